"""CachedLoss, the drop-in: ``loss = cached(columns); loss.backward()`` equals uncached training.

Tolerance: fp32, rtol 1e-5 relative to each parameter's largest gradient (see tests/test_engine.py:
mini-batch summation order and trimmed attention move results by <= 1e-6; any lost, doubled or
mis-scaled mini-batch is an O(1) error).
"""

from __future__ import annotations

import copy

import pytest
import torch
from engine_helpers import (
    RecordingEncoder,
    accumulate_earlier_micro_step,
    assert_grads_close,
    assert_grads_unchanged,
    contrastive_flops_loss,
    enable_checkpointing,
    failing_encoder,
    grads_of,
    make_columns,
    make_encoder,
    pairwise_mse_loss,
    per_mini_batch_loss,
    saved_grads,
    small_config,
    uncached_loss,
)

from gradcache_sparton.engine import CachedLoss, LossOutput

RTOL_FP32 = 1e-5  # see the module docstring
BATCH = 8
SGD_LR = 0.1  # test_optimizer_step_matches_uncached: weights move by ~lr·g, well above fp32 ulps


@pytest.fixture
def config(tiny_bert_config):
    return small_config(tiny_bert_config)


def _reference_grads(encoder, columns, loss_fn, **loss_kwargs):
    loss = uncached_loss(encoder, columns, loss_fn, **loss_kwargs)
    loss = loss[0] if isinstance(loss, tuple) else loss
    loss.backward()
    grads = grads_of(encoder)
    encoder.zero_grad()
    return loss.detach(), grads


@pytest.mark.parametrize("n_columns", [2, 3])
def test_cached_loss_matches_full_batch_loss_and_grads(config, n_columns: int) -> None:
    """The drop-in's loss and its backward give the uncached loss and every uncached gradient."""
    encoder = make_encoder(config)
    columns = make_columns(BATCH, n_columns)
    ref_loss, ref_grads = _reference_grads(encoder, columns, contrastive_flops_loss)

    cached = CachedLoss(encoder, contrastive_flops_loss, mini_batch_size=3)
    loss = cached(columns)
    assert isinstance(loss, torch.Tensor) and loss.requires_grad
    loss.backward()

    torch.testing.assert_close(loss.detach(), ref_loss, rtol=RTOL_FP32, atol=0)
    assert_grads_close(grads_of(encoder), ref_grads, rtol=RTOL_FP32)


def test_return_components_gives_detached_components(config) -> None:
    """return_components=True returns LossOutput(loss, components), components detached and equal."""
    encoder = make_encoder(config)
    columns = make_columns(BATCH, 3)
    with torch.no_grad():
        _, ref_components = uncached_loss(encoder, columns, contrastive_flops_loss)

    output = CachedLoss(encoder, contrastive_flops_loss, mini_batch_size=3)(columns, return_components=True)

    assert isinstance(output, LossOutput) and output.loss.requires_grad
    assert output.components.keys() == {"contrastive", "flops"}
    for name, value in output.components.items():
        assert not value.requires_grad
        torch.testing.assert_close(value, ref_components[name], rtol=RTOL_FP32, atol=0)


def test_incoming_gradient_scales_replay(config) -> None:
    """Loss scaling convention: backward of c·loss gives c times the gradients (what GradScaler relies on)."""
    encoder = make_encoder(config)
    columns = make_columns(BATCH, 2)
    _, ref_grads = _reference_grads(encoder, columns, contrastive_flops_loss)

    (0.25 * CachedLoss(encoder, contrastive_flops_loss, mini_batch_size=3)(columns)).backward()

    assert_grads_close(grads_of(encoder), {k: 0.25 * g for k, g in ref_grads.items()}, rtol=RTOL_FP32)


