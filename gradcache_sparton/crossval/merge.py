"""``gradcache-sparton crossval --merge A/crossval.json B/crossval.json ... --output_dir OUT``: the
``crossval.json`` of separate runs of one experiment (the seeds of one recipe run as separate jobs, one per
GPU; or the folds of one seed, ``--run_folds``, as jobs that each fit a time limit) combined into the result
one run with all their seeds and folds would have written: the same folds, references and recipe, each
query's recipe score averaged over the seeds before the paired interval.

The inputs must be one experiment: the same settings (except ``seeds``, ``output_dir``, ``write_runs``
and ``beir_path``: where the data lives changes no number, and the data itself is compared directly),
the same recipe flags, content of the recipe's ``--config`` file (each run records its sha256 and parsed
content; differing keys are named) and starting model, the same folds (each fold's held-out query ids, and the
counts of its training rows) and the same zero-shot and BM25 numbers per query (``run_folds`` may differ). A
recipe seed is merged where one input finished every fold of it, or where its inputs' finished folds together
cover every fold, each fold from one input (:func:`merge_seeds`); an unfinished one is skipped with a warning
and listed in the result's ``meta``. A seed finished in two inputs, or a fold of a seed in two inputs, is an
error (which run should count?).

Result files written before each fold recorded its ``query_ids`` are merged by rebuilding the folds
from ``beir_path`` exactly as the protocol deals them (the queries judged relevant at least once in the
split's qrels, :func:`~gradcache_sparton.crossval.protocol.make_folds` with the files' ``fold_seed``),
checked against each file's fold sizes and per-query numbers."""

from __future__ import annotations

import datetime
import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gradcache_sparton.crossval.experiment import (
    MERGED_SETTINGS,
    RUN_ONLY_FLAGS,
    TOLERANCE,
    experiment_differences,
    numbers_close,
)

# Private to crossval, kept as they are (also _summarise, _write below): a merge reads the judged queries and
# writes the results file exactly as one run does (protocol.py).
from gradcache_sparton.crossval.protocol import _judged_queries, make_folds
from gradcache_sparton.crossval.report import (
    PRIMARY,
    RECIPE,
    RESULTS_FILE,
    _summarise,
    _write,
    completed_folds,
    is_recipe_system,
)
from gradcache_sparton.data import load_beir

__all__ = ["folds_of", "merge_crossval", "merge_seeds", "read_results", "rebuilt_folds"]

logger = logging.getLogger(__name__)


def read_results(path: Path, *, mode: str = "--merge") -> dict[str, Any]:
    """The ``crossval.json`` at ``path``; ``ValueError`` (its message led by ``mode``, the flag that reads it)
    naming the file if it is missing, not JSON or not a crossval result."""
    if not path.is_file():
        raise ValueError(f"{mode}: {str(path)!r} does not exist (give crossval.json files)")
    try:
        results = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise ValueError(f"{mode}: {str(path)!r} is not JSON ({error})") from None
    if not isinstance(results, dict):
        raise ValueError(
            f"{mode}: {str(path)!r} is not a crossval.json: it holds {json.dumps(results)[:40]}, not a JSON object"
        )
    missing = [k for k in ("settings", "model", "folds", "systems") if k not in results]
    if missing:
        raise ValueError(f"{mode}: {str(path)!r} is not a crossval.json: no {missing}")
    return results


def _check_same_experiment(results: list[dict[str, Any]], paths: list[Path]) -> None:
    """``ValueError`` naming the first input that differs from the first input in a setting, the recipe (its
    flags, its config file's content) or the model."""
    for path, other in zip(paths[1:], results[1:], strict=True):
        differ = experiment_differences(results[0], other)
        if differ:
            shown = "; ".join(f"{k}: {v}" for k, v in differ.items())
            raise ValueError(
                f"--merge: {str(path)!r} is another experiment than {str(paths[0])!r}: settings {list(differ)} "
                f"differ ({shown}); only {list(MERGED_SETTINGS)} and the recipe flags {list(RUN_ONLY_FLAGS)} "
                "may"
            )


