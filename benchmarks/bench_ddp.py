"""Data-parallel GradCache on W GPUs (any W >= 2): gradients equal one process on the global batch, and throughput.

Legend: B batch (rows), S sequence, D hidden, V vocabulary, W world size (GPUs).

Launched with ``torchrun --nproc_per_node W`` (NCCL), in three phases:

  equality    fp32 (TF32 off), dropout off, a 2-layer BERT-base-width SpladeEncoder (Triton head): a cached
              step on W DDP ranks over a global batch of 8 x W rows, split equally (8 rows a rank) and
              unequally (the first half of the ranks 10 rows, the second half 6, a middle rank of an odd W
              8), must give every parameter gradient of one process's cached step on the global batch
              (computed on rank 0 with its own copy of the model), within rtol 1e-4 of each parameter's
              largest gradient (floored at 1e-4 of the model's largest). Both splits run in mini-batches of
              2, which the ranks' row boundaries keep aligned with the reference's (every split is even):
              each mini-batch is the same rows at the same padded shape, so the encoder and head compute
              them bitwise alike and what remains is what data parallelism does (the gather, DDP's sum of W
              partial gradients, the world-size scaling), with unequal replay counts (5, 4, 3 a rank). A
              third row, reported and not gated, cuts the unequal split in mini-batches of 3, so the ranks'
              mini-batches hold other rows than the reference's: there a GPU's batch-dependent kernels give
              the hidden states other last bits, and a head max-pooling position nearly tied with another
              can flip, moving a whole gradient entry (measured 1.27e-4 on 4 H200s, 4.9e-6 on the CPU).
              Every rank's gradients must also be bitwise equal (DDP synchronised them).
  1 GPU       rank 0 alone (the other ranks wait at a barrier): a BERT-base-width SpladeEncoder (D 768, 12
              heads, FFN 3,072, 6 layers, V 30,522, random init, decoder bias -0.5 as in training), bf16
              autocast, queries of 32 tokens + positives of 256, effective batch 256 per GPU in
              mini-batches of 64, SpladeLoss (InfoNCE + FLOPS), fused AdamW, no DDP, no gather.
  1 GPU x W   the 1-GPU configuration on every rank at once, independently (no DDP, no gather): what
              one GPU gives while the host feeds W of them (clocks, power, CPU); its mean is the bound
              of the W-GPU rows that communication cannot explain.
  W GPUs      the same per GPU on every rank: DDP, reps gathered (the loss sees 256 x W rows), one
              all-reduce per step; once with every rank scoring the whole gathered batch, once with the
              scores sharded (each rank 1/W of the queries, ``shard_scores_across_ranks``).

Throughput: after warm-up steps (Triton compilation, optimizer state), ``--steps`` steps between a
synchronize (and, on W GPUs, the step's own all-reduce) at both ends; sequences per second = 2 columns
x rows per step x steps / seconds. The target: W-GPU sequences/s >= 0.925 x W x 1-GPU (1.85 at 2 GPUs,
3.7 at 4). Rank 0 prints a table and writes JSON (rows, checks, device, versions, date) to ``--out``.
The scaling curve is one launch per W, in one call:

    for w in 2 4; do PYTHONPATH=$PWD torchrun --nproc_per_node $w benchmarks/bench_ddp.py --out $OUT/ddp_$w.json; done

``python -m benchmarks.bench_ddp --out ...`` (one process) runs the 1-GPU phase only; ``--equality-only``
(launched) the equality phase only. ``--smoke`` runs
everything on CPU with gloo and a tiny model (``torchrun --nproc_per_node 3 -m benchmarks.bench_ddp
--smoke --out /tmp/ddp.json``): it checks the script at any W, its numbers mean nothing.
"""

from __future__ import annotations

import os

# NVLink SHARP / multicast stay off on the shared machines (see the device notes); set before NCCL starts.
for _name, _value in (
    ("NCCL_NVLS_ENABLE", "0"),
    ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
    ("NVSHMEM_DISABLE_NVLS", "1"),
):
    os.environ.setdefault(_name, _value)

import argparse  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from collections.abc import Mapping  # noqa: E402
from datetime import timedelta  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import Tensor, nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402
from transformers import BertConfig  # noqa: E402

from benchmarks.common import run_stamp  # noqa: E402
from gradcache_sparton.engine import CachedLoss  # noqa: E402
from gradcache_sparton.losses import SpladeLoss, SpladeLossConfig  # noqa: E402
from gradcache_sparton.modeling import SpladeEncoder  # noqa: E402