def test_gradient_accumulation_matches_larger_batch(config) -> None:
    """k accumulated cached steps of loss/k equal one uncached step on the k-times-larger batch.

    The loss is a mean of per-example terms, for which accumulation is exact (an in-batch contrastive
    loss over k small batches is a different loss from one over their union).
    """
    k, batch = 3, 4
    encoder = make_encoder(config)
    columns = make_columns(k * batch, 2)
    targets = torch.linspace(0.0, 0.5, k * batch)
    ref_loss, ref_grads = _reference_grads(encoder, columns, pairwise_mse_loss, targets=targets)

    cached = CachedLoss(encoder, pairwise_mse_loss, mini_batch_size=3)
    total = 0.0
    for step in range(k):
        rows = slice(step * batch, (step + 1) * batch)
        part = {name: {f: v[rows] for f, v in features.items()} for name, features in columns.items()}
        loss = cached(part, targets=targets[rows]) / k  # what Trainer does with gradient_accumulation_steps
        loss.backward()
        total += float(loss.detach())

    torch.testing.assert_close(torch.tensor(total), ref_loss, rtol=RTOL_FP32, atol=0)
    assert_grads_close(grads_of(encoder), ref_grads, rtol=RTOL_FP32)


def test_grad_scaler_path_matches_unscaled(config) -> None:
    """scaler.scale(loss).backward() then unscale_ gives the uncached gradients, and the step is taken."""
    encoder = make_encoder(config)
    columns = make_columns(BATCH, 2)
    _, ref_grads = _reference_grads(encoder, columns, contrastive_flops_loss)
    optimizer = torch.optim.SGD(encoder.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    before = copy.deepcopy(encoder.state_dict())

    cached = CachedLoss(encoder, contrastive_flops_loss, mini_batch_size=3, allow_non_finite=True)
    scaler.scale(cached(columns)).backward()
    scaler.unscale_(optimizer)
    assert_grads_close(grads_of(encoder), ref_grads, rtol=RTOL_FP32)
    scaler.step(optimizer)
    scaler.update()

    assert scaler.get_scale() == 2.0**10
    assert not torch.equal(
        encoder.state_dict()["mlm.cls.predictions.bias"], before["mlm.cls.predictions.bias"]
    )


def _poisoned_loss(reps, *, poison: bool):
    loss, components = contrastive_flops_loss(reps)
    if poison:
        # sqrt at 0 has an infinite derivative: a finite loss with NaN gradients for the query reps.
        loss = loss + torch.sqrt(reps["query"] * 0.0).sum()
    return loss, components


def test_grad_scaler_skips_non_finite_step(config) -> None:
    """With allow_non_finite, NaN rep gradients reach the parameters; GradScaler skips the step as usual."""
    encoder = make_encoder(config)
    columns = make_columns(4, 2)
    optimizer = torch.optim.SGD(encoder.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    before = copy.deepcopy(encoder.state_dict())

    cached = CachedLoss(encoder, _poisoned_loss, mini_batch_size=3, allow_non_finite=True)
    scaler.scale(cached(columns, poison=True)).backward()
    scaler.step(optimizer)
    scaler.update()

    assert scaler.get_scale() == 2.0**9
    for name, value in encoder.state_dict().items():
        assert torch.equal(value, before[name]), name


def test_non_finite_rep_gradient_raises_in_backward_without_scaler(config) -> None:
    """Without allow_non_finite, backward stops before Step (3) naming the column; no gradient lands."""
    encoder = make_encoder(config)
    loss = CachedLoss(encoder, _poisoned_loss, mini_batch_size=3)(make_columns(4, 2), poison=True)
    with pytest.raises(FloatingPointError, match="the gradient of column 'query'"):
        loss.backward()
    assert all(p.grad is None for p in encoder.parameters())


def test_optimizer_step_matches_uncached(config) -> None:
    """An SGD step after the drop-in's backward leaves the model as the uncached step does.

    Bound, per parameter p (fp32): each side computes fl(w - lr·g), so the two results differ by at
    most lr·|g_cached - g_uncached| plus one rounding of each update, ≤ 2^-24·|w| each. The gradients
    agree within RTOL_FP32 · scale_p (the engine's exactness invariant, see assert_grads_close; scale_p
    is the parameter's largest reference gradient), so |Δw| ≤ lr·RTOL_FP32·scale_p + 2^-23·max|w_p|.
    SGD, not AdamW: Adam's first step moves a weight by lr·g/(|g| + eps), whose derivative in g,
    lr·eps/(|g| + eps)², is ~1e5 near g = 0 and turns fp32 summation noise of ~1e-12 in the
    (exactly zero) attention key bias gradients into weight differences of ~2e-7 that depend on the
    CPU's summation order. A gradient mis-scaled by 2 moves its largest entry by lr·scale_p, 1e5 times
    the first term of the bound: the control at the end checks that this comparison rejects it.
    """
    cached_model = make_encoder(config)
    uncached_model = copy.deepcopy(cached_model)
    initial = copy.deepcopy(cached_model.state_dict())
    columns = make_columns(BATCH, 3)
    CachedLoss(cached_model, contrastive_flops_loss, mini_batch_size=3)(columns).backward()
    uncached_loss(uncached_model, columns, contrastive_flops_loss)[0].backward()
    ref_grads = grads_of(uncached_model)
    for model in (cached_model, uncached_model):
        torch.optim.SGD(model.parameters(), lr=SGD_LR).step()

    def mismatches(params: dict[str, torch.Tensor]) -> list[str]:
        largest = max(float(g.abs().max()) for g in ref_grads.values())
        bad = []
        for name, expected in uncached_model.state_dict().items():
            if name not in ref_grads:  # buffers (position ids)
                continue
            scale = max(float(ref_grads[name].abs().max()), 1e-6 * largest)
            atol = SGD_LR * RTOL_FP32 * scale + 2.0**-23 * float(expected.abs().max())
            if not torch.allclose(params[name], expected, rtol=0, atol=atol):
                bad.append(name)
        return bad

    assert mismatches(dict(cached_model.state_dict())) == []
    assert any(not torch.equal(value, initial[name]) for name, value in cached_model.state_dict().items())
    # The control: the step a 2x mis-scaled gradient would have taken fails the comparison.
    doubled = {name: initial[name] - 2 * SGD_LR * grad for name, grad in ref_grads.items()}
    assert mismatches(doubled) != []


@pytest.mark.parametrize("use_reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_gradient_checkpointing_matches_uncached(config, use_reentrant: bool) -> None:
    """With dropout and gradient checkpointing (either torch variant), gradients equal uncached ones.

    The reference runs without checkpointing, mini-batch by mini-batch from the same seed, so it draws
    the same dropout masks (see tests/test_engine.py::test_cached_dropout_matches_per_mini_batch_reference).
    """
    encoder = make_encoder(config, train=True)
    columns = make_columns(BATCH, 2)
    torch.manual_seed(5)
    ref_loss, _ = per_mini_batch_loss(encoder, columns, contrastive_flops_loss, 3)
    ref_loss.backward()
    ref_grads = grads_of(encoder)
    encoder.zero_grad()

    enable_checkpointing(encoder.mlm, use_reentrant=use_reentrant)
    torch.manual_seed(5)
    loss = CachedLoss(encoder, contrastive_flops_loss, mini_batch_size=3)(columns)
    loss.backward()

    torch.testing.assert_close(loss.detach(), ref_loss.detach(), rtol=RTOL_FP32, atol=0)
    assert_grads_close(grads_of(encoder), ref_grads, rtol=RTOL_FP32)


def test_two_forwards_before_one_backward(config) -> None:
    """Two cached losses summed and backpropagated once each replay their own batch (nothing clobbered)."""
    encoder = make_encoder(config)
    first, second = make_columns(BATCH, 2, seed=1), make_columns(5, 2, seed=2)
    ref_first = uncached_loss(encoder, first, contrastive_flops_loss)[0]
    ref_second = uncached_loss(encoder, second, contrastive_flops_loss)[0]
    (ref_first + ref_second).backward()
    ref_grads = grads_of(encoder)
    encoder.zero_grad()

    cached = CachedLoss(encoder, contrastive_flops_loss, mini_batch_size=3)
    loss_first, loss_second = cached(first), cached(second)
    (loss_first + loss_second).backward()

    torch.testing.assert_close(loss_second.detach(), ref_second.detach(), rtol=RTOL_FP32, atol=0)
    assert_grads_close(grads_of(encoder), ref_grads, rtol=RTOL_FP32)


def test_call_under_no_grad_computes_loss_without_graph(config) -> None:
    """Under torch.no_grad (evaluation) the drop-in returns the full-batch loss and keeps no graph."""
    encoder = make_encoder(config)
    columns = make_columns(BATCH, 2)
    with torch.no_grad():
        ref_loss, _ = uncached_loss(encoder, columns, contrastive_flops_loss)
        loss = CachedLoss(encoder, contrastive_flops_loss, mini_batch_size=3)(columns)
    assert not loss.requires_grad
    torch.testing.assert_close(loss, ref_loss, rtol=RTOL_FP32, atol=0)


def test_progress_bar_covers_both_passes(config, capsys) -> None:
    """show_mini_batch_progress=True draws a tqdm bar over the mini-batches of Step (1) and of Step (3)."""
    encoder = make_encoder(config)
    CachedLoss(encoder, contrastive_flops_loss, mini_batch_size=3, show_mini_batch_progress=True)(
        make_columns(BATCH, 2)
    ).backward()
    err = capsys.readouterr().err
    assert "Step (1) encode" in err and "6/6" in err
    assert "Step (3) replay" in err


def test_bad_loss_fn_raises(config) -> None:
    """A loss_fn that is not callable is refused at construction, naming the argument."""
    with pytest.raises(TypeError, match="loss_fn must be callable"):
        CachedLoss(make_encoder(config), "infonce", mini_batch_size=2)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)], ids=["cpu", "cuda"])
