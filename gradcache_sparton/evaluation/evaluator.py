"""The retrieval evaluator: encode a BEIR dataset's judged queries and corpus, retrieve, score.

Legend: Q queries, N documents, K top-k.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from gradcache_sparton.data import QUERY_COLUMN, BeirData
from gradcache_sparton.evaluation.encoding import Encoder, EncodingSettings, takes_encoding
from gradcache_sparton.evaluation.metrics import (
    DEFAULT_MEASURES,
    measure_cutoff,
    parse_measures,
    retrieval_metrics,
)
from gradcache_sparton.evaluation.pruning import PruningBudget
from gradcache_sparton.evaluation.retrieval import retrieve
from gradcache_sparton.evaluation.runs import Run
from gradcache_sparton.evaluation.seismic_index import retrieve_seismic, seismic_available
from gradcache_sparton.primitives.column_routing import DOCUMENT_COLUMN
from gradcache_sparton.primitives.sparse_reps import SparseReps

__all__ = ["RETRIEVALS", "EvaluationResult", "SparseRetrievalEvaluator"]

# Exhaustive chunked search (:func:`retrieve`) or a seismic inverted index (:func:`retrieve_seismic`).
RETRIEVALS = ("exhaustive", "seismic")


@dataclass(frozen=True)
class EvaluationResult:
    """One evaluation at one pruning budget: its metrics and its run (query id -> [(doc id, score)])."""

    budget: PruningBudget
    metrics: dict[str, float]
    run: Run


class SparseRetrievalEvaluator:
    """Evaluate a sparse encoder on a BEIR dataset: ``evaluator(encoder) -> dict[str, float]``.

    Each call encodes the judged queries (those with a relevant doc) and the whole corpus with
    :func:`encode_texts`, retrieves the top ``top_k`` docs per query with :func:`retrieve` and returns

    - one metric per measure (:func:`retrieval_metrics`; default ``nDCG@10``, ``RR@10`` and
      ``R@{top_k}``, keys ``ndcg_at_10``, ``mrr_at_10``, ``recall_at_{top_k}``), and
    - ``query_nonzeros``, ``doc_nonzeros``: average number of non-zero entries per query / doc rep,
      and ``postings``: the corpus's non-zero entries in all (the size of its inverted index).

    :meth:`evaluate` encodes once and evaluates at several :class:`PruningBudget` s, keeping the runs.
    ``retrieval`` picks exhaustive search or a seismic index (see :meth:`search`).
    ``encoding`` says how texts are encoded: truncated to its ``query_max_length`` / ``document_max_length``
    tokens, as in training.
    """

    @takes_encoding
    def __init__(
        self,
        data: BeirData,
        *,
        encoding: EncodingSettings,
        top_k: int = 100,
        measures: Sequence[str] | None = None,
        retrieval: str = "exhaustive",
    ) -> None:
        if not isinstance(data, BeirData):
            raise TypeError(f"data must be a BeirData (see load_beir), got {type(data).__name__}")
        if retrieval not in RETRIEVALS:
            raise ValueError(f"retrieval must be one of {RETRIEVALS}, got {retrieval!r}")
        if retrieval == "seismic" and not seismic_available():
            raise ValueError(
                "retrieval='seismic' needs pyseismic-lsr: pip install 'gradcache_sparton[seismic]'"
            )
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
            raise ValueError(f"top_k must be an int >= 1 (documents retrieved per query), got {top_k!r}")
        measures = tuple(measures) if measures is not None else (*DEFAULT_MEASURES[:2], f"R@{top_k}")
        cutoffs = [c for c in (measure_cutoff(m) for m in parse_measures(measures)) if c is not None]
        if top_k < max(cutoffs, default=1):
            raise ValueError(
                f"top_k must be >= {max(cutoffs)} (the largest cutoff of measures {list(measures)}), got {top_k}"
            )
        self.data = data
        self.encoding = encoding
        self.top_k = top_k
        self.measures = measures
        self.retrieval = retrieval
        self.query_ids = [q for q, judged in data.qrels.items() if any(r > 0 for r in judged.values())]
        if not self.query_ids:
            raise ValueError("data.qrels has no query with a relevant document (relevance > 0)")
        self.doc_ids = list(data.corpus)

    def encode(self, encoder: Encoder) -> tuple[SparseReps, SparseReps]:
        """The reps of the judged queries ([Q, V], in ``query_ids`` order) and of the corpus ([N, V])."""
        queries = [self.data.queries[q] for q in self.query_ids]
        documents = [self.data.corpus[d] for d in self.doc_ids]
        return (
            self.encoding.encode(encoder, queries, column=QUERY_COLUMN, desc="Encoding queries"),
            self.encoding.encode(encoder, documents, column=DOCUMENT_COLUMN, desc="Encoding corpus"),
        )

    def search(self, q_reps: SparseReps, d_reps: SparseReps, *, device: torch.device | str) -> Run:
        """The top ``top_k`` (doc id, score) of every judged query with a positive score, best first
        (ties: earlier doc). A document sharing no term with the query (score 0) is never retrieved, as
        an inverted index never returns it: the metrics do not depend on the corpus's order.

        ``retrieval="seismic"`` searches a seismic index instead (:func:`retrieve_seismic`, exact by
        default: the same documents; ties in seismic's order).
        """
        if self.retrieval == "seismic":
            found = retrieve_seismic(q_reps, d_reps, top_k=self.top_k)
            return {
                query_id: [(self.doc_ids[i], s) for i, s in hits]
                for query_id, hits in zip(self.query_ids, found, strict=True)
            }
        scores, doc_index = retrieve(q_reps, d_reps, top_k=self.top_k, device=device)  # [Q, K] each
        return {
            query_id: [(self.doc_ids[i], s) for i, s in zip(indices, row_scores, strict=True) if s > 0]
            for query_id, indices, row_scores in zip(
                self.query_ids, doc_index.tolist(), scores.tolist(), strict=True
            )
        }

    def score(self, run: Run) -> dict[str, float]:
        """The metrics of ``run`` against the qrels."""
        rankings = {query_id: [doc_id for doc_id, _ in hits] for query_id, hits in run.items()}
        return retrieval_metrics(rankings, self.data.qrels, measures=self.measures)

    def evaluate(
        self, encoder: Encoder, *, budgets: Sequence[PruningBudget] = (PruningBudget(),)
    ) -> list[EvaluationResult]:
        """Encode once, then prune, retrieve and score at each budget (in order)."""
        if not budgets or not all(isinstance(b, PruningBudget) for b in budgets):
            raise ValueError(f"budgets must be a non-empty list of PruningBudget, got {budgets!r}")
        device = self.encoding.device_for(encoder)
        q_full, d_full = self.encode(encoder)
        results = []
        for budget in budgets:
            q_reps, d_reps = budget.apply(q_full, d_full)
            run = self.search(q_reps, d_reps, device=device)
            metrics = self.score(run)
            metrics["query_nonzeros"] = q_reps.nonzeros_per_row().double().mean().item()
            metrics["doc_nonzeros"] = d_reps.nonzeros_per_row().double().mean().item()
            metrics["postings"] = float(d_reps.weights.numel())
            results.append(EvaluationResult(budget, metrics, run))
        return results

    def __call__(self, encoder: Encoder) -> dict[str, float]:
        """The metrics of the unpruned reps (what :class:`RetrievalEvalCallback` logs)."""
        return self.evaluate(encoder)[0].metrics
