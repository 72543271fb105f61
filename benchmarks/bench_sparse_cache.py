"""Dense against sparse rep caches: effective batch against peak memory, and throughput (issue 18).

Legend: B effective batch (triplets), mb mini-batch, S sequence, D hidden, V vocabulary, nnz non-zeros.

One step, for both caches: ``GradCache(encoder, mini_batch_size=mb, sparse_reps=...).step(columns,
SpladeLoss)`` under bf16 autocast (fp32 on a CPU), then AdamW (fused on CUDA) ``step`` and ``zero_grad``.
SpladeLoss is InfoNCE over in-batch and hard negatives (temperature 1) with FLOPS regularizers (query
5e-4, document 3e-4). Caches:

  dense     ``sparse_reps=False``: Step (1) keeps every rep as a [B, V] row (bf16 under autocast, the
            loss upcasts to fp32), Step (2)'s gradients are [B, V] fp32;
  sparse    ``sparse_reps=True``: Step (1) keeps each mini-batch's reps as their non-zeros (int32 ids,
            bf16 weights), Step (2) runs on them and keeps gradients only there (losses/sparse.py).

Model: BERT-base width (D 768, 12 heads, FFN 3,072, 6 layers), random init at each V of ``--vocabs``,
with the decoder bias set so that the reps of the benchmark's text have ``--target_density``
non-zeros (``benchmarks.real_workload.models.calibrate_decoder_bias``: trained SPLADE models have
1-3%). The measured non-zeros per row are recorded. Data: the shipped SciFact sample's (claim,
abstract, another abstract) triplets (``benchmarks.real_workload.workloads.scifact_triplets``, 3,204
rows), queries cut at 32 tokens and passages at 256, tokenized once; a batch of B triplets takes row
i mod 3,204 for i < B, so every rep is one of real text and the non-zeros are real text's (duplicate
rows change no cost).

Configurations: for each V, each B of ``--batches`` (``--batches_v250k`` at V >= 100,000) with each
cache of ``--caches``; the dense cache stops at ``--dense_max_batch`` (it needs ~8·3·B·V bytes for
reps and gradients: 45 GiB at 32,768 on V = 30,522, too much at 65,536). Each configuration: a fresh
encoder from the same initial weights, a fresh optimizer, one step (``--timed_steps`` + 1 at the
batches of ``--throughput_batches``, the first a warm-up: kernels compiled, AdamW state allocated).
Peak memory is ``torch.cuda.max_memory_allocated`` over all its steps (weights, gradients, AdamW state,
inputs and cache); the step time is the median of the steps after the first (the first alone when it
is the only one). Out of memory: a row with status "OOM". A configuration not started within
``--time_budget_s`` is "skipped".

``--loss_only_batches``: Step (2) alone, SpladeLoss forward and backward on sparse reps of B triplets
synthesized with the model's measured non-zeros per row (random sorted ids, random positive bf16
weights), to time the loss, whose block products grow as B², apart from the encoder, which grows as B.

Run on the GPU machine from the repository root:

    export PYTHONPATH=$PWD:$PYTHONPATH PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True HF_HUB_OFFLINE=1
    python benchmarks/bench_sparse_cache.py --output_dir $OUT/sparse_cache

It writes ``sparse_cache.json`` (rows, targets, device, versions, date; rewritten after every
configuration) and ``sparse_cache.md`` (and a plot with matplotlib). ``--smoke`` runs a tiny model
at tiny batches on a CPU; its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from transformers import AutoTokenizer

from benchmarks.common import headless_pyplot, run_stamp
from benchmarks.harness import autocast, free_memory, int_list, is_oom, measured_row, name_list
from benchmarks.real_workload.models import calibrate_decoder_bias, nonzeros_per_row, random_model
from benchmarks.real_workload.steps import splade_loss
from benchmarks.real_workload.workloads import (
    COLUMNS,
    FULL,
    SCIFACT_TRAIN,
    SMOKE,
    read_scifact_pairs,
    scifact_triplets,
    take_rows,
    tokenize_rows,
)
from gradcache_sparton import GradCache, SpladeEncoder
from gradcache_sparton.evaluation import SparseReps
from gradcache_sparton.resources import default_tokenizer_path

GiB = 2**30
LARGE_VOCAB = 100_000  # V at or above this takes --batches_v250k
# Issue 18's targets.
V250K_BATCH, V250K_MAX_GIB = 4096, 16.0
THROUGHPUT_BATCH, THROUGHPUT_MIN = 8192, 0.95
HUGE_BATCH = 262_144

Columns = dict[str, dict[str, Tensor]]


def batch_of(rows: Columns, batch: int, device: torch.device) -> Columns:
    """B triplets: row i of ``rows`` (tokenized once, on the CPU) mod its length, on ``device``."""
    n = rows["query"]["input_ids"].shape[0]
    index = torch.arange(batch) % n
    return take_rows(
        {
            c: {name: value[index].to(device) for name, value in features.items()}
            for c, features in rows.items()
        },
        batch,
    )


class Bench:
    """One model (per V) at a time: its initial weights, and configurations run from them."""

    def __init__(self, args: argparse.Namespace, device: torch.device, rows: Columns) -> None:
        self.args = args
        self.device = device
        self.cuda = device.type == "cuda"
        self.rows = rows
        self.loss_fn = splade_loss()
        self.state: dict[str, Tensor] = {}
        self.encoder: SpladeEncoder | None = None

    def prepare(self, vocab: int, scale: Any) -> dict[str, Any]:
        """Build the random-init model at ``vocab`` with its bias calibrated; what was measured about it."""
        self.encoder = None
        free_memory(self.device)
        model = random_model(scale, vocab, self.args.seed).to(self.device).eval()
        sample = take_rows(self.rows, scale.calibration_rows)
        sample = {c: {k: v.to(self.device) for k, v in f.items()} for c, f in sample.items()}
        bias = calibrate_decoder_bias(model, [sample[c] for c in COLUMNS], self.args.target_density)
        encoder = SpladeEncoder(model).to(self.device)
        # On the host: a device copy would count in every configuration's peak memory.
        self.state = {k: v.detach().to("cpu", copy=True) for k, v in encoder.state_dict().items()}
        self.encoder = encoder
        nnz = nonzeros_per_row(encoder, sample)
        return {"vocab": vocab, "decoder_bias": bias, "nnz_per_row": nnz,
                "density": {c: n / vocab for c, n in nnz.items()}}  # fmt: skip

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def measure(self, cache: str, batch: int, steps: int) -> dict[str, Any]:
        assert self.encoder is not None
        encoder = self.encoder
        encoder.load_state_dict(self.state)
        encoder.train()
        optimizer = torch.optim.AdamW(encoder.parameters(), lr=1e-5, fused=self.cuda)
        engine = GradCache(encoder, mini_batch_size=self.args.mini_batch, sparse_reps=cache == "sparse")
        columns = batch_of(self.rows, batch, self.device)
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        times, losses = [], []
        for _ in range(steps):
            self.sync()
            start = time.perf_counter()
            with autocast(self.device):
                output = engine.step(columns, self.loss_fn)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            self.sync()
            times.append(time.perf_counter() - start)
            losses.append(float(output.loss))
        timed = times[1:] or times
        row: dict[str, Any] = {"step_s": times, "step_s_median": statistics.median(timed),
                               "pairs_per_s": batch / statistics.median(timed), "loss": losses}  # fmt: skip
        if self.cuda:
            row["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / GiB
            row["inputs_and_weights_gib"] = base / GiB
        del optimizer, engine, columns
        return row

    def run(self, vocab: int, cache: str, batch: int, steps: int) -> dict[str, Any]:
        row: dict[str, Any] = {
            "vocab": vocab,
            "cache": cache,
            "batch": batch,
            "mini_batch": self.args.mini_batch,
        }
        return measured_row(row, lambda: self.measure(cache, batch, steps), self.device)


def synthetic_sparse(rows: int, nnz: int, vocab: int, device: torch.device, seed: int) -> SparseReps:
    """``rows`` sparse reps of ``nnz`` distinct random ids each (ascending) and random bf16 weights in [0.05, 2)."""
    generator = torch.Generator(device=device).manual_seed(seed)
    ids = []
    for start in range(0, rows, 4096):  # [4,096, V] random keys at a time
        keys = torch.rand(min(4096, rows - start), vocab, device=device, generator=generator)
        ids.append(keys.topk(nnz, dim=1).indices.sort(dim=1).values.to(torch.int32))
    token_ids = torch.cat(ids).flatten()
    weights = (torch.rand(token_ids.numel(), device=device, generator=generator) * 1.95 + 0.05).to(
        torch.bfloat16
    )
    offsets = torch.arange(rows + 1, device=device, dtype=torch.int64) * nnz
    return SparseReps(offsets, token_ids, weights, vocab)


def time_loss_only(bench: Bench, vocab: int, batch: int, nnz: dict[str, float]) -> dict[str, Any]:
    """Step (2) alone on synthetic sparse reps of ``batch`` triplets: SpladeLoss forward and backward."""
    row: dict[str, Any] = {"vocab": vocab, "cache": "loss-only", "batch": batch, "mini_batch": None}
    try:
        columns = {
            c: synthetic_sparse(batch, round(nnz[c]), vocab, bench.device, seed=i)
            for i, c in enumerate(COLUMNS)
        }
        leaves = {c: x.weights.clone().requires_grad_() for c, x in columns.items()}
        reps = {c: SparseReps(x.offsets, x.token_ids, leaves[c], vocab) for c, x in columns.items()}
        if bench.cuda:
            torch.cuda.reset_peak_memory_stats()
        bench.sync()
        start = time.perf_counter()
        with autocast(bench.device):
            loss, _ = bench.loss_fn(reps)
        loss.backward()
        bench.sync()
        seconds = time.perf_counter() - start
        row.update(
            {"step_s": [seconds], "step_s_median": seconds, "pairs_per_s": batch / seconds, "status": "ok"}
        )
        if bench.cuda:
            row["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / GiB
    except Exception as exc:  # keep the other rows
        row["status"] = "OOM" if is_oom(exc) else f"error: {type(exc).__name__}: {exc}"[:300]
        if not is_oom(exc):
            traceback.print_exc()
    free_memory(bench.device)
    return row


def plan(args: argparse.Namespace) -> list[tuple[int, str, int]]:
    """(V, cache, B) in run order: per V, growing B, dense before sparse."""
    out = []
    for vocab in args.vocabs:
        batches = args.batches_v250k if vocab >= LARGE_VOCAB else args.batches
        for batch in batches:
            for cache in args.caches:
                if cache == "dense" and batch > args.dense_max_batch:
                    continue
                out.append((vocab, cache, batch))
    return out


def evaluate_targets(rows: list[dict]) -> list[dict]:
    """Issue 18's targets from this run's rows (ratios within the run)."""

    def ok(**match: Any) -> dict | None:
        found = [r for r in rows if r["status"] == "ok" and all(r.get(k) == v for k, v in match.items())]
        return found[-1] if found else None

    targets = []
    sparse_rows = [
        r for r in rows if r["status"] == "ok" and r["cache"] == "sparse" and r["vocab"] < LARGE_VOCAB
    ]
    largest = max(sparse_rows, key=lambda r: r["batch"], default=None)
    targets.append({
        "target": f"effective {HUGE_BATCH:,} triplets in one step on one GPU",
        "measured": "largest sparse step run: " + (
            f"B = {largest['batch']:,}, {largest.get('peak_allocated_gib', float('nan')):.1f} GiB" if largest else "none"),
        "passed": bool(largest and largest["batch"] >= HUGE_BATCH),
    })  # fmt: skip
    big = [r for r in rows if r["status"] == "ok" and r["vocab"] >= LARGE_VOCAB and r["batch"] == V250K_BATCH]
    sparse_big = next((r for r in big if r["cache"] == "sparse"), None)
    peak = sparse_big.get("peak_allocated_gib") if sparse_big else None
    targets.append({
        "target": f"V >= {LARGE_VOCAB:,}: effective {V250K_BATCH:,} in under {V250K_MAX_GIB:.0f} GiB",
        "measured": "not run" if peak is None else f"sparse {peak:.2f} GiB",
        "passed": None if peak is None else peak < V250K_MAX_GIB,
    })  # fmt: skip
    dense = ok(cache="dense", batch=THROUGHPUT_BATCH)
    sparse = ok(cache="sparse", batch=THROUGHPUT_BATCH)
    ratio = sparse["pairs_per_s"] / dense["pairs_per_s"] if dense and sparse else None
    targets.append({
        "target": f"throughput at {THROUGHPUT_BATCH:,}: sparse >= {THROUGHPUT_MIN}x dense",
        "measured": "not run" if ratio is None else f"{sparse['pairs_per_s']:.0f} / {dense['pairs_per_s']:.0f} pairs/s = {ratio:.3f}",
        "passed": None if ratio is None else ratio >= THROUGHPUT_MIN,
    })  # fmt: skip
    return targets


def markdown(meta: dict, models: list[dict], rows: list[dict], targets: list[dict]) -> str:
    lines = [
        f"{meta['device']}, torch {meta['torch']}, triton {meta['triton']}, {meta['date']}: `{meta['command']}`",
        "",
    ]
    lines += ["| V | decoder bias | nnz per query / positive / negative |", "|---|---|---|"]
    for m in models:
        nnz = " / ".join(f"{m['nnz_per_row'][c]:.0f}" for c in COLUMNS)
        lines.append(f"| {m['vocab']:,} | {m['decoder_bias']:.3f} | {nnz} |")
    lines += ["", "| V | cache | B | step s | pairs/s | peak GiB | status |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        cells = ("-", "-", "-")
        if r["status"] == "ok":
            peak = r.get("peak_allocated_gib")
            cells = (
                f"{r['step_s_median']:.2f}",
                f"{r['pairs_per_s']:,.0f}",
                "-" if peak is None else f"{peak:.2f}",
            )
        lines.append(
            f"| {r['vocab']:,} | {r['cache']} | {r['batch']:,} | {' | '.join(cells)} | {r['status']} |"
        )
    lines += ["", "| target | measured | status |", "|---|---|---|"]
    for t in targets:
        status = {True: "met", False: "missed", None: "not run"}[t["passed"]]
        lines.append(f"| {t['target']} | {t['measured']} | {status} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> str:
    """Peak memory against effective batch, one series per (V, cache)."""
    plt = headless_pyplot()
    if plt is None:
        return "matplotlib is not installed: no plot"
    done = [r for r in rows if r["status"] == "ok" and "peak_allocated_gib" in r]
    if not done:
        return "no rows with peak memory: no plot"
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for vocab in sorted({r["vocab"] for r in done}):
        for cache, style in (("dense", "o--"), ("sparse", "s-")):
            series = sorted(
                (r for r in done if r["vocab"] == vocab and r["cache"] == cache), key=lambda r: r["batch"]
            )
            if series:
                ax.plot([r["batch"] for r in series], [r["peak_allocated_gib"] for r in series], style,
                        label=f"{cache} cache, V = {vocab:,}")  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.set_xlabel("effective batch (triplets)")
    ax.set_ylabel("peak allocated GiB")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"plot: {path}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output_dir", type=Path, required=True)
    parser.add_argument("--vocabs", type=int_list, default=[250_002, 30522])
    parser.add_argument("--batches", type=int_list, default=[1024, 4096, 8192, 16384, 32768, 65536])
    parser.add_argument("--batches_v250k", type=int_list, default=[1024, 4096])
    parser.add_argument("--caches", type=name_list(("dense", "sparse")), default=["dense", "sparse"])
    parser.add_argument("--dense_max_batch", type=int, default=32768)
    parser.add_argument("--throughput_batches", type=int_list, default=[THROUGHPUT_BATCH])
    parser.add_argument("--timed_steps", type=int, default=2)
    parser.add_argument("--loss_only_batches", type=int_list, default=[],
                        help="also time SpladeLoss alone on synthetic sparse reps of these many triplets")  # fmt: skip
    parser.add_argument("--mini_batch", type=int, default=128)
    parser.add_argument("--target_density", type=float, default=0.02)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--time_budget_s", type=float, default=540.0)
    parser.add_argument("--smoke", action="store_true", help="tiny model and batches on a CPU")
    args = parser.parse_args(argv)
    if args.smoke:
        args.vocabs = [v for v in args.vocabs if v < LARGE_VOCAB] or [30522]
        args.batches, args.throughput_batches, args.mini_batch = [8, 16], [16], 4
        args.dense_max_batch = min(args.dense_max_batch, 16)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    start = time.monotonic()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    scale = dataclasses.replace(SMOKE if args.smoke else FULL, query_max_len=32 if not args.smoke else 8)
    tokenizer = AutoTokenizer.from_pretrained(default_tokenizer_path())
    triplets = scifact_triplets(read_scifact_pairs(SCIFACT_TRAIN), seed=args.seed)
    rows = tokenize_rows(triplets[:64] if args.smoke else triplets, tokenizer, scale, torch.device("cpu"))
    meta = {**run_stamp(device), "command": " ".join(sys.argv), "args": {k: str(v) for k, v in vars(args).items()},
            "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")}  # fmt: skip
    bench = Bench(args, device, rows)
    models: list[dict] = []
    results: list[dict] = []
    out = args.output_dir
    out.mkdir(parents=True, exist_ok=True)

    def save() -> list[dict]:
        targets = evaluate_targets(results)
        (out / "sparse_cache.json").write_text(
            json.dumps({"meta": meta, "models": models, "rows": results, "targets": targets}, indent=1)
        )
        (out / "sparse_cache.md").write_text(markdown(meta, models, results, targets))
        return targets

    oom_from: dict[tuple[int, str], int] = {}
    current_vocab = None
    for vocab, cache, batch in plan(args):
        if time.monotonic() - start > args.time_budget_s:
            results.append({"vocab": vocab, "cache": cache, "batch": batch, "status": "skipped"})
            continue
        if batch > oom_from.get((vocab, cache), batch):
            results.append(
                {"vocab": vocab, "cache": cache, "batch": batch, "status": "skipped (smaller OOM)"}
            )
            continue
        if vocab != current_vocab:
            models.append(bench.prepare(vocab, scale))
            print(f"model: {json.dumps(models[-1])}", flush=True)
            current_vocab = vocab
        steps = 1 + args.timed_steps if batch in args.throughput_batches else 1
        row = bench.run(vocab, cache, batch, steps)
        if row["status"] == "OOM":
            oom_from[(vocab, cache)] = batch
        results.append(row)
        print(json.dumps(row), flush=True)
        save()
    for batch in args.loss_only_batches:
        if not models or time.monotonic() - start > args.time_budget_s:
            results.append(
                {"vocab": args.vocabs[-1], "cache": "loss-only", "batch": batch, "status": "skipped"}
            )
            continue
        row = time_loss_only(bench, models[-1]["vocab"], batch, models[-1]["nnz_per_row"])
        results.append(row)
        print(json.dumps(row), flush=True)
        save()
    targets = save()
    print(markdown(meta, models, results, targets), flush=True)
    print(plot(results, out / "sparse_cache.png"), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
