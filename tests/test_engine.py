"""The GradCache engine: RNG/autocast capture and replay, mini-batching, Steps (1)-(3), bad input.

The core invariant: a cached step leaves the same loss and parameter gradients as one uncached
forward/backward over the whole batch. Tolerance: fp32 with rtol 1e-5 (relative to each parameter's
largest gradient). The cached step sums each parameter's gradient over mini-batches in another order
and runs attention over trimmed sequences, which moves results by a few fp32 ulps (measured <= 1e-6
over all the parametrizations below, loss values bitwise equal); 1e-5 leaves 10x room while a lost,
doubled or mis-scaled mini-batch is an O(1) error.
"""

from __future__ import annotations

import contextlib
import random

import pytest
import torch
from engine_helpers import (
    SMALL_VOCAB,
    RecordingEncoder,
    accumulate_earlier_micro_step,
    assert_grads_close,
    assert_grads_unchanged,
    contrastive_flops_loss,
    failing_encoder,
    grads_of,
    make_columns,
    make_encoder,
    per_mini_batch_loss,
    saved_grads,
    small_config,
    uncached_loss,
    uncached_reference,
)

from gradcache_sparton.engine import CachedLoss, GradCache, GradCacheConfig
from gradcache_sparton.engine import gradcache as gradcache_module
from gradcache_sparton.engine.autocast_state import AutocastState
from gradcache_sparton.engine.mini_batch import iter_mini_batches, row_slices
from gradcache_sparton.engine.rng_state import RngState
from gradcache_sparton.engine.settings import encoder_facts, is_compiled, resolve_settings
from gradcache_sparton.primitives.host_count import HostCount

RTOL_FP32 = 1e-5  # see the module docstring
BATCH = 8

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.fixture
def config(tiny_bert_config):
    return small_config(tiny_bert_config)


def _to(columns, device):
    return {name: {k: v.to(device) for k, v in features.items()} for name, features in columns.items()}


def _assert_step_matches_uncached(config, **engine_options) -> None:
    """GradCache(**engine_options).step on 3 columns gives the loss and every parameter gradient of one
    uncached step over the whole batch (fp32 tolerance, see RTOL_FP32)."""
    encoder = make_encoder(config)
    columns = make_columns(BATCH, 3)
    ref_loss, ref_grads = uncached_reference(encoder, columns, contrastive_flops_loss)

    loss, _ = GradCache(encoder, **engine_options).step(columns, contrastive_flops_loss)

    torch.testing.assert_close(loss, ref_loss, rtol=RTOL_FP32, atol=0)
    assert_grads_close(grads_of(encoder), ref_grads, rtol=RTOL_FP32)


def test_rng_state_replay_reproduces_draws_and_keeps_global_stream() -> None:
    """Replaying a captured state redraws the same numbers, and the global stream continues untouched."""
    torch.manual_seed(123)
    state = RngState.capture()
    first = torch.rand(5)
    after_first = torch.get_rng_state()
    with state.replay():
        again = torch.rand(5)
        torch.rand(100)  # consumption inside the replay must not leak out
    assert torch.equal(first, again)
    assert torch.equal(torch.get_rng_state(), after_first)


@pytest.mark.gpu
def test_rng_state_replays_cuda_generator() -> None:
    """The CUDA generator of the captured device replays too, leaving its global stream untouched."""
    torch.cuda.manual_seed(7)
    state = RngState.capture([torch.cuda.current_device()])
    first = torch.rand(5, device="cuda")
    after_first = torch.cuda.get_rng_state()
    with state.replay():
        again = torch.rand(5, device="cuda")
    assert torch.equal(first, again)
    assert torch.equal(torch.cuda.get_rng_state(), after_first)