SPEEDUP_PER_GPU_TARGET = 0.925  # W GPUs >= 0.925 x W x one GPU: 3.7x at 4 (the target)
EQUALITY_RTOL = 1e-4  # see the module docstring
COLUMN_LENGTHS = {"query": 32, "positive": 256}


def _config(*, smoke: bool, layers: int) -> BertConfig:
    if smoke:
        return BertConfig(
            vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
            intermediate_size=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        )  # fmt: skip
    return BertConfig(
        vocab_size=30522, hidden_size=768, num_hidden_layers=layers, num_attention_heads=12,
        intermediate_size=3072, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip


def _encoder(config: BertConfig, device: torch.device) -> SpladeEncoder:
    torch.manual_seed(0)  # the same weights on every rank and for the reference
    encoder = SpladeEncoder.from_config(config)
    with torch.no_grad():
        # A random-init head with bias 0 activates about half the vocabulary; -0.5 starts it sparser (fixed
        # here so runs stay comparable; the training pipeline's default scales with the width).
        encoder.model.get_output_embeddings().bias.fill_(-0.5)
    return encoder.to(device).train()


def _columns(
    rows: int, lengths: Mapping[str, int], device: torch.device, *, seed: int, padded: bool
) -> dict[str, dict[str, Tensor]]:
    """Random token ids (no tokenizer: the numbers are the model step's); ``padded``: random row lengths."""
    generator = torch.Generator().manual_seed(seed)
    columns = {}
    for name, seq_len in lengths.items():
        input_ids = torch.randint(1000, 30522, (rows, seq_len), generator=generator)
        mask = torch.ones(rows, seq_len, dtype=torch.long)
        if padded:
            row_lengths = torch.randint(2, seq_len + 1, (rows,), generator=generator)
            mask = (torch.arange(seq_len)[None, :] < row_lengths[:, None]).long()  # [B, S]
            input_ids = input_ids * mask
        columns[name] = {
            "input_ids": input_ids.to(device),
            "attention_mask": mask.to(device),
            "token_type_ids": torch.zeros_like(input_ids).to(device),
        }
    return columns


def _rows(columns: Mapping[str, Mapping[str, Tensor]], rows: slice) -> dict[str, dict[str, Tensor]]:
    return {name: {key: value[rows] for key, value in features.items()} for name, features in columns.items()}


def _loss(*, shard_scores: bool = False) -> SpladeLoss:
    return SpladeLoss(
        SpladeLossConfig(query_reg_weight=5e-4, doc_reg_weight=3e-4, shard_scores_across_ranks=shard_scores)
    )


# ---------------------------------------------------------------------------------------------- equality


def row_splits(world_size: int) -> dict[str, list[int]]:
    """Rows per rank for the equality check: equal (8 each) and unequal (10 for the first half of the
    ranks, 6 for the second, 8 for the middle rank of an odd world size); both sum to 8 x W."""
    half = world_size // 2
    unequal = [10] * half + [8] * (world_size % 2) + [6] * half
    return {"equal": [8] * world_size, "unequal": unequal}


ALIGNED_MINI_BATCH = 2  # divides every split's rows: the ranks' mini-batches are the reference's
MISALIGNED_MINI_BATCH = 3  # cuts the unequal split elsewhere than the reference (reported, not gated)


def equality_cases(world_size: int) -> list[tuple[list[int], int, bool]]:
    """(rows per rank, mini-batch size, gated) for each equality row: both splits in aligned mini-batches
    (gated), the unequal split in misaligned ones (reported)."""
    splits = row_splits(world_size)
    return [
        (splits["equal"], ALIGNED_MINI_BATCH, True),
        (splits["unequal"], ALIGNED_MINI_BATCH, True),
        (splits["unequal"], MISALIGNED_MINI_BATCH, False),
    ]


def equality_check(device: torch.device, *, smoke: bool) -> list[dict]:
    """Phase 1: W-rank DDP gradients vs one process on the global batch (every rank takes part)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    config = _config(smoke=smoke, layers=2)
    global_rows = 8 * world
    lengths = {"query": 32, "positive": 64}
    columns = _columns(global_rows, lengths, device, seed=1, padded=True)
    cases = equality_cases(world)
    references: dict[int, dict[str, Tensor]] = {}
    if rank == 0:
        for mini_batch in sorted({mini_batch for _, mini_batch, _ in cases}):
            encoder = _encoder(config, device)
            CachedLoss(encoder, _loss(), mini_batch_size=mini_batch, gather_across_ranks=False)(
                columns
            ).backward()
            references[mini_batch] = {name: p.grad.detach().clone() for name, p in encoder.named_parameters()}
            del encoder
    encoder = _encoder(config, device)
    ddp = DistributedDataParallel(encoder, device_ids=[device.index] if device.type == "cuda" else None)
    results = []
    for per_rank, mini_batch, gated in cases:
        label = "+".join(map(str, per_rank)) + f" rows, mini-batches of {mini_batch}"
        start = sum(per_rank[:rank])
        local = _rows(columns, slice(start, start + per_rank[rank]))
        cached = CachedLoss(ddp, _loss(), mini_batch_size=mini_batch)
        loss = cached(local)
        loss.backward()
        flat = torch.cat([p.grad.reshape(-1) for p in encoder.parameters()])
        low, high = flat.clone(), flat.clone()
        dist.all_reduce(low, op=dist.ReduceOp.MIN)
        dist.all_reduce(high, op=dist.ReduceOp.MAX)
        row = {"check": f"gradients, {label}", "ranks_bitwise_equal": bool(torch.equal(low, high))}
        if rank == 0:
            reference = references[mini_batch]
            largest = max(float(g.abs().max()) for g in reference.values())
            errors = {}
            for name, p in encoder.named_parameters():
                # Floor at 1e-4 of the model's largest gradient: the attention key biases have an exactly
                # zero true gradient (softmax ignores a per-query constant), so theirs is pure rounding
                # noise whose size depends on the GPU kernels' summation order (a 1e-6 floor failed on
                # it at 3e-4 on the H200 while the ranks agreed bitwise). A missing gather or world-size
                # scaling moves every large gradient by O(1) of itself and still fails.
                scale = max(float(reference[name].abs().max()), 1e-4 * largest)
                errors[name] = float((p.grad - reference[name]).abs().max()) / scale
            worst_name = max(errors, key=errors.__getitem__)
            worst = errors[worst_name]
            row.update(
                max_relative_error=worst, worst_parameter=worst_name, rtol=EQUALITY_RTOL if gated else None
            )
            row["largest_errors"] = dict(sorted(errors.items(), key=lambda kv: -kv[1])[:3])
            row["passed"] = row["ranks_bitwise_equal"] and (not gated or worst <= EQUALITY_RTOL)
        results.append(row)
        ddp.zero_grad(set_to_none=True)
    return results


# ---------------------------------------------------------------------------------------------- throughput


def throughput(
    device: torch.device,
    *,
    data_parallel: bool,
    smoke: bool,
    batch: int,
    mini_batch: int,
    steps: int,
    shard_scores: bool = False,
) -> dict:
    """Phases 2 to 4: cached training steps on this rank (``data_parallel``: DDP + gather;
    ``shard_scores``: each rank scores 1/W of the gathered queries, SpladeLossConfig.shard_scores_across_ranks)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    encoder = _encoder(_config(smoke=smoke, layers=6), device)
    model: nn.Module = encoder
    if data_parallel:
        model = DistributedDataParallel(encoder, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.AdamW(encoder.parameters(), lr=1e-5, fused=device.type == "cuda")
    lengths = {"query": 8, "positive": 16} if smoke else COLUMN_LENGTHS
    columns = _columns(batch, lengths, device, seed=100 + rank, padded=False)
    loss_fn = _loss(shard_scores=shard_scores)
    cached = CachedLoss(model, loss_fn, mini_batch_size=mini_batch, gather_across_ranks=data_parallel)
    autocast = (
        torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()
    )

    def step() -> float:
        with autocast:
            loss = cached(columns)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())

    warmup = 1 if smoke else 3
    for _ in range(warmup):
        step()
    _synchronize(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        loss = step()  # float(loss) synchronises with the device
        _synchronize(device)
        times.append(time.perf_counter() - start)
    world = dist.get_world_size() if data_parallel else 1
    sequences = len(lengths) * batch * world * steps
    row = {
        "gpus": world,
        "scores": ("sharded" if shard_scores else "whole batch on every rank") if data_parallel else "-",
        "rows_per_gpu": batch,
        "rows_per_loss": batch * world,
        "mini_batch_size": mini_batch,
        "steps": steps,
        "median_step_s": statistics.median(times),
        "sequences_per_s": sequences / sum(times),
        "final_loss": loss,
        "peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
    }
    return row


def _empty_cache(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------------------------------------- main


def _table(report: dict) -> str:
    lines = ["| check | result |", "|---|---|"]
    for row in report["equality"]:
        bar = "reported, not gated" if row["rtol"] is None else f"rtol {row['rtol']:.0e}"
        lines.append(
            f"| {row['check']} | {'PASS' if row['passed'] else 'FAIL'}: max relative error "
            f"{row['max_relative_error']:.2e} ({row['worst_parameter']}), {bar}, ranks "
            f"bitwise equal: {row['ranks_bitwise_equal']} |"
        )
    lines += [
        "",
        "| GPUs | scores | rows/GPU | rows/loss | mini-batch | median step (s) | sequences/s | peak GiB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in report["throughput"]:
        peak = "-" if row["peak_memory_gib"] is None else f"{row['peak_memory_gib']:.1f}"
        lines.append(
            f"| {row['gpus']} | {row['scores']} | {row['rows_per_gpu']} | {row['rows_per_loss']} | "
            f"{row['mini_batch_size']} | "
            f"{row['median_step_s']:.3f} | {row['sequences_per_s']:.0f} | {peak} |"
        )
    if "speedup" in report:
        target = report["speedup_target"]
        verdict = "PASS" if report["speedup"] >= target else "MISS"
        gpus = report["throughput"][-1]["gpus"]
        lines.append(
            f"\n{gpus}-GPU / 1-GPU sequences per second: {report['speedup']:.3f} (target >= {target:.2f}: {verdict}); "
            f"{gpus} independent 1-GPU runs at once / one alone: {report['concurrent_over_one']:.3f}"
        )
    stamp = ", ".join(
        f"{k} {report['stamp'][k]}" for k in ("device", "torch", "triton", "transformers", "nccl", "date")
    )
    return "\n".join(lines) + f"\n{stamp}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="JSON file to write (rank 0).")
    parser.add_argument("--batch", type=int, default=256, help="Effective batch per GPU (rows per column).")
    parser.add_argument("--mini-batch", type=int, default=64, help="GradCache mini-batch size.")
    parser.add_argument("--steps", type=int, default=10, help="Timed steps per configuration.")
    parser.add_argument("--smoke", action="store_true", help="CPU, gloo, tiny model: checks the script only.")
    parser.add_argument(
        "--equality-only", action="store_true", help="Run the equality phase only (launched)."
    )
    args = parser.parse_args()
    if args.smoke:
        args.batch, args.mini_batch, args.steps = 8, 3, 2

    launched = "RANK" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1
    if args.smoke:
        device = torch.device("cpu")
    else:
        if not torch.cuda.is_available():
            raise SystemExit("bench_ddp.py needs CUDA GPUs (or --smoke on CPU)")
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = False  # the equality check is fp32; bf16 autocast ignores it
        torch.backends.cudnn.allow_tf32 = False
    if launched:
        dist.init_process_group(
            "gloo" if args.smoke else "nccl",
            timeout=timedelta(minutes=5),
            **({} if args.smoke else {"device_id": device}),
        )
    rank = dist.get_rank() if launched else 0
    report: dict = {"stamp": run_stamp(device), "equality": [], "throughput": []}
    if launched:
        report["equality"] = equality_check(device, smoke=args.smoke)
        dist.barrier()
    if rank == 0 and not args.equality_only:
        report["throughput"].append(
            throughput(device, data_parallel=False, smoke=args.smoke, batch=args.batch,
                       mini_batch=args.mini_batch, steps=args.steps)
        )  # fmt: skip
        _empty_cache(device)
    if launched and not args.equality_only:
        dist.barrier()  # the other ranks wait here while rank 0 measures one GPU
        sizes = {"smoke": args.smoke, "batch": args.batch, "mini_batch": args.mini_batch, "steps": args.steps}
        alone = throughput(device, data_parallel=False, **sizes)  # every rank at once, independently
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, alone)
        _empty_cache(device)
        for shard_scores in (False, True):
            row = throughput(device, data_parallel=True, shard_scores=shard_scores, **sizes)
            report["throughput"].append(row)
            _empty_cache(device)
        if rank == 0:
            world = dist.get_world_size()
            report["concurrent_one_gpu"] = {
                "sequences_per_s_per_rank": [row["sequences_per_s"] for row in everyone],
                "median_step_s_per_rank": [row["median_step_s"] for row in everyone],
            }
            one = report["throughput"][0]["sequences_per_s"]
            concurrent = sum(row["sequences_per_s"] for row in everyone)
            best = max(row["sequences_per_s"] for row in report["throughput"][1:])
            report["speedup"] = best / one
            report["speedup_by_scores"] = {
                row["scores"]: row["sequences_per_s"] / one for row in report["throughput"][1:]
            }
            report["concurrent_over_one"] = concurrent / one  # the host's own bound on the speedup
            report["speedup_target"] = SPEEDUP_PER_GPU_TARGET * world
    if rank == 0:
        report["passed"] = all(row["passed"] for row in report["equality"]) and (
            "speedup" not in report or report["speedup"] >= report["speedup_target"]
        )
        print(_table(report), flush=True)
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as file:
            json.dump(report, file, indent=2)
    if launched:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
