"""FSDP2 + GradCache on a billion-parameter sparse retriever built sharded: pairs/s, peak memory, largest batch.

Legend: B global batch (pairs), W world size (GPUs), S sequence, D hidden, V vocabulary (128,256).

Model: a Llama decoder with random weights from its config (``--shape`` from ``bench_llm_step.SHAPES``:
``llama-3-8b``, D 4,096, 32 layers, 8.0B parameters; ``llama-3.2-1b``, D 2,048, 16 layers, 1.2B), as a
``SpladeEncoder`` (the fused Sparton head over ``lm_head``, V 128,256). Built sharded: constructed on the
meta device, each decoder layer then the root ``fully_shard``-ed (FSDP2), ``to_empty`` on the GPU, and
every rank initialises only its own shards (normal(0, 0.02), norms 1, LoRA B 0; the rotary buffers
recomputed): no GPU ever holds the whole model. fp32 shards computed in bf16
(``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``), activation checkpointing in every
decoder layer. Training ``lora`` (peft r 16, alpha 32, q/k/v/o) or ``full`` (every weight), AdamW.

Step: ``CachedLoss`` over ``SpladeLoss`` (InfoNCE over in-batch negatives + FLOPS), the reps gathered
across ranks (the loss sees all B pairs), gradients reduce-scattered once per step: until then each rank
holds its units' unsharded gradients, the whole model's, accumulated in the fp32 reduce dtype (4 B per
trainable parameter); ``--grad_sync auto`` reduces every mini-batch instead where that would not fit
(``grad_sync()``; the row says which). Mini-batches of ``--mini_batch`` passages and 8x as many queries;
``check_replay`` off. Data: random token ids, query 32 and passage 256
tokens, no padding, B / W pairs per rank.

Per training mode (an equal share of what is left of ``--budget_s`` each): two warm-up steps of W x
mini-batch pairs (Triton, optimizer state), ``--steps`` steps at ``--batch`` (4,096) between CUDA events
(median, the slowest rank's; pairs/s = B / median; peak ``max_memory_allocated`` of every GPU), then B
doubled, one step each, until an OOM on every rank, a step projected (2x the last) past the mode's budget,
or ``--max_batch``. ``projected_largest_batch``: the last two peaks extended linearly in B to 95% of the
GPU's memory (a projection). An OOM on some ranks only leaves the others in a collective until
``--timeout_s`` ends the launch; the row being run was written first, with status "running".

On 4 GPUs (rank 0 writes ``--out``, rewritten after every row):

    export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
    torchrun --nproc_per_node 4 -m benchmarks.bench_fsdp_llm --shape llama-3-8b --steps 1 --budget_s 150 --out $OUT/fsdp_8b.json

``--device cpu`` (gloo, fp32, ``--shape tiny``) checks the script; its numbers mean nothing.
"""

from __future__ import annotations

import os

for _name, _value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")):
    os.environ.setdefault(_name, _value)  # NVLink multicast stays off on the shared machines

import argparse  # noqa: E402
import contextlib  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from datetime import timedelta  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import Tensor  # noqa: E402
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from benchmarks.bench_llm_step import LORA_TARGETS, LOSS, SHAPES  # noqa: E402
from benchmarks.common import run_stamp  # noqa: E402
from gradcache_sparton import CachedLoss, SpladeEncoder, SpladeLoss  # noqa: E402

MEMORY_FRACTION = 0.95  # of the GPU's memory, for projected_largest_batch
# Weights, gradients, AdamW state and the cache's unsharded gradients may take this much of a GPU, the rest
# being for activations and reps (8B shape, full, W 4: 60 GiB, over 70% of an H100, under it of an H200).
STATIC_FRACTION = 0.7


def build_sharded(shape: str, training: str, device: torch.device) -> tuple[SpladeEncoder, dict[str, Any]]:
    """The SpladeEncoder on the meta device, sharded (layers, then the root), materialised shard by shard."""
    config = SHAPES[shape]()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    if training == "lora":
        import peft

        peft.get_peft_model(model, peft.LoraConfig(r=16, lora_alpha=32, target_modules=LORA_TARGETS))
    encoder = SpladeEncoder(model)
    encoder.gradient_checkpointing_enable({"use_reentrant": False})
    sizes = {"parameters": sum(p.numel() for p in encoder.parameters())}
    sizes["trainable"] = sum(p.numel() for p in encoder.parameters() if p.requires_grad)
    policy = MixedPrecisionPolicy()  # fp32 on the CPU: the check runs anywhere
    if device.type == "cuda":
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(encoder, mp_policy=policy)
    encoder.to_empty(device=device)
    initialise(encoder, device)
    # Each rank's share of each parameter (1.0: a parameter that some rank holds whole).
    local = [
        (p.to_local().numel() if isinstance(p, DTensor) else p.numel(), p.numel())
        for p in encoder.parameters()
    ]
    sizes["largest_local_fraction"] = max(mine / whole for mine, whole in local)  # fmt: skip
    sizes["local_parameters"] = sum(mine for mine, _ in local)
    return encoder.train(), sizes


