"""The 262,144-triplet benchmark's CPU run (2 gloo ranks, tiny batch): its exactness phase, step split and curve."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from script_helpers import ROOT


@pytest.mark.slow
def test_two_ranks_match_the_uncached_step_and_report_every_phase(tmp_path) -> None:
    """On 2 gloo ranks the cached step (sparse reps, gathered, blocked scores sharded across the ranks) gives
    the uncached single-process gradients, and the run reports the step's phases and a cost curve."""
    out = tmp_path / "262k.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    command += [
        str(ROOT / "benchmarks" / "bench_262k.py"),
        "--device",
        "cpu",
        "--exactness",
        "--out",
        str(out),
    ]
    command += [
        "--batch",
        "16",
        "--mini_batch",
        "4",
        "--curve_start",
        "4",
        "--query_len",
        "8",
        "--doc_len",
        "16",
    ]
    done = subprocess.run(command, env=env, cwd=tmp_path, timeout=240, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["exactness"]["passed"], report["exactness"]
    step = report["step"]
    assert step["status"] == "ok" and step["rows_per_rank"] == 8
    assert step["shared_nonzeros_per_pair"] > 0 and min(step["nnz_per_row"].values()) > 0
    for phase in ("encode_s", "loss_and_rep_grads_s", "replay_s", "optimizer_s"):
        assert step[phase] > 0
    assert [point["batch"] for point in report["curve"]] == [4, 8, 16]
    assert all(point["status"] == "ok" and point["loss_s"] > 0 for point in report["curve"])
