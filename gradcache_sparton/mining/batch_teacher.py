"""An in-batch teacher: each teacher's reps of every training text, made once, and from them the teacher's scores
of every query of a batch against every document of the batch, what ``kl_div`` with ``kl_in_batch`` distils.

Legend: B batch rows, k hard negatives per row, Q distinct training queries, N distinct training documents
(positives and negatives), T a teacher's vocabulary (or D its embedding width).

``train --contrastive kl_div --kl_in_batch True --in_batch_teacher "outputs/siamese:0.5,bm25:0.5"``: before
training, :func:`build_batch_teacher` encodes every distinct training query and document with each teacher
(on the GPU in bf16 when there is one, with a progress bar; the model is freed after), keeping only the reps on
the CPU. For each batch the collator then calls the :class:`BatchTeacher` with the batch's texts and attaches
its [B, (1+k)·B] matrix as ``teacher_scores``: column c·B + r is row r's text of document column c (positives,
then each negative column), the order of the student's score matrix (:func:`~gradcache_sparton.losses.kl_div_loss`).

What each teacher keeps and how a batch is scored (a row's score is a function of its two texts and the teacher;
BM25's statistics also of the training documents):

- ``splade`` (a checkpoint of ours) and ``sparse_encoder`` (a sentence-transformers ``SparseEncoder``): sparse reps
  as scipy CSR [Q, V] and [N, V]; a batch is one sparse product ``[B, V] @ [V, (1+k)·B]`` (the dot product, as
  :class:`~.teachers.SpladeTeacher` scores). A ``SparseEncoder`` must score by dot product.
- ``sentence_transformer`` (dense): embeddings [Q, D], [N, D] and the model's own similarity function.
- ``bm25``: sparse reps in BM25's own vocabulary (:func:`~.rankings.bm25_reps`): a query's token counts, a
  document's BM25 weights under the index of the training documents; their product is
  :func:`~.rankings.bm25_scores` under that corpus.
- ``cross_encoder``: refused; it reads each pair jointly, and a batch has B·(1+k)·B pairs a step.

Each teacher's [B, (1+k)·B] scores are normalised per query over its (1+k)·B candidates and the teachers
ensembled (:func:`~.teacher_scores.normalise_scores`, :func:`~.teacher_scores.ensemble_scores`: ``minmax``
times the scale, 30 by default, or ``none``); ``zscore`` would need a search of a corpus per query and is
refused (by the loss config).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from gradcache_sparton.data.columns import NEGATIVES_COLUMN, QUERY_COLUMN, text_columns_of
from gradcache_sparton.mining.rankings import check_bm25_installed
from gradcache_sparton.mining.teacher_job import TEACHER_COLUMN, check_weights
from gradcache_sparton.mining.teacher_scores import DEFAULT_SCALES, ensemble_scores, normalise_scores
from gradcache_sparton.mining.teachers import load_teacher, teacher_kind

__all__ = ["BatchTeacher", "batch_teacher_for_run", "build_batch_teacher", "parse_teacher_spec"]

logger = logging.getLogger(__name__)

_OPTION = "--in_batch_teacher"


def parse_teacher_spec(spec: str) -> tuple[list[str], list[float]]:
    """``"A:0.5,bm25:0.5"`` -> (teachers, weights): teachers separated by commas, each with an optional
    ``:WEIGHT`` (all or none; none: equal shares), weights checked as the ``teacher`` command's
    (:func:`~.teacher_job.check_weights`: > 0, summing to 1). ``ValueError`` naming ``--in_batch_teacher``."""
    teachers, weights = [], []
    for part in spec.split(","):
        name, _, weight = part.strip().rpartition(":")
        if not name:  # no ":WEIGHT" (or a bare ":")
            name, weight = part.strip(), ""
        try:
            weights.append(float(weight) if weight else None)
        except ValueError:
            raise ValueError(f"{_OPTION}: {part.strip()!r} is not TEACHER or TEACHER:WEIGHT") from None
        if not name:
            raise ValueError(f"{_OPTION} {spec!r}: an empty teacher (give TEACHER[:WEIGHT],...)")
        teachers.append(name)
    given = [w for w in weights if w is not None]
    if given and len(given) != len(weights):
        raise ValueError(f"{_OPTION} {spec!r}: give every teacher a weight, or none (equal shares)")
    try:
        checked = check_weights(given or [1.0 / len(teachers)] * len(teachers), len(teachers))
    except ValueError as error:
        raise ValueError(f"{_OPTION} {spec!r}: {error}".replace("--teacher_weights", "the weights")) from None
    return teachers, checked


@dataclass
class _Reps:
    """One teacher's reps of the training queries and documents: scipy CSR (sparse) or dense float32 tensors
    with their ``similarity`` (None: dot products of CSR rows)."""

    queries: Any
    documents: Any
    similarity: Any = None

    def scores(self, query_rows: np.ndarray, document_rows: np.ndarray) -> Tensor:
        """[len(query_rows), len(document_rows)] scores, float64."""
        if self.similarity is None:
            product = self.queries[query_rows] @ self.documents[document_rows].T  # [B, T] @ [T, (1+k)·B]
            return torch.from_numpy(product.toarray()).double()
        return self.similarity(self.queries[query_rows], self.documents[document_rows]).double()


class BatchTeacher:
    """A batch's teacher scores from reps made once (module docstring): ``teacher(queries, documents)`` with the
    batch's B queries and its document columns (each B texts: positives, then each negative column) ->
    [B, (1+k)·B] float32, column c·B + r for row r of column c, normalised per query and ensembled."""

    def __init__(
        self,
        query_row: dict[str, int],
        document_row: dict[str, int],
        reps: Sequence[_Reps],
        *,
        weights: Sequence[float],
        normalisation: str,
        scale: float,
    ) -> None:
        self.query_row, self.document_row, self.reps = query_row, document_row, list(reps)
        self.weights, self.normalisation, self.scale = list(weights), normalisation, scale

    def raw_scores(self, queries: Sequence[str], documents: Sequence[Sequence[str]]) -> list[Tensor]:
        """Each teacher's own [B, (1+k)·B] scores of the batch, before normalisation (float64)."""
        try:
            query_rows = np.array([self.query_row[text] for text in queries])
            document_rows = np.array([self.document_row[text] for column in documents for text in column])
        except KeyError as missing:
            raise ValueError(
                f"{_OPTION}: the batch's text {str(missing)[:80]} is not among the training texts the teacher "
                "encoded before training (the collator must read the rows it was built from)"
            ) from None
        return [reps.scores(query_rows, document_rows) for reps in self.reps]

    def __call__(self, queries: Sequence[str], documents: Sequence[Sequence[str]]) -> Tensor:
        normalised = [
            normalise_scores(scores, None, normalisation=self.normalisation)
            for scores in self.raw_scores(queries, documents)
        ]
        return ensemble_scores(normalised, self.weights, scale=self.scale)  # [B, (1+k)·B]


