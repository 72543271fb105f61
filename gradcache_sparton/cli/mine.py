"""``gradcache-sparton mine``: hard negatives written as a training file
(:func:`~gradcache_sparton.mining.run_mining`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gradcache_sparton.cli.options import CheckpointOptions, QueryLengthOption, run_job_command
from gradcache_sparton.mining import BM25_STEMMER, CORPORA, METHODS, SAMPLINGS
from gradcache_sparton.primitives.option_field import option

__all__ = ["MineOptions", "mine_command"]


@dataclass
class MineOptions:
    """``mine``'s own flags (with ``--method splade``, the checkpoint's: :class:`~.options.CheckpointOptions`)."""

    train_data: str | None = option(
        None,
        "jsonl of pairs: query, positive [, query_id, positive_id] (neither this nor --beir_path: the shipped SciFact training pairs).",
    )
    beir_path: str | None = option(
        None,
        "BEIR folder ('default': the shipped SciFact dev sample): its qrels give the pairs unless --train_data is set.",
    )
    split: str | None = option(
        None,
        "qrels split of --beir_path (qrels/<split>.tsv); default: train ('dev' for --beir_path default).",
    )
    corpus: str | None = option(
        None,
        "mine from the BEIR corpus (default with --beir_path) or the pairs' distinct positives.",
        choices=CORPORA,
    )
    output_file: Path = option(Path("negatives.jsonl.gz"), "the training file (.jsonl[.gz]).")
    overwrite: bool = option(False, "replace an existing --output_file.")
    method: str = option(
        "bm25", "bm25, or splade: a checkpoint's own ranking (--model_name_or_path).", choices=METHODS
    )
    num_negatives: int = option(2, "k: negative_1..k per pair.")
    rank_start: int = option(
        10,
        "first rank (1-based) a negative may have: higher skips more unjudged positives, gives easier negatives.",
    )
    rank_end: int = option(100, "last rank a negative may have.")
    sampling: str = option(
        "random", "random: k drawn (seeded) from the window; top: the k best ranked.", choices=SAMPLINGS
    )
    seed: int = option(0, "seed of --sampling random.")
    bm25_stemmer: str = option(BM25_STEMMER, "PyStemmer algorithm for BM25 tokens, or none.")


def mine_command(argv: Sequence[str]) -> int:
    from gradcache_sparton.mining import run_mining

    def mine(bm25_stemmer: str, **options: Any) -> dict[str, Any]:
        return run_mining(**options, bm25_stemmer=None if bm25_stemmer.lower() == "none" else bm25_stemmer)

    return run_job_command(
        "mine",
        argv,
        (MineOptions, CheckpointOptions, QueryLengthOption),
        mine,
        description=" (docs/mining.md). The checkpoint's options apply to --method splade.",
    )
