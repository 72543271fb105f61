"""``sparton_head`` and ``SpartonHead``: the SPLADE max-pooled head, dispatched to Triton on CUDA.

Legend: B batch, S sequence, D hidden, V vocabulary.

Y[b, v] = max_s log1p(relu(H[b, s] · E[v] + bias[v])) · M[b, s], computed without the [B, S, V] logits.

The head is two ``torch.library`` custom ops, so ``torch.compile`` (``fullgraph=True`` too) treats it as
one opaque node with a fake (shape-only) implementation instead of tracing into Triton launches:
- ``gradcache_sparton::sparton_head_forward`` -> (Y, fp32 max, int32 argmax): the fused Triton kernel on
  CUDA, :func:`sparton_head_reference` on any other device;
- ``gradcache_sparton::sparton_head_backward`` -> (grad_H, grad_E, grad_bias) from (max, argmax) alone:
  the sparse Triton backward on CUDA, :func:`sparton_head_backward_reference` elsewhere.
``torch.library.register_autograd`` ties them together (the custom-op form of an
``autograd.Function``). Triton is imported only when a CUDA tensor arrives.

Inside a GradCache step with ``reuse_argmax`` (see :mod:`gradcache_sparton.forward_memo`), Step (1)'s
forward also records (max, argmax) at the entries whose gradient can be non-zero (max > 0 or NaN), 12
bytes each, with fingerprints of everything the forward read: H, E and bias (compacted one mini-batch
late, so that no record waits on the device). The Step (3) replay skips the forward kernel: Y =
log1p(max) is rebuilt from the record and the backward op runs on the record's (max, argmax), bit for
bit the backward of an uncached step with the same H, E and bias; the replay reports whether its H, E
and bias were Step (1)'s, so that a change between the two (an optimizer step, an in-place edit of the
decoder) fails the replay check instead of giving the gradient of another function.

Dtypes: H and E share one dtype among fp16, bf16, fp32 (fp64 too on CPU); bias may be any floating
dtype (it is added in fp32). Under autocast for the inputs' device, H and E are cast to the autocast
dtype first, as ``nn.Linear`` would, and bias is left as it is. Y has the dtype of the (cast) H; the
saved max stays fp32 so the backward does not inherit a 16-bit rounding of it.
"""

from __future__ import annotations

import weakref

import torch
from torch import Tensor, nn

from gradcache_sparton.forward_memo import ForwardMemo, recording_memo, replaying_memo
from gradcache_sparton.host_count import HostCount
from gradcache_sparton.kernels.reference import sparton_head_backward_reference, sparton_head_reference

