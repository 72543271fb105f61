"""The 262,144-triplet benchmark's CPU run (2 gloo ranks, tiny batch): its exactness phase, step split and curve."""

from __future__ import annotations

import json

import pytest
from rank_launch import launch_ranks


@pytest.mark.slow
def test_two_ranks_match_the_uncached_step_and_report_every_phase(tmp_path) -> None:
    """On 2 gloo ranks the cached step (sparse reps, gathered, blocked scores sharded across the ranks) gives
    the uncached single-process gradients, and the run reports the step's phases and a cost curve."""
    out = tmp_path / "262k.json"
    argv = [
        "-m",
        "benchmarks.bench_262k",
        "--device",
        "cpu",
        "--exactness",
        "--out",
        str(out),
        "--batch",
        "16",
    ]
    argv += ["--mini_batch", "4", "--curve_start", "4", "--query_len", "8", "--doc_len", "16"]
    launch_ranks(argv, world_size=2, log_dir=tmp_path, timeout_s=240)
    report = json.loads(out.read_text())
    assert report["exactness"]["passed"], report["exactness"]
    step = report["step"]
    assert step["status"] == "ok" and step["rows_per_rank"] == 8
    assert step["shared_nonzeros_per_pair"] > 0 and min(step["nnz_per_row"].values()) > 0
    for phase in ("encode_s", "loss_and_rep_grads_s", "replay_s", "optimizer_s"):
        assert step[phase] > 0
    assert [point["batch"] for point in report["curve"]] == [4, 8, 16]
    assert all(point["status"] == "ok" and point["loss_s"] > 0 for point in report["curve"])
