"""The corpus-scale retrieval benchmark: its synthetic reps follow the measured statistics, and a CPU smoke run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import bench_retrieval_scale as bench
from gradcache_sparton.evaluation import SparseReps, seismic_available

ROOT = Path(__file__).resolve().parents[1]


def test_synthetic_reps_follow_the_measured_statistics() -> None:
    """Each synthetic rep has a measured non-zero count, distinct terms drawn by document frequency (a
    term no measured rep holds is rare) and measured weights."""
    generator = torch.Generator().manual_seed(0)
    vocab, nnz_choices = 200, torch.tensor([3, 5, 8])
    measured = torch.zeros(40, vocab)
    for i, row in enumerate(measured):  # terms 0..49 only, 3 to 8 per row, weights in {0.5, 1.5}
        count = int(nnz_choices[i % 3])
        row[torch.randperm(50, generator=generator)[:count]] = torch.tensor([0.5, 1.5])[i % 2]
    stats = bench.measured_statistics(SparseReps.from_dense(measured))
    reps = bench.synthesize(stats, 3000, device=torch.device("cpu"), seed=0)
    counts = reps.nonzeros_per_row()
    assert reps.num_rows == 3000 and set(counts.tolist()) == {3, 5, 8}
    assert set(reps.weights.unique().tolist()) == {0.5, 1.5}
    # 150 unseen terms weigh 0.1 each (15) against the seen terms' df + 0.1 (211 + 5): ~7% of draws.
    unseen = (reps.token_ids >= 50).float().mean().item()
    assert unseen < 0.1
    dense = reps.to_dense()
    assert torch.equal((dense > 0).sum(dim=1), counts)  # terms within a rep are distinct


@pytest.mark.slow
@pytest.mark.skipif(not seismic_available(), reason="needs pyseismic-lsr (pip install -e '.[dev]')")
def test_smoke_run_writes_every_table(tmp_path: Path) -> None:
    """`--smoke` measures every step on a CPU and writes the JSON and markdown; the exact seismic index
    finds the exhaustive top 10 (recall 1 up to half-precision near-ties)."""
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.bench_retrieval_scale",
            "--smoke",
            "--out",
            str(tmp_path),
        ],
        cwd=ROOT,  # python -m finds the package benchmarks/ of this checkout
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads((tmp_path / "retrieval_scale.json").read_text())
    assert results["corpus"]["documents"] == 500 and results["encoding"]["docs"] == 32
    assert [row["settings"] for row in results["seismic"]] == ["fast", "exact"]
    assert results["seismic"][1]["recall_at_10_vs_exhaustive"] >= 0.9
    assert "| seismic exact |" in (tmp_path / "retrieval_scale.md").read_text()
