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
hard negatives), treated as their row-wise concatenation without building it. The public functions
check their input; :class:`~gradcache_sparton.losses.SpladeLoss` calls the private cores on the
columns it has already checked.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from gradcache_sparton.losses.columns import check_reps, column_list

__all__ = [
    "activation_rate",
    "expected_flops",
    "mean_nonzeros",
    "nonzeros_per_row",
    "unchecked_expected_flops",
    "unchecked_mean_nonzeros",
]


@torch.no_grad()
def nonzeros_per_row(reps: Tensor) -> Tensor:
    """Number of non-zero entries of each rep: [B, V] -> [B] int64."""
    check_reps(reps, name="reps")
    return torch.count_nonzero(reps, dim=1)


def mean_nonzeros(reps: Tensor | Sequence[Tensor]) -> Tensor:
    """Average number of non-zero entries per rep over all rows, as a 0-d fp32 tensor."""
    return unchecked_mean_nonzeros(column_list(reps))


def activation_rate(reps: Tensor | Sequence[Tensor]) -> Tensor:
    """Fraction of rows in which each vocabulary entry is non-zero: -> [V] fp32."""
    return _activation_rate(column_list(reps))


def expected_flops(q_reps: Tensor | Sequence[Tensor], d_reps: Tensor | Sequence[Tensor]) -> Tensor:
    """SPLADE's FLOPS measure ``sum_v p_q(v) · p_d(v)`` as a 0-d fp32 tensor (see the module docstring).

    Args:
        q_reps: query reps, [B_q, V] or a sequence of them.
        d_reps: document reps, [B_d, V] or a sequence of them (e.g. positives and hard negatives).
    """
    q_columns = column_list(q_reps, name="q_reps")
    d_columns = column_list(d_reps, name="d_reps")
    if q_columns[0].shape[1] != d_columns[0].shape[1]:
        raise ValueError(
            "q_reps and d_reps must have the same vocabulary size V, got "
            f"{q_columns[0].shape[1]} and {d_columns[0].shape[1]}"
        )
    return unchecked_expected_flops(q_columns, d_columns)


@torch.no_grad()
def unchecked_mean_nonzeros(columns: list[Tensor]) -> Tensor:
    """:func:`mean_nonzeros` of checked columns."""
    # Summed as tensors, not Python ints: no host synchronisation when called inside a training step.
    total = sum(torch.count_nonzero(column) for column in columns)  # 0-d int64
    rows = sum(column.shape[0] for column in columns)
    return total.to(torch.float32) / rows


@torch.no_grad()
def _activation_rate(columns: list[Tensor]) -> Tensor:
    """:func:`activation_rate` of checked columns."""
    counts = sum(torch.count_nonzero(column, dim=0) for column in columns)  # [V] int64
    rows = sum(column.shape[0] for column in columns)
    return counts.to(torch.float32) / rows


@torch.no_grad()
def unchecked_expected_flops(q_columns: list[Tensor], d_columns: list[Tensor]) -> Tensor:
    """:func:`expected_flops` of checked columns with one V."""
    return torch.dot(_activation_rate(q_columns), _activation_rate(d_columns))  # [V] . [V] -> []
