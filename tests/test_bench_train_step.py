"""The training-step benchmark script: its PyTorch head equals Sparton, OOM recovery, targets, a smoke run."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from transformers import BertConfig

from benchmarks import bench_train_step as bench
from gradcache_sparton import SpladeEncoder


def test_torch_head_encoder_matches_sparton_reps_and_grads() -> None:
    """The benchmark's PyTorch head (materialised MLM logits) gives the SpladeEncoder's reps and gradients."""
    config = BertConfig(
        vocab_size=500, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64
    )
    torch.manual_seed(0)
    encoder = SpladeEncoder.from_config(config).eval()  # eval: no dropout, both calls see one function
    plain = bench.TorchHeadEncoder(encoder)
    ids = torch.randint(0, 500, (3, 11))
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0  # padding must not reach the max in either head
    g = torch.randn(3, 500)
    results = []
    for model in (encoder, plain):
        encoder.zero_grad(set_to_none=True)
        reps = model(input_ids=ids, attention_mask=mask)
        reps.backward(g)
        grad = encoder.model.get_output_embeddings().weight.grad.clone()
        results.append(
            (reps.detach(), grad, encoder.model.bert.encoder.layer[0].output.dense.weight.grad.clone())
        )
    (fused, fused_e, fused_w), (eager, eager_e, eager_w) = results
    assert (fused > 0).any()
    # fp32 both ways; the two heads sum the D-products in different orders (vocabulary chunks vs one
    # matmul), ~1e-7 relative, and argmaxes agree because random logits have no near-ties.
    torch.testing.assert_close(fused, eager, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(fused_e, eager_e, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(fused_w, eager_w, rtol=1e-4, atol=1e-6)


def test_search_stops_at_first_oom_and_keeps_going(tmp_path: Path, monkeypatch) -> None:
    """An OOM is a row with status OOM, ends the largest-batch search, and the next configuration runs."""

    def fake_measure(self, config):
        if config.batch >= 4:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return {"sequences_per_s": 1.0}

    monkeypatch.setattr(bench.Bench, "measure", fake_measure)
    args = type("Args", (), {"init_decoder_bias": 0.0})()
    runner = bench.Bench(args, bench.SMOKE, torch.device("cpu"))
    plans = [
        bench.Search("torch", 1000, (2, 4, 8), "uncached-torch"),
        bench.StepConfig("sparton", True, 16, 1000, 8, "cached-sparton"),
    ]
    rows = bench.run_plans(runner, plans, tmp_path, {}, deadline=float("inf"))
    assert [(r["batch"], r["status"]) for r in rows] == [(2, "ok"), (4, "OOM"), (16, "OOM")]
    saved = json.loads((tmp_path / "train_step.json").read_text())
    assert len(saved["rows"]) == 3


def _row(head: str, cached: bool, batch: int, mb: int | None, vocab: int, **values) -> dict:
    config = bench.StepConfig(head, cached, batch, vocab, mb)
    return {**bench._row_header(config), "status": "ok", **values}


def test_targets_pass_and_miss_on_thresholds() -> None:
    """Targets compare the right rows: largest uncached batch, best cached mini-batch, equal mini-batches."""
    s = bench.SMOKE
    v, eff = s.vocab, s.effective
    rows = [
        _row("sparton", False, 2, None, v, sequences_per_s=50.0),
        _row("sparton", False, 4, None, v, sequences_per_s=100.0),  # the largest: the reference
        _row("sparton", True, eff, 8, v, sequences_per_s=60.0, peak_allocated_gib=1.0),
        _row("sparton", True, eff, 16, v, sequences_per_s=80.0, peak_allocated_gib=2.0),  # best
        _row("torch", True, eff, 8, v, sequences_per_s=40.0, peak_allocated_gib=2.0),
        _row("sparton", True, s.large_batches[1], 8, v, sequences_per_s=9.0, peak_allocated_gib=17.0),
    ]
    targets = {t["target"]: t for t in bench.evaluate_targets(rows, s)}
    assert targets["cached/uncached Sparton speed"]["value"] == pytest.approx(0.8)
    assert targets["cached/uncached Sparton speed"]["status"] == "PASS"
    assert targets["Sparton vs PyTorch head, cached mb8: speed"]["value"] == pytest.approx(1.5)
    assert targets["Sparton vs PyTorch head, cached mb8: speed"]["status"] == "MISS"
    assert targets["Sparton vs PyTorch head, cached mb8: peak memory"]["status"] == "MISS"  # 50% > 40%
    assert targets[f"effective b{s.large_batches[1]} mb8 fits a 16 GiB GPU"]["status"] == "MISS"
    assert targets[f"effective b{s.huge_batch} mb8 runs on the 80 GB H100"]["status"] == "n/a"


def test_smoke_run_writes_rows_and_table(tmp_path: Path, monkeypatch) -> None:
    """`--smoke` on one configuration runs real steps on CPU and writes the JSON and markdown."""
    argv = [
        "bench_train_step.py",
        "--smoke",
        "--configs",
        "cached-sparton-v1000-b16-mb8",
        "--out",
        str(tmp_path),
    ]
    monkeypatch.setattr(sys, "argv", argv)
    assert bench.main() == 0
    saved = json.loads((tmp_path / "train_step.json").read_text())
    (row,) = saved["rows"]
    assert row["status"] == "ok" and row["timed_steps"] == 2 and row["sequences_per_s"] > 0
    assert "cached-sparton-v1000-b16-mb8" in (tmp_path / "train_step.md").read_text()
