"""max_memory against hand-tuned configurations and sentence-transformers' cached loss, on one GPU.

The workload and model of ``benchmarks/bench_real_workload.py`` (``benchmarks.real_workload``): steps of
1,024 (``--effective_batch``) SciFact (query, positive, negative_1) triplets, queries at most 64 tokens
and passages 256, the BERT-base-width 6-layer model with its decoder bias calibrated to
``--target_density`` non-zeros, the SPLADE loss, AdamW, bf16 autocast. Each configuration is a fresh model and optimizer running one provider's steps, in this
order (``--providers ours,st``, both by default, picks them):

  max_memory=<B>    ours (``CachedLoss``) with only ``max_memory`` set, for B in 2, 4, 8 GiB and auto
                    (unlimited: the device's free memory); the engine plans the rest on its first step;
  hand-tuned        ours, the best configurations recorded in issue 37's table: 16 and 32 rows under
                    CUDA graphs (lengths rounded to 32), 160 and 256 rows with activation checkpointing,
                    64-1,024 rows eagerly, and the whole batch keeping every graph (``mb1024+keep``:
                    ``keep_graphs``, an uncached step; it runs out of memory where that does not fit);
  st-mb<N>          sentence-transformers' ``CachedSpladeLoss`` over a ``SparseEncoder`` of the same
                    weights (``benchmarks.real_workload.steps.make_sentence_transformers``) at 16, 32, 64,
                    128, 256 and 512 rows per mini-batch, and 16 and 160 rows with activation
                    checkpointing (``st+ckpt-mb16``, ``st+ckpt-mb160``); run only where sentence-transformers is installed (otherwise
                    recorded as skipped, with a note).

Per configuration: two warm-up steps (the first plans, or records graphs), then ``--steps`` timed steps;
pairs/s from the median, and the peak memory from after the first step on (the planner's probe resets the
peak statistics inside the first step; the allocator's cache is emptied after it), weights, gradients and
AdamW state included: ``torch.cuda.max_memory_reserved``, what the steps hold on the device, and
``max_memory_allocated`` beside it; ``first_step_peak_reserved_gib`` is the first step's own (the
planner's probe and any graph recording included). The reserved peak is the one compared with budgets: once a CUDA graph
is recorded, its intermediates live in the graph's private pool, reserved and not allocated (16 rows under
graphs measured 1.98 GiB allocated); a configuration that runs out of memory is a row with status "OOM". Per budget:

  - our pairs/s with only max_memory over the best hand-tuned row whose peak fits the budget
    (unlimited: the best of all), and whether max_memory's own peak stayed within it;
  - our pairs/s with only max_memory over sentence-transformers' best row that fits the budget (where
    none of theirs fits: their row of smallest peak, labelled so); issue 37's target is >= 2.5x, PASS
    only where our peak also stayed within the budget.

Run from the repository root on the GPU machine:

    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True HF_HUB_OFFLINE=1 \\
        python -m benchmarks.bench_max_memory --out $OUT/max_memory

``--cap`` runs each ``max_memory=<size>`` row with the process capped at its budget
(``torch.cuda.set_per_process_memory_fraction``, lifted after the row): a row that runs out of memory
there is status "OOM", so the budget holds as a cap where every such row is "ok" (``capped`` in the row).
Without ``PYTORCH_CUDA_ALLOC_CONF`` the allocator's default (no expandable segments) is what is measured:

    HF_HUB_OFFLINE=1 python -m benchmarks.bench_max_memory --out $OUT/max_memory_cap --cap \\
        --only max_memory=2GiB,max_memory=4GiB,max_memory=8GiB --providers ours

At the defaults that is 22 configurations of 2 warm-up and 2 timed steps each; estimated from earlier
per-step times, about 7.5 minutes on an H100: about 4.5 for ours (14 rows of 0.6-3 s steps, model setup and
calibration included) and about 2.5 for sentence-transformers' (steps of 2-6 s; 512 rows run out of
memory on an 80 GB card, as ``mb1024+keep`` does: it held 118 GiB on an H200). ``--budget_s`` (480) records every configuration not started by then as
skipped, so a call ends within about 8 minutes. ``--smoke`` runs a tiny random model on a few rows on
the CPU in seconds (max_memory is ignored there with a warning; one sentence-transformers row where it
is installed): it checks the plumbing, its numbers mean nothing. Writes ``max_memory.json`` (rows,
ratios, run stamp) under ``--out``, rewritten after every configuration, and prints the ratios' table.
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
from benchmarks.harness import GiB, Step, StepTimer, autocast, free_memory, is_oom, name_list
from benchmarks.real_workload import configs as real_workload_configs
from benchmarks.real_workload.models import prepare_models, sentence_transformers_version
from benchmarks.real_workload.report import show
from benchmarks.real_workload.steps import LEARNING_RATE, make_sentence_transformers, splade_loss
from benchmarks.real_workload.workloads import (
    FULL,
    SMOKE,
    build_workload,
    read_scifact_pairs,
    scifact_triplets,
)
from gradcache_sparton import CachedLoss, SpladeEncoder
from gradcache_sparton.resources import default_tokenizer_path

__all__ = [
    "HAND_TUNED",
    "SENTENCE_TRANSFORMERS",
    "ST_TARGET",
    "Config",
    "configs",
    "main",
    "parse_args",
    "ratios",
    "st_reference",
]

BUDGETS = ("2GiB", "4GiB", "8GiB", "auto")
PROVIDERS = ("ours", "st")
ST_TARGET = 2.5  # issue 37: ours with only max_memory over sentence-transformers' best within the budget
REFERENCE_KINDS = {True: "best that fits", False: "none fits: smallest peak"}  # st_reference's flag


@dataclass(frozen=True)
class Config:
    """One row: ours with ``max_memory`` alone or a hand-tuned mini-batch, or sentence-transformers'
    cached loss ("st") at a mini-batch; with its options."""

    name: str
    max_memory: str | None = None
    mini_batch_size: int | None = None
    cuda_graphs: bool = False
    checkpointing: bool = False
    keep_graphs: bool = False
    provider: str = "ours"

    def options(self) -> dict[str, Any]:
        """CachedLoss's keyword arguments for this row (ours)."""
        if self.max_memory is not None:
            return {"max_memory": self.max_memory}
        options: dict[str, Any] = {"mini_batch_size": self.mini_batch_size, "keep_graphs": self.keep_graphs}
        if self.cuda_graphs:
            options.update(cuda_graphs=True, mini_batch_length_multiple=32)
        return options


