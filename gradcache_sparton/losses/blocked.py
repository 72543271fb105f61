"""The batch's score matrix in blocks: each query's log-sum-exp over all documents, never [B, (1+k)·B] at once.

Legend: B batch (queries), N = (1+k)·B documents of the batch, V vocabulary, bq × bd one block.

InfoNCE (and listwise KL with in-batch negatives) needs, per query i, ``lse[i] = logsumexp_j s[i, j]``
over every document of the batch, ``s = q @ docs^T / temperature``. Built whole, the fp32 scores and
their softmax take ~12·N·B bytes at peak, which grows with B²: 96 GiB at B = 65,536, k = 1. Here the
scores exist one [bq, bd] block at a time:

- forward: an online log-sum-exp over the document blocks of each query block (running max m and
  running sum l of exp(s - m), rescaled when the max grows), as tile-wise softmax kernels do;
- backward: each block's scores are recomputed with the same operations in the same order (so they
  are bitwise the forward's), turned into ``p = exp(s - lse)`` (d lse[i] / d s[i, j]), and
  ``grad_q += p @ d_block``, ``grad_d += p^T @ q_block``.

The loops run on any :class:`RowBlocks` layout of a column: dense reps here, sparse reps (a block
densified at a time, gradients gathered at its non-zeros) in :mod:`.sparse`.

The result equals the dense computation up to fp32 summation order (the blocks add up the same terms
in another order).

Active columns (sparse reps; :func:`plan_query_blocks`): a score ``q·d`` only needs the vocabulary
columns where q is non-zero; every other term is a product with a query zero. Trained SPLADE queries
have ~50 non-zeros, and the union U of a block of 512 queries' active columns is ~4,000 of V = 30,522
(SciFact, the shipped SPLADE-tiny). So each query block of the plan carries U, its sorted unique
vocabulary ids, and both passes densify it as [bq, W] and every document block as [bd, W]
(W = |U| + 1 padded to :data:`COMPACT_COLUMN_MULTIPLE`): the document entries whose id is in U at
their column, the others written to column |U| and zeroed, every padding column zero. Exactness: the
query's non-zeros are all in U, so the compact score sums exactly the non-zero products the dense one
sums (only the fp32 order differs); ``grad_q`` is read at the query's non-zeros (all in U), and a
document's non-zeros outside U get nothing from this query block, as their zero products give them in
the dense path (the zeroed column's gradient is exactly 0). The plan is computed once in the forward
and kept for the backward, so both passes build bitwise-identical score blocks (same U, same order).
Blocks: queries in blocks of ``min(block_size, COMPACT_QUERY_ROWS)`` rows (few rows keep |U| small),
documents in blocks of :func:`compact_document_rows` rows (``block_size`` times up to V // W: a compact
document block and score block are never larger than the whole-V plan's, and fewer, larger products
leave less per-block work around them); a block whose W would exceed
:data:`COMPACT_MAX_FRACTION` of V runs over all V, and when the compacted plan would not at least halve
the product work (random-init-like reps: hundreds of uniform random terms a row give |U| near V) the
plan is the whole-V one: query and document blocks of ``block_size``, as before compaction. The bf16
products, their 3-part split and the fp32/fp64 CPU paths are the same on compact blocks. Dense [B, V]
reps (:func:`blocked_logsumexp`) always run over all V (their layout has no cheap U).

Sharded across ranks (``shard_across_ranks``, for data-parallel training whose loss sees the batch
gathered from every rank, identical on all W ranks): rank r runs the loops above for its contiguous
1/W of the plan's query blocks only (every rank computes the same plan from the same reps). The forward fills its rows of lse [B] and sums the ranks' (zero
elsewhere) with one all-reduce of B floats; the backward sums the ranks' partial gradients (each
query row from one rank, each document from all) with one all-reduce per input, of its gradient's size
([B, V] dense, [nnz] sparse). Every rank then holds the full lse and gradients, as unsharded, for a
W-th of the block products. Every rank must call it with the same inputs: each input's size and fp64
sum are compared across ranks first (one all-reduce of a few floats), and a difference raises the same
``ValueError`` on every rank (reps that differ but agree in size and sum are not caught).

Products on a GPU: without TF32 an fp32 matmul runs on the CUDA cores (an H100's datasheet peaks: 67
TFLOP/s fp32 against 989 bf16 on the tensor cores), and the blocked products grow as B²: 4 · 2 · B ·
(1+k)B · V flops a step. When every input holds bf16 values (reps made under bf16 autocast and upcast;
checked once per call, :func:`products_in_bf16`) the blocks are kept in bf16 and multiplied on the
tensor cores with fp32 output (``torch.mm(..., out_dtype=torch.float32)``): the product of two bf16
values is exact in fp32, so the scores are sums of the exact fp32 products, in another order. The
backward's fp32 softmax weights are not bf16 values: each is split exactly into three bf16 parts (8 +
8 + 8 significant bits, :func:`_bf16_parts`, once per block for both gradients), and the parts'
products are summed in fp32 by one GEMM (:func:`_mm_fp32_left`): the parts side by side over K = 3·k
against the block repeated three times (``grad_d``: the query block, few rows), or stacked as 3·m rows
whose three [m, n] results are then summed (``grad_q`` of a compacted block: few queries against many
documents), whichever temporary is smaller. So the gradients too are sums of exact products, in another
fp32 order. A blocked step then does 8 bf16 products' work where it did 4 fp32 ones. On a CPU, and for
other values, the products stay fp32 (fp64) matmuls.

Memory: the [B, V] rep gradients the dense path also returns, plus a few [bq, bd] blocks and copies
of one query block and one document block ([b, W] when compacted; the plan keeps each block's U, at
most one int64 per query non-zero) (bf16 in the product path above; fp32 for half-precision
reps otherwise: callers upcast once the columns they also use elsewhere, so their gradients are rounded
once). The split product's temporary is at most 1.5 fp32 [b, W] blocks: a block repeated three times in
bf16, or a [3·bq, W] fp32 product, taken only where it is the smaller. Time: the forward matmuls run
twice (once more in the backward), so a blocked step costs one extra [B, V] x [V, N] product over the
dense one.

:func:`score_block_size` decides: dense while the fp32 score matrix fits :data:`DENSE_SCORES_MAX_BYTES`,
blocks of :data:`AUTO_BLOCK_SIZE` beyond; an explicit block size always blocks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple, Protocol

import torch
import torch.distributed as dist
from torch import Tensor
from torch.autograd.function import FunctionCtx, once_differentiable

from gradcache_sparton.losses.columns import accumulation_dtype

__all__ = [
    "AUTO_BLOCK_SIZE",
    "COMPACT_COLUMN_MULTIPLE",
    "COMPACT_MAX_FRACTION",
    "COMPACT_QUERY_ROWS",
    "DENSE_SCORES_MAX_BYTES",
    "BlockColumns",
    "QueryBlock",
    "RowBlocks",
    "RowsOf",
    "blocked_logsumexp",
    "check_block_size",
    "check_same_on_every_rank",
    "compact_document_rows",
    "plan_query_blocks",
    "products_in_bf16",
    "rows_logsumexp",
    "score_block_size",
]

# The fp32 [B, N] score matrix is built whole up to 1 GiB (B = 16,384 queries with one hard negative
# is 2 GiB: blocked). Below that the dense path's ~3 buffers of that size are a small share of a GPU's
# memory and it saves the blocked path's extra matmul.
DENSE_SCORES_MAX_BYTES = 1 << 30

# Block edge (queries and documents) of the automatic choice: a [4,096, 4,096] fp32 block is 64 MiB,
# small next to the [B, V] reps of such batches, and each [4,096, V] @ [V, 4,096] product stays large
# enough to keep a GPU's matmul units busy (not measured here: a starting point, not a tuned value).
AUTO_BLOCK_SIZE = 4096

# Query rows of a block whose columns may be compacted (module doc, "Active columns"): min(this, block_size).
# The union of active columns grows slowly with the rows: the shipped SPLADE-tiny's reps of SciFact claims
# (50 non-zeros each) touch 1,120 of V = 30,522 columns in 64 queries, 2,720 in 256, 4,079 in 512 and 5,613
# in 1,024. At 512 rows a block's products are 13% of V wide and still [512, |U|] x [|U|, block_size]:
# large enough for the tensor cores; fewer rows shrink |U| slowly while every document block is densified
# once per query block (2B / block_size of them each). A starting point: bench_loss_curve.py measures it.
COMPACT_QUERY_ROWS = 512

# A query block is compacted when its padded width is at most this fraction of V, and the compacted plan
# is used only when its product work (rows x width, summed over the blocks) is at most this fraction of
# the whole-V plan's: the products must at least halve to pay for what compaction adds (the vocabulary ->
# column map, each document block densified once per (smaller) query block instead of once per
# block_size queries, the plan's pass over the queries). Random-init-like reps (hundreds of uniform
# random terms a row) give widths near V and keep the whole-V plan.
COMPACT_MAX_FRACTION = 0.5

# Compacted widths are padded up to a multiple of this: tensor-core tiles (bf16 MMA K-steps of 16..64)
# waste nothing, and widths repeat across blocks (fewer distinct GEMM shapes for cuBLAS heuristics).
COMPACT_COLUMN_MULTIPLE = 64


def check_block_size(block_size: object, *, name: str = "block_size") -> None:
    """Raise unless ``block_size`` is None (automatic) or a positive int; ``name`` names the argument."""
    if block_size is None:
        return
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"{name} must be a positive int or None (automatic), got {block_size!r}")


def score_block_size(n_queries: int, n_documents: int, block_size: int | None) -> int | None:
    """The block edge to compute the [n_queries, n_documents] scores with, or None for the dense path.

    An explicit ``block_size`` always blocks; None blocks (with :data:`AUTO_BLOCK_SIZE`) only when the
    fp32 score matrix would exceed :data:`DENSE_SCORES_MAX_BYTES`.
    """
    if block_size is not None:
        return block_size
    return AUTO_BLOCK_SIZE if 4 * n_queries * n_documents > DENSE_SCORES_MAX_BYTES else None


def blocked_logsumexp(
    q_reps: Tensor,
    d_reps: Sequence[Tensor],
    *,
    temperature: float,
    block_size: int,
    shard_across_ranks: bool = False,
) -> Tensor:
    """``logsumexp(cat([q @ d.T for d in d_reps], 1) / temperature, dim=1)`` -> [B], in blocks (module doc).

    Unchecked: ``q_reps`` [B, V] and every ``d_reps`` column [B_c, V] must be validated 2-D floating
    tensors on one device with one V, ``temperature > 0``, ``block_size >= 1``. Computed in fp32 (fp64
    for fp64 reps); differentiable in ``q_reps`` and every column of ``d_reps``. ``shard_across_ranks``:
    each rank computes 1/W of the query blocks (module doc; a no-op without an initialized process group
    of W > 1 ranks).
    """
    return rows_logsumexp(
        _dense_rows,
        q_reps,
        d_reps,
        temperature=temperature,
        block_size=block_size,
        shard_across_ranks=shard_across_ranks,
    )


def rows_logsumexp(
    rows_of: RowsOf,
    q: Tensor,
    d: Sequence[Tensor],
    *,
    temperature: float,
    block_size: int,
    shard_across_ranks: bool = False,
) -> Tensor:
    """:func:`blocked_logsumexp` of any layout: ``q`` and each of ``d`` are the differentiable tensors of the
    columns (dense reps, or sparse reps' weights), ``rows_of(position, tensor)`` their :class:`RowBlocks`
    (position 0: the queries). Unchecked, as :func:`blocked_logsumexp`."""
    return _BlockedLogSumExp.apply(rows_of, temperature, block_size, shard_across_ranks, q, *d)


class QueryBlock(NamedTuple):
    """One query block of the plan: rows ``start:stop``, scored over ``columns`` or over all V."""

    start: int
    stop: int
    columns: Tensor | None
    """[|U|] int64 ascending vocabulary ids of the block's non-zeros (U); None: the block runs over all V."""
    width: int
    """Columns of the block's products: |U| + 1 padded up to :data:`COMPACT_COLUMN_MULTIPLE`, or V."""
    document_rows: int
    """Rows of each document block scored against it (:func:`compact_document_rows`; ``block_size`` over V)."""


class BlockColumns(NamedTuple):
    """A compacted query block's columns, as the layouts read them: vocabulary id -> product column."""

    index: Tensor
    """[V] int64: the column of each vocabulary id of U; ``outside`` for every other id."""
    width: int
    """Columns of the densified blocks ([b, width])."""
    outside: int
    """Column |U| (a padding column): a document's entries outside U land here and are zeroed."""


def plan_query_blocks(q_rows: RowBlocks, block_size: int) -> list[QueryBlock]:
    """The query blocks of a blocked log-sum-exp, in order: compacted ones where it pays (module doc).

    Blocks of ``min(block_size, COMPACT_QUERY_ROWS)`` rows, each over its active columns when their padded
    width is at most :data:`COMPACT_MAX_FRACTION` of V (over V otherwise), if that plan's product work is
    at most that fraction of the whole-V plan's; else (and for layouts that do not compact: dense reps)
    the whole-V plan, blocks of ``block_size`` rows. Deterministic in the query reps: forward and
    backward use one plan (computed once per forward, kept for the backward).
    """
    num_rows, vocab = q_rows.num_rows, q_rows.vocab_size
    whole = [
        QueryBlock(i, min(i + block_size, num_rows), None, vocab, block_size)
        for i in range(0, num_rows, block_size)
    ]
    edge = min(block_size, COMPACT_QUERY_ROWS)
    active = q_rows.active_columns(edge)
    if active is None:
        return whole
    limit = COMPACT_MAX_FRACTION * vocab
    plan = []
    for i0, ids in zip(range(0, num_rows, edge), active, strict=True):
        width = -(-(ids.numel() + 1) // COMPACT_COLUMN_MULTIPLE) * COMPACT_COLUMN_MULTIPLE
        compact = width <= limit
        i1 = min(i0 + edge, num_rows)
        if compact:
            plan.append(QueryBlock(i0, i1, ids, width, compact_document_rows(block_size, edge, width, vocab)))
        else:
            plan.append(QueryBlock(i0, i1, None, vocab, block_size))
    work = sum((block.stop - block.start) * block.width for block in plan)
    return plan if work <= COMPACT_MAX_FRACTION * num_rows * vocab else whole


def compact_document_rows(block_size: int, query_rows: int, width: int, vocab: int) -> int:
    """Document rows a block of ``query_rows`` queries over ``width`` columns scores at a time: ``block_size``
    times ``min(vocab // width, block_size // query_rows)`` (at least 1), so that a document block
    ([rows, width]) and a score block ([query_rows, rows]) are never larger than the whole-V plan's
    ([block_size, V] and [block_size, block_size]). Larger document blocks mean fewer, larger products:
    a compacted block's products are small next to the per-block work around them (densifying the
    document block, the log-sum-exp's element-wise passes, the launches), which then runs fewer times."""
    return block_size * max(1, min(vocab // width, block_size // query_rows))


def _block_columns(block: QueryBlock, vocab: int) -> BlockColumns | None:
    """The vocabulary -> column map of a compacted block (None for a whole-V one), built anew each pass."""
    if block.columns is None:
        return None
    outside = block.columns.numel()
    index = torch.full((vocab,), outside, dtype=torch.int64, device=block.columns.device)  # [V]
    index[block.columns] = torch.arange(outside, device=index.device)
    return BlockColumns(index, block.width, outside)


def _rank_blocks(plan: list[QueryBlock], shard: bool) -> tuple[list[QueryBlock], bool]:
    """This rank's query blocks (contiguous, 1/W of them; all of them unsharded), and whether the ranks'
    results must be summed (sharded over an initialized group of W > 1 ranks)."""
    if not (shard and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return plan, False
    rank, world = dist.get_rank(), dist.get_world_size()
    return plan[len(plan) * rank // world : len(plan) * (rank + 1) // world], True


class RowBlocks(Protocol):
    """A column of reps read, and differentiated, one block of rows at a time.

    The blocked loops below run on any layout: dense [B, V] reps (:class:`_DenseRows`, slices) or
    sparse ones (:mod:`.sparse`, a block densified at a time). ``tensor`` is the differentiable
    input the layout is built on; its gradient has ``tensor``'s shape. ``num_rows`` (B) and ``vocab_size``
    (V), the reps' shape, are set when the layout is made.
    """

    tensor: Tensor
    num_rows: int
    vocab_size: int

    def active_columns(self, edge: int) -> list[Tensor] | None:
        """Each block of ``edge`` rows' sorted unique vocabulary ids of its non-zeros ([|U|] int64 each), or
        None for a layout that does not compact (every block then runs over all V)."""
        ...

    def block(self, start: int, stop: int, dtype: torch.dtype, columns: BlockColumns | None = None) -> Tensor:
        """Rows ``start:stop`` as a dense [b, V] tensor of ``dtype``; with ``columns``, [b, columns.width]:
        the entries whose id is in U at their column, every other column zero."""
        ...

    def add_to_grad(
        self, grad: Tensor, start: int, stop: int, block_grad: Tensor, columns: BlockColumns | None = None
    ) -> None:
        """Add ``block_grad`` [b, V] ([b, columns.width] with ``columns``), the gradient of rows ``start:stop``,
        into ``grad`` (``tensor``'s shape)."""
        ...


RowsOf = Callable[[int, Tensor], RowBlocks]
"""``rows_of(position, tensor)``: the layout of the differentiable input at ``position`` (0: the queries)."""


class _DenseRows:
    """Dense [B, V] reps: blocks are slices, gradients add into a [B, V] buffer."""

    def __init__(self, tensor: Tensor) -> None:
        self.tensor = tensor  # [B, V]
        self.num_rows, self.vocab_size = tensor.shape

    def active_columns(self, edge: int) -> None:
        return None  # dense reps run over all V (module doc)

    def block(self, start: int, stop: int, dtype: torch.dtype, columns: BlockColumns | None = None) -> Tensor:
        return self.tensor[start:stop].to(dtype)  # [b, V]

    def add_to_grad(
        self, grad: Tensor, start: int, stop: int, block_grad: Tensor, columns: BlockColumns | None = None
    ) -> None:
        grad[start:stop] += block_grad  # [b, V]


def _dense_rows(position: int, tensor: Tensor) -> RowBlocks:
    return _DenseRows(tensor)


# Device types whose block products run in bf16 with fp32 output when the values allow it (module doc).
_BF16_PRODUCT_DEVICES = frozenset({"cuda"})
# Elements checked at a time by products_in_bf16: its temporaries stay ~112 MiB whatever the [B, V].
_CHECK_CHUNK = 1 << 24


def products_in_bf16(tensors: Sequence[Tensor]) -> bool:
    """True when the blocks can be multiplied as bf16 with exact products: fp32 inputs on a GPU whose
    values are all bf16 values (one pass over them in chunks, one device sync). NaN compares unequal."""
    if not all(t.dtype == torch.float32 and t.device.type in _BF16_PRODUCT_DEVICES for t in tensors):
        return False
    exact = torch.ones((), dtype=torch.bool, device=tensors[0].device)
    for t in tensors:
        for chunk in t.detach().reshape(-1).split(_CHECK_CHUNK):
            exact &= (chunk == chunk.to(torch.bfloat16).to(torch.float32)).all()
    return bool(exact)


def _bf16_parts(x: Tensor) -> Tensor:
    """fp32 ``x`` as three bf16 tensors, stacked [3, *x.shape], whose fp32 sum is ``x`` exactly (8 + 8 + 8
    significant bits)."""
    parts = x.new_empty((3, *x.shape), dtype=torch.bfloat16)
    parts[0] = x
    rest = x - parts[0]  # exact: x and its bf16 rounding agree in their leading bits (fp32 arithmetic)
    parts[1] = rest
    rest -= parts[1]  # exact, as above
    parts[2] = rest
    return parts


def _mm(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b``; for bf16 operands with exact products and fp32 sums and output."""
    if a.dtype != torch.bfloat16:
        return a @ b
    if a.device.type == "cuda":
        return torch.mm(a, b, out_dtype=torch.float32)  # tensor cores, fp32 accumulation
    return a.to(torch.float32) @ b.to(torch.float32)  # the same exact products, summed in fp32


def _mm_fp32_left(weights: Tensor, block: Tensor) -> Tensor:
    """``weights @ block`` -> [m, n] for fp32 (fp64) ``weights`` [m, k], or for their bf16 parts [3, m, k]
    (:func:`_bf16_parts`) against a bf16 ``block`` [k, n]: the parts' exact products summed in fp32 by one
    GEMM (module doc), over K = 3k against the block repeated three times, or over 3m rows whose three
    [m, n] results are then summed, whichever temporary is smaller (bf16 [3k, n] or fp32 [3m, n])."""
    if weights.dim() == 2:
        return weights @ block
    _, m, k = weights.shape
    if 2 * m < k:  # 12·m·n bytes < 6·k·n bytes: a few query rows against a large document block
        return _mm(weights.reshape(3 * m, k), block).view(3, m, -1).sum(dim=0)  # [3m, k] @ [k, n] -> [m, n]
    # [m, 3k] @ [3k, n] -> [m, n]; a view when the parts are the transpose of [3, k, m] ones (grad_d's)
    return _mm(weights.transpose(0, 1).reshape(m, 3 * k), block.repeat(3, 1))


def check_same_on_every_rank(tensors: Sequence[Tensor], *, num_rows: int) -> None:
    """Raise on every rank unless every rank passed ``num_rows`` queries and inputs of the same sizes and fp64 sums
    (one all-reduce). The row count too: sparse reps that differ by empty rows have the same weights, and the
    loss's path ('auto': :func:`~.fused_lse.use_fused_kernel`) follows the row count."""
    here = torch.stack([torch.stack([t.new_tensor(t.numel(), dtype=torch.float64), t.detach().sum(dtype=torch.float64)])
                        for t in tensors]).reshape(-1)  # fmt: skip
    here = torch.cat([here, here.new_tensor([num_rows])])
    extremes = torch.cat([here, -here])
    dist.all_reduce(extremes, op=dist.ReduceOp.MAX)  # [max over ranks, -min over ranks]
    if not torch.equal(extremes[: here.numel()], -extremes[here.numel() :]):
        raise ValueError(
            "shard_scores_across_ranks: the ranks called the loss with different reps (sizes or sums differ); "
            "sharded scores need the same gathered batch on every rank (the engine's gather_across_ranks)"
        )


def _blocked_lse_forward(
    q_rows: RowBlocks,
    d_rows: Sequence[RowBlocks],
    plan: list[QueryBlock],
    temperature: float,
    shard: bool,
    dtype: torch.dtype,
    block_dtype: torch.dtype,
) -> Tensor:
    """Forward: per query block of ``plan``, an online log-sum-exp over every document block -> lse [B]."""
    device = q_rows.tensor.device
    blocks, summed = _rank_blocks(plan, shard)
    if summed:
        check_same_on_every_rank([q_rows.tensor, *(d.tensor for d in d_rows)], num_rows=q_rows.num_rows)
    lse = torch.zeros(q_rows.num_rows, dtype=dtype, device=device)  # [B]
    for block in blocks:
        i0, i1, columns = block.start, block.stop, _block_columns(block, q_rows.vocab_size)
        q_block = q_rows.block(i0, i1, block_dtype, columns)  # [bq, V] or [bq, W]
        running_max = torch.full((q_block.shape[0],), -torch.inf, dtype=dtype, device=device)
        running_sum = torch.zeros_like(running_max)  # sum_j exp(s[:, j] - running_max), [bq]
        for scores, _, _, _ in _score_blocks(q_block, d_rows, temperature, block.document_rows, columns):
            new_max = torch.maximum(running_max, scores.amax(dim=1))  # [bq]
            rescale = torch.exp(running_max - new_max)  # [bq]: the old sum at the new max
            running_sum = running_sum * rescale + scores.sub_(new_max[:, None]).exp_().sum(dim=1)  # in place
            running_max = new_max
        lse[i0:i1] = running_max + torch.log(running_sum)
    if summed:  # every rank's rows (zero elsewhere) -> the full [B] on every rank
        dist.all_reduce(lse)
    return lse


def _blocked_lse_backward(
    grad_lse: Tensor,
    lse: Tensor,
    q_rows: RowBlocks,
    d_rows: Sequence[RowBlocks],
    plan: list[QueryBlock],
    temperature: float,
    block_dtype: torch.dtype,
    *,
    needs_q: bool,
    needs_d: Sequence[bool],
    shard: bool,
) -> tuple[Tensor | None, list[Tensor | None]]:
    """Backward: recompute each block, ``p = exp(s - lse)``; accumulate the q and d gradients (input dtypes)."""
    dtype = lse.dtype
    # Shaped as each input: [B, V] for dense reps, [nnz] for sparse ones.
    grad_q = q_rows.tensor.new_zeros(q_rows.tensor.shape, dtype=dtype) if needs_q else None
    grad_d = [
        d.tensor.new_zeros(d.tensor.shape, dtype=dtype) if needs else None
        for d, needs in zip(d_rows, needs_d, strict=True)
    ]
    # d lse[i] / d s[i, j] = softmax_j(s[i]) = exp(s[i, j] - lse[i]), and d s / d q = d / temperature.
    row_scale = grad_lse.to(dtype) / temperature  # [B]
    blocks, summed = _rank_blocks(plan, shard)
    for block in blocks:
        i0, i1, columns = block.start, block.stop, _block_columns(block, q_rows.vocab_size)
        q_block = q_rows.block(i0, i1, block_dtype, columns)  # [bq, V] or [bq, W]
        for scores, c, j0, d_block in _score_blocks(
            q_block, d_rows, temperature, block.document_rows, columns
        ):
            weights = scores.sub_(lse[i0:i1, None]).exp_().mul_(row_scale[i0:i1, None])  # [bq, bd], in place
            # Split once for both products: [3, bq, bd] bf16 parts when the blocks are bf16 (module doc).
            left = _bf16_parts(weights) if block_dtype == torch.bfloat16 else weights
            if grad_q is not None:
                # [bq, bd] @ [bd, V] -> [bq, V] (W for V when compacted)
                q_rows.add_to_grad(grad_q, i0, i1, _mm_fp32_left(left, d_block), columns)
            if grad_d[c] is not None:
                j1 = j0 + d_block.shape[0]
                # [bd, bq] @ [bq, V] -> [bd, V]: zero at the columns outside U (the queries' zeros)
                d_rows[c].add_to_grad(grad_d[c], j0, j1, _mm_fp32_left(left.mT, q_block), columns)
    if summed:  # each query row from one rank, each document from every rank's query rows
        for grad in (grad_q, *grad_d):
            if grad is not None:
                dist.all_reduce(grad)
    return (
        None if grad_q is None else grad_q.to(q_rows.tensor.dtype),
        [None if g is None else g.to(d.tensor.dtype) for g, d in zip(grad_d, d_rows, strict=True)],
    )


class _BlockedLogSumExp(torch.autograd.Function):
    """Row log-sum-exp of the scaled scores of ``q`` against every document, one [bq, bd] block at a time.

    The inputs are the differentiable tensors of each column (dense reps, or sparse reps' weights);
    ``rows_of`` gives their layout. Both passes run with autocast disabled: a caller's
    ``torch.autocast`` region would otherwise turn the fp32 block products into bf16/fp16 ones.
    """

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        rows_of: RowsOf,
        temperature: float,
        block_size: int,
        shard: bool,
        q: Tensor,
        *d: Tensor,
    ) -> Tensor:
        q_rows = rows_of(0, q)
        d_rows = [rows_of(1 + c, tensor) for c, tensor in enumerate(d)]
        with torch.autocast(q.device.type, enabled=False):
            dtype = accumulation_dtype(q, *d)
            block_dtype = torch.bfloat16 if products_in_bf16([q, *d]) else dtype
            plan = plan_query_blocks(q_rows, block_size)
            lse = _blocked_lse_forward(q_rows, d_rows, plan, temperature, shard, dtype, block_dtype)
        ctx.save_for_backward(q, lse, *d)
        ctx.plan = plan  # the backward's blocks are the forward's (same U, same order): bitwise equal scores
        ctx.rows_of = rows_of
        ctx.temperature = temperature
        ctx.block_dtype = block_dtype
        ctx.shard = shard
        return lse

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad_lse: Tensor) -> tuple[Tensor | None, ...]:
        q, lse, *d = ctx.saved_tensors
        with torch.autocast(q.device.type, enabled=False):
            grad_q, grad_d = _blocked_lse_backward(
                grad_lse,
                lse,
                ctx.rows_of(0, q),
                [ctx.rows_of(1 + c, tensor) for c, tensor in enumerate(d)],
                ctx.plan,
                ctx.temperature,
                ctx.block_dtype,
                needs_q=ctx.needs_input_grad[4],
                needs_d=ctx.needs_input_grad[5:],
                shard=ctx.shard,
            )
        return None, None, None, None, grad_q, *grad_d  # rows_of, temperature, block_size, shard, q, *d


def _score_blocks(
    q_block: Tensor,
    d_rows: Sequence[RowBlocks],
    temperature: float,
    document_rows: int,
    columns: BlockColumns | None,
) -> Iterator[tuple[Tensor, int, int, Tensor]]:
    """Yield (scores [bq, bd], column index, first row in that column, document block [bd, V] or [bd, W])
    for every document block, in one fixed order: forward and backward compute their blocks identically.
    """
    for c, d in enumerate(d_rows):
        for j0 in range(0, d.num_rows, document_rows):
            d_block = d.block(j0, min(j0 + document_rows, d.num_rows), q_block.dtype, columns)  # [bd, V or W]
            scores = _mm(q_block, d_block.T).div_(temperature)  # [bq, V] @ [V, bd] -> [bq, bd], fp32 (fp64)
            yield scores, c, j0, d_block
