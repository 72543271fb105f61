"""``max_memory``: its spelling, the planner's choices from injected measurements, and that a plan never
changes the loss or gradients (fp32 tolerance as tests/test_engine.py: rtol 1e-5 per parameter's largest
gradient; the plan only changes which rows share a mini-batch, a few fp32 ulps of summation order)."""

from __future__ import annotations

import warnings
from dataclasses import replace

import pytest
import torch
from engine_helpers import (
    assert_grads_close,
    contrastive_flops_loss,
    grads_of,
    make_columns,
    make_encoder,
    plan_inputs,
    small_config,
    uncached_loss,
)

from gradcache_sparton.arguments import CachedSpladeTrainingArguments
from gradcache_sparton.engine import GradCache, GradCacheConfig
from gradcache_sparton.engine.autocast_state import AutocastState
from gradcache_sparton.engine.memory_size import format_bytes, parse_max_memory, size_bytes
from gradcache_sparton.engine.planner import memory_probe
from gradcache_sparton.engine.planner.memory_plan import (
    GRAPH_ROWS,
    MIN_ROWS,
    PLAN_MARGIN,
    SPARSE_DENSITY_HEADROOM,
    ColumnFit,
    Footprint,
    MemoryPlan,
    choose_plan,
)
from gradcache_sparton.engine.planner.memory_probe import (
    _SPARSE_LOSS_ENTRY_BYTES,
    MemoryPlanner,
    _fits_checked_at,
    measure_fits,
)
from gradcache_sparton.engine.settings import checkpointing_on, encoder_facts, resolve_settings
from gradcache_sparton.losses import SpladeLoss, SpladeLossConfig
from gradcache_sparton.losses.sparse import sparse_block_size
from gradcache_sparton.primitives.sparse_reps import SPARSE_BLOCK_MAX_BYTES, SparseReps

RTOL_FP32 = 1e-5  # see the module docstring
GIB, MIB = 2**30, 2**20
ROWS = {"query": 1024, "positive": 1024}


@pytest.fixture
def config(tiny_bert_config):
    return small_config(tiny_bert_config)


def _footprint(resident: int = GIB, records: int = 0) -> Footprint:
    return Footprint(
        allocated=resident,
        grads=0,
        optimizer=0,
        rep_cache=0,
        records=records,
        sparse_rep_cache=0,
        sparse_loss=0,
    )


def _measure(fits: dict[bool, dict[str, ColumnFit]], calls: list[bool]):
    def measure(checkpointing: bool) -> dict[str, ColumnFit]:
        calls.append(checkpointing)
        return fits[checkpointing]

    return measure


def _fits(fixed: float, per_row: float, length: int = 256) -> dict[str, ColumnFit]:
    return {column: ColumnFit(fixed, per_row, length) for column in ROWS}


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("4GiB", "4GiB"),
        (" 512 mib ", "512 mib"),
        ("24GB", "24GB"),
        ("1.5GiB", "1.5GiB"),
        ("AUTO", "auto"),
        ("none", None),
        (None, None),
    ],
)
def test_max_memory_spellings_are_accepted(given, expected) -> None:
    """Sizes with a unit, auto and none (any case) parse to one spelling; sizes keep their own."""
    assert parse_max_memory(given) == expected
    assert GradCacheConfig(max_memory=given).max_memory == expected


def test_sizes_are_bytes_in_their_units() -> None:
    """Binary units are powers of 1024, decimal ones of 1000."""
    assert size_bytes("4GiB") == 4 * GIB
    assert size_bytes("1.5gib") == 3 * GIB // 2
    assert size_bytes("24GB") == 24 * 10**9
    assert size_bytes("512MiB") == 512 * MIB
    assert format_bytes(3.5 * GIB) == "3.50 GiB"


@pytest.mark.parametrize("bad", ["4", "4G", "4 gigabytes", "0GiB", "-1GiB", "GiB", "", 4, 4.0, True])
def test_bad_max_memory_is_one_clear_error(bad) -> None:
    """A number without a unit, an unknown unit, zero or a non-string: a ValueError naming max_memory."""
    with pytest.raises(ValueError, match="max_memory"):
        GradCacheConfig(max_memory=bad)


