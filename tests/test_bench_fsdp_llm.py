"""The FSDP2 LLM benchmark's CPU run (2 gloo ranks, tiny Llama): built sharded, both training modes, the search."""

from __future__ import annotations

import json
import math

import pytest
from rank_launch import launch_ranks


@pytest.mark.slow
def test_two_ranks_build_sharded_and_run_every_phase(tmp_path) -> None:
    """Each rank holds half of every parameter (built on the meta device, never whole), LoRA and full training
    run the warm-up, timed and search phases with a finite loss, and the search stops at --max_batch."""
    out = tmp_path / "fsdp_llm.json"
    argv = ["-m", "benchmarks.bench_fsdp_llm", "--device", "cpu", "--shape", "tiny", "--out", str(out)]
    argv += ["--batch", "8", "--mini_batch", "2", "--query_len", "8", "--doc_len", "16", "--steps", "2"]
    launch_ranks([*argv, "--max_batch", "16"], world_size=2, log_dir=tmp_path, timeout_s=240)
    rows = json.loads(out.read_text())["rows"]
    for training in ("lora", "full"):
        mine = [r for r in rows if r["training"] == training]
        assert [(r["phase"], r["batch"]) for r in mine] == [
            ("warm-up", 4),
            ("warm-up", 4),
            ("timed", 8),
            ("search", 16),
        ]
        for row in mine:
            assert row["status"] == "ok" and math.isfinite(row["loss"]) and row["pairs_per_s"] > 0
            assert row["largest_local_fraction"] == 0.5 and row["local_parameters"] * 2 == row["parameters"]
            assert (
                row["grad_sync"] == "step"
            )  # one reduce-scatter per step where memory allows (always on a CPU)
        assert (mine[0]["trainable"] < mine[0]["parameters"]) == (training == "lora")
