"""benchmarks/bench_max_memory.py: its ratios per budget and a CPU smoke run of the whole script."""

from __future__ import annotations

import importlib.util
import json

import pytest

from benchmarks import bench_max_memory as script


def _row(name: str, pairs: float, peak: float, max_memory: str | None = None, provider: str = "ours") -> dict:
    return {
        "name": name,
        "provider": provider,
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
        _row("st-mb16", 9000.0, 1.0, provider="st"),  # never a hand-tuned row of ours
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


def test_st_reference_is_their_best_that_fits_else_their_smallest() -> None:
    """Against sentence-transformers each budget takes their fastest row that fits it; where none fits,
    their row of smallest peak, labelled so; OOM rows are never a reference; PASS needs >= 2.5x and our
    peak within the budget."""
    rows = [
        _row("st-mb16", 180.0, 4.5, provider="st"),
        _row("st+ckpt-mb160", 400.0, 23.7, provider="st"),
        _row("st-mb128", 460.0, 24.7, provider="st"),
        {**_row("st-mb512", 0.0, 0.0, provider="st"), "status": "OOM"},
        _row("mb16+graphs", 650.0, 1.9),
        _row("max_memory=2GiB", 600.0, 1.95, "2GiB"),
        _row("max_memory=8GiB", 900.0, 8.5, "8GiB"),
        _row("max_memory=auto", 1200.0, 54.0, "auto"),
    ]
    assert script.st_reference(rows, 4.0)[0]["name"] == "st-mb16"
    assert script.st_reference(rows, 4.0)[1] is False
    assert script.st_reference(rows, 24.0) == (rows[1], True)
    assert script.st_reference(rows, None) == (rows[2], True)
    assert script.st_reference(rows[4:], None) == (None, False)
    by_budget = {r["budget"]: r for r in script.ratios(rows)}
    two = by_budget["2GiB"]
    assert (two["st_reference"], two["st_reference_kind"]) == ("st-mb16", "none fits: smallest peak")
    assert two["ratio_vs_st"] == pytest.approx(600 / 180) and two["status_vs_st"] == "PASS"
    assert two["target_vs_st"] == 2.5
    eight = by_budget["8GiB"]  # 5.0x their smallest, but our peak is over the budget
    assert eight["ratio_vs_st"] == pytest.approx(900 / 180) and eight["status_vs_st"] == "MISS"
    auto = by_budget["unlimited (auto)"]
    assert (auto["st_reference"], auto["st_reference_kind"]) == ("st-mb128", "best that fits")
    assert auto["ratio_vs_st"] == pytest.approx(1200 / 460) and auto["status_vs_st"] == "PASS"
    assert by_budget["4GiB"]["status_vs_st"] == "n/a"  # no max_memory row at 4 GiB
    slower = [*rows[:5], _row("max_memory=2GiB", 400.0, 1.95, "2GiB")]
    assert {r["budget"]: r for r in script.ratios(slower)}["2GiB"]["status_vs_st"] == "MISS"


def test_providers_pick_the_configurations() -> None:
    """--providers picks ours (max_memory rows first, then hand-tuned) and/or sentence-transformers' rows,
    theirs after ours; the CPU drops the CUDA-graph rows."""
    every = script.configs(smoke=False, cuda=True)
    assert [c.provider for c in every] == ["ours"] * (4 + len(script.HAND_TUNED)) + ["st"] * len(
        script.SENTENCE_TRANSFORMERS
    )
    assert [c.max_memory for c in every[:4]] == ["2GiB", "4GiB", "8GiB", "auto"]
    assert script.configs(smoke=False, cuda=True, providers=["st"]) == list(script.SENTENCE_TRANSFORMERS)
    assert all(c.provider == "ours" for c in script.configs(smoke=False, cuda=True, providers=["ours"]))
    assert not any(c.cuda_graphs for c in script.configs(smoke=False, cuda=False))
    assert script.parse_args(["--out", "x", "--providers", "st"]).providers == ["st"]
    with pytest.raises(SystemExit):
        script.parse_args(["--out", "x", "--providers", "theirs"])


@pytest.mark.slow
def test_smoke_run_writes_every_row_and_the_ratios(tmp_path) -> None:
    """--smoke on the CPU runs every configuration (max_memory ignored there; sentence-transformers' row
    where it is installed) and writes max_memory.json with both ratios per budget."""
    with_st = importlib.util.find_spec("sentence_transformers") is not None
    assert script.main(["--out", str(tmp_path), "--smoke", "--effective_batch", "8", "--steps", "1"]) == 0
    result = json.loads((tmp_path / "max_memory.json").read_text())
    expected = ["ok"] * len(script.configs(smoke=True, cuda=False))
    if not with_st:
        expected[-1] = "skipped (sentence-transformers not installed)"
    assert [r["status"] for r in result["rows"]] == expected
    assert [r["provider"] for r in result["rows"]][-1] == "st"
    assert all(r["pairs_per_s"] > 0 for r in result["rows"] if r["status"] == "ok")
    assert [r["budget"] for r in result["ratios"]] == ["2GiB", "4GiB", "8GiB", "unlimited (auto)"]
    for ratio in result["ratios"]:
        assert ratio["ratio"] > 0 and ratio["target_vs_st"] == 2.5
        if with_st:  # the CPU measures no peak: their one row fits every budget
            assert (ratio["st_reference"], ratio["st_reference_kind"]) == ("st-mb4", "best that fits")
            assert ratio["ratio_vs_st"] > 0 and ratio["status_vs_st"] in ("PASS", "MISS")
        else:
            assert ratio["st_reference"] is None and ratio["status_vs_st"] == "n/a"


def test_without_sentence_transformers_their_rows_are_skipped(tmp_path, monkeypatch) -> None:
    """Where sentence-transformers is not installed its rows are recorded as skipped, with a note, and the
    ratio against it is n/a (never a PASS)."""
    monkeypatch.setattr(script, "sentence_transformers_version", lambda: None)
    argv = ["--out", str(tmp_path), "--smoke", "--effective_batch", "8", "--steps", "1", "--providers", "st"]
    assert script.main(argv) == 0
    result = json.loads((tmp_path / "max_memory.json").read_text())
    assert [r["status"] for r in result["rows"]] == ["skipped (sentence-transformers not installed)"]
    assert {r["status_vs_st"] for r in result["ratios"]} == {"n/a"}
