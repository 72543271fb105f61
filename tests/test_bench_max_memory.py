"""benchmarks/bench_max_memory.py: its ratios per budget and a CPU smoke run of the whole script."""

from __future__ import annotations

import json

from benchmarks import bench_max_memory as script


def _row(name: str, pairs: float, peak: float, max_memory: str | None = None) -> dict:
    return {
        "name": name,
        "max_memory": max_memory,
        "status": "ok",
        "pairs_per_s": pairs,
        "peak_allocated_gib": peak,
    }


def test_ratios_compare_with_the_best_hand_tuned_row_that_fits() -> None:
    """Each budget's reference is the fastest hand-tuned row whose peak fits it; unlimited takes the fastest."""
    rows = [
        _row("mb32+graphs", 1400.0, 1.9),
        _row("mb128", 1700.0, 8.3),
        _row("mb512", 2200.0, 28.0),
        _row("max_memory=2GiB", 1330.0, 1.95, "2GiB"),
        _row("max_memory=8GiB", 1500.0, 8.5, "8GiB"),
        _row("max_memory=auto", 2100.0, 30.0, "auto"),
    ]
    by_budget = {r["budget"]: r for r in script.ratios(rows)}
    assert by_budget["2GiB"]["best_hand_tuned"] == "mb32+graphs" and by_budget["2GiB"]["ratio"] == 1330 / 1400
    assert by_budget["2GiB"]["within_budget"] is True
    assert (
        by_budget["8GiB"]["best_hand_tuned"] == "mb32+graphs" and by_budget["8GiB"]["within_budget"] is False
    )
    assert by_budget["unlimited (auto)"]["best_hand_tuned"] == "mb512"
    assert by_budget["4GiB"]["ratio"] is None  # no max_memory row measured at 4 GiB


def test_smoke_run_writes_every_row_and_the_ratios(tmp_path) -> None:
    """--smoke on the CPU runs every configuration (max_memory ignored there) and writes max_memory.json."""
    assert script.main(["--out", str(tmp_path), "--smoke", "--effective_batch", "8", "--steps", "1"]) == 0
    result = json.loads((tmp_path / "max_memory.json").read_text())
    assert [r["status"] for r in result["rows"]] == ["ok"] * len(script.configs(smoke=True, cuda=False))
    assert all(r["pairs_per_s"] > 0 for r in result["rows"])
    assert [r["budget"] for r in result["ratios"]] == ["2GiB", "4GiB", "8GiB", "unlimited (auto)"]