def test_autocast_state_replays_enabled_and_disabled() -> None:
    """A captured bf16 autocast is re-entered outside it; a captured 'off' switches off an outer autocast."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        on = AutocastState.capture()
    off = AutocastState.capture()
    assert not torch.is_autocast_enabled("cpu")
    with on.replay():
        assert torch.is_autocast_enabled("cpu")
        assert torch.get_autocast_dtype("cpu") == torch.bfloat16
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16
    with torch.autocast("cpu", dtype=torch.bfloat16), off.replay():
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.float32


def test_host_count_reads_the_value_and_refuses_non_integer_scalars() -> None:
    """HostCount gives a 0-d integer tensor's value later (on CUDA after waiting for its event only) and
    refuses a float or a non-scalar, naming the argument."""
    assert HostCount(torch.tensor([0, 3, 0, 5]).ne(0).sum()).value() == 2
    if torch.cuda.is_available():
        assert HostCount(torch.arange(10, device="cuda").sum()).value() == 45
    with pytest.raises(ValueError, match=r"count must be a 0-d integer tensor, got torch\.float32"):
        HostCount(torch.tensor(2.0))
    with pytest.raises(ValueError, match=r"of shape \(2,\)"):
        HostCount(torch.tensor([1, 2]))


def test_row_slices_cover_batch_with_short_last() -> None:
    """Mini-batches cover every row once, in order; only the last may be short."""
    assert list(row_slices(7, 3)) == [slice(0, 3), slice(3, 6), slice(6, 7)]
    assert list(row_slices(6, 3)) == [slice(0, 3), slice(3, 6)]
    assert list(row_slices(2, 5)) == [slice(0, 2)]


def test_mini_batches_are_cut_to_their_own_longest_row() -> None:
    """Each mini-batch's [B, S] features end at its own last kept position; other features are row-sliced."""
    mask = torch.tensor([[1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0]])
    features = {
        "input_ids": torch.arange(25).view(5, 5),
        "attention_mask": mask,
        "labels": torch.arange(5),
    }
    got = list(iter_mini_batches(features, 5, 2))
    assert [rows for rows, _ in got] == [slice(0, 2), slice(2, 4), slice(4, 5)]
    (_, first), (_, second), (_, last) = got
    assert torch.equal(first["input_ids"], torch.tensor([[0, 1, 2], [5, 6, 7]]))
    assert torch.equal(first["attention_mask"], mask[:2, :3])
    assert torch.equal(first["labels"], torch.tensor([0, 1]))
    assert torch.equal(second["input_ids"], features["input_ids"][2:4])  # a full-length row: no cut
    assert last["attention_mask"].shape == (1, 1)  # fully masked: one position kept
    left_padded = {"attention_mask": torch.tensor([[0, 1, 1], [1, 1, 1]])}
    assert next(iter_mini_batches(left_padded, 2, 2))[1]["attention_mask"].shape == (2, 3)
    no_mask = {"input_ids": torch.ones(3, 4)}
    assert [f["input_ids"].shape for _, f in iter_mini_batches(no_mask, 3, 2)] == [(2, 4), (1, 4)]


@pytest.mark.parametrize("n_columns", [2, 3])
@pytest.mark.parametrize(
    "mini_batch_size", [1, 3, 4, 20], ids=["mb1", "mb3-short-last", "mb4-divides", "mb20"]
)
def test_step_matches_full_batch_loss_and_grads(config, n_columns: int, mini_batch_size: int) -> None:
    """GradCache.step gives the loss, components and every gradient of one uncached full-batch step."""
    encoder = make_encoder(config)
    columns = make_columns(BATCH, n_columns)
    ref_loss, ref_components = uncached_loss(encoder, columns, contrastive_flops_loss)
    ref_loss.backward()
    ref_grads = grads_of(encoder)
    encoder.zero_grad()

    loss, components = GradCache(encoder, mini_batch_size=mini_batch_size).step(
        columns, contrastive_flops_loss
    )

    torch.testing.assert_close(loss, ref_loss.detach(), rtol=RTOL_FP32, atol=0)
    assert components.keys() == ref_components.keys()
    for name, value in components.items():
        assert not value.requires_grad
        torch.testing.assert_close(value, ref_components[name].detach(), rtol=RTOL_FP32, atol=0)
    assert_grads_close(grads_of(encoder), ref_grads, rtol=RTOL_FP32)


def test_step_with_per_column_mini_batch_size_matches_full_batch(config) -> None:
    """A mini-batch size per column (one dividing B, one not, one above B) still gives uncached gradients."""
    _assert_step_matches_uncached(config, mini_batch_size={"query": 4, "positive": 3, "negative": 11})


