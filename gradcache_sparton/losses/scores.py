"""Relevance scores of sparse reps: the dot products the losses rank by, computed in fp32.

Legend: B batch (queries), N documents, V vocabulary.

SPLADE scores a (query, document) pair by the plain dot product of their vocabulary-weight vectors,
the quantity an inverted index computes. Scores are accumulated and returned in fp32 even for bf16/fp16
reps: SPLADE scores are unnormalised sums of tens of terms (typically 10–40), where a bf16 result
(8 bits of mantissa) would be off by up to ~0.1, enough to reorder close candidates and to bias a
softmax over them. fp64 reps stay fp64. The matmul runs with autocast disabled, so a caller's
``torch.autocast`` region does not turn it into a bf16 product.
"""

from __future__ import annotations

import torch
from torch import Tensor

from gradcache_sparton.losses.columns import accumulation_dtype, check_reps

__all__ = ["dot_scores", "paired_scores", "unchecked_dot_scores", "unchecked_paired_scores"]


def _check_pair(q_reps: Tensor, d_reps: Tensor) -> None:
    check_reps(q_reps, name="q_reps")
    check_reps(d_reps, name="d_reps")
    if q_reps.shape[1] != d_reps.shape[1]:
        raise ValueError(
            f"q_reps and d_reps must have the same vocabulary size V, got {q_reps.shape[1]} and "
            f"{d_reps.shape[1]}"
        )
    if q_reps.device != d_reps.device:
        raise ValueError(f"q_reps and d_reps must be on one device, got {q_reps.device} and {d_reps.device}")


def dot_scores(q_reps: Tensor, d_reps: Tensor) -> Tensor:
    """All-pairs dot-product scores: [B, V] x [N, V] -> [B, N] in fp32 (fp64 for fp64 inputs).

    Memory: the [B, N] output, plus fp32 copies of the inputs when they are bf16/fp16 (none for
    fp32 inputs). Nothing of size B·N·V is formed. Differentiable in both arguments.
    """
    _check_pair(q_reps, d_reps)
    return unchecked_dot_scores(q_reps, d_reps)


def paired_scores(q_reps: Tensor, d_reps: Tensor) -> Tensor:
    """Row-wise dot-product scores of aligned pairs: [B, V] x [B, V] -> [B] (fp32, fp64 for fp64).

    Memory: one [B, V] product in the score dtype. Differentiable in both arguments.
    """
    _check_pair(q_reps, d_reps)
    if q_reps.shape[0] != d_reps.shape[0]:
        raise ValueError(
            f"paired_scores needs as many documents as queries, got q_reps with {q_reps.shape[0]} rows and "
            f"d_reps with {d_reps.shape[0]}"
        )
    return unchecked_paired_scores(q_reps, d_reps)


def unchecked_dot_scores(q_reps: Tensor, d_reps: Tensor) -> Tensor:
    """:func:`dot_scores` on checked inputs (the losses check their columns once, then score them)."""
    dtype = accumulation_dtype(q_reps, d_reps)
    # An ambient autocast (a caller's own loop) would run this matmul in bf16/fp16: keep it in fp32.
    with torch.autocast(q_reps.device.type, enabled=False):
        return q_reps.to(dtype) @ d_reps.to(dtype).T  # [B, V] @ [V, N] -> [B, N]


def unchecked_paired_scores(q_reps: Tensor, d_reps: Tensor) -> Tensor:
    """:func:`paired_scores` on checked inputs."""
    dtype = accumulation_dtype(q_reps, d_reps)
    return (q_reps.to(dtype) * d_reps.to(dtype)).sum(dim=1)  # [B, V] -> [B]
