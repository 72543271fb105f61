"""The inference-free benchmark script: its CPU rows from a smoke run, and its GPU rows on a GPU."""

from __future__ import annotations

import json

import pytest

from benchmarks import bench_inference_free as bench


def test_cpu_smoke_times_every_route(tmp_path) -> None:
    """`--smoke` times each query route on a few sample queries and writes the rows with their stamp; the
    speedup is the faster SPLADE route's median over the table's."""
    out = tmp_path / "cpu.json"
    result = bench.main(["--smoke", "--output", str(out)])
    assert json.loads(out.read_text()) == result
    cpu = result["cpu"]
    for route in ("splade_plain", "splade_fused", "table", "tokenize"):
        assert cpu[route]["queries"] == 5 and cpu[route]["median_ms"] > 0
    fastest = min(cpu["splade_plain"]["median_ms"], cpu["splade_fused"]["median_ms"])
    assert cpu["speedup_median"] == pytest.approx(fastest / cpu["table"]["median_ms"])
    assert result["meta"]["torch_threads"] >= 1 and "date" in result["meta"]


@pytest.mark.gpu
def test_gpu_smoke_rows_for_both_routes(tmp_path) -> None:
    """`--mode gpu --smoke` gives documents/s of the fused and plain routes and the largest batch of each."""
    result = bench.main(
        ["--mode", "gpu", "--smoke", "--memory_gib", "2", "--output", str(tmp_path / "gpu.json")]
    )
    rows = {row["route"]: row for row in result["gpu"]}
    assert set(rows) == {"fused", "plain"}
    for row in rows.values():
        assert (
            row["train_docs_per_s"] > 0 and row["encode_docs_per_s"] > 0 and row["largest_train_batch"] >= 1
        )
