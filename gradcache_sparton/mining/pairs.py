"""The (query, positive[, ids]) pairs that mining starts from: from a BEIR folder or a jsonl file.

Mining pairs are a ``datasets.Dataset`` with the text columns ``query`` and ``positive`` and, optionally,
``query_id`` and ``positive_id`` (strings or integers, compared as strings). Ids say which rows share a
query and which corpus document a positive is; without them, rows are grouped by query text and
positives are matched by exact text. No other column is accepted: a row that already has negatives or
loss columns (e.g. ``teacher_scores``) would no longer match them once mined negatives are added.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from gradcache_sparton.data import (
    NEGATIVE_PREFIX,
    NEGATIVES_COLUMN,
    POSITIVE_COLUMN,
    QUERY_COLUMN,
    BeirData,
    validate_training_dataset,
)
from gradcache_sparton.data.beir import relevant_judgements
from gradcache_sparton.data.files import COMPRESSIONS, format_suffix

if TYPE_CHECKING:
    import datasets

__all__ = [
    "POSITIVE_ID_COLUMN",
    "QUERY_ID_COLUMN",
    "beir_mining_pairs",
    "check_mining_pairs",
    "load_mining_pairs",
]

QUERY_ID_COLUMN = "query_id"
POSITIVE_ID_COLUMN = "positive_id"
_ID_COLUMNS = (QUERY_ID_COLUMN, POSITIVE_ID_COLUMN)
_JSON_SUFFIXES = (".jsonl", ".json")


def beir_mining_pairs(beir: BeirData) -> datasets.Dataset:
    """One row per judgement with relevance > 0, in qrels order (the rows of ``beir_training_pairs``),
    with the ids: columns ``query``, ``positive``, ``query_id``, ``positive_id``."""
    import datasets

    if not isinstance(beir, BeirData):
        raise TypeError(f"beir must be a BeirData (see load_beir), got {type(beir).__name__}")
    rows = [
        {
            QUERY_COLUMN: beir.queries[query_id],
            POSITIVE_COLUMN: beir.corpus[doc_id],
            QUERY_ID_COLUMN: query_id,
            POSITIVE_ID_COLUMN: doc_id,
        }
        for query_id, doc_id in relevant_judgements(beir)
    ]
    if not rows:
        raise ValueError("beir has no judgement with relevance > 0: no pairs to mine negatives for")
    return datasets.Dataset.from_list(rows)


def check_mining_pairs(pairs: datasets.Dataset) -> None:
    """Raise ``ValueError`` (naming the column, and the row where one is at fault) unless ``pairs`` is a
    non-empty Dataset with string ``query`` / ``positive`` cells, optional non-null ``query_id`` /
    ``positive_id`` cells, and no other column."""
    import datasets

    if not isinstance(pairs, datasets.Dataset):
        raise TypeError(f"pairs must be a datasets.Dataset, got {type(pairs).__name__}")
    names = pairs.column_names
    if any(name == NEGATIVES_COLUMN or name.startswith(NEGATIVE_PREFIX) for name in names):
        raise ValueError(
            f"pairs already have negatives (columns {names}): mining writes negative_1..k itself; "
            "remove the negative columns first"
        )
    extra = [name for name in names if name not in (QUERY_COLUMN, POSITIVE_COLUMN, *_ID_COLUMNS)]
    if extra:
        raise ValueError(
            f"pairs have column(s) {extra}: mining accepts {QUERY_COLUMN!r}, {POSITIVE_COLUMN!r} and the "
            f"optional {list(_ID_COLUMNS)} only (other columns would not match the mined negatives)"
        )
    ids = [name for name in _ID_COLUMNS if name in names]
    validate_training_dataset(pairs.remove_columns(ids) if ids else pairs)  # query/positive: strings
    for name in ids:
        values = pairs.select_columns([name])[:][name]
        missing = next((row for row, value in enumerate(values) if value is None), None)
        if missing is not None:
            raise ValueError(f"column {name!r} is empty (null) in row {missing}: give every row an id")


def load_mining_pairs(path: str | Path) -> datasets.Dataset:
    """Read mining pairs from a ``.jsonl`` / ``.json`` file (optionally .gz/.bz2/.xz/.zst), one
    object per line with ``query``, ``positive`` and optionally ``query_id``, ``positive_id``, and
    check them with :func:`check_mining_pairs`."""
    import datasets

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"training data file {str(path)!r} does not exist")
    if format_suffix(path) not in _JSON_SUFFIXES:
        raise ValueError(
            f"mining reads {list(_JSON_SUFFIXES)} files (optionally compressed: {list(COMPRESSIONS)}), "
            f"got {str(path)!r}"
        )
    pairs = datasets.load_dataset("json", data_files=str(path), split="train")
    check_mining_pairs(pairs)
    return pairs
