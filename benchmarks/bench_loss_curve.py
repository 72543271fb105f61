"""The sparse InfoNCE loss alone over B queries and 2B documents: compaction to active columns on vs off.

Legend: B queries (global batch), W ranks, V vocabulary (30,522), U a query block's active columns, nnz
non-zeros.

What is timed: ``SpladeLoss`` (InfoNCE over the B positives and B hard negatives, FLOPS) on sparse reps, as the
engine's Step (2) calls it with ``sparse_reps``: the forward (loss value) and the backward (to the reps'
weights), each with CUDA events (wall clock on a CPU), the median of
``--repeats`` runs; peak memory allocated and reserved per run. Compaction off is the same call with
``losses.blocked.COMPACT_MAX_FRACTION = 0`` (every block over all V, today's path before compaction). The
warm-up runs at the first point only; a run longer than ``--long_run_s`` is not repeated. Under
torchrun every rank holds the same reps (rank 0's, broadcast) and scores 1/W of the query blocks
(``shard_scores_across_ranks``); times are the slowest rank's.

Reps, two kinds:

  text     the shipped SPLADE-tiny's reps of SciFact text (``--beir_path``): claims and abstract sentences
           as queries (``--query_len`` tokens), abstracts as documents (``--doc_len``), encoded once (bf16
           autocast on a GPU); each B draws queries with replacement, their abstracts as positives and
           random abstracts as hard negatives; the distinct rows drawn are recorded;
  uniform  random-init-like: each row as many distinct uniform random ids as the text reps' mean nnz of its
           column, weights drawn from the text reps' weights.

Each point records, per kind and mode, forward/backward seconds, peak memory, the plan (query blocks, how
many compacted, |U| and width statistics), the loss and how far the on and off runs' loss and gradients
are apart (fp32 summation order only), and the off/on time ratio. B doubles from ``--min_batch`` to
``--max_batch``; a point whose projected time (4x the last: the work grows as B²) would pass
``--budget_s`` is skipped and named.

One GPU:    python -m benchmarks.bench_loss_curve --beir_path /data/scifact --max_batch 131072 \\
                --budget_s 540 --out $OUT/loss_curve_1gpu.json
Four GPUs:  torchrun --nproc_per_node 4 -m benchmarks.bench_loss_curve --beir_path /data/scifact \\
                --max_batch 262144 --budget_s 540 --out $OUT/loss_curve_4gpu.json
CPU check:  python -m benchmarks.bench_loss_curve --device cpu --beir_path default --min_batch 16 \\
                --max_batch 32 --max_texts 200 --query_len 8 --doc_len 16 --block_size 8 --out /tmp/c.json
"""

from __future__ import annotations

import os

for _name, _value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")):
    os.environ.setdefault(_name, _value)  # NVLink multicast stays off on the shared machines

import argparse  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from datetime import timedelta  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from benchmarks.common import run_stamp  # noqa: E402
from benchmarks.scifact_text import TextPairs, draw_rows, encode_sparse, read_pairs, tokenize  # noqa: E402
from gradcache_sparton import SpladeEncoder, SpladeLoss, SpladeLossConfig  # noqa: E402
from gradcache_sparton.losses import blocked  # noqa: E402
from gradcache_sparton.losses.sparse import sparse_block_size, sparse_score_plan  # noqa: E402
from gradcache_sparton.primitives.sparse_reps import SparseReps  # noqa: E402
from gradcache_sparton.resources import shipped_model_path  # noqa: E402

KINDS = ("text", "uniform")
MODES = ("on", "off")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON file (rank 0), rewritten after every point")
    parser.add_argument(
        "--beir_path", default="default", help="BEIR folder (default: the shipped dev sample)"
    )
    parser.add_argument("--min_batch", type=int, default=16_384, help="first B (queries)")
    parser.add_argument("--max_batch", type=int, default=262_144, help="last B")
    parser.add_argument("--budget_s", type=float, default=500.0, help="wall-clock budget of the launch")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per setting (median)")
    parser.add_argument(
        "--long_run_s", type=float, default=10.0, help="a run longer than this is not repeated"
    )
    parser.add_argument("--kinds", default=",".join(KINDS), help="comma-separated: text, uniform")
    parser.add_argument("--block_size", type=int, default=None, help="score_block_size (default: the loss's)")
    parser.add_argument("--query_rows", type=int, default=blocked.COMPACT_QUERY_ROWS,
                        help="COMPACT_QUERY_ROWS: query rows of a compacted block")  # fmt: skip
    parser.add_argument("--query_len", type=int, default=32)
    parser.add_argument("--doc_len", type=int, default=256)
    parser.add_argument("--encode_batch", type=int, default=512, help="rows per encoder call")
    parser.add_argument("--max_texts", type=int, default=0, help="at most this many queries (0: all)")
    parser.add_argument("--timeout_s", type=float, default=900.0, help="process group timeout")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args = parser.parse_args(argv)
    args.kinds = [k for k in args.kinds.split(",") if k]
    if not set(args.kinds) <= set(KINDS):
        parser.error(f"--kinds: choose among {KINDS}, got {args.kinds}")
    return args


