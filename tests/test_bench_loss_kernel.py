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


@pytest.mark.slow
def test_loss_kernel_bench_smoke_at_a_peaked_temperature(tmp_path, monkeypatch) -> None:
    """--smoke --temperature 0.05: the loss of every part runs at that temperature (recorded with the run): the
    fused backward's pairs are its non-zero softmax weights, fewer than the B x 2B scores (at 1.0 here, every one).
    Its check against fp64 is recorded, not bounded here: at 0.05 the exponent magnifies a score's rounding by
    max |s| / T (test_fused_lse's peaked test bounds that)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    out = tmp_path / "kernel.json"
    argv = ["--smoke", "--variants", "columns", "--temperature", "0.05", "--output", str(out)]
    assert bench_loss_kernel.main(argv) == 0
    report = json.loads(out.read_text())
    assert float(report["args"]["temperature"]) == 0.05
    assert all("loss_rel" in report["check"][kind]["fused:columns"] for kind in ("bf16", "fp32"))
    (point,) = report["ab"]
    assert point["status"] == "ok" and point["fused:columns"]["total_s"] > 0
    pairs = point["tiles"]["fused:columns"]["routes"]["pairs"]
    assert 0 < pairs < point["batch"] * 2 * point["batch"]  # some weights underflowed (at 1.0 here: none)


def test_loss_kernel_bench_refuses_bad_temperatures(tmp_path) -> None:
    """--temperature 0 or below stops the run before any work, naming the flag."""
    with pytest.raises(SystemExit):
        bench_loss_kernel.parse_args(["--temperature", "0", "--output", str(tmp_path / "k.json")])


def test_loss_kernel_bench_refuses_unknown_settings(tmp_path) -> None:
    """A --variants name not in fused_lse.VARIANTS stops the run before any work, naming the flag."""
    with pytest.raises(SystemExit):
        bench_loss_kernel.parse_args(["--variants", "columns,nope", "--output", str(tmp_path / "k.json")])
