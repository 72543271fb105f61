"""max_memory against hand-tuned configurations: real text at effective batch 1,024 on one GPU.

The workload and model of ``benchmarks/bench_real_workload.py`` (``benchmarks.real_workload``): SciFact
(query, positive, negative_1) triplets, queries at most 64 tokens and passages 256, the BERT-base-width
6-layer model with its decoder bias calibrated to ``--target_density`` non-zeros, the SPLADE loss, AdamW,
bf16 autocast. Each configuration is a fresh model and optimizer running ``CachedLoss`` steps:

  max_memory=<B>    only ``max_memory`` set, for B in 2, 4, 8 GiB and auto (unlimited: the device's
                    free memory); the engine plans the rest on its first step;
  hand-tuned        the best configurations recorded in issue 37's table: 16 and 32 rows under CUDA
                    graphs (lengths rounded to 32), 160 and 256 rows with activation checkpointing, and
                    64, 128, 256 and 512 rows eagerly.

Per configuration: two warm-up steps (the first plans, or records graphs), then up to ``--steps`` timed
steps; pairs/s from the median, and the peak ``torch.cuda.max_memory_allocated`` from after the first
step on (the planner's probe resets the peak statistics inside the first step), weights, gradients and
AdamW state included. Per budget: our pairs/s with only max_memory over the best hand-tuned row whose
peak fits the budget (unlimited: the best of all), and whether max_memory's own peak stayed within it.

Run from the repository root on the GPU machine (about 4 minutes on an H100 at the defaults):

    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True HF_HUB_OFFLINE=1 \\
        python -m benchmarks.bench_max_memory --out $OUT/max_memory

``--budget_s`` (480) records every configuration not started by then as skipped. ``--smoke`` runs a tiny
random model on a few rows on the CPU in seconds (max_memory is ignored there with a warning): it checks
the plumbing, its numbers mean nothing. Writes ``max_memory.json`` (rows, ratios, run stamp) under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from transformers import AutoTokenizer

from benchmarks.common import run_stamp
from benchmarks.harness import GiB, StepTimer, autocast, free_memory, is_oom
from benchmarks.real_workload.models import prepare_models
from benchmarks.real_workload.steps import LEARNING_RATE, splade_loss
from benchmarks.real_workload.workloads import (
    FULL,
    SMOKE,
    build_workload,
    read_scifact_pairs,
    scifact_triplets,
)
from gradcache_sparton import CachedLoss, SpladeEncoder
from gradcache_sparton.resources import default_tokenizer_path

__all__ = ["HAND_TUNED", "Config", "main", "parse_args", "ratios"]

BUDGETS = ("2GiB", "4GiB", "8GiB", "auto")


@dataclass(frozen=True)
class Config:
    """One row: ``max_memory`` alone, or a hand-tuned mini-batch with its options."""

    name: str
    max_memory: str | None = None
    mini_batch_size: int | None = None
    cuda_graphs: bool = False
    checkpointing: bool = False

    def options(self) -> dict[str, Any]:
        """CachedLoss's keyword arguments for this row."""
        if self.max_memory is not None:
            return {"max_memory": self.max_memory}
        options: dict[str, Any] = {"mini_batch_size": self.mini_batch_size}
        if self.cuda_graphs:
            options.update(cuda_graphs=True, mini_batch_length_multiple=32)
        return options