def rebuilt_folds(beir_path: str, settings: dict[str, Any]) -> list[list[str]]:
    """The folds the protocol deals from ``beir_path`` under ``settings`` (split, folds, fold_seed)."""
    beir = _judged_queries(load_beir(beir_path, split=settings["split"]))
    return make_folds(list(beir.qrels), folds=settings["folds"], seed=settings["fold_seed"])


def folds_of(
    results: dict[str, Any], path: Path, rebuilt: list[list[str]] | None, *, mode: str = "--merge"
) -> list[dict[str, Any]]:
    """The file's fold entries, each with its ``query_ids`` (rebuilt ones where the file has none, checked
    against its fold sizes; checked against the file's where both exist); every per-query number the file
    holds must be for exactly the folds' queries (``ValueError`` led by ``mode``, naming the file, if not)."""
    entries = [dict(entry) for entry in results["folds"]]
    if all("query_ids" in entry for entry in entries):
        if rebuilt is not None and [e["query_ids"] for e in entries] != rebuilt:
            raise ValueError(
                f"{mode}: the folds rebuilt from --beir_path differ from the query_ids of {str(path)!r}'s folds"
            )
    elif rebuilt is None:
        raise ValueError(
            f"{mode}: {str(path)!r} does not record its folds' query_ids (written before they were): pass "
            "--beir_path (the BEIR folder it ran on) to rebuild them"
        )
    else:
        sizes = [entry["queries"] for entry in entries]
        if sizes != [len(fold) for fold in rebuilt]:
            raise ValueError(
                f"{mode}: the folds rebuilt from --beir_path hold {[len(f) for f in rebuilt]} queries, "
                f"{str(path)!r}'s folds {sizes}: not the data it ran on"
            )
        for entry, fold in zip(entries, rebuilt, strict=True):
            entry["query_ids"] = fold
    queries = {q for entry in entries for q in entry["query_ids"]}
    for system, entry in results["systems"].items():
        for seed, run in entry["seeds"].items():
            finished = completed_folds(run, len(entries))
            scored = set(run["per_query"][PRIMARY])
            if (
                not set(finished) <= set(range(len(entries)))
                or not scored <= queries
                or any(q not in scored for k in finished for q in entries[k]["query_ids"])
            ):
                raise ValueError(
                    f"{mode}: {str(path)!r}: {system} (seed {seed}) does not score the queries of the folds it "
                    f"finished ({finished}), or scores queries outside its folds"
                )
    return entries


def _check_references(results: list[dict[str, Any]], paths: list[Path]) -> None:
    """``ValueError`` unless every input holds the same references with the same numbers (``TOLERANCE``)."""
    first = results[0]["systems"]
    for path, other in zip(paths[1:], results[1:], strict=True):
        systems = other["systems"]
        if set(first) != set(systems):
            raise ValueError(
                f"--merge: {str(path)!r} holds systems {sorted(systems)}, {str(paths[0])!r} {sorted(first)}"
            )
        for system in sorted(name for name in first if not is_recipe_system(name)):
            if not numbers_close(first[system]["seeds"], systems[system]["seeds"]):
                raise ValueError(
                    f"--merge: {system}'s per-query numbers differ between {str(paths[0])!r} and {str(path)!r} "
                    f"(beyond {TOLERANCE}): not the same data or evaluation"
                )