@pytest.mark.parametrize("device", DEVICES)
def test_replay_reproduces_step1_reps_bitwise(config, device: str) -> None:
    """With dropout on, every Step (3) rep equals its Step (1) rep bit for bit (and dropout is active)."""
    encoder = RecordingEncoder(make_encoder(config, train=True)).to(device)
    columns = _to(make_columns(BATCH, 3), device)

    GradCache(encoder, mini_batch_size=3).step(columns, contrastive_flops_loss)

    first, replayed = encoder.outputs(with_graph=False), encoder.outputs(with_graph=True)
    assert len(first) == len(replayed) == 9  # 3 columns x 3 mini-batches
    for rep_1, rep_3 in zip(first, replayed, strict=True):
        assert torch.equal(rep_1, rep_3)
    # The control: without the replayed RNG state the same mini-batch draws other dropout masks.
    with torch.no_grad():
        fresh = encoder.encoder(**{k: v[:3] for k, v in columns["query"].items()})
    assert not torch.equal(fresh, first[0])


def test_cached_dropout_matches_per_mini_batch_reference(config) -> None:
    """With dropout, cached gradients equal uncached ones under the same per-mini-batch RNG draws.

    The reference encodes the same mini-batches in the same order with a graph from the same seed; the
    global RNG stream afterwards is also the same, because Step (3) replays inside fork_rng.
    """
    encoder = make_encoder(config, train=True)
    columns = make_columns(BATCH, 3)
    torch.manual_seed(99)
    ref_loss, _ = per_mini_batch_loss(encoder, columns, contrastive_flops_loss, 3)
    ref_loss.backward()
    ref_grads, ref_rng = grads_of(encoder), torch.get_rng_state()
    encoder.zero_grad()

    torch.manual_seed(99)
    loss, _ = GradCache(encoder, mini_batch_size=3).step(columns, contrastive_flops_loss)

    torch.testing.assert_close(loss, ref_loss.detach(), rtol=RTOL_FP32, atol=0)
    assert_grads_close(grads_of(encoder), ref_grads, rtol=RTOL_FP32)
    assert torch.equal(torch.get_rng_state(), ref_rng)


@pytest.mark.parametrize("device", DEVICES)
def test_replay_runs_in_step1_autocast_dtype(config, device: str) -> None:
    """Step (3), run outside the caller's bf16 autocast, re-enters it: bf16 reps equal Step (1)'s bitwise."""
    encoder = RecordingEncoder(make_encoder(config, train=True)).to(device)
    columns = _to(make_columns(BATCH, 2), device)
    engine = GradCache(encoder, mini_batch_size=3)
    with torch.autocast(device, dtype=torch.bfloat16):
        reps, replay_state = engine.encode(columns)
        _, rep_grads = engine.rep_gradients(reps, contrastive_flops_loss)
    engine.replay(replay_state, rep_grads)  # outside autocast, as inside loss.backward()

    first, replayed = encoder.outputs(with_graph=False), encoder.outputs(with_graph=True)
    assert len(first) == len(replayed) == 6
    # The reps' dtype cannot show the autocast state (CUDA autocast runs log1p in fp32, CPU's in bf16):
    # the encoder records the autocast dtype it ran under.
    assert encoder.autocast_dtypes(with_graph=False) == [torch.bfloat16] * 6
    assert encoder.autocast_dtypes(with_graph=True) == [torch.bfloat16] * 6
    for rep_1, rep_3 in zip(first, replayed, strict=True):
        assert rep_3.dtype == rep_1.dtype
        assert torch.equal(rep_1, rep_3)
    assert all(p.grad is not None for p in encoder.parameters() if p.requires_grad)


def test_replay_context_wraps_each_mini_batch(config) -> None:
    """The per-mini-batch context factory wraps every replay once, flagging only the very last."""
    encoder = make_encoder(config)
    engine = GradCache(encoder, mini_batch_size={"query": 3, "positive": 5})
    reps, replay_state = engine.encode(make_columns(BATCH, 2))
    _, rep_grads = engine.rep_gradients(reps, contrastive_flops_loss)
    entered: list[bool] = []

    def context(is_last: bool) -> contextlib.AbstractContextManager[None]:
        entered.append(is_last)
        return contextlib.nullcontext()

    engine.replay(replay_state, rep_grads, mini_batch_context=context)
    assert entered == [False, False, False, False, True]  # 3 query + 2 positive mini-batches


def _columns_with(mutation: str):
    columns = make_columns(4, 2)
    if mutation == "no columns":
        return {}
    if mutation == "empty batch":
        return {name: {k: v[:0] for k, v in f.items()} for name, f in columns.items()}
    if mutation == "non-tensor feature":
        columns["query"]["input_ids"] = columns["query"]["input_ids"].tolist()
    elif mutation == "ragged column":
        columns["positive"]["attention_mask"] = columns["positive"]["attention_mask"][:3]
    elif mutation == "columns of different batch sizes":
        columns["positive"] = {k: v[:3] for k, v in columns["positive"].items()}
    return columns


