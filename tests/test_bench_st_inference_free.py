"""The sentence-transformers inference-free benchmark (issue 3441's case): its CPU smoke step and its GPU search."""

from __future__ import annotations

import json
import math

import pytest

pytest.importorskip("sentence_transformers", reason="needs the sentence-transformers extra")

from benchmarks import bench_st_inference_free as bench


def test_cpu_smoke_steps_both_routes(tmp_path) -> None:
    """`--smoke --device cpu` runs one training step of sentence-transformers' route and of ours on the same
    Router model (finite losses) and writes the result with its stamp."""
    out = tmp_path / "cpu.json"
    result = bench.main(["--smoke", "--device", "cpu", "--output", str(out)])
    assert json.loads(out.read_text()) == result
    assert set(result["steps"]) == set(bench.ROUTES)
    for row in result["steps"].values():
        assert row["batch"] == 4 and math.isfinite(row["loss"])
    assert "date" in result["meta"]


@pytest.mark.gpu
def test_gpu_largest_batch_ours_at_least_eight_times(tmp_path) -> None:
    """In 4 GiB, the fused head and the cache fit at least 8x sentence-transformers' largest document batch."""
    result = bench.main(["--memory_gib", "4", "--max_batch", "4096", "--output", str(tmp_path / "gpu.json")])
    largest = result["largest_train_batch"]
    assert largest["sentence_transformers"] >= 1
    assert largest["ours"] >= 8 * largest["sentence_transformers"], largest