def subset(pairs: TextPairs, limit: int, seed: int = 0) -> TextPairs:
    """At most ``limit`` random queries and only the abstracts they need, plus as many others (CPU checks)."""
    if not limit or limit >= len(pairs.queries):
        return pairs
    rng = random.Random(seed)
    chosen = rng.sample(range(len(pairs.queries)), limit)
    others = rng.sample(range(len(pairs.documents)), min(limit, len(pairs.documents)))
    keep = sorted({pairs.positive[i] for i in chosen} | set(others))
    index = {doc: i for i, doc in enumerate(keep)}
    return TextPairs([pairs.queries[i] for i in chosen], [pairs.documents[d] for d in keep],
                     [index[pairs.positive[i]] for i in chosen])  # fmt: skip


def broadcast_reps(reps: SparseReps | None, device: torch.device) -> SparseReps:
    """Rank 0's ``reps`` on every rank (a no-op on one process)."""
    if not dist.is_initialized():
        assert reps is not None
        return reps
    sizes = torch.tensor([0, 0, 0] if reps is None else [reps.num_rows, reps.weights.numel(), reps.vocab_size],
                         device=device)  # fmt: skip
    dist.broadcast(sizes, 0)
    rows, nnz, vocab = sizes.tolist()
    if reps is None:
        reps = SparseReps(torch.empty(rows + 1, dtype=torch.int64, device=device),
                          torch.empty(nnz, dtype=torch.int32, device=device),
                          torch.empty(nnz, dtype=torch.float32, device=device), vocab)  # fmt: skip
    for tensor in (reps.offsets, reps.token_ids, reps.weights):
        dist.broadcast(tensor, 0)
    return reps


def encoded_text(args: argparse.Namespace, device: torch.device) -> tuple[TextPairs, SparseReps, SparseReps]:
    """The pairs and the reps of every query and every abstract (encoded on rank 0, broadcast)."""
    pairs = subset(read_pairs(args.beir_path), args.max_texts)
    q_reps = d_reps = None
    if not dist.is_initialized() or dist.get_rank() == 0:
        path = shipped_model_path("splade-tiny-msmarco")
        tokenizer = AutoTokenizer.from_pretrained(path)
        encoder = SpladeEncoder.from_pretrained(path).to(device).eval()
        q_reps = encode_sparse(
            encoder, tokenize(pairs.queries, tokenizer, args.query_len, device), args.encode_batch
        )
        d_reps = encode_sparse(
            encoder, tokenize(pairs.documents, tokenizer, args.doc_len, device), args.encode_batch
        )
        del encoder
    return pairs, broadcast_reps(q_reps, device), broadcast_reps(d_reps, device)


