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

The result equals the dense computation up to fp32 summation order (the blocks add up the same terms
in another order). Memory: the [B, V] rep gradients the dense path also returns, plus a few [bq, bd]
blocks and, for half-precision reps, fp32 copies of one query block and one document block (callers
upcast once the columns they also use elsewhere, so their gradients are rounded once). Time: the forward
matmuls run twice (once more in the backward), so a blocked step costs one extra [B, V] x [V, N]
product over the dense one.

:func:`score_block_size` decides: dense while the fp32 score matrix fits :data:`DENSE_SCORES_MAX_BYTES`,
blocks of :data:`AUTO_BLOCK_SIZE` beyond; an explicit block size always blocks.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from torch import Tensor
from torch.autograd.function import FunctionCtx, once_differentiable

from gradcache_sparton.losses.columns import accumulation_dtype

__all__ = [
    "AUTO_BLOCK_SIZE",
    "DENSE_SCORES_MAX_BYTES",
    "blocked_logsumexp",
    "check_block_size",
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
    q_reps: Tensor, d_reps: Sequence[Tensor], *, temperature: float, block_size: int
) -> Tensor:
    """``logsumexp(cat([q @ d.T for d in d_reps], 1) / temperature, dim=1)`` -> [B], in blocks (module doc).

    Unchecked: ``q_reps`` [B, V] and every ``d_reps`` column [B_c, V] must be validated 2-D floating
    tensors on one device with one V, ``temperature > 0``, ``block_size >= 1``. Computed in fp32 (fp64
    for fp64 reps); differentiable in ``q_reps`` and every column of ``d_reps``.
    """
    return _BlockedLogSumExp.apply(q_reps, temperature, block_size, *d_reps)


def _blocked_lse_forward(
    q_reps: Tensor, d_reps: Sequence[Tensor], temperature: float, block_size: int
) -> Tensor:
    """Forward: per query block, an online log-sum-exp over every document block -> lse [B]."""
    dtype = accumulation_dtype(q_reps, *d_reps)
    lse = torch.empty(q_reps.shape[0], dtype=dtype, device=q_reps.device)  # [B]
    for i0 in range(0, q_reps.shape[0], block_size):
        q_block = q_reps[i0 : i0 + block_size].to(dtype)  # [bq, V]
        running_max = torch.full((q_block.shape[0],), -torch.inf, dtype=dtype, device=q_reps.device)
        running_sum = torch.zeros_like(running_max)  # sum_j exp(s[:, j] - running_max), [bq]
        for scores, _, _, _ in _score_blocks(q_block, d_reps, temperature, block_size):  # [bq, bd]
            new_max = torch.maximum(running_max, scores.amax(dim=1))  # [bq]
            rescale = torch.exp(running_max - new_max)  # [bq]: the old sum at the new max
            running_sum = running_sum * rescale + torch.exp(scores - new_max[:, None]).sum(dim=1)
            running_max = new_max
        lse[i0 : i0 + block_size] = running_max + torch.log(running_sum)
    return lse


def _blocked_lse_backward(
    grad_lse: Tensor,
    lse: Tensor,
    q_reps: Tensor,
    d_reps: Sequence[Tensor],
    temperature: float,
    block_size: int,
    *,
    needs_q: bool,
    needs_d: Sequence[bool],
) -> tuple[Tensor | None, list[Tensor | None]]:
    """Backward: recompute each block, ``p = exp(s - lse)``; accumulate the q and d gradients (input dtypes)."""
    dtype = lse.dtype
    grad_q = torch.zeros(q_reps.shape, dtype=dtype, device=q_reps.device) if needs_q else None  # [B, V]
    grad_d = [
        torch.zeros(d.shape, dtype=dtype, device=d.device) if needs else None
        for d, needs in zip(d_reps, needs_d, strict=True)
    ]
    # d lse[i] / d s[i, j] = softmax_j(s[i]) = exp(s[i, j] - lse[i]), and d s / d q = d / temperature.
    row_scale = grad_lse.to(dtype) / temperature  # [B]
    for i0 in range(0, q_reps.shape[0], block_size):
        rows = slice(i0, i0 + block_size)
        q_block = q_reps[rows].to(dtype)  # [bq, V]
        for scores, c, j0, d_block in _score_blocks(q_block, d_reps, temperature, block_size):
            weights = torch.exp(scores - lse[rows, None]) * row_scale[rows, None]  # [bq, bd]
            if grad_q is not None:
                grad_q[rows] += weights @ d_block  # [bq, bd] @ [bd, V] -> [bq, V]
            if grad_d[c] is not None:
                grad_d[c][j0 : j0 + block_size] += weights.T @ q_block  # [bd, bq] @ [bq, V] -> [bd, V]
    return (
        None if grad_q is None else grad_q.to(q_reps.dtype),
        [None if g is None else g.to(d.dtype) for g, d in zip(grad_d, d_reps, strict=True)],
    )


class _BlockedLogSumExp(torch.autograd.Function):
    """Row log-sum-exp of the scaled scores of ``q`` against every document, one [bq, bd] block at a time.

    Both passes run with autocast disabled: a caller's ``torch.autocast`` region would otherwise turn
    the fp32 block products into bf16/fp16 ones.
    """

    @staticmethod
    def forward(
        ctx: FunctionCtx, q_reps: Tensor, temperature: float, block_size: int, *d_reps: Tensor
    ) -> Tensor:
        with torch.autocast(q_reps.device.type, enabled=False):
            lse = _blocked_lse_forward(q_reps, d_reps, temperature, block_size)
        ctx.save_for_backward(q_reps, lse, *d_reps)
        ctx.temperature = temperature
        ctx.block_size = block_size
        return lse

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad_lse: Tensor) -> tuple[Tensor | None, ...]:
        q_reps, lse, *d_reps = ctx.saved_tensors
        with torch.autocast(q_reps.device.type, enabled=False):
            grad_q, grad_d = _blocked_lse_backward(
                grad_lse,
                lse,
                q_reps,
                d_reps,
                ctx.temperature,
                ctx.block_size,
                needs_q=ctx.needs_input_grad[0],
                needs_d=ctx.needs_input_grad[3:],
            )
        return grad_q, None, None, *grad_d  # q_reps, temperature, block_size, *d_reps


def _score_blocks(
    q_block: Tensor, d_reps: Sequence[Tensor], temperature: float, block_size: int
) -> Iterator[tuple[Tensor, int, int, Tensor]]:
    """Yield (scores [bq, bd], column index, first row in that column, document block [bd, V]) for every
    document block, in one fixed order: forward and backward compute their blocks identically.
    """
    for c, d in enumerate(d_reps):
        for j0 in range(0, d.shape[0], block_size):
            d_block = d[j0 : j0 + block_size].to(q_block.dtype)  # [bd, V]
            scores = q_block @ d_block.T / temperature  # [bq, V] @ [V, bd] -> [bq, bd]
            yield scores, c, j0, d_block
