"""Ranking metrics: nDCG@k, MRR@k and Recall@k, averaged over the queries with a relevant document."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

__all__ = ["ndcg_at_k", "recall_at_k", "reciprocal_rank_at_k", "retrieval_metrics"]


def _check_ranking(ranking: Sequence[str], k: int) -> None:
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if len(set(ranking[:k])) != len(ranking[:k]):
        raise ValueError("ranking lists a document more than once")


def ndcg_at_k(ranking: Sequence[str], relevance: Mapping[str, int], k: int) -> float:
    """nDCG@k of one ranked list with graded relevance (the trec_eval / BEIR definition).

    DCG = sum over ranks i = 1..k of rel_i / log2(i + 1), with linear gain rel_i (relevance <= 0 or
    unjudged counts 0). The ideal DCG sorts *all* judged relevances > 0 of the query (retrieved or
    not) in descending order and takes the first k. 0.0 when the query has no relevant document.
    """
    _check_ranking(ranking, k)
    dcg = sum(
        relevance.get(doc, 0) / math.log2(rank + 1)
        for rank, doc in enumerate(ranking[:k], start=1)
        if relevance.get(doc, 0) > 0
    )
    ideal = sorted((r for r in relevance.values() if r > 0), reverse=True)[:k]
    idcg = sum(r / math.log2(rank + 1) for rank, r in enumerate(ideal, start=1))
    return dcg / idcg if idcg > 0 else 0.0


def reciprocal_rank_at_k(ranking: Sequence[str], relevance: Mapping[str, int], k: int) -> float:
    """1 / rank of the first document with relevance > 0 within the top k; 0.0 if there is none."""
    _check_ranking(ranking, k)
    for rank, doc in enumerate(ranking[:k], start=1):
        if relevance.get(doc, 0) > 0:
            return 1.0 / rank
    return 0.0


def recall_at_k(ranking: Sequence[str], relevance: Mapping[str, int], k: int) -> float:
    """Fraction of the query's documents with relevance > 0 that appear in the top k; 0.0 if none."""
    _check_ranking(ranking, k)
    relevant = {doc for doc, r in relevance.items() if r > 0}
    if not relevant:
        return 0.0
    return len(relevant.intersection(ranking[:k])) / len(relevant)


def retrieval_metrics(
    rankings: Mapping[str, Sequence[str]],
    qrels: Mapping[str, Mapping[str, int]],
    *,
    ndcg_k: int = 10,
    mrr_k: int = 10,
    recall_k: int = 100,
) -> dict[str, float]:
    """Mean nDCG@ndcg_k, MRR@mrr_k and Recall@recall_k over the queries of ``qrels`` that have at
    least one document with relevance > 0 (queries without one are left out, as in BEIR).

    ``rankings`` maps each such query id to its ranked doc ids, best first (ties must already be
    broken; :func:`retrieve` ranks equal scores by doc index). A query missing from ``rankings`` is a
    ``ValueError``. Keys: ``ndcg_at_{ndcg_k}``, ``mrr_at_{mrr_k}``, ``recall_at_{recall_k}``.
    """
    evaluated = [query_id for query_id, judged in qrels.items() if any(r > 0 for r in judged.values())]
    if not evaluated:
        raise ValueError("qrels has no query with a relevant document (relevance > 0)")
    missing = [query_id for query_id in evaluated if query_id not in rankings]
    if missing:
        raise ValueError(f"rankings has no entry for {len(missing)} judged queries, e.g. {missing[:3]}")
    totals = {f"ndcg_at_{ndcg_k}": 0.0, f"mrr_at_{mrr_k}": 0.0, f"recall_at_{recall_k}": 0.0}
    for query_id in evaluated:
        ranking, relevance = rankings[query_id], qrels[query_id]
        totals[f"ndcg_at_{ndcg_k}"] += ndcg_at_k(ranking, relevance, ndcg_k)
        totals[f"mrr_at_{mrr_k}"] += reciprocal_rank_at_k(ranking, relevance, mrr_k)
        totals[f"recall_at_{recall_k}"] += recall_at_k(ranking, relevance, recall_k)
    return {name: total / len(evaluated) for name, total in totals.items()}
