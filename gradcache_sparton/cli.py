"""Console entry point ``gradcache-sparton``: ``train``, ``evaluate`` and ``mine``.

``train`` parses :class:`~gradcache_sparton.arguments.ModelArguments`,
:class:`~gradcache_sparton.arguments.DataArguments` and
:class:`~gradcache_sparton.arguments.CachedSpladeTrainingArguments` with ``HfArgumentParser``. Values
come from, in increasing priority: the dataclass defaults, a config file (``--config FILE.yaml|json``;
without one, the shipped ``resources/default_train.yaml``, the embedded default run), then the flags.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["build_parser", "main"]

COMMANDS = {
    "train": "train a SPLADE model with GradCache (default: the embedded SciFact run)",
    "evaluate": "retrieval metrics (nDCG@10, MRR@10, Recall@100) of a checkpoint on a BEIR folder",
    "mine": "hard negatives (BM25 or a checkpoint's own ranking) written as a training file",
}


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser: ``--version``, ``--help`` and the command names (each parses its own flags)."""
    from gradcache_sparton import __version__

    parser = argparse.ArgumentParser(
        prog="gradcache-sparton",
        description=(
            "Train SPLADE-style learned sparse retrievers at very large effective batch sizes "
            "(GradCache engine + fused Triton SPLADE head)."
        ),
        epilog="Commands:\n"
        + "\n".join(f"  {n:<10}{h}" for n, h in COMMANDS.items())
        + "\n\nRun `gradcache-sparton COMMAND --help` for a command's flags.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument("command", nargs="?", choices=sorted(COMMANDS), metavar="COMMAND")
    parser.add_argument("args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    return parser


def _train_parser() -> Any:
    from transformers import HfArgumentParser

    from gradcache_sparton.arguments import CachedSpladeTrainingArguments, DataArguments, ModelArguments

    parser = HfArgumentParser(
        (ModelArguments, DataArguments, CachedSpladeTrainingArguments),
        prog="gradcache-sparton train",
        description="Train a SPLADE model with GradCache. Flags override --config (default: the embedded run).",
    )
    parser.add_argument(
        "--config",
        type=Path,
        default=None,
        help="YAML or JSON file of argument values (default: resources/default_train.yaml, the embedded run).",
    )
    return parser


def _load_config(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ValueError(f"--config {str(path)!r} does not exist")
    text = path.read_text(encoding="utf-8")
    if path.suffix.lower() in (".yaml", ".yml"):
        import yaml

        values = yaml.safe_load(text) or {}
    elif path.suffix.lower() == ".json":
        values = json.loads(text)
    else:
        raise ValueError(f"--config must be a .yaml, .yml or .json file, got {str(path)!r}")
    if not isinstance(values, dict):
        raise ValueError(f"--config {str(path)!r} must hold a mapping of argument names to values")
    return values


def _train(argv: Sequence[str]) -> int:
    from gradcache_sparton.pipeline import run_training
    from gradcache_sparton.resources import RESOURCES_DIR

    parser = _train_parser()
    pre, _ = parser.parse_known_args(argv)
    config_path = pre.config if pre.config is not None else RESOURCES_DIR / "default_train.yaml"
    config = _load_config(config_path)
    known = {action.dest for action in parser._actions}
    unknown = sorted(set(config) - known)
    if unknown:
        raise ValueError(f"--config {str(config_path)!r} has unknown argument(s) {unknown}")
    parser.set_defaults(**config)
    model_args, data_args, training_args, rest = parser.parse_args_into_dataclasses(args=list(argv))
    del rest  # only --config, already read
    logging.getLogger(__name__).info("config: %s", config_path)
    metrics = run_training(model_args, data_args, training_args)
    if training_args.process_index == 0:  # under DDP, one summary rather than one per process
        print(json.dumps({"output_dir": training_args.output_dir, **metrics}, indent=2))
    return 0


def _evaluate(argv: Sequence[str]) -> int:
    from gradcache_sparton.pipeline import run_evaluation

    parser = argparse.ArgumentParser(
        prog="gradcache-sparton evaluate",
        description=COMMANDS["evaluate"] + " (default: shipped SciFact dev).",
    )
    parser.add_argument("--model_name_or_path", required=True, help="Local checkpoint folder (from `train`).")
    parser.add_argument(
        "--beir_path", default=None, help="BEIR folder; default: the shipped SciFact dev sample."
    )
    parser.add_argument("--split", default="dev", help="qrels split (qrels/<split>.tsv).")
    parser.add_argument("--query_max_length", type=int, default=32)
    parser.add_argument("--document_max_length", type=int, default=256)
    parser.add_argument("--batch_size", type=int, default=64)
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:1, ... (default: cuda if available).")
    parser.add_argument("--output_file", type=Path, default=None, help="Also write the metrics as JSON here.")
    args = parser.parse_args(argv)
    if args.output_file is not None:
        _prepare_output_file(args.output_file)  # before any work: a result is never lost to a bad path
    metrics = run_evaluation(
        args.model_name_or_path,
        beir_path=args.beir_path,
        split=args.split,
        query_max_length=args.query_max_length,
        document_max_length=args.document_max_length,
        batch_size=args.batch_size,
        device=args.device,
    )
    text = json.dumps(metrics, indent=2)
    print(text, flush=True)  # first: the metrics reach the terminal even if writing the file fails
    if args.output_file is not None:
        args.output_file.write_text(text + "\n", encoding="utf-8")
    return 0


def _prepare_output_file(path: Path) -> None:
    """Create the folder of ``--output_file`` and check it can be written; ``ValueError`` if not."""
    if path.is_dir():
        raise ValueError(f"--output_file {str(path)!r} is a directory; give a file path")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"--output_file {str(path)!r}: cannot create its folder ({exc})") from None
    if not os.access(path.parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise ValueError(f"--output_file {str(path)!r} is not writable")


def _mine(argv: Sequence[str]) -> int:
    from gradcache_sparton.mining import BM25_STEMMER, CORPORA, METHODS, SAMPLINGS, run_mining

    parser = argparse.ArgumentParser(
        prog="gradcache-sparton mine",
        description=COMMANDS["mine"] + " (docs/mining.md).",
    )
    source = parser.add_argument_group("input (at least one)")
    source.add_argument(
        "--train_data", default=None, help="jsonl of pairs: query, positive [, query_id, positive_id]."
    )
    source.add_argument(
        "--beir_path", default=None, help="BEIR folder: its qrels give the pairs unless --train_data is set."
    )
    parser.add_argument("--split", default="train", help="qrels split of --beir_path (qrels/<split>.tsv).")
    parser.add_argument(
        "--corpus",
        choices=CORPORA,
        default=None,
        help="mine from the BEIR corpus (default with --beir_path) or the pairs' distinct positives.",
    )
    parser.add_argument("--output_file", type=Path, required=True, help="the training file (.jsonl[.gz]).")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --output_file.")
    parser.add_argument(
        "--method", choices=METHODS, default="bm25", help="bm25, or splade: a checkpoint's own ranking."
    )
    parser.add_argument("--model_name_or_path", default=None, help="checkpoint folder for --method splade.")
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
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--bm25_stemmer", default=BM25_STEMMER, help="PyStemmer algorithm for BM25 tokens, or none."
    )
    parser.add_argument("--query_max_length", type=int, default=32, help="--method splade: query tokens.")
    parser.add_argument(
        "--document_max_length", type=int, default=256, help="--method splade: document tokens."
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


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the process exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)
    run = {"train": _train, "evaluate": _evaluate, "mine": _mine}[args.command]
    try:
        return run(args.args)
    except ValueError as exc:  # bad arguments or data: one clear line, no traceback
        print(f"gradcache-sparton {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