def test_drop_in_backward_replays_dropout_and_autocast_bitwise(config, device: str) -> None:
    """Through loss.backward() (on CUDA: the autograd engine's own thread), with dropout and bf16
    autocast, every Step (3) rep equals its Step (1) rep bit for bit."""
    encoder = RecordingEncoder(make_encoder(config, train=True)).to(device)
    columns = {n: {k: v.to(device) for k, v in f.items()} for n, f in make_columns(BATCH, 3).items()}
    cached = CachedLoss(encoder, contrastive_flops_loss, mini_batch_size=3)
    with torch.autocast(device, dtype=torch.bfloat16):
        loss = cached(columns)
    loss.backward()

    first, replayed = encoder.outputs(with_graph=False), encoder.outputs(with_graph=True)
    assert len(first) == len(replayed) == 9  # 3 columns x 3 mini-batches
    # The reps' dtype cannot show the autocast state (CUDA autocast runs log1p in fp32, CPU's in bf16):
    # the encoder records the autocast dtype it ran under.
    assert encoder.autocast_dtypes(with_graph=False) == [torch.bfloat16] * 9
    assert encoder.autocast_dtypes(with_graph=True) == [torch.bfloat16] * 9
    for rep_1, rep_3 in zip(first, replayed, strict=True):
        assert rep_3.dtype == rep_1.dtype
        assert torch.equal(rep_1, rep_3)


