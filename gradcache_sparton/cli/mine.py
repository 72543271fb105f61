"""``gradcache-sparton mine``: hard negatives written as a training file
(:func:`~gradcache_sparton.mining.run_mining`)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

from gradcache_sparton.cli.commands import COMMANDS

__all__ = ["mine_command"]


def mine_command(argv: Sequence[str]) -> int:
    from gradcache_sparton.mining import BM25_STEMMER, CORPORA, METHODS, SAMPLINGS, run_mining

    parser = argparse.ArgumentParser(
        prog="gradcache-sparton mine",
        description=COMMANDS["mine"] + " (docs/mining.md).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    source = parser.add_argument_group("input (default, neither given: the shipped SciFact training pairs)")
    source.add_argument(
        "--train_data", default=None, help="jsonl of pairs: query, positive [, query_id, positive_id]."
    )
    source.add_argument(
        "--beir_path",
        default=None,
        help="BEIR folder ('default': the shipped SciFact dev sample): its qrels give the pairs unless "
        "--train_data is set.",
    )
    parser.add_argument(
        "--split",
        default=None,
        help="qrels split of --beir_path (qrels/<split>.tsv); default: train ('dev' for --beir_path default).",
    )
    parser.add_argument(
        "--corpus",
        choices=CORPORA,
        default=None,
        help="mine from the BEIR corpus (default with --beir_path) or the pairs' distinct positives.",
    )
    parser.add_argument(
        "--output_file",
        type=Path,
        default=Path("negatives.jsonl.gz"),
        help="the training file (.jsonl[.gz]).",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --output_file.")
    parser.add_argument(
        "--method", choices=METHODS, default="bm25", help="bm25, or splade: a checkpoint's own ranking."
    )
    parser.add_argument(
        "--model_name_or_path",
        default=None,
        help="--method splade: checkpoint folder, shipped name or hub id.",
    )
    parser.add_argument("--num_negatives", type=int, default=2, help="k: negative_1..k per pair.")
    parser.add_argument(
        "--rank_start",
        type=int,
        default=10,
        help="first rank (1-based) a negative may have: higher skips more unjudged positives, gives easier negatives.",
    )
    parser.add_argument("--rank_end", type=int, default=100, help="last rank a negative may have.")
    parser.add_argument(
        "--sampling",
        choices=SAMPLINGS,
        default="random",
        help="random: k drawn (seeded) from the window; top: the k best ranked.",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of --sampling random.")
    parser.add_argument(
        "--bm25_stemmer", default=BM25_STEMMER, help="PyStemmer algorithm for BM25 tokens, or none."
    )
    parser.add_argument(
        "--query_max_length",
        type=int,
        default=None,
        help="--method splade: query tokens (None: the checkpoint's training length, else 32).",
    )
    parser.add_argument(
        "--document_max_length",
        type=int,
        default=None,
        help="--method splade: document tokens (None: the checkpoint's training length, else 256).",
    )
    parser.add_argument("--batch_size", type=int, default=64, help="--method splade: encoding batch.")
    parser.add_argument(
        "--device", default=None, help="--method splade: cpu, cuda, ... (default: cuda if any)."
    )
    args = parser.parse_args(argv)
    summary = run_mining(
        output_file=args.output_file,
        train_data=args.train_data,
        beir_path=args.beir_path,
        split=args.split,
        corpus=args.corpus,
        method=args.method,
        model_name_or_path=args.model_name_or_path,
        num_negatives=args.num_negatives,
        rank_start=args.rank_start,
        rank_end=args.rank_end,
        sampling=args.sampling,
        seed=args.seed,
        query_max_length=args.query_max_length,
        document_max_length=args.document_max_length,
        batch_size=args.batch_size,
        device=args.device,
        bm25_stemmer=None if args.bm25_stemmer.lower() == "none" else args.bm25_stemmer,
        overwrite=args.overwrite,
    )
    print(json.dumps(summary, indent=2))
    return 0
