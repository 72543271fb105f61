"""``gradcache-sparton crossval --compare A/crossval.json B/crossval.json [--names A B] --output_dir OUT``: two
recipes' cross-validations (say an inference-free model and a siamese one) compared claim by claim.

The two results must hold the same claims dealt into the same folds: the same ``split`` and ``fold_seed``
and, fold by fold, the same held-out query ids (each file's own, or rebuilt from ``beir_path`` for files
written before they were recorded, as ``--merge`` rebuilds them); where both evaluated BM25, the same BM25
number for every claim (within :data:`~.experiment.TOLERANCE`: otherwise not the same data). Everything else
may differ, as it is what is compared: starting model, recipe, seeds, evaluation lengths (the report shows
each file's).

Systems (the table): each file's recipe (each claim's score averaged over its seeds first, exactly as
``crossval`` does; a seed with folds missing left out) and zero-shot, over the claims of the folds both recipes
finished (:func:`folds_compared`: all of them unless a file's recipe has no seed that finished every fold),
named ``<name>:recipe`` and ``<name>:zero-shot``, and ``bm25`` once. Paired nDCG@10 differences over all held-out claims (mean, 95%
bootstrap interval, randomization p-value: :func:`~.report.paired_difference` with the larger of the two
files' ``resamples``): A:recipe - B:recipe, A:recipe - B:zero-shot, A:zero-shot - B:recipe, A:zero-shot -
B:zero-shot (left out when the two zero-shots score every claim the same) and each recipe - bm25; per seed
where one side is a recipe (both recipes: only when they ran the same seeds, seed paired with seed).

Output in ``output_dir``: ``compare.json`` (the files, the claims, the table, the comparisons) and
``compare.md`` (the tables); an existing ``compare.json`` needs ``overwrite``."""

from __future__ import annotations

import datetime
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gradcache_sparton.crossval.experiment import TOLERANCE, numbers_close
from gradcache_sparton.crossval.merge import folds_of, read_results, rebuilt_folds
from gradcache_sparton.crossval.report import (
    BM25,
    RECIPE,
    ZERO_SHOT,
    comparison_lines,
    completed_folds,
    paired_difference,
    system_scores,
    table_lines,
)

__all__ = ["COMPARE_FILE", "COMPARE_REPORT", "compare_crossval", "folds_compared", "format_comparison"]

COMPARE_FILE, COMPARE_REPORT = "compare.json", "compare.md"
MODE = "--compare"
# What makes two results score the same claims (besides each fold's query ids).
CLAIM_SETTINGS = ("split", "fold_seed", "folds")


def _check_same_claims(
    results: list[dict[str, Any]], files: list[Path], beir_path: str | None
) -> list[list[str]]:
    """The folds' query ids both results hold; ``ValueError`` naming the second file and what differs."""
    first, other = (r["settings"] for r in results)
    differ = {
        k: f"{first.get(k)!r} vs {other.get(k)!r}" for k in CLAIM_SETTINGS if first.get(k) != other.get(k)
    }
    if differ:
        shown = "; ".join(f"{k}: {v}" for k, v in differ.items())
        raise ValueError(
            f"{MODE}: {str(files[1])!r} holds other claims than {str(files[0])!r}: settings {list(differ)} "
            f"differ ({shown})"
        )
    rebuilt = rebuilt_folds(beir_path, first) if beir_path is not None else None
    folds = [
        [entry["query_ids"] for entry in folds_of(r, path, rebuilt, mode=MODE)]
        for r, path in zip(results, files, strict=True)
    ]
    differ_folds = [k for k, (a, b) in enumerate(zip(*folds, strict=True)) if a != b]
    if differ_folds:
        raise ValueError(
            f"{MODE}: folds {differ_folds} of {str(files[1])!r} hold other held-out query ids than "
            f"{str(files[0])!r}'s: not the same claims in the same folds"
        )
    bm25 = [r["systems"].get(BM25) for r in results]
    if all(bm25) and not numbers_close(*(entry["seeds"] for entry in bm25)):
        raise ValueError(
            f"{MODE}: bm25's per-claim numbers differ between {str(files[0])!r} and {str(files[1])!r} (beyond "
            f"{TOLERANCE}): not the same data"
        )
    return folds[0]


def folds_compared(results: list[dict[str, Any]], files: list[Path], folds: int) -> list[int]:
    """The folds both recipes finished: a file's recipe finished every fold when one of its seeds did (its
    unfinished seeds are then left out), else the folds all its seeds finished (a stopped run, or one of
    --run_folds); ``ValueError`` when no fold is left."""
    compared = set(range(folds))
    for r in results:
        runs = r["systems"].get(RECIPE, {"seeds": {}})["seeds"].values()
        finished = [set(completed_folds(run, folds)) for run in runs]
        if finished and not any(len(done) == folds for done in finished):
            compared &= set.intersection(*finished)
    if not compared:
        raise ValueError(
            f"{MODE}: no fold is finished by every recipe seed of both {str(files[0])!r} and {str(files[1])!r}"
        )
    return sorted(compared)


