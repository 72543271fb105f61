"""``gradcache-sparton export``: a BEIR corpus encoded into a seismic or Anserini index file, or the document
encoder as an ONNX model (:func:`~gradcache_sparton.pipeline.run_export`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gradcache_sparton.cli.options import CheckpointOptions, run_job_command
from gradcache_sparton.evaluation.export import EXPORT_FORMATS
from gradcache_sparton.primitives.option_field import option

__all__ = ["ExportOptions", "export_command"]


@dataclass
class ExportOptions:
    """``export``'s own flags (the checkpoint's: :class:`~.options.CheckpointOptions`)."""

    output_file: Path = option(
        None, "the JSON-lines file to write (.jsonl or .json), or the .onnx model.", required=True
    )
    beir_path: str = option(
        "default",
        "BEIR folder whose corpus.jsonl[.gz] is encoded ('default': the shipped SciFact dev sample).",
    )
    overwrite: bool = option(False, "replace an existing --output_file.")
    format: str = option(
        "seismic",
        "seismic: float weights (SeismicIndex.build); anserini: JsonVectorCollection, int impacts; onnx: the "
        "document encoder as an ONNX model (--output_file *.onnx), checked with onnxruntime against PyTorch on "
        "the corpus's first documents.",
        choices=(*EXPORT_FORMATS, "onnx"),
    )
    scale: float = option(100.0, "anserini: impact = round(weight x scale); 0s left out.")
    chunk_size: int = option(4096, "documents encoded and written per chunk (bounds memory).")


def export_command(argv: Sequence[str]) -> int:
    from gradcache_sparton.pipeline import run_export

    def export(model_name_or_path: str, format: str, **options: Any) -> dict[str, Any]:
        return run_export(model_name_or_path, **options, export_format=format)

    return run_job_command(
        "export",
        argv,
        (CheckpointOptions, ExportOptions),
        export,
        description=" (docs/evaluation.md).",
        required=("model_name_or_path",),
    )
