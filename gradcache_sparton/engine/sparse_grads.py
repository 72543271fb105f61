"""Rep gradients at the non-zeros of sparse reps, placed by Step (1)'s mini-batches for Step (3).

With ``sparse_reps`` Step (2) differentiates the weights of each column's
:class:`~gradcache_sparton.primitives.sparse_reps.SparseReps`: its gradient is dL/dr at the reps' non-zeros only.
A SPLADE head's reps are relu'd, so wherever a rep is 0 its gradient reaches no parameter (the head's
backward multiplies it by 1[y > 0]): Step (3) needs nothing else, and each replayed mini-batch gets
back the dense gradient at its non-zeros (zeros elsewhere, which such an encoder ignores).

Layout: the non-zeros of one column in the order of Step (1)'s mini-batches (row-major within each),
with per-mini-batch offsets read back once, so Step (3) slices its entries without a device sync.

Legend: B batch (rows of a column), V rep width, nnz non-zeros of a column's reps, mb mini-batch rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from gradcache_sparton.engine.mini_batch import Rows, mini_batch_order, mini_batch_starts
from gradcache_sparton.primitives.sparse_reps import SparseReps

__all__ = ["SparseRepGrad"]


@dataclass(frozen=True)
class SparseRepGrad:
    """One column's dL/dr at the non-zeros of its reps, grouped by Step (1)'s mini-batches."""

    rows: Tensor  # [nnz] int32: row in mini-batch order
    cols: Tensor  # [nnz] int32: position in V
    values: Tensor  # [nnz]: dL/dr there
    starts: tuple[int, ...]  # mini-batch k's rows are [starts[k], starts[k + 1]) in mini-batch order
    offsets: tuple[int, ...]  # mini-batch k's entries are [offsets[k], offsets[k + 1])
    width: int  # V

    @classmethod
    def at_sparse_reps(cls, reps: SparseReps, grad: Tensor, mini_batch_rows: Sequence[Rows]) -> SparseRepGrad:
        """``grad`` [nnz], dL/d ``reps.weights`` (rows in the column's order), in the order of ``mini_batch_rows``.

        What Step (2) gives for sparse reps (``sparse_reps``): the gradient is already at the
        non-zeros, only reordered for length-grouped mini-batches. One device sync per column (the
        mini-batch offsets).
        """
        offsets, cols, values = reps.offsets, reps.token_ids, grad
        order = mini_batch_order(mini_batch_rows, offsets.device)  # [B], None: already in that order
        if order is not None:  # grouped by length: each mini-batch's rows together, in its order
            offsets, source = reps.entries_of(order)  # [B + 1], [nnz]
            cols, values = cols[source], grad[source]
        starts = mini_batch_starts(mini_batch_rows)
        counts = offsets[1:] - offsets[:-1]  # [B]
        positions = torch.arange(reps.num_rows, dtype=torch.int32, device=offsets.device)
        return cls(
            rows=torch.repeat_interleave(positions, counts, output_size=values.numel()),  # [nnz]
            cols=cols,
            values=values,
            starts=starts,
            offsets=tuple(offsets[list(starts)].tolist()),
            width=reps.vocab_size,
        )

    def mini_batch(self, index: int) -> Tensor:
        """Mini-batch ``index``'s dense gradient [mb, V]: the kept values, zeros elsewhere."""
        lo, hi = self.offsets[index], self.offsets[index + 1]
        start, stop = self.starts[index], self.starts[index + 1]
        dense = self.values.new_zeros((stop - start, self.width))  # [mb, V]
        dense[self.rows[lo:hi].long() - start, self.cols[lo:hi].long()] = self.values[lo:hi]
        return dense
