"""bench_loss_kernel at CPU sizes (Triton interpreter): one command checks the blocked path and the fused settings
against fp64, times them all, and writes them."""

from __future__ import annotations

import json

import pytest

from benchmarks import bench_loss_kernel


@pytest.mark.slow
def test_loss_kernel_bench_smoke_checks_and_times_every_setting(tmp_path, monkeypatch) -> None:
    """--smoke (CPU, interpreter): the blocked path and every fused setting are within the fp32 bound of fp64
    (1e-4 of the largest: a few hundred 2^-24 plus the 2-part split's 2^-16), each has its A/B times, and the
    fused backward's routes are counted (its score tiles, and the pairs or tensor-core tiles they went by)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    out = tmp_path / "kernel.json"
    assert bench_loss_kernel.main(["--smoke", "--variants", "columns", "--output", str(out)]) == 0
    report = json.loads(out.read_text())
    paths = ["blocked", "fused:columns"]
    for kind in ("bf16", "fp32"):
        for path in paths:
            errors = report["check"][kind][path]
            assert errors["loss_rel"] < 1e-5
            assert max(v for k, v in errors.items() if k.endswith("_rel_to_max")) < 1e-4
    (point,) = report["ab"]
    assert point["status"] == "ok" and all(point[path]["total_s"] > 0 for path in paths)
    assert set(report["variants"]) == {"columns"}
    routes = point["tiles"]["fused:columns"]["routes"]
    assert routes["score_tiles"] > 0 and routes["pairs"] + routes["dense_tiles"] > 0


def test_loss_kernel_bench_refuses_unknown_settings(tmp_path) -> None:
    """A --variants name not in fused_lse.VARIANTS stops the run before any work, naming the flag."""
    with pytest.raises(SystemExit):
        bench_loss_kernel.parse_args(["--variants", "columns,nope", "--output", str(tmp_path / "k.json")])