def _seed_parts(
    files: list[Path], results: list[dict[str, Any]], folds: int
) -> dict[str, list[tuple[Path, dict[str, Any], list[int]]]]:
    """Recipe seed -> its runs in the inputs: (file, trained system -> that seed's entry, the folds it
    finished); ``ValueError`` naming the file where a trained system (teacher, earlier round) did not finish
    the folds its recipe did."""
    parts: dict[str, list[tuple[Path, dict[str, Any], list[int]]]] = {}
    for path, r in zip(files, results, strict=True):
        trained = [name for name in r["systems"] if is_recipe_system(name)]
        for seed, run in r["systems"].get(RECIPE, {"seeds": {}})["seeds"].items():
            finished = sorted(completed_folds(run, folds))
            systems = {name: r["systems"][name]["seeds"].get(seed) for name in trained}
            for name, entry in systems.items():
                if entry is None or sorted(completed_folds(entry, folds)) != finished:
                    raise ValueError(
                        f"--merge: {str(path)!r}: {name} (seed {seed}) did not finish the folds its recipe did "
                        f"({finished})"
                    )
            parts.setdefault(seed, []).append((path, systems, finished))
    return parts


def _combined(parts: list[tuple[Path, dict[str, Any], list[int]]], folds: list[list[str]]) -> dict[str, Any]:
    """One seed's trained systems as one run of every fold would have recorded them, from ``parts`` (runs
    that each finished some folds, together each fold once): the per-query numbers fold by fold, the mean
    non-zeros weighted by each part's queries."""
    if len(parts) == 1:
        return parts[0][1]
    owner = {k: systems for _, systems, finished in parts for k in finished}
    sizes = [sum(len(folds[k]) for k in finished) for _, _, finished in parts]
    combined = {}
    for name in parts[0][1]:
        per_query: dict[str, dict[str, float]] = {}
        for k, fold in enumerate(folds):
            held = set(fold)
            for key, values in owner[k][name]["per_query"].items():
                per_query.setdefault(key, {}).update((q, v) for q, v in values.items() if q in held)
        entry: dict[str, Any] = {"per_query": per_query}
        for key in ("query_nonzeros", "doc_nonzeros"):
            if all(key in systems[name] for _, systems, _ in parts):
                weighted = sum(
                    n * systems[name][key] for n, (_, systems, _) in zip(sizes, parts, strict=True)
                )
                entry[key] = weighted / sum(sizes)
        combined[name] = {**entry, "folds_done": len(folds), "folds_finished": list(range(len(folds)))}
    return combined


def merge_seeds(
    files: list[Path], results: list[dict[str, Any]], folds: list[list[str]]
) -> tuple[dict[str, dict[str, Any]], list[dict[str, Any]]]:
    """The recipe seeds the inputs finish (seed -> trained system -> its entry, as one run of all the folds
    writes it) and, per input, what was taken from it (``merged_from``). A seed is finished by one input that
    ran every fold of it (another input's unfinished run of it is left out, with a warning), or by inputs whose
    finished folds together cover every fold; a seed finished whole in two inputs, or a fold of a seed in two
    inputs' runs, is a ``ValueError`` naming both; a seed whose folds stay uncovered is left out with a
    warning (listed in ``skipped_unfinished_seeds``)."""
    k = len(folds)
    seeds: dict[str, dict[str, Any]] = {}
    taken: dict[Path, dict[str, list[int]]] = {path: {} for path in files}  # file -> seed -> its folds used
    skipped: dict[Path, dict[str, int]] = {path: {} for path in files}  # file -> seed -> folds done, left out
    for seed, parts in _seed_parts(files, results, k).items():
        whole = [part for part in parts if len(part[2]) == k]
        if len(whole) > 1:
            raise ValueError(
                f"--merge: recipe seed {seed} is in both {str(whole[0][0])!r} and {str(whole[1][0])!r}: merge each "
                "seed once"
            )
        chosen = whole or parts
        owner: dict[int, Path] = {}
        for path, _, finished in chosen:
            for fold in finished:
                if fold in owner:
                    raise ValueError(
                        f"--merge: fold {fold} of recipe seed {seed} is in both {str(owner[fold])!r} and "
                        f"{str(path)!r}: merge each fold of a seed once"
                    )
                owner[fold] = path
        finished_whole = len(owner) == k
        for path, _, finished in parts:
            if finished_whole and any(part[0] is path for part in chosen):
                taken[path][seed] = finished
                continue
            skipped[path][seed] = len(finished)
            logger.warning(
                "crossval --merge: %s: recipe seed %s finished %d of %d folds (%s)%s: left out",
                path,
                seed,
                len(finished),
                k,
                finished,
                "" if finished_whole else f", all its runs together {sorted(owner)}",
            )
        if finished_whole:
            seeds[seed] = _combined(chosen, folds)
    merged_from = [
        {
            "file": str(path),
            "seeds": [int(seed) for seed in taken[path]],
            "seed_folds": taken[path],
            "skipped_unfinished_seeds": skipped[path],
            "beir_path": r["settings"].get("beir_path"),
            "output_dir": r["settings"].get("output_dir"),
            "recipe_flags": r["settings"].get("recipe_flags"),
            "run_folds": r["settings"].get("run_folds", list(range(k))),
            "meta": r.get("meta", {}),
        }
        for path, r in zip(files, results, strict=True)
    ]
    return seeds, merged_from