HAND_TUNED = (
    Config("mb16+graphs", mini_batch_size=16, cuda_graphs=True),
    Config("mb32+graphs", mini_batch_size=32, cuda_graphs=True),
    Config("ckpt-mb160", mini_batch_size=160, checkpointing=True),
    Config("ckpt-mb256", mini_batch_size=256, checkpointing=True),
    *(Config(f"mb{n}", mini_batch_size=n) for n in (64, 128, 256, 512, 1024)),
    Config("mb1024+keep", mini_batch_size=1024, keep_graphs=True),
)
# The row most likely to run out of memory (512 rows: 48 GiB at 256 on an H100) last.
SENTENCE_TRANSFORMERS = (
    Config("st+ckpt-mb16", mini_batch_size=16, checkpointing=True, provider="st"),
    *(Config(f"st-mb{n}", mini_batch_size=n, provider="st") for n in (16, 32, 64, 128, 256)),
    Config("st+ckpt-mb160", mini_batch_size=160, checkpointing=True, provider="st"),
    Config("st-mb512", mini_batch_size=512, provider="st"),
)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for max_memory.json")
    parser.add_argument("--effective_batch", type=int, default=1024, help="pairs per step")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per configuration")
    parser.add_argument(
        "--providers",
        type=name_list(PROVIDERS),
        default=list(PROVIDERS),
        help="ours (max_memory and hand-tuned rows), st (sentence-transformers' rows), or both: ours,st",
    )
    parser.add_argument(
        "--budget_s", type=float, default=480.0, help="configurations not started by then are skipped"
    )
    parser.add_argument(
        "--target_density", type=float, default=0.02, help="rep non-zeros of the model's start"
    )
    parser.add_argument(
        "--only", type=lambda text: [n for n in text.split(",") if n], default=None,
        help="run only these configurations, by name (e.g. max_memory=4GiB,mb16+graphs); others are skipped",
    )  # fmt: skip
    parser.add_argument("--cap", action="store_true",
                        help="run each max_memory=<size> row with the process capped at its budget (CUDA)")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU (plumbing only)")
    args = parser.parse_args(argv)
    if args.effective_batch < 1 or args.steps < 1:
        parser.error("--effective_batch and --steps must be >= 1")
    known = [c.name for c in configs(args.smoke, True, args.providers)]
    unknown = sorted(set(args.only or ()) - set(known))
    if unknown:
        parser.error(f"--only: no configuration named {unknown}; these run: {known}")
    if not 0 < args.target_density < 1:
        parser.error(f"--target_density must be in (0, 1), got {args.target_density}")
    return args


