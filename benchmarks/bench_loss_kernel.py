"""The sparse InfoNCE loss: the fused Triton kernel against the blocked path, checked against fp64, then A/B timed.

Legend: B queries, N = 2B documents (positives and one hard negative each), V vocabulary (30,522), K_t a query
tile's padded active columns, nnz non-zeros.

One run, three parts (SciFact text reps as ``benchmarks/bench_loss_curve.py`` makes them: the shipped
SPLADE-tiny, bf16 autocast on a GPU; B queries drawn with replacement, their abstracts as positives, random
abstracts as hard negatives):

1. check: at ``--check_batch`` queries, the loss (``SpladeLoss``, InfoNCE only: regularizer weights 0) and the
   gradients of the queries', positives' and negatives' weights from the fused kernel and from the blocked path,
   each against a dense fp64 computation (max abs error, and max abs error over the largest |value|); for
   "bf16" inputs (the reps as encoded: bf16 values, bf16 tiles) and "fp32" inputs (the same weights times
   1 + 1e-3·U(0,1): not bf16 values, fp32 tiles without TF32);
2. A/B: for each B of ``--batches``, ``SpladeLoss`` (InfoNCE + FLOPS, as bench_loss_curve) with
   ``score_kernel='fused'`` and ``'blocked'``: forward, backward and forward + backward medians of ``--repeats``
   runs (CUDA events, after one warm-up run), peak memory allocated and reserved, and the tensor-core work
   each path issues over its time as a fraction of the device's dense bf16 peak (fused: 2·B·N·mean K_t per
   pass-unit, forward 1 unit, backward 1 + 2·SPLIT_PARTS; blocked: its plan's widths, forward 1, backward 7);
   a point whose runs would pass ``--budget_s`` (projected: 4x the last point's) is skipped and named;
3. variants (``--tile_batch``, optional): the fused path alone under other settings (``--variants``: tile shapes,
   one or two backward kernels, 2 or 3 split parts, queries sorted into tiles or not).

GPU:  python -m benchmarks.bench_loss_kernel --beir_path /work/shared/data/scifact --output $OUT/loss_kernel.json
CPU:  TRITON_INTERPRET=1 python -m benchmarks.bench_loss_kernel --device cpu --beir_path default \\
          --max_texts 200 --query_len 8 --doc_len 16 --check_batch 24 --batches 32 --output /tmp/k.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch

from benchmarks.bench_loss_curve import Timer, batch_reps, encoded_text
from benchmarks.common import run_stamp
from gradcache_sparton import SpladeLoss, SpladeLossConfig
from gradcache_sparton.losses import fused_lse
from gradcache_sparton.losses.sparse import sparse_block_size, sparse_score_plan
from gradcache_sparton.primitives.sparse_reps import SparseReps

# Dense bf16 tensor-core peaks (datasheet, SXM, without sparsity), by a substring of the device name.
BF16_PEAK_FLOPS = {"H100": 989.4e12, "H200": 989.4e12, "A100": 312e12}
COLUMNS = ("query", "positive", "negative")
# Fused settings compared at --tile_batch: TileShape's fields, then SPLIT_PARTS and SORT_QUERIES (1/0).
VARIANTS = (
    "64,32,128,64,4,3,1,2,1",  # the defaults
    "64,32,128,64,4,3,2,2,1",  # one backward kernel per gradient
    "64,32,128,64,4,3,1,3,1",  # 3 split parts (exact products)
    "64,32,128,64,4,3,1,2,0",  # queries in the batch's order
    "64,64,128,64,8,2,1,2,1",
    "64,32,128,128,8,3,1,2,1",
    "64,32,256,64,8,3,1,2,1",
    "128,32,128,64,8,3,1,2,1",
    "64,64,128,64,4,3,1,2,1",
    "128,64,128,64,8,2,2,2,1",
)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", required=True, help="JSON file, rewritten after every part")
    parser.add_argument(
        "--beir_path", default="default", help="BEIR folder (default: the shipped dev sample)"
    )
    parser.add_argument("--check_batch", type=int, default=2048, help="B of the fp64 check")
    parser.add_argument("--batches", default="16384,32768,65536,131072", help="comma-separated B of the A/B")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per setting (median)")
    parser.add_argument("--budget_s", type=float, default=420.0, help="skip A/B points past this wall clock")
    parser.add_argument("--tile_batch", type=int, default=0, help="B of the tile comparison (0: none)")
    parser.add_argument("--variants", default=";".join(VARIANTS),
                        help="bm,bk,bn_forward,bn_backward,warps,stages,backward_passes,split_parts,sort;...")  # fmt: skip
    parser.add_argument("--query_len", type=int, default=32)
    parser.add_argument("--doc_len", type=int, default=256)
    parser.add_argument("--encode_batch", type=int, default=512)
    parser.add_argument("--max_texts", type=int, default=0, help="at most this many queries (0: all)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args = parser.parse_args(argv)
    args.batches = [int(b) for b in args.batches.split(",") if b]
    args.variants = [tuple(map(int, v.split(","))) for v in args.variants.split(";") if v]
    return args


def leaves(reps: dict[str, SparseReps]) -> dict[str, SparseReps]:
    """The reps with fresh leaf weights (requires_grad)."""
    return {n: SparseReps(r.offsets, r.token_ids, r.weights.detach().clone().requires_grad_(True), r.vocab_size)
            for n, r in reps.items()}  # fmt: skip


def loss_and_grads(reps: dict[str, SparseReps], kernel: str, reg: bool) -> tuple[float, list[torch.Tensor]]:
    weights = (5e-4, 3e-4) if reg else (0.0, 0.0)
    config = SpladeLossConfig(query_reg_weight=weights[0], doc_reg_weight=weights[1], score_kernel=kernel)
    inputs = leaves(reps)
    value, _ = SpladeLoss(config)(inputs)
    value.backward()
    return value.item(), [inputs[c].weights.grad for c in COLUMNS]


def fp64_reference(reps: dict[str, SparseReps]) -> tuple[float, list[torch.Tensor]]:
    """InfoNCE (temperature 1) over dense fp64 reps; gradients at each column's non-zeros."""
    dense = {c: reps[c].to_dense().double().requires_grad_(True) for c in COLUMNS}
    q, p, n = (dense[c] for c in COLUMNS)
    scores = torch.cat([q @ p.T, q @ n.T], dim=1)  # [B, 2B]
    loss = (torch.logsumexp(scores, dim=1) - (q * p).sum(dim=1)).mean()
    loss.backward()
    grads = []
    for c in COLUMNS:
        rows, ids = reps[c].row_ids(), reps[c].token_ids.long()
        grads.append(dense[c].grad[rows, ids])
    return loss.item(), grads


