"""What a decoder-only LM needs to encode like a masked LM: attention both ways, and echo inputs.

Legend: B batch, S sequence.

- ``bidirectional``: every token attends to every attended token, later ones too, through a [B, 1, S, S]
  mask that replaces the causal one (:func:`bidirectional_mask`; the ``sdpa`` and ``eager`` attention
  implementations read it as given). The same mask spares the BERT family's ``sdpa`` path a host read.
- ``echo``: the backbone reads each text twice and only the second copy is pooled, so every pooled token
  has seen the whole text (:func:`echo_inputs`).
- the BOS and EOS positions stay out of the pool by default (:func:`default_special_token_ids`): under causal
  attention the BOS position sees only itself, so its rep is the same for every text.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from gradcache_sparton.modeling.backbones import is_decoder_only

__all__ = ["bidirectional_mask", "check_attention_implementation", "default_special_token_ids", "echo_inputs"]

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


def default_special_token_ids(model: nn.Module) -> tuple[int, ...]:
    """The token ids ``SpladeEncoder`` keeps out of the pool when none are given: for a decoder-only LM its
    config's ``bos_token_id`` and ``eos_token_id`` (each an id or a list of ids; those within the vocabulary),
    for a masked LM none (SPLADE pools [CLS] and [SEP] as the reference models do).

    A decoder's tokenizer puts BOS (and some an EOS) in every text; under causal attention the BOS position
    attends to itself only, so its contribution is one fixed vector added to every rep. ``special_token_ids=()``
    pools them all the same.
    """
    if not is_decoder_only(type(model)):
        return ()
    vocab_size = model.get_output_embeddings().out_features
    ids: list[int] = []
    for name in ("bos_token_id", "eos_token_id"):
        value = getattr(model.config, name, None)
        for token_id in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(token_id, int) and not isinstance(token_id, bool) and 0 <= token_id < vocab_size:
                ids.append(token_id)
    return tuple(sorted(set(ids)))


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
