"""``gradcache-sparton export``: a BEIR corpus encoded into a seismic or Anserini index file
(:func:`~gradcache_sparton.pipeline.run_export`)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

from gradcache_sparton.cli.commands import COMMANDS

__all__ = ["export_command"]


def export_command(argv: Sequence[str]) -> int:
    from gradcache_sparton.evaluation import EXPORT_FORMATS
    from gradcache_sparton.pipeline import run_export

    parser = argparse.ArgumentParser(
        prog="gradcache-sparton export",
        description=COMMANDS["export"] + " (docs/evaluation.md).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--model_name_or_path",
        required=True,
        help="checkpoint folder (from `train`), shipped name or hub id.",
    )
    parser.add_argument(
        "--beir_path",
        default="default",
        help="BEIR folder whose corpus.jsonl[.gz] is encoded ('default': the shipped SciFact dev sample).",
    )
    parser.add_argument(
        "--output_file",
        type=Path,
        required=True,
        help="the JSON-lines file to write (.jsonl or .json), or the .onnx model.",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --output_file.")
    parser.add_argument(
        "--format",
        choices=(*EXPORT_FORMATS, "onnx"),
        default="seismic",
        help="seismic: float weights (SeismicIndex.build); anserini: JsonVectorCollection, int impacts; onnx: "
        "the document encoder as an ONNX model (--output_file *.onnx), checked with onnxruntime against "
        "PyTorch on the corpus's first documents.",
    )
    parser.add_argument(
        "--scale", type=float, default=100.0, help="anserini: impact = round(weight x scale); 0s left out."
    )
    parser.add_argument(
        "--document_max_length",
        type=int,
        default=None,
        help="document tokens (None: the checkpoint's training length, else 256).",
    )
    parser.add_argument("--batch_size", type=int, default=64, help="documents encoded at once.")
    parser.add_argument(
        "--chunk_size",
        type=int,
        default=4096,
        help="documents encoded and written per chunk (bounds memory).",
    )
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:1, ... (default: cuda if any).")
    args = parser.parse_args(argv)
    summary = run_export(
        args.model_name_or_path,
        beir_path=args.beir_path,
        output_file=args.output_file,
        export_format=args.format,
        document_max_length=args.document_max_length,
        batch_size=args.batch_size,
        chunk_size=args.chunk_size,
        scale=args.scale,
        device=args.device,
        overwrite=args.overwrite,
    )
    print(json.dumps(summary, indent=2))
    return 0
