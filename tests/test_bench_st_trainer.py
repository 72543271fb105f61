"""benchmarks/bench_st_trainer.py: a CPU smoke run of ours and sentence-transformers' own trainer."""

from __future__ import annotations

import importlib.util
import json

import pytest

from benchmarks import bench_st_trainer as script


@pytest.mark.skipif(
    importlib.util.find_spec("sentence_transformers") is None,
    reason="sentence-transformers is not installed (it is optional: pip install sentence-transformers)",
)
def test_smoke_run_times_both_trainers_on_one_model(tmp_path) -> None:
    """Our trainer on the SparseEncoder and sentence-transformers' SparseEncoderTrainer + CachedSpladeLoss each
    run a CPU step, and the result holds both rows' pairs/s and ours over theirs."""
    out = tmp_path / "st_trainer.json"
    assert script.main(["--smoke", "--providers", "ours,st", "--out", str(out)]) == 0
    payload = json.loads(out.read_text())
    assert set(payload["rows"]) == {"ours", "st"}
    assert all(row["pairs_per_s"] > 0 for row in payload["rows"].values())
    assert payload["rows"]["ours"]["speedup_vs_st"] > 0
    assert payload["meta"]["sentence_transformers"] and payload["meta"]["smoke"] is True
