"""The head's ``activation_function="log1p_relu"`` (Y = log1p(log1p(relu(x))), OpenSearch v3's "l0"
activation): the reference against a naive [B, S, V] computation, the Triton kernels against the reference
(forward and every gradient), the backward coefficient's derivation, the CPU op and the replay.

Legend: B batch, S sequence, D hidden, V vocabulary.

Shapes, dtypes and tolerances are those of ``test_kernels.py`` (imported from there, with their derivation):
the kernels' max and argmax do not depend on the activation, and Y and the backward coefficient are
computed from the same fp32 max in both, so the same bounds hold: Y is one fp32 value rounded once to
the output dtype, and each gradient one rounding of an fp32 sum of coef-weighted rows.
"""

from __future__ import annotations

import pytest
import torch
from test_kernels import (
    BACKWARD_PATHS,
    DTYPES,
    FORWARDS,
    SHAPES,
    SHORT_SHAPES,
    _inputs,
    _launch_backward,
    _launch_forward,
    _top2_gap,
)
from torch import Tensor, nn

from gradcache_sparton.kernels import (
    SpartonHead,
    sparton_head,
    sparton_head_reference,
    splade_head_materialized,
)
from gradcache_sparton.kernels.reference import backward_coefficients, sparton_head_backward_reference
from gradcache_sparton.primitives.forward_memo import recording, replaying

pytestmark = pytest.mark.kernel

L0 = "log1p_relu"


def _naive_l0(h: Tensor, e: Tensor, b: Tensor | None, m: Tensor) -> Tensor:
    """The l0 head written out on the full [B, S, V] logits, as sentence-transformers' SpladePooling does:
    log1p twice over relu, times the mask, max over S (no helper of the package)."""
    logits = h @ e.T + (b if b is not None else 0)  # [B, S, D] @ [D, V] -> [B, S, V]
    return (torch.log1p(torch.log1p(torch.relu(logits))) * m[:, :, None]).max(dim=1).values  # [B, V]


# ---------------------------------------------------------------------------------------------------
# Reference
# ---------------------------------------------------------------------------------------------------


