"""262,144 triplets in one cached step on W GPUs: the step's time split, peak memory, the loss's cost curve, exactness.

Legend: B global batch (triplets), W world size (GPUs), S sequence, V vocabulary (30,522), nnz non-zeros.

Model: the shipped SPLADE-tiny (``gradcache_sparton/resources/splade-tiny-msmarco``: BERT, 2 layers, D 128,
the fused Sparton head), train mode, bf16 autocast, AdamW. Data: random token ids, query 32, positive 256
and hard negative 256 tokens, no padding, B / W triplets per rank (65,536 at B 262,144, W 4). Random ids give
near-uniform term patterns (the loss's query blocks then span most of V); ``--text BEIR_DIR`` draws real
SciFact text instead (``benchmarks/scifact_text.py``: claims and abstract sentences as queries, truncated to
``--query_len``, their abstracts as positives and random other abstracts as hard negatives, truncated to
``--doc_len`` and padded to the longest; drawn with replacement, each rank its own draws).

Step: GradCache with ``sparse_reps`` (each column kept as its non-zeros from Step (1) to Step (3): dense fp32
[B, V] reps of 3 x 262,144 rows would take 96 GiB on every rank), reps gathered across ranks, mini-batches of
``--mini_batch`` passages and 8x as many queries, ``reuse_argmax`` (Step (3) rebuilds the head from Step (1)'s
argmax, the trainer's default). Loss: ``SpladeLoss`` (InfoNCE over all B positives and B
hard negatives, FLOPS), its [B, 2B] scores never held whole: [block, V] blocks densified from the non-zeros,
multiplied on the tensor cores in bf16 with exact products and fp32 sums (``losses/blocked.py``: the
B x 2B x V multiply-adds, 8 products a block, run on the tensor cores, not the fp32 units; no B² memory), each rank scoring 1/W of the queries (``shard_scores_across_ranks``: W times less score work
per rank than every rank scoring the whole gathered batch). Timed phases (synchronised, the slowest rank's):
Step (1) encode, Step (2) loss + rep gradients (gather included), Step (3) replay, the optimizer step.
Also recorded: the non-zeros per row and ``shared_nonzeros_per_pair`` (the loss's FLOPS statistic,
sum_v p_q(v) p_d(v)): the multiply-adds per score that sparse x sparse scoring would do, against V for
the dense blocks.

Phases, in order (the step always runs; the curve stops where ``--budget_s`` would be passed):

  exactness  (``--exactness``: fp32, TF32 off, dropout off, 8 x W triplets, score blocks of 4) the cached step
             above on W ranks under DDP equals the uncached step (dense reps, unsharded scores) of one
             process on the global batch, every parameter gradient within ``--rtol`` (1e-4) of its largest,
             floored at 1e-4 of the model's largest (as ``bench_ddp.py``: the attention key biases' true
             gradient is exactly zero, theirs is rounding noise; a missing gather, scale or shard sum is O(1));
  step       one cached step at ``--batch``, after a warm-up step of 2 mini-batches per rank (Triton);
  curve      the loss alone (Step (2): gather, loss, rep gradients) on synthetic sparse reps with the step's
             nnz per row, at B = 16,384, 32,768, ... up to ``--batch``; a point whose projected time (4x the
             last: the scores grow as B²) would pass the budget is skipped and named.

On 4 GPUs (rank 0 writes ``--out``, rewritten after every phase):

    export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
    torchrun --nproc_per_node 4 -m benchmarks.bench_262k --exactness --budget_s 140 --out $OUT/262k.json
    torchrun --nproc_per_node 4 -m benchmarks.bench_262k --text /data/scifact --budget_s 140 --out $OUT/262k_text.json

``--device cpu`` (gloo) with small ``--batch`` checks the script; only its exactness result means something.
"""

from __future__ import annotations

import os

for _name, _value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")):
    os.environ.setdefault(_name, _value)  # NVLink multicast stays off on the shared machines

