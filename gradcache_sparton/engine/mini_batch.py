"""Cutting one input column into mini-batches, and trimming each mini-batch's trailing padding.

Legend: B batch (rows of a column), S sequence.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch
from torch import Tensor

__all__ = ["row_slices", "trim_trailing_padding"]


def row_slices(batch_size: int, mini_batch_size: int) -> Iterator[slice]:
    """Consecutive row ranges of at most ``mini_batch_size`` rows covering ``range(batch_size)``.

    The last range is short when ``mini_batch_size`` does not divide ``batch_size``.
    """
    for start in range(0, batch_size, mini_batch_size):
        yield slice(start, min(start + mini_batch_size, batch_size))


def trim_trailing_padding(features: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Cut every [B, S] feature to the last position that any row's ``attention_mask`` keeps.

    A mini-batch of short texts cut from a batch padded to its longest text need not pay for the
    padding: with an attention mask, trailing padded positions change no real position's output.
    Features that are not [B, S] with the mask's S (e.g. [B] labels) are returned unchanged, and so
    is everything when there is no 2-D ``attention_mask``. At least one position is kept, so a
    mini-batch of fully masked rows keeps its shape valid for the encoder.
    """
    mask = features.get("attention_mask")
    if mask is None or mask.ndim != 2:
        return dict(features)
    batch_size, seq_len = mask.shape
    # [B, S] -> [S]: which positions some row keeps; the last such position + 1 is the length to keep.
    kept_positions = mask.ne(0).any(dim=0)
    positions = torch.arange(1, seq_len + 1, device=mask.device)
    keep = max(int((kept_positions * positions).max()), 1) if seq_len > 0 else seq_len
    if keep == seq_len:
        return dict(features)
    return {
        name: value[:, :keep].contiguous() if value.shape == (batch_size, seq_len) else value
        for name, value in features.items()
    }
