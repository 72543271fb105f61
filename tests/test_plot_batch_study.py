"""scripts/plot_batch_study.py: the points it plots are the crossval reports' own numbers."""

from __future__ import annotations

import json

import pytest
from script_helpers import import_script

plot = import_script("scripts", "plot_batch_study")


def _report(path, mean: float, low: float, high: float, seeds: int, *, finished: bool = True) -> str:
    comparisons = {"zero-shot - bm25": {"mean_difference": -0.05}}
    if finished:
        comparisons["recipe - zero-shot"] = {"mean_difference": mean, "ci95_low": low, "ci95_high": high}
    path.write_text(json.dumps({"comparisons": comparisons, "table": {"recipe": {"seeds": seeds}}}))
    return str(path)


def test_points_are_the_reports_comparisons_sorted_by_batch(tmp_path) -> None:
    """Each BATCH:FILE gives (batch, mean gain, interval, seeds) from its "recipe - zero-shot" comparison,
    sorted by batch; an unfinished run (no comparison) and a spec without a batch are refused by name."""
    big = _report(tmp_path / "big.json", 0.05, 0.04, 0.06, 1)
    small = _report(tmp_path / "small.json", 0.01, 0.0, 0.02, 3)
    assert plot.gain_points([f"2048:{big}", f"32:{small}"]) == [
        (32, 0.01, 0.0, 0.02, 3),
        (2048, 0.05, 0.04, 0.06, 1),
    ]
    unfinished = _report(tmp_path / "cut.json", 0, 0, 0, 1, finished=False)
    with pytest.raises(ValueError, match=r"cut\.json has no 'recipe - zero-shot'"):
        plot.gain_points([f"64:{unfinished}"])
    with pytest.raises(ValueError, match="expected BATCH:FILE"):
        plot.gain_points([small])