@pytest.mark.parametrize(
    ("mutation", "error", "match"),
    [
        ("no columns", ValueError, "non-empty mapping"),
        ("empty batch", ValueError, "'query' is an empty batch"),
        ("non-tensor feature", TypeError, "feature 'input_ids' of column 'query' must be a torch.Tensor"),
        ("ragged column", ValueError, "features of column 'positive' have different batch sizes"),
        ("columns of different batch sizes", ValueError, r"columns have different batch sizes"),
    ],
)
def test_bad_columns_raise_before_encoding(config, mutation: str, error: type, match: str) -> None:
    """Malformed columns raise a clear error naming the problem before the encoder runs once."""
    encoder = RecordingEncoder(make_encoder(config))
    with pytest.raises(error, match=match):
        GradCache(encoder, mini_batch_size=2).step(_columns_with(mutation), contrastive_flops_loss)
    assert encoder.calls == []


def test_bad_engine_arguments_raise(config) -> None:
    """mini_batch_size < 1, non-int, or per-column sizes not matching the columns raise, naming the field."""
    encoder = make_encoder(config)
    with pytest.raises(ValueError, match="mini_batch_size must be >= 1, got 0"):
        GradCache(encoder, mini_batch_size=0)
    with pytest.raises(TypeError, match="mini_batch_size must be an int, got float"):
        GradCache(encoder, mini_batch_size=2.0)
    with pytest.raises(ValueError, match=r"mini_batch_size\['query'\] must be >= 1"):
        GradCache(encoder, mini_batch_size={"query": 0})
    with pytest.raises(ValueError, match=r"one entry per column: missing \['positive'\]"):
        GradCache(encoder, mini_batch_size={"query": 2}).encode(make_columns(4, 2))
    with pytest.raises(ValueError, match="mini_batch_tokens must be >= 1, got 0"):
        GradCache(encoder, mini_batch_size=2, mini_batch_tokens=0)
    with pytest.raises(TypeError, match="mini_batch_tokens must be an int, got float"):
        GradCache(encoder, mini_batch_size=2, mini_batch_tokens=64.0)
    with pytest.raises(ValueError, match="mini_batch_length_multiple must be >= 1, got 0"):
        GradCache(encoder, mini_batch_size=2, mini_batch_length_multiple=0)
    with pytest.raises(TypeError, match="mini_batch_length_multiple must be an int, got bool"):
        GradCache(encoder, mini_batch_size=2, mini_batch_length_multiple=True)
    maskless = {name: {"input_ids": f["input_ids"]} for name, f in make_columns(4, 2).items()}
    with pytest.raises(
        ValueError, match=r"mini_batch_tokens needs an attention_mask .* column 'query' has none"
    ):
        GradCache(encoder, mini_batch_size=2, mini_batch_tokens=64).encode(maskless)
    with pytest.raises(ValueError, match="loss keyword 'targets' has 3 rows but the columns have 4"):
        GradCache(encoder, mini_batch_size=2).step(
            make_columns(4, 2), contrastive_flops_loss, targets=torch.ones(3)
        )


@pytest.mark.parametrize(
    ("loss_fn", "error", "match"),
    [
        (lambda reps: reps["query"].sum(dim=1), ValueError, r"scalar \(0-dim\) Tensor, got shape \(4,\)"),
        (lambda reps: 1.0, TypeError, "floating-point scalar Tensor, got float"),
        (lambda reps: (reps["query"].sum(), 2.0), TypeError, "tuple \\(scalar Tensor, dict"),
        (lambda reps: torch.tensor(1.0), ValueError, "does not depend on the reps"),
    ],
    ids=["not-scalar", "not-tensor", "bad-tuple", "no-graph"],
)
def test_bad_loss_output_raises(config, loss_fn, error: type, match: str) -> None:
    """A loss that does not return a scalar tensor (with a graph) raises before Step (3)."""
    encoder = RecordingEncoder(make_encoder(config))
    with pytest.raises(error, match=match):
        GradCache(encoder, mini_batch_size=2).step(make_columns(4, 2), loss_fn)
    assert encoder.outputs(with_graph=True) == []