def _training_texts(dataset: Any) -> tuple[list[str], list[str]]:
    """The distinct queries and the distinct documents (positives and negatives) of the rows, first seen first."""
    names = text_columns_of(dataset.column_names)
    queries = list(dict.fromkeys(dataset[QUERY_COLUMN]))
    documents: dict[str, None] = {}
    for name in names[1:]:
        for value in dataset[name]:
            documents.update(dict.fromkeys(value if name == NEGATIVES_COLUMN else [value]))
    return queries, list(documents)


def _csr(reps: Any) -> Any:
    """Sparse reps (ours: :class:`~gradcache_sparton.primitives.sparse_reps.SparseReps`; a SparseEncoder's: a
    sparse COO tensor) as a float32 scipy CSR matrix."""
    from scipy import sparse

    if isinstance(reps, Tensor):  # [n, V] COO
        reps = reps.cpu().coalesce()
        rows, columns = reps.indices().numpy()
        return sparse.csr_matrix((reps.values().float().numpy(), (rows, columns)), shape=tuple(reps.shape))
    return sparse.csr_matrix(
        (reps.weights.float().numpy(), reps.token_ids.numpy(), reps.offsets.numpy()), shape=tuple(reps.shape)
    )


def _encode(name: str, kind: str, queries: list[str], documents: list[str], **load: Any) -> _Reps:
    """One teacher's reps of the training texts; its model is freed after."""
    if kind == "bm25":
        from gradcache_sparton.mining.rankings import bm25_reps

        query_counts, document_weights = bm25_reps(queries, documents, documents)
        # float32 as the models' reps: half the bytes a batch's product reads (scores of O(10), 7 digits kept).
        return _Reps(query_counts.astype(np.float32), document_weights.astype(np.float32))
    model = load_teacher(name, kind=kind, **load)
    try:
        q, d = model.encode(queries, query=True), model.encode(documents, query=False)
        if kind == "sentence_transformer":
            from sentence_transformers import SimilarityFunction

            function = SimilarityFunction.to_similarity_fn(model.model.similarity_fn_name or "cosine")
            return _Reps(q.cpu(), d.cpu(), function)
        if kind == "sparse_encoder" and model.model.similarity_fn_name not in (None, "dot"):
            raise ValueError(
                f"{_OPTION} {name!r}: a SparseEncoder scoring by {model.model.similarity_fn_name!r}; an in-batch "
                "teacher scores sparse reps by their dot product"
            )
        return _Reps(_csr(q), _csr(d))
    finally:
        del model
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _check_finite(name: str, reps: _Reps) -> None:
    for part in (reps.queries, reps.documents):
        values = part if isinstance(part, Tensor) else torch.from_numpy(np.asarray(part.data))
        if not bool(torch.isfinite(values).all()):
            raise ValueError(
                f"{_OPTION} {name!r}: its reps of the training texts hold NaN or inf values (a broken or "
                "diverged checkpoint?): no teacher scores from it"
            )


