"""What a decoder-only LM needs to encode like a masked LM: attention both ways, and echo inputs.

Legend: B batch, S sequence.

- ``bidirectional``: every token attends to every attended token, later ones too, through a [B, 1, S, S]
  mask that replaces the causal one (:func:`bidirectional_mask`; the ``sdpa`` and ``eager`` attention
  implementations read it as given). The same mask spares the BERT family's ``sdpa`` path a host read.
- ``echo``: the backbone reads each text twice and only the second copy is pooled, so every pooled token
  has seen the whole text (:func:`echo_inputs`).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = ["bidirectional_mask", "check_attention_implementation", "echo_inputs"]

# Attention implementations that read a [B, 1, S, S] mask as given (transformers passes a 4-D mask on
# unchanged), which is how bidirectional attention replaces the causal one.
_BIDIRECTIONAL_ATTENTION = ("sdpa", "eager")


def check_attention_implementation(model: nn.Module) -> None:
    """Raise unless ``model``'s attention implementation reads a [B, 1, S, S] mask as given (sdpa, eager)."""
    implementation = model.config._attn_implementation
    if implementation not in _BIDIRECTIONAL_ATTENTION:
        raise ValueError(
            f"bidirectional=True needs attn_implementation in {_BIDIRECTIONAL_ATTENTION}, got {implementation!r} "
            "(flash attention kernels take causality from the layer, not from the mask)"
        )


def bidirectional_mask(model: nn.Module, attention_mask: Tensor) -> Tensor:
    """[B, S] padding mask -> [B, 1, S, S]: every query attends to every attended key, later ones too."""
    check_attention_implementation(model)
    S = attention_mask.shape[1]
    keys = attention_mask.bool()[:, None, None, :].expand(-1, 1, S, -1)  # [B, 1, S, S]
    if model.config._attn_implementation == "sdpa":
        return keys  # bool: True attends
    # eager adds the mask to the scores: 0 where attended, the dtype's minimum elsewhere.
    dtype = model.dtype
    return torch.zeros(keys.shape, dtype=dtype, device=keys.device).masked_fill(~keys, torch.finfo(dtype).min)


def echo_inputs(
    input_ids: Tensor, attention_mask: Tensor, pool_mask: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """Each row's attended tokens twice, right-padded to [B, 2S]; only the second copy keeps ``pool_mask``.

    Row b with L_b attended tokens t (in order, wherever its padding was) becomes [t, t] (2·L_b
    tokens) then padding; position p < L_b reads t[p], L_b <= p < 2·L_b reads t[p - L_b].
    """
    B, S = input_ids.shape
    attended = attention_mask.bool()  # [B, S]
    # Stable sort puts the attended positions first, in order: a left-padded row is compacted too.
    order = torch.sort((~attended).to(torch.int8), dim=1, stable=True).indices  # [B, S]
    ids, pool = input_ids.gather(1, order), pool_mask.gather(1, order)  # [B, S]
    lengths = attended.sum(dim=1, keepdim=True)  # [B, 1]
    position = torch.arange(2 * S, device=input_ids.device).expand(B, -1)  # [B, 2S]
    second = position >= lengths  # [B, 2S]
    source = torch.where(second, position - lengths, position).clamp(max=S - 1)  # [B, 2S]
    echo_mask = position < 2 * lengths  # [B, 2S]
    echo_ids = ids.gather(1, source).masked_fill(~echo_mask, 0)  # [B, 2S]
    echo_pool = pool.gather(1, source) & second & echo_mask  # [B, 2S]
    return echo_ids, echo_mask.to(attention_mask.dtype), echo_pool