def test_non_finite_loss_raises_naming_it(config) -> None:
    """An infinite loss stops before Step (3) with FloatingPointError naming the loss and its component."""
    encoder = RecordingEncoder(make_encoder(config))

    def loss_fn(reps):
        bad = reps["query"].sum() / 0.0
        return reps["positive"].sum() + bad, {"bad": bad}

    with pytest.raises(FloatingPointError, match=r"non-finite values in the loss.*components: \['bad'\]"):
        GradCache(encoder, mini_batch_size=2).step(make_columns(4, 2), loss_fn)
    assert encoder.outputs(with_graph=True) == []
    assert all(p.grad is None for p in encoder.parameters())


def test_non_finite_rep_gradient_raises_naming_column(config) -> None:
    """A finite loss with a NaN gradient for one column stops before Step (3), naming that column."""
    encoder = RecordingEncoder(make_encoder(config))

    def loss_fn(reps):
        # sqrt at 0 has an infinite derivative; times 0 it makes a NaN gradient but a finite value.
        return reps["positive"].sum() + torch.sqrt(reps["query"] * 0.0).sum()

    with pytest.raises(FloatingPointError, match="the gradient of column 'query'"):
        GradCache(encoder, mini_batch_size=2).step(make_columns(4, 2), loss_fn)
    assert encoder.outputs(with_graph=True) == []


def test_encoder_without_autograd_in_replay_raises(config) -> None:
    """An encoder that runs under no_grad gives reps without a graph: Step (3) says so."""
    inner = make_encoder(config)

    def frozen_encoder(**features):
        with torch.no_grad():
            return inner(**features)

    with pytest.raises(
        RuntimeError, match=r"replayed rep \(column 'query', rows 0:2\) does not require grad"
    ):
        GradCache(frozen_encoder, mini_batch_size=2).step(make_columns(4, 2), contrastive_flops_loss)


def test_column_without_gradient_is_not_replayed(config) -> None:
    """A column the loss ignores gets no gradient and no Step (3) re-encode; the rest match uncached."""
    encoder = RecordingEncoder(make_encoder(config))
    columns = make_columns(BATCH, 3)

    def query_positive_loss(reps):
        return contrastive_flops_loss({name: reps[name] for name in ("query", "positive")})

    ref_loss, _ = uncached_loss(encoder, columns, query_positive_loss)
    ref_loss.backward()
    ref_grads = grads_of(encoder)
    encoder.zero_grad()
    encoder.calls.clear()

    GradCache(encoder, mini_batch_size=4).step(columns, query_positive_loss)

    assert len(encoder.outputs(with_graph=False)) == 6  # Step (1) encodes all 3 columns
    assert len(encoder.outputs(with_graph=True)) == 4  # Step (3) replays query and positive only
    assert_grads_close(grads_of(encoder), ref_grads, rtol=RTOL_FP32)


@pytest.mark.parametrize("accumulated", [False, True], ids=["fresh", "accumulated"])
@pytest.mark.parametrize("kind", ["exception", "oom-in-backward"])
def test_step_failing_midway_restores_grads(config, kind: str, accumulated: bool) -> None:
    """A replay failing in mini-batch 4 of 6 leaves every .grad as before the step (None stays None,
    accumulated gradients bitwise, the same tensors), and the error propagates with a note saying so."""
    encoder = failing_encoder(config, kind)
    if accumulated:
        accumulate_earlier_micro_step(encoder.encoder)
    before = saved_grads(encoder)

    with pytest.raises(type(encoder.error)) as caught:
        GradCache(encoder, mini_batch_size=3).step(make_columns(BATCH, 2), contrastive_flops_loss)

    assert caught.value is encoder.error and encoder.replays == 4
    assert any("mini-batch 4 of 6" in note and "restored" in note for note in caught.value.__notes__)
    assert_grads_unchanged(encoder, before)


class PythonRandomEncoder(torch.nn.Module):
    """Replaces one random token of each row, drawn from Python's ``random`` (which the engine does not replay)."""

    def __init__(self, encoder: torch.nn.Module) -> None:
        super().__init__()
        self.encoder = encoder

    def forward(self, input_ids: torch.Tensor, **features: torch.Tensor) -> torch.Tensor:
        input_ids = input_ids.clone()
        for row in range(input_ids.shape[0]):
            input_ids[row, random.randrange(input_ids.shape[1])] = random.randrange(1, SMALL_VOCAB)
        return self.encoder(input_ids=input_ids, **features)


