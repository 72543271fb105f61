"""``max_memory`` as a cap on what the process reserves: the probe stays within the budget (CPU, its peak
readings injected), and on a GPU, with the process limited to the budget by
``torch.cuda.set_per_process_memory_fraction``, the planned steps (the probe's included) run without running
out of memory and reserve no more than the budget: 6-layer BERT-base width (random weights, decoder bias
-1.9 for a trained-like sparsity), 512 real SciFact pairs (queries 64 tokens, passages 256), bf16, AdamW."""

from __future__ import annotations

import gc
import gzip
import json

import pytest
import torch
from engine_helpers import make_columns, make_encoder, small_config
from transformers import AutoTokenizer, BertConfig, BertForMaskedLM

from gradcache_sparton import CachedLoss, SpladeEncoder
from gradcache_sparton.engine.autocast_state import AutocastState
from gradcache_sparton.engine.planner import memory_probe
from gradcache_sparton.engine.planner.memory_probe import measure_fits
from gradcache_sparton.losses import SpladeLoss, SpladeLossConfig
from gradcache_sparton.resources import RESOURCES_DIR, default_tokenizer_path

GIB = 2**30
ROWS = 512


CPU = torch.device("cpu")


def _probe(config, peak_bytes, room):
    encoder = make_encoder(small_config(config))
    trained = [p for p in encoder.parameters() if p.requires_grad]
    columns = {"query": make_columns(16, 2)["query"]}
    fits = measure_fits(
        encoder, columns, AutocastState.capture(), trained, CPU, (2, 4, 8), peak_bytes, room=room
    )
    return encoder, fits["query"]


def test_probe_skips_points_predicted_beyond_the_room(tiny_bert_config) -> None:
    """A probe point that the points before it predict above the room is not run, nor any larger one."""
    runs = []

    def peak_bytes(run, device):
        rep = run()
        runs.append(len(rep))
        return 1000 + 100 * len(rep), rep

    _, fit = _probe(tiny_bert_config, peak_bytes, room=1500)  # 2 rows: 1,200; 4 predicted 2,400 (one point)
    assert runs == [2] and fit.points == ((2, 1200),)
    runs.clear()
    _, fit = _probe(tiny_bert_config, peak_bytes, room=None)
    assert runs == [2, 4, 8]


def test_probe_out_of_memory_under_a_cap_counts_as_not_fitting(tiny_bert_config) -> None:
    """A point that runs out of memory (a process cap) is recorded above the room, so that its rows do not
    fit; the gradients are put back; not even the first point fitting still gives the reps' width."""

    def oom_from(rows: int):
        def peak_bytes(run, device):
            if run.__defaults__[0]["input_ids"].shape[0] >= rows:
                raise torch.OutOfMemoryError("CUDA out of memory (injected)")
            rep = run()
            return 100 * len(rep), rep

        return peak_bytes

    encoder, fit = _probe(tiny_bert_config, oom_from(4), room=1000)
    assert fit.points == ((2, 200), (4, 1001)) and fit.largest(1000, 16) < 4
    assert all(p.grad is None for p in encoder.parameters())
    _, first = _probe(tiny_bert_config, oom_from(2), room=1000)
    assert first.points == ((2, 1001),) and first.width == encoder.mlm.config.vocab_size
    with pytest.raises(torch.OutOfMemoryError):
        _probe(tiny_bert_config, oom_from(2), room=None)  # no budget: the error is the user's to see


def test_resident_memory_counts_what_the_process_reserves(monkeypatch) -> None:
    """What stays resident is what the process reserves with its cache emptied, when that exceeds what its
    tensors allocate (the free space inside held segments)."""
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 100)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 300)
    assert memory_probe._held_bytes(CPU) == 300
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 50)
    assert memory_probe._held_bytes(CPU) == 100


def _columns(device: torch.device) -> dict[str, dict[str, torch.Tensor]]:
    with gzip.open(RESOURCES_DIR / "scifact_sample" / "train.jsonl.gz", "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line, _ in zip(f, range(ROWS), strict=False)]
    tokenizer = AutoTokenizer.from_pretrained(default_tokenizer_path())
    columns = {}
    for column, length in (("query", 64), ("positive", 256)):
        features = tokenizer(
            [row[column] for row in rows],
            padding=True,
            truncation=True,
            max_length=length,
            return_tensors="pt",
        )
        columns[column] = {name: value.to(device) for name, value in features.items()}
    return columns


def _encoder(device: torch.device) -> SpladeEncoder:
    torch.manual_seed(0)
    config = BertConfig(hidden_size=768, num_hidden_layers=6, num_attention_heads=12, intermediate_size=3072)
    model = BertForMaskedLM(config)
    with torch.no_grad():
        model.get_output_embeddings().bias.fill_(-1.9)
    return SpladeEncoder(model).to(device).train()


# On an H200 (2026-11-28, torch 2.11) with the allocator's fixed segments, 2 and 8 GiB failed (8 GiB: a replayed
# mini-batch ran out under the cap with 1.25 GiB reserved but unallocated); with expandable segments, which
# max_memory now turns on (engine/planner/allocator.py), all three held.
@pytest.mark.gpu
@pytest.mark.parametrize("budget_gib", [2, 4, 8])
def test_max_memory_holds_as_a_process_cap(budget_gib: int) -> None:
    """Capped at the budget, three steps planned by max_memory alone run without an out-of-memory error and
    their reserved peak (the first step's probe included) stays within the budget."""
    device = torch.device("cuda", torch.cuda.current_device())  # the memory-fraction call needs an index
    columns = _columns(device)
    gc.collect()
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(budget_gib * GIB / total, device)
    try:
        torch.cuda.reset_peak_memory_stats(device)
        encoder = _encoder(device)
        optimizer = torch.optim.AdamW(encoder.parameters(), lr=1e-5, fused=True)
        cached = CachedLoss(encoder, SpladeLoss(SpladeLossConfig()), max_memory=f"{budget_gib}GiB")
        for step in range(3):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = cached(columns, step=step)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_reserved(device)
        plan = cached.engine.memory_plan
        assert plan is not None
        assert peak <= budget_gib * GIB, (peak / GIB, plan.describe())
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device)
        gc.collect()
        torch.cuda.empty_cache()