def compare_crossval(
    paths: Sequence[str | Path],
    *,
    output_dir: str | Path,
    names: Sequence[str] = ("A", "B"),
    beir_path: str | None = None,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Compare the two ``crossval.json`` files ``paths`` (module docstring), named ``names`` in the tables, and
    write ``compare.json`` and ``compare.md`` in ``output_dir``; returns what ``compare.json`` holds.
    ``beir_path`` rebuilds the folds of files that do not record them (and checks those that do)."""
    if len(paths) != 2:
        raise ValueError(f"{MODE} takes two crossval.json files, got {len(paths)}")
    if len(names) != 2 or len(set(names)) != 2 or not all(names):
        raise ValueError(f"--names takes two distinct names, one per file, got {list(names)}")
    out = Path(output_dir)
    if (out / COMPARE_FILE).exists() and not overwrite:
        raise ValueError(f"--output_dir {str(out)!r} holds a {COMPARE_FILE}: pass --overwrite to replace it")
    files = [Path(p) for p in paths]
    results = [read_results(path, mode=MODE) for path in files]
    all_folds = _check_same_claims(results, files, beir_path)
    compared = folds_compared(results, files, len(all_folds))
    folds = [all_folds[k] for k in compared]

    table: dict[str, Any] = {}
    scores: dict[str, dict[str, list[float]]] = {}  # system -> claim -> nDCG@10 per seed
    seeds: dict[str, dict[str, dict[str, float]]] = {}  # recipe system -> seed -> claim -> nDCG@10
    for name, r in zip(names, results, strict=True):
        for system in (RECIPE, ZERO_SHOT):
            summary = system_scores(r["systems"][system], folds) if system in r["systems"] else None
            if summary is not None:
                key = f"{name}:{system}"
                table[key], scores[key], per_seed = summary
                if system == RECIPE:
                    seeds[key] = per_seed
    bm25 = next((r["systems"][BM25] for r in results if BM25 in r["systems"]), None)
    summary = system_scores(bm25, folds) if bm25 is not None else None
    if summary is not None:
        table[BM25], scores[BM25], _ = summary

    a, b = names
    pairs = [
        (f"{a}:{RECIPE}", f"{b}:{RECIPE}"),
        (f"{a}:{RECIPE}", f"{b}:{ZERO_SHOT}"),
        (f"{a}:{ZERO_SHOT}", f"{b}:{RECIPE}"),
        (f"{a}:{ZERO_SHOT}", f"{b}:{ZERO_SHOT}"),
        (f"{a}:{RECIPE}", BM25),
        (f"{b}:{RECIPE}", BM25),
    ]
    resamples = max(r["settings"]["resamples"] for r in results)
    comparisons = {}
    for candidate, baseline in pairs:
        if candidate not in scores or baseline not in scores:
            continue
        zero_shots = candidate.endswith(f":{ZERO_SHOT}") and baseline.endswith(f":{ZERO_SHOT}")
        if zero_shots and numbers_close(scores[candidate], scores[baseline]):
            continue  # one starting model evaluated twice: nothing to compare
        candidate_seeds, baseline_seeds = seeds.get(candidate), seeds.get(baseline)
        if candidate_seeds and baseline_seeds and set(candidate_seeds) != set(baseline_seeds):
            candidate_seeds = baseline_seeds = None  # seed with seed only where both ran the same seeds
        comparisons[f"{candidate} - {baseline}"] = paired_difference(
            scores[candidate],
            scores[baseline],
            resamples=resamples,
            candidate_seeds=candidate_seeds,
            baseline_seeds=baseline_seeds,
        )
    if not comparisons:
        raise ValueError(f"{MODE}: {[str(f) for f in files]} hold no two systems to compare")

    from gradcache_sparton.version import __version__

    comparison = {
        "meta": {
            "gradcache_sparton": __version__,
            "date": datetime.datetime.now(datetime.timezone.utc).date().isoformat(),
        },
        "files": {
            name: {
                "file": str(path),
                "model": r["model"],
                "settings": r["settings"],
                "seeds": [int(s) for s in seeds.get(f"{name}:{RECIPE}", {})],
            }
            for name, path, r in zip(names, files, results, strict=True)
        },
        "claims": {
            "split": results[0]["settings"]["split"],
            "fold_seed": results[0]["settings"]["fold_seed"],
            "folds": all_folds,
            "folds_compared": compared,
        },
        "resamples": resamples,
        "table": table,
        "comparisons": comparisons,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / COMPARE_FILE).write_text(json.dumps(comparison, indent=1) + "\n", encoding="utf-8")
    (out / COMPARE_REPORT).write_text(format_comparison(comparison), encoding="utf-8")
    return comparison


def format_comparison(comparison: dict[str, Any]) -> str:
    """The markdown of a ``compare.json``: the two files, the systems and the paired differences."""
    claims = comparison["claims"]
    compared = claims.get("folds_compared", list(range(len(claims["folds"]))))
    only = (
        ""
        if len(compared) == len(claims["folds"])
        else f"; only the claims of folds {compared}, the folds both recipes finished"
    )
    lines = [
        f"Two cross-validations on the same {sum(len(claims['folds'][k]) for k in compared)} claims "
        f"({len(claims['folds'])} folds of split {claims['split']}, fold seed {claims['fold_seed']}{only}), each "
        f"claim's nDCG@10 paired (recipe seeds averaged per claim first; {comparison['resamples']} draws):",
        "",
    ]
    for name, entry in comparison["files"].items():
        settings = entry["settings"]
        lines.append(
            f"- {name}: `{entry['file']}`: model {entry['model']}, recipe seeds {entry['seeds']}, "
            f"{settings['query_max_length']}/{settings['document_max_length']} tokens, recipe "
            f"`{' '.join(settings['recipe_flags']) or '(dataclass defaults)'}`"
        )
    lines += ["", *table_lines(comparison["table"]), "", *comparison_lines(comparison["comparisons"])]
    return "\n".join(lines) + "\n"