def test_l0_reference_matches_naive_full_logits_fp64() -> None:
    """The chunked reference with log1p_relu equals the naive [B, S, V] computation and the materialised
    head, forward and every gradient (H, E, bias), in fp64."""
    h, e, b, m = _inputs(3, 29, 24, 41, True, torch.float64, torch.device("cpu"), seed=1)
    h, e, b = (t.requires_grad_() for t in (h, e, b))
    g = torch.randn(3, 41, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    y = sparton_head_reference(h, e, b, m, chunk_elements=3 * 29 * 7, activation_function=L0)  # ~6 chunks
    for other in (_naive_l0(h, e, b, m), splade_head_materialized(h, e, b, m, activation_function=L0)):
        torch.testing.assert_close(y, other, rtol=1e-12, atol=1e-12)
        for got, want in zip(
            torch.autograd.grad(y, (h, e, b), g, retain_graph=True),
            torch.autograd.grad(other, (h, e, b), g),
            strict=True,
        ):
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert (y[0] == 0).all() and (y[:, :3] == 0).all()  # fully masked row, all-negative columns
    relu_y = sparton_head_reference(h, e, b, m)
    torch.testing.assert_close(y, torch.log1p(relu_y), rtol=1e-12, atol=0)  # the extra log1p, nothing else
    assert (y < relu_y)[relu_y > 0].all()


def test_l0_reference_and_cpu_op_pass_gradcheck() -> None:
    """Finite differences agree with the l0 reference's autograd and with the head's CPU backward."""
    h, e, b, m = _inputs(2, 7, 5, 9, True, torch.float64, torch.device("cpu"), seed=2)
    h, e, b = (t.requires_grad_() for t in (h, e, b))
    assert torch.autograd.gradcheck(
        lambda *a: sparton_head_reference(*a, m, activation_function=L0), (h, e, b)
    )
    assert torch.autograd.gradcheck(lambda *a: sparton_head(*a, m, activation_function=L0), (h, e, b))


def test_l0_coefficient_is_the_chain_rule_at_the_saved_max() -> None:
    """coef = grad_y / ((1 + m)(1 + log1p(m))) equals autograd of log1p(log1p(m)) where m > 0, is 0 where
    m <= 0 (whatever grad_y), 0 at m = +inf and NaN at m = NaN, as for the relu activation."""
    m = torch.tensor([0.0, -1.0, 1e-6, 0.5, 3.0, 40.0, 1e30, float("inf"), float("nan")], dtype=torch.float64)
    g = torch.tensor([2.0, float("nan"), -1.5, 0.7, 1.0, -3.0, 2.0, 1.0, 1.0], dtype=torch.float64)
    coef = backward_coefficients(g[None], m[None], L0)[0]
    x = m[2:7].clone().requires_grad_()
    (want,) = torch.autograd.grad(torch.log1p(torch.log1p(x)), x, g[2:7])
    torch.testing.assert_close(coef[2:7], want, rtol=1e-15, atol=0)
    assert coef[0] == 0 and coef[1] == 0 and coef[7] == 0 and coef[8].isnan()
    relu_coef = backward_coefficients(g[None], m[None])[0]
    assert (coef[2:7].abs() <= relu_coef[2:7].abs()).all()  # the extra factor 1/(1 + log1p(m)) <= 1


def test_l0_cpu_backward_from_argmax_matches_autograd() -> None:
    """The PyTorch backward from (max, argmax) with log1p_relu equals autograd through the l0 reference."""
    h, e, b, m = _inputs(3, 17, 24, 29, True, torch.float64, torch.device("cpu"), seed=13)
    _, mx, arg = sparton_head_reference(h, e, b, m, return_argmax=True, activation_function=L0)
    g = torch.randn(3, 29, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    got = sparton_head_backward_reference(g, h, e, mx, arg, chunk_elements=3 * 24 * 5, activation_function=L0)
    hr, er, br = (t.clone().requires_grad_() for t in (h, e, b))
    want = torch.autograd.grad(sparton_head_reference(hr, er, br, m, activation_function=L0), (hr, er, br), g)
    for x, ref in zip(got, want, strict=True):
        torch.testing.assert_close(x, ref, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------------------------------
# Triton kernels (interpreter on CPU, compiled on GPU)
# ---------------------------------------------------------------------------------------------------


def _forward_cases() -> list:
    """Every forward kernel on the first SHAPES entry; the packed one on a short shape too."""
    shape = SHAPES[0]
    cases = [pytest.param(f, *shape.values, id=f"{f}-{shape.id}") for f in FORWARDS]
    return [*cases, pytest.param("packed", *SHORT_SHAPES[2].values, id=f"packed-{SHORT_SHAPES[2].id}")]


@pytest.mark.parametrize(("dtype", "rtol"), DTYPES)
@pytest.mark.parametrize(("forward", "B", "S", "D", "V", "bias"), _forward_cases())
def test_l0_triton_forward_matches_reference(kernel_device, dtype, rtol, forward, B, S, D, V, bias) -> None:
    """Kernel Y = log1p(log1p(max)) and its fp32 max equal the l0 reference's (the max is the relu head's)."""
    h, e, b, m = _inputs(B, S, D, V, bias, dtype, kernel_device, seed=10 + B + S)
    y, mx, arg = _launch_forward(h, e, b, m, forward, activation_function=L0)
    y_ref, mx_ref, arg_ref = sparton_head_reference(h, e, b, m, return_argmax=True, activation_function=L0)
    assert y.dtype == dtype and mx.dtype == torch.float32
    torch.testing.assert_close(mx, mx_ref, rtol=1e-5, atol=1e-5)  # fp32 sums in another order
    torch.testing.assert_close(y, y_ref, rtol=rtol, atol=1e-6)  # one rounding of the fp32 value
    torch.testing.assert_close(y.float(), torch.log1p(torch.log1p(mx)).to(dtype).float(), rtol=0, atol=0)
    assert (y[0] == 0).all() and (y[:, :3] == 0).all()
    clear = (mx_ref > 0) & (_top2_gap(h, e, b, m) > 1e-4)
    assert clear.float().mean() > 0.5 and torch.equal(arg[clear].long(), arg_ref[clear])


@pytest.mark.parametrize("path", BACKWARD_PATHS)
@pytest.mark.parametrize(("dtype", "rtol"), DTYPES)
@pytest.mark.parametrize(("B", "S", "D", "V", "bias"), SHAPES)
def test_l0_triton_backward_matches_reference_autograd(
    kernel_device, dtype, rtol, B, S, D, V, bias, path
) -> None:
    """grad_H, grad_E and grad_bias of the l0 head from (max, argmax) equal autograd through the l0
    reference, on every path of the backward."""
    h, e, b, m = _inputs(B, S, D, V, bias, dtype, kernel_device, seed=20 + B)
    _, mx, arg = _launch_forward(h, e, b, m, activation_function=L0)
    g = torch.randn(B, V, generator=torch.Generator().manual_seed(5)).to(kernel_device, dtype)
    grad_h, grad_e, grad_b = _launch_backward(g, h, e, mx, arg, path, activation_function=L0)
    inputs = [t.detach().clone().requires_grad_() for t in (h, e, b) if t is not None]
    y_ref = sparton_head_reference(
        inputs[0], inputs[1], inputs[2] if bias else None, m, activation_function=L0
    )
    want = torch.autograd.grad(y_ref, inputs, g)
    relu = _launch_backward(g, h, e, mx, arg, path)
    assert not torch.allclose(grad_e.float(), relu[1].float())  # the activation reached the gradient
    for got, ref in zip((grad_h, grad_e, grad_b), want, strict=False):  # no grad_bias without bias
        # test_kernels' bounds: one rounding of an fp32 sum, plus summation-order differences near 0
        torch.testing.assert_close(got, ref.to(got.dtype), rtol=rtol, atol=1e-5 * ref.abs().max().item())


# ---------------------------------------------------------------------------------------------------
# Module, custom op, replay, validation (the CPU path)
# ---------------------------------------------------------------------------------------------------


def test_l0_module_matches_reference_and_compiles() -> None:
    """SpartonHead(activation_function="log1p_relu") tied to a decoder equals the l0 reference, forward and
    every gradient, eagerly and under torch.compile(fullgraph=True) (the name travels in the op's schema)."""
    h, e, b, m = _inputs(3, 37, 24, 53, True, torch.float32, torch.device("cpu"), seed=9)
    decoder = nn.Linear(24, 53)
    with torch.no_grad():
        decoder.weight.copy_(e)
        decoder.bias.copy_(b)
    head = SpartonHead.from_decoder(decoder, activation_function=L0)
    assert "log1p_relu" in repr(head)
    h.requires_grad_()
    g = torch.randn(3, 53, generator=torch.Generator().manual_seed(4))
    hr, er, br = (t.detach().clone().requires_grad_() for t in (h, e, b))
    y_ref = sparton_head_reference(hr, er, br, m, activation_function=L0)
    want = torch.autograd.grad(y_ref, (hr, er, br), g)
    for run in (head, torch.compile(head, fullgraph=True, backend="aot_eager")):
        y = run(h, m)
        got = torch.autograd.grad(y, (h, decoder.weight, decoder.bias), g)
        torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-6)
        for x, ref in zip(got, want, strict=True):
            torch.testing.assert_close(x, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


class _ListMemo:
    """The smallest ForwardMemo: (max, argmax) kept in call order."""

    def __init__(self) -> None:
        self.kept: list[tuple[Tensor, Tensor]] = []

    def record(self, hidden_states, weight, bias, max_logits, argmax) -> None:
        self.kept.append((max_logits, argmax))

    def take(self, hidden_states, weight, bias) -> tuple[Tensor, Tensor]:
        return self.kept.pop(0)


def test_l0_replay_from_a_memo_equals_the_forward() -> None:
    """GradCache's reuse_argmax replay rebuilds Y = log1p(log1p(max)) and the l0 backward from Step (1)'s
    (max, argmax): bitwise the head's own forward and gradients."""
    h, e, b, m = _inputs(3, 21, 24, 37, True, torch.float32, torch.device("cpu"), seed=6)
    g = torch.randn(3, 37, generator=torch.Generator().manual_seed(7))
    leaves = [t.detach().clone().requires_grad_() for t in (h, e, b)]
    y = sparton_head(*leaves, m, activation_function=L0)
    want = torch.autograd.grad(y, leaves, g)
    memo = _ListMemo()
    with recording(memo), torch.no_grad():
        sparton_head(h, e, b, m, activation_function=L0)
    with replaying(memo):
        replayed = sparton_head(*leaves, m, activation_function=L0)
    assert torch.equal(replayed, y)
    for got, ref in zip(torch.autograd.grad(replayed, leaves, g), want, strict=True):
        assert torch.equal(got, ref)


@pytest.mark.parametrize("value", ["l0", "log1p", "RELU", None, 1])
def test_unknown_activation_is_one_clear_error(value) -> None:
    """An unknown activation_function is a ValueError naming the argument and its choices, from the op, the
    module and the reference alike, before any work."""
    h, e, b, m = _inputs(2, 5, 8, 11, True, torch.float32, torch.device("cpu"), seed=8)
    match = r"activation_function must be one of \['relu', 'log1p_relu'\]"
    with pytest.raises(ValueError, match=match):
        sparton_head(h, e, b, m, activation_function=value)
    with pytest.raises(ValueError, match=match):
        SpartonHead(8, 11, activation_function=value)
    with pytest.raises(ValueError, match=match):
        sparton_head_reference(h, e, b, m, activation_function=value)