def errors(value: float, grads: list[torch.Tensor], ref_value: float, ref_grads: list[torch.Tensor]) -> dict:
    out: dict[str, Any] = {
        "loss_abs": abs(value - ref_value),
        "loss_rel": abs(value - ref_value) / abs(ref_value),
    }
    for c, g, r in zip(COLUMNS, grads, ref_grads, strict=True):
        diff = float((g.double() - r).abs().max())
        out[f"grad_{c}_abs"] = diff
        out[f"grad_{c}_rel_to_max"] = diff / max(float(r.abs().max()), 1e-300)
    return out


def check(text: Any, args: argparse.Namespace) -> dict:
    reps, _ = batch_reps("text", args.check_batch, text, seed=1)
    generator = torch.Generator().manual_seed(2)
    out = {}
    for kind in ("bf16", "fp32"):
        if kind == "fp32":
            reps = {c: SparseReps(r.offsets, r.token_ids, r.weights * (1 + 1e-3 * torch.rand(
                r.weights.shape, generator=generator).to(r.weights.device)), r.vocab_size) for c, r in reps.items()}  # fmt: skip
        ref_value, ref_grads = fp64_reference(reps)
        row: dict[str, Any] = {"loss_fp64": ref_value}
        results = {kernel: loss_and_grads(reps, kernel, reg=False) for kernel in ("fused", "blocked")}
        for kernel, (value, grads) in results.items():
            row[kernel] = errors(value, grads, ref_value, ref_grads)
        f, b = results["fused"], results["blocked"]
        row["fused_vs_blocked"] = errors(f[0], f[1], b[0], [g.double() for g in b[1]])
        out[kind] = row
    return out


def tile_stats(q_reps: SparseReps, shape: fused_lse.TileShape) -> dict:
    order = fused_lse.query_order(q_reps) if fused_lse.SORT_QUERIES else None
    tiles = fused_lse.build_query_tiles(
        q_reps, q_reps.weights, bm=shape.bm, bk=shape.bk, dtype=torch.bfloat16, order=order
    )
    num_tiles = tiles.tile_ptr.numel() - 1
    widths = (tiles.tile_ptr[1:] - tiles.tile_ptr[:-1]).double()
    return {"tiles": num_tiles, "k_mean": float(widths.mean()), "k_max": float(widths.max()),
            "k_mean_fraction_of_v": float(widths.mean()) / q_reps.vocab_size}  # fmt: skip


def blocked_width_rows(q_reps: SparseReps) -> float:
    """sum over the blocked plan's query blocks of rows x width (its products' K per document, summed)."""
    plan = sparse_score_plan(q_reps, block_size=sparse_block_size(q_reps.vocab_size))
    return float(sum((b.stop - b.start) * b.width for b in plan))


