"""The loss-scale benchmarks at CPU sizes: bench_loss_curve's one command (text and uniform reps, compaction
on and off) and bench_262k's ``--text`` step on 2 gloo ranks."""

from __future__ import annotations

import json

import pytest
from rank_launch import launch_ranks

from benchmarks import bench_loss_curve

TINY = [
    "--device",
    "cpu",
    "--beir_path",
    "default",
    "--max_texts",
    "120",
    "--query_len",
    "8",
    "--doc_len",
    "16",
]


@pytest.mark.slow
def test_loss_curve_runs_tiny_and_compaction_changes_only_the_summation_order(tmp_path) -> None:
    """One command writes every point for both kinds and both modes; the compacted and whole-V runs of the
    same reps give the same loss and gradients up to fp32 summation order (1e-5 of the largest)."""
    out = tmp_path / "curve.json"
    argv = [*TINY, "--min_batch", "16", "--max_batch", "32", "--block_size", "8", "--repeats", "1"]
    assert bench_loss_curve.main([*argv, "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [point["batch"] for point in report["points"]] == [16, 32]
    for point in report["points"]:
        for kind in ("text", "uniform"):
            entry = point[kind]
            assert entry["on"]["total_s"] > 0 and entry["off"]["total_s"] > 0
            assert entry["loss_relative_difference"] < 1e-5 and entry["grad_max_difference_over_max"] < 1e-5
        text = point["text"]
        assert text["plan"]["compacted_blocks"] == text["plan"]["query_blocks"] == point["batch"] // 8
        assert 0 < text["distinct_rows"]["query"] <= point["batch"]
    assert report["text"]["nnz_per_row"]["query"] > 0


@pytest.mark.slow
def test_bench_262k_text_step_runs_on_two_ranks(tmp_path) -> None:
    """``--text`` draws the step's triplets from SciFact text: the step runs on 2 gloo ranks and reports its phases."""
    out = tmp_path / "262k.json"
    argv = ["-m", "benchmarks.bench_262k", "--device", "cpu", "--text", "default", "--out", str(out)]
    argv += [
        "--batch",
        "16",
        "--mini_batch",
        "4",
        "--curve_start",
        "16",
        "--query_len",
        "8",
        "--doc_len",
        "16",
    ]
    launch_ranks(argv, world_size=2, log_dir=tmp_path, timeout_s=300)
    step = json.loads(out.read_text())["step"]
    assert step["status"] == "ok" and step["rows_per_rank"] == 8 and step["loss_and_rep_grads_s"] > 0