def build_batch_teacher(
    spec: str,
    dataset: Any,
    *,
    normalisation: str = "minmax",
    scale: float | None = None,
    device: str | None = None,
    bf16: bool = True,
    batch_size: int = 64,
    show_progress: bool = True,
) -> BatchTeacher:
    """The :class:`BatchTeacher` of ``spec`` (:func:`parse_teacher_spec`) over ``dataset``'s rows (``query``,
    ``positive``, negatives; no ``teacher_scores`` column): every teacher folder and kind checked first (one
    ``ValueError`` naming ``--in_batch_teacher``), then each teacher encodes every distinct training text once on
    ``device`` (default: cuda when available; bf16 autocast there with ``bf16``), ours at the lengths it was
    trained with; ``scale`` default: :data:`~.teacher_scores.DEFAULT_SCALES` of ``normalisation``."""
    teachers, weights = parse_teacher_spec(spec)
    kinds = []
    for name in teachers:
        try:
            kinds.append(teacher_kind(name))
        except ValueError as error:
            raise ValueError(str(error).replace("--teacher", _OPTION)) from None
    if "cross_encoder" in kinds:
        raise ValueError(
            f"{_OPTION} {teachers[kinds.index('cross_encoder')]!r} is a cross-encoder: it reads each (query, text) "
            "pair jointly, and an in-batch teacher scores every query of a batch against every document of it "
            "(B·(1+k)·B pairs a step); use it with `gradcache-sparton teacher` on each row's own candidates"
        )
    if "bm25" in kinds:
        check_bm25_installed("english")
    if TEACHER_COLUMN in dataset.column_names:
        raise ValueError(
            f"the training data has a {TEACHER_COLUMN} column and {_OPTION} is set: both are teacher scores; "
            f"drop the column or the option (neither is preferred silently)"
        )
    scale = DEFAULT_SCALES[normalisation] if scale is None else scale
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a finite number > 0, got {scale!r}")
    queries, documents = _training_texts(dataset)
    start = time.perf_counter()
    load = {"batch_size": batch_size, "device": device, "bf16": bf16, "show_progress": show_progress}
    all_reps = []
    for name, kind in zip(teachers, kinds, strict=True):
        reps = _encode(name, kind, queries, documents, **load)
        _check_finite(name, reps)
        all_reps.append(reps)
    logger.info(
        "In-batch teacher %s: %d queries and %d documents encoded in %.1f s",
        spec,
        len(queries),
        len(documents),
        time.perf_counter() - start,
    )
    return BatchTeacher(
        {text: row for row, text in enumerate(queries)},
        {text: row for row, text in enumerate(documents)},
        all_reps,
        weights=weights,
        normalisation=normalisation,
        scale=scale,
    )


def batch_teacher_for_run(args: Any, dataset: Any) -> BatchTeacher | None:
    """The in-batch teacher the training arguments ``args`` name (``in_batch_teacher`` and its normalisation, at
    that normalisation's default scale: ``teacher_temperature`` divides the scores after) over the training rows, on the GPU when the run has one (bf16 autocast with ``--bf16``); None
    without one."""
    if args.in_batch_teacher is None:
        return None
    device = "cuda" if torch.cuda.is_available() and not args.use_cpu else "cpu"
    return build_batch_teacher(
        args.in_batch_teacher,
        dataset,
        normalisation=args.in_batch_teacher_normalisation,
        device=device,
        bf16=bool(args.bf16),
        show_progress=not args.disable_tqdm,
    )
