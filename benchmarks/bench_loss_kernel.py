"""The sparse InfoNCE loss: the fused Triton kernel's settings against the blocked path, checked against fp64,
then A/B timed, all in one call.

Legend: B queries, N = 2B documents (positives and one hard negative each), V vocabulary (30,522), K_t a query
tile's padded active columns, nnz non-zeros.

One run, two parts (the A/B first, within the budget, then the check) (SciFact text reps as ``benchmarks/bench_loss_curve.py`` makes them: the shipped
SPLADE-tiny, bf16 autocast on a GPU; B queries drawn with replacement, their abstracts as positives, random
abstracts as hard negatives). The fused settings are the names of ``losses.fused_lse.VARIANTS`` given by
``--variants`` (default: all), each run as ``fused_lse.GPU_TILES``:

1. check: at ``--check_batch`` queries, the loss (``SpladeLoss``, InfoNCE only: regularizer weights 0) and the
   gradients of the queries', positives' and negatives' weights from the blocked path and from every fused
   setting, each against a dense fp64 computation (max abs error, and max abs error over the largest |value|);
   for "bf16" inputs (the reps as encoded: bf16 values, bf16 tiles) and "fp32" inputs (the same weights times
   1 + 1e-3·U(0,1): not bf16 values, fp32 tiles without TF32);
2. A/B: for each B of ``--batches``, ``SpladeLoss`` (InfoNCE + FLOPS, as bench_loss_curve) with
   ``score_kernel='blocked'`` and ``'fused'`` under every setting: forward, backward and forward + backward
   medians of ``--repeats`` runs (CUDA events, after one warm-up run), peak memory allocated and reserved, and
   the tensor-core work each path issues over its time as a fraction of the device's dense bf16 peak (fused:
   2·B·N·mean K_t a unit, forward 1 unit, backward :func:`fused_backward_units` of the tiles it took on the
   tensor cores (counted in an untimed run, with its pairs: ``tiles.<path>.routes``); blocked: its plan's
   widths, forward 1, backward 7). A run that would pass ``--budget_s`` (projected from the point's last run,
   4x the previous point's) is skipped and named.

The loss is InfoNCE at ``--temperature`` (default SpladeLoss's, 1.0: raw dot products, every score tile dense);
at 0.05 (a sentence-transformers scale of 20) most softmax weights underflow to 0 and the fused backward's scan
takes most tiles off the tensor cores.

GPU:   python -m benchmarks.bench_loss_kernel --beir_path /work/shared/data/scifact --batches 65536 \\
           --output $OUT/loss_kernel.json
Smoke: python -m benchmarks.bench_loss_kernel --smoke --output /tmp/k.json  (CPU, Triton interpreter, B 32)
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import os
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from benchmarks.bench_loss_curve import Timer, batch_reps, encoded_text
from benchmarks.common import run_stamp
from gradcache_sparton import SpladeLoss, SpladeLossConfig
from gradcache_sparton.losses import fused_lse, fused_lse_triton, query_tiles
from gradcache_sparton.losses.sparse import sparse_block_size, sparse_score_plan
from gradcache_sparton.primitives.sparse_reps import SparseReps

# Dense bf16 tensor-core peaks (datasheet, SXM, without sparsity), by a substring of the device name.
BF16_PEAK_FLOPS = {"H100": 989.4e12, "H200": 989.4e12, "A100": 312e12}
COLUMNS = ("query", "positive", "negative")
# --smoke: CPU sizes under the Triton interpreter (seconds a setting).
SMOKE = {"device": "cpu", "beir_path": "default", "max_texts": 120, "query_len": 8, "doc_len": 16,
         "check_batch": 24, "batches": "32", "repeats": 1}  # fmt: skip


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", required=True, help="JSON file, rewritten after every part")
    parser.add_argument(
        "--beir_path", default="default", help="BEIR folder (default: the shipped dev sample)"
    )
    parser.add_argument("--check_batch", type=int, default=2048, help="B of the fp64 check")
    parser.add_argument("--batches", default="16384,32768,65536,131072", help="comma-separated B of the A/B")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per setting (median)")
    parser.add_argument("--budget_s", type=float, default=240.0, help="skip runs past this wall clock")
    parser.add_argument("--variants", default=",".join(fused_lse.VARIANTS),
                        help=f"comma-separated names of fused settings, of {list(fused_lse.VARIANTS)}")  # fmt: skip
    parser.add_argument("--query_len", type=int, default=32)
    parser.add_argument("--doc_len", type=int, default=256)
    parser.add_argument("--encode_batch", type=int, default=512)
    parser.add_argument("--max_texts", type=int, default=0, help="at most this many queries (0: all)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument(
        "--temperature", type=float, default=SpladeLossConfig().temperature,
        help="the InfoNCE's temperature (default: SpladeLoss's, raw dot products; 0.05: a sentence-transformers "
        "scale of 20, where most softmax weights underflow to 0)",
    )  # fmt: skip
    parser.add_argument(
        "--smoke", action="store_true", help="CPU sizes under the Triton interpreter (overrides)"
    )
    args = parser.parse_args(argv)
    if args.smoke:
        vars(args).update(SMOKE)
    args.batches = [int(b) for b in args.batches.split(",") if b]
    args.variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in args.variants if v not in fused_lse.VARIANTS]
    if unknown or not args.variants:
        parser.error(f"--variants must name some of {list(fused_lse.VARIANTS)}, got {unknown or 'none'}")
    if not args.temperature > 0:
        parser.error(f"--temperature must be > 0, got {args.temperature}")
    if args.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        parser.error(
            "--device cpu (and --smoke) run the fused kernels under the Triton interpreter: set TRITON_INTERPRET=1"
        )
    return args


@contextlib.contextmanager
def fused_setting(name: str) -> Iterator[None]:
    """``fused_lse.GPU_TILES`` set to the named setting of ``fused_lse.VARIANTS`` while inside."""
    default = fused_lse.GPU_TILES
    fused_lse.GPU_TILES = fused_lse.VARIANTS[name]
    try:
        yield
    finally:
        fused_lse.GPU_TILES = default


def fused_backward_units(scanned_fraction: float, dense_fraction: float, shape: fused_lse.TileShape) -> float:
    """Tensor-core products of a fused backward per score tile, in forward units: the scan's scores for the
    ``scanned_fraction`` of tiles (blocks run with the routes), then for the ``dense_fraction`` taken on the tensor
    cores the scores again (once in each dense kernel: two with ``shape.dense_split``, one where the second reads
    the first's stored weights) and the query and the document gradients against each split part (the pairs'
    products run on the CUDA cores: not counted)."""
    scores = 2 if shape.dense_split and not shape.store_weights else 1
    return scanned_fraction + dense_fraction * (scores + 2 * fused_lse.SPLIT_PARTS)


@contextlib.contextmanager
def counted_routes() -> Iterator[dict[str, int]]:
    """Counts, while inside, the fused backward's score tiles (``bn_scan`` documents wide), those its scan took (the
    blocks run with the routes), those on the tensor cores (every one of a block run without the routes) and its
    pairs (one device read per document block: for an untimed run)."""
    counts = {"score_tiles": 0, "scanned_tiles": 0, "dense_tiles": 0, "pairs": 0}
    launch = fused_lse_triton.launch_backward

    def counting(*args: Any, **kwargs: Any) -> None:
        launch(*args, **kwargs)
        work = inspect.signature(launch).bind(*args, **kwargs).arguments["work"]
        score_tiles = len(kwargs["tiles"]) * -(-kwargs["n_docs"] // kwargs["bn_scan"])
        routes = kwargs.get("routes", True)
        counts["score_tiles"] += score_tiles
        counts["scanned_tiles"] += score_tiles if routes else 0
        counts["dense_tiles"] += work.dense_tiles() if routes else score_tiles
        counts["pairs"] += work.pairs() if routes else 0

    fused_lse_triton.launch_backward = counting
    try:
        yield counts
    finally:
        fused_lse_triton.launch_backward = launch


def backward_routes(reps: dict[str, SparseReps], name: str, temperature: float) -> dict[str, float]:
    """How one fused backward under setting ``name`` took its score tiles (:func:`counted_routes`)."""
    with fused_setting(name), counted_routes() as counts:
        loss_and_grads(reps, "fused", reg=True, temperature=temperature)
    tiles = max(counts["score_tiles"], 1)
    return {**counts, "scanned_fraction": counts["scanned_tiles"] / tiles,
            "dense_fraction": counts["dense_tiles"] / tiles,
            "pairs_per_query": counts["pairs"] / reps["query"].num_rows}  # fmt: skip


def leaves(reps: dict[str, SparseReps]) -> dict[str, SparseReps]:
    """The reps with fresh leaf weights (requires_grad)."""
    return {n: SparseReps(r.offsets, r.token_ids, r.weights.detach().clone().requires_grad_(True), r.vocab_size)
            for n, r in reps.items()}  # fmt: skip


def loss_config(kernel: str, reg: bool, temperature: float) -> SpladeLossConfig:
    """The benchmark's loss: InfoNCE at ``temperature``, with the FLOPS regularizer (``reg``) or alone."""
    weights = (5e-4, 3e-4) if reg else (0.0, 0.0)
    return SpladeLossConfig(query_reg_weight=weights[0], doc_reg_weight=weights[1], score_kernel=kernel,
                            temperature=temperature)  # fmt: skip