def test_without_max_memory_the_defaults_are_unchanged(tmp_path) -> None:
    """Unset options take the engine's defaults (32 rows, no graphs) unless max_memory is to plan them; the
    engine's max_memory is off by default, the trainer's auto."""
    config = GradCacheConfig()
    assert (config.mini_batch_size, config.cuda_graphs, config.max_memory) == (None, None, None)
    decided = resolve_settings(config, encoder_facts(torch.nn.Linear(2, 2)))
    assert (decided.mini_batch_size, decided.cuda_graphs, decided.sparse_reps) == (32, False, "false")
    planned = GradCacheConfig(max_memory="4GiB")
    assert (planned.mini_batch_size, planned.cuda_graphs) == (None, None)
    decided = resolve_settings(planned, encoder_facts(torch.nn.Linear(2, 2)))  # before a plan (or off CUDA)
    assert (decided.mini_batch_size, decided.cuda_graphs, decided.planned) == (32, False, False)
    args = CachedSpladeTrainingArguments(output_dir=str(tmp_path), report_to="none", max_memory="none")
    assert args.mini_batch_size is None and args.max_memory is None
    args = CachedSpladeTrainingArguments(output_dir=str(tmp_path), report_to="none")  # the trainer plans
    assert args.max_memory == "auto" and args.mini_batch_size is None
    args = CachedSpladeTrainingArguments(output_dir=str(tmp_path), report_to="none", max_memory="4GiB")
    assert args.mini_batch_size is None and args.grad_cache_config(ROWS).max_memory == "4GiB"
    with pytest.raises(ValueError, match="max_memory"):
        CachedSpladeTrainingArguments(output_dir=str(tmp_path), report_to="none", max_memory="lots")


def test_fit_lies_on_or_above_every_measured_point() -> None:
    """The conservative fit: an exact line is recovered, a noisy one is raised to cover every point."""
    exact = ColumnFit.from_points([(8, 100 + 8 * 10), (16, 100 + 16 * 10), (32, 100 + 32 * 10)], 256)
    assert (exact.fixed, exact.per_row) == pytest.approx((100, 10))
    points = [(8, 190), (16, 250), (32, 430)]
    noisy = ColumnFit.from_points(points, 256)
    assert all(noisy.peak(rows) >= peak - 1e-9 for rows, peak in points)


def test_plan_takes_the_largest_mini_batch_that_fits() -> None:
    """Without explicit settings: the most rows whose predicted peak stays within the budget less its margin."""
    calls: list[bool] = []
    fit = ColumnFit(0.5 * GIB, 40 * MIB, 256)
    plan = choose_plan(
        16 * GIB,
        ROWS,
        _measure({False: {c: fit for c in ROWS}}, calls),
        _footprint(),
        *plan_inputs(dict.fromkeys(ROWS)),
    )
    usable = 16 * GIB * (1 - PLAN_MARGIN)
    size = plan.settings.mini_batch_size["positive"]
    assert GIB + fit.peak(size) <= usable < GIB + fit.peak(size + 1)
    assert (
        plan.predicted_peak <= usable
        and not plan.settings.activation_checkpointing
        and not plan.settings.cuda_graphs
    )
    assert calls == [False]  # checkpointing was never needed


def test_whole_batch_when_it_fits() -> None:
    """A mini-batch never has more rows than its column."""
    plan = choose_plan(
        64 * GIB,
        ROWS,
        _measure({False: _fits(GIB, MIB)}, []),
        _footprint(),
        *plan_inputs(dict.fromkeys(ROWS)),
    )
    assert plan.settings.mini_batch_size == ROWS


def test_checkpointing_when_nothing_fits_without_it() -> None:
    """Under MIN_ROWS rows fitting eagerly: the probe runs again with checkpointing, which the plan turns on."""
    calls: list[bool] = []
    fits = {False: _fits(GIB, 200 * MIB), True: _fits(0.5 * GIB, 10 * MIB)}
    choices = plan_inputs(dict.fromkeys(ROWS), can_checkpoint=True)
    plan = choose_plan(4 * GIB, ROWS, _measure(fits, calls), _footprint(), *choices)
    assert calls == [False, True] and plan.settings.activation_checkpointing
    assert plan.settings.mini_batch_size["positive"] >= MIN_ROWS and plan.predicted_peak <= 4 * GIB * (
        1 - PLAN_MARGIN
    )


def test_too_small_a_budget_is_one_clear_error() -> None:
    """Not even MIN_ROWS rows with checkpointing: a ValueError naming max_memory and what to change."""
    fits = {False: _fits(GIB, 200 * MIB), True: _fits(GIB, 100 * MIB)}
    with pytest.raises(ValueError, match=r"max_memory .* too small"):
        choose_plan(
            2 * GIB,
            ROWS,
            _measure(fits, []),
            _footprint(),
            *plan_inputs(dict.fromkeys(ROWS), can_checkpoint=True),
        )


