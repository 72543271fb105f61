"""``gradcache-sparton idf``: an inference-free model from a checkpoint and a corpus
(:func:`~gradcache_sparton.pipeline.run_idf`)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

from gradcache_sparton.cli.commands import COMMANDS

__all__ = ["idf_command"]


def idf_command(argv: Sequence[str]) -> int:
    from gradcache_sparton.pipeline import run_idf

    parser = argparse.ArgumentParser(
        prog="gradcache-sparton idf",
        description=COMMANDS["idf"] + " (docs/inference_free.md).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--model_name_or_path",
        required=True,
        help="the document encoder: a checkpoint folder (from `train`), shipped name or hub id; its tokenizer "
        "counts the corpus.",
    )
    parser.add_argument(
        "--beir_path",
        default="default",
        help="BEIR folder whose corpus.jsonl[.gz] the IDF is counted over ('default': the shipped SciFact dev "
        "sample).",
    )
    parser.add_argument(
        "--output_dir",
        type=Path,
        required=True,
        help="the inference-free model's folder: the document encoder, query_table.safetensors and idf.json "
        "(the model's own folder: only the table files are added, and query_encoder 'idf' recorded in its "
        "splade_config.json).",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the table files output_dir has, or the files of another checkpoint in it (never written "
        "through a symlink).",
    )
    args = parser.parse_args(argv)
    summary = run_idf(
        args.model_name_or_path,
        beir_path=args.beir_path,
        output_dir=args.output_dir,
        overwrite=args.overwrite,
    )
    print(json.dumps(summary, indent=2))
    return 0
