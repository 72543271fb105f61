"""``sparton_head``: the SPLADE max-pooled head as two custom ops, dispatched to Triton on CUDA.

Legend: B batch, S sequence, D hidden, V vocabulary.

Y[b, v] = max_s log1p(relu(H[b, s] · E[v] + bias[v])) · M[b, s], computed without the [B, S, V] logits
(log1p(log1p(relu(.))) with ``activation_function="log1p_relu"``: see ``reference.py``).

The head is two ``torch.library`` custom ops, so ``torch.compile`` (``fullgraph=True`` too) treats it as
one opaque node with a fake (shape-only) implementation instead of tracing into Triton launches:
- ``gradcache_sparton::sparton_head_forward`` -> (Y, fp32 max, int32 argmax): the fused Triton kernel on
  CUDA, :func:`sparton_head_reference` on any other device;
- ``gradcache_sparton::sparton_head_backward`` -> (grad_H, grad_E, grad_bias) from (max, argmax) alone:
  the sparse Triton backward on CUDA, :func:`sparton_head_backward_reference` elsewhere.
``torch.library.register_autograd`` ties them together (the custom-op form of an
``autograd.Function``). Triton is imported only when a CUDA tensor arrives.

The Triton kernels are in ``sparton_forward.py`` and ``sparton_backward.py`` (tiles in
``sparton_blocks.py``), the :class:`~gradcache_sparton.kernels.SpartonHead` module in ``sparton_module.py``.

Inside a GradCache step with ``reuse_argmax``, a memo found through :mod:`gradcache_sparton.primitives.forward_memo`
is given the forward op's (max, argmax) in Step (1) and gives them back in Step (3), where the head
skips the forward kernel: Y = activation(max) is rebuilt and the backward op runs on that (max, argmax), bit
for bit the backward of the forward it skips (:class:`_ReplayedHead`). What the memo keeps, and the
check that the replay's H, E and bias are Step (1)'s, belong to the engine
(:mod:`gradcache_sparton.engine.argmax_reuse`).

Dtypes: H and E share one dtype among fp16, bf16, fp32 (fp64 too on CPU); bias may be any floating
dtype (it is added in fp32). Under autocast for the inputs' device, H and E are cast to the autocast
dtype first, as ``nn.Linear`` would, and bias is left as it is. Y has the dtype of the (cast) H; the
saved max stays fp32 so the backward does not inherit a 16-bit rounding of it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from gradcache_sparton.kernels.reference import (
    DEFAULT_HEAD_ACTIVATION,
    activation_from_max,
    check_head_activation,
    sparton_head_backward_reference,
    sparton_head_reference,
)
from gradcache_sparton.primitives.forward_memo import recording_memo, replaying_memo

__all__ = ["sparton_head"]

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# ---------------------------------------------------------------------------------------------------
# Validation (cheap metadata checks, before anything is launched)
# ---------------------------------------------------------------------------------------------------


def _check_inputs(hidden_states: Tensor, weight: Tensor, bias: Tensor | None, attention_mask: Tensor) -> None:
    for name, t in (("hidden_states", hidden_states), ("weight", weight), ("attention_mask", attention_mask)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if bias is not None and not isinstance(bias, Tensor):
        raise TypeError(f"bias must be a torch.Tensor or None, got {type(bias).__name__}")
    if hidden_states.dim() != 3:
        raise ValueError(f"hidden_states must be [B, S, D], got shape {tuple(hidden_states.shape)}")
    if weight.dim() != 2:
        raise ValueError(f"weight must be [V, D], got shape {tuple(weight.shape)}")
    if attention_mask.dim() != 2:
        raise ValueError(f"attention_mask must be [B, S], got shape {tuple(attention_mask.shape)}")
    B, S, D = hidden_states.shape
    V = weight.shape[0]
    if B == 0 or S == 0:
        raise ValueError(f"hidden_states must have a non-empty batch and sequence, got [B, S] = [{B}, {S}]")
    if V == 0 or D == 0:
        raise ValueError(f"weight must be a non-empty [V, D], got shape {tuple(weight.shape)}")
    if weight.shape[1] != D:
        raise ValueError(f"weight is [V, D] = {tuple(weight.shape)} but hidden_states has D = {D}")
    if tuple(attention_mask.shape) != (B, S):
        raise ValueError(f"attention_mask must be [B, S] = [{B}, {S}], got {tuple(attention_mask.shape)}")
    if bias is not None and tuple(bias.shape) != (V,):
        raise ValueError(f"bias must be [V] = [{V}], got shape {tuple(bias.shape)}")
    devices = {t.device for t in (hidden_states, weight, attention_mask, bias) if t is not None}
    if len(devices) != 1:
        raise ValueError(
            f"hidden_states, weight, bias and attention_mask must share one device, got {devices}"
        )
    allowed = _FLOAT_DTYPES if hidden_states.is_cuda else (*_FLOAT_DTYPES, torch.float64)
    if hidden_states.dtype not in allowed:
        raise TypeError(f"hidden_states must be one of {allowed}, got {hidden_states.dtype}")
    if weight.dtype != hidden_states.dtype:
        raise TypeError(
            f"weight ({weight.dtype}) and hidden_states ({hidden_states.dtype}) must share a dtype "
            "(or run under autocast, which casts both)"
        )
    if bias is not None and not bias.is_floating_point():
        raise TypeError(f"bias must be floating point, got {bias.dtype}")
    if attention_mask.is_floating_point() or attention_mask.is_complex():
        raise TypeError(f"attention_mask must be a bool or integer 0/1 mask, got {attention_mask.dtype}")


def _check_mask_values(attention_mask: Tensor) -> None:
    """Masks must be 0/1 (one device sync; runs eagerly inside the op, also under torch.compile).

    Not while a CUDA graph is recorded, which cannot sync: the engine's eager warm-up run of the same
    mini-batch checked it (``GradCache(cuda_graphs=True)``).
    """
    if attention_mask.dtype == torch.bool:
        return
    if attention_mask.is_cuda and torch.cuda.is_current_stream_capturing():
        return
    if bool(((attention_mask != 0) & (attention_mask != 1)).any()):
        raise ValueError("attention_mask must contain only 0 and 1")


# ---------------------------------------------------------------------------------------------------
# Custom ops
# ---------------------------------------------------------------------------------------------------


def _use_triton(hidden_states: Tensor) -> bool:
    """Where the ops run the Triton kernels: CUDA tensors (tests force it on CPU under the interpreter)."""
    return hidden_states.is_cuda


@torch.library.custom_op(
    "gradcache_sparton::sparton_head_forward",
    mutates_args=(),
    schema="(Tensor hidden_states, Tensor weight, Tensor? bias, Tensor attention_mask, "
    "str activation_function) -> (Tensor, Tensor, Tensor)",
)
def _forward_op(
    hidden_states: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    attention_mask: Tensor,
    activation_function: str,
) -> tuple[Tensor, Tensor, Tensor]:
    """(Y [B, V], max [B, V] fp32 (fp64 for fp64 inputs), argmax [B, V] int32)."""
    _check_mask_values(attention_mask)
    if _use_triton(hidden_states):
        from gradcache_sparton.kernels.sparton_forward import sparton_forward  # imports triton

        return sparton_forward(
            hidden_states, weight, bias, attention_mask, activation_function=activation_function
        )
    y, mx, arg = sparton_head_reference(
        hidden_states,
        weight,
        bias,
        attention_mask,
        return_argmax=True,
        activation_function=activation_function,
    )
    return y, mx, arg.to(torch.int32)


@_forward_op.register_fake
def _forward_fake(
    hidden_states: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    attention_mask: Tensor,
    activation_function: str,
) -> tuple[Tensor, Tensor, Tensor]:
    B, V = hidden_states.shape[0], weight.shape[0]
    max_dtype = torch.promote_types(hidden_states.dtype, torch.float32)
    return (
        hidden_states.new_empty(B, V),
        hidden_states.new_empty(B, V, dtype=max_dtype),
        hidden_states.new_empty(B, V, dtype=torch.int32),
    )


@torch.library.custom_op(
    "gradcache_sparton::sparton_head_backward",
    mutates_args=(),
    schema="(Tensor grad_y, Tensor hidden_states, Tensor weight, Tensor max_logits, Tensor argmax, "
    "bool need_grad_hidden, bool need_grad_weight, bool need_grad_bias, str activation_function) "
    "-> (Tensor, Tensor, Tensor)",
)
def _backward_op(
    grad_y: Tensor,
    hidden_states: Tensor,
    weight: Tensor,
    max_logits: Tensor,
    argmax: Tensor,
    need_grad_hidden: bool,
    need_grad_weight: bool,
    need_grad_bias: bool,
    activation_function: str,
) -> tuple[Tensor, Tensor, Tensor]:
    """(grad_H [B, S, D], grad_E [V, D], grad_bias [V] in the dtype of max); a gradient not needed is
    neither computed nor allocated, and comes back as an empty tensor (custom ops return tensors)."""
    needs = (need_grad_hidden, need_grad_weight, need_grad_bias)
    backward = sparton_head_backward_reference
    if _use_triton(hidden_states):
        from gradcache_sparton.kernels.sparton_backward import sparton_backward as backward  # imports triton
    grads = backward(
        grad_y,
        hidden_states,
        weight,
        max_logits,
        argmax,
        needs_input_grad=needs,
        activation_function=activation_function,
    )
    like = (hidden_states, weight, max_logits)
    return tuple(g if g is not None else t.new_empty(0) for g, t in zip(grads, like, strict=True))


@_backward_op.register_fake
def _backward_fake(
    grad_y,
    hidden_states,
    weight,
    max_logits,
    argmax,
    need_grad_hidden,
    need_grad_weight,
    need_grad_bias,
    activation_function,
) -> tuple[Tensor, Tensor, Tensor]:
    """The shapes and dtypes of :func:`_backward_op`'s gradients (its arguments, typed there), for tracing."""
    return (
        torch.empty_like(hidden_states) if need_grad_hidden else hidden_states.new_empty(0),
        torch.empty_like(weight) if need_grad_weight else weight.new_empty(0),
        max_logits.new_empty(weight.shape[0] if need_grad_bias else 0),
    )