def test_explicit_settings_are_kept() -> None:
    """An explicit mini_batch_size, cuda_graphs=False or reuse_argmax=True is what the plan's settings run."""
    fits = {False: _fits(0.5 * GIB, 40 * MIB)}
    explicit = plan_inputs(
        {"query": 8, "positive": None}, cuda_graphs=False, reuse_argmax=True, graphs_possible=True
    )
    plan = choose_plan(4 * GIB, ROWS, _measure(fits, []), _footprint(), *explicit)
    settings = plan.settings
    assert (
        settings.mini_batch_size["query"] == 8 and not settings.cuda_graphs and settings.reuse_argmax is True
    )
    assert settings.planned and set(settings.mini_batch_size) == set(ROWS)


def test_cuda_graphs_where_eager_mini_batches_are_small() -> None:
    """Graphs at GRAPH_ROWS when eager mini-batches would be small; not where large ones fit."""
    choices = plan_inputs(dict.fromkeys(ROWS), graphs_possible=True)
    small = choose_plan(
        4 * GIB, ROWS, _measure({False: _fits(0.2 * GIB, 40 * MIB)}, []), _footprint(), *choices
    )
    assert small.settings.cuda_graphs and set(small.settings.mini_batch_size.values()) == {GRAPH_ROWS}
    settings = small.settings
    assert (
        settings.cuda_graphs and settings.reuse_argmax is False and settings.mini_batch_length_multiple == 32
    )
    large = choose_plan(
        24 * GIB, ROWS, _measure({False: _fits(0.5 * GIB, 40 * MIB)}, []), _footprint(), *choices
    )
    assert not large.settings.cuda_graphs and min(large.settings.mini_batch_size.values()) > GRAPH_ROWS


def test_graphs_pay_for_their_recording_stream() -> None:
    """The recording stream's workspace (Footprint.graphs) counts against graphed plans only: a little
    more than the graphed plan leaves free shrinks its mini-batches, more than the budget leaves graphs out
    and gives the eager plan unchanged."""
    choices = plan_inputs(dict.fromkeys(ROWS), graphs_possible=True)
    fits = _measure({False: _fits(0.2 * GIB, 40 * MIB)}, [])
    usable = 4 * GIB * (1 - PLAN_MARGIN)
    plain = choose_plan(4 * GIB, ROWS, fits, _footprint(), *choices)
    assert plain.settings.cuda_graphs and set(plain.settings.mini_batch_size.values()) == {GRAPH_ROWS}
    tighter = replace(_footprint(), graphs=int(usable - plain.predicted_peak) + MIB)
    shrunk = choose_plan(4 * GIB, ROWS, fits, tighter, *choices)
    assert shrunk.settings.cuda_graphs and max(shrunk.settings.mini_batch_size.values()) < GRAPH_ROWS
    assert shrunk.predicted_peak <= usable
    costly = choose_plan(4 * GIB, ROWS, fits, replace(_footprint(), graphs=int(usable)), *choices)
    eager = choose_plan(4 * GIB, ROWS, fits, _footprint(), *plan_inputs(dict.fromkeys(ROWS)))
    assert (
        not costly.settings.cuda_graphs and costly.settings.mini_batch_size == eager.settings.mini_batch_size
    )


def test_reuse_argmax_off_where_its_records_crowd_out_rows() -> None:
    """reuse_argmax (left to its default) stays on when its records cost few rows, turns off otherwise."""
    choices = plan_inputs(dict.fromkeys(ROWS))
    measure = _measure({False: _fits(0.5 * GIB, 40 * MIB)}, [])
    cheap = choose_plan(16 * GIB, ROWS, measure, _footprint(records=10 * MIB), *choices)
    costly = choose_plan(16 * GIB, ROWS, measure, _footprint(records=4 * GIB), *choices)
    assert cheap.settings.reuse_argmax is True and costly.settings.reuse_argmax is False


def test_plan_never_changes_the_loss_or_gradients(config) -> None:
    """A cached step under a plan's configuration equals the uncached step (within RTOL_FP32)."""
    rows = {"query": 32, "positive": 32, "negative": 32}
    fits = {column: ColumnFit(0.0, 45 * MIB, 16) for column in rows}
    plan = choose_plan(GIB, rows, lambda on: fits, _footprint(0), *plan_inputs(dict.fromkeys(rows)))
    assert plan.settings.mini_batch_size["query"] == 21  # floor(0.95 GiB / 45 MiB): a real split
    planned = _planned_config(plan)

    encoder = make_encoder(config)
    columns = make_columns(32, 3)
    ref_loss, _ = uncached_loss(encoder, columns, contrastive_flops_loss)
    ref_loss.backward()
    ref_grads = grads_of(encoder)
    encoder.zero_grad()
    with warnings.catch_warnings():
        loss, _ = GradCache(encoder, planned).step(columns, contrastive_flops_loss)
    torch.testing.assert_close(loss, ref_loss.detach(), rtol=RTOL_FP32, atol=0)
    assert_grads_close(grads_of(encoder), ref_grads, rtol=RTOL_FP32)