HAND_TUNED = (
    Config("mb16+graphs", mini_batch_size=16, cuda_graphs=True),
    Config("mb32+graphs", mini_batch_size=32, cuda_graphs=True),
    Config("ckpt-mb160", mini_batch_size=160, checkpointing=True),
    Config("ckpt-mb256", mini_batch_size=256, checkpointing=True),
    *(Config(f"mb{n}", mini_batch_size=n) for n in (64, 128, 256, 512)),
)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for max_memory.json")
    parser.add_argument("--effective_batch", type=int, default=1024, help="pairs per step")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per configuration")
    parser.add_argument(
        "--budget_s", type=float, default=480.0, help="configurations not started by then are skipped"
    )
    parser.add_argument(
        "--target_density", type=float, default=0.02, help="rep non-zeros of the model's start"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU (plumbing only)")
    args = parser.parse_args(argv)
    if args.effective_batch < 1 or args.steps < 1:
        parser.error("--effective_batch and --steps must be >= 1")
    if not 0 < args.target_density < 1:
        parser.error(f"--target_density must be in (0, 1), got {args.target_density}")
    return args


def configs(smoke: bool, cuda: bool) -> list[Config]:
    """The max_memory rows, then the hand-tuned ones (smaller and without graphs for a CPU smoke run)."""
    rows = [Config(f"max_memory={b}", max_memory=b) for b in BUDGETS]
    hand = HAND_TUNED
    if smoke:
        hand = (Config("mb4", mini_batch_size=4), Config("ckpt-mb8", mini_batch_size=8, checkpointing=True))
    return rows + [c for c in hand if cuda or not c.cuda_graphs]


def make_step(config: Config, path: Path, device: torch.device) -> tuple[Any, CachedLoss]:
    """A fresh model, AdamW and CachedLoss for ``config``; the step over one batch."""
    encoder = SpladeEncoder.from_pretrained(path).to(device).train()
    if config.checkpointing:
        encoder.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    optimizer = torch.optim.AdamW(encoder.parameters(), lr=LEARNING_RATE, fused=device.type == "cuda")
    cached = CachedLoss(encoder, splade_loss(), **config.options())

    def step(columns: dict[str, dict[str, Tensor]]) -> None:
        with autocast(device):
            cached(columns).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step, cached


def measure(
    config: Config, path: Path, batches: list, device: torch.device, args: argparse.Namespace
) -> dict:
    """Two warm-up steps, ``args.steps`` timed ones; pairs/s, peak memory after the first step, the plan."""
    row: dict[str, Any] = asdict(config)
    try:
        step, cached = make_step(config, path, device)
        timer = StepTimer(device, Path(args.out))
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="max_memory=")  # the smoke run's CPU
            row["first_step_s"] = timer.timed(step, batches[0])
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            timer.timed(step, batches[1])
            times = [timer.timed(step, batches[2 + i]) for i in range(args.steps)]
        row.update(status="ok", step_s=times, pairs_per_s=args.effective_batch / statistics.median(times))
        if device.type == "cuda":
            row["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / GiB
        plan = cached.engine.memory_plan
        if plan is not None:
            row["plan"] = plan.describe()
            row["plan_values"] = plan.log_values()
        del step, cached
    except Exception as exc:  # one configuration's failure must not lose the others
        row["status"] = "OOM" if is_oom(exc) else f"error: {type(exc).__name__}: {exc}"[:400]
    free_memory(device)
    return row


def ratios(rows: Sequence[dict]) -> list[dict]:
    """Per budget: max_memory's pairs/s over the best hand-tuned row whose peak fits (unlimited: of all)."""
    measured = [r for r in rows if r.get("status") == "ok"]
    hand = [r for r in measured if r["max_memory"] is None]
    results = []
    for budget in BUDGETS:
        ours = next((r for r in measured if r["max_memory"] == budget), None)
        limit = None if budget == "auto" else float(budget.removesuffix("GiB"))
        fitting = [r for r in hand if limit is None or r.get("peak_allocated_gib", 0.0) <= limit]
        best = max(fitting, key=lambda r: r["pairs_per_s"], default=None)
        results.append(
            {
                "budget": "unlimited (auto)" if limit is None else budget,
                "max_memory_pairs_per_s": None if ours is None else ours["pairs_per_s"],
                "max_memory_peak_gib": None if ours is None else ours.get("peak_allocated_gib"),
                "within_budget": None
                if ours is None or limit is None or "peak_allocated_gib" not in ours
                else ours["peak_allocated_gib"] <= limit,
                "best_hand_tuned": None if best is None else best["name"],
                "best_hand_tuned_pairs_per_s": None if best is None else best["pairs_per_s"],
                "ratio": None if ours is None or best is None else ours["pairs_per_s"] / best["pairs_per_s"],
            }
        )
    return results


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    start = time.monotonic()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    if device.type == "cpu" and not args.smoke:
        print("no GPU: this benchmark needs one (use --smoke for a CPU check)", file=sys.stderr)
        return 2
    scale = SMOKE if args.smoke else FULL
    tokenizer = AutoTokenizer.from_pretrained(default_tokenizer_path())
    n_batches = args.steps + 2
    triplets = scifact_triplets(read_scifact_pairs(), args.seed)[: args.effective_batch * n_batches]
    workload = build_workload("scifact", triplets, tokenizer, scale, args.effective_batch, n_batches, device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model_args = argparse.Namespace(
        models=["base"], smoke=args.smoke, seed=args.seed, target_density=args.target_density,
        model_path=None, providers=["ours"],
    )  # fmt: skip
    rows: list[dict] = []
    meta = {**run_stamp(device), "args": vars(args), "command": " ".join(sys.argv)}
    with tempfile.TemporaryDirectory(prefix="bench_max_memory_") as tmp:
        models = prepare_models(model_args, scale, tokenizer, [workload], Path(tmp), device)
        path, meta["model"] = models["base"]
        for config in configs(args.smoke, device.type == "cuda"):
            if time.monotonic() - start > args.budget_s:
                rows.append({**asdict(config), "status": "skipped (time budget)"})
                continue
            row = measure(config, path, workload.batches, device, args)
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "plan_values"}), flush=True)
            summary = {"meta": meta, "rows": rows, "ratios": ratios(rows)}
            (out / "max_memory.json").write_text(json.dumps(summary, indent=1, default=str))
    for result in ratios(rows):
        print(json.dumps(result), flush=True)
    print(f"{meta['device']}: {time.monotonic() - start:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