import argparse  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from datetime import timedelta  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import Tensor  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from benchmarks.common import run_stamp  # noqa: E402
from benchmarks.scifact_text import read_pairs, tokenize  # noqa: E402
from gradcache_sparton import SpladeEncoder, SpladeLoss, SpladeLossConfig  # noqa: E402
from gradcache_sparton.engine import GradCache  # noqa: E402
from gradcache_sparton.engine.sparse_grads import SparseRepGrad  # noqa: E402
from gradcache_sparton.primitives.sparse_reps import SparseReps  # noqa: E402
from gradcache_sparton.resources import shipped_model_path  # noqa: E402

CURVE_START = 16_384


def loss_fn(world: int, block_size: int | None) -> SpladeLoss:
    return SpladeLoss(SpladeLossConfig(query_reg_weight=5e-4, doc_reg_weight=3e-4, score_block_size=block_size,
                                       shard_scores_across_ranks=world > 1))  # fmt: skip


def columns(
    rows: int, lengths: dict[str, int], device: torch.device, seed: int
) -> dict[str, dict[str, Tensor]]:
    """Random token ids (no tokenizer: the numbers are the model step's), no padding."""
    generator = torch.Generator(device=device).manual_seed(seed)
    out = {}
    for name, length in lengths.items():
        ids = torch.randint(1000, 30522, (rows, length), device=device, generator=generator)
        out[name] = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    return out