def test_python_random_in_encoder_is_detected(config) -> None:
    """An encoder drawing from Python's `random` replays other reps: the step raises naming the likely
    causes, after restoring .grad (None here)."""
    random.seed(0)
    encoder = PythonRandomEncoder(make_encoder(config))
    with pytest.raises(RuntimeError, match=r"did not reproduce Step \(1\).*Python's `random`") as caught:
        GradCache(encoder, mini_batch_size=3).step(make_columns(BATCH, 2), contrastive_flops_loss)
    assert any("after replaying all 6 mini-batches" in note for note in caught.value.__notes__)
    assert all(p.grad is None for p in encoder.parameters())


def test_dropout_replay_passes_the_replay_check(config) -> None:
    """With dropout on, every mini-batch carries a Step (1) fingerprint and the checked replay matches it
    (the check is on by default); with check_replay=False no fingerprint is kept."""
    encoder = make_encoder(config, train=True)
    columns = make_columns(BATCH, 3)
    engine = GradCache(encoder, mini_batch_size=3)
    reps, replay_state = engine.encode(columns)
    _, rep_grads = engine.rep_gradients(reps, contrastive_flops_loss)
    fingerprints = [mb.fingerprint for mbs in replay_state.mini_batches.values() for mb in mbs]
    assert len(fingerprints) == 9 and all(f is not None and f.dtype == torch.float32 for f in fingerprints)
    engine.replay(replay_state, rep_grads)  # raises if any replayed mini-batch differs
    assert all(p.grad is not None for p in encoder.parameters())

    unchecked = GradCache(encoder, mini_batch_size=3, check_replay=False).encode(columns).replay_state
    assert all(mb.fingerprint is None for mbs in unchecked.mini_batches.values() for mb in mbs)


def test_token_budget_mini_batches_group_rows_by_length() -> None:
    """mini_batch_tokens: rows longest first (ties in row order), each mini-batch within the token budget
    (rows x its longest row) and mini_batch_size, cut to its longest row; a row over the budget alone."""
    lengths = torch.tensor([2, 5, 3, 5, 1, 4])
    mask = (torch.arange(6).unsqueeze(0) < lengths.unsqueeze(1)).long()  # [6, 6], right padded
    features = {
        "input_ids": torch.arange(36).view(6, 6) * mask,
        "attention_mask": mask,
        "labels": torch.arange(6),
    }

    got = list(iter_mini_batches(features, 6, 3, mini_batch_tokens=10))
    assert [rows.tolist() for rows, _ in got] == [[1, 3], [5, 2], [0, 4]]
    assert [f["attention_mask"].shape for _, f in got] == [(2, 5), (2, 4), (2, 2)]
    (_, first), (_, second), _ = got
    assert torch.equal(second["input_ids"], features["input_ids"][[5, 2], :4])
    assert torch.equal(second["labels"], torch.tensor([5, 2]))
    assert torch.equal(first["attention_mask"], mask[[1, 3], :5])

    over_budget = [rows.tolist() for rows, _ in iter_mini_batches(features, 6, 3, mini_batch_tokens=4)]
    assert over_budget == [[1], [3], [5], [2], [0, 4]]
    by_rows = [rows.tolist() for rows, _ in iter_mini_batches(features, 6, 2, mini_batch_tokens=100)]
    assert by_rows == [[1, 3], [5, 2], [0, 4]]


def test_mini_batch_lengths_round_up_to_a_multiple() -> None:
    """mini_batch_length_multiple: each cut length is rounded up to the multiple, never past the column's width,
    the extra positions being the column's own (masked) padding; a token budget counts the rounded length."""
    lengths = torch.tensor([2, 5, 3, 7, 1, 4])
    mask = (torch.arange(7).unsqueeze(0) < lengths.unsqueeze(1)).long()  # [6, 7], right padded
    features = {"input_ids": torch.arange(42).view(6, 7) * mask, "attention_mask": mask}

    rounded = list(iter_mini_batches(features, 6, 2, mini_batch_length_multiple=4))
    assert [f["attention_mask"].shape[1] for _, f in rounded] == [7, 7, 4]  # 5 and 7 -> 8, capped at 7
    (_, first), _, (_, last) = rounded
    assert torch.equal(first["input_ids"], features["input_ids"][:2, :7])
    assert torch.equal(last["attention_mask"], mask[4:6, :4])
    by_threes = iter_mini_batches(features, 6, 3, mini_batch_length_multiple=3)
    assert [f["attention_mask"].shape[1] for _, f in by_threes] == [6, 7]  # 5 -> 6; 7 stays 7
    # Token budget 12 with lengths rounded to 4: 7 -> 7 (width), 5 -> 8, 4, 3 -> 4, 2 -> 4, 1 -> 4.
    grouped = list(iter_mini_batches(features, 6, 6, mini_batch_tokens=12, mini_batch_length_multiple=4))
    assert [rows.tolist() for rows, _ in grouped] == [[3], [1], [5, 2, 0], [4]]
    assert [f["attention_mask"].shape for _, f in grouped] == [(1, 7), (1, 7), (3, 4), (1, 4)]


