"""Paired statistics of two systems scored on the same queries: how sure is a difference in the mean?

Given one score per query for a baseline and a candidate (nDCG@10, say), the difference per query
``d = candidate - baseline`` ([Q]) is what is tested:

- ``mean_difference``: the mean of ``d``;
- ``ci95_low`` / ``ci95_high``: a 95% percentile bootstrap interval of that mean (``resamples`` draws
  of Q queries with replacement);
- ``p_value``: a two-sided paired randomization (sign-flip) test: each query's difference flipped at
  random ``resamples`` times; the share of flips whose mean is at least as far from zero as the
  observed one, the observed assignment counted as one of them (so never below 1 / (resamples + 1));
- ``queries_up`` / ``queries_down`` / ``queries_same``: how many queries moved which way.

The query is the unit: the interval says how much the mean would move on another draw of queries like
these, not how much another training seed would move it (average the seeds per query first to fold that
in: :func:`paired_comparison` takes several candidate scores per query).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from gradcache_sparton.evaluation.metrics import DEFAULT_MEASURES, measure_key, parse_measures
from gradcache_sparton.evaluation.runs import Run

__all__ = ["paired_comparison", "paired_run_comparison", "paired_statistics", "per_query_metrics"]

DEFAULT_RESAMPLES = 10_000


def paired_statistics(
    differences: torch.Tensor | Sequence[float], *, resamples: int = DEFAULT_RESAMPLES, seed: int = 0
) -> dict[str, float]:
    """Mean of ``differences`` [Q], its 95% bootstrap interval, the sign-flip p-value and the up/down/same
    counts (see the module docstring). ``ValueError`` for an empty or non-finite input or ``resamples < 1``."""
    d = torch.as_tensor(differences, dtype=torch.float64).flatten()
    if d.numel() == 0:
        raise ValueError("differences is empty: need at least one query")
    if not torch.isfinite(d).all():
        raise ValueError("differences holds NaN or inf")
    if isinstance(resamples, bool) or not isinstance(resamples, int) or resamples < 1:
        raise ValueError(f"resamples must be an int >= 1, got {resamples!r}")
    g = torch.Generator().manual_seed(seed)
    Q = d.numel()
    mean = d.mean().item()
    boot = torch.empty(resamples, dtype=torch.float64)  # [R]
    flipped = torch.empty(resamples, dtype=torch.float64)  # [R]
    chunk = max(1, 2**22 // Q)  # bounds memory at [chunk, Q]
    for start in range(0, resamples, chunk):
        n = min(chunk, resamples - start)
        picks = torch.randint(0, Q, (n, Q), generator=g)  # [n, Q] queries drawn with replacement
        boot[start : start + n] = d[picks].mean(dim=1)
        signs = torch.randint(0, 2, (n, Q), generator=g, dtype=torch.float64) * 2 - 1  # [n, Q]
        flipped[start : start + n] = (signs * d).mean(dim=1).abs()
    low, high = torch.quantile(boot, torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
    # A flip reaches the observed mean up to summation-order rounding: tolerance of a few ulps of the scale.
    tolerance = 1e-12 * max(1.0, d.abs().max().item())
    p_value = ((flipped >= abs(mean) - tolerance).sum().item() + 1) / (resamples + 1)
    return {
        "queries": Q,
        "mean_difference": mean,
        "ci95_low": low,
        "ci95_high": high,
        "p_value": p_value,
        "queries_up": int((d > 0).sum()),
        "queries_down": int((d < 0).sum()),
        "queries_same": int((d == 0).sum()),
    }


def paired_comparison(
    baseline: Mapping[str, float | Sequence[float]],
    candidate: Mapping[str, float | Sequence[float]],
    *,
    resamples: int = DEFAULT_RESAMPLES,
    seed: int = 0,
) -> dict[str, float]:
    """:func:`paired_statistics` of ``candidate - baseline`` over their queries (query id -> score, or
    -> one score per seed, averaged first), with each side's mean (``baseline_mean``, ``candidate_mean``).

    Both must score the same query ids (``ValueError`` naming some that differ)."""
    if set(baseline) != set(candidate):
        only = sorted(set(baseline) ^ set(candidate))
        raise ValueError(
            f"baseline and candidate must score the same queries; {len(only)} differ, e.g. {only[:3]}"
        )
    queries = sorted(baseline)
    before = torch.tensor([_mean_score(baseline[q], q) for q in queries], dtype=torch.float64)  # [Q]
    after = torch.tensor([_mean_score(candidate[q], q) for q in queries], dtype=torch.float64)  # [Q]
    stats = paired_statistics(after - before, resamples=resamples, seed=seed)
    return {"baseline_mean": before.mean().item(), "candidate_mean": after.mean().item(), **stats}


def _mean_score(value: float | Sequence[float], query_id: str) -> float:
    if isinstance(value, (int, float)):
        return float(value)
    values = [float(v) for v in value]
    if not values:
        raise ValueError(f"query {query_id!r} has an empty list of scores")
    return sum(values) / len(values)


def per_query_metrics(
    rankings: Mapping[str, Sequence[str]],
    qrels: Mapping[str, Mapping[str, int]],
    *,
    measures: Sequence[str] = DEFAULT_MEASURES,
) -> dict[str, dict[str, float]]:
    """measure key (``ndcg_at_10``, ...) -> query id -> value, for every query of ``qrels`` with a relevant
    document (a judged query missing from ``rankings`` is ``ValueError``; one that retrieved nothing
    scores 0). The means of these are :func:`~gradcache_sparton.evaluation.retrieval_metrics`."""
    import ir_measures

    parsed = parse_measures(measures)
    judged = {
        q: {d: int(r) for d, r in rel.items()} for q, rel in qrels.items() if any(r > 0 for r in rel.values())
    }
    missing = [q for q in judged if q not in rankings]
    if missing:
        raise ValueError(f"rankings has no entry for {len(missing)} judged queries, e.g. {missing[:3]}")
    # Scores that encode the given order, so that ir_measures' own tie-break never applies.
    run = {q: {d: float(len(rankings[q]) - rank) for rank, d in enumerate(rankings[q])} for q in judged}
    values: dict[str, dict[str, float]] = {measure_key(m): dict.fromkeys(judged, 0.0) for m in parsed}
    keys = {m: measure_key(m) for m in parsed}
    for metric in ir_measures.iter_calc(parsed, judged, run):
        values[keys[metric.measure]][metric.query_id] = float(metric.value)
    return values


def paired_run_comparison(
    baseline: Run,
    candidate: Run,
    qrels: Mapping[str, Mapping[str, int]],
    *,
    measure: str = "nDCG@10",
    resamples: int = DEFAULT_RESAMPLES,
    seed: int = 0,
) -> dict[str, float]:
    """:func:`paired_comparison` of two runs (query id -> ranked (doc id, score)) on one measure of
    :func:`per_query_metrics` over the judged queries of ``qrels`` (e.g. an evaluation before and after
    training: ``SparseRetrievalEvaluator.evaluate(...)[0].run``)."""
    key = measure_key(parse_measures([measure])[0])
    scores = [
        per_query_metrics({q: [d for d, _ in hits] for q, hits in run.items()}, qrels, measures=[measure])[
            key
        ]
        for run in (baseline, candidate)
    ]
    return paired_comparison(scores[0], scores[1], resamples=resamples, seed=seed)