__all__ = ["SpartonHead", "sparton_head"]

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
    schema="(Tensor hidden_states, Tensor weight, Tensor? bias, Tensor attention_mask) "
    "-> (Tensor, Tensor, Tensor)",
)
def _forward_op(
    hidden_states: Tensor, weight: Tensor, bias: Tensor | None, attention_mask: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """(Y [B, V], max [B, V] fp32 (fp64 for fp64 inputs), argmax [B, V] int32)."""
    _check_mask_values(attention_mask)
    if _use_triton(hidden_states):
        from gradcache_sparton.kernels.sparton import sparton_forward  # imports triton

        return sparton_forward(hidden_states, weight, bias, attention_mask)
    y, mx, arg = sparton_head_reference(hidden_states, weight, bias, attention_mask, return_argmax=True)
    return y, mx, arg.to(torch.int32)


@_forward_op.register_fake
def _forward_fake(
    hidden_states: Tensor, weight: Tensor, bias: Tensor | None, attention_mask: Tensor
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
    "bool need_grad_hidden, bool need_grad_weight, bool need_grad_bias) -> (Tensor, Tensor, Tensor)",
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
) -> tuple[Tensor, Tensor, Tensor]:
    """(grad_H [B, S, D], grad_E [V, D], grad_bias [V] in the dtype of max); a gradient not needed is
    neither computed nor allocated, and comes back as an empty tensor (custom ops return tensors)."""
    needs = (need_grad_hidden, need_grad_weight, need_grad_bias)
    if _use_triton(hidden_states):
        from gradcache_sparton.kernels.sparton import sparton_backward  # imports triton

        grads = sparton_backward(grad_y, hidden_states, weight, max_logits, argmax, needs_input_grad=needs)
    else:
        grads = sparton_head_backward_reference(
            grad_y, hidden_states, weight, max_logits, argmax, needs_input_grad=needs
        )
    like = (hidden_states, weight, max_logits)
    return tuple(g if g is not None else t.new_empty(0) for g, t in zip(grads, like, strict=True))


@_backward_op.register_fake
def _backward_fake(
    grad_y: Tensor,
    hidden_states: Tensor,
    weight: Tensor,
    max_logits: Tensor,
    argmax: Tensor,
    need_grad_hidden: bool,
    need_grad_weight: bool,
    need_grad_bias: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    return (
        torch.empty_like(hidden_states) if need_grad_hidden else hidden_states.new_empty(0),
        torch.empty_like(weight) if need_grad_weight else weight.new_empty(0),
        max_logits.new_empty(weight.shape[0] if need_grad_bias else 0),
    )


def _setup_context(ctx, inputs, output) -> None:
    hidden_states, weight, bias, _ = inputs
    _, mx, arg = output
    ctx.save_for_backward(hidden_states, weight, mx, arg)
    ctx.bias_dtype = None if bias is None else bias.dtype


def _head_grads(
    ctx, grad_y: Tensor, need_h: bool, need_e: bool, need_bias: bool
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """(grad_H, grad_E, grad_bias) from ``ctx``'s saved (H, E, max, argmax): the backward of the forward op
    and of its replay from a record."""
    hidden_states, weight, mx, arg = ctx.saved_tensors
    # A frozen weight (LoRA, a frozen decoder) gets no [V, D] gradient: at V = 152k, D = 4,096 that is
    # 1.2 GB in bf16 never allocated; likewise grad_H and grad_bias when nothing needs them.
    grad_h, grad_e, grad_bias = _backward_op(
        grad_y, hidden_states, weight, mx, arg, need_h, need_e, need_bias
    )
    return (
        grad_h if need_h else None,
        grad_e if need_e else None,
        grad_bias.to(ctx.bias_dtype) if need_bias else None,
    )


def _backward(ctx, grad_y: Tensor, _grad_max: Tensor, _grad_argmax: Tensor):
    need_h, need_e, need_bias, _ = ctx.needs_input_grad
    return (*_head_grads(ctx, grad_y, need_h, need_e, need_bias), None)  # the mask gets no gradient


torch.library.register_autograd(
    "gradcache_sparton::sparton_head_forward", _backward, setup_context=_setup_context
)


# ---------------------------------------------------------------------------------------------------
# Replay from Step (1)'s record (GradCache ``reuse_argmax``)
# ---------------------------------------------------------------------------------------------------


class _HeadRecord:
    """Step (1)'s (max, argmax) at the live entries, where max > 0 or is NaN: elsewhere max is 0 (relu)
    and the backward sends nothing whatever the argmax. Legend: n live entries of the [B, V] grid.

    - ``positions`` [n] flat indices into [B, V] (int32 while B·V < 2**31, else int64),
    - ``max_logits`` [n] in the saved max's dtype (fp32; fp64 for fp64 inputs),
    - ``argmax`` [n] int32 sequence positions,
    - ``fingerprint`` [B] fp32 row sums of H, to check that the replay's H is bitwise Step (1)'s,
    - ``weights_digest`` [2] int64 digests of E and bias as the forward read them (after autocast's cast),
      to check that the replay's are bitwise Step (1)'s (:func:`_bits_digest`).

    Keeping the live entries needs their count n on the host, and reading it right away would stall
    the host until the device has finished this mini-batch, once per mini-batch. So a record is kept in
    two stages: :meth:`keep` holds the dense [B, V] (max, argmax) and starts copying n to the host
    behind the work queued so far; the record is compacted to its n entries when the next record is
    kept (by then the host has queued the next mini-batch, so waiting for this copy leaves the device
    busy), or when it is taken back, whichever comes first. At most two mini-batches' dense records
    exist at once, and no step waits on the device for them.
    """

    def __init__(
        self, hidden_states: Tensor, weight: Tensor, bias: Tensor | None, max_logits: Tensor, argmax: Tensor
    ) -> None:
        self.hidden_shape = tuple(hidden_states.shape)
        self.hidden_dtype = hidden_states.dtype
        self.vocab_size = max_logits.shape[1]
        self.fingerprint = _row_sums(hidden_states)
        self.weights_digest = _weights_digest(weight, bias)
        flat_max = max_logits.detach().reshape(-1)  # [B, V] -> [B·V]; a record never holds a graph
        live = (flat_max > 0) | flat_max.isnan()  # [B·V]
        self._dense: tuple[Tensor, Tensor, Tensor] | None = (flat_max, argmax.reshape(-1), live)
        self._count = HostCount(live.sum())
        self.positions: Tensor | None = None
        self.max_logits: Tensor | None = None
        self.argmax: Tensor | None = None

    @classmethod
    def keep(
        cls, hidden_states: Tensor, weight: Tensor, bias: Tensor | None, max_logits: Tensor, argmax: Tensor
    ) -> _HeadRecord:
        """A record of the forward op's [B, V] (max, argmax) on (H, E, bias); earlier records still dense are
        compacted."""
        record = cls(hidden_states, weight, bias, max_logits, argmax)
        for earlier in [r for ref in _DENSE_RECORDS if (r := ref()) is not None]:
            earlier.compact()
        _DENSE_RECORDS[:] = [weakref.ref(record)]
        return record

    def compact(self) -> None:
        """Keep only the live entries (waits for their count, copied to the host when the record was kept)."""
        if self._dense is None:
            return
        flat_max, flat_arg, live = self._dense
        n = self._count.value()
        index_dtype = torch.int32 if flat_max.numel() < 2**31 else torch.int64
        positions = torch.nonzero_static(live, size=n).squeeze(1)  # [n] int64; n known: no sync
        self.positions = positions.to(index_dtype)
        self.max_logits = flat_max[positions]
        self.argmax = flat_arg[positions]
        self._dense = None

    def restore(self) -> tuple[Tensor, Tensor]:
        """The forward op's [B, V] (max, argmax): the kept entries, 0 elsewhere (what relu left there)."""
        self.compact()
        B, V = self.hidden_shape[0], self.vocab_size
        positions = self.positions.long()
        mx = self.max_logits.new_zeros(B * V).index_copy_(0, positions, self.max_logits)
        arg = self.argmax.new_zeros(B * V).index_copy_(0, positions, self.argmax)
        return mx.view(B, V), arg.view(B, V)


# The record kept last, while it is dense (weakly held: an abandoned step's record is freed with it).
_DENSE_RECORDS: list[weakref.ref[_HeadRecord]] = []


def _row_sums(hidden_states: Tensor) -> Tensor:
    """[B, S, D] -> [B] fp32 sums, computed alike in Step (1) and Step (3) (no graph, no autocast)."""
    with torch.no_grad(), torch.autocast(hidden_states.device.type, enabled=False):
        return hidden_states.detach().sum(dim=(1, 2), dtype=torch.float32)


def _bits_digest(tensor: Tensor) -> Tensor:
    """An int64 scalar digest of ``tensor``'s bits: the sum of its elements' bit patterns read as integers.

    Integer sums are exact and independent of summation order, so bitwise-equal tensors give equal
    digests on any device, and a change of any single element (by as little as one ulp, which a
    floating-point sum can absorb) always changes it. A permutation of the elements keeps it, as it
    keeps the reps' row sums that check the replay without ``reuse_argmax``. One read of the tensor, no
    copy (a same-size integer view), no device sync.
    """
    integer = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.element_size()]
    with torch.no_grad():
        return tensor.detach().view(integer).sum(dtype=torch.int64)


def _weights_digest(weight: Tensor, bias: Tensor | None) -> Tensor:
    """[2] int64: the digests of E [V, D] and bias [V] (0 without one), as the forward op reads them."""
    bias_digest = weight.new_zeros((), dtype=torch.int64) if bias is None else _bits_digest(bias)
    return torch.stack([_bits_digest(weight), bias_digest])


class _ReplayedHead(torch.autograd.Function):
    """Y = log1p(max) from a record (the forward op's own last step), with the forward op's backward."""

    @staticmethod
    def forward(ctx, hidden_states: Tensor, weight: Tensor, bias: Tensor | None, mx: Tensor, arg: Tensor):
        ctx.save_for_backward(hidden_states, weight, mx, arg)
        ctx.bias_dtype = None if bias is None else bias.dtype
        return torch.log1p(mx).to(hidden_states.dtype)  # [B, V], as the forward op computes it

    @staticmethod
    def backward(ctx, grad_y: Tensor):
        need_h, need_e, need_bias = ctx.needs_input_grad[:3]
        return (*_head_grads(ctx, grad_y, need_h, need_e, need_bias), None, None)


def _replay(memo: ForwardMemo, hidden_states: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    record = memo.take()
    if (
        not isinstance(record, _HeadRecord)
        or record.hidden_shape != tuple(hidden_states.shape)
        or record.hidden_dtype != hidden_states.dtype
        or record.vocab_size != weight.shape[0]
    ):
        seen = (
            f"hidden states {list(record.hidden_shape)} {record.hidden_dtype} and V = {record.vocab_size}"
            if isinstance(record, _HeadRecord)
            else f"a {type(record).__name__} record"
        )
        raise RuntimeError(
            f"the replayed Sparton head got hidden states {list(hidden_states.shape)} {hidden_states.dtype} and "
            f"V = {weight.shape[0]}, but Step (1) recorded {seen} at this call: the encoder did not take the "
            "same path twice"
        )
    # The rebuilt output and backward are the forward's only if it would read what Step (1)'s read: the same
    # H (which also covers every weight before the head) and the same E and bias.
    hidden_differs = (
        _row_sums(hidden_states).view(torch.int32) != record.fingerprint.view(torch.int32)
    ).any()
    weights_differ = (_weights_digest(weight, bias) != record.weights_digest).any()
    memo.report(hidden_differs | weights_differ)
    mx, arg = record.restore()  # [B, V] each
    return _ReplayedHead.apply(hidden_states, weight, bias, mx, arg)


# ---------------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------------


def sparton_head(
    hidden_states: Tensor, weight: Tensor, bias: Tensor | None, attention_mask: Tensor
) -> Tensor:
    """Y[b, v] = max_s log1p(relu(H[b,s]·E[v] + bias[v])) · M[b,s], without the [B, S, V] logits.

    Args:
        hidden_states: [B, S, D] fp16/bf16/fp32 (fp64 on CPU).
        weight: [V, D] vocabulary embeddings, same dtype as ``hidden_states``.
        bias: [V] floating, or None.
        attention_mask: [B, S] bool or integer mask of 0/1.

    Returns:
        [B, V] in the dtype of ``hidden_states`` (the autocast dtype under autocast). Triton on CUDA,
        the chunked PyTorch reference elsewhere; both differentiable w.r.t. H, E and bias.

    Raises:
        TypeError / ValueError on wrong types, ranks, shapes, dtypes, devices, an empty batch or a
        mask that is not 0/1, before anything is launched.
    """
    if isinstance(hidden_states, Tensor) and isinstance(weight, Tensor):
        device_type = hidden_states.device.type
        if torch.is_autocast_enabled(device_type):
            dtype = torch.get_autocast_dtype(device_type)
            hidden_states, weight = hidden_states.to(dtype), weight.to(dtype)
    _check_inputs(hidden_states, weight, bias, attention_mask)
    memo = replaying_memo()
    if memo is not None:  # GradCache Step (3) with reuse_argmax: no forward kernel
        return _replay(memo, hidden_states, weight, bias)
    y, mx, arg = _forward_op(hidden_states, weight, bias, attention_mask)
    memo = recording_memo()
    if memo is not None:  # GradCache Step (1) with reuse_argmax
        memo.record(_HeadRecord.keep(hidden_states, weight, bias, mx, arg))
    return y


class SpartonHead(nn.Module):
    """SPLADE head: max over the sequence of log1p(relu(logits)), masked, fused so logits never exist.

    Usually built from (and sharing the parameters of) a masked-LM decoder with
    :meth:`from_decoder` or :meth:`tie_weights`, so a model saved with ``save_pretrained`` stays a
    standard masked-LM checkpoint with no extra tensors.
    """

    def __init__(
        self,
        hidden_size: int,
        vocab_size: int,
        *,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if hidden_size < 1 or vocab_size < 1:
            raise ValueError(
                f"hidden_size and vocab_size must be >= 1, got hidden_size={hidden_size}, "
                f"vocab_size={vocab_size}"
            )
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(vocab_size, device=device, dtype=dtype)) if bias else None
        if self.weight.device.type != "meta":
            nn.init.normal_(self.weight, std=0.02)

    @property
    def vocab_size(self) -> int:
        return self.weight.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.weight.shape[1]

    @classmethod
    def from_decoder(cls, decoder: nn.Linear) -> SpartonHead:
        """A head that shares ``decoder.weight`` [V, D] and ``decoder.bias`` [V] (no copy)."""
        if not isinstance(decoder, nn.Linear):
            raise TypeError(f"decoder must be an nn.Linear, got {type(decoder).__name__}")
        head = cls(decoder.in_features, decoder.out_features, bias=decoder.bias is not None, device="meta")
        head.tie_weights(decoder)
        return head

    def tie_weights(self, decoder: nn.Linear) -> None:
        """Share the parameters of a masked-LM decoder (``nn.Linear(D, V)``) instead of owning copies."""
        if not isinstance(decoder, nn.Linear):
            raise TypeError(f"decoder must be an nn.Linear, got {type(decoder).__name__}")
        self.weight = decoder.weight
        self.bias = decoder.bias

    def forward(self, hidden_states: Tensor, attention_mask: Tensor) -> Tensor:
        """[B, S, D] hidden states and [B, S] 0/1 mask -> [B, V] sparse reps."""
        return sparton_head(hidden_states, self.weight, self.bias, attention_mask)

    def extra_repr(self) -> str:
        return f"hidden_size={self.hidden_size}, vocab_size={self.vocab_size}, bias={self.bias is not None}"
