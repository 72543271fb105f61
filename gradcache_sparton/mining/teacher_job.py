"""The ``gradcache-sparton teacher`` job, usable from Python too: a training file's rows with ``teacher_scores``.

Legend: R rows, C = 1 + k candidates per row (the positive, then ``negative_1..k``).

Reads a training file (what ``mine`` writes: ``query``, ``positive``, ``negative_1..k``), scores every row's
candidates with one teacher or a weighted ensemble (:mod:`.teachers`, :mod:`.teacher_scores`) and writes the
rows with a ``teacher_scores`` [C] column, what ``train --contrastive kl_div`` (or ``margin_mse``) reads.
Every input is checked before any model loads; the file is written atomically (a temporary file in the same
folder, renamed over the output), so an interrupted run leaves no half-written file.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gradcache_sparton.data import POSITIVE_COLUMN, QUERY_COLUMN, beir_folder, read_corpus
from gradcache_sparton.data.columns import TEACHER_COLUMN, negative_number
from gradcache_sparton.data.output import check_output_path, write_training_file
from gradcache_sparton.mining.rankings import check_bm25_installed
from gradcache_sparton.mining.teacher_scores import (
    DEFAULT_DEPTH,
    DEFAULT_SCALES,
    NORMALISATIONS,
    ensemble_scores,
    normalise_scores,
)
from gradcache_sparton.mining.teachers import load_teacher, teacher_kind

__all__ = ["TEACHER_COLUMN", "candidate_lists", "check_weights", "run_teacher_scores"]

logger = logging.getLogger(__name__)

# Weights must sum to 1 up to float rounding of a few decimal weights (0.1 + 0.2 + 0.7 = 1 + 1e-16).
_WEIGHT_SUM_TOLERANCE = 1e-6


def check_weights(weights: Sequence[float], teachers: int) -> list[float]:
    """The ensemble's weights, checked: one a teacher, each finite and > 0, summing to 1 (so ``minmax`` scores
    stay in [0, scale]); ``ValueError`` naming ``--teacher_weights`` otherwise."""
    weights = [float(w) for w in weights]
    if len(weights) != teachers:
        raise ValueError(
            f"--teacher_weights: {len(weights)} weight(s) for {teachers} --teacher(s); give one each"
        )
    if not all(math.isfinite(w) and w > 0 for w in weights):
        raise ValueError(f"--teacher_weights must be finite and > 0, got {weights}")
    if abs(sum(weights) - 1.0) > _WEIGHT_SUM_TOLERANCE:
        raise ValueError(f"--teacher_weights must sum to 1, got {weights} (sum {sum(weights)})")
    return weights


def candidate_lists(rows: Any) -> tuple[list[str], list[list[str]]]:
    """The rows' queries and each row's candidates (its positive, then ``negative_1..k`` in order)."""
    columns = rows[:]
    negatives = sorted((c for c in columns if negative_number(c)), key=negative_number)
    candidates = [
        list(texts) for texts in zip(*(columns[c] for c in [POSITIVE_COLUMN, *negatives]), strict=True)
    ]
    return list(columns[QUERY_COLUMN]), candidates


def run_teacher_scores(
    *,
    train_data: str | Path,
    teacher: Sequence[str],
    output_file: str | Path,
    teacher_weights: Sequence[float] | None = None,
    normalisation: str = "minmax",
    scale: float | None = None,
    depth: int = DEFAULT_DEPTH,
    beir_path: str | Path | None = None,
    query_max_length: int | None = None,
    document_max_length: int | None = None,
    batch_size: int = 64,
    device: str | None = None,
    bf16: bool = True,
    overwrite: bool = False,
    show_progress: bool = True,
) -> dict[str, Any]:
    """Write ``train_data``'s rows with ``teacher_scores`` to ``output_file``; returns a summary.

    ``teacher``: one or more teacher folders (a checkpoint of ours, a sentence-transformers SparseEncoder,
    SentenceTransformer or CrossEncoder folder) or ``bm25``; ``teacher_weights`` their shares (default equal),
    summing to 1. Each teacher's scores are normalised per query (``normalisation``: ``minmax``, ``zscore``
    against the query's top ``depth`` corpus scores, or ``none``), weighted, summed and multiplied by ``scale``
    (default: 30 for ``minmax``, 1 otherwise). The corpus (BM25's index statistics, ``zscore``'s top K) is
    ``beir_path``'s corpus, else the rows' distinct candidate texts. Models run on ``device`` (default: cuda
    when available), in bf16 autocast on a GPU when ``bf16``, fp32 on the CPU; ours at the lengths given, else
    those it was trained with.
    """
    from gradcache_sparton.data import load_training_data

    output = check_output_path(output_file, overwrite=overwrite)
    teachers = list(teacher)
    if not teachers:
        raise ValueError("--teacher: give at least one teacher (a model folder or bm25)")
    weights = check_weights(teacher_weights or [1.0 / len(teachers)] * len(teachers), len(teachers))
    if normalisation not in NORMALISATIONS:
        raise ValueError(f"--normalisation must be one of {NORMALISATIONS}, got {normalisation!r}")
    scale = DEFAULT_SCALES[normalisation] if scale is None else scale
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"--scale must be a finite number > 0, got {scale!r}")
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
        raise ValueError(f"--depth must be an int >= 1, got {depth!r}")
    if depth != DEFAULT_DEPTH and normalisation != "zscore":
        raise ValueError(
            f"--depth is zscore's reference depth; it does not apply to --normalisation {normalisation}"
        )
    if not Path(train_data).is_file():
        raise ValueError(f"--train_data {str(train_data)!r} does not exist")
    if beir_path is not None:
        beir_path = beir_folder(beir_path)  # 'default': the shipped SciFact dev sample
    if beir_path is not None and not Path(beir_path).is_dir():
        raise ValueError(f"--beir_path {str(beir_path)!r} is not a directory")
    kinds = [teacher_kind(name) for name in teachers]
    if normalisation == "zscore" and "cross_encoder" in kinds:
        raise ValueError(
            f"--teacher {teachers[kinds.index('cross_encoder')]!r} is a cross-encoder: it scores (query, text) "
            "pairs jointly and has no top K over a corpus, so --normalisation zscore does not apply (use minmax "
            "or none)"
        )
    if "bm25" in kinds:
        check_bm25_installed("english")
    rows = load_training_data(train_data)
    if TEACHER_COLUMN in rows.column_names:
        raise ValueError(
            f"--train_data {str(train_data)!r} already has a {TEACHER_COLUMN} column: score the file it came from "
            f"(or drop the column) rather than replace scores silently"
        )
    queries, candidates = candidate_lists(rows)
    if len(candidates[0]) < 2:
        raise ValueError(
            f"--train_data {str(train_data)!r} has no negative_1 column: teacher scores rank a row's positive "
            "against its negatives (`gradcache-sparton mine` writes them)"
        )
    documents = (
        [doc.full_text for doc in read_corpus(beir_path)]
        if beir_path is not None
        else list(dict.fromkeys(t for texts in candidates for t in texts))
    )
    if normalisation == "zscore" and depth > len(documents):
        raise ValueError(f"--depth {depth} is more than the corpus's {len(documents)} documents")

    start = time.perf_counter()
    normalised = []
    for name, kind in zip(teachers, kinds, strict=True):
        model = load_teacher(
            name,
            kind=kind,
            batch_size=batch_size,
            device=device,
            bf16=bf16,
            query_max_length=query_max_length,
            document_max_length=document_max_length,
            show_progress=show_progress,
        )
        scores, top = model.scores(
            queries, candidates, documents, depth=depth if normalisation == "zscore" else None
        )
        normalised.append(normalise_scores(scores, top, normalisation=normalisation))
        del model
    teacher_scores = ensemble_scores(normalised, weights, scale=scale)
    write_training_file(rows.add_column(TEACHER_COLUMN, teacher_scores.tolist()), output, overwrite=overwrite)
    seconds = time.perf_counter() - start
    logger.info("wrote %d rows with teacher scores to %s in %.1f s", len(rows), output, seconds)
    return {
        "output_file": str(output),
        "rows": len(rows),
        "candidates": len(candidates[0]),
        "teachers": [
            {"teacher": n, "kind": k, "weight": w} for n, k, w in zip(teachers, kinds, weights, strict=True)
        ],
        "normalisation": normalisation,
        "scale": scale,
        "seconds": round(seconds, 2),
        "rows_per_second": round(len(rows) / seconds, 1) if seconds > 0 else None,
    }