@torch.no_grad()
def initialise(encoder: SpladeEncoder, device: torch.device) -> None:
    """Random values in this rank's shards only (the shards differ by rank: seeded by it)."""
    generator = torch.Generator(device=device).manual_seed(1000 + dist.get_rank())
    for name, p in encoder.named_parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        if "lora_B" in name:
            local.zero_()
        elif local.ndim == 1:  # RMSNorm weights (Llama has no biases)
            local.fill_(1.0)
        else:
            local.normal_(0.0, 0.02, generator=generator)
    for module in encoder.modules():  # to_empty left the rotary embeddings' buffers uninitialised
        if hasattr(module, "original_inv_freq"):
            fresh = type(module)(module.config)
            module.inv_freq.copy_(fresh.inv_freq)
            module.original_inv_freq.copy_(fresh.original_inv_freq)


def pairs(rows: int, args: argparse.Namespace, vocab: int, device: torch.device) -> dict[str, dict[str, Tensor]]:  # fmt: skip
    """This rank's (query, positive) rows of random token ids, no padding."""
    generator = torch.Generator(device=device).manual_seed(1234 + dist.get_rank())
    columns = {}
    for column, length in (("query", args.query_len), ("positive", args.doc_len)):
        ids = torch.randint(0, vocab, (rows, length), device=device, generator=generator)
        columns[column] = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    return columns


def timed_step(step: Any, columns: dict, device: torch.device) -> float | None:
    """One step's seconds (CUDA events; the slowest rank's), or None when it ran out of memory on every rank."""
    try:
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step(columns)
            end.record()
            torch.cuda.synchronize()
            seconds = start.elapsed_time(end) / 1000
        else:
            began = time.perf_counter()
            step(columns)
            seconds = time.perf_counter() - began
    except torch.OutOfMemoryError:
        seconds = -1.0  # an OOM here, after every collective of the step was joined (or the launch hangs)
    result = torch.tensor([seconds, -seconds], device=device)
    dist.all_reduce(result, op=dist.ReduceOp.MAX)  # [slowest, -fastest]: any rank's OOM shows as -(-1)
    return None if result[1] > 0 else float(result[0])


def peaks(device: torch.device) -> list[float] | None:
    """Every rank's peak allocated GiB since the last reset (None on the CPU)."""
    if device.type != "cuda":
        return None
    mine = torch.tensor([torch.cuda.max_memory_allocated(device) / 2**30], device=device)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    torch.cuda.reset_peak_memory_stats(device)
    return [round(float(t), 2) for t in everyone]


def projected_largest(rows: list[dict[str, Any]], device: torch.device) -> int | None:
    """B at which the last two measured peaks, extended linearly in B, reach MEMORY_FRACTION of the GPU."""
    points = [(r["batch"], max(r["peak_gib_per_gpu"])) for r in rows if r["status"] == "ok" and r["peak_gib_per_gpu"]]  # fmt: skip
    if device.type != "cuda" or len(points) < 2:
        return None
    (b1, p1), (b2, p2) = sorted(points)[-2:]
    if b2 == b1 or p2 <= p1:
        return None
    total = torch.cuda.get_device_properties(device).total_memory / 2**30
    return int(b2 + (MEMORY_FRACTION * total - p2) * (b2 - b1) / (p2 - p1))


def grad_sync(choice: str, sizes: dict[str, Any], world: int, device: torch.device) -> str:
    """'step' (one reduce-scatter per step) or 'mini_batch'; 'auto': per step unless the sharded fp32 weights,
    gradients and AdamW state (16 B per trainable parameter / W) plus the unsharded fp32 gradients it holds
    until the last replay (4 B per trainable parameter) pass STATIC_FRACTION of the GPU's memory."""
    if choice != "auto" or device.type != "cuda":
        return "step" if choice == "auto" else choice
    static = 16 * sizes["trainable"] / world + 4 * sizes["trainable"]
    return (
        "step"
        if static <= STATIC_FRACTION * torch.cuda.get_device_properties(device).total_memory
        else "mini_batch"
    )