@pytest.mark.gpu
def test_fp16_grad_scaler_step_on_cuda(config) -> None:
    """fp16 autocast + GradScaler on CUDA: the cached step gives finite gradients and is taken."""
    encoder = make_encoder(config, train=True).cuda()
    columns = {n: {k: v.cuda() for k, v in f.items()} for n, f in make_columns(BATCH, 3).items()}
    optimizer = torch.optim.AdamW(encoder.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**10)
    before = copy.deepcopy(encoder.state_dict())
    cached = CachedLoss(encoder, contrastive_flops_loss, mini_batch_size=3, allow_non_finite=True)

    with torch.autocast("cuda", dtype=torch.float16):
        loss = cached(columns)
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    assert all(torch.isfinite(p.grad).all() for p in encoder.parameters() if p.grad is not None)
    scaler.step(optimizer)
    scaler.update()

    assert scaler.get_scale() == 2.0**10
    assert not torch.equal(
        encoder.state_dict()["mlm.cls.predictions.bias"], before["mlm.cls.predictions.bias"]
    )


@pytest.mark.parametrize("accumulated", [False, True], ids=["fresh", "accumulated"])
@pytest.mark.parametrize("kind", ["exception", "oom-in-backward"])
def test_backward_failing_midway_restores_grads(config, kind: str, accumulated: bool) -> None:
    """loss.backward() whose replay fails in mini-batch 4 of 6 leaves every .grad as before it (None stays
    None, accumulated gradients bitwise, the same tensors), and raises the encoder's error with a note."""
    encoder = failing_encoder(config, kind)
    if accumulated:
        accumulate_earlier_micro_step(encoder.encoder)
    before = saved_grads(encoder)

    loss = CachedLoss(encoder, contrastive_flops_loss, mini_batch_size=3)(make_columns(BATCH, 2))
    with pytest.raises(type(encoder.error)) as caught:
        loss.backward()

    assert caught.value is encoder.error and encoder.replays == 4
    assert any("mini-batch 4 of 6" in note and "restored" in note for note in caught.value.__notes__)
    assert_grads_unchanged(encoder, before)


