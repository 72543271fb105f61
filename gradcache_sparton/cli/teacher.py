"""``gradcache-sparton teacher``: a training file's rows with ``teacher_scores`` from a teacher or an ensemble
(:func:`~gradcache_sparton.mining.run_teacher_scores`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from gradcache_sparton.cli.options import EncodingOptions, QueryLengthOption, run_job_command
from gradcache_sparton.mining import DEFAULT_DEPTH, NORMALISATIONS
from gradcache_sparton.primitives.option_field import option

__all__ = ["TeacherOptions", "teacher_command"]


@dataclass
class TeacherOptions:
    """``teacher``'s own flags (how our checkpoints encode: :class:`~.options.EncodingOptions`,
    :class:`~.options.QueryLengthOption`)."""

    train_data: str = option(
        None,
        "training file with negatives (query, positive, negative_1..k), e.g. what `mine` writes.",
        required=True,
    )
    teacher: list[str] = option(
        None,
        "teacher folder(s): a checkpoint of ours (siamese or inference-free), a sentence-transformers "
        "SparseEncoder / SentenceTransformer / CrossEncoder folder, or bm25; several: a weighted ensemble.",
        required=True,
        metavar="FOLDER",
    )
    teacher_weights: list[float] | None = option(
        None, "each teacher's share of the ensemble, > 0, summing to 1 (default: equal shares).", metavar="W"
    )
    output_file: Path = option(None, "the training file to write (.jsonl[.gz]).", required=True)
    overwrite: bool = option(False, "replace an existing --output_file.")
    normalisation: str = option(
        "minmax",
        "per-query normalisation of each teacher before the weighted sum: minmax over the row's candidates, "
        "zscore against the query's top --depth corpus scores, or none.",
        choices=NORMALISATIONS,
    )
    scale: float | None = option(
        None, "multiplies the ensemble (None: 30 for minmax, as OpenSearch's distillation; 1 otherwise)."
    )
    depth: int = option(DEFAULT_DEPTH, "zscore only: the query's top K corpus scores it normalises against.")
    beir_path: str | None = option(
        None,
        "BEIR folder ('default': the shipped SciFact dev sample) whose corpus gives BM25's statistics and "
        "zscore's top K (None: the rows' own texts).",
    )
    bf16: bool = option(True, "on a GPU, encode under bf16 autocast (the CPU always runs fp32).")


def teacher_command(argv: Sequence[str]) -> int:
    from gradcache_sparton.mining import run_teacher_scores

    return run_job_command(
        "teacher",
        argv,
        (TeacherOptions, EncodingOptions, QueryLengthOption),
        run_teacher_scores,
        description=" (docs/distillation.md): the positive, then each negative, per row.",
    )
