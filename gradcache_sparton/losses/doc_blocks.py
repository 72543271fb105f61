"""A document column in blocks of bd rows, each densified over the vocabulary and transposed, as the fused
log-sum-exp's kernels read them (:mod:`.fused_lse`, "Layout"): DT [V + 1, bd], a block's weights at (id, row), zero
elsewhere (row V: the padding ids'), and its fp32 gradient of the same shape, at the block's entries.

Legend: V vocabulary, bd documents a block.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

import torch
from torch import Tensor

from gradcache_sparton.losses.query_tiles import entry_values
from gradcache_sparton.primitives.sparse_reps import SparseReps

__all__ = ["DocBlock", "DocBlocks"]


class DocBlock(NamedTuple):
    """One block of a document column, densified (:meth:`DocBlocks.blocks`)."""

    n: int
    """Its rows (documents)."""
    lo: int
    """Its first entry of the column's non-zeros."""
    hi: int
    """Its end entry."""
    entries: tuple[Tensor, Tensor]
    """Its entries' places in DT and grad_DT: (vocabulary ids, rows of the block)."""
    dt: Tensor
    """[V + 1, n] of the tiles' dtype: the block's weights transposed, zero elsewhere (row V: the padding's)."""
    grad_dt: Tensor | None
    """[V + 1, n] fp32, zero at the block's entries (None: no gradient); elsewhere another block's leftovers, which
    no kernel reads or writes: they add into it, and it is gathered, at the entries alone."""


class DocBlocks:
    """A document column read in blocks of ``bd`` rows, each densified transposed over V + 1 (module doc)."""

    def __init__(self, reps: SparseReps, bd: int) -> None:
        self.reps, self.bd = reps, bd
        self._offsets = reps.offsets.tolist()  # read back once: no device sync per block
        self._rows = reps.row_ids()
        self._ids = reps.token_ids.long()

    def blocks(self, weights: Tensor, dtype: torch.dtype, *, grads: bool = False) -> Iterator[DocBlock]:
        """Each block of the column with ``weights``, DT of ``dtype`` and (``grads``) its gradient's block. The blocks'
        DT and grad_DT are views of two [V + 1, bd] buffers, allocated once: each block writes its entries and, once
        the next block is asked for, zeroes its DT entries again, so no block clears the whole buffers (188 MB a
        block at V = 30,522 and bd = 1,024). The zeros are device tensors: a Python 0.0 written at tensor indices
        reaches a GPU tensor through a host-to-device copy that waits for the stream (torch's ``index_put_``), a
        stall each block."""
        shape = (self.reps.vocab_size + 1, min(self.bd, self.reps.num_rows))
        dt_all = weights.new_zeros(shape, dtype=dtype)
        grad_all = weights.new_empty(shape, dtype=torch.float32) if grads else None
        dt_zero = dt_all.new_zeros(())
        grad_zero = None if grad_all is None else grad_all.new_zeros(())
        for j0 in range(0, self.reps.num_rows, self.bd):
            j1 = min(j0 + self.bd, self.reps.num_rows)
            lo, hi = self._offsets[j0], self._offsets[j1]
            at = (self._ids[lo:hi], self._rows[lo:hi] - j0)  # the block's entries in DT
            dt = dt_all[:, : j1 - j0]
            dt[at] = entry_values(weights[lo:hi], dtype)
            grad_dt = None if grad_all is None else grad_all[:, : j1 - j0]
            if grad_dt is not None:
                grad_dt[at] = grad_zero
            yield DocBlock(j1 - j0, lo, hi, at, dt, grad_dt)
            dt[at] = dt_zero  # +0.0: no entry for the next block