def test_mode_change_between_forward_and_backward_is_detected(config) -> None:
    """model.eval() between the cached forward and its backward (dropout then replays off) raises naming the
    likely causes, and leaves .grad as it was (None); with check_replay=False it goes through silently."""
    encoder = make_encoder(config, train=True)
    columns = make_columns(BATCH, 2)
    loss = CachedLoss(encoder, contrastive_flops_loss, mini_batch_size=3)(columns)
    encoder.eval()
    with pytest.raises(RuntimeError, match=r"did not reproduce Step \(1\).*train/eval mode"):
        loss.backward()
    assert all(p.grad is None for p in encoder.parameters())

    encoder.train()
    unchecked = CachedLoss(encoder, contrastive_flops_loss, mini_batch_size=3, check_replay=False)(columns)
    encoder.eval()
    unchecked.backward()  # the switch: wrong gradients, no error (what the check exists to prevent)
    assert all(p.grad is not None for p in encoder.parameters())


def test_parameters_modified_between_forward_and_backward_are_detected(config) -> None:
    """An optimizer step between the cached forward and its backward (replay on other weights) raises, and the
    accumulated gradients are restored bitwise."""
    encoder = make_encoder(config)
    accumulate_earlier_micro_step(encoder)
    before = saved_grads(encoder)
    loss = CachedLoss(encoder, contrastive_flops_loss, mini_batch_size=3)(make_columns(BATCH, 2))
    torch.optim.SGD(encoder.parameters(), lr=1e-3).step()  # in place, between forward and backward
    with pytest.raises(RuntimeError, match=r"did not reproduce Step \(1\).*modified in place"):
        loss.backward()
    assert_grads_unchanged(encoder, before)


def test_engine_options_go_to_the_engine(config) -> None:
    """Keywords beyond mini_batch_size reach GradCache unchanged; an unknown one is refused, naming it."""
    encoder = make_encoder(config)
    cached = CachedLoss(
        encoder, contrastive_flops_loss, mini_batch_size=2, mini_batch_tokens=50, check_replay=False
    )
    assert (cached.engine.config.mini_batch_tokens, cached.engine.config.check_replay) == (50, False)
    assert cached.engine.encoder is encoder and cached.engine.config.mini_batch_size == 2
    with pytest.raises(TypeError, match="mini_batch_chunks"):
        CachedLoss(encoder, contrastive_flops_loss, mini_batch_size=2, mini_batch_chunks=3)


def test_token_budget_cached_loss_matches_full_batch(config) -> None:
    """The drop-in with token-budget mini-batches gives the uncached loss and every uncached gradient."""
    encoder = make_encoder(config)
    columns = make_columns(BATCH, 3)
    ref_loss, ref_grads = _reference_grads(encoder, columns, contrastive_flops_loss)

    loss = CachedLoss(encoder, contrastive_flops_loss, mini_batch_size=8, mini_batch_tokens=25)(columns)
    loss.backward()

    torch.testing.assert_close(loss.detach(), ref_loss, rtol=RTOL_FP32, atol=0)
    assert_grads_close(grads_of(encoder), ref_grads, rtol=RTOL_FP32)
