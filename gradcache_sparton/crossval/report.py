"""The numbers of a cross-validation: per-system means over folds (and seeds), paired comparisons of the
per-query nDCG@10, and the markdown tables of ``crossval.md``."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from gradcache_sparton.evaluation.significance import paired_comparison, paired_statistics

__all__ = [
    "comparison_lines",
    "completed_folds",
    "format_report",
    "is_recipe_system",
    "paired_difference",
    "round_system",
    "system_scores",
    "table_lines",
]

PRIMARY = "ndcg_at_10"
RESULTS_FILE, REPORT_FILE = "crossval.json", "crossval.md"
ZERO_SHOT, BM25, RECIPE = "zero-shot", "bm25", "recipe"
TEACHER = "teacher"  # --teacher fold: the model the teacher recipe trains in each fold, per seed
ROUND_PREFIX = (
    "recipe-round"  # a run of R rounds: recipe-round1 .. recipe-round<R-1>, then the recipe (round R)
)


def round_system(round_: int) -> str:
    """The system name of round ``round_``'s models when a later round exists (the last round is ``recipe``)."""
    return f"{ROUND_PREFIX}{round_}"


def is_recipe_system(name: str) -> bool:
    """Whether ``name`` holds trained models, one entry per seed (the recipe, an earlier round of it, or the
    fold teacher), as opposed to a reference evaluated once."""
    return name in (RECIPE, TEACHER) or name.startswith(ROUND_PREFIX)


def completed_folds(run: Mapping[str, Any], folds: int) -> list[int]:
    """The indices of the folds, of ``folds``, that one seed of a system finished (``systems[name]["seeds"][s]``):
    its ``folds_finished``; in a file written before that was recorded (every run then dealt its folds in
    order), the first ``folds_done``; without either (a reference, evaluated once on every query), all."""
    if "folds_finished" in run:
        return list(run["folds_finished"])
    return list(range(run.get("folds_done", folds)))


def _mean(values: Any) -> float:
    values = list(values)
    return sum(values) / len(values)


def system_scores(
    entry: Mapping[str, Any], folds: list[list[str]]
) -> tuple[dict[str, Any], dict[str, list[float]], dict[str, dict[str, float]]] | None:
    """One system of a ``crossval.json`` (``results["systems"][name]``) over ``folds``: its table row (each
    metric's mean over folds of the mean over its seeds, ``<metric>_per_fold``, mean non-zeros), its nDCG@10
    per query (one value per seed) and per seed (seed -> query -> nDCG@10), each over the queries of ``folds``
    (all the folds, or those a run of some folds ran). A seed without a score for every such query (folds still
    missing) is left out; None when none has them all."""
    wanted = {q for fold in folds for q in fold}
    complete = {
        s: {
            **r,
            "per_query": {
                k: {q: v for q, v in values.items() if q in wanted} for k, values in r["per_query"].items()
            },
        }
        for s, r in entry["seeds"].items()
        if wanted <= set(r["per_query"][PRIMARY])
    }
    if not complete:
        return None
    row: dict[str, Any] = {"seeds": len(complete)}
    for key in next(iter(complete.values()))["per_query"]:
        fold_means = [
            _mean(_mean(r["per_query"][key][q] for q in fold) for r in complete.values()) for fold in folds
        ]
        row[key] = _mean(fold_means)
        row[f"{key}_per_fold"] = fold_means
    for key in ("query_nonzeros", "doc_nonzeros"):
        if all(key in r for r in complete.values()):
            row[key] = _mean(r[key] for r in complete.values())
    scores = {
        q: [r["per_query"][PRIMARY][q] for r in complete.values()]
        for q in next(iter(complete.values()))["per_query"][PRIMARY]
    }
    return row, scores, {s: r["per_query"][PRIMARY] for s, r in complete.items()}


def paired_difference(
    candidate: Mapping[str, list[float]],
    baseline: Mapping[str, list[float]],
    *,
    resamples: int,
    candidate_seeds: Mapping[str, Mapping[str, float]] | None = None,
    baseline_seeds: Mapping[str, Mapping[str, float]] | None = None,
) -> dict[str, Any]:
    """The paired comparison ``candidate - baseline`` of per-query nDCG@10 (query -> one value per seed, the
    seeds averaged per query first), and ``per_seed``: for each seed of ``candidate_seeds`` (else of
    ``baseline_seeds``), that seed's scores against the other side's same seed where it has one, else
    against the other side's mean over its seeds. No seeds given: no ``per_seed``."""
    stats: dict[str, Any] = paired_comparison(baseline, candidate, resamples=resamples)
    seeds = candidate_seeds or baseline_seeds
    if seeds:
        means = [{q: _mean(v) for q, v in side.items()} for side in (candidate, baseline)]
        stats["per_seed"] = {
            seed: paired_statistics(
                torch.tensor(
                    [
                        (candidate_seeds or {}).get(seed, means[0])[q]
                        - (baseline_seeds or {}).get(seed, means[1])[q]
                        for q in sorted(means[1])
                    ],
                    dtype=torch.float64,
                ),
                resamples=resamples,
            )
            for seed in seeds
        }
    return stats


