"""Ranking metrics through ``ir_measures`` (pytrec_eval underneath): any measure it names.

A measure is named as ``ir_measures`` names it: ``nDCG@10``, ``RR@10`` (MRR), ``R@100`` (recall),
``AP`` (MAP), ``P@5``, ``nDCG(dcg='exp-log2')@10``, ... The mean is over the queries of the qrels that
have at least one document with relevance > 0 (queries without one are left out, as in BEIR); a
judged query that retrieved nothing counts 0.

Rankings are given already ordered (ties broken by :func:`~gradcache_sparton.evaluation.retrieve`:
the earlier doc first). ``ir_measures`` ranks by score and breaks ties its own way, so each ranking
reaches it with scores that encode its order (``len - rank``), never with raw scores that may tie.

Result keys are stable names derived from the measure: ``ndcg_at_10``, ``mrr_at_10``,
``recall_at_100``, ``map``, ``precision_at_5`` (see :func:`measure_key`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = [
    "DEFAULT_MEASURES",
    "measure_cutoff",
    "measure_key",
    "ndcg_at_k",
    "parse_measures",
    "recall_at_k",
    "reciprocal_rank_at_k",
    "retrieval_metrics",
]

# nDCG@10, MRR@10 and Recall@100: the BEIR / SPLADE reporting set.
DEFAULT_MEASURES = ("nDCG@10", "RR@10", "R@100")
# Key prefixes of the common measures (the rest use their lower-cased ir_measures name).
_KEY_NAMES = {"nDCG": "ndcg", "RR": "mrr", "R": "recall", "AP": "map", "P": "precision"}


def _ir_measures() -> Any:
    try:
        import ir_measures
    except ImportError:
        raise ImportError(
            "retrieval metrics need the ir_measures package: pip install 'ir_measures>=0.4'"
        ) from None
    return ir_measures


def parse_measures(measures: Sequence[str]) -> list[Any]:
    """``ir_measures`` measure objects for names like ``nDCG@10``; ``ValueError`` naming a bad one."""
    if isinstance(measures, str) or not isinstance(measures, Sequence) or not measures:
        raise ValueError(f"measures must be a non-empty list of measure names, got {measures!r}")
    ir_measures = _ir_measures()
    parsed = []
    for name in measures:
        try:
            parsed.append(ir_measures.parse_measure(name))
        except (NameError, ValueError, TypeError, SyntaxError) as exc:
            raise ValueError(
                f"measure {name!r} is not an ir_measures measure ({exc}); e.g. nDCG@10, RR@10, R@100, AP, P@5"
            ) from None
    for name, measure in zip(measures, parsed, strict=True):
        cutoff = measure_cutoff(measure)
        if cutoff is not None and (isinstance(cutoff, bool) or not isinstance(cutoff, int) or cutoff < 1):
            # pytrec_eval aborts the process (signal 6) on a cutoff of 0.
            raise ValueError(f"measure {name!r}: its cutoff must be an integer >= 1, got {cutoff!r}")
    keys = [measure_key(m) for m in parsed]
    if len(set(keys)) != len(keys):
        raise ValueError(f"measures name one measure twice: {list(measures)}")
    return parsed


def measure_cutoff(measure: Any) -> int | None:
    """The measure's rank cutoff (10 for ``nDCG@10``), None when it reads the whole ranking."""
    return measure.params.get("cutoff")


def measure_key(measure: Any) -> str:
    """A stable metric name: ``ndcg_at_10``, ``mrr_at_10``, ``recall_at_100``, ``map``, ...

    The prefix is the measure's common name (``RR`` -> ``mrr``, ``R`` -> ``recall``, ``AP`` ->
    ``map``, ``P`` -> ``precision``, else its lower-cased name), then any parameter other than the
    cutoff as ``_name_value``, then ``_at_<cutoff>``.
    """
    parts = [_KEY_NAMES.get(measure.NAME, measure.NAME.lower())]
    for name, value in sorted(measure.params.items()):
        if name != "cutoff":
            parts.append(re.sub(r"[^0-9a-zA-Z]+", "_", f"{name}_{value}").strip("_").lower())
    cutoff = measure_cutoff(measure)
    return "_".join(parts) + (f"_at_{cutoff}" if cutoff is not None else "")


def retrieval_metrics(
    rankings: Mapping[str, Sequence[str]],
    qrels: Mapping[str, Mapping[str, int]],
    *,
    measures: Sequence[str] = DEFAULT_MEASURES,
) -> dict[str, float]:
    """Mean of each measure over the queries of ``qrels`` with a document of relevance > 0.

    ``rankings`` maps each such query id to its ranked doc ids, best first (ties already broken). A
    judged query missing from ``rankings``, a ranking that lists a doc twice, and qrels without any
    relevant document are ``ValueError``. Keys: :func:`measure_key` of each measure.
    """
    parsed = parse_measures(measures)
    evaluated = [query_id for query_id, judged in qrels.items() if any(r > 0 for r in judged.values())]
    if not evaluated:
        raise ValueError("qrels has no query with a relevant document (relevance > 0)")
    missing = [query_id for query_id in evaluated if query_id not in rankings]
    if missing:
        raise ValueError(f"rankings has no entry for {len(missing)} judged queries, e.g. {missing[:3]}")
    run: dict[str, dict[str, float]] = {}
    for query_id in evaluated:
        ranking = rankings[query_id]
        if len(set(ranking)) != len(ranking):
            raise ValueError(f"the ranking of query {query_id!r} lists a document more than once")
        # Scores that encode the given order, so that ir_measures' own tie-break never applies.
        run[query_id] = {doc_id: float(len(ranking) - rank) for rank, doc_id in enumerate(ranking)}
    judged = {query_id: {d: int(r) for d, r in qrels[query_id].items()} for query_id in evaluated}
    results = _ir_measures().calc_aggregate(parsed, judged, run)
    return {measure_key(m): float(results[m]) for m in parsed}


def _one_query(measure: str, ranking: Sequence[str], relevance: Mapping[str, int], k: int) -> float:
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if not any(r > 0 for r in relevance.values()):
        return 0.0
    return next(
        iter(retrieval_metrics({"q": ranking}, {"q": relevance}, measures=[f"{measure}@{k}"]).values())
    )


def ndcg_at_k(ranking: Sequence[str], relevance: Mapping[str, int], k: int) -> float:
    """nDCG@k of one ranked list with graded relevance (``nDCG@k`` of trec_eval / BEIR: linear gain,
    log2 discount, ideal DCG from all judged relevances > 0); 0.0 when no document is relevant."""
    return _one_query("nDCG", ranking, relevance, k)


def reciprocal_rank_at_k(ranking: Sequence[str], relevance: Mapping[str, int], k: int) -> float:
    """1 / rank of the first document with relevance > 0 within the top k (``RR@k``); 0.0 if none."""
    return _one_query("RR", ranking, relevance, k)


def recall_at_k(ranking: Sequence[str], relevance: Mapping[str, int], k: int) -> float:
    """Fraction of the documents with relevance > 0 that appear in the top k (``R@k``); 0.0 if none."""
    return _one_query("R", ranking, relevance, k)