def _setup_context(ctx, inputs, output) -> None:
    hidden_states, weight, bias, _, activation_function = inputs
    _, mx, arg = output
    ctx.save_for_backward(hidden_states, weight, mx, arg)
    ctx.bias_dtype = None if bias is None else bias.dtype
    ctx.activation_function = activation_function


def _head_grads(
    ctx, grad_y: Tensor, need_h: bool, need_e: bool, need_bias: bool
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """(grad_H, grad_E, grad_bias) from ``ctx``'s saved (H, E, max, argmax): the backward of the forward op
    and of its replay from a record."""
    hidden_states, weight, mx, arg = ctx.saved_tensors
    # A frozen weight (LoRA, a frozen decoder) gets no [V, D] gradient: at V = 152k, D = 4,096 that is
    # 1.2 GB in bf16 never allocated; likewise grad_H and grad_bias when nothing needs them.
    grad_h, grad_e, grad_bias = _backward_op(
        grad_y, hidden_states, weight, mx, arg, need_h, need_e, need_bias, ctx.activation_function
    )
    return (
        grad_h if need_h else None,
        grad_e if need_e else None,
        grad_bias.to(ctx.bias_dtype) if need_bias else None,
    )


def _backward(ctx, grad_y: Tensor, _grad_max: Tensor, _grad_argmax: Tensor):
    need_h, need_e, need_bias, _, _ = ctx.needs_input_grad
    # the mask and the activation's name get no gradient
    return (*_head_grads(ctx, grad_y, need_h, need_e, need_bias), None, None)


torch.library.register_autograd(
    "gradcache_sparton::sparton_head_forward", _backward, setup_context=_setup_context
)


# ---------------------------------------------------------------------------------------------------
# Replay from a memo (GradCache ``reuse_argmax``)
# ---------------------------------------------------------------------------------------------------


class _ReplayedHead(torch.autograd.Function):
    """Y = activation(max) from the forward op's own (max, argmax) of an earlier call, with the forward op's
    backward."""

    @staticmethod
    def forward(
        ctx,
        hidden_states: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        mx: Tensor,
        arg: Tensor,
        activation_function: str,
    ):
        ctx.save_for_backward(hidden_states, weight, mx, arg)
        ctx.bias_dtype = None if bias is None else bias.dtype
        ctx.activation_function = activation_function
        # [B, V], as the forward op computes it
        return activation_from_max(mx, activation_function).to(hidden_states.dtype)

    @staticmethod
    def backward(ctx, grad_y: Tensor):
        need_h, need_e, need_bias = ctx.needs_input_grad[:3]
        return (*_head_grads(ctx, grad_y, need_h, need_e, need_bias), None, None, None)


# ---------------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------------


def sparton_head(
    hidden_states: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    attention_mask: Tensor,
    *,
    activation_function: str = DEFAULT_HEAD_ACTIVATION,
) -> Tensor:
    """Y[b, v] = max_s log1p(relu(H[b,s]·E[v] + bias[v])) · M[b,s], without the [B, S, V] logits.

    Args:
        hidden_states: [B, S, D] fp16/bf16/fp32 (fp64 on CPU).
        weight: [V, D] vocabulary embeddings, same dtype as ``hidden_states``.
        bias: [V] floating, or None.
        attention_mask: [B, S] bool or integer mask of 0/1.
        activation_function: the activation before the log1p, as sentence-transformers' ``SpladePooling``
            names it: ``"relu"`` (SPLADE) or ``"log1p_relu"`` (Y = log1p(log1p(relu(.))), OpenSearch v3).

    Returns:
        [B, V] in the dtype of ``hidden_states`` (the autocast dtype under autocast). Triton on CUDA,
        the chunked PyTorch reference elsewhere; both differentiable w.r.t. H, E and bias.

    Raises:
        TypeError / ValueError on wrong types, ranks, shapes, dtypes, devices, an empty batch, a
        mask that is not 0/1 or an unknown ``activation_function``, before anything is launched.
    """
    if isinstance(hidden_states, Tensor) and isinstance(weight, Tensor):
        device_type = hidden_states.device.type
        if torch.is_autocast_enabled(device_type):
            dtype = torch.get_autocast_dtype(device_type)
            hidden_states, weight = hidden_states.to(dtype), weight.to(dtype)
    check_head_activation(activation_function)
    _check_inputs(hidden_states, weight, bias, attention_mask)
    memo = replaying_memo()
    if memo is not None:  # GradCache Step (3) with reuse_argmax: Step (1)'s (max, argmax), no forward kernel
        mx, arg = memo.take(hidden_states, weight, bias)  # [B, V] each
        return _ReplayedHead.apply(hidden_states, weight, bias, mx, arg, activation_function)
    y, mx, arg = _forward_op(hidden_states, weight, bias, attention_mask, activation_function)
    memo = recording_memo()
    if memo is not None:  # GradCache Step (1) with reuse_argmax
        memo.record(hidden_states, weight, bias, mx, arg)
    return y