@pytest.mark.parametrize(
    ("mini_batch_length_multiple", "mini_batch_tokens"), [(3, None), (8, None), (64, None), (4, 30)],
    ids=["m3", "m8", "m64-wider-than-columns", "m4-tok30"],
)  # fmt: skip
def test_padded_mini_batches_step_matches_full_batch(
    config, mini_batch_length_multiple: int, mini_batch_tokens
) -> None:
    """Mini-batches cut to rounded-up lengths give the loss and every gradient of one uncached step, also
    with token budgets and a multiple wider than every column."""
    _assert_step_matches_uncached(
        config,
        mini_batch_size=3,
        mini_batch_tokens=mini_batch_tokens,
        mini_batch_length_multiple=mini_batch_length_multiple,
    )


@pytest.mark.parametrize("mini_batch_tokens", [7, 20, 30, 1000], ids=["tok7", "tok20", "tok30", "tok1000"])
def test_token_budget_step_matches_full_batch(config, mini_batch_tokens: int) -> None:
    """Length-grouped, token-budget mini-batches (budgets splitting unevenly, one row per mini-batch at 7,
    rows bounded by mini_batch_size at 1000) give the loss and every gradient of one uncached step."""
    _assert_step_matches_uncached(config, mini_batch_size=3, mini_batch_tokens=mini_batch_tokens)


@pytest.mark.parametrize("mini_batch_tokens", [20, 33], ids=["tok20", "tok33"])
def test_token_budget_with_dropout_matches_grouped_reference(config, mini_batch_tokens: int) -> None:
    """With dropout, token-budget mini-batches give the gradients of the same length groups encoded with a
    graph from the same seed, reps put back in row order (and the same global RNG state afterwards)."""
    encoder = make_encoder(config, train=True)
    columns = make_columns(BATCH, 3)
    torch.manual_seed(99)
    ref_loss, _ = per_mini_batch_loss(
        encoder, columns, contrastive_flops_loss, 4, mini_batch_tokens=mini_batch_tokens
    )
    ref_loss.backward()
    ref_grads, ref_rng = grads_of(encoder), torch.get_rng_state()
    encoder.zero_grad()

    torch.manual_seed(99)
    engine = GradCache(encoder, mini_batch_size=4, mini_batch_tokens=mini_batch_tokens)
    loss, _ = engine.step(columns, contrastive_flops_loss)

    torch.testing.assert_close(loss, ref_loss.detach(), rtol=RTOL_FP32, atol=0)
    assert_grads_close(grads_of(encoder), ref_grads, rtol=RTOL_FP32)
    assert torch.equal(torch.get_rng_state(), ref_rng)


def test_inputs_are_checked_once_per_step(config, monkeypatch) -> None:
    """GradCache.step and CachedLoss check the columns once, at the public entry, not once per stage."""
    calls: list[int] = []
    check_columns = gradcache_module.check_columns

    def counting(columns, config):
        calls.append(1)
        check_columns(columns, config)

    monkeypatch.setattr(gradcache_module, "check_columns", counting)
    encoder = make_encoder(config)
    GradCache(encoder, mini_batch_size=4).step(make_columns(4, 2), contrastive_flops_loss)
    assert len(calls) == 1
    CachedLoss(encoder, contrastive_flops_loss, mini_batch_size=4)(make_columns(4, 2)).backward()
    assert len(calls) == 2


