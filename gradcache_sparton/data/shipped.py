"""Paths of the shipped SciFact sample: training rows and a dev BEIR folder (``resources/scifact_sample``)."""

from __future__ import annotations

from pathlib import Path

from gradcache_sparton.resources import RESOURCES_DIR

__all__ = ["default_dev_beir_path", "default_train_data_path"]


def default_train_data_path() -> Path:
    """The shipped SciFact training pairs (gzip'd jsonl, columns ``query``, ``positive``).

    Self-supervised pairs from the SciFact corpus plus the labelled training claims, the dev claims
    held out; see ``resources/NOTICE.md`` (licence: CC BY-NC 2.0) and ``docs/data.md``. Load it with
    ``load_training_data(default_train_data_path())``.
    """
    return RESOURCES_DIR / "scifact_sample" / "train.jsonl.gz"


def default_dev_beir_path() -> Path:
    """The shipped SciFact dev BEIR folder: held-out claims, their qrels (``qrels/dev.tsv``) and a
    corpus of their relevant abstracts plus distractors. Load it with ``load_beir(path, split="dev")``."""
    return RESOURCES_DIR / "scifact_sample" / "dev"