def run_mode(training: str, args: argparse.Namespace, device: torch.device, budget_s: float, record: Any) -> None:  # fmt: skip
    """Build, warm up, time ``--batch`` and search larger batches for one training mode."""
    began, world = time.monotonic(), dist.get_world_size()
    encoder, sizes = build_sharded(args.shape, training, device)
    optimizer = torch.optim.AdamW([p for p in encoder.parameters() if p.requires_grad], lr=1e-5)
    sync = grad_sync(args.grad_sync, sizes, world, device)
    every = {"mini_batch_context": lambda is_last: contextlib.nullcontext()} if sync == "mini_batch" else {}
    cached = CachedLoss(encoder, SpladeLoss(LOSS), check_replay=False, **every,
                        mini_batch_size={"query": 8 * args.mini_batch, "positive": args.mini_batch})  # fmt: skip
    losses: list[Tensor] = []

    def step(columns: dict) -> None:
        loss = cached(columns)
        loss.backward()
        losses.append(loss.detach())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    base = {"shape": args.shape, "training": training, "world_size": world, "mini_batch": args.mini_batch,
            "grad_sync": sync, "build_s": round(time.monotonic() - began, 1), **sizes}  # fmt: skip
    mode_rows: list[dict[str, Any]] = []

    def attempt(phase: str, batch: int, steps: int) -> float | None:
        row = record(base | {"phase": phase, "batch": batch, "status": "running"})
        columns = pairs(batch // world, args, encoder.vocab_size, device)
        times = []
        for _ in range(steps):
            if times and time.monotonic() - began + times[-1] > budget_s:
                break  # at least one step: the rest as the mode's budget allows
            seconds = timed_step(step, columns, device)
            if seconds is None:
                row.update(status="OOM")
                break
            times.append(seconds)
        if times and row["status"] == "running":
            median = statistics.median(times)
            row.update(status="ok", step_s=round(median, 3), pairs_per_s=round(batch / median, 1), steps=len(times),
                       loss=float(losses[-1]))  # fmt: skip
        row["peak_gib_per_gpu"] = peaks(device)
        mode_rows.append(row)
        row["projected_largest_batch"] = projected_largest(mode_rows, device)
        record(row)
        return statistics.median(times) if row["status"] == "ok" else None

    for _ in range(2):
        attempt("warm-up", world * args.mini_batch, 1)
    last = attempt("timed", args.batch, args.steps)
    batch = args.batch * 2
    while last is not None and batch <= args.max_batch:
        if time.monotonic() - began + 2 * last > budget_s:
            record(base | {"phase": "search", "batch": batch, "status": "budget",
                           "projected_step_s": round(2 * last, 1)})  # fmt: skip
            break
        last = attempt("search", batch, 1)
        batch *= 2


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON file (rank 0)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-3-8b")
    parser.add_argument("--training", default="lora,full", help="comma list of lora, full (in this order)")
    parser.add_argument("--batch", type=int, default=4096, help="global effective batch (pairs)")
    parser.add_argument("--mini_batch", type=int, default=32, help="passages per mini-batch (queries: 8x)")
    parser.add_argument("--query_len", type=int, default=32)
    parser.add_argument("--doc_len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=3, help="timed steps at --batch (the median)")
    parser.add_argument("--max_batch", type=int, default=1 << 17, help="the search stops here")
    parser.add_argument("--budget_s", type=float, default=240.0, help="wall-clock budget of the launch")
    parser.add_argument("--timeout_s", type=float, default=180.0, help="process group timeout")
    parser.add_argument("--grad_sync", choices=("auto", "step", "mini_batch"), default="auto",
                        help="reduce-scatter once per step or per mini-batch (auto: grad_sync())")  # fmt: skip
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args = parser.parse_args()
    began = time.monotonic()
    modes = args.training.split(",")
    if any(mode not in ("lora", "full") for mode in modes):
        parser.error(f"--training: modes are lora and full, got {args.training!r}")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.batch % world or args.batch < world * args.mini_batch:
        parser.error(f"--batch {args.batch} must be a multiple of W = {world} and >= W x --mini_batch")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if args.device == "cuda" else torch.device("cpu")  # fmt: skip
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timedelta(seconds=args.timeout_s))  # fmt: skip
    rank = dist.get_rank()
    results = {"stamp": run_stamp(device), "command": " ".join(sys.argv), "args": vars(args), "rows": []}

    def record(row: dict[str, Any]) -> dict[str, Any]:
        """Add (or update) a row; rank 0 rewrites the JSON and prints it."""
        if not any(r is row for r in results["rows"]):
            results["rows"].append(row)
        if rank == 0:
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out, "w") as file:
                json.dump(results, file, indent=1)
            print(json.dumps(row), flush=True)
        return row

    for i, training in enumerate(modes):
        share = (args.budget_s - (time.monotonic() - began)) / (len(modes) - i)
        run_mode(training, args, device, share, record)
        gc.collect()  # the mode's model and optimizer state go with run_mode's frame
        if device.type == "cuda":
            torch.cuda.empty_cache()
    dist.barrier()  # every rank done before one leaves the group (pytorch#75097)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
