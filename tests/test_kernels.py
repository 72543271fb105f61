"""Sparton head: the reference against naive full logits, the Triton kernels against the reference,
the module / custom op on CPU, torch.compile, and input validation.

Legend: B batch, S sequence, D hidden, V vocabulary.

Kernel tests launch the Triton launchers directly on ``kernel_device`` tensors: compiled on a GPU, through
``TRITON_INTERPRET=1`` on CPU (where the module itself would take the reference path). Shapes are small
but awkward: S and V not multiples of any block, D = 24 or 40 (not a power of two, and 24 < one 16-wide
K step plus a remainder), a fully masked row, padded tails, all-negative columns and ties.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import Tensor, nn

from gradcache_sparton.kernels import (
    SpartonHead,
    sparton_head,
    sparton_head_reference,
    splade_head_materialized,
    splade_max_pool,
)
from gradcache_sparton.kernels.reference import sparton_head_backward_reference

pytestmark = pytest.mark.kernel


# (dtype, rtol of one rounding to the dtype). Kernel and reference form the same exact products (16-bit
# products are exact in fp32) and sum them in fp32 in different orders, so fp32 results agree to ~1e-6
# relative; a 16-bit output is that fp32 value rounded once, so the two may land one unit in the last
# place apart: 2^-7 relative for bf16 (8 significant bits), 2^-10 for fp16 (11). A wrong argmax, mask or
# bias moves values by O(1) and fails any of these.
DTYPES = [
    pytest.param(torch.float32, 1e-5, id="fp32"),
    pytest.param(torch.bfloat16, 2.0**-7, id="bf16"),
    pytest.param(torch.float16, 2.0**-10, id="fp16"),
]
# (B, S, D, V, bias): S, V off every block size, D = 24 / 40.
SHAPES = [
    pytest.param(3, 37, 24, 53, True, id="B3-S37-D24-V53-bias"),
    pytest.param(4, 45, 40, 70, False, id="B4-S45-D40-V70-nobias"),
    pytest.param(5, 29, 24, 53, True, id="B5-S29-D24-V53-bias-short"),  # the GPU's short-sequence tiles
]
# Forward-only shapes for the packed-rows kernel: S = 1 (a 1-wide segment per row), S = 5 and 17 (just
# past a power of two), S = 64 (the largest packed length, exactly a power of two); under the
# interpreter's N = 128 a program packs 128, 16, 4 and 2 rows, so B is never a multiple of G.
SHORT_SHAPES = [
    pytest.param(7, 1, 24, 37, True, id="B7-S1-D24-V37-bias"),
    pytest.param(6, 5, 40, 37, False, id="B6-S5-D40-V37-nobias"),
    pytest.param(5, 17, 24, 53, True, id="B5-S17-D24-V53-bias"),
    pytest.param(3, 64, 24, 37, True, id="B3-S64-D24-V37-bias"),
]
# The two forward kernels: one program per (batch row, V tile) walking S tiles, and the packed-rows
# kernel (G whole rows per product, meant for S <= 64), which the GPU picks for short 16-bit inputs.
# one-row: one NaN-aware launch; two-pass: plain, then redo; both load 16-bit tiles by tensor descriptors
# (TMA) where the inputs allow, as all the tests' 16-bit shapes do; pointers: one-row with pointer loads.
FORWARDS = ["one-row", "two-pass", "pointers", "packed"]


def _inputs(
    B: int, S: int, D: int, V: int, bias: bool, dtype: torch.dtype, device: torch.device, seed: int
) -> tuple[Tensor, Tensor, Tensor | None, Tensor]:
    """Fresh random H, E, bias and a mask with a fully masked row, a padded tail and a hole; the first
    three vocabulary columns are all-negative (their outputs are exactly 0)."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(B, S, D, generator=g)
    h[..., 0] = h[..., 0].abs() + 0.1  # feature 0 is positive everywhere ...
    e = torch.randn(V, D, generator=g) / D**0.5
    e[:3] = 0.0
    e[:3, 0] = -1.0  # ... so columns 0..2 have logits -H[b, s, 0] (+ bias -1) < 0 at every position
    b = torch.randn(V, generator=g) if bias else None
    if b is not None:
        b[:3] = -1.0
    mask = torch.ones(B, S, dtype=torch.long)
    mask[0] = 0  # fully masked row
    mask[1, S // 2 :] = 0  # padded tail
    mask[-1, 3:7] = 0  # a hole in the middle
    cast = lambda t: None if t is None else t.to(device=device, dtype=dtype)
    return cast(h), cast(e), cast(b), mask.to(device)


def _launch_forward(
    h: Tensor,
    e: Tensor,
    b: Tensor | None,
    m: Tensor,
    forward: str = "one-row",
    activation_function: str = "relu",
) -> tuple[Tensor, Tensor, Tensor]:
    from gradcache_sparton.kernels.sparton_blocks import _FWD_INTERPRET, _FWD_PACKED_INTERPRET
    from gradcache_sparton.kernels.sparton_forward import sparton_forward

    # on a GPU the interpreter's small tiles are valid too (N = 128, 16-wide K): same kernels, same code
    act = {"activation_function": activation_function}
    if forward == "packed":
        return sparton_forward(h, e, b, m, blocks=_FWD_PACKED_INTERPRET, **act)
    if forward == "pointers":
        return sparton_forward(h, e, b, m, blocks=replace(_FWD_INTERPRET, tma=False), two_pass=False, **act)
    return sparton_forward(h, e, b, m, blocks=_FWD_INTERPRET, two_pass=forward == "two-pass", **act)


def _launch_backward(
    g: Tensor,
    h: Tensor,
    e: Tensor,
    mx: Tensor,
    arg: Tensor,
    path: str = "by-density",
    activation_function: str = "relu",
) -> tuple[Tensor, Tensor, Tensor]:
    from gradcache_sparton.kernels.sparton_backward import sparton_backward
    from gradcache_sparton.kernels.sparton_blocks import _BWD_INTERPRET

    # The backward's kernels forced, or chosen by the density of Y (the default blocks' rule). All the
    # tests' S are short (<= 64): short_s = 0 forces the longer sequences' kernels (which the default
    # blocks give fp32 inputs whatever S). Sparse regime: grad_E by column (4 non-zeros per step),
    # grad_H's rows from the column layout (short) or by a sort of all B·V keys (long); dense regime:
    # grad_E's b loop (2 rows per step, so B = 3 and 5 end on a partial step), grad_H on the tensor
    # cores (short) or by the sorted rows (long).
    below, short_s = {
        "by-density": (0.25, 64),
        "sparse-short": (2.0, 64),
        "sparse-long": (2.0, 0),
        "dense-short": (0.0, 64),
        "dense-long": (0.0, 0),
    }[path]
    blocks = replace(_BWD_INTERPRET, by_column_below=below, short_s=short_s)
    return sparton_backward(g, h, e, mx, arg, blocks=blocks, activation_function=activation_function)


# The backward's paths: the sparse regime's and the dense regime's, each for short and longer sequences.
BACKWARD_PATHS = ["sparse-short", "sparse-long", "dense-short", "dense-long"]


def _top2_gap(h: Tensor, e: Tensor, b: Tensor | None, m: Tensor) -> Tensor:
    """[B, V] fp64 gap between the largest and second-largest masked logit (ties and near-ties: small)."""
    logits = h.double() @ e.double().T + (b.double() if b is not None else 0)
    logits = logits.masked_fill(~m.bool()[:, :, None], float("-inf"))
    logits = torch.cat([logits, torch.full_like(logits[:, :1], float("-inf"))], dim=1)  # S = 1 has no second
    top = logits.topk(2, dim=1).values  # [B, 2, V]
    return (top[:, 0] - top[:, 1]).nan_to_num(0.0)


# ---------------------------------------------------------------------------------------------------
# Reference
# ---------------------------------------------------------------------------------------------------


def test_reference_matches_naive_full_logits_fp64() -> None:
    """The chunked reference equals the full-logits head (splade_head_materialized), forward and all
    gradients, in fp64."""
    h, e, b, m = _inputs(3, 29, 24, 41, True, torch.float64, torch.device("cpu"), seed=1)
    h, e, b = (t.requires_grad_() for t in (h, e, b))
    g = torch.randn(3, 41, dtype=torch.float64)
    # chunk_elements forces ~6 vocabulary chunks, so chunk boundaries are exercised.
    y = sparton_head_reference(h, e, b, m, chunk_elements=3 * 29 * 7)
    y_naive = splade_head_materialized(h, e, b, m)
    torch.testing.assert_close(y, y_naive, rtol=1e-12, atol=1e-12)
    assert (y[0] == 0).all() and (y[:, :3] == 0).all()  # fully masked row, all-negative columns
    grads = torch.autograd.grad(y, (h, e, b), g)
    grads_naive = torch.autograd.grad(y_naive, (h, e, b), g)
    for got, want in zip(grads, grads_naive, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_materialized_head_is_the_usual_splade_pooling() -> None:
    """splade_max_pool equals log1p(relu(logits)) · mask max-pooled (as SPLADE code writes it), values and
    gradients, and sends a tie's whole gradient to its first position (the kernels' rule, not amax's)."""
    g = torch.Generator().manual_seed(14)
    logits = torch.randn(3, 9, 7, generator=g, dtype=torch.float64)
    logits[:, 2] = logits[:, 2].abs() + 3.0
    logits[:, 6] = logits[:, 2]  # positions 2 and 6 tie for the max everywhere
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[0] = 0
    mask[1, 5:] = 0
    x = logits.clone().requires_grad_()
    y = splade_max_pool(x, mask)
    usual = (torch.log1p(torch.relu(x)) * mask[:, :, None]).max(dim=1).values
    torch.testing.assert_close(y, usual, rtol=0, atol=0)
    grad = torch.randn(3, 7, generator=g, dtype=torch.float64)
    (got,) = torch.autograd.grad(y, x, grad)
    (want,) = torch.autograd.grad(usual, x, grad)
    assert torch.equal(got, want) and (got[2, 2] != 0).all() and (got[:, 6] == 0).all()


def test_reference_and_cpu_op_pass_gradcheck() -> None:
    """Finite differences agree with the reference's autograd and with the head's CPU backward."""
    h, e, b, m = _inputs(2, 7, 5, 9, True, torch.float64, torch.device("cpu"), seed=2)
    h, e, b = (t.requires_grad_() for t in (h, e, b))
    assert torch.autograd.gradcheck(lambda *a: sparton_head_reference(*a, m), (h, e, b))
    assert torch.autograd.gradcheck(lambda *a: sparton_head(*a, m), (h, e, b))


def test_reference_is_exact_under_tf32_without_touching_it(monkeypatch) -> None:
    """With the process asking for reduced fp32 matmul precision, the fp32 reference is computed in fp64
    (exact products) and leaves the switch as it found it: no global state, no fixture needed."""
    h, e, b, m = _inputs(2, 9, 24, 11, True, torch.float64, torch.device("cpu"), seed=15)
    want = sparton_head_reference(h, e, b, m).float()
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "high")
    got = sparton_head_reference(h.float(), e.float(), b.float(), m)
    # Y = log1p(the fp64 max rounded to fp32), in fp32: the max's rounding (2^-24 relative, not amplified:
    # x / ((1 + x) log1p(x)) <= 1), fp32 log1p (about an ulp, 2^-23) and Y's rounding (2^-24) add to 2^-22.
    torch.testing.assert_close(got, want, rtol=2.0**-22, atol=0)
    assert torch.get_float32_matmul_precision() == "high" and not torch.backends.cuda.matmul.allow_tf32


def test_reference_y_is_log1p_of_its_fp32_max_when_it_sums_in_fp64(monkeypatch) -> None:
    """Where the fp32 reference sums in fp64 (on CUDA, or under a lowered matmul precision), a logit past
    fp32's range makes the saved max +inf and Y = log1p(max) +inf with it, as in the kernels (which sum in
    fp32): not log1p(1e50) = 115 from the unrounded fp64 max."""
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "high")
    h, e, b, m = _inputs(2, 9, 24, 11, True, torch.float32, torch.device("cpu"), seed=16)
    m[1, 4] = 1
    h[1, 4, 3] = 1e30
    e[2:5, 3] = 1e20  # logits 1e50 in columns 2..4 of row 1
    y, mx, _ = sparton_head_reference(h, e, b, m, return_argmax=True)
    assert mx[1, 2:5].isposinf().all() and y[1, 2:5].isposinf().all()
    assert y[0].isfinite().all() and torch.equal(y, torch.log1p(mx))


