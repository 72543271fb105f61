"""The LLM training-step benchmark: the materialising head computes the fused head's reps, and a CPU smoke run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import bench_llm_step as bench

ROOT = Path(__file__).resolve().parents[1]


def test_materializing_head_equals_the_fused_head() -> None:
    """Both providers train the same function: the [B, S, V]-logits head gives the SpladeEncoder's reps
    (fp32, tiny Llama; the two differ by summation order only, ~1e-7 relative over D = 32)."""
    encoder = bench.build_encoder("tiny", "full", torch.device("cpu"))
    with torch.no_grad():  # perturb the init so that many terms are active
        for p in encoder.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    ids = torch.randint(0, encoder.vocab_size, (3, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0
    fused, materialized = encoder(ids, mask), bench.MaterializingEncoder(encoder)(ids, mask)
    assert (fused > 0).float().mean() > 0.1
    torch.testing.assert_close(materialized, fused, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_smoke_run_writes_rows_and_targets(tmp_path: Path) -> None:
    """`--smoke` runs every provider for LoRA and full training and computes both targets per mode."""
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_llm_step", "--smoke", "--out", str(tmp_path)],
        cwd=ROOT,  # python -m finds the package benchmarks/ of this checkout
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads((tmp_path / "llm_step.json").read_text())
    assert {(r["provider"], r["training"]) for r in results["rows"] if r["status"] == "ok"} == {
        (p, t) for p in ("cached-sparton", "uncached-sparton", "uncached-torch") for t in ("lora", "full")
    }
    assert len(results["targets"]) == 4 and all(t["value"] is not None for t in results["targets"])
    assert "| cached-sparton | lora | 8 | 4 | ok |" in (tmp_path / "llm_step.md").read_text()
