"""``reuse_argmax`` on a CPU: one cached training step of the embedded default run, with and without it.

Legend: B batch (pairs), S sequence.

The setting of ``gradcache-sparton train``'s default run: the shipped SPLADE-tiny (D 128, 2 layers,
V 30,522), B = 32 (query, positive) pairs in one mini-batch of 32, queries of 32 tokens and passages of
64 (random token ids of the vocabulary, no padding: the cost does not depend on which tokens), the
default SpladeLoss weights (FLOPS query 5e-4, document 3e-4), fp32. A step is
``CachedLoss(encoder, loss, mini_batch_size=32, reuse_argmax=...)(columns).backward()``; the
optimizer is left out (the same in both). The two settings alternate, ``--repeats`` passes of
``--steps`` steps each, so a drift of the machine's speed reaches both; the first step of each pass is
a warm-up. Prints each step's seconds and the ratio of the medians.

    python benchmarks/bench_reuse_argmax_cpu.py
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from gradcache_sparton.engine import CachedLoss
from gradcache_sparton.losses import SpladeLoss, SpladeLossConfig
from gradcache_sparton.modeling import SpladeEncoder
from gradcache_sparton.resources import shipped_model_path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4, help="steps per pass, the first a warm-up")
    parser.add_argument("--repeats", type=int, default=2, help="passes of each setting, alternating")
    args = parser.parse_args()

    torch.manual_seed(0)
    encoder = SpladeEncoder.from_pretrained(shipped_model_path("splade-tiny-msmarco")).train()
    vocab = encoder.head.vocab_size

    def column(length: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(1000, vocab, (32, length))  # [B, S]
        return {
            "input_ids": ids,
            "attention_mask": torch.ones_like(ids),
            "token_type_ids": torch.zeros_like(ids),
        }

    columns = {"query": column(32), "positive": column(64)}
    loss = SpladeLoss(SpladeLossConfig(query_reg_weight=5e-4, doc_reg_weight=3e-4))
    times: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(args.repeats):
        for reuse in (False, True):
            cached = CachedLoss(encoder, loss, mini_batch_size=32, reuse_argmax=reuse)
            for step in range(args.steps):
                start = time.perf_counter()
                cached(columns).backward()
                if step > 0:
                    times[reuse].append(time.perf_counter() - start)
            encoder.zero_grad(set_to_none=True)
            print(f"reuse_argmax={reuse}: " + " ".join(f"{t:.3f}" for t in times[reuse][-(args.steps - 1) :]))
    medians = {reuse: statistics.median(ts) for reuse, ts in times.items()}
    print(
        f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}: "
        f"median {medians[False]:.3f} s without, {medians[True]:.3f} s with: {medians[False] / medians[True]:.2f}x"
    )


if __name__ == "__main__":
    main()