def test_reference_ties_send_gradient_to_first_position() -> None:
    """On tied maxima the reference picks and differentiates only the first sequence position."""
    h, e, b, m = _inputs(2, 9, 6, 11, False, torch.float64, torch.device("cpu"), seed=3)
    h[:, 6] = h[:, 2]  # positions 2 and 6 produce identical logits everywhere
    h[:, 2, 0] = h[:, 2, 0] + 50.0  # ... and dominate every column with E[v, 0] > 0
    h[:, 6, 0] = h[:, 2, 0]
    h.requires_grad_()
    _, mx, arg = sparton_head_reference(h, e, b, m, return_argmax=True)
    live = (mx > 0) & (e[:, 0] > 0)[None, :] & (m[:, 2] == 1)[:, None]
    assert live.any() and (arg[live] == 2).all()
    y = sparton_head_reference(h, e, b, m)
    (grad_h,) = torch.autograd.grad(y.sum(), h)
    assert (grad_h[:, 6] == 0).all() and (grad_h[1:, 2] != 0).any()


# ---------------------------------------------------------------------------------------------------
# Triton kernels (interpreter on CPU, compiled on GPU)
# ---------------------------------------------------------------------------------------------------


def _forward_cases() -> list:
    """Every SHAPES entry through both forward kernels; the short shapes through the packed one."""
    cases = [pytest.param(f, *shape.values, id=f"{f}-{shape.id}") for f in FORWARDS for shape in SHAPES]
    return cases + [pytest.param("packed", *shape.values, id=f"packed-{shape.id}") for shape in SHORT_SHAPES]


