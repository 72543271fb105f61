"""A sentence-transformers training dataset's columns renamed to ours (query, positive, negative_1..k)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from gradcache_sparton.data.columns import NEGATIVE_PREFIX, POSITIVE_COLUMN, QUERY_COLUMN

if TYPE_CHECKING:
    import datasets

__all__ = ["from_sentence_transformers_columns"]

# sentence-transformers' names for the query column and a lone hard-negative column.
_ANCHOR_COLUMN = "anchor"
_NEGATIVE_COLUMN = "negative"


def from_sentence_transformers_columns(
    dataset: datasets.Dataset, *, positional: bool = False
) -> datasets.Dataset:
    """Rename a sentence-transformers training dataset's columns to ours (query, positive, negative_1..k).

    - Named: ``anchor`` -> ``query`` and a lone ``negative`` -> ``negative_1``; ``positive`` and
      ``negative_<i>`` are already ours.
    - ``positional=True`` (sentence-transformers' own rule, where names do not matter): the string
      columns in order are the query, the positive, then hard negatives; numeric columns (labels,
      teacher scores) keep their names.

    A dataset that already has a ``query`` column, or that is not a ``datasets.Dataset``, is returned
    unchanged (validation reports what is wrong with it). Renaming touches no data.

    Raises:
        ValueError: a renamed column would collide with an existing one, or ``positional=True`` with
            fewer than two string columns.
    """
    import datasets

    if not isinstance(dataset, datasets.Dataset) or QUERY_COLUMN in dataset.column_names:
        return dataset
    names = dataset.column_names
    if positional:
        texts = [
            n
            for n in names
            if isinstance(dataset.features[n], datasets.Value)
            and dataset.features[n].dtype in ("string", "large_string")
        ]
        if len(texts) < 2:
            raise ValueError(
                "train_dataset needs at least two string columns (query, positive, then hard negatives, by "
                f"position), got columns {names}"
            )
        targets = [QUERY_COLUMN, POSITIVE_COLUMN] + [
            f"{NEGATIVE_PREFIX}{i}" for i in range(1, len(texts) - 1)
        ]
        mapping = dict(zip(texts, targets, strict=True))
    else:
        mapping = {_ANCHOR_COLUMN: QUERY_COLUMN, _NEGATIVE_COLUMN: f"{NEGATIVE_PREFIX}1"}
    mapping = {old: new for old, new in mapping.items() if old in names and old != new}
    kept = set(names) - set(mapping)
    collisions = sorted(new for new in mapping.values() if new in kept)
    if collisions:
        raise ValueError(
            f"renaming train_dataset columns {mapping} to this trainer's names would overwrite existing "
            f"columns {collisions}: rename them first"
        )
    return dataset.rename_columns(mapping) if mapping else dataset
