"""Validation of a ``datasets.Dataset`` of training rows (columns, types, nulls, list lengths)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import numpy as np

from gradcache_sparton.data.columns import (
    NEGATIVE_PREFIX,
    NEGATIVES_COLUMN,
    POSITIVE_COLUMN,
    QUERY_COLUMN,
    text_columns_of,
)

if TYPE_CHECKING:
    import datasets
    import pyarrow as pa

__all__ = ["RowError", "check_dataset_type", "validate_training_dataset"]

logger = logging.getLogger(__name__)

# Rows per Arrow batch when validating a dataset: bounds memory on large datasets.
_VALIDATION_BATCH_ROWS = 10_000


def _is_numeric(arrow_type: pa.DataType) -> bool:
    import pyarrow as pa

    return (
        pa.types.is_integer(arrow_type) or pa.types.is_floating(arrow_type) or pa.types.is_boolean(arrow_type)
    )


def _is_list(arrow_type: pa.DataType) -> bool:
    import pyarrow as pa

    return (
        pa.types.is_list(arrow_type)
        or pa.types.is_large_list(arrow_type)
        or pa.types.is_fixed_size_list(arrow_type)
    )


def _is_string(arrow_type: pa.DataType) -> bool:
    import pyarrow as pa

    return pa.types.is_string(arrow_type) or pa.types.is_large_string(arrow_type)


def check_dataset_type(value: object, *, name: str) -> None:
    """Raise ``TypeError`` naming ``name`` unless ``value`` is a map-style ``datasets.Dataset``.

    A ``DatasetDict`` is told to pick a split, a streaming ``IterableDataset`` to load map-style.
    """
    import datasets

    if isinstance(value, datasets.Dataset):
        return
    if isinstance(value, (datasets.DatasetDict, datasets.IterableDatasetDict)):
        splits = list(value)
        raise TypeError(
            f"{name} is a {type(value).__name__} with splits {splits}: pass one split, "
            f"e.g. {name}[{(splits or ['train'])[0]!r}]"
        )
    if isinstance(value, datasets.IterableDataset):
        raise TypeError(
            f"{name} is a streaming datasets.IterableDataset: training validates, counts and shuffles "
            "its rows, so it needs a map-style datasets.Dataset (load_dataset(..., streaming=False))"
        )
    raise TypeError(f"{name} must be a datasets.Dataset, got {type(value).__name__}")


def validate_training_dataset(dataset: datasets.Dataset, *, warn_repeats: bool = True) -> list[str]:
    """Check a training dataset and return its text columns in collator order.

    Checks, each raising ``ValueError`` that names the column (and row, where one is at fault):
    the dataset is non-empty; ``query`` and ``positive`` exist; negatives are ``negative_1..k``
    without gaps or one ``negatives`` list column, not both; text columns are strings with no null
    cell (a null ``negative_i`` cell is a row with fewer negatives); every ``negatives`` list has the
    same length; no text is empty or whitespace only; every other column is numeric with finite values
    (no NaN or infinity), and a list-valued one has the same length in every row. A row-level fault is a :class:`RowError` (with ``.row``). Rows that
    repeat an earlier row's (query, positive) pair are counted and logged as a warning (``warn_repeats``).

    Returns e.g. ``["query", "positive", "negative_1", "negative_2"]`` or
    ``["query", "positive", "negatives"]``.
    """
    import pyarrow.compute as pc

    check_dataset_type(dataset, name="dataset")
    if len(dataset) == 0:
        raise ValueError("dataset is empty: training needs at least one (query, positive) row")
    columns = text_columns_of(dataset.column_names)
    schema = dataset.features.arrow_schema
    extras = [name for name in dataset.column_names if name not in columns]
    for name in columns:
        arrow_type = schema.field(name).type
        ok = (
            _is_list(arrow_type) and _is_string(arrow_type.value_type)
            if name == NEGATIVES_COLUMN
            else _is_string(arrow_type)
        )
        if not ok:
            expected = "a list of strings" if name == NEGATIVES_COLUMN else "strings"
            raise ValueError(f"column {name!r} must hold {expected}, got Arrow type {arrow_type}")
    for name in extras:
        arrow_type = schema.field(name).type
        if not (_is_numeric(arrow_type) or (_is_list(arrow_type) and _is_numeric(arrow_type.value_type))):
            raise ValueError(
                f"column {name!r} (Arrow type {arrow_type}) is neither a text column "
                f"({QUERY_COLUMN}, {POSITIVE_COLUMN}, {NEGATIVE_PREFIX}<i>, {NEGATIVES_COLUMN}) nor numeric "
                f"(passed to the loss as loss_kwargs); remove it with dataset.remove_columns([{name!r}])"
            )
    list_columns = [name for name in [*columns, *extras] if _is_list(schema.field(name).type)]
    first_lengths: dict[str, int] = {}
    pair_hashes: list[np.ndarray] = []  # 8 bytes a row: memory stays small on large datasets
    offset = 0
    # Arrow batches honour any indices mapping (select/shuffle) and bound memory on large datasets.
    for table in dataset.with_format("arrow").iter(batch_size=_VALIDATION_BATCH_ROWS):
        for name in [*columns, *extras]:
            nulls = pc.is_null(table.column(name))
            if pc.any(nulls).as_py():
                row = offset + pc.index(nulls, True).as_py()
                raise RowError(
                    f"column {name!r} is empty (null) in row {row}: every row needs a value in every "
                    "column (rows must all have the same number of negatives)",
                    row=row,
                )
        for name in columns:
            _check_no_blank_text(table.column(name), name, offset)
        for name in extras:
            _check_finite(table.column(name), name, offset)
        if warn_repeats:
            pair_hashes.append(_pair_hashes(table))
        for name in list_columns:
            lengths = pc.list_value_length(table.column(name))
            expected = first_lengths.setdefault(name, lengths[0].as_py())
            wrong = pc.not_equal(lengths, expected)
            if pc.any(wrong).as_py():
                row = offset + pc.index(wrong, True).as_py()
                raise RowError(
                    f"column {name!r}: row {row} has {lengths[row - offset].as_py()} entries but row 0 has "
                    f"{expected}; every row needs the same number",
                    row=row,
                )
        offset += table.num_rows
    if first_lengths.get(NEGATIVES_COLUMN) == 0:
        raise ValueError(f"column {NEGATIVES_COLUMN!r} holds empty lists: drop the column instead")
    if not warn_repeats:
        return columns
    repeated, row, first = _repeated_pairs(np.concatenate(pair_hashes))
    if repeated:
        logger.warning(
            "%d row(s) repeat an earlier row's (query, positive) pair (e.g. row %d repeats row %d): when two "
            "copies land in one batch, each copy's positive is an in-batch negative of the other (a false "
            "negative). Deduplicate the data unless the repetition is meant as oversampling.",
            repeated,
            row,
            first,
        )
    return columns


class RowError(ValueError):
    """A training row at fault; ``row`` is its index in the dataset (0-based), for callers that know the file."""

    def __init__(self, message: str, *, row: int) -> None:
        super().__init__(message)
        self.row = row


def _check_no_blank_text(column: pa.ChunkedArray, name: str, offset: int) -> None:
    """``RowError`` naming the column and row of the first empty or whitespace-only text (a list's entries too)."""
    import pyarrow.compute as pc

    array, rows = _flat_entries(column)
    if len(array) == 0:
        return
    found = _first_flagged(pc.equal(pc.utf8_length(pc.utf8_trim_whitespace(array)), 0), rows, offset)
    if found is not None:
        _, row = found
        raise RowError(
            f"column {name!r} is an empty text in row {row}: an empty query or document gives the loss nothing "
            "to score (its reps are only the special tokens'); fix or drop the row",
            row=row,
        )


def _check_finite(column: pa.ChunkedArray, name: str, offset: int) -> None:
    """``RowError`` naming the column and row of the first NaN or infinite number (a list's entries too):
    a teacher score of NaN would stop training at its first step, far from the row at fault."""
    import pyarrow as pa
    import pyarrow.compute as pc

    array, rows = _flat_entries(column)
    if len(array) == 0 or not pa.types.is_floating(array.type):
        return
    found = _first_flagged(pc.invert(pc.is_finite(array)), rows, offset)
    if found is not None:
        index, row = found
        raise RowError(
            f"column {name!r} holds {array[index].as_py()} in row {row}: the loss needs finite numbers; fix or "
            "drop the row",
            row=row,
        )


def _flat_entries(column: pa.ChunkedArray) -> tuple[pa.Array, pa.Array | None]:
    """The column's values, a list column's entries flattened, and for a list column each entry's row
    within the column (None for a column of scalars, whose entries are its rows)."""
    import pyarrow.compute as pc

    array = column.combine_chunks()
    if not _is_list(array.type):
        return array, None
    return pc.list_flatten(array), pc.list_parent_indices(array)


def _first_flagged(flags: pa.Array, rows: pa.Array | None, offset: int) -> tuple[int, int] | None:
    """(entry index, dataset row) of the first entry whose flag is true, or None where none is; ``rows``
    as :func:`_flat_entries` gives them, ``offset`` the dataset row of the column's first row."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if not pc.any(flags).as_py():
        return None
    index = pc.index(flags, True).as_py()
    return index, offset + (index if rows is None else pa.array(rows)[index].as_py())


def _pair_hashes(table: pa.Table) -> np.ndarray:
    """A 64-bit hash of each row's (query, positive) pair (pandas' vectorised string hashing)."""
    import pandas as pd

    query, positive = (
        pd.util.hash_array(table.column(name).to_numpy(zero_copy_only=False).astype(object))
        for name in (QUERY_COLUMN, POSITIVE_COLUMN)
    )
    return query * np.uint64(0x9E3779B97F4A7C15) ^ positive  # wraps modulo 2**64


def _repeated_pairs(hashes: np.ndarray) -> tuple[int, int, int]:
    """(rows repeating an earlier row's pair, the first such row, the row it repeats); (0, -1, -1) if none."""
    _, first_rows, inverse = np.unique(hashes, return_index=True, return_inverse=True)
    earlier = first_rows[inverse]  # each row's first occurrence
    repeats = np.flatnonzero(earlier != np.arange(len(hashes)))
    if len(repeats) == 0:
        return 0, -1, -1
    return len(repeats), int(repeats[0]), int(earlier[repeats[0]])