def test_probe_leaves_gradients_and_rng_as_they_were(config) -> None:
    """measure_fits (here with a peak reading injected) puts back .grad values, None grads and the RNG."""
    encoder = make_encoder(config, train=True)  # dropout draws from the RNG
    columns = make_columns(8, 2)
    encoder.mlm.cls.predictions.transform.dense.weight.grad = torch.ones_like(
        encoder.mlm.cls.predictions.transform.dense.weight
    )
    before = {name: None if p.grad is None else p.grad.clone() for name, p in encoder.named_parameters()}
    rng = torch.get_rng_state()
    trained = [p for p in encoder.parameters() if p.requires_grad]

    def rows_as_bytes(run, device):
        rep = run()
        return 1000 + 10 * len(rep), rep

    fits = measure_fits(
        encoder, columns, AutocastState.capture(), trained, torch.device("cpu"), (2, 4), rows_as_bytes
    )
    assert fits["query"].fixed == pytest.approx(1000) and fits["query"].per_row == pytest.approx(10)
    assert fits["query"].length == 7 and fits["query"].width == encoder.mlm.config.vocab_size
    assert torch.equal(torch.get_rng_state(), rng)
    for name, p in encoder.named_parameters():
        assert (p.grad is None) == (before[name] is None), name
        if p.grad is not None:
            assert torch.equal(p.grad, before[name]), name


def test_a_plan_beyond_the_probe_is_measured_at_its_own_size(config) -> None:
    """A planned mini-batch larger than the probe's rows is measured at its size: a peak above the line
    (here quadratic growth the small probe cannot see) comes back as a fit through that point, which then
    predicts it; a peak on or below the line leaves the fits as they were (None)."""
    encoder = make_encoder(config)
    columns = make_columns(64, 2)
    trained = [p for p in encoder.parameters() if p.requires_grad]
    line = {c: ColumnFit.from_points([(8, 1080), (16, 1160), (32, 1320)], 7) for c in columns}
    rows = {c: 64 for c in columns}
    plan = choose_plan(
        10**9, rows, lambda on: line, _footprint(0), *plan_inputs({"query": 64, "positive": 8})
    )

    def peak(curve):
        def peak_bytes(run, device):
            rep = run()
            return curve(len(rep)), rep

        return peak_bytes

    args = (plan, columns, AutocastState.capture(), trained, torch.device("cpu"), encoder)
    quadratic = _fits_checked_at(*args, peak(lambda r: 1000 + 10 * r + r * r))
    assert quadratic is not None and quadratic["query"].peak(64) >= 1000 + 640 + 64 * 64
    assert quadratic["positive"] == line["positive"]  # 8 rows: inside the probe, not measured again
    assert _fits_checked_at(*args, peak(lambda r: 1000 + 10 * r)) is None


def test_cpu_ignores_a_size_with_one_warning(config) -> None:
    """On a CPU a size is ignored with one warning (the defaults run), auto quietly."""
    encoder = make_encoder(config)
    engine = GradCache(encoder, max_memory="4GiB")
    with pytest.warns(UserWarning, match="max_memory='4GiB' is ignored on cpu"):
        engine.step(make_columns(4, 2), contrastive_flops_loss)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        engine.step(make_columns(4, 2), contrastive_flops_loss)  # once only
        GradCache(encoder, max_memory="auto").step(make_columns(4, 2), contrastive_flops_loss)
    assert engine.memory_plan is None and engine.settings.mini_batch_size == 32


def test_data_parallel_refuses_a_size(config) -> None:
    """Under data parallelism a size is refused (ranks must agree on one plan); auto is ignored."""
    with pytest.raises(ValueError, match="max_memory='4GiB' needs no data parallelism"):
        encoder = make_encoder(config)
        MemoryPlanner(GradCacheConfig(max_memory="4GiB"), encoder, encoder_facts(encoder, data_parallel=True))
    encoder = make_encoder(config)
    planner = MemoryPlanner(
        GradCacheConfig(max_memory="auto"), encoder, encoder_facts(encoder, data_parallel=True)
    )
    assert not planner.needs_plan(make_columns(4, 2))


