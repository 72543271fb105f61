"""bench_inference_free_defaults at a CPU size: one variant of the default command, one step, no evaluation."""

from __future__ import annotations

import json

import pytest

from benchmarks import bench_inference_free_defaults


@pytest.mark.slow
def test_one_variant_runs_and_is_recorded(tmp_path) -> None:
    """A variant runs as its own process; its command, exit status and log are recorded in the result file."""
    out = tmp_path / "defaults.json"
    extra = ["--max_steps", "1", "--eval_beir", "none", "--per_device_train_batch_size", "4",
             "--mini_batch_size", "4", "--max_train_samples", "8"]  # fmt: skip
    argv = [
        "--variants",
        "li_lsr_docs_25x_lower",
        "--out",
        str(out),
        "--work_dir",
        str(tmp_path / "w"),
        "--extra",
    ]
    assert bench_inference_free_defaults.main([*argv, *extra]) == 0
    run = json.loads(out.read_text())["runs"]["li_lsr_docs_25x_lower"]
    assert run["returncode"] == 0 and run["command"].startswith("gradcache-sparton train --config default")
    assert "--query_encoder li_lsr" in run["command"] and (tmp_path / run["log"]).is_file()
    assert (tmp_path / "w" / "li_lsr_docs_25x_lower" / "query_table.safetensors").is_file()
