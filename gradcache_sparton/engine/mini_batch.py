"""Cutting one input column into mini-batches, each trimmed of its trailing padding.

Mini-batches are consecutive rows, or rows grouped by length under a token budget: GradCache's result
does not depend on which rows share a mini-batch, so grouping only saves padding. Cut lengths can be
rounded up to a multiple (``mini_batch_length_multiple``), so that mini-batches come in a few shapes: what a
compiled encoder with static shapes, or one replayed from CUDA graphs, needs.

Legend: B batch (rows of a column), S sequence, mb rows of a mini-batch.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

import torch
from torch import Tensor

__all__ = [
    "Rows",
    "describe_rows",
    "iter_mini_batches",
    "mini_batch_order",
    "mini_batch_starts",
    "row_count",
    "row_slices",
]

Rows = slice | Tensor
"""A mini-batch's rows in its column: consecutive rows (a slice), or a [mb] index tensor (grouped by length)."""


def row_slices(batch_size: int, mini_batch_size: int) -> Iterator[slice]:
    """Consecutive row ranges of at most ``mini_batch_size`` rows covering ``range(batch_size)``.

    The last range is short when ``mini_batch_size`` does not divide ``batch_size``.
    """
    for start in range(0, batch_size, mini_batch_size):
        yield slice(start, min(start + mini_batch_size, batch_size))


def iter_mini_batches(
    features: Mapping[str, Tensor],
    batch_size: int,
    mini_batch_size: int,
    *,
    mini_batch_tokens: int | None = None,
    mini_batch_length_multiple: int | None = None,
) -> Iterator[tuple[Rows, dict[str, Tensor]]]:
    """(rows, features of those rows) per mini-batch, each cut to its own longest row.

    A mini-batch of short texts cut from a batch padded to its longest text need not pay for the
    padding: with an attention mask, trailing padded positions change no real position's output. Every
    [B, S] feature (S the mask's) is cut after the last position that any row of the mini-batch keeps;
    other features (e.g. [B] labels) are taken by rows only, and nothing is cut when there is no 2-D
    ``attention_mask``. At least one position is kept, so fully masked rows keep a valid shape.

    Without ``mini_batch_tokens``, mini-batches are consecutive rows (``rows`` a slice), at most
    ``mini_batch_size`` each. With it (length-grouped, token-budget mini-batches), the rows are taken
    longest first (a stable sort by kept length, so ties keep their order) and packed greedily: each
    mini-batch holds at most ``mini_batch_size`` rows and at most ``mini_batch_tokens`` padded tokens
    (rows x its longest row, the length it is cut to); a row longer than the budget makes a
    mini-batch of its own. ``rows`` is then a [mb] index tensor on the mask's device, and the caller
    puts each mini-batch's results back at those rows. This needs a 2-D ``attention_mask``.

    With ``mini_batch_length_multiple`` = m, each cut length (the longest row kept) is rounded up to a multiple
    of m, at most the column's own width: the extra positions are the column's padding, masked as
    before, so only the shapes change (at most ceil(S / m) + 1 lengths per column), not the result.
    A token budget counts the rounded length.

    The kept lengths of all rows are read back from the device once per column, not once per
    mini-batch: each read is a synchronisation that stalls the host's kernel queue.
    """
    mask = features.get("attention_mask")
    lengths = _kept_lengths(mask)  # [B] on the mask's device
    width = mask.shape[1] if lengths is not None else 0
    if mini_batch_tokens is None:
        kept = lengths.tolist() if lengths is not None else None
        for rows in row_slices(batch_size, mini_batch_size):
            cut = None if kept is None else _rounded(max(kept[rows]), mini_batch_length_multiple, width)
            yield rows, _cut(features, rows, rows.stop - rows.start, cut)
        return
    if lengths is None:
        raise ValueError("mini_batch_tokens needs a 2-D attention_mask [B, S] to measure each row's length")
    order = torch.argsort(lengths, descending=True, stable=True)  # [B]: longest first
    sorted_lengths = lengths[order].tolist()
    start = 0
    while start < batch_size:
        longest = _rounded(sorted_lengths[start], mini_batch_length_multiple, width)
        count = max(1, min(mini_batch_size, mini_batch_tokens // longest, batch_size - start))
        rows = order[start : start + count]  # [mb], a view: no transfer
        yield rows, _cut(features, rows, count, longest)
        start += count


def row_count(rows: Rows) -> int:
    """How many rows a mini-batch has."""
    return rows.stop - rows.start if isinstance(rows, slice) else len(rows)


def mini_batch_starts(mini_batch_rows: Sequence[Rows]) -> tuple[int, ...]:
    """Where each mini-batch begins with the mini-batches laid end to end: (0, mb_0, mb_0 + mb_1, ..., B)."""
    starts = [0]
    for rows in mini_batch_rows:
        starts.append(starts[-1] + row_count(rows))
    return tuple(starts)


def mini_batch_order(mini_batch_rows: Sequence[Rows], device: torch.device) -> Tensor | None:
    """[B] int64: the column's row at each position of the mini-batches laid end to end; None when
    they are consecutive slices (that order is the column's own)."""
    if all(isinstance(rows, slice) for rows in mini_batch_rows):
        return None
    return torch.cat(
        [torch.arange(r.start, r.stop, device=device) if isinstance(r, slice) else r for r in mini_batch_rows]
    )


def describe_rows(rows: Rows) -> str:
    """``rows 0:3`` for a slice, ``rows [4, 0, 7]`` for an index tensor (reads it back: for messages only)."""
    if isinstance(rows, slice):
        return f"rows {rows.start}:{rows.stop}"
    return f"rows {rows.tolist()}"


def _rounded(length: int, multiple: int | None, width: int) -> int:
    """A cut length: at least 1, rounded up to ``multiple`` (when given), at most the column's ``width``."""
    length = max(length, 1)
    if multiple is not None:
        length = -(-length // multiple) * multiple
    return min(length, width)


def _cut(features: Mapping[str, Tensor], rows: Rows, count: int, keep: int | None) -> dict[str, Tensor]:
    """The features of ``rows`` (``count`` of them), every [mb, S] feature cut to ``keep`` positions."""
    taken = {name: value[rows] for name, value in features.items()}
    if keep is None:
        return taken
    seq_len = features["attention_mask"].shape[1]
    if keep == seq_len:
        return taken
    shape = (count, seq_len)
    return {
        name: value[:, :keep].contiguous() if value.shape == shape else value for name, value in taken.items()
    }


def _kept_lengths(mask: Tensor | None) -> Tensor | None:
    """[B]: per row, 1 + the last position its mask keeps (0 for a fully masked row); None without a [B, S] mask."""
    if mask is None or mask.ndim != 2 or mask.shape[1] == 0:
        return None
    # [B, S] -> [B]: position numbers 1..S where kept, 0 elsewhere; the row's max is its kept length.
    positions = torch.arange(1, mask.shape[1] + 1, device=mask.device)
    return (mask.ne(0) * positions).amax(dim=1)