def loss_and_grads(
    reps: dict[str, SparseReps], kernel: str, reg: bool, temperature: float
) -> tuple[float, list[torch.Tensor]]:
    config = loss_config(kernel, reg, temperature)
    inputs = leaves(reps)
    value, _ = SpladeLoss(config)(inputs)
    value.backward()
    return value.item(), [inputs[c].weights.grad for c in COLUMNS]


def fp64_reference(reps: dict[str, SparseReps], temperature: float) -> tuple[float, list[torch.Tensor]]:
    """InfoNCE at ``temperature`` over dense fp64 reps; gradients at each column's non-zeros."""
    dense = {c: reps[c].to_dense().double().requires_grad_(True) for c in COLUMNS}
    q, p, n = (dense[c] for c in COLUMNS)
    scores = torch.cat([q @ p.T, q @ n.T], dim=1) / temperature  # [B, 2B]
    loss = (torch.logsumexp(scores, dim=1) - (q * p).sum(dim=1) / temperature).mean()
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


def failure(error: Exception) -> dict:
    """A run that raised, as its record: the others still run."""
    return {"status": "failed", "error": f"{type(error).__name__}: {str(error)[:300]}"}


def check(text: Any, args: argparse.Namespace) -> dict:
    reps, _ = batch_reps("text", args.check_batch, text, seed=1)
    generator = torch.Generator().manual_seed(2)
    out = {}
    for kind in ("bf16", "fp32"):
        if kind == "fp32":
            reps = {c: SparseReps(r.offsets, r.token_ids, r.weights * (1 + 1e-3 * torch.rand(
                r.weights.shape, generator=generator).to(r.weights.device)), r.vocab_size) for c, r in reps.items()}  # fmt: skip
        ref_value, ref_grads = fp64_reference(reps, args.temperature)
        row: dict[str, Any] = {"loss_fp64": ref_value}
        blocked = loss_and_grads(reps, "blocked", reg=False, temperature=args.temperature)
        row["blocked"] = errors(*blocked, ref_value, ref_grads)
        for name in args.variants:
            try:
                with fused_setting(name):
                    value, grads = loss_and_grads(reps, "fused", reg=False, temperature=args.temperature)
            except Exception as error:  # a setting the compiler rejects: recorded, the others still run
                row[f"fused:{name}"] = failure(error)
                continue
            row[f"fused:{name}"] = errors(value, grads, ref_value, ref_grads)
            row[f"fused:{name}_vs_blocked"] = errors(
                value, grads, blocked[0], [g.double() for g in blocked[1]]
            )
        out[kind] = row
    return out