@pytest.mark.parametrize(("dtype", "rtol"), DTYPES)
@pytest.mark.parametrize(("forward", "B", "S", "D", "V", "bias"), _forward_cases())
def test_triton_forward_matches_reference(kernel_device, dtype, rtol, forward, B, S, D, V, bias) -> None:
    """Kernel Y and fp32 max equal the reference's; argmax equals wherever the top two are not tied."""
    h, e, b, m = _inputs(B, S, D, V, bias, dtype, kernel_device, seed=10 + B + S)
    y, mx, arg = _launch_forward(h, e, b, m, forward)
    y_ref, mx_ref, arg_ref = sparton_head_reference(h, e, b, m, return_argmax=True)
    assert y.dtype == dtype and mx.dtype == torch.float32 and arg.dtype == torch.int32
    # the fp32 max: same exact products, different summation order (~1e-6 relative at |x| ~ 3).
    torch.testing.assert_close(mx, mx_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y, y_ref, rtol=rtol, atol=1e-6)
    assert (mx[0] == 0).all() and (mx[:, :3] == 0).all()  # fully masked row, all-negative columns
    clear = (mx_ref > 0) & (_top2_gap(h, e, b, m) > 1e-4)
    # most columns are checked, so the test cannot pass vacuously (one position: a logit is > 0 with
    # probability ~1/2, and at S = 1 two of the 7 rows are fully masked)
    assert clear.float().mean() > (0.25 if S == 1 else 0.5)
    assert torch.equal(arg[clear].long(), arg_ref[clear])


def test_forward_loads_by_descriptors_only_where_the_copy_engine_allows(kernel_device) -> None:
    """TMA loads for 16-bit inputs with 16-byte aligned bases and row strides; fp32, a 40-byte row (D = 20)
    and a base 2 bytes off fall back to pointer loads in both forward kernels, with the reference's results."""
    from gradcache_sparton.kernels.sparton_forward import _tma_loads

    h, e, b, m = _inputs(3, 37, 20, 53, True, torch.bfloat16, kernel_device, seed=41)
    h24, e24, _, _ = _inputs(3, 37, 24, 53, True, torch.bfloat16, kernel_device, seed=41)
    shifted = torch.empty(53 * 24 + 1, dtype=torch.bfloat16, device=kernel_device)[1:].view(53, 24)
    shifted.copy_(e24)
    assert _tma_loads(h24, e24)
    assert not _tma_loads(h24.float(), e24.float())
    assert not _tma_loads(h, e)  # D * 2 bytes = 40, not a multiple of 16
    assert not _tma_loads(h24, shifted)  # contiguous, but its base is 2 bytes past an aligned address
    for args in ((h, e, b, m), (h24, shifted, b, m)):
        _, mx_ref, arg_ref = sparton_head_reference(*args, return_argmax=True)
        clear = (mx_ref > 0) & (_top2_gap(*args) > 1e-4)
        assert clear.float().mean() > 0.5
        for forward in ("one-row", "packed"):
            _, mx, arg = _launch_forward(*args, forward)
            torch.testing.assert_close(mx, mx_ref, rtol=1e-5, atol=1e-5)
            assert torch.equal(arg[clear].long(), arg_ref[clear])


def test_forward_kernel_follows_sequence_length(monkeypatch) -> None:
    """On a GPU, 16-bit sequences of up to 64 positions get the packed-rows kernel, longer ones the
    one-row kernel's 256-wide tile; fp32 the one-row kernel's FMA tile whatever S."""
    from gradcache_sparton.kernels import sparton_blocks

    monkeypatch.setattr(sparton_blocks, "interpreting", lambda: False)
    for dtype in (torch.bfloat16, torch.float16):
        for S in (1, 29, 32, 33, 64):
            assert sparton_blocks.default_forward_blocks(dtype, S) == sparton_blocks._FWD_GPU_16BIT_PACKED
        for S in (65, 512):
            assert sparton_blocks.default_forward_blocks(dtype, S).block_s == 256
    for S in (16, 512):
        assert sparton_blocks.default_forward_blocks(torch.float32, S).block_s == 64


def test_forward_launches_follow_the_product_size(monkeypatch) -> None:
    """By default the one-row forward runs as two launches (plain, then redo) from 2^39 multiply-adds on (the
    measured shapes: B 128 S 256 and larger, not B 32 S 256), one NaN-aware launch below; packed always one."""
    from gradcache_sparton.kernels import sparton_blocks, sparton_forward

    assert sparton_blocks.two_pass_forward(128, 256, 768, 30522)
    assert sparton_blocks.two_pass_forward(16, 512, 2048, 128256)
    assert not sparton_blocks.two_pass_forward(32, 256, 768, 30522)
    passes: list[str] = []
    monkeypatch.setattr(
        sparton_forward, "_forward_one_row", lambda *a, nan_pass, **k: passes.append(nan_pass)
    )
    monkeypatch.setattr(sparton_forward, "two_pass_forward", lambda *shape: shape == (3, 40, 16, 24))
    h, e, b, m = _inputs(3, 40, 16, 24, True, torch.float32, torch.device("cpu"), seed=37)
    from gradcache_sparton.kernels.sparton_blocks import _FWD_INTERPRET

    sparton_forward.sparton_forward(h, e, b, m, blocks=_FWD_INTERPRET)
    sparton_forward.sparton_forward(h[:, :39], e, b, m[:, :39], blocks=_FWD_INTERPRET)
    assert passes == ["plain", "redo", "only"]


