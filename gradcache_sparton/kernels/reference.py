"""Pure-PyTorch SPLADE head: the ground truth for the Triton kernels, the CPU path and the benchmark baseline.

Legend (used in every shape comment of this package): B batch, S sequence, D hidden, V vocabulary,
C a vocabulary chunk.

The head computes

    Y[b, v] = max_s log1p(act(H[b, s] · E[v] + bias[v])) · M[b, s]

with ``act`` the activation before the log1p, named as sentence-transformers' ``SpladePooling``
names its ``activation_function`` (:data:`HEAD_ACTIVATIONS`): ``"relu"`` (SPLADE v2 and later, the
default: Y = log1p(relu(x))) or ``"log1p_relu"`` (OpenSearch's v3 models, the "l0" activation:
Y = log1p(log1p(relu(x))), a flatter weight for the same terms).

Identities the kernels rely on, which this reference makes explicit:
- f(x) = log1p(relu(x)) is monotone non-decreasing, and so is log1p(f(x)), so max_s f(x_s) =
  f(max_s x_s) for either activation: reduce the raw logits over S first (the saved max is
  m = relu(max_s x_s)), apply the activation once on [B, V] (:func:`activation_from_max`).
- Masked positions (M = 0) contribute f(.) · 0 = 0, and f >= 0, so they can be dropped from the max
  (filled with -inf); a fully masked row gives Y = 0.
- The gradient reaches only the argmax position, and only where the max is > 0 (relu's gradient at
  0 is 0): a fully masked row or an all-negative column gets exactly zero gradient.
- Ties: ``Tensor.max(dim)`` returns the first maximal index and its backward sends the whole
  gradient there (``amax`` would split it among ties). The kernels follow the same rule: the first
  sequence position wins.

Non-finite values (NaN, ±inf) are part of the semantics, and the kernels reproduce them exactly:
- Order: ``Tensor.max(dim)`` puts NaN above +inf and picks the first NaN, so a NaN logit at an
  unmasked position makes Y[b, v] NaN with the argmax at the first such position; +inf gives Y = inf
  (first +inf on ties); -inf never wins and gives Y = 0 where nothing else is > 0.
- Masked positions are filled with -inf *before* the max: a NaN or inf in the hidden state of a
  masked position (or of a fully masked row) never reaches Y.
- What a non-finite input makes of the logits: NaN in H[b, s] makes every logit of (b, s) NaN; ±inf
  in H[b, s, d] makes logit (b, s, v) ±inf by the sign of E[v, d], and NaN where E[v, d] = 0
  (inf · 0); the same with H and E swapped, for every unmasked position of column v; NaN or ±inf in
  bias[v] makes column v NaN or ±inf at every unmasked position.
- Gradients (autograd through this function, which ``sparton_head_backward_reference`` and the
  Triton backward match exactly): with coef = grad_y / (1 + max) (``"relu"``; for ``"log1p_relu"`` see
  :func:`backward_coefficients`), the gradient at the argmax is coef
  where max > 0, NaN where max is NaN (relu passes NaN, 1/(1 + NaN) = NaN), 0 where max = +inf
  (1/inf; NaN if grad_y is infinite too) and 0 where max <= 0 whatever grad_y is. The dense matmul
  backward also multiplies every H entry by a logits gradient that is mostly 0, and 0 · ±inf =
  0 · NaN = NaN: one non-finite H[b, s, d] anywhere, masked or not, makes grad_E[:, d] NaN for every
  v, and one non-finite E[v, d] makes grad_H[:, :, d] NaN for every (b, s). grad_bias is the sum of
  the coefficients (no such product). So a NaN in the reps always comes with NaN gradients, and a
  non-finite H or E entry that Y does not show still reaches grad_E or grad_H.

Memory: the logits are materialised one vocabulary chunk at a time ([B, S, C], at most
``chunk_elements`` elements), so peak memory does not grow with B·S·V. Autograd keeps only the
[B, C] argmax indices per chunk (``max(dim)``'s backward needs no input values), never the chunk.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "CPU_REFERENCE_CHUNK_ELEMENTS",
    "DEFAULT_HEAD_ACTIVATION",
    "HEAD_ACTIVATIONS",
    "REFERENCE_CHUNK_ELEMENTS",
    "activation_from_max",
    "backward_coefficients",
    "check_head_activation",
    "default_chunk_elements",
    "non_finite_columns",
    "sparton_head_backward_reference",
    "sparton_head_reference",
    "splade_activation",
    "splade_head_materialized",
    "splade_max_pool",
]

#: The head's activations before the log1p, named as sentence-transformers' ``SpladePooling`` names its
#: ``activation_function``: ``"relu"``, Y = log1p(relu(x)) (SPLADE v2 and later); ``"log1p_relu"``,
#: Y = log1p(log1p(relu(x))) (OpenSearch's v3 "l0" activation).
HEAD_ACTIVATIONS = ("relu", "log1p_relu")
#: The activation of every SPLADE v2+ model, and of every checkpoint that does not name one.
DEFAULT_HEAD_ACTIVATION = "relu"


def check_head_activation(activation_function: object) -> None:
    """``ValueError`` naming ``activation_function`` unless it is one of :data:`HEAD_ACTIVATIONS`."""
    if not isinstance(activation_function, str) or activation_function not in HEAD_ACTIVATIONS:
        raise ValueError(
            f"activation_function must be one of {list(HEAD_ACTIVATIONS)} (the activation before the log1p, "
            f"as sentence-transformers' SpladePooling names it), got {activation_function!r}"
        )


def activation_from_max(max_logits: Tensor, activation_function: str = DEFAULT_HEAD_ACTIVATION) -> Tensor:
    """Y [B, V] from the saved max m = relu(max_s x) [B, V]: log1p(m) (``"relu"``) or log1p(log1p(m))
    (``"log1p_relu"``), in the dtype of ``max_logits`` (the kernels' fp32: Y is rounded once, after)."""
    y = torch.log1p(max_logits)
    return torch.log1p(y) if activation_function == "log1p_relu" else y


def splade_activation(logits: Tensor, activation_function: str = DEFAULT_HEAD_ACTIVATION) -> Tensor:
    """log1p(relu(x)) (``"relu"``) or log1p(log1p(relu(x))) (``"log1p_relu"``) of any logits, elementwise:
    the definition the fused head reproduces (one formula for the materialised heads and exports)."""
    return activation_from_max(torch.relu(logits), activation_function)


# 2**25 fp32 elements = 128 MiB per logits chunk: large enough that the chunked matmuls run at full
# speed on a GPU, small enough to be irrelevant next to a BERT-base mini-batch's activations.
REFERENCE_CHUNK_ELEMENTS = 2**25
# On a CPU, 2**20 (4 MiB): a buffer that size comes back from the allocator's free lists, while a larger
# one (glibc's threshold is at most 32 MiB) is mapped afresh and page-faulted in each time. The default
# run's step took 1.50 s at 2**25 and 0.75-0.98 s at 2**18-2**20 on a 2-core CPU (12 steps, 2026-11-26),
# the matmuls of [B·S, D] @ [D, C] staying large enough for the CPU's BLAS.
CPU_REFERENCE_CHUNK_ELEMENTS = 2**20


def default_chunk_elements(device: torch.device) -> int:
    """The reference's chunk bound on ``device``: :data:`REFERENCE_CHUNK_ELEMENTS` on a GPU, the smaller
    :data:`CPU_REFERENCE_CHUNK_ELEMENTS` on a CPU."""
    return CPU_REFERENCE_CHUNK_ELEMENTS if device.type == "cpu" else REFERENCE_CHUNK_ELEMENTS


def sparton_head_reference(
    hidden_states: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    attention_mask: Tensor,
    *,
    chunk_elements: int | None = None,
    return_argmax: bool = False,
    activation_function: str = DEFAULT_HEAD_ACTIVATION,
) -> Tensor | tuple[Tensor, Tensor, Tensor]:
    """SPLADE max-pooled head in plain PyTorch, chunked over the vocabulary.

    Args:
        hidden_states: [B, S, D] floating tensor (the LM transform's output).
        weight: [V, D] vocabulary embeddings (the masked-LM decoder weight).
        bias: [V] decoder bias, or None.
        attention_mask: [B, S] 0/1 mask (any integer, bool or floating dtype).
        chunk_elements: upper bound on B·S·C, the elements of one logits chunk (default:
            :func:`default_chunk_elements` of the inputs' device).
        return_argmax: also return the pre-activation max and its argmax (no gradient).
        activation_function: one of :data:`HEAD_ACTIVATIONS` (module doc).

    Returns:
        Y [B, V] in the dtype of ``hidden_states``; with ``return_argmax``, ``(Y, max, argmax)`` where
        ``max`` is the [B, V] running max of the masked logits clamped at 0 (fp32, fp64 for fp64
        inputs: the Triton kernels' saved state, Y = :func:`activation_from_max` of it) and ``argmax`` the [B, V] int64 first
        sequence position attaining it (meaningful only where max > 0).

    Matmuls are exact products accumulated in fp32 or better, like the kernels, whatever the process-wide
    matmul precision says: 16-bit inputs are multiplied in fp32 (their products are exact there, and
    TF32 leaves 16-bit operands unchanged); fp32 inputs in fp64 per vocabulary chunk on CUDA, where
    accelerate or ``torch.set_float32_matmul_precision`` may have switched TF32 on (it rounds fp32
    operands to 10 mantissa bits: measured 1e-3 absolute error on the max at D = 24 on the H100), and
    on CPU only when the process lowered its fp32 matmul precision; fp64 stays fp64. No global switch
    is touched, so the reference is thread-safe and needs no fixture. Autocast is switched off inside,
    so the result does not depend on the caller's autocast state; callers that want autocast's dtype
    cast the inputs first (``sparton_head`` does).
    """
    check_head_activation(activation_function)
    chunk_elements = chunk_elements or default_chunk_elements(hidden_states.device)
    with torch.autocast(device_type=hidden_states.device.type, enabled=False):
        return _reference(
            hidden_states, weight, bias, attention_mask, chunk_elements, return_argmax, activation_function
        )


def _exact_dtype(t: Tensor) -> torch.dtype:
    """The dtype in which products of ``t``'s values are exact and summed in fp32 or better, under any
    process-wide fp32 matmul precision (reading it is thread-safe; it is never set here)."""
    if t.dtype in (torch.float16, torch.bfloat16):
        return torch.float32
    if t.dtype == torch.float32 and (t.is_cuda or torch.get_float32_matmul_precision() != "highest"):
        return torch.float64  # fp32 · fp32 products are exact in fp64 (24 + 24 < 53 bits)
    return t.dtype


def _reference(
    hidden_states: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    attention_mask: Tensor,
    chunk_elements: int,
    return_argmax: bool,
    activation_function: str,
) -> Tensor | tuple[Tensor, Tensor, Tensor]:
    B, S, _ = hidden_states.shape
    V = weight.shape[0]
    max_dtype = torch.promote_types(hidden_states.dtype, torch.float32)  # of the saved max
    compute_dtype = _exact_dtype(hidden_states)
    h = hidden_states.to(compute_dtype)  # [B, S, D]
    keep = attention_mask.to(torch.bool)  # [B, S]
    C = max(1, min(V, chunk_elements // max(1, B * S)))
    ys, maxes, argmaxes = [], [], []
    for v0 in range(0, V, C):
        w = weight[v0 : v0 + C].to(compute_dtype)  # [C, D]
        logits = h @ w.T  # [B, S, D] @ [D, C] -> [B, S, C]
        # In place: the chunk is a fresh product that no backward reads (the matmul saves h and w, the
        # max its indices), and one buffer a chunk instead of three keeps the allocator's traffic down.
        if bias is not None:
            logits += bias[v0 : v0 + C].to(compute_dtype)
        logits.masked_fill_(~keep[:, :, None], float("-inf"))
        mx, idx = logits.max(dim=1)  # [B, C]; first maximal position on ties
        # [B, C]; -inf (fully masked) -> 0, zero gradient at <= 0. Rounded to the saved max's dtype before
        # the activation, as the kernels compute Y from their fp32 max: a sum past fp32's range (finite in
        # fp64) is +inf there, and Y with it.
        act = torch.relu(mx).to(max_dtype)
        ys.append(activation_from_max(act, activation_function))
        if return_argmax:
            maxes.append(act.detach())
            argmaxes.append(idx)
    y = torch.cat(ys, dim=1).to(hidden_states.dtype)  # [B, V]
    if return_argmax:
        return y, torch.cat(maxes, dim=1), torch.cat(argmaxes, dim=1)
    return y


def splade_max_pool(
    logits: Tensor, attention_mask: Tensor, *, activation_function: str = DEFAULT_HEAD_ACTIVATION
) -> Tensor:
    """[B, S, V] materialised logits -> [B, V] = max_s log1p(relu(logits)) · M, in the logits' dtype
    (log1p(log1p(relu(logits))) for ``activation_function="log1p_relu"``, :func:`splade_activation`).

    The plain SPLADE pooling, as a masked-LM's own logits feed it. Masked positions are filled with -inf
    before the activation, as in :func:`sparton_head_reference` (same values as multiplying by the mask
    for finite logits, and a non-finite logit at a masked position is ignored, as in the fused head);
    ``Tensor.max(dim)`` sends the whole gradient to the first maximal position, the kernels' tie rule.
    """
    check_head_activation(activation_function)
    masked = logits.masked_fill(attention_mask[:, :, None] == 0, float("-inf"))  # [B, S, V]
    return splade_activation(masked, activation_function).max(dim=1).values  # [B, S, V] -> [B, V]


def splade_head_materialized(
    hidden_states: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    attention_mask: Tensor,
    *,
    activation_function: str = DEFAULT_HEAD_ACTIVATION,
) -> Tensor:
    """The SPLADE head as usually written: the full [B, S, V] logits, then :func:`splade_max_pool`.

    The eager baseline of the benchmarks (and, under ``torch.compile``, the compiled one) and the
    definition the tests check the chunked reference against. Runs in the inputs' dtype (autocast
    applies as to any ``F.linear``); memory grows with B·S·V, which is what the fused head avoids.
    """
    logits = F.linear(hidden_states, weight, bias)  # [B, S, D] @ [D, V] -> [B, S, V]
    return splade_max_pool(logits, attention_mask, activation_function=activation_function)


def backward_coefficients(
    grad_y: Tensor, max_logits: Tensor, activation_function: str = DEFAULT_HEAD_ACTIVATION
) -> Tensor:
    """coef [B, V] = grad_y · dY/dm at the saved max m where m > 0 or m is NaN, else 0, in the dtype of
    ``max_logits``: the gradient that reaches the argmax's logit.

    ``"relu"``: Y = log1p(m), dY/dm = 1/(1 + m), coef = grad_y / (1 + m).
    ``"log1p_relu"``: Y = log1p(log1p(m)), by the chain rule dY/dm = 1/((1 + m)(1 + log1p(m))), so
    coef = grad_y / ((1 + m)(1 + log1p(m))), computed from the fp32 (or fp64) saved max, never from the
    16-bit Y (1 + log1p(m) = exp(Y) would inherit Y's rounding). Both factors are >= 1 where m > 0, so the
    coefficient is at most |grad_y|.

    relu passes nothing where m <= 0 (a NaN grad_y there included) and passes its input where m is NaN,
    which the division turns into NaN. At m = +inf the coefficient is grad_y / inf = 0 (NaN for an
    infinite grad_y), for both activations, as autograd computes it.
    """
    live = (max_logits > 0) | max_logits.isnan()  # [B, V]
    slope = 1 + max_logits  # [B, V]: 1 / (dY/dm) ...
    if activation_function == "log1p_relu":
        slope = slope * (1 + torch.log1p(max_logits))  # ... times 1 / (d log1p(u)/du) at u = log1p(m)
    return torch.where(live, grad_y.to(max_logits.dtype) / slope, 0.0)


def non_finite_columns(t: Tensor, *, dim: int | tuple[int, ...]) -> Tensor:
    """[D] fp32: NaN where column d of ``t`` (reduced over ``dim``) holds a NaN or ±inf anywhere, else 0.

    The dense matmul backward multiplies every entry of H by the logits' gradient, which is 0 almost
    everywhere, and 0 · ±inf = 0 · NaN = NaN: autograd through the reference makes grad_E[:, d] NaN
    for every v as soon as one H[b, s, d] is not finite (masked positions included), and likewise
    grad_H[:, :, d] from E[:, d]. The sparse backward adds this vector to reproduce it. One read of
    ``t``, no temporary of its size (max |x| propagates NaN).
    """
    return torch.linalg.vector_norm(t, ord=float("inf"), dim=dim).float() * 0


def sparton_head_backward_reference(
    grad_y: Tensor,
    hidden_states: Tensor,
    weight: Tensor,
    max_logits: Tensor,
    argmax: Tensor,
    *,
    needs_input_grad: tuple[bool, bool, bool] = (True, True, True),
    chunk_elements: int | None = None,
    activation_function: str = DEFAULT_HEAD_ACTIVATION,
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """Gradients of the head from its saved (max, argmax) alone, in plain PyTorch, over the non-zeros.

    The same rule as the Triton backward: with coef = :func:`backward_coefficients` (of the activation),
    grad_E[v] = Σ_b coef[b, v] · H[b, argmax[b, v]], grad_H[b, s] = Σ_{v: argmax[b, v] = s}
    coef[b, v] · E[v] and grad_bias[v] = Σ_b coef[b, v], plus NaN in the columns that
    :func:`non_finite_columns` marks. Only the non-zero coefficients (NaN ones included) are visited, in
    increasing (b, v) order, so work and memory follow the non-zeros of Y (a trained SPLADE model's
    are under 1% of B·V), not B·V·D. It is the backward of the head's CPU path; the tests check it
    against autograd through :func:`sparton_head_reference`, non-finite inputs included.

    Args:
        grad_y: [B, V] upstream gradient.
        hidden_states: [B, S, D]; weight: [V, D].
        max_logits, argmax: [B, V] from ``sparton_head_reference(..., return_argmax=True)``.
        needs_input_grad: which of (grad_H, grad_E, grad_bias) to compute; the others are None.
        chunk_elements: upper bound on n·D, the elements of one chunk of n gathered rows, and on the
            entries of coef searched for non-zeros at a time (whole rows, at least one); default:
            :func:`default_chunk_elements` of the inputs' device.
        activation_function: the forward's (:data:`HEAD_ACTIVATIONS`); it decides coef.

    Returns:
        (grad_H [B, S, D] in the dtype of H, grad_E [V, D] in the dtype of E, grad_bias [V] in the
        compute dtype: fp32, or fp64 for fp64 inputs), each None where not needed.
    """
    check_head_activation(activation_function)
    chunk_elements = chunk_elements or default_chunk_elements(hidden_states.device)
    return _backward_reference(
        grad_y,
        hidden_states,
        weight,
        max_logits,
        argmax,
        needs_input_grad,
        chunk_elements,
        activation_function,
    )


def _backward_reference(
    grad_y: Tensor,
    hidden_states: Tensor,
    weight: Tensor,
    max_logits: Tensor,
    argmax: Tensor,
    needs_input_grad: tuple[bool, bool, bool],
    chunk_elements: int,
    activation_function: str,
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    need_h, need_e, need_bias = needs_input_grad
    B, S, D = hidden_states.shape
    V = weight.shape[0]
    bias_dtype = torch.promote_types(hidden_states.dtype, torch.float32)
    compute_dtype = _exact_dtype(hidden_states)  # as in the forward: exact under any TF32 setting
    h = hidden_states.to(compute_dtype).reshape(B * S, D)  # row b·S + s
    coef = backward_coefficients(grad_y, max_logits.to(compute_dtype), activation_function)  # [B, V]
    grad_h = grad_e = None
    if need_h:  # [B·S, D], starting from NaN in E's non-finite columns
        grad_h = non_finite_columns(weight, dim=0).to(compute_dtype).expand(B * S, D).clone()
    if need_e:  # [V, D], starting from NaN in H's non-finite columns
        grad_e = non_finite_columns(hidden_states, dim=(0, 1)).to(compute_dtype).expand(V, D).clone()
    coef_flat, arg_flat = coef.reshape(-1), argmax.reshape(-1)  # [B·V]
    # Rows of coef searched a block at a time (at most chunk_elements entries, so the index of the
    # non-zeros never takes more), their non-zeros gathered chunk_elements // D at a time.
    block_rows, step = max(1, chunk_elements // max(1, V)), max(1, chunk_elements // max(1, D))
    for b0 in range(0, B if need_h or need_e else 0, block_rows):
        block = coef_flat[b0 * V : (b0 + block_rows) * V]
        live = block.nonzero().squeeze(1) + b0 * V  # b·V + v of the non-zero (or NaN) coefficients
        for i0 in range(0, live.numel(), step):
            index = live[i0 : i0 + step]  # [n]
            v = index % V
            rows = (index // V) * S + arg_flat[index].long()  # [n]: b·S + argmax[b, v]
            c = coef_flat[index, None]  # [n, 1]
            if need_e:
                grad_e.index_add_(0, v, c * h[rows])  # coef · H[b, argmax[b, v]] into row v
            if need_h:
                grad_h.index_add_(0, rows, c * weight[v].to(compute_dtype))  # coef · E[v] into b·S + s
    return (
        grad_h.view(B, S, D).to(hidden_states.dtype) if need_h else None,
        grad_e.to(weight.dtype) if need_e else None,
        coef.sum(dim=0).to(bias_dtype) if need_bias else None,
    )
