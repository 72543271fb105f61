"""Read the reps mapping a loss receives: queries, positives and hard-negative columns, validated.

Legend: B batch, V vocabulary, k hard negatives per query.

The loss contract: ``reps`` is a ``Mapping[str, Tensor]`` in column order; the first column holds the
queries [B, V], the second their positives [B, V], and each further column one hard negative per query
[B, V], so k negative columns give every query k hard negatives. Row i of every column belongs to
query i: a column whose row count differs from the queries' is a batch in which some query has a
different number of hard negatives, which a dense [B, ...] loss cannot express, and is rejected.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

from torch import Tensor

from gradcache_sparton.sparsity import check_reps

__all__ = ["ContrastiveColumns", "split_columns"]


class ContrastiveColumns(NamedTuple):
    """The columns of a contrastive batch: queries [B, V], positives [B, V], k hard negatives [B, V]."""

    q_reps: Tensor
    pos_reps: Tensor
    neg_reps: list[Tensor]


def split_columns(reps: Mapping[str, Tensor]) -> ContrastiveColumns:
    """Split ``reps`` into (queries, positives, hard negatives), checking every column.

    Raises:
        TypeError: ``reps`` is not a mapping, a column is not a floating tensor (a list or tuple of
            tensors, e.g. a ragged set of negatives, is named as such).
        ValueError: fewer than two columns, a column that is not 2-D [B, V], columns with different V,
            devices or row counts.
    """
    if not isinstance(reps, Mapping):
        raise TypeError(f"reps must be a mapping of column name -> [B, V] tensor, got {type(reps).__name__}")
    if len(reps) < 2:
        raise ValueError(
            f"reps must have at least two columns (queries, then positives), got {list(reps)}; "
            "further columns are hard negatives"
        )
    names = list(reps)
    for name, column in reps.items():
        if isinstance(column, (list, tuple)):
            raise TypeError(
                f"reps[{name!r}] is a {type(column).__name__}; each column must be one [B, V] tensor. "
                "Give every query the same number k of hard negatives and pass them as k columns "
                "(e.g. 'negative_1', ..., 'negative_k'), one negative per query in each"
            )
        if isinstance(column, Tensor) and column.dim() == 3:
            raise ValueError(
                f"reps[{name!r}] has shape {tuple(column.shape)}; each column must be [B, V]. Pass "
                "stacked hard negatives [B, k, V] as k columns, e.g. "
                "{f'negative_{j + 1}': negs[:, j] for j in range(k)}"
            )
        check_reps(column, name=f"reps[{name!r}]")
    q_name = names[0]
    q_reps = reps[q_name]
    B, V = q_reps.shape
    for name in names[1:]:
        column = reps[name]
        if column.shape[1] != V:
            raise ValueError(
                f"reps[{name!r}] has vocabulary size {column.shape[1]} but reps[{q_name!r}] has {V}: "
                "all columns must share V"
            )
        if column.device != q_reps.device:
            raise ValueError(
                f"reps[{name!r}] is on {column.device} but reps[{q_name!r}] is on {q_reps.device}: "
                "all columns must be on one device"
            )
        if column.shape[0] != B:
            kind = "positives" if name == names[1] else "hard negatives"
            raise ValueError(
                f"reps[{name!r}] ({kind}) has {column.shape[0]} rows but the queries reps[{q_name!r}] "
                f"have {B}: every column needs one row per query, i.e. one positive and the same "
                "number of hard negatives for every query in the batch"
            )
    return ContrastiveColumns(q_reps, reps[names[1]], [reps[name] for name in names[2:]])