def text_tokens(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """Every query and abstract of ``--text`` tokenized once ([n, S] on ``device``), and each query's abstract."""
    pairs = read_pairs(args.text)
    tokenizer = AutoTokenizer.from_pretrained(shipped_model_path("splade-tiny-msmarco"))
    return {"query": tokenize(pairs.queries, tokenizer, args.query_len, device),
            "document": tokenize(pairs.documents, tokenizer, args.doc_len, device),
            "positive": torch.tensor(pairs.positive)}  # fmt: skip


def text_columns(rows: int, tokens: dict[str, Any], seed: int) -> dict[str, dict[str, Tensor]]:
    """``rows`` triplets drawn with replacement: a query, its abstract, another random abstract."""
    generator = torch.Generator().manual_seed(seed)
    queries = torch.randint(0, tokens["positive"].numel(), (rows,), generator=generator)
    positives = tokens["positive"][queries]
    documents = tokens["document"]["input_ids"].shape[0]
    negatives = (positives + torch.randint(1, max(2, documents), (rows,), generator=generator)) % documents
    picks = {
        "query": ("query", queries),
        "positive": ("document", positives),
        "negative": ("document", negatives),
    }
    return {name: {k: v[picked.to(v.device)] for k, v in tokens[source].items()}
            for name, (source, picked) in picks.items()}  # fmt: skip


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def slowest(values: list[float], device: torch.device) -> list[float]:
    """Each value's maximum over the ranks."""
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return [round(v, 3) for v in tensor.tolist()]


def engine_for(encoder: Any, mini_batch: int) -> GradCache:
    sizes = {"query": 8 * mini_batch, "positive": mini_batch, "negative": mini_batch}
    return GradCache(encoder, mini_batch_size=sizes, sparse_reps=True, reuse_argmax=True, check_replay=False)


def cached_step(
    engine: GradCache, batch: dict, loss: SpladeLoss, device: torch.device
) -> tuple[list[float], Any]:
    """Steps (1), (2), (3) of one cached step, each timed; the loss output and the reps' nnz per row."""
    times, began = [], time.perf_counter()

    def lap() -> None:
        nonlocal began
        synchronize(device)
        times.append(time.perf_counter() - began)
        began = time.perf_counter()

    reps, state = engine.encode(batch)  # Step (1)
    lap()
    output, grads = engine.rep_gradients(reps, loss)  # Step (2), across ranks
    nnz = {name: rep.weights.numel() / rep.num_rows for name, rep in reps.items()}
    kept = {name: SparseRepGrad.at_sparse_reps(reps[name], grad, [mb.rows for mb in state.mini_batches[name]])
            for name, grad in grads.items()}  # fmt: skip
    del reps, grads
    lap()
    engine.replay(state, kept)  # Step (3)
    lap()
    return times, (output, nnz)


def exactness(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """W-rank cached step (sparse reps, blocked and sharded scores, DDP) against one process's uncached step."""
    rank, world = dist.get_rank(), dist.get_world_size()
    per_rank, lengths = 8, {"query": 8, "positive": 16, "negative": 16}
    batch = columns(per_rank * world, lengths, device, seed=7)
    reference = SpladeEncoder.from_pretrained(shipped_model_path("splade-tiny-msmarco")).to(device).eval()
    full_loss = SpladeLoss(SpladeLossConfig(query_reg_weight=5e-4, doc_reg_weight=3e-4))
    full_loss({name: reference(**features) for name, features in batch.items()})[0].backward()  # uncached
    want = {name: p.grad for name, p in reference.named_parameters()}
    encoder = SpladeEncoder.from_pretrained(shipped_model_path("splade-tiny-msmarco")).to(device).eval()
    ddp = DistributedDataParallel(encoder, device_ids=[device.index] if device.type == "cuda" else None)
    local = {
        c: {k: v[rank * per_rank : (rank + 1) * per_rank] for k, v in f.items()} for c, f in batch.items()
    }
    engine = GradCache(ddp, mini_batch_size=3, sparse_reps=True, reuse_argmax=True)
    engine.step(local, loss_fn(world, block_size=4))
    largest = max(float(g.abs().max()) for g in want.values())
    errors = {name: float((p.grad - want[name]).abs().max()) / max(float(want[name].abs().max()), 1e-4 * largest)
              for name, p in encoder.named_parameters()}  # fmt: skip
    worst = max(errors, key=errors.__getitem__)
    return {"max_relative_error": errors[worst], "worst_parameter": worst, "rtol": args.rtol,
            "passed": errors[worst] <= args.rtol, "rows": per_rank * world}  # fmt: skip


def synthetic_reps(rows: int, nnz: int, vocab: int, device: torch.device, seed: int) -> SparseReps:
    """``rows`` sparse reps of ``nnz`` <= V / 7 distinct ascending ids each (stride 7, coprime with V = 30,522),
    bf16-valued weights."""
    generator = torch.Generator(device=device).manual_seed(seed)
    starts = torch.randint(0, vocab, (rows, 1), device=device, generator=generator)
    ids = ((starts + 7 * torch.arange(nnz, device=device)) % vocab).sort(dim=1).values  # [rows, nnz]
    weights = torch.rand(rows * nnz, device=device, generator=generator) + 0.1
    offsets = torch.arange(0, rows * nnz + 1, nnz, device=device)
    return SparseReps(offsets, ids.reshape(-1).to(torch.int32), weights.bfloat16().float(), vocab)


def curve_point(batch: int, nnz: dict[str, float], args: argparse.Namespace, device: torch.device) -> float:
    """Seconds of Step (2) alone (gather, loss forward and backward to the reps) at global batch ``batch``."""
    world, rank = dist.get_world_size(), dist.get_rank()
    reps = {name: synthetic_reps(batch // world, min(30522 // 7, max(1, round(nnz[name]))), 30522, device, seed=rank * 3 + i)
            for i, name in enumerate(nnz)}  # fmt: skip
    for rep in reps.values():
        rep.weights.requires_grad_(True)
    engine = GradCache(lambda **features: None, mini_batch_size=1, sparse_reps=True)  # Step (2) only
    synchronize(device)
    began = time.perf_counter()
    engine.rep_gradients(reps, loss_fn(world, args.score_block_size))
    synchronize(device)
    return slowest([time.perf_counter() - began], device)[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON file (rank 0)")
    parser.add_argument("--batch", type=int, default=262_144, help="global triplets of the step")
    parser.add_argument("--mini_batch", type=int, default=1024, help="passages per mini-batch (queries: 8x)")
    parser.add_argument("--query_len", type=int, default=32)
    parser.add_argument("--doc_len", type=int, default=256, help="positive and negative tokens")
    parser.add_argument("--score_block_size", type=int, default=None, help="score block edge (default: auto)")
    parser.add_argument("--text", default=None, metavar="BEIR_DIR",
                        help="draw the step's triplets from this BEIR folder's text (default: random token ids)")  # fmt: skip
    parser.add_argument("--exactness", action="store_true", help="run the exactness phase first")
    parser.add_argument("--rtol", type=float, default=1e-4, help="exactness tolerance (fp32, module doc)")
    parser.add_argument("--curve_start", type=int, default=CURVE_START)
    parser.add_argument("--budget_s", type=float, default=240.0, help="wall-clock budget of the launch")
    parser.add_argument("--timeout_s", type=float, default=300.0, help="process group timeout")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args = parser.parse_args()
    began = time.monotonic()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.batch % world or args.curve_start % world:
        parser.error(f"--batch and --curve_start must be multiples of W = {world}")
    device = torch.device("cpu")
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo", timeout=timedelta(seconds=args.timeout_s)
    )
    rank = dist.get_rank()
    results: dict[str, Any] = {"stamp": run_stamp(device), "command": " ".join(sys.argv), "args": vars(args),
                               "world_size": world, "exactness": None, "step": None, "curve": []}  # fmt: skip

    def save() -> None:
        if rank == 0:
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out, "w") as file:
                json.dump(results, file, indent=1)

    if args.exactness:
        tf32, torch.backends.cuda.matmul.allow_tf32 = torch.backends.cuda.matmul.allow_tf32, False
        results["exactness"] = exactness(args, device)
        torch.backends.cuda.matmul.allow_tf32 = tf32
        save()
    encoder = SpladeEncoder.from_pretrained(shipped_model_path("splade-tiny-msmarco")).to(device).train()
    model = DistributedDataParallel(encoder, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.AdamW(encoder.parameters(), lr=1e-5, fused=device.type == "cuda")
    engine = engine_for(model, args.mini_batch)
    autocast = (
        torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()
    )
    lengths = {"query": args.query_len, "positive": args.doc_len, "negative": args.doc_len}
    tokens = None if args.text is None else text_tokens(args, device)

    def draw(rows: int, seed: int) -> dict[str, dict[str, Tensor]]:
        return columns(rows, lengths, device, seed) if tokens is None else text_columns(rows, tokens, seed)

    warm = draw(2 * args.mini_batch, seed=rank)  # Triton compilation
    with autocast:
        cached_step(engine, warm, loss_fn(world, args.score_block_size), device)
    optimizer.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    batch = draw(args.batch // world, seed=100 + rank)
    results["step"] = {"batch": args.batch, "rows_per_rank": args.batch // world, "status": "running"}
    save()
    with autocast:
        times, (output, nnz) = cached_step(engine, batch, loss_fn(world, args.score_block_size), device)
    began_optimizer = time.perf_counter()
    optimizer.step()
    synchronize(device)
    times.append(time.perf_counter() - began_optimizer)
    phases = dict(
        zip(
            ("encode_s", "loss_and_rep_grads_s", "replay_s", "optimizer_s"),
            slowest(times, device),
            strict=True,
        )
    )
    peak = None
    if device.type == "cuda":
        mine = torch.tensor([torch.cuda.max_memory_allocated(device) / 2**30], device=device)
        everyone = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(everyone, mine)
        peak = [round(float(t), 2) for t in everyone]
    results["step"].update(status="ok", **phases, step_s=round(sum(phases.values()), 3), peak_gib_per_gpu=peak,
                           loss=float(output.loss), nnz_per_row=nnz,
                           shared_nonzeros_per_pair=float(output.components["flops"]))  # fmt: skip
    save()
    del batch, engine, model, optimizer
    point, last = args.curve_start, None
    while point <= args.batch:
        if last is not None and time.monotonic() - began + 4 * last > args.budget_s:
            results["curve"].append({"batch": point, "status": "budget", "projected_s": round(4 * last, 1)})
            break
        last = curve_point(point, nnz, args, device)
        results["curve"].append({"batch": point, "status": "ok", "loss_s": last})
        save()
        point *= 2
    save()
    dist.barrier()  # every rank done before one leaves the group (pytorch#75097)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
