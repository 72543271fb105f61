"""bench_loss_kernel at CPU sizes (Triton interpreter): one command checks both paths against fp64, times the A/B
and a variant, and writes them all."""

from __future__ import annotations

import json

import pytest

from benchmarks import bench_loss_kernel


@pytest.mark.slow
def test_loss_kernel_bench_runs_tiny_and_both_paths_match_fp64(tmp_path) -> None:
    """The check's fused and blocked losses and gradients are within the fp32 bound of fp64 (1e-4 of the
    largest: a few hundred 2^-24 plus the 2-part split's 2^-16), every A/B point and variant has its times."""
    out = tmp_path / "kernel.json"
    argv = [
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
    argv += ["--check_batch", "24", "--batches", "32", "--repeats", "1", "--tile_batch", "32"]
    argv += ["--variants", "16,16,16,16,4,1,2,3,0", "--output", str(out)]
    assert bench_loss_kernel.main(argv) == 0
    report = json.loads(out.read_text())
    for kind in ("bf16", "fp32"):
        for path in ("fused", "blocked"):
            errors = report["check"][kind][path]
            assert errors["loss_rel"] < 1e-5
            assert max(v for k, v in errors.items() if k.endswith("_rel_to_max")) < 1e-4
    (point,) = report["ab"]
    assert point["status"] == "ok" and point["fused"]["total_s"] > 0 and point["blocked"]["total_s"] > 0
    (variant,) = report["variants"]["rows"]
    assert variant["settings"]["backward_passes"] == 2 and variant["total_s"] > 0
