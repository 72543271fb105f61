"""Cutting one input column into mini-batches, each trimmed of its trailing padding.

Legend: B batch (rows of a column), S sequence.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch
from torch import Tensor

__all__ = ["iter_mini_batches", "row_slices"]


def row_slices(batch_size: int, mini_batch_size: int) -> Iterator[slice]:
    """Consecutive row ranges of at most ``mini_batch_size`` rows covering ``range(batch_size)``.

    The last range is short when ``mini_batch_size`` does not divide ``batch_size``.
    """
    for start in range(0, batch_size, mini_batch_size):
        yield slice(start, min(start + mini_batch_size, batch_size))


def iter_mini_batches(
    features: Mapping[str, Tensor], batch_size: int, mini_batch_size: int
) -> Iterator[tuple[slice, dict[str, Tensor]]]:
    """(rows, features of those rows) per mini-batch, each cut to its own longest row.

    A mini-batch of short texts cut from a batch padded to its longest text need not pay for the
    padding: with an attention mask, trailing padded positions change no real position's output. Every
    [B, S] feature (S the mask's) is cut after the last position that any row of the mini-batch keeps;
    other features (e.g. [B] labels) are sliced by rows only, and nothing is cut when there is no 2-D
    ``attention_mask``. At least one position is kept, so fully masked rows keep a valid shape.

    The kept lengths of all rows are read back from the device once per column, not once per
    mini-batch: each read is a synchronisation that stalls the host's kernel queue.
    """
    lengths = _kept_lengths(features.get("attention_mask"))
    seq_len = features["attention_mask"].shape[1] if lengths is not None else 0
    for rows in row_slices(batch_size, mini_batch_size):
        sliced = {name: value[rows] for name, value in features.items()}
        if lengths is None:
            yield rows, sliced
            continue
        keep = max(max(lengths[rows]), 1)
        if keep == seq_len:
            yield rows, sliced
            continue
        shape = (rows.stop - rows.start, seq_len)
        yield (
            rows,
            {
                name: value[:, :keep].contiguous() if value.shape == shape else value
                for name, value in sliced.items()
            },
        )


def _kept_lengths(mask: Tensor | None) -> list[int] | None:
    """Per row, 1 + the last position its mask keeps (0 for a fully masked row); None without a [B, S] mask."""
    if mask is None or mask.ndim != 2 or mask.shape[1] == 0:
        return None
    # [B, S] -> [B]: position numbers 1..S where kept, 0 elsewhere; the row's max is its kept length.
    positions = torch.arange(1, mask.shape[1] + 1, device=mask.device)
    return (mask.ne(0) * positions).amax(dim=1).tolist()
