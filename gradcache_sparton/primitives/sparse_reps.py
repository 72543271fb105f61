"""Sparse reps in compressed-row layout (like CSR): offsets, vocabulary ids, weights.

Legend: N reps, V vocabulary.

One type shared by the GradCache engine (``sparse_reps``: reps kept as their non-zeros from Step (1)
on), the losses (:mod:`gradcache_sparton.losses.sparse`) and evaluation (encoded corpora, retrieval,
indexes, export), which re-exports it as ``gradcache_sparton.evaluation.SparseReps``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["SPARSE_BLOCK_MAX_BYTES", "SparseReps"]

# Bytes of one densified fp32 [block, V] buffer of the loss over sparse reps under its automatic block size
# (``losses.sparse.sparse_block_size``; defined here, below the losses and the engine, so that the engine's
# memory plan bounds that loss with the same number).
# Four live at once, so 2 GiB in all: at V = 30,522 the block is AUTO_BLOCK_SIZE rows (4,096; 477 MiB
# each), at V = 250,002 it is 536 rows, where 4,096 rows would take 3.8 GiB each, 15 GiB for the four
# (issue 18's V = 250,002 target is a whole step in 16 GiB).
SPARSE_BLOCK_MAX_BYTES = 512 << 20


@dataclass(frozen=True)
class SparseReps:
    """N sparse reps over a vocabulary of V, in compressed-row layout (like CSR), on one device.

    - ``offsets`` [N + 1] int64: row i's entries are ``[offsets[i], offsets[i + 1])``,
    - ``token_ids`` [nnz] int32 vocabulary ids, ascending within a row (int32: V < 2**31, and the
      ids are most of the memory next to the weights),
    - ``weights`` [nnz] float32, all non-zero (the reps' own dtype when built with
      ``from_dense(reps, dtype=None)``, as the GradCache engine's ``sparse_reps`` does).

    Our own three tensors rather than ``torch.sparse_csr_tensor``: CSR is still beta in torch (it warns
    on construction), and retrieval only needs row slices densified into a chunk.
    """

    offsets: Tensor
    token_ids: Tensor
    weights: Tensor
    vocab_size: int

    @property
    def num_rows(self) -> int:
        return self.offsets.numel() - 1

    @property
    def shape(self) -> torch.Size:
        """[N, V], the shape of the dense reps."""
        return torch.Size((self.num_rows, self.vocab_size))

    def nonzeros_per_row(self) -> Tensor:
        """[N] int64 number of non-zero entries of each rep."""
        return self.offsets[1:] - self.offsets[:-1]

    def to_dense(
        self, start: int = 0, end: int | None = None, *, device: torch.device | None = None
    ) -> Tensor:
        """Rows ``start:end`` as a dense float32 [end - start, V] tensor on ``device`` (fp64 weights stay fp64)."""
        end = self.num_rows if end is None else end
        lo, hi = int(self.offsets[start]), int(self.offsets[end])
        device = self.weights.device if device is None else device
        counts = (self.offsets[start + 1 : end + 1] - self.offsets[start:end]).to(device)
        rows = torch.repeat_interleave(torch.arange(end - start, device=device), counts)  # [nnz_slice]
        dtype = torch.promote_types(self.weights.dtype, torch.float32)
        dense = torch.zeros(end - start, self.vocab_size, dtype=dtype, device=device)
        dense[rows, self.token_ids[lo:hi].to(device, torch.int64)] = self.weights[lo:hi].to(device, dtype)
        return dense

    @staticmethod
    def from_dense(
        reps: Tensor, *, dtype: torch.dtype | None = torch.float32, nnz: int | None = None
    ) -> SparseReps:
        """Keep the non-zeros of a dense [N, V] tensor (on its device, as ``dtype``; None: the reps' dtype).

        ``nnz``: their number, when the host already knows it (e.g. from a
        :class:`~gradcache_sparton.primitives.host_count.HostCount`): the non-zeros are then found without a
        device sync. It must be exact (not checked on the device).
        """
        if reps.dim() != 2:
            raise ValueError(f"reps must be 2-D [N, V], got shape {tuple(reps.shape)}")
        if nnz is None:
            rows, token_ids = reps.nonzero(as_tuple=True)  # row-major order: rows ascending, ids ascending
        else:
            rows, token_ids = torch.nonzero_static(reps, size=nnz).unbind(1)  # [nnz] each, row-major too
        counts = reps.ne(0).sum(dim=1)  # [N]; not bincount(rows), which reads its size on the host
        offsets = torch.zeros(reps.shape[0] + 1, dtype=torch.int64, device=reps.device)
        offsets[1:] = torch.cumsum(counts, 0)
        weights = reps[rows, token_ids].to(reps.dtype if dtype is None else dtype)
        return SparseReps(offsets, token_ids.to(torch.int32), weights, reps.shape[1])

    @staticmethod
    def concat(parts: Sequence[SparseReps]) -> SparseReps:
        """Stack the rows of several :class:`SparseReps` (same V, same device) in order."""
        if not parts:
            raise ValueError("parts is empty")
        vocab_size = parts[0].vocab_size
        if any(p.vocab_size != vocab_size for p in parts):
            raise ValueError(f"all parts must have one vocabulary size, got {[p.vocab_size for p in parts]}")
        offsets, shift = [parts[0].offsets[:1]], 0
        for part in parts:
            offsets.append(part.offsets[1:] + shift)
            shift += part.weights.numel()  # = part.offsets[-1], known on the host (no device read)
        return SparseReps(
            torch.cat(offsets),
            torch.cat([p.token_ids for p in parts]),
            torch.cat([p.weights for p in parts]),
            vocab_size,
        )

    def to(self, device: torch.device | str) -> SparseReps:
        """The same reps on ``device``."""
        return SparseReps(
            self.offsets.to(device), self.token_ids.to(device), self.weights.to(device), self.vocab_size
        )

    def select(self, order: Tensor) -> SparseReps:
        """The rows in the given order ([M] int64 row indices)."""
        offsets, source = self.entries_of(order)
        return SparseReps(offsets, self.token_ids[source], self.weights[source], self.vocab_size)

    def entries_of(self, order: Tensor) -> tuple[Tensor, Tensor]:
        """Where the rows ``order`` ([M] int64 row indices) take their entries from.

        Returns:
            offsets [M + 1] int64 of the selected rows, and source [nnz_selected] int64: the position
            in this object's entries of each selected entry (rows in ``order``, ids ascending).
        """
        order = order.to(self.offsets.device)
        counts = self.nonzeros_per_row()[order]
        starts = self.offsets[:-1][order]
        offsets = torch.zeros(order.numel() + 1, dtype=torch.int64, device=order.device)
        offsets[1:] = torch.cumsum(counts, 0)
        # Position of every selected entry in the source: its row's start + its rank within the row.
        within = torch.arange(int(offsets[-1]), device=order.device) - torch.repeat_interleave(
            offsets[:-1], counts
        )
        return offsets, torch.repeat_interleave(starts, counts) + within

    def row_ids(self) -> Tensor:
        """[nnz] int64: the row of each entry."""
        rows = torch.arange(self.num_rows, device=self.offsets.device)
        return torch.repeat_interleave(rows, self.nonzeros_per_row(), output_size=self.weights.numel())