def tile_stats(q_reps: SparseReps, shape: fused_lse.TileShape) -> dict:
    order = query_tiles.query_order(q_reps) if fused_lse.SORT_QUERIES else None
    tiles = query_tiles.build_query_tiles(
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


def timed(
    reps: dict[str, SparseReps], kernel: str, repeats: int, device: torch.device, temperature: float
) -> dict:
    runs = []
    # warm-up: compilation, autotuning, the allocator's blocks
    loss_and_grads(reps, kernel, reg=True, temperature=temperature)
    for _ in range(repeats):
        inputs = leaves(reps)
        loss = SpladeLoss(loss_config(kernel, reg=True, temperature=temperature))
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


def time_path(reps: dict[str, SparseReps], path: str, args: argparse.Namespace, device: torch.device,
              units: tuple[float, float, float], peak: float | None) -> dict:  # fmt: skip
    """One path's timings at one B ('blocked' or 'fused:<setting>'), or why there are none."""
    kernel, _, name = path.partition(":")
    try:
        with contextlib.ExitStack() as stack:
            if name:
                stack.enter_context(fused_setting(name))
            row = timed(reps, kernel, args.repeats, device, args.temperature)
    except torch.OutOfMemoryError as error:
        torch.cuda.empty_cache()
        return {"status": "out of memory", "error": str(error)[:300]}
    except Exception as error:  # a setting the compiler rejects: recorded, the others still run
        return failure(error)
    unit, fwd, bwd = units
    row["tensor_core_flops"] = {"forward": unit * fwd, "backward": unit * bwd}
    if peak is not None:
        row["fraction_of_bf16_peak"] = {"forward": unit * fwd / row["forward_s"] / peak,
                                        "backward": unit * bwd / row["backward_s"] / peak,
                                        "total": unit * (fwd + bwd) / row["total_s"] / peak}  # fmt: skip
    return row


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    began = time.monotonic()
    device = torch.device(args.device)
    text = encoded_text(args, device)
    results: dict[str, Any] = {"stamp": run_stamp(device), "command": " ".join(sys.argv),
                               "args": {k: str(v) for k, v in vars(args).items()},
                               "variants": {n: fused_lse.VARIANTS[n]._asdict() for n in args.variants},
                               "default_tiles": fused_lse.GPU_TILES._asdict(), "split_parts": fused_lse.SPLIT_PARTS,
                               "sort_queries": fused_lse.SORT_QUERIES,
                               "fused_min_queries": fused_lse.FUSED_MIN_QUERIES, "ab": []}  # fmt: skip

    def save() -> None:
        os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
        with open(args.output, "w") as file:
            json.dump(results, file, indent=1)

    peak = peak_flops(device)
    paths = ["blocked", *(f"fused:{name}" for name in args.variants)]
    last = None  # wall seconds of the last point: the next one's are ~4x (work grows as B²)
    for batch in args.batches:
        if last is not None and time.monotonic() - began + 4 * last > args.budget_s:
            results["ab"].append({"batch": batch, "status": "budget"})
            break
        point_began = time.monotonic()
        reps, distinct = batch_reps("text", batch, text, seed=batch)
        point: dict[str, Any] = {"batch": batch, "distinct_rows": distinct, "status": "ok", "tiles": {}}
        blocked_unit = 2.0 * 2 * batch * blocked_width_rows(reps["query"])
        run_s = 0.0  # the last run's wall seconds, all its repeats: the next path's projection
        for path in paths:
            if time.monotonic() - began + run_s > args.budget_s:
                point[path] = {"status": "budget"}
                continue
            path_began = time.monotonic()
            if path == "blocked":
                units = (blocked_unit, 1, 7)
            else:
                shape = fused_lse.VARIANTS[path.partition(":")[2]]
                point["tiles"][path] = stats = tile_stats(reps["query"], shape)
                stats["routes"] = routes = backward_routes(reps, path.partition(":")[2], args.temperature)
                units = (
                    2.0 * batch * 2 * batch * stats["k_mean"],
                    1,
                    fused_backward_units(routes["scanned_fraction"], routes["dense_fraction"], shape),
                )
            point[path] = time_path(reps, path, args, device, units, peak)
            run_s = time.monotonic() - path_began
            save()
        blocked = point["blocked"].get("total_s")
        for path in paths[1:]:
            if blocked and "total_s" in point[path]:
                point[path]["speedup_total_over_blocked"] = blocked / point[path]["total_s"]
        results["ab"].append(point)
        save()
        last = time.monotonic() - point_began
        del reps
    results["check"] = check(text, args)  # after the A/B (its budget): the fp32 inputs compile other kernels
    results["wall_s"] = time.monotonic() - began
    save()
    keys = ("forward_s", "backward_s", "total_s", "peak_allocated_gib", "status")
    for point in results["ab"]:
        for path in paths:
            if point["status"] == "ok":
                print(point["batch"], path, {k: point[path][k] for k in keys if k in point[path]})
    print(json.dumps(results["check"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