def test_reps_of_another_width_or_dtype_in_one_column_raise(config) -> None:
    """An encoder whose mini-batches of one column return reps of different widths or dtypes is refused
    (naming the column and rows) instead of being cast into the column's reps."""
    widths = iter([5, 6])
    dtypes = iter([torch.float32, torch.float64])

    def wider(input_ids, **_):
        return torch.zeros(input_ids.shape[0], next(widths))

    def other_dtype(input_ids, **_):
        return torch.zeros(input_ids.shape[0], 5, dtype=next(dtypes))

    columns = make_columns(4, 1)
    with pytest.raises(
        ValueError, match=r"\[6\] torch.float32 on cpu for rows 2:4 of column 'query' but \[5\]"
    ):
        GradCache(wider, mini_batch_size=2).encode(columns)
    with pytest.raises(ValueError, match=r"torch.float64 .* column 'query' but \[5\] torch.float32"):
        GradCache(other_dtype, mini_batch_size=2).encode(columns)


def test_config_or_its_fields_as_keywords_build_the_same_engine(config) -> None:
    """GradCache(encoder, GradCacheConfig(...)) and GradCache(encoder, **fields) build equal configurations
    (CachedLoss too); a config with keywords, a config of another type, or an unknown field is refused."""
    encoder = make_encoder(config)
    options = {"mini_batch_size": {"query": 4, "positive": 2}, "mini_batch_tokens": 64, "sparse_reps": "auto"}
    by_config = GradCache(encoder, GradCacheConfig(**options))
    by_keywords = GradCache(encoder, **options)
    assert (
        by_config.config
        == by_keywords.config
        == CachedLoss(encoder, contrastive_flops_loss, **options).engine.config
    )
    assert by_config.config.mini_batch_size == {"query": 4, "positive": 2}
    with pytest.raises(TypeError, match="not both"):
        GradCache(encoder, GradCacheConfig(), mini_batch_size=2)
    with pytest.raises(TypeError, match="not both"):
        GradCache(encoder, {"mini_batch_size": 2})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="sparse_rep_grads"):
        GradCache(encoder, sparse_rep_grads=True)


def test_config_decides_its_automatic_defaults(config) -> None:
    """check_replay and reuse_argmax left None are on for an eager encoder and off for a compiled one (a
    torch.compile wrapper or a module compiled in place inside it), unless set; a compiled encoder's lengths
    are rounded to multiples of 32 unless set; cuda_graphs turns the reuse_argmax default off; sparse_reps
    takes bools and any case and keeps one spelling."""
    encoder = make_encoder(config)
    eager = resolve_settings(GradCacheConfig(), encoder_facts(encoder))
    assert (eager.check_replay, eager.reuse_argmax, eager.mini_batch_length_multiple) == (True, True, None)
    for compiled in (torch.compile(encoder), torch.nn.Sequential(make_encoder(config))):
        if isinstance(compiled, torch.nn.Sequential):
            compiled[0].compile()
        assert is_compiled(compiled) and not is_compiled(encoder)
        decided = resolve_settings(GradCacheConfig(), encoder_facts(compiled))
        assert (decided.check_replay, decided.reuse_argmax, decided.mini_batch_length_multiple) == (
            False,
            False,
            32,
        )
        kept = resolve_settings(
            GradCacheConfig(check_replay=True, reuse_argmax=True, mini_batch_length_multiple=8),
            encoder_facts(compiled),
        )
        assert (kept.check_replay, kept.reuse_argmax) == (True, True)
        assert kept.mini_batch_length_multiple == 8
    graphed = GradCacheConfig(cuda_graphs=True, mini_batch_length_multiple=8)
    assert (
        graphed.reuse_argmax is None
        and resolve_settings(graphed, encoder_facts(encoder)).reuse_argmax is False
    )
    spellings = [GradCacheConfig(sparse_reps=value).sparse_reps for value in (True, False, "AUTO", "False")]
    assert spellings == ["true", "false", "auto", "false"]


@pytest.mark.parametrize(
    ("field", "value", "error"),
    [
        ("same_batch_size", 1, TypeError),
        ("allow_non_finite", "yes", TypeError),
        ("show_mini_batch_progress", None, TypeError),
        ("cuda_graphs", "yes", TypeError),
        ("check_replay", 0, TypeError),
        ("reuse_argmax", "auto", TypeError),
        ("gather_across_ranks", "yes", TypeError),
        ("sparse_reps", "yes", ValueError),
        ("sparse_reps", 1, ValueError),
        ("mini_batch_size", {}, ValueError),
    ],
)
def test_config_refuses_a_bad_value_naming_the_field(field: str, value: object, error: type) -> None:
    """Each GradCacheConfig field of the wrong type or value raises one error naming it, when built."""
    with pytest.raises(error, match=field):
        GradCacheConfig(**{field: value})