def _summarise(results: dict[str, Any], folds: list[list[str]]) -> None:
    """Fill ``results["table"]`` (per system: means over folds, and seeds) and ``results["comparisons"]``
    from the per-query numbers; a recipe seed with folds still missing is left out."""
    table = {}
    scores: dict[str, dict[str, list[float]]] = {}  # system -> query -> nDCG@10 per seed
    per_seed: dict[str, dict[str, dict[str, float]]] = {}  # recipe system -> seed -> query -> nDCG@10
    for system, entry in results["systems"].items():
        summary = system_scores(entry, folds)
        if summary is None:
            continue
        table[system], scores[system], seeds = summary
        if is_recipe_system(system):
            per_seed[system] = seeds
    results["table"] = table
    comparisons = {}
    rounds = [name for name in results["systems"] if name.startswith(ROUND_PREFIX)]
    pairs = [
        (RECIPE, ZERO_SHOT),
        (RECIPE, BM25),
        (ZERO_SHOT, BM25),
        *((RECIPE, name) for name in rounds),
        (RECIPE, TEACHER),
        (TEACHER, BM25),
        (TEACHER, ZERO_SHOT),
    ]
    for candidate, baseline in pairs:
        if candidate in scores and baseline in scores:
            # each trained seed against the reference, or against the same seed's earlier round or teacher
            trained = candidate in per_seed
            comparisons[f"{candidate} - {baseline}"] = paired_difference(
                scores[candidate],
                scores[baseline],
                resamples=results["settings"]["resamples"],
                candidate_seeds=per_seed[candidate] if trained else None,
                baseline_seeds=per_seed.get(baseline) if trained else None,
            )
    results["comparisons"] = comparisons


def _write(results: dict[str, Any], out: Path) -> None:
    (out / RESULTS_FILE).write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    (out / REPORT_FILE).write_text(format_report(results), encoding="utf-8")


def format_report(results: Mapping[str, Any]) -> str:
    """The markdown tables of a ``crossval.json``: systems (means over folds) and paired comparisons."""
    settings = results["settings"]
    queries = sum(f["queries"] for f in results["folds"])
    lines = [
        f"Cross-validation: {settings['folds']} folds of {queries} queries of {settings['beir_path']} "
        f"(split {settings['split']}, fold seed {settings['fold_seed']}), each fold ranked against the full corpus "
        f"({settings['query_max_length']}/{settings['document_max_length']} tokens); recipe seeds {settings['seeds']}; "
        f"recipe: `{' '.join(settings['recipe_flags']) or '(dataclass defaults)'}`, "
        f"self-supervised pairs {settings['self_supervised_pairs']}, BM25 negatives {settings['bm25_negatives']}"
        + _rounds_line(settings)
        + _teacher_line(settings)
        + _run_folds_line(settings)
        + ".",
        "",
    ]
    lines += [*table_lines(results.get("table", {})), "", *comparison_lines(results.get("comparisons", {}))]
    return "\n".join(lines) + "\n"


def table_lines(table: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """The markdown table of systems: system -> row as :func:`system_scores` gives it."""
    lines = [
        "| system | seeds | nDCG@10 | MRR@10 | R@100 | query nnz | doc nnz | nDCG@10 per fold |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for system, row in table.items():
        nnz = [f"{row[k]:.1f}" if k in row else "-" for k in ("query_nonzeros", "doc_nonzeros")]
        folds = " / ".join(f"{v:.3f}" for v in row[f"{PRIMARY}_per_fold"])
        lines.append(
            f"| {system} | {row['seeds']} | {row['ndcg_at_10']:.4f} | {row['mrr_at_10']:.4f} | "
            f"{row['recall_at_100']:.4f} | {nnz[0]} | {nnz[1]} | {folds} |"
        )
    return lines


def comparison_lines(comparisons: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """The markdown table of paired nDCG@10 differences: name -> :func:`paired_difference`'s result."""
    lines = [
        "| nDCG@10 difference | mean | 95% interval | p | queries up / down / same | per seed (mean [interval]) |",
        "|---|---|---|---|---|---|",
    ]
    for name, c in comparisons.items():
        seeds = "; ".join(
            f"{s}: {v['mean_difference']:+.4f} [{v['ci95_low']:+.4f}, {v['ci95_high']:+.4f}]"
            for s, v in c.get("per_seed", {}).items()
        )
        lines.append(
            f"| {name} | {c['mean_difference']:+.4f} | {c['ci95_low']:+.4f} to {c['ci95_high']:+.4f} | "
            f"{c['p_value']:.4f} | {c['queries_up']} / {c['queries_down']} / {c['queries_same']} | {seeds or '-'} |"
        )
    return lines


def _rounds_line(settings: Mapping[str, Any]) -> str:
    """The rounds part of the report's first line: nothing for one round (a file written before rounds
    existed ran one)."""
    rounds = settings.get("rounds", 1)
    if rounds == 1:
        return ""
    return (
        f"; {rounds} rounds (round r > 1: {settings['model_negatives']} negatives a pair mined by the fold's "
        f"round r-1 model, trained from {'that model' if settings['round_start'] == 'previous' else 'the start'}"
        f"; the recipe row is round {rounds}, recipe-round<r> the earlier rounds)"
    )


def _run_folds_line(settings: Mapping[str, Any]) -> str:
    """A run of some folds (``--run_folds``): which, and that the tables cover those folds' queries only."""
    run_folds = settings.get("run_folds") or list(range(settings["folds"]))
    if len(run_folds) == settings["folds"]:
        return ""
    return (
        f"; this run trained folds {run_folds} of {settings['folds']} only (--run_folds): the tables cover their "
        "queries; `crossval --merge` combines it with runs of the other folds"
    )


def _teacher_line(settings: Mapping[str, Any]) -> str:
    """The fold teacher's part of the report's first line: nothing without one."""
    if settings.get("teacher") != "fold":
        return ""
    return (
        f"; teacher: a model trained in each fold (and seed) by `{settings['teacher_recipe']}` on the fold's rows, "
        f"its scores mixed with BM25's (BM25's share {settings['teacher_weight']}, "
        f"{settings.get('teacher_normalisation', 'zscore')} per query); the teacher row is that model"
    )
