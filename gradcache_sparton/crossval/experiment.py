"""What makes two cross-validation results one experiment: the same settings (besides those that change no
number), the same recipe (its flags and the content of any ``--config`` file they pass) and the same starting
model. Both a run into a folder that holds a finished run's ``crossval.json`` (:mod:`.protocol`, which adds
its seeds to that result) and ``crossval --merge`` (:mod:`.merge`) check it."""

from __future__ import annotations

import dataclasses
import hashlib
import math
import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gradcache_sparton.crossval.settings import CrossvalSettings

__all__ = [
    "MERGED_SETTINGS",
    "RUN_ONLY_FLAGS",
    "TOLERANCE",
    "experiment_differences",
    "numbers_close",
    "recipe_config",
]

# Settings that may differ between the runs of one experiment: the seeds and the folds run (``run_folds``) are
# what is merged, the output folder and the TREC runs change no number, and the data behind ``beir_path`` is
# compared directly (folds, references).
MERGED_SETTINGS = ("seeds", "run_folds", "output_dir", "write_runs", "beir_path")
# Recipe flags that change how a run goes, not what it trains: the collator is deterministic and the
# sampler runs in the main process, so data-loading workers give the same batches in the same order.
RUN_ONLY_FLAGS = (
    "dataloader_num_workers",
    "dataloader_persistent_workers",
    "dataloader_prefetch_factor",
    "disable_tqdm",
)
# A setting a file does not record (written before the setting existed) ran at its default: every setting
# is added with the default that keeps the earlier behaviour (e.g. rounds = 1; no config file content).
DEFAULTS = {
    **{
        f.name: f.default
        for f in dataclasses.fields(CrossvalSettings)
        if f.default is not dataclasses.MISSING
    },
    "recipe_config": None,
    "teacher_recipe_config": None,
}
# Two runs compute a reference's per-query metrics from the same ranking by the same arithmetic, so they
# agree to a few ulps (< 1e-15 for numbers <= 1, ~1e-13 for mean non-zeros in the hundreds); the smallest
# real change of a query's nDCG@10 (one document moved by one rank) is above 1e-3.
TOLERANCE = 1e-9


def recipe_config(argv: Sequence[str]) -> dict[str, Any] | None:
    """The ``--config`` file of ``train`` flags as a result records it: its path, the sha256 of its bytes and
    its parsed content (``values``); None without ``--config``. ``ValueError`` naming the file if it is
    missing or not a YAML/JSON mapping."""
    from gradcache_sparton.arguments import load_config_file
    from gradcache_sparton.resources import default_train_config_path

    flags = list(argv)
    given = [flags[i + 1] for i, flag in enumerate(flags[:-1]) if flag == "--config"]
    given += [flag.split("=", 1)[1] for flag in flags if flag.startswith("--config=")]
    if not given:
        return None
    path = default_train_config_path() if given[-1] == "default" else Path(given[-1])
    values = load_config_file(path)
    return {"file": given[-1], "sha256": hashlib.sha256(path.read_bytes()).hexdigest(), "values": values}


def experiment_differences(first: dict[str, Any], other: dict[str, Any]) -> dict[str, str]:
    """What differs between two ``crossval.json`` results' experiments: setting name -> ``"a vs b"`` (a config
    file's differing keys named), besides :data:`MERGED_SETTINGS` and the recipe flags :data:`RUN_ONLY_FLAGS`;
    empty when they are one experiment."""
    keys = sorted((set(first["settings"]) | set(other["settings"]) | set(DEFAULTS)) - set(MERGED_SETTINGS))
    differ = {
        k: _config_difference(_setting(first, k), _setting(other, k))
        if k in ("recipe_config", "teacher_recipe_config")
        else f"{_setting(first, k)!r} vs {_setting(other, k)!r}"
        for k in keys
        if _comparable(_setting(first, k)) != _comparable(_setting(other, k))
    }
    if first["model"] != other["model"]:
        differ["model"] = f"{first['model']!r} vs {other['model']!r}"
    return differ


def _setting(results: dict[str, Any], key: str) -> Any:
    if key == "recipe_flags":
        return _training_flags(results["settings"]["recipe_flags"])
    if key == "teacher_recipe" and results["settings"].get(key):  # its flags, as the recipe's
        return _training_flags(shlex.split(results["settings"][key]))
    return results["settings"].get(key, DEFAULTS.get(key, "(absent)"))


def _comparable(value: Any) -> Any:
    """A config record compares by its content (``values``): the file's path, or a comment in it, changes
    no number."""
    if isinstance(value, dict) and "values" in value and "sha256" in value:
        return value["values"]
    return value


def _config_difference(a: dict[str, Any] | None, b: dict[str, Any] | None) -> str:
    if a is None or b is None:
        shown = [f"{c['file']!r} (sha256 {c['sha256'][:12]})" if c else "no --config content" for c in (a, b)]
        return f"{shown[0]} vs {shown[1]}"
    keys = sorted(k for k in set(a["values"]) | set(b["values"]) if a["values"].get(k) != b["values"].get(k))
    values = ", ".join(
        f"{k}: {a['values'].get(k, '(absent)')!r} vs {b['values'].get(k, '(absent)')!r}" for k in keys
    )
    return (
        f"--config {a['file']!r} (sha256 {a['sha256'][:12]}) vs {b['file']!r} (sha256 "
        f"{b['sha256'][:12]}) differ in {keys} ({values})"
    )


def _training_flags(flags: list[str]) -> list[str]:
    """``flags`` without the ``RUN_ONLY_FLAGS`` (``--name value`` or ``--name=value``) and their values."""
    kept: list[str] = []
    skip_value = False
    for flag in flags:
        if skip_value:
            skip_value = False
            if not flag.startswith("--"):
                continue
        name, has_value, _ = flag.removeprefix("--").partition("=")
        if flag.startswith("--") and name in RUN_ONLY_FLAGS:
            skip_value = not has_value
            continue
        kept.append(flag)
    return kept


def numbers_close(a: Any, b: Any) -> bool:
    """Same structure, numbers within ``TOLERANCE``."""
    if isinstance(a, dict) and isinstance(b, dict):
        return set(a) == set(b) and all(numbers_close(a[k], b[k]) for k in a)
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(a, b, rel_tol=0.0, abs_tol=TOLERANCE)
    return a == b
