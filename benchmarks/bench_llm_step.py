"""Training steps of an LLM-shaped SPLADE encoder: cached + Sparton against uncached, fused and materialising heads.

Legend: B batch (pairs), S sequence, D hidden, V vocabulary.

Model: a decoder-only LM with random weights in bf16 (``--shape``: ``qwen3-0.6b``, D 1,024, 28 layers,
V 151,936, tied embeddings; ``llama-3.2-1b``, D 2,048, 16 layers, V 128,256, tied; ``llama-3-8b``, D 4,096,
32 layers, V 128,256, untied, for the sharded benchmark ``bench_fsdp_llm.py``), wrapped as a
``SpladeEncoder`` (causal attention, the head tied to ``lm_head``). Training: ``full`` (every weight) or
``lora`` (peft LoRA r 16, alpha 32, on q/k/v/o; ``lm_head`` and the embeddings frozen, so the head's
backward skips the [V, D] gradient). Data: synthetic (query, positive) pairs of random token ids, query
``--query_len`` (32) and passage ``--doc_len`` (256) tokens, no padding, generated on the GPU. A step:
InfoNCE over in-batch negatives + FLOPS (query 5e-4, doc 3e-4), ``loss.backward()``, AdamW, under bf16
autocast. Providers:

  cached-sparton     ``CachedLoss`` (GradCache) at effective batch ``--batch`` (1,024), mini-batches of
                     ``--mini_batch`` (32);
  uncached-sparton   the plain step with the fused head, B = 8, 16, 32, ... until the first OOM;
  uncached-torch     the plain step with the materialising head (``lm_head`` logits [B, S, V], then
                     ``splade_max_pool``), B = 1, 2, 4, ... until the first OOM.

Timing: a warm-up step (Triton compilation, optimizer state), then up to ``--steps`` steps between CUDA
events; the median. Peak memory: ``torch.cuda.max_memory_allocated`` over the timed steps. Targets
(issue 19), from the rows of one run: cached pairs/s >= 0.7x the uncached Sparton step at its largest
batch; the cached effective batch >= 16x the largest batch the materialising head fits.

On the GPU machine (peft installed: ``pip install 'gradcache_sparton[peft]'``):

    export PYTHONPATH=$PWD:$PYTHONPATH PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
    python benchmarks/bench_llm_step.py --shape qwen3-0.6b --training lora,full --out $OUT/llm

Writes ``llm_step.json`` (rewritten after every row) and ``llm_step.md`` to ``--out``; configurations
past ``--time_budget_s`` are skipped and named. ``--smoke`` runs a tiny shape on the CPU (numbers mean
nothing).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from transformers import AutoModelForCausalLM, LlamaConfig, PretrainedConfig, Qwen3Config

from benchmarks.common import run_stamp
from gradcache_sparton import CachedLoss, SpladeEncoder, SpladeLoss, SpladeLossConfig
from gradcache_sparton.kernels import splade_max_pool

SHAPES: dict[str, Callable[[], PretrainedConfig]] = {
    "qwen3-0.6b": lambda: Qwen3Config(
        vocab_size=151_936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
        max_position_embeddings=4096,
    ),
    "llama-3-8b": lambda: LlamaConfig(
        vocab_size=128_256, hidden_size=4096, intermediate_size=14_336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False, max_position_embeddings=8192,
        rope_parameters={"rope_type": "default", "rope_theta": 500_000.0},
    ),
    "llama-3.2-1b": lambda: LlamaConfig(
        vocab_size=128_256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True, max_position_embeddings=4096,
    ),
    "tiny": lambda: LlamaConfig(
        vocab_size=1000, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=True, max_position_embeddings=128,
    ),
}  # fmt: skip
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
LOSS = SpladeLossConfig(query_reg_weight=5e-4, doc_reg_weight=3e-4)


class MaterializingEncoder(nn.Module):
    """The SPLADE head as LLM SPLADE papers write it: ``lm_head``'s [B, S, V] logits, then max-pooling.
    Shares every parameter with ``encoder`` (it calls ``encoder.model``, the causal LM)."""

    def __init__(self, encoder: SpladeEncoder) -> None:
        super().__init__()
        self.encoder = encoder

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        logits = self.encoder.model(input_ids=input_ids, attention_mask=attention_mask).logits  # [B, S, V]
        special = torch.tensor(self.encoder.special_token_ids, dtype=input_ids.dtype, device=input_ids.device)
        pool = attention_mask.bool() & ~torch.isin(input_ids, special)  # the fused head's pool (BOS/EOS out)
        return splade_max_pool(logits, pool)  # [B, S, V] -> [B, V]


def build_encoder(shape: str, training: str, device: torch.device) -> SpladeEncoder:
    """The random-init decoder as a SpladeEncoder, every weight trainable (full) or LoRA adapters only."""
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with device:  # random init on the GPU: a 0.6B model initialised on the CPU takes tens of seconds
        model = AutoModelForCausalLM.from_config(SHAPES[shape](), dtype=dtype, attn_implementation="sdpa")
    if training == "lora":
        import peft

        peft.get_peft_model(model, peft.LoraConfig(r=16, lora_alpha=32, target_modules=LORA_TARGETS))
    return SpladeEncoder(model).to(device).train()


def pairs(
    batch: int, args: argparse.Namespace, vocab: int, device: torch.device
) -> dict[str, dict[str, Tensor]]:
    """(query, positive) columns of random token ids, no padding."""
    generator = torch.Generator(device=device).manual_seed(1234)
    columns = {}
    for column, length in (("query", args.query_len), ("positive", args.doc_len)):
        ids = torch.randint(0, vocab, (batch, length), device=device, generator=generator)
        columns[column] = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    return columns


def timed_steps(step: Callable[[], None], steps: int, device: torch.device) -> list[float]:
    """One warm-up step, then up to ``steps`` timed ones (seconds each)."""
    step()
    times = []
    for _ in range(steps):
        if device.type == "cuda":
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1000)
        else:
            began = time.perf_counter()
            step()
            times.append(time.perf_counter() - began)
    return times


def run_config(
    provider: str, training: str, batch: int, args: argparse.Namespace, device: torch.device
) -> dict[str, Any]:
    """One configuration's row: pairs/s and peak memory, or status OOM; its memory is freed after."""
    row: dict[str, Any] = {"provider": provider, "training": training, "batch": batch}
    row["mini_batch"] = args.mini_batch if provider == "cached-sparton" else None
    try:
        row.update(measure(provider, training, batch, args, device))
    except torch.OutOfMemoryError:
        row.update(status="OOM")
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def measure(
    provider: str, training: str, batch: int, args: argparse.Namespace, device: torch.device
) -> dict[str, Any]:
    """Build the model, optimizer and batch of one configuration and time its steps."""
    encoder = build_encoder(args.shape, training, device)
    loss_fn = SpladeLoss(LOSS)
    trainable = [p for p in encoder.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-5, fused=device.type == "cuda")
    columns = pairs(batch, args, encoder.vocab_size, device)
    cached = CachedLoss(encoder, loss_fn, mini_batch_size=args.mini_batch, check_replay=False)
    plain = MaterializingEncoder(encoder) if provider == "uncached-torch" else encoder
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")

    def step() -> None:
        with autocast:
            if provider == "cached-sparton":
                loss = cached(columns)
            else:
                loss, _ = loss_fn({name: plain(**features) for name, features in columns.items()})
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    median = statistics.median(timed_steps(step, args.steps, device))
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
    return {"status": "ok", "step_s": median, "pairs_per_s": batch / median, "peak_gib": peak}


def targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's two ratios per training mode, from this run's rows (None where a row is missing)."""
    found = []
    for training in sorted({r["training"] for r in rows}):
        ok = [r for r in rows if r["training"] == training and r["status"] == "ok"]
        cached = [r for r in ok if r["provider"] == "cached-sparton"]
        largest = {p: max((r for r in ok if r["provider"] == p), key=lambda r: r["batch"], default=None)
                   for p in ("uncached-sparton", "uncached-torch")}  # fmt: skip
        speed = (
            cached[0]["pairs_per_s"] / largest["uncached-sparton"]["pairs_per_s"]
            if cached and largest["uncached-sparton"]
            else None
        )
        batch = cached[0]["batch"] / largest["uncached-torch"]["batch"] if cached and largest["uncached-torch"] else None  # fmt: skip
        found += [
            {"training": training, "target": "cached / uncached Sparton (largest batch) pairs/s >= 0.7", "value": speed,
             "met": None if speed is None else speed >= 0.7},
            {"training": training, "target": "cached effective batch / largest materialising batch >= 16", "value": batch,
             "met": None if batch is None else batch >= 16,
             # No OOM: the search stopped at --max_uncached_batch, so the ratio is an upper bound.
             "materialising_search_hit_oom": any(r["provider"] == "uncached-torch" and r["training"] == training
                                                 and r["status"] == "OOM" for r in rows)},
        ]  # fmt: skip
    return found


def table(results: dict[str, Any]) -> str:
    stamp = results["stamp"]
    lines = [f"{stamp['device']}, torch {stamp['torch']}, triton {stamp['triton']}, {stamp['date']}: "
             f"`{results['command']}`", "",
             "| provider | training | batch | mini-batch | status | step s | pairs/s | peak GiB |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in results["rows"]:
        step = f"{r['step_s']:.3f}" if r["status"] == "ok" else "-"
        speed = f"{r['pairs_per_s']:,.0f}" if r["status"] == "ok" else "-"
        peak = f"{r['peak_gib']:.2f}" if r.get("peak_gib") is not None else "-"
        lines.append(f"| {r['provider']} | {r['training']} | {r['batch']:,} | {r['mini_batch'] or '-'} | "
                     f"{r['status']} | {step} | {speed} | {peak} |")  # fmt: skip
    lines += ["", "| training | target | value | met |", "|---|---|---|---|"]
    for t in results["targets"]:
        value = "-" if t["value"] is None else f"{t['value']:.2f}"
        if t.get("materialising_search_hit_oom") is False:
            value += " (no OOM up to --max_uncached_batch: an upper bound)"
        lines.append(f"| {t['training']} | {t['target']} | {value} | {t['met']} |")
    if results["skipped"]:
        lines += ["", f"skipped (time budget): {', '.join(results['skipped'])}"]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-0.6b")
    parser.add_argument("--training", default="lora,full", help="comma list of lora, full")
    parser.add_argument("--batch", type=int, default=1024, help="cached effective batch (pairs)")
    parser.add_argument("--mini_batch", type=int, default=32)
    parser.add_argument("--query_len", type=int, default=32)
    parser.add_argument("--doc_len", type=int, default=256)
    parser.add_argument("--max_uncached_batch", type=int, default=1024, help="stop the OOM search here")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--time_budget_s", type=float, default=540.0)
    parser.add_argument("--smoke", action="store_true", help="tiny shape on the CPU, batch 8, mini-batch 4")
    args = parser.parse_args()
    if args.smoke:
        args.shape, args.batch, args.mini_batch, args.query_len, args.doc_len = "tiny", 8, 4, 8, 16
        args.max_uncached_batch, args.steps = 4, 1
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    began = time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"stamp": run_stamp(device), "command": " ".join(sys.argv), "args": vars(args) | {"out": str(args.out)},
                               "rows": [], "targets": [], "skipped": []}  # fmt: skip
    plan = []
    for training in args.training.split(","):
        if training not in ("lora", "full"):
            parser.error(f"--training: unknown mode {training!r} (lora, full)")
        plan.append(("cached-sparton", training, [args.batch]))
        for provider, first in (("uncached-sparton", 8), ("uncached-torch", 1)):
            sizes, size = [], min(first, args.max_uncached_batch)
            while size <= args.max_uncached_batch:
                sizes.append(size)
                size *= 2
            plan.append((provider, training, sizes))
    for provider, training, sizes in plan:
        for batch in sizes:
            name = f"{provider}-{training}-b{batch}"
            if time.monotonic() - began > args.time_budget_s:
                results["skipped"].append(name)
                continue
            row = run_config(provider, training, batch, args, device)
            results["rows"].append(row)
            results["targets"] = targets(results["rows"])
            (args.out / "llm_step.json").write_text(json.dumps(results, indent=1) + "\n")
            print(json.dumps(row), flush=True)
            if row["status"] == "OOM":
                break  # larger batches of this provider only fail the same way
    (args.out / "llm_step.md").write_text(table(results))
    print(table(results), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