def uniform_like(reps: SparseReps, rows: int, generator: torch.Generator) -> SparseReps:
    """``rows`` reps with about ``reps``' mean nnz of distinct uniform random ids, weights drawn from ``reps``'."""
    device, vocab = reps.weights.device, reps.vocab_size
    nnz = max(1, round(reps.weights.numel() / reps.num_rows))
    ids = torch.randint(0, vocab, (rows, nnz), generator=generator).sort(dim=1).values  # [rows, nnz]
    keep = torch.ones_like(ids, dtype=torch.bool)
    keep[:, 1:] = ids[:, 1:] != ids[:, :-1]  # a repeated id once
    offsets = torch.zeros(rows + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(keep.sum(dim=1), 0)
    picks = torch.randint(0, reps.weights.numel(), (int(offsets[-1]),), generator=generator)
    return SparseReps(offsets.to(device), ids[keep].to(device, torch.int32),
                      reps.weights[picks.to(device)].clone(), vocab)  # fmt: skip


def batch_reps(
    kind: str, batch: int, text: tuple[TextPairs, SparseReps, SparseReps], seed: int
) -> tuple[dict, dict]:
    """Queries, positives, hard negatives of ``batch`` rows (the same on every rank: CPU generator, one seed)."""
    pairs, q_pool, d_pool = text
    generator = torch.Generator().manual_seed(seed)
    queries = torch.randint(0, q_pool.num_rows, (batch,), generator=generator)
    positives = torch.tensor(pairs.positive)[queries]
    shift = torch.randint(1, max(2, d_pool.num_rows), (batch,), generator=generator)
    negatives = (positives + shift) % d_pool.num_rows  # another abstract (when there are two)
    if kind == "text":
        reps = {"query": draw_rows(q_pool, queries), "positive": draw_rows(d_pool, positives),
                "negative": draw_rows(d_pool, negatives)}  # fmt: skip
        distinct = {"query": int(queries.unique().numel()),
                    "documents": int(torch.cat([positives, negatives]).unique().numel())}  # fmt: skip
        return reps, distinct
    reps = {"query": uniform_like(q_pool, batch, generator), "positive": uniform_like(d_pool, batch, generator),
            "negative": uniform_like(d_pool, batch, generator)}  # fmt: skip
    return reps, {}


class Timer:
    """Forward and backward seconds of one run: CUDA events on a GPU, the wall clock on a CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list[Any] = []

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def seconds(self) -> list[float]:
        if self.cuda:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) / 1e3 for a, b in zip(self.marks, self.marks[1:], strict=False)]
        return [b - a for a, b in zip(self.marks, self.marks[1:], strict=False)]


def slowest(values: list[float], device: torch.device) -> list[float]:
    """Each value's maximum over the ranks."""
    if not dist.is_initialized():
        return values
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.tolist()


def run_loss(
    reps: dict[str, SparseReps], loss: SpladeLoss, device: torch.device
) -> tuple[list[float], float, list]:
    """One forward and backward: ([forward_s, backward_s], loss, gradients of each column's weights)."""
    leaves = {name: SparseReps(r.offsets, r.token_ids, r.weights.detach().requires_grad_(True), r.vocab_size)
              for name, r in reps.items()}  # fmt: skip
    timer = Timer(device)
    timer.mark()
    value, _ = loss(leaves)
    timer.mark()
    value.backward()
    timer.mark()
    return timer.seconds(), value.item(), [r.weights.grad for r in leaves.values()]


def plan_stats(q_reps: SparseReps, block_size: int) -> dict[str, Any]:
    """The compacted plan of ``q_reps``: blocks, how many compacted, |U| and width statistics (host side)."""
    plan = sparse_score_plan(q_reps, block_size=block_size)
    compact = [b for b in plan if b.columns is not None]
    active = [int(b.columns.numel()) for b in compact] or [0]
    return {"query_blocks": len(plan), "compacted_blocks": len(compact), "query_rows": plan[0].stop - plan[0].start,
            "u_mean": statistics.fmean(active), "u_median": statistics.median(active), "u_max": max(active),
            "width_mean_fraction_of_v": statistics.fmean(b.width for b in plan) / q_reps.vocab_size}  # fmt: skip


def measure(
    reps: dict[str, SparseReps],
    loss: SpladeLoss,
    mode: str,
    args: argparse.Namespace,
    device: torch.device,
    *,
    warm_up: bool,
) -> dict:
    """Median forward/backward seconds of ``--repeats`` runs in ``mode`` (one run once a run passes
    ``--long_run_s``: its noise is small next to it), after a warm-up run when ``warm_up``; peak memory."""
    fraction = blocked.COMPACT_MAX_FRACTION
    blocked.COMPACT_MAX_FRACTION = fraction if mode == "on" else 0.0
    try:
        if warm_up:
            run_loss(reps, loss, device)  # cuBLAS heuristics, the allocator's first blocks
        runs: list[list[float]] = []
        while len(runs) < args.repeats and not (runs and sum(runs[-1]) > args.long_run_s):
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            seconds, value, grads = run_loss(reps, loss, device)
            runs.append(slowest(seconds, device))
    finally:
        blocked.COMPACT_MAX_FRACTION = fraction
    row = {"forward_s": round(statistics.median(r[0] for r in runs), 4),
           "backward_s": round(statistics.median(r[1] for r in runs), 4), "loss": value}  # fmt: skip
    row["total_s"] = round(row["forward_s"] + row["backward_s"], 4)
    row["runs"] = len(runs)
    if device.type == "cuda":
        row["peak_allocated_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 3)
        row["peak_reserved_gib"] = round(torch.cuda.max_memory_reserved(device) / 2**30, 3)
    return {"row": row, "grads": grads}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    began = time.monotonic()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    device = torch.device("cpu")
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    if world > 1:
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo", timeout=timedelta(seconds=args.timeout_s)
        )
    rank = dist.get_rank() if world > 1 else 0
    blocked.COMPACT_QUERY_ROWS = args.query_rows
    text = encoded_text(args, device)
    pairs, q_pool, d_pool = text
    nnz = {
        "query": q_pool.weights.numel() / q_pool.num_rows,
        "document": d_pool.weights.numel() / d_pool.num_rows,
    }
    results: dict[str, Any] = {
        "stamp": run_stamp(device), "command": " ".join(sys.argv), "args": vars(args), "world_size": world,
        "compact": {"query_rows": blocked.COMPACT_QUERY_ROWS, "max_fraction": blocked.COMPACT_MAX_FRACTION,
                    "column_multiple": blocked.COMPACT_COLUMN_MULTIPLE},
        "text": {"queries": len(pairs.queries), "documents": len(pairs.documents), "nnz_per_row": nnz},
        "points": [],
    }  # fmt: skip

    def save() -> None:
        if rank == 0:
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out, "w") as file:
                json.dump(results, file, indent=1)

    save()
    loss = SpladeLoss(SpladeLossConfig(query_reg_weight=5e-4, doc_reg_weight=3e-4, score_block_size=args.block_size,
                                       shard_scores_across_ranks=world > 1))  # fmt: skip
    block = sparse_block_size(q_pool.vocab_size) if args.block_size is None else args.block_size
    batch, last = args.min_batch, None
    while batch <= args.max_batch:
        if last is not None and time.monotonic() - began + 4 * last > args.budget_s:
            results["points"].append({"batch": batch, "status": "budget", "projected_s": round(4 * last, 1)})
            break
        point_began = time.monotonic()
        point: dict[str, Any] = {"batch": batch, "status": "ok"}
        for kind in args.kinds:
            reps, distinct = batch_reps(kind, batch, text, seed=batch)
            on, off = (
                measure(reps, loss, mode, args, device, warm_up=batch == args.min_batch) for mode in MODES
            )
            scale = max(float(g.abs().max()) for g in off["grads"])
            entry = {"distinct_rows": distinct, "plan": plan_stats(reps["query"], block), "on": on["row"],
                     "off": off["row"], "ratio_off_over_on": round(off["row"]["total_s"] / on["row"]["total_s"], 3),
                     "loss_relative_difference": abs(on["row"]["loss"] - off["row"]["loss"]) / abs(off["row"]["loss"]),
                     "grad_max_difference_over_max": max(float((a - b).abs().max()) for a, b in
                                                         zip(on["grads"], off["grads"], strict=True)) / scale}  # fmt: skip
            point[kind] = entry
            del reps, on, off
        last = time.monotonic() - point_began
        point["wall_s"] = round(last, 2)
        results["points"].append(point)
        save()
        batch *= 2
    save()
    if rank == 0:
        print(
            f"{'B':>8} {'kind':>8} {'|U| mean':>9} {'fwd on':>8} {'fwd off':>8} {'bwd on':>8} {'bwd off':>8} ratio"
        )
        for point in results["points"]:
            for kind in args.kinds:
                if kind in point:
                    e = point[kind]
                    print(f"{point['batch']:>8} {kind:>8} {e['plan']['u_mean']:>9.0f} {e['on']['forward_s']:>8.3f} "
                          f"{e['off']['forward_s']:>8.3f} {e['on']['backward_s']:>8.3f} {e['off']['backward_s']:>8.3f} "
                          f"{e['ratio_off_over_on']:.2f}")  # fmt: skip
            if point["status"] != "ok":
                print(f"{point['batch']:>8} skipped: projected {point['projected_s']} s passes the budget")
    if world > 1:
        dist.barrier()  # every rank done before one leaves the group (pytorch#75097)
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