def configs(smoke: bool, cuda: bool, providers: Sequence[str] = PROVIDERS) -> list[Config]:
    """The max_memory rows, the hand-tuned ones, then sentence-transformers' (smaller, without graphs and
    one of theirs for a CPU smoke run), of the chosen providers."""
    ours = [Config(f"max_memory={b}", max_memory=b) for b in BUDGETS]
    hand: Sequence[Config] = HAND_TUNED
    theirs: Sequence[Config] = SENTENCE_TRANSFORMERS
    if smoke:
        hand = (Config("mb4", mini_batch_size=4), Config("ckpt-mb8", mini_batch_size=8, checkpointing=True))
        theirs = (Config("st-mb4", mini_batch_size=4, provider="st"),)
    ours += [c for c in hand if cuda or not c.cuda_graphs]
    return (ours if "ours" in providers else []) + (list(theirs) if "st" in providers else [])


def make_ours(config: Config, path: Path, device: torch.device) -> tuple[Step, CachedLoss]:
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


def make_theirs(config: Config, path: Path, device: torch.device, batch: int) -> Step:
    """sentence-transformers' step for ``config``, built as the real-workload benchmark builds it."""
    shared = real_workload_configs.Config(
        "base",
        "scifact",
        "st",
        mini_batch=config.mini_batch_size,
        batch=batch,
        checkpointing=config.checkpointing,
    )
    step, _ = make_sentence_transformers(shared, path, device)
    return step


