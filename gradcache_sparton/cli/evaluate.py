"""``gradcache-sparton evaluate``: retrieval metrics of a checkpoint on BEIR folders
(:func:`~gradcache_sparton.pipeline.run_evaluation`)."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from gradcache_sparton.cli.options import CheckpointOptions, QueryLengthOption, parse_command
from gradcache_sparton.evaluation.evaluator import RETRIEVALS
from gradcache_sparton.evaluation.metrics import DEFAULT_MEASURES
from gradcache_sparton.primitives.option_field import option

__all__ = ["EvaluateOptions", "evaluate_command"]


@dataclass
class EvaluateOptions:
    """``evaluate``'s own flags (the checkpoint's: :class:`~.options.CheckpointOptions`)."""

    beir_path: list[str] | None = option(
        None,
        "One or more BEIR folders (a per-dataset table and the mean); default: the shipped SciFact dev sample.",
    )
    split: str = option("dev", "qrels split (qrels/<split>.tsv).")
    measures: list[str] | None = option(
        None,
        f"ir_measures names, e.g. nDCG@10 RR@10 R@100 AP P@5 (default: {' '.join(DEFAULT_MEASURES)}, the recall cutoff following --top_k).",
    )
    top_k: int = option(100, "Documents retrieved per query.")
    retrieval: str = option(
        "exhaustive",
        "Exhaustive search, or a seismic inverted index (exact by default; needs pyseismic-lsr).",
        choices=RETRIEVALS,
    )
    budgets: list[str] = option(
        ["full"],
        "Pruning budgets Q:D[:T] (query top-k, document top-k: an int or 'all'; weight threshold), e.g. full 64:256 32:128 all:all:0.5: metrics and index size (postings) at each.",
    )
    output_file: Path | None = option(
        None,
        "Also write the metrics as JSON here, and each TREC run beside it (<stem>.<dataset>.<budget>.trec).",
    )
    overwrite: bool = option(False, "replace an existing --output_file and its TREC runs.")


def evaluate_command(argv: Sequence[str]) -> int:
    from gradcache_sparton.evaluation import PruningBudget, format_table
    from gradcache_sparton.pipeline import run_evaluation

    checkpoint, queries, args = parse_command(
        "evaluate",
        argv,
        (CheckpointOptions, QueryLengthOption, EvaluateOptions),
        description=" (default: shipped SciFact dev).",
        required=("model_name_or_path",),
    )
    if args.top_k < 1:  # before the measures, whose default recall cutoff follows it
        raise ValueError(f"--top_k must be an int >= 1 (documents retrieved per query), got {args.top_k}")
    budgets = [PruningBudget.parse(text) for text in args.budgets]
    if args.output_file is not None:
        # Before any work: a result is never lost to a bad path, nor a file to a result.
        _prepare_output_file(args.output_file, overwrite=args.overwrite)
    encoding = asdict(checkpoint)
    result = run_evaluation(
        encoding.pop("model_name_or_path"),
        **encoding,
        **asdict(queries),
        beir_path=args.beir_path,
        split=args.split,
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