@pytest.mark.gpu
def test_real_probe_keeps_the_measured_peak_within_the_budget(tiny_bert_config) -> None:
    """On a GPU: a budget the probe's own fit puts at about 64 of 256 rows splits the batch, the planned
    step's measured peak stays under it, and the gradients are those of the plan's options run without a
    plan (the probe put back what it accumulated; RTOL_FP32: CUDA's embedding backward sums atomically)."""
    config = small_config(tiny_bert_config, dropout=0.0)
    columns = {k: {n: t.cuda() for n, t in f.items()} for k, f in make_columns(256, 2).items()}
    encoder = make_encoder(config, train=True).cuda()
    # The process's one-time CUDA allocations (cuBLAS workspaces) first: in the first probe point they made a
    # fixed part of 82 MiB, which put the budget below at a whole batch of this tiny model (2026-11-29, H200).
    encoder(**columns["query"]).sum().backward()
    encoder.zero_grad(set_to_none=True)
    measuring = GradCache(encoder, max_memory="auto")
    measuring.encode(columns)  # plans (autograd on), then Step (1) only
    first = measuring.memory_plan
    assert first is not None and first.settings.mini_batch_size == {"query": 256, "positive": 256}
    budget = int((first.resident + max(fit.peak(64) for fit in first.fits.values())) / (1 - PLAN_MARGIN))
    engine = GradCache(encoder, max_memory=f"{budget}B")
    engine.step(columns, contrastive_flops_loss)
    plan = engine.memory_plan
    assert (
        plan is not None
        and plan.predicted_peak <= budget
        and max(plan.settings.mini_batch_size.values()) < 256
    )
    planned_grads = grads_of(encoder)
    encoder.zero_grad(set_to_none=True)
    torch.cuda.reset_peak_memory_stats()
    engine.step(columns, contrastive_flops_loss)  # the plan reused
    assert torch.cuda.max_memory_allocated() <= budget, (plan.describe(), torch.cuda.max_memory_allocated())
    encoder.zero_grad(set_to_none=True)
    GradCache(encoder, _planned_config(plan)).step(columns, contrastive_flops_loss)
    assert_grads_close(grads_of(encoder), planned_grads, rtol=RTOL_FP32)


def test_explicit_cuda_graphs_plans_rows_under_graphs() -> None:
    """cuda_graphs=True given: the plan keeps graphs and sizes the mini-batches for their pool."""
    choices = plan_inputs(dict.fromkeys(ROWS), cuda_graphs=True, graphs_possible=True)
    plan = choose_plan(
        24 * GIB, ROWS, _measure({False: _fits(0.5 * GIB, 40 * MIB)}, []), _footprint(), *choices
    )
    assert plan.settings.cuda_graphs and plan.settings.mini_batch_size["query"] > GRAPH_ROWS
    assert plan.predicted_peak <= 24 * GIB * (1 - PLAN_MARGIN)


def test_the_loss_over_the_whole_batch_counts_too() -> None:
    """A batch whose dense reps alone (Step (2)) exceed the budget fits no plan with dense reps, whatever
    the mini-batch; the refusal then suggests sparse reps."""
    footprint = Footprint(
        allocated=GIB, grads=0, optimizer=0, rep_cache=2 * GIB, records=0, sparse_rep_cache=0, sparse_loss=0
    )
    assert footprint.loss_peak(sparse=False) == 4 * GIB
    fits = {False: _fits(0.0, MIB), True: _fits(0.0, MIB)}
    with pytest.raises(ValueError, match=r"too small.*keep the reps sparse \(sparse_reps true\)"):
        choose_plan(
            4 * GIB,
            ROWS,
            _measure(fits, []),
            footprint,
            *plan_inputs(dict.fromkeys(ROWS), can_checkpoint=True, sparse_reps="false"),
        )


# The benchmark's refused case (docs/benchmarks.md, "Only a memory budget", H200): a 6-layer BERT-base-width
# model, 1,024 rows per column, V 30,522, reps ~2% non-zero, 2 GiB: "16 rows per mini-batch need a predicted
# 2.04 GiB (resident 1.57 GiB)", 0.47 GiB of which the dense reps and their gradients.
BERT_V, BERT_DENSITY = 30_522, 0.02
BERT_FIT = ColumnFit(0.22 * GIB, 16 * MIB, 256, width=BERT_V, rep_bytes=4, density=BERT_DENSITY)
BERT_DENSE_REPS = 2 * 2 * 1024 * BERT_V * 4  # two columns, reps and their gradients, fp32 [1,024, V] each