def merge_crossval(
    paths: Sequence[str | Path],
    *,
    output_dir: str | Path,
    beir_path: str | None = None,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Merge the ``crossval.json`` files ``paths`` (module docstring) and write ``crossval.json`` and
    ``crossval.md`` in ``output_dir`` (an existing ``crossval.json`` there needs ``overwrite``); returns
    what ``crossval.json`` holds. ``beir_path`` rebuilds the folds of files that do not record them (and
    checks those that do); the merged settings name it, else the first file's ``beir_path``."""
    if not paths:
        raise ValueError("--merge needs at least one crossval.json")
    out = Path(output_dir)
    if (out / RESULTS_FILE).exists() and not overwrite:
        raise ValueError(f"--output_dir {str(out)!r} holds a {RESULTS_FILE}: pass --overwrite to replace it")
    files = [Path(p) for p in paths]
    results = [read_results(path) for path in files]
    _check_same_experiment(results, files)
    rebuilt = rebuilt_folds(beir_path, results[0]["settings"]) if beir_path is not None else None
    folds = [folds_of(r, path, rebuilt) for r, path in zip(results, files, strict=True)]
    for path, entries in zip(files[1:], folds[1:], strict=True):
        if entries != folds[0]:
            differ = [k for k, (a, b) in enumerate(zip(folds[0], entries, strict=True)) if a != b]
            raise ValueError(
                f"--merge: folds {differ} of {str(path)!r} differ from {str(files[0])!r}'s (held-out query ids "
                "or training rows): not the same folds"
            )
    _check_references(results, files)

    seeds, merged_from = merge_seeds(files, results, [entry["query_ids"] for entry in folds[0]])
    if not seeds:
        raise ValueError(
            f"--merge: no recipe seed finished all {len(folds[0])} folds in {[str(f) for f in files]}"
        )

    first = results[0]
    metas = [r.get("meta", {}) for r in results]
    common = {k: v for k, v in metas[0].items() if all(m.get(k) == v for m in metas)}
    merged = {
        "meta": {
            **common,
            "merged_from": merged_from,
            "merge_date": datetime.datetime.now(datetime.timezone.utc).date().isoformat(),
        },
        "settings": {
            **first["settings"],
            "beir_path": beir_path if beir_path is not None else first["settings"]["beir_path"],
            "output_dir": str(out),
            "seeds": [int(s) for s in seeds],
            "run_folds": list(range(len(folds[0]))),
        },
        "model": first["model"],
        "folds": folds[0],
        "systems": {
            name: {"seeds": {seed: systems[name] for seed, systems in seeds.items()}}
            if is_recipe_system(name)
            else entry
            for name, entry in first["systems"].items()
        },
    }
    _summarise(merged, [entry["query_ids"] for entry in folds[0]])
    out.mkdir(parents=True, exist_ok=True)
    _write(merged, out)
    return merged
