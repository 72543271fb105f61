"""``reuse_argmax``: Step (3) rebuilds the Sparton head from Step (1)'s record instead of running its forward.

The invariant: the replayed head's output and its backward are those of the forward it skips, bit for
bit. The record holds the forward op's own (max, argmax) at every entry whose gradient can be
non-zero, and the backward op runs on them, so a step with ``reuse_argmax`` leaves the loss and every
parameter gradient bitwise equal to the same step without it (same device, same mini-batches); the
tests compare with ``torch.equal``. The comparison with the uncached step uses the engine tests'
fp32 tolerance (rtol 1e-5 of each parameter's largest gradient, tests/test_engine.py says why).
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from engine_helpers import (
    assert_grads_close,
    assert_grads_unchanged,
    grads_of,
    make_columns,
    make_encoder,
    saved_grads,
    small_config,
    uncached_loss,
)
from torch import Tensor, nn
from trainer_helpers import trainer_args, trainer_model, trainer_rows

from gradcache_sparton.engine import CachedLoss, GradCache
from gradcache_sparton.engine.argmax_reuse import ArgmaxMemo, ArgmaxReuse
from gradcache_sparton.kernels import sparton_head
from gradcache_sparton.losses import SpladeLoss, SpladeLossConfig
from gradcache_sparton.modeling import SpladeEncoder
from gradcache_sparton.primitives.forward_memo import recording, replaying
from gradcache_sparton.trainer import CachedSpladeTrainer

RTOL_FP32 = 1e-5  # see the module docstring
BATCH = 8


@pytest.fixture
def config(tiny_bert_config):
    return small_config(tiny_bert_config)


def _loss() -> SpladeLoss:
    return SpladeLoss(SpladeLossConfig(query_reg_weight=0.3, doc_reg_weight=0.2))


def _encoder(config, *, dropout: bool = False, bias_shift: float = 0.0) -> SpladeEncoder:
    """A seeded SpladeEncoder (Sparton head) of the tiny config; a lowered decoder bias makes reps sparser."""
    config = small_config(config, dropout=0.1 if dropout else 0.0)
    torch.manual_seed(0)
    encoder = SpladeEncoder.from_config(config).train()
    with torch.no_grad():
        encoder.head.bias -= bias_shift
    return encoder


def _step(
    encoder: nn.Module, columns, *, seed: int = 5, **engine_options
) -> tuple[Tensor, dict[str, Tensor]]:
    encoder.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    output = GradCache(encoder, **engine_options).step(columns, _loss())
    return output.loss, grads_of(encoder)


def _assert_bitwise_equal(actual: dict[str, Tensor], expected: dict[str, Tensor]) -> None:
    assert actual.keys() == expected.keys()
    for name, grad in expected.items():
        assert torch.equal(actual[name], grad), name


@pytest.mark.parametrize("dropout", [False, True], ids=["no-dropout", "dropout"])
@pytest.mark.parametrize(
    "mini_batch_size", [1, 3, 4, 20], ids=["mb1", "mb3-short-last", "mb4-divides", "mb20"]
)
def test_reuse_argmax_step_equals_the_step_without_it_bitwise(
    config, mini_batch_size: int, dropout: bool
) -> None:
    """With reuse_argmax the step's loss and every parameter gradient are bitwise those of the same step
    without it, dropout on and off, mini-batches dividing the batch and not."""
    encoder = _encoder(config, dropout=dropout)
    columns = make_columns(BATCH, 3)
    loss, grads = _step(encoder, columns, mini_batch_size=mini_batch_size)
    reused_loss, reused_grads = _step(encoder, columns, mini_batch_size=mini_batch_size, reuse_argmax=True)
    assert torch.equal(reused_loss, loss)
    _assert_bitwise_equal(reused_grads, grads)
    assert max(float(g.abs().max()) for g in grads.values()) > 0


def test_reuse_argmax_step_matches_the_uncached_step(config) -> None:
    """Cached with reuse_argmax against one uncached forward/backward of the whole batch (no dropout)."""
    encoder = _encoder(config)
    columns = make_columns(BATCH, 3)
    ref_loss, _ = uncached_loss(encoder, columns, _loss())
    ref_loss.backward()
    ref_grads = grads_of(encoder)
    loss, grads = _step(encoder, columns, mini_batch_size=3, reuse_argmax=True)
    torch.testing.assert_close(loss, ref_loss.detach(), rtol=RTOL_FP32, atol=0)
    assert_grads_close(grads, ref_grads, rtol=RTOL_FP32)


@pytest.mark.parametrize(
    "options",
    [{"sparse_reps": True}, {"mini_batch_tokens": 25}, {"sparse_reps": True, "mini_batch_tokens": 25}],
    ids=["sparse", "tok25", "sparse-tok25"],
)
def test_reuse_argmax_with_sparse_reps_and_token_budgets_is_bitwise(config, options) -> None:
    """reuse_argmax composes with sparse reps and length-grouped mini-batches: bitwise the same step
    without it (3% dense reps, dropout on)."""
    encoder = _encoder(config, dropout=True, bias_shift=0.3)
    columns = make_columns(BATCH, 3)
    loss, grads = _step(encoder, columns, mini_batch_size=3, **options)
    reused_loss, reused_grads = _step(encoder, columns, mini_batch_size=3, reuse_argmax=True, **options)
    assert torch.equal(reused_loss, loss)
    _assert_bitwise_equal(reused_grads, grads)


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_reuse_argmax_with_gradient_checkpointing_is_bitwise(config, reentrant: bool) -> None:
    """With activation checkpointing in the backbone (recomputed inside Step (3)'s backward), reuse_argmax
    still gives bitwise the step without it (dropout on)."""
    encoder = _encoder(config, dropout=True)
    encoder.gradient_checkpointing_enable({"use_reentrant": reentrant})
    columns = make_columns(BATCH, 3)
    loss, grads = _step(encoder, columns, mini_batch_size=3)
    reused_loss, reused_grads = _step(encoder, columns, mini_batch_size=3, reuse_argmax=True)
    assert torch.equal(reused_loss, loss)
    _assert_bitwise_equal(reused_grads, grads)


def test_cached_loss_with_reuse_argmax_is_bitwise(config) -> None:
    """CachedLoss (Step (3) inside loss.backward()) with reuse_argmax: bitwise the gradients without it."""
    encoder = _encoder(config, dropout=True)
    columns = make_columns(BATCH, 3)
    results = []
    for reuse in (False, True):
        encoder.zero_grad(set_to_none=True)
        torch.manual_seed(5)
        CachedLoss(encoder, _loss(), mini_batch_size=3, reuse_argmax=reuse)(columns).backward()
        results.append(grads_of(encoder))
    _assert_bitwise_equal(results[1], results[0])


@pytest.mark.gpu
def test_reuse_argmax_on_cuda_with_the_triton_head(config) -> None:
    """On CUDA under bf16 autocast (the Triton head), reuse_argmax gives the loss bitwise and the gradients of
    the step without it. Not bitwise there: the word-embedding backward (tied to the head's weight) adds
    with atomics in no fixed order; its fp32 sums move by a few ulps, far inside rtol 1e-5."""
    encoder = _encoder(config, dropout=True).cuda()
    columns = {c: {k: v.cuda() for k, v in f.items()} for c, f in make_columns(BATCH, 3).items()}
    results = []
    for reuse in (False, True):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            results.append(_step(encoder, columns, mini_batch_size=3, reuse_argmax=reuse))
    assert torch.equal(results[1][0], results[0][0])
    assert_grads_close(results[1][1], results[0][1], rtol=RTOL_FP32)


def test_record_keeps_only_the_entries_with_a_gradient(config) -> None:
    """Step (1) records, per mini-batch, one head call holding (max, argmax) only where max > 0: as many
    entries as the mini-batch's non-zero reps (12 bytes each), not B x V."""
    encoder = _encoder(config, bias_shift=0.3)
    columns = make_columns(BATCH, 2)
    reps, replay_state = GradCache(encoder, mini_batch_size=3, reuse_argmax=True).encode(columns)
    for column, mini_batches in replay_state.mini_batches.items():
        assert len(mini_batches) == 3
        for mb in mini_batches:
            assert mb.memo is not None and len(mb.memo) == 1
            record = mb.memo._records[0]
            record.compact()  # the last record kept is still dense until taken back by the replay
            nonzeros = int(torch.count_nonzero(reps[column][mb.rows]))
            assert 0 < nonzeros < 0.1 * reps[column][mb.rows].numel()  # sparse reps: the point of the record
            assert record.positions.numel() == record.max_logits.numel() == record.argmax.numel() == nonzeros
            assert (record.positions.dtype, record.argmax.dtype) == (torch.int32, torch.int32)
            assert bool((record.max_logits > 0).all())


def test_records_are_compacted_one_mini_batch_late_without_a_host_read(config, monkeypatch) -> None:
    """Step (1) never reads a record's size back while keeping it (no ``nonzero``, whose output size is a
    device sync): each record stays dense until the next is kept, then keeps only its live entries; the
    last one is compacted when the replay takes it (or freed with an abandoned step), and the step stays
    bitwise the step without it."""
    encoder = _encoder(config, bias_shift=0.3)
    columns = make_columns(BATCH, 2)
    expected = _step(encoder, columns, mini_batch_size=3, reuse_argmax=False)

    def no_host_sized_nonzero(*args, **kwargs):
        raise AssertionError("a record was compacted with a host-sized nonzero (a device sync)")

    with monkeypatch.context() as patched:  # Step (1) only: the CPU reference backward uses nonzero
        patched.setattr(torch.Tensor, "nonzero", no_host_sized_nonzero)
        _, replay_state = GradCache(encoder, mini_batch_size=3, reuse_argmax=True).encode(columns)
    records = [mb.memo._records[0] for mbs in replay_state.mini_batches.values() for mb in mbs]
    assert len(records) == 6
    assert all(r.positions is not None and r._dense is None for r in records[:-1])  # compacted
    assert records[-1].positions is None and records[-1]._dense is not None  # the last: still dense
    last = weakref.ref(records[-1])
    del records, replay_state  # a step abandoned before its replay: its dense record goes with it
    gc.collect()
    assert last() is None
    got = _step(encoder, columns, mini_batch_size=3, reuse_argmax=True)
    assert torch.equal(got[0], expected[0])
    _assert_bitwise_equal(got[1], expected[1])


def test_records_belong_to_their_step(config) -> None:
    """Each Step (1) owns its records (no state shared between steps or engines): another engine's Step (1)
    run in between leaves this step's last record dense (it neither compacts it nor waits on its count),
    and this step's replay still takes it back."""
    encoder = _encoder(config, bias_shift=0.3)
    columns = make_columns(BATCH, 2)
    engine = GradCache(encoder, mini_batch_size=3, reuse_argmax=True)
    reps, replay_state = engine.encode(columns)
    last = [mb.memo for mbs in replay_state.mini_batches.values() for mb in mbs][-1]
    GradCache(encoder, mini_batch_size=3, reuse_argmax=True).encode(columns)
    assert last._records[0]._dense is not None  # still dense: untouched by the other step
    _, rep_grads = engine.rep_gradients(reps, _loss())
    engine.replay(replay_state, rep_grads)
    assert last.fully_taken and not bool(last.differs())


@pytest.mark.gpu
def test_reuse_argmax_syncs_do_not_grow_with_the_mini_batches(config) -> None:
    """On CUDA, a step's host-device synchronisations are per step and per column, never per mini-batch
    (torch.cuda.set_sync_debug_mode counts them). At 8 mini-batches per column instead of 2, one sync per
    mini-batch in even one column would add 6; the counts must differ by less (measured on an H100:
    6 at 8 mini-batches, 7 at 2, the odd one not per mini-batch)."""
    import warnings

    encoder = _encoder(config, bias_shift=0.3).cuda()
    columns = {c: {k: v.cuda() for k, v in f.items()} for c, f in make_columns(BATCH, 3).items()}
    counts = []
    for mini_batch_size in (4, 1):
        _step(encoder, columns, mini_batch_size=mini_batch_size, reuse_argmax=True)  # warm-up (Triton)
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                _step(encoder, columns, mini_batch_size=mini_batch_size, reuse_argmax=True)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        counts.append(sum("synchronizing" in str(w.message) for w in caught))
    # Every step syncs at least once (the replay check reads its fingerprints back): a count of 0 means the
    # debug mode counted nothing, and the comparison below would pass on nothing measured.
    assert min(counts) > 0, counts
    assert abs(counts[1] - counts[0]) < 6, counts


def test_changed_backbone_between_steps_is_detected_and_grads_restored(config) -> None:
    """A backbone weight changed between Step (1) and Step (3): the replayed head's input differs, so the
    replay check raises (although the rebuilt reps equal Step (1)'s) and .grad is left as it was."""
    encoder = _encoder(config)
    engine = GradCache(encoder, mini_batch_size=3, reuse_argmax=True)
    reps, replay_state = engine.encode(make_columns(BATCH, 2))
    _, rep_grads = engine.rep_gradients(reps, _loss())
    before = saved_grads(encoder)
    with torch.no_grad():
        encoder.model.bert.encoder.layer[0].output.dense.weight.mul_(1.5)
    with pytest.raises(RuntimeError, match=r"did not reproduce Step \(1\)"):
        engine.replay(replay_state, rep_grads)
    assert_grads_unchanged(encoder, before)


def _nudge(tensor: Tensor, index: int, how: str) -> None:
    """Change one entry of a head parameter in place: by one ulp (below what an fp32 sum of the tensor can
    resolve) or by 0.5; through ``.data`` (which bumps no version counter) or the tensor itself."""
    flat = tensor.data.view(-1) if how == "data" else tensor.view(-1)
    with torch.no_grad():
        value = flat[index]
        flat[index] = torch.nextafter(value, value + 1) if how == "ulp" else value + 0.5


@pytest.mark.parametrize(
    ("parameter", "how", "autocast", "reuse_argmax"),
    [
        ("weight", "add", False, True),
        ("weight", "data", True, True),
        ("bias", "add", True, True),
        ("bias", "ulp", False, True),  # the digest's guarantee; the reps' row sums may absorb one ulp
        ("weight", "add", False, False),
        ("bias", "add", False, False),
    ],
)
def test_head_weight_changed_between_steps_is_detected_and_grads_restored(
    config, parameter: str, how: str, autocast: bool, reuse_argmax: bool
) -> None:
    """The decoder weight or bias changed between Step (1) and Step (3), at a token absent from the batch
    (so the head's hidden states are unchanged), in place or through ``.data``, in fp32 or under bf16
    autocast: with reuse_argmax on, as with it off, the replay check raises and .grad is left as it was."""
    encoder = _encoder(config, bias_shift=0.3)
    columns = make_columns(BATCH, 2)
    present = set(torch.cat([c["input_ids"].reshape(-1) for c in columns.values()]).tolist())
    token = next(t for t in range(encoder.vocab_size) if t not in present)
    tensor = getattr(encoder.head, parameter)
    index = token * tensor.shape[1] + 3 if tensor.ndim == 2 else token
    engine = GradCache(encoder, mini_batch_size=3, reuse_argmax=reuse_argmax)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        reps, replay_state = engine.encode(columns)
    _, rep_grads = engine.rep_gradients(reps, _loss())
    before = saved_grads(encoder)
    _nudge(tensor, index, how)
    with pytest.raises(RuntimeError, match=r"did not reproduce Step \(1\)"):
        engine.replay(replay_state, rep_grads)
    assert_grads_unchanged(encoder, before)


def test_unchanged_head_weights_under_autocast_give_the_full_replays_gradients(config) -> None:
    """Under bf16 autocast (the head reads a cast copy of its weight, made anew in each pass) the checked
    replay with reuse_argmax passes and equals the step without it bitwise."""
    encoder = _encoder(config, bias_shift=0.3)
    columns = make_columns(BATCH, 2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = _step(encoder, columns, mini_batch_size=3, reuse_argmax=False)
        got = _step(encoder, columns, mini_batch_size=3, reuse_argmax=True)
    assert torch.equal(got[0], expected[0])
    _assert_bitwise_equal(got[1], expected[1])


class _HeadCalls(nn.Module):
    """A SpladeEncoder whose forward calls its head ``first`` times without a graph and ``replayed`` times
    with one (their sum is returned), to test a replay that does not follow Step (1)'s path."""

    def __init__(self, encoder: SpladeEncoder, first: int, replayed: int) -> None:
        super().__init__()
        self.encoder, self.first, self.replayed = encoder, first, replayed

    def forward(self, input_ids: Tensor, attention_mask: Tensor, token_type_ids: Tensor) -> Tensor:
        hidden = self.encoder.token_hidden_states(input_ids, attention_mask, token_type_ids)
        calls = self.replayed if torch.is_grad_enabled() else self.first
        return sum(self.encoder.head(hidden, attention_mask.bool()) for _ in range(calls))


@pytest.mark.parametrize(
    ("first", "replayed", "match"), [(1, 2, "asked for record 2"), (2, 1, "fewer of its 2")]
)
def test_replay_taking_another_path_raises(config, first: int, replayed: int, match: str) -> None:
    """A replay that calls the head more (or fewer) times than Step (1) raises naming it, .grad restored."""
    encoder = _HeadCalls(_encoder(config), first, replayed)
    before = saved_grads(encoder)
    with pytest.raises(RuntimeError, match=match):
        GradCache(encoder, mini_batch_size=4, reuse_argmax=True).step(make_columns(BATCH, 2), _loss())
    assert_grads_unchanged(encoder, before)


def test_encoder_without_a_sparton_head_warns_and_runs_as_without_the_option(config) -> None:
    """An encoder with the plain SPLADE head records nothing: one warning, then the full replay, with the
    gradients of the step without the option."""
    encoder = make_encoder(config)
    columns = make_columns(BATCH, 2)
    loss, grads = _step(encoder, columns, mini_batch_size=3)
    with pytest.warns(UserWarning, match="recorded nothing to reuse"):
        reused_loss, reused_grads = _step(encoder, columns, mini_batch_size=3, reuse_argmax=True)
    assert torch.equal(reused_loss, loss)
    _assert_bitwise_equal(reused_grads, grads)


def test_reuse_argmax_must_be_a_bool(config) -> None:
    """A non-bool reuse_argmax is refused when the engine is built, naming the argument."""
    with pytest.raises(TypeError, match="reuse_argmax must be a bool"):
        GradCache(_encoder(config), mini_batch_size=3, reuse_argmax="yes")


@pytest.mark.parametrize("path", ["triton", "reference"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_replayed_head_equals_the_forward_op_bitwise(kernel_device, monkeypatch, path, dtype) -> None:
    """The head replayed from its record returns the forward's Y and the same grad_H, grad_E, grad_bias bit
    for bit, on the Triton path (interpreted on CPU) and the reference path; with a fully masked row, a
    NaN logit column and entries whose max is <= 0."""
    from gradcache_sparton.kernels import sparton_ops

    device = kernel_device if path == "triton" else torch.device("cpu")
    monkeypatch.setattr(sparton_ops, "_use_triton", lambda hidden_states: path == "triton")
    generator = torch.Generator().manual_seed(3)
    B, S, D, V = 3, 21, 24, 37
    hidden = torch.randn(B, S, D, generator=generator).to(device, dtype)
    weight = torch.randn(V, D, generator=generator).to(device, dtype)
    bias = (torch.randn(V, generator=generator) - 1.0).to(device)
    bias[5] = float("nan")  # column 5: NaN Y and NaN gradients
    mask = torch.rand(B, S, generator=generator).to(device) > 0.3
    mask[2] = False  # a fully masked row: Y = 0, no gradient
    grad_y = torch.randn(B, V, generator=generator).to(device, dtype)

    memo, results = ArgmaxReuse().memo(), []
    for context in (recording(memo), replaying(memo)):
        leaves = [t.detach().clone().requires_grad_() for t in (hidden, weight, bias)]
        with context:
            y = sparton_head(leaves[0], leaves[1], leaves[2], mask)
        y.backward(grad_y)
        results.append((y.detach(), *(leaf.grad for leaf in leaves)))
    assert memo.fully_taken and not bool(memo.differs())
    for first, replayed in zip(*results, strict=True):
        assert torch.equal(first.nan_to_num(), replayed.nan_to_num())
        assert torch.equal(first.isnan(), replayed.isnan())
    assert bool(results[0][0][2].eq(0).all()) and bool(results[0][0][:2, 5].isnan().all())  # masked row: 0


def test_trainer_reuse_argmax_leaves_the_same_parameters(tokenizer, tmp_path, monkeypatch) -> None:
    """CachedSpladeTrainer with reuse_argmax on (its default) records the head in every Step (1) mini-batch
    and takes every record back, and after 2 SGD steps the parameters are bitwise those of the trainer with
    it off."""
    counts = {"record": 0, "take": 0}
    for method in counts:
        original = getattr(ArgmaxMemo, method)

        def counted(self, *args, _original=original, _method=method):
            counts[_method] += 1
            return _original(self, *args)

        monkeypatch.setattr(ArgmaxMemo, method, counted)
    results = []
    for reuse in (False, None):  # None, the default: on
        model = trainer_model(tokenizer, dropout=0.1)
        args = trainer_args(tmp_path / str(reuse), per_device_batch=4, reuse_argmax=reuse)
        trainer = CachedSpladeTrainer(model, args, train_dataset=trainer_rows(), processing_class=tokenizer)
        trainer.train()
        results.append({name: p.detach().clone() for name, p in model.named_parameters()})
        if reuse is False:
            assert counts == {"record": 0, "take": 0}
    # 2 optimizer steps x 2 accumulation steps x 2 columns (query, positive) x 2 mini-batches of 3 and 1 rows
    assert counts == {"record": 16, "take": 16}
    _assert_bitwise_equal(results[1], results[0])