def _bert_footprint(monkeypatch, rows: dict[str, int] = ROWS) -> Footprint:
    """The probe's footprint of the benchmark's batch (weights, gradients and optimizer state allocated)."""
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: int(1.57 * GIB) - BERT_DENSE_REPS)
    monkeypatch.setattr(memory_probe, "_stream_workspace_bytes", lambda device: 0)
    columns = {column: {"input_ids": torch.zeros(size, 1, dtype=torch.long)} for column, size in rows.items()}
    fits = dict.fromkeys(rows, BERT_FIT)
    return memory_probe._footprint(columns, fits, [], torch.device("cpu"), first=False)


def test_the_refused_2gib_case_plans_sparse_reps(monkeypatch) -> None:
    """The benchmark's 2 GiB case: dense reps are refused with the numbers it printed; left unset, the plan
    keeps the reps sparse, which fits at least MIN_ROWS rows, and says so."""
    footprint = _bert_footprint(monkeypatch)
    assert footprint.rep_cache == BERT_DENSE_REPS
    assert footprint.resident(records=False, sparse=False) == int(1.57 * GIB)
    assert footprint.sparse_rep_cache < 64 * MIB  # ~2% of the entries (twice that planned), 12 bytes each
    measure = _measure({False: dict.fromkeys(ROWS, BERT_FIT)}, [])
    dense = plan_inputs(dict.fromkeys(ROWS), graphs_possible=True, sparse_reps="false")
    with pytest.raises(
        ValueError, match=r"16 rows per mini-batch need a predicted 2.04 GiB \(resident 1.57 GiB"
    ):
        choose_plan(2 * GIB, ROWS, measure, footprint, *dense)

    plan = choose_plan(
        2 * GIB, ROWS, measure, footprint, *plan_inputs(dict.fromkeys(ROWS), graphs_possible=True)
    )
    assert plan.settings.sparse_reps == "true" and not plan.settings.activation_checkpointing
    assert min(plan.settings.mini_batch_size.values()) >= MIN_ROWS and plan.predicted_peak <= 2 * GIB * (
        1 - PLAN_MARGIN
    )
    assert plan.predicted_peak >= footprint.loss_peak(sparse=True)  # the sparse loss is counted
    assert "reps sparse" in plan.describe() and "sparse reps: with the dense reps" in plan.reason
    assert plan.log_values()["memory_plan_sparse_reps"] == 1.0


def test_dense_reps_stay_where_they_fit(monkeypatch) -> None:
    """The same batch in 4 GiB: dense reps fit (and are the faster cache), so the plan keeps them dense."""
    footprint = _bert_footprint(monkeypatch)
    measure = _measure({False: dict.fromkeys(ROWS, BERT_FIT)}, [])
    plan = choose_plan(
        4 * GIB, ROWS, measure, footprint, *plan_inputs(dict.fromkeys(ROWS), graphs_possible=True)
    )
    assert plan.settings.sparse_reps == "false" and "reps dense" in plan.describe()
    assert plan.resident >= footprint.rep_cache


@pytest.mark.parametrize("given", ["true", "false", "auto"])
def test_explicit_sparse_reps_are_kept(monkeypatch, given) -> None:
    """An explicit sparse_reps runs as given at 4 GiB (true counted sparse; false and auto, which may stay
    dense, counted dense); at 2 GiB true fits and false and auto are refused, never switched to sparse."""
    footprint = _bert_footprint(monkeypatch)
    measure = _measure({False: dict.fromkeys(ROWS, BERT_FIT)}, [])
    choices = plan_inputs(dict.fromkeys(ROWS), sparse_reps=given)
    plan = choose_plan(4 * GIB, ROWS, measure, footprint, *choices)
    assert plan.settings.sparse_reps == given
    assert plan.resident == footprint.resident(records=plan.settings.reuse_argmax, sparse=given == "true")
    if given == "true":
        assert choose_plan(2 * GIB, ROWS, measure, footprint, *choices).settings.sparse_reps == "true"
    else:
        with pytest.raises(ValueError, match="too small"):
            choose_plan(2 * GIB, ROWS, measure, footprint, *choices)


def test_sparse_reps_where_the_dense_loss_does_not_fit() -> None:
    """Mini-batches that fit beside dense reps, but a loss over the whole dense batch beyond the budget:
    the plan keeps the reps sparse and names the loss as the reason."""
    footprint = Footprint(
        allocated=GIB, grads=0, optimizer=0, rep_cache=2 * GIB, records=0, sparse_rep_cache=64 * MIB,
        sparse_loss=512 * MIB,
    )  # fmt: skip
    plan = choose_plan(
        4 * GIB, ROWS, _measure({False: _fits(0.0, MIB)}, []), footprint, *plan_inputs(dict.fromkeys(ROWS))
    )
    assert (
        plan.settings.sparse_reps == "true"
        and "the loss over the whole batch would peak at 4.00 GiB" in plan.reason
    )


