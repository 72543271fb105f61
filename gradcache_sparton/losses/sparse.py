"""The SPLADE loss on sparse reps: memory that grows with the non-zeros, not with V.

Legend: B batch (queries), V vocabulary, k hard negatives per query, nnz non-zeros of a column,
bq × bd one score block.

Each column is a :class:`~gradcache_sparton.primitives.sparse_reps.SparseReps` (row offsets,
vocabulary ids, weights) whose ``weights`` [nnz] are the differentiable input: every gradient here
is dL/d weights, the gradient at the reps' non-zeros only. That is all a SPLADE head needs (its relu
sends no gradient through a zero rep), and what the GradCache engine's ``sparse_reps`` hands to
Step (3). The contrastive losses are those of :mod:`.contrastive`, scored by :data:`SPARSE_SCORES`.
Against the dense [B, V] loss the value is the same up to fp32 summation order:

- all-pairs scores (InfoNCE, listwise KL with in-batch negatives): the blocked log-sum-exp of
  :mod:`.blocked` on a sparse layout, one block of rows densified at a time, over all V or, for the
  query blocks whose active columns U are few (trained reps), over U only ([b, |U| padded]; the
  exactness argument and the choice are :mod:`.blocked`'s "Active columns"; :func:`sparse_score_plan`
  shows the plan); in the backward each block's gradient is gathered at that block's non-zeros;
- paired scores s(q_i, d_i) (the positive's score, MarginMSE, listwise KL): entries matched by
  (row, id) with a sorted search, O(nnz), no [B, V] buffer;
- FLOPS: column sums ``index_add`` over the vocabulary ids ([V]); L1: the sum of ``|weights|``.

Memory: the weights' fp32 copy and gradient (4 + 4 bytes per non-zero), the [V] column sums, and at
most four fp32 [block, V] buffers at once (a query block, a document block and, in the backward,
the gradient of each; [block, W] when compacted), never [B, V]; for one forward or backward pass the int64
row and id of every entry (8 + 8 bytes per non-zero, made once rather than per block pair); the plan's
active ids (at most 8 bytes per query non-zero) and a [blocks, V] bool mask of at most 64 MiB while it is made. The automatic block (:func:`sparse_block_size`) keeps each of
them within :data:`SPARSE_BLOCK_MAX_BYTES`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import cached_property
from typing import NamedTuple

import torch
from torch import Tensor

from gradcache_sparton.losses.blocked import (
    AUTO_BLOCK_SIZE,
    BlockColumns,
    QueryBlock,
    RowBlocks,
    plan_query_blocks,
    rows_logsumexp,
)
from gradcache_sparton.losses.columns import accumulation_dtype
from gradcache_sparton.losses.contrastive import ScorePath, Scores
from gradcache_sparton.losses.fused_lse import fused_sparse_logsumexp, use_fused_kernel
from gradcache_sparton.primitives.sparse_reps import SPARSE_BLOCK_MAX_BYTES, SparseReps

# Bytes of the [blocks, V] bool mask a plan finds each query block's active columns with, at a time.
_PLAN_MASK_BYTES = 64 << 20

__all__ = [
    "SPARSE_BLOCK_MAX_BYTES",
    "SPARSE_SCORES",
    "SparseColumns",
    "sparse_block_size",
    "sparse_blocked_logsumexp",
    "sparse_expected_flops",
    "sparse_flops",
    "sparse_l1",
    "sparse_mean_nonzeros",
    "sparse_paired_scores",
    "sparse_score_plan",
    "sparse_weighted_scores",
    "split_sparse_columns",
    "upcast_sparse",
]


def sparse_block_size(vocab_size: int) -> int:
    """Rows per score block of the sparse path when none is given: AUTO_BLOCK_SIZE, fewer at large V."""
    return max(1, min(AUTO_BLOCK_SIZE, SPARSE_BLOCK_MAX_BYTES // (4 * vocab_size)))


class SparseColumns(NamedTuple):
    """The columns of a contrastive batch as sparse reps: queries, positives, k hard negatives (B rows each)."""

    q_reps: SparseReps
    pos_reps: SparseReps
    neg_reps: list[SparseReps]


def split_sparse_columns(reps: Mapping[str, object]) -> SparseColumns:
    """Split ``reps`` (column name -> :class:`SparseReps`) into (queries, positives, hard negatives), checked.

    Raises:
        TypeError: a column is not a :class:`SparseReps` (dense and sparse columns do not mix).
        ValueError: fewer than two columns, columns with different V, devices or row counts.
    """
    names = list(reps)
    if len(names) < 2:
        raise ValueError(
            f"reps must have at least two columns (queries, then positives), got {names}; "
            "further columns are hard negatives"
        )
    for name, column in reps.items():
        if not isinstance(column, SparseReps):
            raise TypeError(
                f"reps[{name!r}] is a {type(column).__name__} but other columns are SparseReps: a loss call "
                "takes all columns dense ([B, V] tensors) or all sparse (SparseReps)"
            )
    columns = [reps[name] for name in names]
    q = columns[0]
    for name, column in zip(names[1:], columns[1:], strict=True):
        assert isinstance(column, SparseReps) and isinstance(q, SparseReps)  # checked above
        if column.shape != q.shape or column.weights.device != q.weights.device:
            raise ValueError(
                f"reps[{name!r}] is {list(column.shape)} on {column.weights.device} but reps[{names[0]!r}] is "
                f"{list(q.shape)} on {q.weights.device}: every column needs one row per query, one V, one device"
            )
    return SparseColumns(columns[0], columns[1], columns[2:])  # type: ignore[arg-type]


def upcast_sparse(reps: SparseReps) -> SparseReps:
    """The same reps with fp32 weights for half-precision ones (a differentiable cast; fp32/fp64 unchanged)."""
    dtype = torch.promote_types(reps.weights.dtype, torch.float32)
    return SparseReps(reps.offsets, reps.token_ids, reps.weights.to(dtype), reps.vocab_size)


class _SparseRows:
    """:class:`~.blocked.RowBlocks` of sparse reps: a block of rows densified (over all V, or over a compacted
    query block's columns), its gradient gathered back at its non-zeros. One is made per forward or backward
    pass: its int64 rows and ids of the entries, made at the first block, serve every block pair of the pass."""

    def __init__(self, reps: SparseReps, weights: Tensor) -> None:
        self.tensor = weights  # [nnz], the differentiable input
        self._reps = reps
        self._offsets = reps.offsets.tolist()  # read back once: no device sync per block
        self.num_rows, self.vocab_size = reps.num_rows, reps.vocab_size

    @cached_property
    def _rows(self) -> Tensor:
        """[nnz] int64: every entry's row; made once per pass, not once per block pair."""
        return self._reps.row_ids()

    @cached_property
    def _ids(self) -> Tensor:
        """[nnz] int64: every entry's vocabulary id (indexing takes int64); made once per pass."""
        return self._reps.token_ids.long()

    def _entries(self, start: int, stop: int) -> tuple[int, int, Tensor, Tensor]:
        """Rows ``start:stop``'s entries ``lo:hi``, with their row within the block and their id ([nnz_b] each)."""
        lo, hi = self._offsets[start], self._offsets[stop]
        return lo, hi, self._rows[lo:hi] - start, self._ids[lo:hi]

    def active_columns(self, edge: int) -> list[Tensor]:
        """Each block of ``edge`` rows' sorted unique ids: a [blocks, V] bool mask at a time (two syncs each)."""
        vocab, num_rows = self.vocab_size, self.num_rows
        per_pass = edge * max(1, _PLAN_MASK_BYTES // vocab)  # rows whose blocks share one mask
        active: list[Tensor] = []
        for first in range(0, num_rows, per_pass):
            last = min(first + per_pass, num_rows)
            _, _, rows, ids = self._entries(first, last)
            mask = torch.zeros((-(-(last - first) // edge), vocab), dtype=torch.bool, device=ids.device)
            mask[rows // edge, ids] = mask.new_ones(())  # [blocks, V]: the ids each block touches
            sizes = mask.sum(dim=1).tolist()
            active.extend(mask.nonzero()[:, 1].split(sizes))  # row-major: per block, ids ascending
        return active

    def block(self, start: int, stop: int, dtype: torch.dtype, columns: BlockColumns | None = None) -> Tensor:
        lo, hi, rows, ids = self._entries(start, stop)
        if columns is None:
            dense = self.tensor.new_zeros((stop - start, self.vocab_size), dtype=dtype)  # [b, V]
            dense[rows, ids] = self.tensor[lo:hi].to(dtype)
            return dense
        dense = self.tensor.new_zeros((stop - start, columns.width), dtype=dtype)  # [b, W]
        dense[rows, columns.index[ids]] = self.tensor[lo:hi].to(dtype)
        dense[:, columns.outside] = 0  # the entries outside U (a document's): they meet only query zeros
        return dense

    def add_to_grad(
        self, grad: Tensor, start: int, stop: int, block_grad: Tensor, columns: BlockColumns | None = None
    ) -> None:
        lo, hi, rows, ids = self._entries(start, stop)
        at = ids if columns is None else columns.index[ids]  # outside U: the zero column (module doc)
        grad[lo:hi] += block_grad[rows, at]  # [b, V or W] -> [nnz_b], at the block's non-zeros


def sparse_blocked_logsumexp(
    q_reps: SparseReps,
    d_reps: Sequence[SparseReps],
    *,
    temperature: float,
    block_size: int,
    shard_across_ranks: bool = False,
) -> Tensor:
    """Each query's log-sum-exp of its scaled scores against every document -> [B], in [block, block] blocks.

    The sparse twin of :func:`~.blocked.blocked_logsumexp` (the same loops, blocks densified from the
    sparse rows): differentiable in ``q_reps.weights`` and every ``d_reps[c].weights``. Unchecked.
    ``shard_across_ranks``: each rank scores 1/W of the query blocks (:mod:`.blocked`).
    """
    layouts = [q_reps, *d_reps]

    def rows_of(position: int, weights: Tensor) -> RowBlocks:
        return _SparseRows(layouts[position], weights)

    return rows_logsumexp(
        rows_of,
        q_reps.weights,
        [d.weights for d in d_reps],
        temperature=temperature,
        block_size=block_size,
        shard_across_ranks=shard_across_ranks,
    )


def sparse_weighted_scores(
    q_reps: SparseReps, d_reps: Sequence[SparseReps], weights: Tensor, *, block_size: int
) -> Tensor:
    """``sum_j weights[i, j] · (q_i · d_j)`` over every document -> [B] (fp32, fp64 for fp64 weights): each
    query's scores weighted by ``weights`` [B, len(d_reps)·B] (column c·B + r: row r of ``d_reps[c]``; not
    differentiated), differentiable in every column's weights. Unchecked.

    Bilinear, so no score matrix: per block of ``block_size`` queries, the weighted sum of the densified
    document blocks ([bq, bd] @ [bd, V] -> [bq, V]) is read at the queries' non-zeros. Autograd keeps no
    densified block (the products save their ``weights`` slice only): at most a few [block, V] buffers at once.
    """
    dtype = accumulation_dtype(q_reps.weights, *(d.weights for d in d_reps))
    num_rows, weights = q_reps.num_rows, weights.to(dtype)
    queries = _SparseRows(q_reps, q_reps.weights)
    documents = [_SparseRows(d, d.weights) for d in d_reps]
    parts = []
    # An ambient autocast (a caller's own loop) would run the products in bf16/fp16: keep them in fp32.
    with torch.autocast(weights.device.type, enabled=False):
        for qs in range(0, num_rows, block_size):
            qe = min(qs + block_size, num_rows)
            mixed = None  # [bq, V]: each query's weighted document
            for c, rows in enumerate(documents):
                for ds in range(0, num_rows, block_size):
                    de = min(ds + block_size, num_rows)
                    term = weights[qs:qe, c * num_rows + ds : c * num_rows + de] @ rows.block(ds, de, dtype)
                    mixed = term if mixed is None else mixed + term
            lo, hi, rows_in_block, ids = queries._entries(qs, qe)
            products = q_reps.weights[lo:hi].to(dtype) * mixed[rows_in_block, ids]  # [nnz_b]
            parts.append(products.new_zeros(qe - qs).index_add(0, rows_in_block, products))  # [bq]
    return torch.cat(parts)


def sparse_score_plan(q_reps: SparseReps, *, block_size: int) -> list[QueryBlock]:
    """The query blocks :func:`sparse_blocked_logsumexp` runs ``q_reps`` in at ``block_size`` (documents'
    edge): which are compacted to their active columns, and how wide (:func:`~.blocked.plan_query_blocks`)."""
    return plan_query_blocks(_SparseRows(q_reps, q_reps.weights), block_size)


def sparse_paired_scores(q_reps: SparseReps, d_reps: SparseReps) -> Tensor:
    """Row-wise dot products of aligned sparse reps -> [B] (fp32, fp64 for fp64 weights); O(nnz) memory.

    Every query entry looks up the document entry with its (row, id) by a sorted search (ids ascend
    within a row, rows ascend); differentiable in both ``weights``. Unchecked: one B, one V.
    """
    dtype = accumulation_dtype(q_reps.weights, d_reps.weights)
    width = q_reps.vocab_size
    q_rows = q_reps.row_ids()  # [nnz_q]
    q_keys = q_rows * width + q_reps.token_ids  # [nnz_q], ascending
    # A sentinel past every key ends the documents' keys, so every search lands on an entry.
    sentinel = q_keys.new_full((1,), d_reps.num_rows * width)
    d_keys = torch.cat([d_reps.row_ids() * width + d_reps.token_ids, sentinel])  # [nnz_d + 1], ascending
    d_weights = torch.cat([d_reps.weights.to(dtype), d_reps.weights.new_zeros(1, dtype=dtype)])
    found = torch.searchsorted(d_keys, q_keys)  # [nnz_q]
    d_at_q = torch.where(d_keys[found] == q_keys, d_weights[found], 0.0)  # [nnz_q]: d's weight at q's entries
    products = q_reps.weights.to(dtype) * d_at_q  # [nnz_q]
    return products.new_zeros(q_reps.num_rows).index_add(0, q_rows, products)  # [nnz_q] -> [B]


def sparse_flops(columns: Sequence[SparseReps]) -> Tensor:
    """FLOPS ``sum_v (mean_b reps[b, v])²`` over the rows of every column: a 0-d fp32 tensor (fp64 stays)."""
    dtype = accumulation_dtype(*(column.weights for column in columns))
    rows = sum(column.num_rows for column in columns)
    width = columns[0].vocab_size
    column_sum = sum(
        column.weights.new_zeros(width, dtype=dtype).index_add(0, column.token_ids, column.weights.to(dtype))
        for column in columns
    )  # [nnz] -> [V], summed over the columns
    return (column_sum / rows).square().sum()  # [V] -> []


def sparse_l1(columns: Sequence[SparseReps]) -> Tensor:
    """L1 ``mean_b sum_v |reps[b, v]|`` over the rows of every column: a 0-d fp32 tensor (fp64 stays)."""
    dtype = accumulation_dtype(*(column.weights for column in columns))
    rows = sum(column.num_rows for column in columns)
    return sum(column.weights.abs().sum(dtype=dtype) for column in columns) / rows  # [nnz] -> []


@torch.no_grad()
def sparse_mean_nonzeros(columns: Sequence[SparseReps]) -> Tensor:
    """Average number of non-zero entries per rep over all rows, as a 0-d fp32 tensor."""
    device = columns[0].weights.device
    # Filled on the device: torch.tensor(n, device=cuda) copies from the host, a device sync.
    total = torch.full(
        (), sum(column.weights.numel() for column in columns), dtype=torch.int64, device=device
    )
    return total.to(torch.float32) / sum(column.num_rows for column in columns)


@torch.no_grad()
def sparse_expected_flops(q_columns: Sequence[SparseReps], d_columns: Sequence[SparseReps]) -> Tensor:
    """SPLADE's FLOPS measure ``sum_v p_q(v) · p_d(v)`` (see :mod:`.sparsity`) as a 0-d fp32 tensor."""

    def activation_rate(columns: Sequence[SparseReps]) -> Tensor:
        width = columns[0].vocab_size
        counts = sum(torch.bincount(column.token_ids, minlength=width) for column in columns)  # [V] int64
        return counts.to(torch.float32) / sum(column.num_rows for column in columns)

    return torch.dot(activation_rate(q_columns), activation_rate(d_columns))  # [V] . [V] -> []


class _SparseScores:
    """:class:`~.contrastive.Scores` of :class:`SparseReps`: paired scores by sorted search, the log-sum-exp
    in the fused kernel (:func:`~.fused_lse.use_fused_kernel` says when) or in blocks (:func:`sparse_block_size`
    rows when none is given)."""

    def paired(self, q_reps: SparseReps, d_reps: SparseReps) -> Tensor:
        return sparse_paired_scores(q_reps, d_reps)

    def upcast(self, *reps: SparseReps) -> list[SparseReps]:
        dtype = accumulation_dtype(*(column.weights for column in reps))
        return [SparseReps(c.offsets, c.token_ids, c.weights.to(dtype), c.vocab_size) for c in reps]

    def block_size(self, q_reps: SparseReps, num_columns: int, block_size: int | None, shard: bool) -> int:
        return sparse_block_size(q_reps.vocab_size) if block_size is None else block_size

    def logsumexp(
        self, q_reps: SparseReps, d_reps: Sequence[SparseReps], *, temperature: float, path: ScorePath
    ) -> Tensor:
        if use_fused_kernel(q_reps, d_reps, path.kernel):
            return fused_sparse_logsumexp(
                q_reps, d_reps, temperature=temperature, shard_across_ranks=path.shard_across_ranks
            )
        return path.blocked_logsumexp(sparse_blocked_logsumexp, q_reps, d_reps, temperature=temperature)

    def weighted(
        self, q_reps: SparseReps, d_reps: Sequence[SparseReps], weights: Tensor, *, block_size: int
    ) -> Tensor:
        return sparse_weighted_scores(q_reps, d_reps, weights, block_size=block_size)


SPARSE_SCORES: Scores = _SparseScores()
"""The :class:`~.contrastive.Scores` of :class:`SparseReps`: the contrastive losses of :mod:`.contrastive`
on the non-zeros (:func:`~.contrastive.info_nce`, :func:`~.contrastive.margin_mse`, :func:`~.contrastive.kl_div`)."""
