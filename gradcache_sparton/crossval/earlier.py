"""A run into a folder that holds an earlier run's ``crossval.json`` (:mod:`.protocol`): the earlier result is
read and checked to be the same experiment (:mod:`.experiment`) on the same folds and training rows, the seeds it
finished are kept, and a seed whose models a stopped run left there is refused, all before any file is
written."""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gradcache_sparton.crossval.experiment import (
    MERGED_SETTINGS,
    TOLERANCE,
    experiment_differences,
    numbers_close,
)
from gradcache_sparton.crossval.report import RECIPE, RESULTS_FILE, completed_folds, is_recipe_system

__all__ = ["add_to_earlier", "check_same_rows", "earlier_run", "seeds_to_train"]

logger = logging.getLogger(__name__)


def earlier_run(out: Path, results: dict[str, Any], folds: list[list[str]]) -> dict[str, Any] | None:
    """The ``crossval.json`` a run left in ``out`` (None if there is none), checked to be the same
    experiment as ``results`` (settings, recipe and its config's content, model, folds): ``ValueError``
    naming what differs otherwise."""
    path = out / RESULTS_FILE
    if not path.is_file():
        return None
    try:
        earlier = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise ValueError(f"output_dir {str(out)!r}: {str(path)!r} is not JSON ({error})") from None
    differ = experiment_differences(earlier, results)
    if differ:
        shown = "; ".join(f"{k}: {v}" for k, v in differ.items())
        raise ValueError(
            f"output_dir {str(out)!r} holds the {RESULTS_FILE} of another experiment: settings {list(differ)} "
            f"differ ({shown}). A run into a finished run's folder adds seeds to it, so only "
            f"{list(MERGED_SETTINGS)} may differ: choose another output_dir"
        )
    recorded = [entry.get("query_ids", fold) for entry, fold in zip(earlier["folds"], folds, strict=False)]
    sizes = [entry["queries"] for entry in earlier["folds"]]
    if recorded != folds or sizes != [len(fold) for fold in folds]:  # files without query ids: their sizes
        raise ValueError(
            f"output_dir {str(out)!r} holds a {RESULTS_FILE} whose folds' query ids differ from the folds of "
            f"{results['settings']['beir_path']!r}: not the same data; choose another output_dir"
        )
    return earlier


def check_same_rows(earlier: dict[str, Any], fold_info: list[dict[str, Any]], out: Path) -> None:
    """``ValueError`` unless the earlier run's folds counted the training rows this run's do (``fold_info``)."""
    differ = [k for k, (f, e) in enumerate(zip(fold_info, earlier["folds"], strict=True)) if {**f, **e} != f]
    if differ:
        shown = [f"fold {k}: {_counts(earlier['folds'][k])} vs {_counts(fold_info[k])}" for k in differ]
        raise ValueError(
            f"output_dir {str(out)!r} holds a {RESULTS_FILE} whose folds {differ} have other training rows "
            f"than this run's ({'; '.join(shown)}): not the same data; choose another output_dir"
        )


def _counts(fold: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in fold.items() if k not in ("fold", "query_ids", "train_file")}


def seeds_to_train(out: Path, seeds: Sequence[int], earlier: dict[str, Any] | None) -> list[int]:
    """``seeds`` less those the earlier run finished (kept as they are); ``ValueError`` if the folder already
    holds models of a seed to train (an unfinished earlier run: its results are not in ``crossval.json``)."""
    folds = len(earlier["folds"]) if earlier is not None else 0
    finished = {
        int(seed)
        for seed, run in (earlier or {"systems": {}})["systems"].get(RECIPE, {"seeds": {}})["seeds"].items()
        if len(completed_folds(run, folds)) == folds
    }
    kept = [seed for seed in seeds if seed in finished]
    if kept:
        logger.info(
            "crossval: seeds %s finished in %s already: kept, not trained again", kept, out / RESULTS_FILE
        )
    for seed in seeds:
        folder = out / f"seed{seed}"
        if seed not in finished and folder.is_dir() and any(folder.iterdir()):
            raise ValueError(
                f"output_dir {str(out)!r} already holds models of seed {seed} ({str(folder)!r}) from a run that did "
                f"not finish it: delete {str(folder)!r} to train seed {seed} again, or train the folds it lacks "
                "into another output_dir (--run_folds) and combine the two crossval.json with --merge"
            )
    return [seed for seed in seeds if seed not in finished]


def add_to_earlier(results: dict[str, Any], earlier: dict[str, Any], out: Path) -> None:
    """Carry the earlier run's trained systems (every seed) into ``results``, after checking that the
    references it holds have this run's per-query numbers (``TOLERANCE``); the seeds are both runs'."""
    for system, entry in earlier["systems"].items():
        if is_recipe_system(system):
            results["systems"][system]["seeds"].update(entry["seeds"])
        elif not numbers_close(entry["seeds"], results["systems"][system]["seeds"]):
            raise ValueError(
                f"output_dir {str(out)!r}: {system}'s per-query numbers in its {RESULTS_FILE} differ from this run's "
                f"(beyond {TOLERANCE}): not the same data or evaluation; choose another output_dir"
            )
    given = results["settings"]["seeds"]
    results["settings"]["seeds"] = [
        *earlier["settings"]["seeds"],
        *(s for s in given if s not in earlier["settings"]["seeds"]),
    ]
    results["meta"]["earlier_run"] = {"seeds": earlier["settings"]["seeds"], "meta": earlier.get("meta", {})}