def test_sparse_reps_before_activation_checkpointing() -> None:
    """Where dense reps leave under MIN_ROWS rows and sparse ones do not, the plan keeps them sparse
    without measuring or turning on checkpointing (the dearer of the two)."""
    calls: list[bool] = []
    footprint = Footprint(
        allocated=GIB, grads=0, optimizer=0, rep_cache=2 * GIB, records=0, sparse_rep_cache=64 * MIB,
        sparse_loss=512 * MIB,
    )  # fmt: skip
    fits = {False: _fits(0.5 * GIB, 40 * MIB), True: _fits(0.1 * GIB, 5 * MIB)}
    choices = plan_inputs(dict.fromkeys(ROWS), can_checkpoint=True)
    plan = choose_plan(4 * GIB, ROWS, _measure(fits, calls), footprint, *choices)
    assert (
        calls == [False]
        and plan.settings.sparse_reps == "true"
        and not plan.settings.activation_checkpointing
    )
    assert min(plan.settings.mini_batch_size.values()) >= MIN_ROWS


def test_sparse_loss_estimate_covers_its_densified_blocks(monkeypatch) -> None:
    """The loss over sparse reps is counted with its four densified fp32 [block, V] buffers at the block
    the loss uses (whole columns of 1,024 rows; sparse_block_size rows of a 65,536-row batch), each at most
    SPARSE_BLOCK_MAX_BYTES, beside its copies per (planned) non-zero."""
    for rows in (1024, 65_536):
        footprint = _bert_footprint(monkeypatch, dict.fromkeys(ROWS, rows))
        block = min(rows, sparse_block_size(BERT_V))
        planned_nnz = len(ROWS) * rows * BERT_V * BERT_DENSITY * SPARSE_DENSITY_HEADROOM
        assert footprint.sparse_loss >= 4 * block * BERT_V * 4
        assert (
            footprint.sparse_loss <= 4 * SPARSE_BLOCK_MAX_BYTES + _SPARSE_LOSS_ENTRY_BYTES * planned_nnz + 1
        )


def _sparse_planning_on_cpu(config, monkeypatch):
    """The probe path on a CPU, its peak readings and allocator injected: an encoder factory (reps ~3%
    non-zero, as tests/test_sparse_reps_training.py), 32-row columns, a budget that leaves dense reps under
    MIN_ROWS rows per mini-batch and sparse ones 20, and the footprint it was sized from."""
    monkeypatch.setattr(MemoryPlanner, "needs_plan", lambda self, columns: self.plan is None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 0)
    monkeypatch.setattr(memory_probe, "_stream_workspace_bytes", lambda device: 0)
    columns = make_columns(32, 3)

    def encoder_3pct():
        encoder = make_encoder(config)
        with torch.no_grad():
            encoder.mlm.cls.predictions.bias -= 0.3
        return encoder

    encoder = encoder_3pct()
    trained = [p for p in encoder.parameters() if p.requires_grad]
    per_row = [1]  # peak bytes per mini-batch row, as the probe will read them

    def peak_bytes(run, device):
        rep = run()
        return per_row[0] * len(rep), rep

    cpu = torch.device("cpu")
    probe = measure_fits(encoder, columns, AutocastState.capture(), trained, cpu, (8,), peak_bytes)
    footprint = memory_probe._footprint(columns, probe, trained, cpu, first=True)
    per_row[0] = footprint.rep_cache // 8  # dense reps cost 8 rows' activations
    budget = (footprint.resident(records=True, sparse=True) + 20.5 * per_row[0]) / (1 - PLAN_MARGIN)
    monkeypatch.setattr(memory_probe, "_cuda_peak_bytes", peak_bytes)
    return encoder_3pct, columns, int(budget), footprint


