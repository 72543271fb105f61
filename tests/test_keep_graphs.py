"""``keep_graphs``: mini-batches that keep their Step (1) graph and are backpropagated, not re-encoded, in Step (3).

The invariant is the engine's: the loss and every parameter gradient equal one uncached step over the whole
batch (fp32, rtol 1e-5 of each parameter's largest gradient, as tests/test_engine.py argues), whether every,
some or no mini-batch keeps its graph; with dropout, the same draws as the replayed mini-batches. And the
planner keeps only what fits beside the rest of the step.
"""

from __future__ import annotations

import socket
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from engine_helpers import (
    RecordingEncoder,
    assert_grads_close,
    contrastive_flops_loss,
    grads_of,
    make_columns,
    make_encoder,
    per_mini_batch_loss,
    plan_inputs,
    small_config,
    uncached_reference,
)
from torch.nn.parallel import DistributedDataParallel
from trainer_helpers import trainer_args, trainer_model, trainer_rows

from gradcache_sparton.engine import CachedLoss, GradCache, GradCacheConfig
from gradcache_sparton.engine.planner.memory_plan import (
    KEEP_MAX_SPLIT,
    MIN_ROWS,
    PLAN_MARGIN,
    ColumnFit,
    Footprint,
    choose_kept_graphs,
    choose_plan,
)
from gradcache_sparton.engine.settings import encoder_facts, resolve_settings
from gradcache_sparton.losses import SpladeLoss, SpladeLossConfig
from gradcache_sparton.modeling import SpladeEncoder
from gradcache_sparton.primitives.sparse_reps import SparseReps
from gradcache_sparton.trainer import CachedSpladeTrainer

RTOL_FP32 = 1e-5  # see the module docstring
BATCH = 8
GIB, MIB = 2**30, 2**20


@pytest.fixture
def config(tiny_bert_config):
    return small_config(tiny_bert_config)


def _dense_loss(reps):
    """contrastive_flops_loss on dense reps, sparse ones densified (differentiably, through their weights)."""
    return contrastive_flops_loss(
        {c: r.to_dense() if isinstance(r, SparseReps) else r for c, r in reps.items()}
    )


def _engine(encoder, keep, **options) -> GradCache:
    """An engine whose settings keep the graphs ``keep`` says (True, False, or a count per column)."""
    engine = GradCache(encoder, keep_graphs=keep is True, **options)
    if isinstance(keep, dict):  # what a max_memory plan decides, set as its settings would be
        engine.settings = replace(engine.settings, keep_graphs=keep)
    return engine


@pytest.mark.parametrize("sparse_reps", ["false", "true"])
@pytest.mark.parametrize(
    "keep",
    [True, {"query": 1, "positive": 2, "negative": 0}, {"query": 3, "negative": 1}],
    ids=["every", "some", "other-some"],
)
@pytest.mark.parametrize("mini_batch_size", [1, 3, 20], ids=["mb1", "mb3", "whole"])
def test_kept_graphs_give_the_uncached_step(config, keep, mini_batch_size: int, sparse_reps: str) -> None:
    """Every, some or one column's mini-batches kept: the loss and every gradient of the uncached step."""
    encoder = make_encoder(config)
    columns = make_columns(BATCH, 3)
    ref_loss, ref_grads = uncached_reference(encoder, columns, contrastive_flops_loss)

    engine = _engine(encoder, keep, mini_batch_size=mini_batch_size, sparse_reps=sparse_reps)
    loss, _ = engine.step(columns, _dense_loss)

    torch.testing.assert_close(loss, ref_loss, rtol=RTOL_FP32, atol=0)
    assert_grads_close(grads_of(encoder), ref_grads, rtol=RTOL_FP32)


@pytest.mark.parametrize(
    "options",
    [{"reuse_argmax": True}, {"mini_batch_tokens": 25}, {"reuse_argmax": True, "sparse_reps": "true"}],
    ids=["reuse-argmax", "tok25", "reuse-argmax-sparse"],
)
def test_some_kept_graphs_beside_the_sparton_heads_records(config, options) -> None:
    """A SpladeEncoder (Sparton head) with some mini-batches kept, beside reuse_argmax's records (the others
    rebuilt from them), length-grouped mini-batches or sparse reps: the SpladeLoss and gradients of the
    uncached step."""
    torch.manual_seed(0)
    encoder = SpladeEncoder.from_config(small_config(config, dropout=0.0)).train()
    loss_fn = SpladeLoss(SpladeLossConfig(query_reg_weight=0.3, doc_reg_weight=0.2))
    columns = make_columns(BATCH, 3)
    ref_loss, ref_grads = uncached_reference(encoder, columns, loss_fn)

    engine = _engine(encoder, {"query": 1, "negative": 2}, mini_batch_size=3, **options)
    loss, _ = engine.step(columns, loss_fn)

    torch.testing.assert_close(loss, ref_loss, rtol=RTOL_FP32, atol=0)
    assert_grads_close(grads_of(encoder), ref_grads, rtol=RTOL_FP32)


