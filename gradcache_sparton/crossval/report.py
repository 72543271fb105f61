"""The numbers of a cross-validation: per-system means over folds (and seeds), paired comparisons of the
per-query nDCG@10, and the markdown tables of ``crossval.md``."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from gradcache_sparton.evaluation.significance import paired_comparison, paired_statistics

__all__ = ["format_report", "is_recipe_system", "round_system"]

PRIMARY = "ndcg_at_10"
RESULTS_FILE, REPORT_FILE = "crossval.json", "crossval.md"
ZERO_SHOT, BM25, RECIPE = "zero-shot", "bm25", "recipe"
ROUND_PREFIX = (
    "recipe-round"  # a run of R rounds: recipe-round1 .. recipe-round<R-1>, then the recipe (round R)
)


def round_system(round_: int) -> str:
    """The system name of round ``round_``'s models when a later round exists (the last round is ``recipe``)."""
    return f"{ROUND_PREFIX}{round_}"


def is_recipe_system(name: str) -> bool:
    """Whether ``name`` holds trained models, one entry per seed (the recipe or an earlier round of it), as
    opposed to a reference evaluated once."""
    return name == RECIPE or name.startswith(ROUND_PREFIX)


def _mean(values: Any) -> float:
    values = list(values)
    return sum(values) / len(values)


def _summarise(results: dict[str, Any], folds: list[list[str]]) -> None:
    """Fill ``results["table"]`` (per system: means over folds, and seeds) and ``results["comparisons"]``
    from the per-query numbers; a recipe seed with folds still missing is left out."""
    table = {}
    scores: dict[str, dict[str, list[float]]] = {}  # system -> query -> nDCG@10 per seed
    per_seed: dict[str, dict[str, dict[str, float]]] = {}  # recipe system -> seed -> query -> nDCG@10
    for system, entry in results["systems"].items():
        complete = {s: r for s, r in entry["seeds"].items() if r.get("folds_done", len(folds)) == len(folds)}
        if not complete:
            continue
        row: dict[str, Any] = {"seeds": len(complete)}
        for key in next(iter(complete.values()))["per_query"]:
            fold_means = [
                _mean(_mean(r["per_query"][key][q] for q in fold) for r in complete.values())
                for fold in folds
            ]
            row[key] = _mean(fold_means)
            row[f"{key}_per_fold"] = fold_means
        for key in ("query_nonzeros", "doc_nonzeros"):
            if all(key in r for r in complete.values()):
                row[key] = _mean(r[key] for r in complete.values())
        table[system] = row
        scores[system] = {
            q: [r["per_query"][PRIMARY][q] for r in complete.values()]
            for q in next(iter(complete.values()))["per_query"][PRIMARY]
        }
        if is_recipe_system(system):
            per_seed[system] = {s: r["per_query"][PRIMARY] for s, r in complete.items()}
    results["table"] = table
    resamples = results["settings"]["resamples"]
    comparisons = {}
    rounds = [name for name in results["systems"] if name.startswith(ROUND_PREFIX)]
    pairs = [(RECIPE, ZERO_SHOT), (RECIPE, BM25), (ZERO_SHOT, BM25), *((RECIPE, name) for name in rounds)]
    for candidate, baseline in pairs:
        if candidate in scores and baseline in scores:
            stats = paired_comparison(scores[baseline], scores[candidate], resamples=resamples)
            if candidate == RECIPE:  # each seed against the reference, or against its own earlier round
                mean = {q: _mean(v) for q, v in scores[baseline].items()}
                stats["per_seed"] = {
                    seed: paired_statistics(
                        torch.tensor(
                            [values[q] - per_seed.get(baseline, {}).get(seed, mean)[q] for q in sorted(mean)],
                            dtype=torch.float64,
                        ),
                        resamples=resamples,
                    )
                    for seed, values in per_seed[RECIPE].items()
                }
            comparisons[f"{candidate} - {baseline}"] = stats
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
        + ".",
        "",
        "| system | seeds | nDCG@10 | MRR@10 | R@100 | query nnz | doc nnz | nDCG@10 per fold |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for system, row in results.get("table", {}).items():
        nnz = [f"{row[k]:.1f}" if k in row else "-" for k in ("query_nonzeros", "doc_nonzeros")]
        folds = " / ".join(f"{v:.3f}" for v in row[f"{PRIMARY}_per_fold"])
        lines.append(
            f"| {system} | {row['seeds']} | {row['ndcg_at_10']:.4f} | {row['mrr_at_10']:.4f} | "
            f"{row['recall_at_100']:.4f} | {nnz[0]} | {nnz[1]} | {folds} |"
        )
    lines += [
        "",
        "| nDCG@10 difference | mean | 95% interval | p | queries up / down / same | per seed (mean [interval]) |",
        "|---|---|---|---|---|---|",
    ]
    for name, c in results.get("comparisons", {}).items():
        seeds = "; ".join(
            f"{s}: {v['mean_difference']:+.4f} [{v['ci95_low']:+.4f}, {v['ci95_high']:+.4f}]"
            for s, v in c.get("per_seed", {}).items()
        )
        lines.append(
            f"| {name} | {c['mean_difference']:+.4f} | {c['ci95_low']:+.4f} to {c['ci95_high']:+.4f} | "
            f"{c['p_value']:.4f} | {c['queries_up']} / {c['queries_down']} / {c['queries_same']} | {seeds or '-'} |"
        )
    return "\n".join(lines) + "\n"


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