def test_planned_sparse_reps_run_on_that_step_and_change_nothing(config, monkeypatch) -> None:
    """A budget that leaves dense reps under MIN_ROWS rows but sparse ones 20 plans sparse reps, which that
    very step runs (the loss receives SparseReps) with the uncached loss and gradients (RTOL_FP32, as
    tests/test_sparse_reps_training.py); reps that then outgrow the non-zeros it counted have the next step
    planned again, at their density; a budget that fits dense reps keeps them dense."""
    encoder_3pct, columns, budget, footprint = _sparse_planning_on_cpu(config, monkeypatch)
    layouts: list[set[type]] = []

    def loss_fn(reps, **loss_kwargs):
        layouts.append({type(rep) for rep in reps.values()})
        return SpladeLoss(SpladeLossConfig())(reps, **loss_kwargs)

    reference = encoder_3pct()
    ref_loss, _ = uncached_loss(reference, columns, loss_fn)
    ref_loss.backward()
    layouts.clear()
    encoder = encoder_3pct()
    engine = GradCache(encoder, max_memory=f"{budget}B", cuda_graphs=False)
    loss, _ = engine.step(columns, loss_fn)
    plan = engine.memory_plan
    assert plan is not None and plan.settings.sparse_reps == "true" and engine.settings.sparse_reps == "true"
    assert set(plan.settings.mini_batch_size.values()) == {20} and layouts == [{SparseReps}]
    torch.testing.assert_close(loss, ref_loss.detach(), rtol=RTOL_FP32, atol=0)
    assert_grads_close(grads_of(encoder), grads_of(reference), rtol=RTOL_FP32)

    with torch.no_grad():
        encoder.mlm.cls.predictions.bias += 0.3  # reps ~93% non-zero: beyond the plan's count
    engine.step(columns, loss_fn)
    assert engine.memory_plan is None  # planned again on the next step, at the reps' new density
    engine.step(columns, loss_fn)
    assert engine.memory_plan is not None
    assert min(fit.density for fit in engine.memory_plan.fits.values()) > 0.5

    layouts.clear()
    roomy = GradCache(encoder_3pct(), max_memory=f"{budget + footprint.rep_cache * 2}B", cuda_graphs=False)
    roomy.step(columns, loss_fn)
    assert roomy.memory_plan is not None and roomy.memory_plan.settings.sparse_reps == "false"
    assert roomy.settings.sparse_reps == "false" and layouts == [{torch.Tensor}]


def test_a_dense_only_loss_on_planned_sparse_reps_is_told_why(config, monkeypatch) -> None:
    """A loss that takes dense reps only, handed sparse reps the plan chose, fails with its own error and a
    note naming the plan and sparse_reps='false'; given sparse_reps='false' the same budget is refused."""
    encoder_3pct, columns, budget, _ = _sparse_planning_on_cpu(config, monkeypatch)
    with pytest.raises(TypeError, match="SparseReps") as raised:
        GradCache(encoder_3pct(), max_memory=f"{budget}B", cuda_graphs=False).step(
            columns, contrastive_flops_loss
        )
    assert any("sparse_reps='false'" in note for note in raised.value.__notes__)
    dense = GradCache(encoder_3pct(), max_memory=f"{budget}B", cuda_graphs=False, sparse_reps="false")
    with pytest.raises(ValueError, match="too small"):
        dense.step(columns, contrastive_flops_loss)


def test_checkpointing_the_plan_turns_on_is_logged_and_stays(config, monkeypatch, caplog) -> None:
    """Where only activation checkpointing fits MIN_ROWS rows, the plan turns it on in the user's model, says
    so in a log line naming the model, and leaves it on; engine.settings reports it."""
    encoder_3pct, columns, _, footprint = _sparse_planning_on_cpu(config, monkeypatch)
    encoder = encoder_3pct()
    small = footprint.rep_cache // 8  # peak bytes per row with checkpointing; ten times that without

    def peak_bytes(run, device):
        rep = run()
        return (small if checkpointing_on(encoder) else 10 * small) * len(rep), rep

    monkeypatch.setattr(memory_probe, "_cuda_peak_bytes", peak_bytes)
    budget = int((footprint.resident(records=True, sparse=False) + 20.5 * small) / (1 - PLAN_MARGIN))
    engine = GradCache(encoder, max_memory=f"{budget}B", cuda_graphs=False, sparse_reps="false")
    assert not checkpointing_on(encoder) and not engine.settings.activation_checkpointing
    with caplog.at_level("INFO", logger="gradcache_sparton.engine.planner.memory_plan"):
        engine.step(columns, contrastive_flops_loss)
    assert engine.memory_plan is not None and engine.memory_plan.settings.activation_checkpointing
    assert engine.settings.activation_checkpointing and checkpointing_on(encoder)
    turned_on = [
        r.getMessage() for r in caplog.records if "activation checkpointing turned on" in r.getMessage()
    ]
    assert len(turned_on) == 1 and type(encoder.mlm).__name__ in turned_on[0], caplog.text


def _planned_config(plan: MemoryPlan) -> GradCacheConfig:
    """The options ``plan`` chose, given explicitly (no max_memory: run as planned, without planning)."""
    return GradCacheConfig(
        mini_batch_size=dict(plan.settings.mini_batch_size),
        cuda_graphs=plan.settings.cuda_graphs,
        reuse_argmax=plan.settings.reuse_argmax,
        sparse_reps=plan.settings.sparse_reps,
    )
