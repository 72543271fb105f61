"""Read the reps a loss receives: the one validator of rep matrices and the column helpers of ``losses``.

Legend: B batch, V vocabulary, k hard negatives per query.

The loss contract: ``reps`` is a ``Mapping[str, Tensor]`` in column order; the first column holds the
queries [B, V], the second their positives [B, V], and each further column one hard negative per query
[B, V], so k negative columns give every query k hard negatives. Row i of every column belongs to
query i: a column whose row count differs from the queries' is a batch in which some query has a
different number of hard negatives, which a dense [B, ...] loss cannot express, and is rejected.

Validation happens once, at a public entry (:func:`split_columns`, :func:`column_list`); the unchecked
cores the public losses share (:func:`~.contrastive.info_nce` and its siblings) take the validated
columns and trust them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

import torch
from torch import Tensor

__all__ = ["ContrastiveColumns", "accumulation_dtype", "check_reps", "column_list", "split_columns"]


class ContrastiveColumns(NamedTuple):
    """The columns of a contrastive batch: queries [B, V], positives [B, V], k hard negatives [B, V]."""

    q_reps: Tensor
    pos_reps: Tensor
    neg_reps: list[Tensor]


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


def column_list(reps: Tensor | Sequence[Tensor], *, name: str = "reps") -> list[Tensor]:
    """One [B, V] tensor or a non-empty sequence of [B_i, V] tensors with one V -> a checked list.

    The reduction helpers (regularizers, sparsity statistics) treat the list as the row-wise
    concatenation of its tensors without building it.
    """
    columns = [reps] if isinstance(reps, Tensor) else list(reps)
    if not columns:
        raise ValueError(f"{name} must be a [B, V] tensor or a non-empty sequence of them, got an empty one")
    for i, column in enumerate(columns):
        check_reps(column, name=name if isinstance(reps, Tensor) else f"{name}[{i}]")
    vocab = {column.shape[1] for column in columns}
    if len(vocab) > 1:
        raise ValueError(f"all tensors in {name} must have the same vocabulary size V, got {sorted(vocab)}")
    return columns


def accumulation_dtype(*tensors: Tensor) -> torch.dtype:
    """The dtype losses reduce in: fp32 for half-precision and fp32 inputs, fp64 if any input is fp64."""
    dtype = torch.float32
    for tensor in tensors:
        dtype = torch.promote_types(dtype, tensor.dtype)
    return dtype


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
