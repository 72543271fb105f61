"""Sparsity statistics of SPLADE reps, for logging and evaluation (never differentiated).

Legend: B batch, V vocabulary.

- :func:`mean_nonzeros`: average number of non-zero vocabulary entries per rep, i.e. the posting-list
  entries a document adds to an inverted index, or the terms a query looks up.
- :func:`expected_flops`: the FLOPS measure of the SPLADE papers (after Paria et al. 2020),
  ``sum_v p_q(v) · p_d(v)`` where ``p(v)`` is the fraction of reps that activate term ``v``: the
  expected number of multiply-adds an inverted index spends on one (query, document) score. The
  FLOPS *regularizer* (:func:`gradcache_sparton.losses.flops_regularizer`) is its smooth relaxation,
  with mean activations in place of activation rates.

Every function accepts one [B, V] tensor or a sequence of them (several columns, e.g. positives and
hard negatives), treated as their row-wise concatenation without building it.

This module also holds :func:`check_reps`, the one validator of rep matrices shared by the losses.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["activation_rate", "check_reps", "expected_flops", "mean_nonzeros", "nonzeros_per_row"]


def check_reps(reps: object, *, name: str) -> Tensor:
    """Return ``reps`` if it is a non-empty 2-D floating tensor [B, V]; raise a clear error otherwise.

    ``name`` is how the error refers to the argument (e.g. ``"reps['negative_1']"``).
    """
    if not isinstance(reps, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape [B, V], got {type(reps).__name__}")
    if reps.dim() != 2:
        raise ValueError(f"{name} must be 2-D [B, V] (batch, vocabulary), got shape {tuple(reps.shape)}")
    if not reps.is_floating_point():
        raise TypeError(f"{name} must be a floating tensor, got dtype {reps.dtype}")
    if reps.shape[0] == 0 or reps.shape[1] == 0:
        raise ValueError(f"{name} must have at least one row and one column, got shape {tuple(reps.shape)}")
    return reps


def _as_columns(reps: Tensor | Sequence[Tensor], *, name: str) -> list[Tensor]:
    """One [B, V] tensor or a non-empty sequence of [B_i, V] tensors with one V -> list of tensors."""
    columns = [reps] if isinstance(reps, Tensor) else list(reps)
    if not columns:
        raise ValueError(f"{name} must be a [B, V] tensor or a non-empty sequence of them, got an empty one")
    for i, column in enumerate(columns):
        check_reps(column, name=name if isinstance(reps, Tensor) else f"{name}[{i}]")
    vocab = {column.shape[1] for column in columns}
    if len(vocab) > 1:
        raise ValueError(f"all tensors in {name} must have the same vocabulary size V, got {sorted(vocab)}")
    return columns


@torch.no_grad()
def nonzeros_per_row(reps: Tensor) -> Tensor:
    """Number of non-zero entries of each rep: [B, V] -> [B] int64."""
    check_reps(reps, name="reps")
    return torch.count_nonzero(reps, dim=1)


@torch.no_grad()
def mean_nonzeros(reps: Tensor | Sequence[Tensor]) -> Tensor:
    """Average number of non-zero entries per rep over all rows, as a 0-d fp32 tensor."""
    columns = _as_columns(reps, name="reps")
    # Summed as tensors, not Python ints: no host synchronisation when called inside a training step.
    total = sum(torch.count_nonzero(column) for column in columns)  # 0-d int64
    rows = sum(column.shape[0] for column in columns)
    return total.to(torch.float32) / rows


@torch.no_grad()
def activation_rate(reps: Tensor | Sequence[Tensor]) -> Tensor:
    """Fraction of rows in which each vocabulary entry is non-zero: -> [V] fp32."""
    columns = _as_columns(reps, name="reps")
    counts = sum(torch.count_nonzero(column, dim=0) for column in columns)  # [V] int64
    rows = sum(column.shape[0] for column in columns)
    return counts.to(torch.float32) / rows


@torch.no_grad()
def expected_flops(q_reps: Tensor | Sequence[Tensor], d_reps: Tensor | Sequence[Tensor]) -> Tensor:
    """SPLADE's FLOPS measure ``sum_v p_q(v) · p_d(v)`` as a 0-d fp32 tensor (see the module docstring).

    Args:
        q_reps: query reps, [B_q, V] or a sequence of them.
        d_reps: document reps, [B_d, V] or a sequence of them (e.g. positives and hard negatives).
    """
    p_q = activation_rate(_as_columns(q_reps, name="q_reps"))  # [V]
    p_d = activation_rate(_as_columns(d_reps, name="d_reps"))  # [V]
    if p_q.shape != p_d.shape:
        raise ValueError(
            f"q_reps and d_reps must have the same vocabulary size V, got {p_q.shape[0]} and {p_d.shape[0]}"
        )
    return torch.dot(p_q, p_d)
