"""The reps between the steps, dense or sparse: assembled in Step (1), leaves of Step (2), sliced in Step (3).

A column's reps are a dense [B, V] tensor in the column's row order, or with ``sparse_reps`` its
non-zeros, a :class:`~gradcache_sparton.primitives.sparse_reps.SparseReps` (also in row order), whose gradient
(dL/d weights) reaches Step (3) as a :class:`~gradcache_sparton.engine.sparse_grads.SparseRepGrad`.

Legend: B batch (rows of a column), V rep width, mb rows of a mini-batch, nnz non-zeros of a column.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from gradcache_sparton.engine.distributed import holds_on_every_rank
from gradcache_sparton.engine.mini_batch import Rows, mini_batch_order
from gradcache_sparton.engine.sparse_grads import SparseRepGrad
from gradcache_sparton.engine.types import MiniBatch
from gradcache_sparton.primitives.host_count import HostCount
from gradcache_sparton.primitives.sparse_reps import SparseReps

__all__ = ["StepReps", "leaf", "leaf_grad", "mini_batch_grad", "replay_grads"]


class StepReps:
    """Step (1)'s reps of every column, put together as the mini-batches come (:meth:`add`, then
    :meth:`column` once a column's last mini-batch is in).

    Dense: each mini-batch's [mb, V] reps go to their rows of its column's [B, V] tensor (no copy when
    one mini-batch holds every row in order). Sparse (``sparse_reps``): each mini-batch's non-zeros are
    kept one mini-batch late, once their count has reached the host without waiting on the device's
    queue. ``sparse_reps="auto"`` is decided by the step's first mini-batch for every column: sparse when
    [mb, V] reps take fewer bytes as non-zeros (an int32 id and a value per non-zero, an int64 offset per
    row) than dense (one device sync), agreed across ranks when gathering so that all gather one layout.
    Reps that are not [B, V] stay dense.
    """

    def __init__(self, sparse_reps: str, world_size: int) -> None:
        self._keep_sparse = None if sparse_reps == "auto" else sparse_reps == "true"
        self._world_size = world_size
        self._dense: dict[str, Tensor] = {}  # column -> [B, V], rows in the column's order
        self._parts: dict[str, list[SparseReps]] = {}  # column -> each mini-batch's non-zeros
        self._pending: tuple[str, Tensor, HostCount] | None = None  # last mini-batch, its count on its way

    def add(self, column: str, batch_size: int, rows: Rows, rep: Tensor) -> None:
        """Mini-batch ``rows`` of ``column`` (of ``batch_size`` rows): its reps [mb, V]."""
        if self._keep_sparse is None:
            self._keep_sparse = _sparse_is_smaller(rep)
            if self._world_size > 1:
                self._keep_sparse = holds_on_every_rank(self._keep_sparse, rep.device)
        if self._keep_sparse and rep.ndim == 2:
            self._flush()
            self._parts.setdefault(column, [])
            self._pending = (column, rep, HostCount(torch.count_nonzero(rep)))
        elif isinstance(rows, slice) and rows == slice(0, batch_size):
            self._dense[column] = rep  # one mini-batch of every row, in order: no copy
        else:
            if column not in self._dense:
                self._dense[column] = rep.new_empty((batch_size, *rep.shape[1:]))
            self._dense[column][rows] = rep  # [mb, V] -> its rows of [B, V]

    def column(self, column: str, mini_batches: Sequence[MiniBatch]) -> Tensor | SparseReps:
        """``column``'s reps in its row order, once all its ``mini_batches`` were added."""
        self._flush()
        if column in self._parts:
            reps = SparseReps.concat(self._parts.pop(column))  # the column's rows in mini-batch order
            order = mini_batch_order([mb.rows for mb in mini_batches], reps.offsets.device)  # [B]
            return reps if order is None else reps.select(torch.argsort(order))  # length groups put back
        return self._dense.pop(column)  # a column has at least one row (check_columns)

    def _flush(self) -> None:
        if self._pending is not None:
            column, rep, nnz = self._pending
            self._parts[column].append(SparseReps.from_dense(rep, dtype=None, nnz=nnz.value()))
            self._pending = None


def _sparse_is_smaller(rep: Tensor) -> bool:
    if rep.ndim != 2:
        return False
    sparse_bytes = int(torch.count_nonzero(rep)) * (4 + rep.element_size()) + 8 * (rep.shape[0] + 1)
    return sparse_bytes < rep.numel() * rep.element_size()


def leaf(rep: Tensor | SparseReps) -> Tensor | SparseReps:
    """Step (2)'s leaf for a column: the dense reps, or the weights of sparse reps (ids and offsets fixed)."""
    if isinstance(rep, SparseReps):
        weights = rep.weights.detach().requires_grad_()
        return SparseReps(rep.offsets, rep.token_ids, weights, rep.vocab_size)
    return rep.detach().requires_grad_()


def leaf_grad(rep: Tensor | SparseReps) -> Tensor | None:
    """The gradient Step (2)'s backward left on a :func:`leaf`: dL/dr [B, V], or dL/d weights [nnz]."""
    return rep.weights.grad if isinstance(rep, SparseReps) else rep.grad


def replay_grads(
    reps: Mapping[str, Tensor | SparseReps],
    grads: Mapping[str, Tensor | None],
    mini_batches: Mapping[str, Sequence[MiniBatch]],
) -> dict[str, Tensor | SparseRepGrad | None]:
    """Step (2)'s gradients as Step (3) takes them: a sparse column's dL/d weights placed by Step (1)'s
    mini-batches (:meth:`SparseRepGrad.at_sparse_reps`); dense ones and None as they are."""
    return {
        column: SparseRepGrad.at_sparse_reps(reps[column], grad, [mb.rows for mb in mini_batches[column]])
        if grad is not None and isinstance(reps[column], SparseReps)
        else grad
        for column, grad in grads.items()
    }


def mini_batch_grad(grad: Tensor | SparseRepGrad, k: int, mb: MiniBatch) -> Tensor:
    """A column's rep gradient -> mini-batch ``k``'s [mb, V] slice."""
    if isinstance(grad, SparseRepGrad):
        return grad.mini_batch(k)  # kept non-zeros -> [mb, V]
    return grad[mb.rows]  # [B, V] -> [mb, V]
