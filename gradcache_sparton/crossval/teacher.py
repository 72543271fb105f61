"""The distillation teacher the protocol writes into each fold's training rows: BM25 ensembled with a model.

Legend: R training rows, C = 1 + k candidates per row (the positive, then its k negatives), N corpus
documents, K normalisation depth, V vocabulary.

For every training row the teacher scores its candidates twice, with BM25 (:func:`~gradcache_sparton.mining.
bm25_scores`, the mining's bm25s index over the full corpus) and with a model (dot products of its sparse reps,
encoded at the evaluation lengths), puts each system's scores on one scale per query (``zscore`` by default,
:func:`~gradcache_sparton.mining.normalise_scores`) and mixes them: ``bm25_weight · n_bm25 + (1 - bm25_weight) ·
n_model``. The model is the recipe's untrained start (``--teacher bm25+model``; in a round r > 1 the fold's round
r-1 model) or, with ``--teacher fold``, a model the teacher recipe trained on the fold's own training rows. The
result is the row's ``teacher_scores`` [C], what ``--contrastive kl_div`` (or ``margin_mse``) reads.

A student recipe with ``--kl_in_batch`` distils instead from the fold teacher and BM25 scoring every document of
each batch (:func:`in_batch_teacher_args`: its ``--in_batch_teacher``, :mod:`gradcache_sparton.mining.batch_teacher`),
so that the teacher's softmax covers the student's in-batch candidates; its BM25 index is the fold's training
documents. Those scores too read only the fold's training rows and the fold's teacher.

A row's teacher scores are a function of the row's own texts, the corpus and the model: nothing of any other
row, query or judgement is read, and no model that saw a held-out claim scores a fold's rows, so the folds'
guarantee (no held-out claim shapes its training rows) holds for them as for the mined negatives.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from torch import Tensor

from gradcache_sparton.evaluation import EncodingSettings

__all__ = [
    "DEFAULT_TEACHER_WEIGHT",
    "LOSSES_READING_TEACHER",
    "TEACHERS",
    "TEACHER_NORMALISATIONS",
    "ensemble_teacher_scores",
    "in_batch_teacher_args",
]

# 'fold': a model trained on each fold's training rows with the teacher recipe (--teacher_recipe), per seed.
TEACHERS = ("none", "bm25+model", "fold")
# How each system's scores are put on one scale per query (:mod:`gradcache_sparton.mining.teacher_scores`):
# zscore first, the default (what the bm25+model teacher has always used).
TEACHER_NORMALISATIONS = ("zscore", "minmax", "none")
# BM25's share of the ensemble. Equal shares of the two normalised scores (CombSUM of z-scores): on the
# folds BM25 leads the starting model by 0.047 nDCG@10 at 256 tokens (docs/experiments.md), too little to
# justify a lopsided prior, and choosing the weight on the folds' own claims would tune on the test claims.
DEFAULT_TEACHER_WEIGHT = 0.5
# The contrastive losses that read a teacher_scores column (losses/splade.py); any other ignores it.
LOSSES_READING_TEACHER = ("kl_div", "margin_mse")


def ensemble_teacher_scores(
    queries: Sequence[str],
    candidates: Sequence[Sequence[str]],
    documents: Sequence[str],
    *,
    encoder: Callable[..., Tensor],
    encoding: EncodingSettings,
    bm25_weight: float = DEFAULT_TEACHER_WEIGHT,
    depth: int = 100,
    normalisation: str = "zscore",
) -> Tensor:
    """The teacher's scores [R, C] (module docstring): row r's candidates ``candidates[r]`` (positive first)
    for query ``queries[r]``, ``scale · (bm25_weight · n_bm25 + (1 - bm25_weight) · n_model)`` with each system
    normalised per query by ``normalisation`` (``zscore`` over their top min(``depth``, N) corpus scores;
    :func:`~gradcache_sparton.mining.normalise_scores`) and ``scale`` that normalisation's default (30 for
    ``minmax``, else 1); the model's reps encoded as ``encoding`` says
    (:class:`~gradcache_sparton.mining.SpladeTeacher`)."""
    from gradcache_sparton.mining import (
        DEFAULT_SCALES,
        BM25Teacher,
        SpladeTeacher,
        ensemble_scores,
        normalise_scores,
    )

    if not 0.0 <= bm25_weight <= 1.0:
        raise ValueError(f"bm25_weight must be in [0, 1], got {bm25_weight!r}")
    if normalisation not in TEACHER_NORMALISATIONS:
        raise ValueError(f"normalisation must be one of {TEACHER_NORMALISATIONS}, got {normalisation!r}")
    depth = min(depth, len(documents)) if normalisation == "zscore" else None
    systems = (BM25Teacher(show_progress=encoding.show_progress), SpladeTeacher(encoder, encoding))
    normalised = [
        normalise_scores(
            *system.scores(queries, candidates, documents, depth=depth), normalisation=normalisation
        )
        for system in systems
    ]  # [R, C] each
    return ensemble_scores(normalised, [bm25_weight, 1.0 - bm25_weight], scale=DEFAULT_SCALES[normalisation])


def in_batch_teacher_args(teacher_dir: str, *, bm25_weight: float, normalisation: str) -> dict[str, str]:
    """The student's training arguments that make the fold's teacher (the checkpoint in ``teacher_dir``) and BM25,
    at ``bm25_weight``, its in-batch teacher, normalised by ``normalisation`` (minmax or none)."""
    shares = [(teacher_dir, 1.0 - bm25_weight), ("bm25", bm25_weight)]
    spec = ",".join(f"{name}:{share!r}" for name, share in shares if share > 0)
    return {"in_batch_teacher": spec, "in_batch_teacher_normalisation": normalisation}
