"""Where the sparse blocked loss's time goes: ``torch.profiler`` over one forward and backward of ``SpladeLoss``
on SciFact text reps (``benchmarks.bench_loss_curve``'s ``text`` kind), ops by CUDA time, on one GPU.

    python -m benchmarks.profile_loss --beir_path /data/scifact --batch 32768 --out $OUT/loss_profile.txt

Three runs first, timed by CUDA events (the first warms up: cuBLAS heuristics, the allocator's blocks), then
one under the profiler: its table, ops by CUDA time.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks import bench_loss_curve
from gradcache_sparton.losses import SpladeLoss, SpladeLossConfig
from gradcache_sparton.losses.sparse import sparse_block_size

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--beir_path", required=True, help="BEIR folder (corpus.jsonl, queries.jsonl, qrels/)"
    )
    parser.add_argument("--batch", type=int, default=32_768, help="B queries (2B documents)")
    parser.add_argument("--out", required=True, help="text file for the profile tables")
    args = parser.parse_args(argv)
    curve = bench_loss_curve.parse_args(["--out", "unused", "--beir_path", args.beir_path])
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    reps, _ = bench_loss_curve.batch_reps("text", args.batch, bench_loss_curve.encoded_text(curve, device), 0)
    loss = SpladeLoss(SpladeLossConfig(query_reg_weight=5e-4, doc_reg_weight=3e-4))
    plan = bench_loss_curve.plan_stats(reps["query"], sparse_block_size(reps["query"].vocab_size))
    timed = [bench_loss_curve.run_loss(reps, loss, device)[0] for _ in range(3)][1:]  # the first warms up
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        seconds, _, _ = bench_loss_curve.run_loss(reps, loss, device)
        torch.cuda.synchronize()
    with open(args.out, "w", encoding="utf-8") as handle:
        handle.write(
            f"B={args.batch} unprofiled forward/backward s={timed}; profiled {seconds}; plan={plan}\n"
        )
        handle.write(
            prof.key_averages().table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=60)
        )
    print(f"wrote {args.out}: unprofiled forward/backward s={timed}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