def measure(
    config: Config, path: Path, batches: list, device: torch.device, args: argparse.Namespace
) -> dict:
    """Two warm-up steps, ``args.steps`` timed ones; pairs/s, peak memory after the first step, the plan."""
    row: dict[str, Any] = asdict(config)
    cap = _cap_fraction(config, device) if args.cap else None
    if cap is not None:
        torch.cuda.set_per_process_memory_fraction(cap, device)
        row["capped"] = True
    try:
        cached = None
        if config.provider == "st":
            step = make_theirs(config, path, device, args.effective_batch)
        else:
            step, cached = make_ours(config, path, device)
        timer = StepTimer(device, Path(args.out))
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="max_memory=")  # the smoke run's CPU
            row["first_step_s"] = timer.timed(step, batches[0])
            if device.type == "cuda":
                row["first_step_peak_reserved_gib"] = torch.cuda.max_memory_reserved() / GiB
                # Cached blocks the first step freed go back, so the reserved peak that follows is what the
                # steps hold: their tensors, the allocator's rounding, and CUDA graphs' private pools (whose
                # intermediates are reserved but not allocated once a graph is recorded).
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            timer.timed(step, batches[1])
            times = [timer.timed(step, batches[2 + i]) for i in range(args.steps)]
        row.update(status="ok", step_s=times, pairs_per_s=args.effective_batch / statistics.median(times))
        if device.type == "cuda":
            row["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / GiB
            row["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / GiB
        plan = None if cached is None else cached.engine.memory_plan
        if plan is not None:
            row["plan"] = plan.describe()
            row["plan_values"] = plan.log_values()
        del step, cached
    except Exception as exc:  # one configuration's failure must not lose the others
        row["status"] = "OOM" if is_oom(exc) else f"error: {type(exc).__name__}: {exc}"[:400]
    finally:
        if cap is not None:
            torch.cuda.set_per_process_memory_fraction(1.0, device)
    free_memory(device)
    return row


def _cap_fraction(config: Config, device: torch.device) -> float | None:
    """The fraction of the device's memory that is ``config``'s ``max_memory`` size (None: not a size, or
    not CUDA): ``--cap`` limits the process to it."""
    if device.type != "cuda" or config.max_memory in (None, "auto"):
        return None
    from gradcache_sparton.engine.memory_size import size_bytes

    return min(1.0, size_bytes(config.max_memory) / torch.cuda.get_device_properties(device).total_memory)


def _peak(row: dict) -> float:
    """A row's peak GiB, the memory its steps hold on the device: the reserved peak (allocated tensors and
    CUDA graphs' pools, which ``max_memory_allocated`` misses after recording), else the allocated one (an
    older result); 0 where none was measured (the CPU), so every row fits every budget there."""
    return row.get("peak_reserved_gib", row.get("peak_allocated_gib", 0.0))


def st_reference(rows: Sequence[dict], limit_gib: float | None) -> tuple[dict | None, bool]:
    """sentence-transformers' row to compare with under ``limit_gib`` (None: unlimited): its fastest
    measured row whose peak fits, and True; where none fits, its row of smallest peak, and False; (None,
    False) where none of its rows was measured."""
    theirs = [r for r in rows if r.get("status") == "ok" and r.get("provider") == "st"]
    fitting = [r for r in theirs if limit_gib is None or _peak(r) <= limit_gib]
    if fitting:
        return max(fitting, key=lambda r: r["pairs_per_s"]), True
    return min(theirs, key=_peak, default=None), False


def ratios(rows: Sequence[dict]) -> list[dict]:
    """Per budget: max_memory's pairs/s over the best hand-tuned row whose peak fits (unlimited: of all),
    and over sentence-transformers' reference row (``st_reference``) with issue 37's target of 2.5x."""
    measured = [r for r in rows if r.get("status") == "ok"]
    hand = [r for r in measured if r.get("provider", "ours") == "ours" and r["max_memory"] is None]
    results = []
    for budget in BUDGETS:
        ours = next((r for r in measured if r["max_memory"] == budget), None)
        limit = None if budget == "auto" else float(budget.removesuffix("GiB"))
        fitting = [r for r in hand if limit is None or _peak(r) <= limit]
        best = max(fitting, key=lambda r: r["pairs_per_s"], default=None)
        within = (
            None
            if ours is None or limit is None or "peak_allocated_gib" not in ours
            else _peak(ours) <= limit
        )
        theirs, fits = st_reference(measured, limit)
        vs_st = None if ours is None or theirs is None else ours["pairs_per_s"] / theirs["pairs_per_s"]
        status = "n/a"
        if vs_st is not None:  # over its budget, ours missed the target within it, whatever its speed
            status = "PASS" if vs_st >= ST_TARGET and within is not False else "MISS"
        results.append(
            {
                "budget": "unlimited (auto)" if limit is None else budget,
                "max_memory_pairs_per_s": None if ours is None else ours["pairs_per_s"],
                "max_memory_peak_gib": None if ours is None else _peak(ours),
                "within_budget": within,
                "best_hand_tuned": None if best is None else best["name"],
                "best_hand_tuned_pairs_per_s": None if best is None else best["pairs_per_s"],
                "ratio": None if ours is None or best is None else ours["pairs_per_s"] / best["pairs_per_s"],
                "st_reference": None if theirs is None else theirs["name"],
                "st_reference_kind": None if theirs is None else REFERENCE_KINDS[fits],
                "st_pairs_per_s": None if theirs is None else theirs["pairs_per_s"],
                "st_peak_gib": None if theirs is None else _peak(theirs),
                "ratio_vs_st": vs_st,
                "target_vs_st": ST_TARGET,
                "status_vs_st": status,
            }
        )
    return results


def _cell(value: object, fmt: str = "{:.2f}") -> str:
    return "-" if value is None else fmt.format(value) if isinstance(value, float) else str(value)


def _cells(r: dict) -> list[str]:
    """One budget's line of the printed table."""
    hand = (
        "-"
        if r["best_hand_tuned"] is None
        else f"{r['best_hand_tuned']} {r['best_hand_tuned_pairs_per_s']:.0f}"
    )
    theirs = "-" if r["st_reference"] is None else f"{r['st_reference']} ({r['st_reference_kind']})"
    return [
        r["budget"], _cell(r["max_memory_pairs_per_s"], "{:.0f}"), _cell(r["max_memory_peak_gib"]),
        _cell(r["within_budget"]), hand, _cell(r["ratio"]), theirs, _cell(r["st_pairs_per_s"], "{:.0f}"),
        _cell(r["st_peak_gib"]), _cell(r["ratio_vs_st"]), f">= {r['target_vs_st']}x", r["status_vs_st"],
    ]  # fmt: skip


def print_ratios(results: Sequence[dict]) -> None:
    """The per-budget table: ours with only max_memory, the best hand-tuned row, sentence-transformers'."""
    head = ["budget", "max_memory pairs/s", "peak GiB", "within", "best hand-tuned", "ratio",
            "sentence-transformers", "their pairs/s", "their GiB", "vs theirs", "target", "status"]  # fmt: skip
    show(head, [_cells(r) for r in results])


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    start = time.monotonic()
    # An indexed device: set_per_process_memory_fraction (--cap) refuses a bare "cuda".
    device = torch.device("cuda", 0) if torch.cuda.is_available() and not args.smoke else torch.device("cpu")
    if device.type == "cpu" and not args.smoke:
        print("no GPU: this benchmark needs one (use --smoke for a CPU check)", file=sys.stderr)
        return 2
    st_version = sentence_transformers_version()
    if "st" in args.providers and st_version is None:
        print("sentence-transformers is not installed: its rows are skipped", flush=True)
    scale = SMOKE if args.smoke else FULL
    tokenizer = AutoTokenizer.from_pretrained(default_tokenizer_path())
    n_batches = args.steps + 2
    triplets = scifact_triplets(read_scifact_pairs(), args.seed)[: args.effective_batch * n_batches]
    workload = build_workload("scifact", triplets, tokenizer, scale, args.effective_batch, n_batches, device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model_args = argparse.Namespace(
        models=["base"], smoke=args.smoke, seed=args.seed, target_density=args.target_density,
        model_path=None, providers=args.providers,
    )  # fmt: skip
    rows: list[dict] = []
    meta = {
        **run_stamp(device),
        "sentence_transformers": st_version,
        "args": vars(args),
        "command": " ".join(sys.argv),
    }
    with tempfile.TemporaryDirectory(prefix="bench_max_memory_") as tmp:
        models = prepare_models(model_args, scale, tokenizer, [workload], Path(tmp), device)
        path, meta["model"] = models["base"]
        for config in configs(args.smoke, device.type == "cuda", args.providers):
            if args.only is not None and config.name not in args.only:
                continue
            if config.provider == "st" and st_version is None:
                rows.append({**asdict(config), "status": "skipped (sentence-transformers not installed)"})
                continue
            if time.monotonic() - start > args.budget_s:
                rows.append({**asdict(config), "status": "skipped (time budget)"})
                continue
            row = measure(config, path, workload.batches, device, args)
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "plan_values"}), flush=True)
            summary = {"meta": meta, "rows": rows, "ratios": ratios(rows)}
            (out / "max_memory.json").write_text(json.dumps(summary, indent=1, default=str))
    results = ratios(rows)
    (out / "max_memory.json").write_text(
        json.dumps({"meta": meta, "rows": rows, "ratios": results}, indent=1, default=str)
    )
    print()
    print_ratios(results)
    print(f"{meta['device']}: {time.monotonic() - start:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