@pytest.mark.parametrize("forward", FORWARDS)
def test_triton_forward_ties_pick_first_position(kernel_device, forward) -> None:
    """Exactly tied logits, within one S tile and across tiles (one-row kernel) or within a row's
    segment of the packed tile, resolve to the first position."""
    h, e, b, m = _inputs(2, 37, 24, 53, True, torch.bfloat16, kernel_device, seed=4)
    # positions 3, 5 (same 16-row tile) and 21, 35 (later tiles) carry the same dominant row
    winner = h[:, 3].clone()
    winner[:, 0] = 8.0
    for s in (3, 5, 21, 35):
        h[:, s] = winner
    m[:] = 1
    _, mx, arg = _launch_forward(h, e, b, m, forward)
    _, mx_ref, arg_ref = sparton_head_reference(h, e, b, m, return_argmax=True)
    at_winner = (mx > 0) & (_top2_gap(h, e, b, m) == 0)  # columns where the four copies tie for max
    assert at_winner.sum() > 10
    assert (arg[at_winner] == 3).all() and (arg_ref[at_winner] == 3).all()
    torch.testing.assert_close(mx, mx_ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("path", BACKWARD_PATHS)
@pytest.mark.parametrize(("dtype", "rtol"), DTYPES)
@pytest.mark.parametrize(("B", "S", "D", "V", "bias"), SHAPES)
def test_triton_backward_matches_reference_autograd(
    kernel_device, dtype, rtol, B, S, D, V, bias, path
) -> None:
    """grad_H, grad_E and grad_bias from (max, argmax) equal autograd through the reference, on every
    path of the backward."""
    h, e, b, m = _inputs(B, S, D, V, bias, dtype, kernel_device, seed=20 + B)
    _, mx, arg = _launch_forward(h, e, b, m)
    g = torch.randn(B, V, generator=torch.Generator().manual_seed(5)).to(kernel_device, dtype)
    grad_h, grad_e, grad_b = _launch_backward(g, h, e, mx, arg, path)
    inputs = [t.detach().clone().requires_grad_() for t in (h, e, b) if t is not None]
    y_ref = sparton_head_reference(inputs[0], inputs[1], inputs[2] if bias else None, m)
    want = torch.autograd.grad(y_ref, inputs, g)
    assert grad_h.dtype == dtype and grad_e.dtype == dtype and grad_b.dtype == torch.float32
    for got, ref in zip((grad_h, grad_e, grad_b), want, strict=False):  # no grad_bias without bias
        # one rounding of an fp32 sum (rtol), plus fp32 summation-order differences on entries that
        # cancel towards 0 (atol, relative to the gradient's scale).
        torch.testing.assert_close(got, ref.to(got.dtype), rtol=rtol, atol=1e-5 * ref.abs().max().item())


@pytest.mark.parametrize(("dtype", "rtol"), DTYPES)
@pytest.mark.parametrize("positions", [64, 16], ids=["whole-rows", "s-tiles"])
def test_triton_dense_backward_matches_reference_autograd(kernel_device, dtype, rtol, positions) -> None:
    """The dense (tensor-core, one-hot tile) backward equals autograd through the reference, like the
    sparse one: bf16 coefficients as a hi + lo pair keep 16 bits, far inside one output rounding. With
    64-position products two whole rows of S = 29 share each product (B = 5: a partial last group);
    with 16, each row's S is split into two tiles."""
    from gradcache_sparton.kernels.sparton_backward import sparton_backward
    from gradcache_sparton.kernels.sparton_blocks import DenseBackwardBlocks

    B, S, D, V, bias = SHAPES[2].values
    h, e, b, m = _inputs(B, S, D, V, bias, dtype, kernel_device, seed=25)
    _, mx, arg = _launch_forward(h, e, b, m)
    g = torch.randn(B, V, generator=torch.Generator().manual_seed(26)).to(kernel_device, dtype)
    blocks = DenseBackwardBlocks(16, positions, 16, 1, positions, 16, 16, 1, 1)
    grads = sparton_backward(g, h, e, mx, arg, dense=True, blocks=blocks)
    inputs = [t.detach().clone().requires_grad_() for t in (h, e, b)]
    want = torch.autograd.grad(sparton_head_reference(*inputs, m), inputs, g)
    assert (grads[0][m == 0] == 0).all() and (grads[1][:3] == 0).all()  # masked positions, zero columns
    if dtype == torch.bfloat16:
        # coef kept to 16 bits (hi + lo) moves a sum by ~2^-16, so the bf16 results rarely round other
        # than the sparse backward's (measured 0.2%); coef rounded to bf16 alone (2^-9 per term) flips
        # 28-51% of them.
        sparse = sparton_backward(g, h, e, mx, arg)
        for got, ref in zip(grads[:2], sparse[:2], strict=True):
            assert (got != ref).float().mean() < 0.05
    for got, ref in zip(grads, want, strict=True):
        torch.testing.assert_close(got, ref.to(got.dtype), rtol=rtol, atol=1e-5 * ref.abs().max().item())


@pytest.mark.parametrize(
    ("B", "S", "V", "density"),
    [(5, 7, 83, 0.4), (3, 21, 53, 0.05), (1, 1, 40, 0.9), (4, 64, 33, 1.0)],
    ids=["B5-S7-V83", "B3-S21-V53-sparse", "B1-S1-V40", "B4-S64-V33-dense"],
)
def test_triton_segments_equal_the_stable_sort(kernel_device, B, S, V, density) -> None:
    """The CSR layouts hold exactly the stable argsort of the keys (column v for grad_E, a counting sort;
    row b·S + argmax for grad_H, by a sort of all B·V keys or built from the column layout; zeros
    skipped, NaN coefficients kept) and its segment offsets: the entries of a segment in increasing b
    (columns) or v (rows), the fixed summation order of the backward."""
    from gradcache_sparton.kernels import sparton_backward as backward

    g = torch.Generator().manual_seed(B * 1000 + S)
    coef = torch.randn(B, V, generator=g) * (torch.rand(B, V, generator=g) < density)
    coef[0, 3] = float("nan")
    arg = torch.randint(0, S, (B, V), dtype=torch.int32, generator=g)
    live = int((coef != 0).sum())
    columns = torch.arange(V)[None, :].expand(B, V)
    rows = torch.arange(B)[:, None] * S + arg
    coef_d, arg_d = coef.to(kernel_device), arg.to(kernel_device)
    got_columns = backward.column_segments(coef_d, torch.tensor(live, device=kernel_device), B * V + 1)
    got_rows = backward.row_segments(coef_d, arg_d, S)
    live_d = torch.tensor(live, device=kernel_device)
    got_rows_from_columns = backward.row_segments_from_columns(got_columns[0], arg_d, S, live_d, B * V + 1)
    layouts = ((got_columns, columns, V), (got_rows, rows, B * S), (got_rows_from_columns, rows, B * S))
    for (order, offsets), keys, count in layouts:
        sorted_keys, want = torch.sort(torch.where(coef != 0, keys, count).reshape(-1), stable=True)
        assert torch.equal(order[:live].cpu().long(), want[:live])
        assert torch.equal(offsets.cpu(), torch.searchsorted(sorted_keys, torch.arange(count + 1)))


def test_triton_backward_same_with_narrow_or_wide_indices(kernel_device, monkeypatch) -> None:
    """Bitwise the same gradients (on every path of the backward), NaN planted in a coefficient
    included, with the narrow indices the tests' shapes get (the column layout's int32 b·V + v; grad_H's
    int16 sort keys, B·S < 2^15) and the wide ones of larger shapes (int64; int32 keys)."""
    from gradcache_sparton.kernels import sparton_backward as backward

    h, e, b, m = _inputs(4, 45, 24, 53, True, torch.float32, kernel_device, seed=27)  # B·S = 180 > 2^7
    _, mx, arg = _launch_forward(h, e, b, m)
    g = torch.randn(4, 53, generator=torch.Generator().manual_seed(28)).to(kernel_device)
    g[2, 10] = float("nan")
    for path in BACKWARD_PATHS:
        narrow = _launch_backward(g, h, e, mx, arg, path)[:2]
        with monkeypatch.context() as patch:
            patch.setattr(backward, "_order_dtype", lambda B, V: torch.int64)
            patch.setattr(backward, "INT16_KEYS_BELOW", 0)
            wide = _launch_backward(g, h, e, mx, arg, path)[:2]
        for x, y in zip(narrow, wide, strict=True):
            assert torch.equal(x.isnan(), y.isnan()) and x.isnan().any()
            assert torch.equal(x.nan_to_num(), y.nan_to_num()) and (x.nan_to_num() != 0).any()


def test_triton_backward_follows_the_density_of_y(kernel_device) -> None:
    """By default the backward takes the sparse regime's path (grad_E by column, grad_H's rows from the
    column layout) where under 25% of Y's entries have a non-zero coefficient, and the dense regime's
    elsewhere (grad_E's b loop; at this short S, grad_H on the tensor cores), chosen on the device:
    bitwise the forced path's grad_H and grad_E either way (the paths sum in different orders, and
    differ on these inputs)."""
    V = 211  # ~5 entries per grad_H row: enough for the two paths' summation orders to round apart
    h, e, b, m = _inputs(5, 29, 24, V, True, torch.float32, kernel_device, seed=29)
    _, mx, arg = _launch_forward(h, e, b, m)
    g = torch.randn(5, V, generator=torch.Generator().manual_seed(30)).to(kernel_device)
    sparse = g * (torch.rand(5, V, generator=torch.Generator().manual_seed(31)) < 0.2).to(kernel_device)
    for grad_y, expected in ((g, "dense-short"), (sparse, "sparse-short")):
        density = ((mx > 0) & (grad_y != 0)).float().mean().item()
        assert (density >= 0.25) == (expected == "dense-short"), density
        chosen = _launch_backward(grad_y, h, e, mx, arg, "by-density")[:2]
        forced = {k: _launch_backward(grad_y, h, e, mx, arg, k)[:2] for k in ("sparse-short", "dense-short")}
        assert any(not torch.equal(one, other) for one, other in zip(*forced.values(), strict=True))
        for got, want in zip(chosen, forced[expected], strict=True):
            assert torch.equal(got, want)


def test_triton_backward_takes_the_b_loop_under_by_column_min_b_rows(kernel_device) -> None:
    """Under ``by_column_min_b`` rows the backward takes the dense regime's kernels (grad_E's b loop; at
    this short S, grad_H on the tensor cores) even where Y is sparse: bitwise the forced dense path, and
    not the sparse one's (the two sum in different orders on these inputs)."""
    from gradcache_sparton.kernels.sparton_backward import sparton_backward
    from gradcache_sparton.kernels.sparton_blocks import _BWD_INTERPRET

    V = 211
    h, e, b, m = _inputs(5, 29, 24, V, True, torch.float32, kernel_device, seed=29)
    _, mx, arg = _launch_forward(h, e, b, m)
    g = torch.randn(5, V, generator=torch.Generator().manual_seed(30)).to(kernel_device)
    sparse = g * (torch.rand(5, V, generator=torch.Generator().manual_seed(31)) < 0.2).to(kernel_device)
    few_rows = replace(_BWD_INTERPRET, by_column_min_b=6)  # B = 5
    got = sparton_backward(sparse, h, e, mx, arg, blocks=few_rows)[:2]
    forced = {k: _launch_backward(sparse, h, e, mx, arg, k)[:2] for k in ("sparse-short", "dense-short")}
    assert any(not torch.equal(one, other) for one, other in zip(*forced.values(), strict=True))
    for one, want in zip(got, forced["dense-short"], strict=True):
        assert torch.equal(one, want)


@pytest.mark.parametrize("path", BACKWARD_PATHS)
def test_triton_backward_zero_where_output_zero_or_masked(kernel_device, path) -> None:
    """Masked positions, fully masked rows and all-negative columns get exactly zero gradient."""
    h, e, b, m = _inputs(3, 37, 24, 53, True, torch.float32, kernel_device, seed=6)
    _, mx, arg = _launch_forward(h, e, b, m)
    g = torch.randn(3, 53).to(kernel_device)
    grad_h, grad_e, grad_b = _launch_backward(g, h, e, mx, arg, path)
    assert (grad_h[m == 0] == 0).all()  # includes the fully masked row 0
    assert (grad_e[:3] == 0).all() and (grad_b[:3] == 0).all()
    assert (grad_h[m == 1] != 0).any() and (grad_e[3:] != 0).any()


def test_triton_replay_is_bitwise_deterministic(kernel_device) -> None:
    """Two forwards (and two backwards) of the same input give bitwise identical results."""
    h, e, b, m = _inputs(3, 37, 40, 53, True, torch.bfloat16, kernel_device, seed=7)
    first = _launch_forward(h, e, b, m)
    second = _launch_forward(h, e, b, m)
    for x, y in zip(first, second, strict=True):
        assert torch.equal(x, y)
    g = torch.randn(3, 53).to(kernel_device, torch.bfloat16)
    for x, y in zip(
        _launch_backward(g, h, e, first[1], first[2]),
        _launch_backward(g, h, e, first[1], first[2]),
        strict=True,
    ):
        assert torch.equal(x, y)


@pytest.mark.parametrize("forward", FORWARDS)
def test_triton_accepts_non_contiguous_inputs_and_any_mask_dtype(kernel_device, forward) -> None:
    """Strided H/E views and bool/int32 masks give exactly the results of contiguous int64 inputs."""
    h, e, b, m = _inputs(3, 37, 24, 53, True, torch.float32, kernel_device, seed=8)
    h_view = h.transpose(0, 1).contiguous().transpose(0, 1)  # [B, S, D] with S-major strides
    e_view = e.T.contiguous().T  # [V, D] column-major
    assert not h_view.is_contiguous() and not e_view.is_contiguous()
    want = _launch_forward(h, e, b, m, forward)
    for mask in (m.bool(), m.int()):
        got = _launch_forward(h_view, e_view, b, mask, forward)
        for x, y in zip(got, want, strict=True):
            assert torch.equal(x, y)


# ---------------------------------------------------------------------------------------------------
# Non-finite inputs: the kernels propagate NaN and ±inf exactly as autograd through the reference
# ---------------------------------------------------------------------------------------------------

NAN, INF = float("nan"), float("inf")
# Where one non-finite value is planted in _inputs(3, 21, 24, 37, ...): row 0 is fully masked, row 1
# unmasked up to position 9, row 2 everywhere but 3..6. Feature d = 5 is one where columns 0..2 have
# E = 0, so ±inf there gives inf · 0 = NaN logits in those columns and ±inf by the sign of E elsewhere.
NON_FINITE_SHAPE = (3, 21, 24, 37)
NON_FINITE_SITES = ["hidden-unmasked", "hidden-masked", "hidden-masked-row", "weight", "bias", "grad_y"]


def _plant(site: str, value: float, h: Tensor, e: Tensor, b: Tensor, g: Tensor) -> None:
    """Put ``value`` at one place of the inputs (in place)."""
    if site == "hidden-unmasked":
        h[2, 17, 5] = value  # in the second 16-wide S tile
    elif site == "hidden-masked":
        h[2, 4, 5] = value  # in row 2's masked hole
    elif site == "hidden-masked-row":
        h[0, 0, 5] = value  # row 0 is fully masked
    elif site == "weight":
        e[20, 5] = value
    elif site == "bias":
        b[20] = value
    else:
        g[2, 10:14] = value


def _assert_same_non_finite(got: Tensor, want: Tensor, rtol: float, atol: float) -> None:
    """NaN and ±inf at exactly the same entries, finite entries within tolerance."""
    assert torch.equal(got.isnan(), want.isnan()), "NaN at different entries"
    assert torch.equal(got.isposinf(), want.isposinf()) and torch.equal(got.isneginf(), want.isneginf())
    torch.testing.assert_close(got, want.to(got.dtype), rtol=rtol, atol=atol, equal_nan=True)


@pytest.mark.parametrize("site", NON_FINITE_SITES)
@pytest.mark.parametrize("value", [NAN, INF, -INF], ids=["nan", "+inf", "-inf"])
def test_reference_backward_non_finite_matches_autograd(site, value) -> None:
    """The head's CPU backward (from max, argmax) puts NaN/inf where autograd through the reference does."""
    h, e, b, m = _inputs(*NON_FINITE_SHAPE, True, torch.float64, torch.device("cpu"), seed=30)
    g = torch.randn(3, 37, generator=torch.Generator().manual_seed(31), dtype=torch.float64)
    _plant(site, value, h, e, b, g)
    _, mx, arg = sparton_head_reference(h, e, b, m, return_argmax=True)
    got = sparton_head_backward_reference(g, h, e, mx, arg)
    hr, er, br = (t.clone().requires_grad_() for t in (h, e, b))
    want = torch.autograd.grad(sparton_head_reference(hr, er, br, m), (hr, er, br), g)
    for x, ref in zip(got, want, strict=True):
        _assert_same_non_finite(x, ref, rtol=1e-12, atol=1e-12)


def _kernel_non_finite_cases() -> list:
    """Every site and value in fp32 (a fully masked row only with NaN: the one-row kernel skips such rows
    whatever they hold); bf16, whose tensor-core products are the other path, for a few. The two-pass
    forward (its redo launch must take over wherever the bound fails) and the packed kernel (all three
    rows in one tile, the fully masked one computed and masked) for NaN and +inf at every site the
    forward reads."""
    fp32, bf16 = DTYPES[0].values, DTYPES[1].values
    cases = [
        pytest.param(value, site, *fp32, "one-row", id=f"{name}-{site}-fp32")
        for value, name in ((NAN, "nan"), (INF, "+inf"), (-INF, "-inf"))
        for site in NON_FINITE_SITES
        if site != "hidden-masked-row" or name == "nan"
    ]
    bf16_cases = [(NAN, "nan", "hidden-unmasked"), (INF, "+inf", "hidden-unmasked"), (NAN, "nan", "weight")]
    cases += [
        pytest.param(v, site, *bf16, "one-row", id=f"{name}-{site}-bf16") for v, name, site in bf16_cases
    ]
    cases += [
        pytest.param(value, site, *fp32, forward, id=f"{forward}-{name}-{site}-fp32")
        for forward in ("two-pass", "packed")
        for value, name in ((NAN, "nan"), (INF, "+inf"))
        for site in NON_FINITE_SITES
        if site != "grad_y"
    ]
    packed_bf16 = pytest.param(NAN, "hidden-unmasked", *bf16, "packed", id="packed-nan-hidden-unmasked-bf16")
    return [*cases, packed_bf16]


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter's numpy
@pytest.mark.parametrize(("value", "site", "dtype", "rtol", "forward"), _kernel_non_finite_cases())
def test_triton_non_finite_matches_reference(kernel_device, value, site, dtype, rtol, forward) -> None:
    """A NaN/±inf in H (unmasked, masked, fully masked row), E, bias or grad_y: kernel Y, max, argmax and
    every gradient (on every path of the backward) are NaN/inf at exactly the reference's entries
    (autograd for the gradients)."""
    h, e, b, m = _inputs(*NON_FINITE_SHAPE, True, dtype, kernel_device, seed=32)
    g = torch.randn(3, 37, generator=torch.Generator().manual_seed(33)).to(kernel_device, dtype)
    _plant(site, value, h, e, b, g)
    y, mx, arg = _launch_forward(h, e, b, m, forward)
    y_ref, mx_ref, arg_ref = sparton_head_reference(h, e, b, m, return_argmax=True)
    _assert_same_non_finite(mx, mx_ref, rtol=1e-5, atol=1e-5)
    _assert_same_non_finite(y, y_ref, rtol=rtol, atol=1e-6)
    if site.startswith("hidden-masked"):  # masked positions never reach Y, whatever they hold
        assert y.isfinite().all()
    elif site != "grad_y" and not (site == "bias" and value == -INF):
        assert not y.isfinite().all()  # the planted value does reach Y: the case is not vacuous
    # the first NaN / first +inf wins exactly; finite maxima wherever the top two are not near-tied
    clear = ~mx_ref.isfinite() | ((mx_ref > 0) & (_top2_gap(h, e, b, m) > 1e-4))
    assert torch.equal(arg[clear].long(), arg_ref[clear])
    inputs = [t.detach().clone().requires_grad_() for t in (h, e, b)]
    want = torch.autograd.grad(sparton_head_reference(*inputs, m), inputs, g)
    for path in BACKWARD_PATHS:
        grads = _launch_backward(g, h, e, mx, arg, path)
        for got, ref in zip(grads, want, strict=True):
            scale = ref.nan_to_num(0.0, 0.0, 0.0).abs().max().item()  # of the finite entries
            _assert_same_non_finite(got, ref, rtol=rtol, atol=1e-5 * scale)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter's numpy
@pytest.mark.parametrize("forward", FORWARDS)
def test_triton_forward_nan_beats_inf_and_first_nan_wins(kernel_device, forward) -> None:
    """Max/argmax order is Tensor.max(dim)'s: a NaN beats an earlier +inf, the first NaN wins within a
    tile and across tiles, and a later NaN does not replace an earlier one; in the packed kernel rows 0
    and 1 share a tile and keep their own first NaN, and row 2's finite maxima stay finite."""
    h, e, b, m = _inputs(3, 37, 24, 37, False, torch.float32, kernel_device, seed=34)
    m[:] = 1
    h[:2, 1, 0] = INF  # +inf logits at s = 1 wherever E[v, 0] > 0 (and inf · 0 = NaN in columns 0..2)
    h[0, (9, 3, 20), 7] = NAN  # row 0: NaNs at 3 and 9 (tile 0) and 20 (tile 1): argmax 3
    h[1, (33, 20), 7] = NAN  # row 1: NaNs in tiles 1 and 2 only: argmax 20
    y, mx, arg = _launch_forward(h, e, b, m, forward)
    _, mx_ref, arg_ref = sparton_head_reference(h, e, b, m, return_argmax=True)
    assert mx[:2].isnan().all() and y[:2].isnan().all() and mx[2].isfinite().all()
    assert (arg[0] == 3).all() and (arg[1] == 20).all()
    assert torch.equal(arg[:2].long(), arg_ref[:2])
    torch.testing.assert_close(mx, mx_ref, rtol=1e-5, atol=1e-5, equal_nan=True)


@pytest.mark.parametrize(
    ("site", "value", "bounded"),
    [
        ("none", 0.0, 1),
        ("hidden-masked", 1e3, 1),  # large but bounded: D · 1e3 · max|E| stays far below 2^126
        ("hidden-masked", NAN, 0),  # masked positions count: they only cost the redo
        ("weight", INF, 0),
        ("bias", -INF, 0),
        ("hidden-unmasked", 1e37, 0),  # finite, but D · 1e37 · max|E| passes 2^126: may overflow
    ],
)
def test_logits_bounded_says_when_no_logit_can_be_non_finite(site, value, bounded) -> None:
    """The forward's fast pass (the plain max) is trusted exactly where this flag is 1: ordinary inputs
    give 1 (so the fast pass runs), a NaN / inf input or finite inputs whose products may overflow give 0."""
    from gradcache_sparton.kernels.sparton_forward import _logits_bounded

    h, e, b, _ = _inputs(*NON_FINITE_SHAPE, True, torch.float32, torch.device("cpu"), seed=35)
    if site != "none":
        _plant(site, value, h, e, b, torch.zeros(3, 37))
    assert _logits_bounded(h, e, b).tolist() == [bounded]
    assert _logits_bounded(h.bfloat16(), e.bfloat16(), None).dtype == torch.int32


@pytest.mark.parametrize("forward", FORWARDS)
def test_triton_forward_finite_inputs_with_overflowing_logits_match_reference(kernel_device, forward) -> None:
    """Finite inputs whose products overflow fp32 (±inf logits, and inf · 0 = NaN where E is 0) take the
    NaN-aware pass: max and first argmax as the reference's, although no input is NaN or inf."""
    h, e, b, m = _inputs(*NON_FINITE_SHAPE, True, torch.float32, kernel_device, seed=36)
    h[2, 17, 5] = 1e30
    e[10:20, 5] = 1e20  # logits ±1e50 -> ±inf in columns 10..19 of row 2
    y, mx, arg = _launch_forward(h, e, b, m, forward)
    y_ref, mx_ref, arg_ref = sparton_head_reference(h, e, b, m, return_argmax=True)
    assert mx[2, 10:20].isposinf().all()  # the case is not vacuous
    _assert_same_non_finite(mx, mx_ref, rtol=1e-5, atol=1e-5)
    _assert_same_non_finite(y, y_ref, rtol=1e-5, atol=1e-6)
    clear = ~mx_ref.isfinite() | ((mx_ref > 0) & (_top2_gap(h, e, b, m) > 1e-4))
    assert torch.equal(arg[clear].long(), arg_ref[clear])


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter's numpy
@pytest.mark.parametrize(
    ("value", "site"), [(NAN, "hidden-unmasked"), (INF, "weight"), (NAN, "hidden-masked")]
)
def test_triton_dense_backward_non_finite_matches_sparse(kernel_device, value, site) -> None:
    """With a NaN/inf planted, the dense backward puts NaN/inf at exactly the sparse backward's entries
    (which match autograd through the reference: test_triton_non_finite_matches_reference)."""
    from gradcache_sparton.kernels.sparton_backward import sparton_backward

    h, e, b, m = _inputs(*NON_FINITE_SHAPE, True, torch.bfloat16, kernel_device, seed=35)
    g = torch.randn(3, 37, generator=torch.Generator().manual_seed(36)).to(kernel_device, torch.bfloat16)
    _plant(site, value, h, e, b, g)
    _, mx, arg = _launch_forward(h, e, b, m)
    sparse = sparton_backward(g, h, e, mx, arg)
    dense = sparton_backward(g, h, e, mx, arg, dense=True)
    for got, want in zip(dense, sparse, strict=True):
        scale = want.float().nan_to_num(0.0, 0.0, 0.0).abs().max().item()
        _assert_same_non_finite(got, want, rtol=2.0**-7, atol=1e-5 * scale)


# ---------------------------------------------------------------------------------------------------
# Module, custom op, compile, autocast (the CPU path; the same on CUDA with the gpu marker)
# ---------------------------------------------------------------------------------------------------


def _module_matches_reference(device: torch.device, dtype: torch.dtype, rtol: float) -> None:
    h, e, b, m = _inputs(3, 37, 24, 53, True, dtype, device, seed=9)
    decoder = nn.Linear(24, 53, device=device, dtype=dtype)
    with torch.no_grad():
        decoder.weight.copy_(e)
        decoder.bias.copy_(b)
    head = SpartonHead.from_decoder(decoder)
    assert head.weight is decoder.weight and head.bias is decoder.bias
    h.requires_grad_()
    y = head(h, m)
    g = torch.randn_like(y)
    got = torch.autograd.grad(y, (h, decoder.weight, decoder.bias), g)
    hr, er, br = (t.detach().clone().requires_grad_() for t in (h, e, decoder.bias))
    y_ref = sparton_head_reference(hr, er, br, m)
    want = torch.autograd.grad(y_ref, (hr, er, br), g)
    torch.testing.assert_close(y, y_ref, rtol=rtol, atol=1e-6)
    for x, ref in zip(got, want, strict=True):
        torch.testing.assert_close(x, ref, rtol=rtol, atol=1e-5 * ref.abs().max().item())


def test_module_cpu_matches_reference() -> None:
    """SpartonHead tied to a decoder equals the reference on CPU, forward and every gradient."""
    _module_matches_reference(torch.device("cpu"), torch.float32, 1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize(("dtype", "rtol"), DTYPES)
def test_module_cuda_matches_reference(dtype, rtol) -> None:
    """On CUDA the module (custom op -> Triton) equals the reference, forward and every gradient."""
    _module_matches_reference(torch.device("cuda"), dtype, rtol)


@pytest.mark.parametrize("path", ["triton", "reference"])
@pytest.mark.parametrize("frozen", ["weight", "hidden_states", "bias"])
def test_backward_skips_gradients_nobody_needs(kernel_device, monkeypatch, path, frozen) -> None:
    """A frozen weight gets no [V, D] gradient (the grad_E launcher never runs: nothing computed or
    allocated), hidden states without grad no [B, S, D] one, a frozen bias none; the gradients still
    needed equal those of the full backward."""
    from gradcache_sparton.kernels import sparton_backward as backward
    from gradcache_sparton.kernels import sparton_ops

    device = kernel_device if path == "triton" else torch.device("cpu")
    monkeypatch.setattr(sparton_ops, "_use_triton", lambda hidden_states: path == "triton")
    calls = []
    for name in ("_grad_e", "_grad_h"):  # the launchers that allocate grad_E / grad_H
        launcher = getattr(backward, name)
        monkeypatch.setattr(backward, name, lambda *a, _l=launcher, _n=name: calls.append(_n) or _l(*a))
    cpu_backward = sparton_ops.sparton_head_backward_reference
    needs = []  # what the CPU path was asked to compute
    monkeypatch.setattr(
        sparton_ops,
        "sparton_head_backward_reference",
        lambda *a, **k: needs.append(k.get("needs_input_grad")) or cpu_backward(*a, **k),
    )
    h, e, b, m = _inputs(3, 21, 24, 37, True, torch.float32, device, seed=16)
    g = torch.randn(3, 37, generator=torch.Generator().manual_seed(17)).to(device)
    inputs = {"hidden_states": h, "weight": e, "bias": b}
    everything = [t.detach().clone().requires_grad_() for t in inputs.values()]
    full = dict(zip(inputs, torch.autograd.grad(sparton_head(*everything, m), everything, g), strict=True))
    calls.clear()
    needs.clear()
    leaves = {name: t.detach().clone().requires_grad_(name != frozen) for name, t in inputs.items()}
    sparton_head(*leaves.values(), m).backward(g)
    assert leaves[frozen].grad is None
    for name, leaf in leaves.items():
        if name != frozen:
            assert torch.equal(leaf.grad, full[name]), name
    if path == "triton":
        skipped = {"weight": "_grad_e", "hidden_states": "_grad_h"}.get(frozen)
        assert sorted(calls) == sorted({"_grad_e", "_grad_h"} - {skipped})
    else:
        assert needs == [tuple(name != frozen for name in inputs)]


def test_tie_weights_keeps_a_plain_masked_lm_checkpoint(tiny_bert_mlm) -> None:
    """A head tied to a BERT decoder adds no tensors to the model's state dict and follows its updates."""
    keys = set(tiny_bert_mlm.state_dict())
    head = SpartonHead(32, len(tiny_bert_mlm.cls.predictions.decoder.weight))
    head.tie_weights(tiny_bert_mlm.cls.predictions.decoder)
    assert set(tiny_bert_mlm.state_dict()) == keys
    with torch.no_grad():
        tiny_bert_mlm.cls.predictions.decoder.weight.mul_(2.0)
    assert head.weight.data_ptr() == tiny_bert_mlm.cls.predictions.decoder.weight.data_ptr()


def test_compile_fullgraph_cpu() -> None:
    """torch.compile(fullgraph=True) traces sparton_head as one custom op (fake impl), fwd and bwd."""
    h, e, b, m = _inputs(2, 11, 24, 19, True, torch.float32, torch.device("cpu"), seed=11)
    h.requires_grad_()

    def loss(h: Tensor, e: Tensor, b: Tensor, m: Tensor) -> Tensor:
        return sparton_head(h, e, b, m).square().sum()

    # aot_eager runs the fake implementations and the autograd registration without spending the CPU
    # test budget on inductor's C++ codegen (which would add nothing about the custom op).
    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    (grad_c,) = torch.autograd.grad(compiled(h, e, b, m), h)
    (grad_e,) = torch.autograd.grad(loss(h, e, b, m), h)
    assert torch.equal(grad_c, grad_e) and (grad_c != 0).any()


def test_autocast_casts_inputs_and_sets_output_dtype() -> None:
    """Under CPU bf16 autocast the head computes on bf16-cast H/E and returns bf16."""
    h, e, b, m = _inputs(2, 13, 24, 19, True, torch.float32, torch.device("cpu"), seed=12)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = sparton_head(h, e, b, m)
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, sparton_head_reference(h.bfloat16(), e.bfloat16(), b, m))


def test_cpu_backward_from_argmax_matches_autograd() -> None:
    """The PyTorch backward from (max, argmax) equals autograd through the reference (chunked)."""
    h, e, b, m = _inputs(3, 17, 24, 29, True, torch.float64, torch.device("cpu"), seed=13)
    _, mx, arg = sparton_head_reference(h, e, b, m, return_argmax=True)
    g = torch.randn(3, 29, dtype=torch.float64)
    got = sparton_head_backward_reference(g, h, e, mx, arg, chunk_elements=3 * 24 * 5)
    hr, er, br = (t.clone().requires_grad_() for t in (h, e, b))
    want = torch.autograd.grad(sparton_head_reference(hr, er, br, m), (hr, er, br), g)
    for x, ref in zip(got, want, strict=True):
        torch.testing.assert_close(x, ref, rtol=1e-12, atol=1e-12)


def test_cpu_backward_work_follows_the_nonzeros(monkeypatch) -> None:
    """The CPU backward visits only the non-zero coefficients: with one gathered row per chunk it adds
    exactly one row per non-zero into grad_E and one into grad_H (zero outputs and zero upstream
    gradients cost nothing), and the chunking does not change the gradients."""
    h, e, b, m = _inputs(3, 17, 24, 29, True, torch.float64, torch.device("cpu"), seed=14)
    _, mx, arg = sparton_head_reference(h, e, b, m, return_argmax=True)
    g = torch.randn(3, 29, dtype=torch.float64)
    g[:, ::2] = 0
    live = int(((mx > 0) & (g != 0)).sum())
    assert 0 < live < 3 * 29 / 2
    rows_added = []
    index_add = torch.Tensor.index_add_

    def counting_index_add(self: Tensor, dim: int, index: Tensor, source: Tensor) -> Tensor:
        rows_added.append(index.numel())
        return index_add(self, dim, index, source)

    monkeypatch.setattr(torch.Tensor, "index_add_", counting_index_add)
    one_at_a_time = sparton_head_backward_reference(g, h, e, mx, arg, chunk_elements=24)
    monkeypatch.undo()
    assert rows_added == [1] * (2 * live)
    for x, y in zip(one_at_a_time, sparton_head_backward_reference(g, h, e, mx, arg), strict=True):
        assert torch.equal(x, y)


# ---------------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------------


def _bad_cases() -> list:
    h = torch.randn(2, 5, 8)
    e = torch.randn(11, 8)
    b = torch.randn(11)
    m = torch.ones(2, 5, dtype=torch.long)
    two = torch.tensor([[1, 2, 1, 1, 1], [1, 1, 1, 1, 1]])
    return [
        pytest.param((h[0], e, b, m), ValueError, "hidden_states must be", id="H-rank"),
        pytest.param((h, e[None], b, m), ValueError, "weight must be", id="E-rank"),
        pytest.param((h, e, b, m[0]), ValueError, "attention_mask must be", id="M-rank"),
        pytest.param((h, torch.randn(11, 7), b, m), ValueError, "D = 8", id="D-mismatch"),
        pytest.param((h, e, torch.randn(10), m), ValueError, "bias must be", id="V-mismatch"),
        pytest.param(
            (h, e, b, torch.ones(2, 6, dtype=torch.long)), ValueError, "attention_mask", id="S-mismatch"
        ),
        pytest.param(
            (h, e, b, torch.ones(3, 5, dtype=torch.long)), ValueError, "attention_mask", id="B-mismatch"
        ),
        pytest.param((h[:0], e, b, m[:0]), ValueError, "non-empty batch", id="empty-batch"),
        pytest.param((h, e, b, m.float()), TypeError, "bool or integer", id="float-mask"),
        pytest.param((h, e, b, two), ValueError, "only 0 and 1", id="mask-not-0-1"),
        pytest.param((h, e.double(), b, m), TypeError, "share a dtype", id="dtype-mismatch"),
        pytest.param((h.int(), e.int(), b, m), TypeError, "hidden_states must be one of", id="int-inputs"),
        pytest.param((h, e, b.long(), m), TypeError, "bias must be floating", id="int-bias"),
        pytest.param((h, e, b, m.to("meta")), ValueError, "one device", id="devices-differ"),
        pytest.param((h.numpy(), e, b, m), TypeError, "torch.Tensor", id="not-a-tensor"),
    ]


@pytest.mark.parametrize(("args", "error", "match"), _bad_cases())
def test_bad_input_raises_before_launch(args, error, match) -> None:
    """Wrong ranks, shapes, dtypes, devices, empty batches and non-0/1 masks raise a clear error."""
    with pytest.raises(error, match=match):
        sparton_head(*args)


def test_module_rejects_non_linear_decoder() -> None:
    """from_decoder / tie_weights name the expected type instead of failing later."""
    with pytest.raises(TypeError, match=r"nn\.Linear"):
        SpartonHead.from_decoder(nn.Embedding(3, 4))
    with pytest.raises(TypeError, match=r"nn\.Linear"):
        SpartonHead(4, 3).tie_weights(nn.Identity())