def test_kept_mini_batches_run_once_after_the_others(config) -> None:
    """A kept mini-batch runs one forward, with a graph, after every other Step (1) forward; Step (3) re-encodes
    only the others: 6 graph-less forwards, then the 3 kept, then 6 replays (3 columns of 3 mini-batches)."""
    encoder = RecordingEncoder(make_encoder(config))
    engine = _engine(encoder, {"query": 1, "positive": 2}, mini_batch_size=3)
    engine.step(make_columns(BATCH, 3), contrastive_flops_loss)
    with_graph = [grad for grad, _, _ in encoder.calls]
    assert with_graph == [False] * 6 + [True] * 3 + [True] * 6


def test_kept_graphs_draw_the_dropout_of_the_replayed_step(config) -> None:
    """Dropout on, every graph kept: the reference's draws (each mini-batch in order, with a graph), the
    replayed engine's gradients bit for bit, and the global RNG stream left where the replayed step leaves it."""
    columns = make_columns(BATCH, 3)
    encoder = make_encoder(config, train=True)
    torch.manual_seed(99)
    ref_loss, _ = per_mini_batch_loss(encoder, columns, contrastive_flops_loss, 3)
    ref_loss.backward()
    ref_grads = grads_of(encoder)
    encoder.zero_grad()

    runs = {}
    for keep in (False, True):
        torch.manual_seed(99)
        loss, _ = GradCache(encoder, mini_batch_size=3, keep_graphs=keep).step(
            columns, contrastive_flops_loss
        )
        runs[keep] = (loss, grads_of(encoder), torch.get_rng_state())
        encoder.zero_grad()

    loss, grads, rng = runs[True]
    torch.testing.assert_close(loss, ref_loss.detach(), rtol=RTOL_FP32, atol=0)
    assert_grads_close(grads, ref_grads, rtol=RTOL_FP32)
    replayed_loss, replayed_grads, replayed_rng = runs[False]
    assert torch.equal(loss, replayed_loss) and torch.equal(rng, replayed_rng)
    assert all(torch.equal(grads[name], replayed_grads[name]) for name in grads)


def test_cached_loss_keeps_graphs_only_to_train(config) -> None:
    """CachedLoss with keep_graphs: backward gives the uncached gradients; an evaluation (autograd off) keeps
    no graph, and nor does an encoder whose forward makes none (all frozen: Step (3) refuses it, as replayed)."""
    encoder = make_encoder(config)
    columns = make_columns(BATCH, 2)
    ref_loss, ref_grads = uncached_reference(encoder, columns, contrastive_flops_loss)

    cached = CachedLoss(encoder, contrastive_flops_loss, mini_batch_size=3, keep_graphs=True)
    loss = cached(columns)
    loss.backward()
    torch.testing.assert_close(loss.detach(), ref_loss, rtol=RTOL_FP32, atol=0)
    assert_grads_close(grads_of(encoder), ref_grads, rtol=RTOL_FP32)

    with torch.no_grad():
        _, evaluated = cached.engine.encode(columns)
    assert all(mb.graph is None for mbs in evaluated.mini_batches.values() for mb in mbs)
    _, trained = cached.engine.encode(columns)
    assert all(mb.graph is not None and mb.graph.requires_grad for mb in trained.mini_batches["query"])
    encoder.requires_grad_(False)
    _, frozen = cached.engine.encode(columns)
    assert all(mb.graph is None for mbs in frozen.mini_batches.values() for mb in mbs)


def test_trainer_with_kept_graphs_leaves_the_same_parameters(tokenizer, tmp_path) -> None:
    """CachedSpladeTrainer with --keep_graphs true (dropout on, 2 SGD steps of 2 accumulation steps): the
    parameters are bitwise those of the trainer replaying every mini-batch."""
    results = []
    for keep in (False, True):
        model = trainer_model(tokenizer, dropout=0.1)
        args = trainer_args(tmp_path / str(keep), per_device_batch=4, keep_graphs=keep)
        trainer = CachedSpladeTrainer(model, args, train_dataset=trainer_rows(), processing_class=tokenizer)
        trainer.train()
        assert trainer.engine_settings is not None and trainer.engine_settings.keep_graphs is keep
        results.append({name: p.detach().clone() for name, p in model.named_parameters()})
    assert all(torch.equal(results[1][name], results[0][name]) for name in results[0])


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        ({"keep_graphs": "yes"}, TypeError, "keep_graphs must be a bool or None"),
        ({"keep_graphs": True, "cuda_graphs": True}, ValueError, "cuda_graphs=True needs .*keep_graphs off"),
    ],
)
def test_bad_keep_graphs_is_one_clear_error(options, error, match) -> None:
    """A non-bool, or kept graphs asked for with CUDA graphs: one error naming keep_graphs."""
    with pytest.raises(error, match=match):
        GradCacheConfig(**options)


