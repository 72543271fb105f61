"""``gradcache-sparton evaluate``: retrieval metrics of a checkpoint on BEIR folders
(:func:`~gradcache_sparton.pipeline.run_evaluation`)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from gradcache_sparton.cli.commands import COMMANDS

__all__ = ["evaluate_command"]


def evaluate_command(argv: Sequence[str]) -> int:
    from gradcache_sparton.evaluation import DEFAULT_MEASURES, RETRIEVALS, PruningBudget, format_table
    from gradcache_sparton.pipeline import run_evaluation

    parser = argparse.ArgumentParser(
        prog="gradcache-sparton evaluate",
        description=COMMANDS["evaluate"] + " (default: shipped SciFact dev).",
    )
    parser.add_argument(
        "--model_name_or_path",
        required=True,
        help="Checkpoint folder (`train` writes outputs/splade-<date>-<time> and prints it), shipped name "
        "(splade-tiny-msmarco) or hub id.",
    )
    parser.add_argument(
        "--beir_path",
        nargs="+",
        default=None,
        help="One or more BEIR folders (a per-dataset table and the mean); default: the shipped SciFact dev sample.",
    )
    parser.add_argument("--split", default="dev", help="qrels split (qrels/<split>.tsv).")
    parser.add_argument(
        "--query_max_length",
        type=int,
        default=None,
        help="Default: the checkpoint's training length, else 32.",
    )
    parser.add_argument(
        "--document_max_length",
        type=int,
        default=None,
        help="Default: the checkpoint's training length, else 256.",
    )
    parser.add_argument("--batch_size", type=int, default=64)
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:1, ... (default: cuda if available).")
    parser.add_argument(
        "--measures",
        nargs="+",
        default=None,
        help=f"ir_measures names, e.g. nDCG@10 RR@10 R@100 AP P@5 (default: {' '.join(DEFAULT_MEASURES)}, "
        "the recall cutoff following --top_k).",
    )
    parser.add_argument("--top_k", type=int, default=100, help="Documents retrieved per query.")
    parser.add_argument(
        "--retrieval",
        choices=RETRIEVALS,
        default="exhaustive",
        help="Exhaustive search, or a seismic inverted index (exact by default; needs pyseismic-lsr).",
    )
    parser.add_argument(
        "--budgets",
        nargs="+",
        default=["full"],
        help="Pruning budgets Q:D[:T] (query top-k, document top-k: an int or 'all'; weight threshold), "
        "e.g. full 64:256 32:128 all:all:0.5: metrics and index size (postings) at each.",
    )
    parser.add_argument(
        "--output_file",
        type=Path,
        default=None,
        help="Also write the metrics as JSON here, and each TREC run beside it (<stem>.<dataset>.<budget>.trec).",
    )
    parser.add_argument(
        "--overwrite", action="store_true", help="replace an existing --output_file and its TREC runs."
    )
    args = parser.parse_args(argv)
    if args.top_k < 1:  # before the measures, whose default recall cutoff follows it
        raise ValueError(f"--top_k must be an int >= 1 (documents retrieved per query), got {args.top_k}")
    budgets = [PruningBudget.parse(text) for text in args.budgets]
    if args.output_file is not None:
        # Before any work: a result is never lost to a bad path, nor a file to a result.
        _prepare_output_file(args.output_file, overwrite=args.overwrite)
    result = run_evaluation(
        args.model_name_or_path,
        beir_path=args.beir_path,
        split=args.split,
        query_max_length=args.query_max_length,
        document_max_length=args.document_max_length,
        batch_size=args.batch_size,
        device=args.device,
        measures=args.measures,
        top_k=args.top_k,
        budgets=budgets,
        retrieval=args.retrieval,
        run_prefix=None if args.output_file is None else args.output_file.with_suffix(""),
        overwrite=args.overwrite,
    )
    if all(isinstance(row, dict) for row in result.values()):  # a table: one row per dataset / budget
        print(format_table(result), file=sys.stderr)
    text = json.dumps(result, indent=2)
    print(text, flush=True)  # first: the metrics reach the terminal even if writing the file fails
    if args.output_file is not None:
        args.output_file.write_text(text + "\n", encoding="utf-8")
    return 0


def _prepare_output_file(path: Path, *, overwrite: bool) -> None:
    """Create the folder of ``--output_file`` and check it can be written and, without ``overwrite``, does
    not exist (as ``mine`` and ``export`` check theirs); ``ValueError`` if not."""
    if path.is_dir():
        raise ValueError(f"--output_file {str(path)!r} is a directory; give a file path")
    if path.exists() and not overwrite:
        raise ValueError(f"--output_file {str(path)!r} exists: pass --overwrite to replace it")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"--output_file {str(path)!r}: cannot create its folder ({exc})") from None
    if not os.access(path.parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise ValueError(f"--output_file {str(path)!r} is not writable")
