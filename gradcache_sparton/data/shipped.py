"""Paths of the shipped SciFact sample: training rows and a dev BEIR folder (``resources/scifact_sample``)."""

from __future__ import annotations

from pathlib import Path

from gradcache_sparton.resources import RESOURCES_DIR

__all__ = ["DEFAULT_BEIR_NAME", "beir_folder", "default_dev_beir_path", "default_train_data_path"]

# How a table and messages name the shipped dev sample (beir_path "default").
DEFAULT_BEIR_NAME = "scifact-dev"


def default_train_data_path() -> Path:
    """The shipped SciFact training pairs (gzip'd jsonl, columns ``query``, ``positive``).

    Self-supervised pairs from the SciFact corpus plus the labelled training claims, the dev claims
    held out; see ``resources/NOTICE.md`` (licence: CC BY-NC 2.0) and ``docs/data.md``. Load it with
    ``load_training_data(default_train_data_path())``.
    """
    return RESOURCES_DIR / "scifact_sample" / "train.jsonl.gz"


def default_dev_beir_path() -> Path:
    """The shipped SciFact dev BEIR folder: 100 held-out claims, their qrels (``qrels/dev.tsv``) and a
    corpus pooled from the full SciFact corpus (their relevant abstracts plus the abstracts that the shipped
    SPLADE-tiny and BM25 rank highest for them: 1,583 of 5,183), on which nDCG@10 tracks the full corpus
    (docs/experiments.md). Load it with ``load_beir(path, split="dev")``."""
    return RESOURCES_DIR / "scifact_sample" / "dev"


def beir_folder(path: str | Path, *, split: str | None = None) -> str:
    """The BEIR folder ``path`` names: ``"default"`` is the shipped SciFact dev sample, whose one split is
    ``dev``; ``ValueError`` for another ``split`` there (naming the one it has), not a silent ``dev``."""
    if str(path) != "default":
        return str(path)
    if split is not None and split != "dev":
        raise ValueError(
            f"split {split!r}: the default BEIR folder (the shipped SciFact dev sample, {DEFAULT_BEIR_NAME}) has "
            "only the split 'dev'; give --beir_path a BEIR folder with qrels/" + f"{split}.tsv"
        )
    return str(default_dev_beir_path())