def test_keep_graphs_is_refused_under_data_parallelism(config) -> None:
    """DDP decides at each forward whether its backward synchronises: keep_graphs=True is refused, naming it."""
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        ddp = DistributedDataParallel(make_encoder(config))
        with pytest.raises(ValueError, match="keep_graphs=True needs no data parallelism"):
            GradCache(ddp, keep_graphs=True)
        assert not GradCache(ddp).settings.keep_graphs  # left unset: off
    finally:
        dist.destroy_process_group()


def test_settings_take_the_plans_kept_graphs_but_not_under_cuda_graphs() -> None:
    """Left unset, keep_graphs is the plan's count per column (off without a plan); CUDA graphs turn it off."""
    facts = encoder_facts(torch.nn.Linear(2, 2))
    assert resolve_settings(GradCacheConfig(), facts).kept_mini_batches("query", 3) == 0
    assert resolve_settings(GradCacheConfig(keep_graphs=True), facts).kept_mini_batches("query", 3) == 3
    decided = _plan(64 * GIB).settings
    assert decided.keep_graphs == {"query": 1, "positive": 1}
    assert decided.kept_mini_batches("query", 5) == 1
    graphed = replace(decided, cuda_graphs=True)
    assert graphed.keep_graphs is False and graphed.kept_mini_batches("query", 5) == 0


ROWS = {"query": 1024, "positive": 1024}
QUERY_FIT, PASSAGE_FIT = ColumnFit(0.25 * GIB, 10 * MIB, 64), ColumnFit(0.25 * GIB, 40 * MIB, 256)


def _footprint() -> Footprint:
    return Footprint(
        allocated=GIB, grads=0, optimizer=0, rep_cache=0, records=0, sparse_rep_cache=0, sparse_loss=0
    )


def _plan(budget: int, **choices: object):
    fits = {"query": QUERY_FIT, "positive": PASSAGE_FIT}
    return choose_plan(
        budget, ROWS, lambda on: fits, _footprint(), *plan_inputs(dict.fromkeys(ROWS), **choices)
    )


def test_with_memory_to_spare_every_graph_is_kept() -> None:
    """A budget that holds every column's graphs at once: the whole batch as kept mini-batches (an uncached
    step), predicted at what is held plus each kept mini-batch's measured peak."""
    plan = _plan(64 * GIB)
    assert plan.settings.mini_batch_size == ROWS and plan.settings.keep_graphs == {"query": 1, "positive": 1}
    assert plan.predicted_peak == GIB + int(QUERY_FIT.peak(1024) + PASSAGE_FIT.peak(1024))
    assert "uncached step" in plan.reason


def test_where_only_some_fit_the_last_column_is_cut_to_keep_more() -> None:
    """The queries' graphs fit whole, the passages' in part: their column is cut (at most KEEP_MAX_SPLIT times,
    no mini-batch under MIN_ROWS) so that as many rows as fit keep their graph, within the budget."""
    budget = 48 * GIB
    plan = _plan(budget)
    usable = budget * (1 - PLAN_MARGIN)
    size, kept = plan.settings.mini_batch_size["positive"], plan.settings.keep_graphs["positive"]
    assert plan.settings.keep_graphs["query"] == 1 and 0 < kept * size < ROWS["positive"]
    assert MIN_ROWS <= size < ROWS["positive"] and ROWS["positive"] / size <= KEEP_MAX_SPLIT
    assert plan.predicted_peak <= usable
    assert GIB + QUERY_FIT.peak(1024) + (kept + 1) * PASSAGE_FIT.peak(size) > usable  # one more would not fit
    # Uncut, not one passage mini-batch of 1,024 rows would fit beside the queries' graphs.
    assert GIB + QUERY_FIT.peak(1024) + PASSAGE_FIT.peak(1024) > usable