def timed(reps: dict[str, SparseReps], kernel: str, repeats: int, device: torch.device) -> dict:
    runs = []
    loss_and_grads(reps, kernel, reg=True)  # warm-up: compilation, autotuning, the allocator's blocks
    for _ in range(repeats):
        inputs = leaves(reps)
        config = SpladeLossConfig(query_reg_weight=5e-4, doc_reg_weight=3e-4, score_kernel=kernel)
        loss = SpladeLoss(config)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        timer = Timer(device)
        timer.mark()
        value, _ = loss(inputs)
        timer.mark()
        value.backward()
        timer.mark()
        runs.append(timer.seconds())
    row: dict[str, Any] = {"forward_s": statistics.median(r[0] for r in runs),
                           "backward_s": statistics.median(r[1] for r in runs),
                           "total_s": statistics.median(r[0] + r[1] for r in runs), "runs": len(runs)}  # fmt: skip
    row["backward_over_forward"] = row["backward_s"] / row["forward_s"]
    if device.type == "cuda":
        row["peak_allocated_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        row["peak_reserved_gib"] = torch.cuda.max_memory_reserved(device) / 2**30
    return row


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in BF16_PEAK_FLOPS.items() if k in name), None)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    began = time.monotonic()
    device = torch.device(args.device)
    text = encoded_text(args, device)
    results: dict[str, Any] = {"stamp": run_stamp(device), "command": " ".join(sys.argv),
                               "args": {k: str(v) for k, v in vars(args).items()},
                               "gpu_tiles": fused_lse.GPU_TILES._asdict(), "split_parts": fused_lse.SPLIT_PARTS,
                               "sort_queries": fused_lse.SORT_QUERIES,
                               "fused_min_queries": fused_lse.FUSED_MIN_QUERIES, "ab": []}  # fmt: skip

    def save() -> None:
        os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
        with open(args.output, "w") as file:
            json.dump(results, file, indent=1)

    results["check"] = check(text, args)
    save()
    peak = peak_flops(device)
    last = None  # wall seconds of the last point's timed runs: the next one's are ~4x (work grows as B²)
    for batch in args.batches:
        if last is not None and time.monotonic() - began + 4 * last > args.budget_s:
            results["ab"].append({"batch": batch, "status": "budget"})
            break
        reps, distinct = batch_reps("text", batch, text, seed=batch)
        point: dict[str, Any] = {"batch": batch, "distinct_rows": distinct, "status": "ok",
                                 "tiles": tile_stats(reps["query"], fused_lse.GPU_TILES)}  # fmt: skip
        documents = 2 * batch
        backward_units = fused_lse.GPU_TILES.backward_passes + 2 * fused_lse.SPLIT_PARTS
        units = {"fused": (2.0 * batch * documents * point["tiles"]["k_mean"], 1, backward_units),
                 "blocked": (2.0 * documents * blocked_width_rows(reps["query"]), 1, 7)}  # fmt: skip
        point_s = 0.0
        for kernel in ("fused", "blocked"):
            try:
                row = timed(reps, kernel, args.repeats, device)
            except torch.OutOfMemoryError as error:
                row = {"status": "out of memory", "error": str(error)[:300]}
                torch.cuda.empty_cache()
            else:
                unit, fwd, bwd = units[kernel]
                row["tensor_core_flops"] = {"forward": unit * fwd, "backward": unit * bwd}
                if peak is not None:
                    row["fraction_of_bf16_peak"] = {"forward": unit * fwd / row["forward_s"] / peak,
                                                    "backward": unit * bwd / row["backward_s"] / peak,
                                                    "total": unit * (fwd + bwd) / row["total_s"] / peak}  # fmt: skip
                point_s += row["total_s"] * (args.repeats + 1)
            point[kernel] = row
            save()
        if "total_s" in point["fused"] and "total_s" in point["blocked"]:
            point["speedup_total"] = point["blocked"]["total_s"] / point["fused"]["total_s"]
        results["ab"].append(point)
        save()
        last = point_s
        del reps
    if args.tile_batch:
        reps, _ = batch_reps("text", args.tile_batch, text, seed=args.tile_batch)
        defaults = fused_lse.GPU_TILES, fused_lse.SPLIT_PARTS, fused_lse.SORT_QUERIES
        rows = []
        try:
            for variant in args.variants:
                fused_lse.GPU_TILES = fused_lse.TileShape(*variant[:7])
                fused_lse.SPLIT_PARTS, fused_lse.SORT_QUERIES = variant[7], bool(variant[8])
                settings = {**fused_lse.GPU_TILES._asdict(), "split_parts": variant[7], "sort": variant[8]}
                try:
                    row = timed(reps, "fused", args.repeats, device)
                except Exception as error:  # a shape the compiler rejects: recorded, the others still run
                    row = {"status": "failed", "error": f"{type(error).__name__}: {str(error)[:300]}"}
                rows.append(
                    {"settings": settings, "tiles": tile_stats(reps["query"], fused_lse.GPU_TILES), **row}
                )
                results["variants"] = {"batch": args.tile_batch, "rows": rows}
                save()
        finally:
            fused_lse.GPU_TILES, fused_lse.SPLIT_PARTS, fused_lse.SORT_QUERIES = defaults
    results["wall_s"] = time.monotonic() - began
    save()
    for point in results["ab"]:
        if point["status"] == "ok":
            f, b = point["fused"], point["blocked"]
            print(point["batch"], {k: f.get(k) for k in ("forward_s", "backward_s", "total_s", "peak_allocated_gib")},
                  {k: b.get(k) for k in ("forward_s", "backward_s", "total_s", "peak_allocated_gib")})  # fmt: skip
    print(json.dumps(results["check"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
