"""The column names of training rows and their order: query, positive, negative_1..k (or ``negatives``)."""

from __future__ import annotations

import re
from collections.abc import Iterable

__all__ = [
    "NEGATIVES_COLUMN",
    "NEGATIVE_PREFIX",
    "POSITIVE_COLUMN",
    "QUERY_COLUMN",
    "TEACHER_COLUMN",
    "negative_number",
    "text_columns_of",
]

QUERY_COLUMN = "query"
POSITIVE_COLUMN = "positive"
# Hard negatives as separate columns negative_1 ... negative_k (1-based, no gaps) ...
NEGATIVE_PREFIX = "negative_"
# ... or as one list column with the same number of texts in every row.
NEGATIVES_COLUMN = "negatives"
# The teacher's scores of each row's candidates (the positive, then each negative), or of every document of a batch
# (an in-batch teacher): what the distillation losses read, a data column and a loss keyword alike.
TEACHER_COLUMN = "teacher_scores"

_NEGATIVE_RE = re.compile(rf"^{NEGATIVE_PREFIX}([1-9][0-9]*)$")


def negative_number(name: str) -> int | None:
    """i for a column named ``negative_i`` (i >= 1), else None."""
    match = _NEGATIVE_RE.match(name)
    return int(match.group(1)) if match else None


def text_columns_of(names: Iterable[str]) -> list[str]:
    """The text columns in collator order (query, positive, negative_1..k) or ``[..., negatives]``.

    Raises ``ValueError`` for a missing required column, a gap in negative_i, or both negative forms.
    """
    names = list(names)
    missing = [c for c in (QUERY_COLUMN, POSITIVE_COLUMN) if c not in names]
    if missing:
        raise ValueError(
            f"training data must have columns {QUERY_COLUMN!r} and {POSITIVE_COLUMN!r}; "
            f"missing {missing} (columns: {names})"
        )
    numbers = sorted(n for n in (negative_number(name) for name in names) if n is not None)
    if numbers and NEGATIVES_COLUMN in names:
        raise ValueError(
            f"training data has both a {NEGATIVES_COLUMN!r} list column and {NEGATIVE_PREFIX}<i> columns; "
            "use one form"
        )
    if numbers != list(range(1, len(numbers) + 1)):
        expected = [f"{NEGATIVE_PREFIX}{i}" for i in range(1, len(numbers) + 1)]
        found = [f"{NEGATIVE_PREFIX}{i}" for i in numbers]
        raise ValueError(
            f"negative columns must be numbered 1..k without gaps: expected {expected}, got {found}"
        )
    columns = [QUERY_COLUMN, POSITIVE_COLUMN] + [f"{NEGATIVE_PREFIX}{i}" for i in numbers]
    if NEGATIVES_COLUMN in names:
        columns.append(NEGATIVES_COLUMN)
    return columns