def test_a_column_of_explicit_mini_batch_size_keeps_no_graph() -> None:
    """An explicit mini_batch_size says how much activation memory its column may take: with memory to spare,
    only the planned column keeps its graphs."""
    fits = {"query": QUERY_FIT, "positive": PASSAGE_FIT}
    choices = plan_inputs({"query": 256, "positive": None})
    plan = choose_plan(64 * GIB, ROWS, lambda on: fits, _footprint(), *choices)
    assert plan.settings.mini_batch_size == {"query": 256, "positive": 1024}
    assert plan.settings.keep_graphs == {"query": 0, "positive": 1}


def test_explicit_keep_graphs_is_kept_and_predicted() -> None:
    """keep_graphs=False: no graph kept and the peak of the step without them; True: as configured, with the
    kept graphs in the predicted peak (a warning where that exceeds the budget); CUDA graphs keep none."""
    off = _plan(64 * GIB, keep_graphs=False)
    assert off.settings.keep_graphs is False and off.predicted_peak == GIB + int(PASSAGE_FIT.peak(1024))
    on = _plan(16 * GIB, keep_graphs=True)
    assert on.settings.keep_graphs is True and on.predicted_peak > 16 * GIB
    assert "WARNING: keep_graphs" in on.reason
    graphed = _plan(16 * GIB, cuda_graphs=True, graphs_possible=True)
    assert graphed.settings.cuda_graphs and graphed.settings.keep_graphs is False
    assert "keeping their graph none;" in graphed.describe()


@pytest.mark.gpu
def test_planned_kept_graphs_on_cuda_in_bf16(config) -> None:
    """On CUDA under bf16 autocast, max_memory auto keeps every graph of a small batch (one mini-batch a
    column): Step (1) runs each once, with its graph, and nothing is re-encoded; the loss is the replayed
    step's bit for bit and the gradients within fp32 summation order (the word-embedding backward adds with
    atomics)."""
    columns = {c: {k: v.cuda() for k, v in f.items()} for c, f in make_columns(BATCH, 3).items()}
    encoder = RecordingEncoder(make_encoder(config, train=True)).cuda()
    runs = {}
    for keep in (None, False):
        cached = CachedLoss(encoder, contrastive_flops_loss, max_memory="auto", keep_graphs=keep)
        for _ in range(2):  # the first step plans (its probe calls the encoder too)
            encoder.calls.clear()
            encoder.zero_grad()
            torch.manual_seed(7)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = cached(columns)
            loss.backward()
        graph_less = sum(not grad for grad, _, _ in encoder.calls)
        runs[keep] = (loss.detach(), grads_of(encoder), graph_less, cached.engine.settings.keep_graphs)
    loss, grads, graph_less, kept = runs[None]
    assert kept == {"query": 1, "positive": 1, "negative": 1} and graph_less == 0
    replayed_loss, replayed_grads, replayed_graph_less, _ = runs[False]
    assert replayed_graph_less == 3 and torch.equal(loss, replayed_loss)
    assert_grads_close(grads, replayed_grads, rtol=RTOL_FP32)


def test_kept_graphs_of_a_frozen_encoder_are_refused_as_replayed(config) -> None:
    """keep_graphs=True on an encoder whose forward makes no graph (every weight frozen): its mini-batches are
    replayed, and the replay's error (the encoder ran without autograd) stops the step; no gradient appears."""
    encoder = make_encoder(config).requires_grad_(False)
    with pytest.raises(RuntimeError, match="does not require grad"):
        GradCache(encoder, mini_batch_size=3, keep_graphs=True).step(
            make_columns(BATCH, 2), contrastive_flops_loss
        )
    assert all(p.grad is None for p in encoder.parameters())


def test_a_column_the_budget_splits_is_not_cut_to_keep_graphs() -> None:
    """Where the budget already splits a column, its mini-batches keep their size: a graph is kept only where a
    whole planned mini-batch fits beside the step (cutting 418-row query mini-batches to 108 to keep three
    slowed an 8 GiB step on an H200 from 1,075 to 792 pairs/s)."""
    fits = {"query": QUERY_FIT, "positive": PASSAGE_FIT}
    sizes, counts, _ = choose_kept_graphs(3 * GIB, ROWS, {"query": 400, "positive": 100}, fits, list(ROWS))
    assert sizes == {"query": 400, "positive": 100}
    assert counts == {"query": 0, "positive": 0}  # 400 query rows need 4.15 GiB; nothing is cut to fit
    sizes, counts, _ = choose_kept_graphs(5 * GIB, ROWS, {"query": 400, "positive": 100}, fits, list(ROWS))
    assert sizes == {"query": 400, "positive": 100} and counts == {"query": 1, "positive": 0}
