"""Inference-free models: what a query costs on a CPU, and what the document side costs on a GPU.

Legend: B batch (documents), S sequence, V vocabulary.

``--mode cpu`` (the default): one query at a time, from its text to its [1, V] rep, on the CPU in fp32, over
the shipped SciFact dev sample's queries (``--passes`` times each; the two encoders alternate query by
query, so a drift of the machine's speed reaches both):

- ``splade_plain``: the shipped SPLADE-tiny's query encoder as plain PyTorch and sentence-transformers run
  it on a CPU (tokenize, the masked-LM's [1, S, V] logits, then ``max_s log1p(relu(logits))``);
- ``splade_fused``: the same model as :class:`~gradcache_sparton.modeling.SpladeEncoder` runs it on a CPU
  (the Sparton head's PyTorch reference, chunked over V; slower than the plain route for one query);
- ``table``: the same model's inference-free query side (tokenize, then the IDF table's lookup,
  :class:`~gradcache_sparton.modeling.QueryTable`; the IDF of the sample's corpus);
- ``tokenize``: the tokenizer alone, the floor both share.

It prints and writes (``--output``) the median and 90th percentile of each and ``speedup_median``: the
faster SPLADE route's median over the table's.
Medians over many queries: the machine may be shared (the 1-minute load average before and after is
recorded), and a median is what one query usually costs.

``--mode gpu``: the document side at batch ``--batch`` (``--document_length`` tokens of random ids, bf16
autocast, a training step's forward and backward of the reps' sum, and an encoding's forward under
``no_grad``), documents/s for

- ``fused``: :class:`~gradcache_sparton.modeling.SpladeEncoder` (the Sparton head: the [B, S, V] logits are
  never formed);
- ``plain``: the masked-LM's own logits [B, S, V], then ``max_s log1p(relu(logits))``
  (:func:`~gradcache_sparton.kernels.splade_max_pool`): the document route of sentence-transformers'
  ``MLMTransformer`` + ``SpladePooling`` and of plain PyTorch code;

and, with ``--memory_gib``, the largest training batch of each (doubling, then bisecting) whose step fits
in that much GPU memory (``torch.cuda.set_per_process_memory_fraction``): the case of
sentence-transformers issue 3441, an inference-free model's document route out of memory.

    python -m benchmarks.bench_inference_free --output benchmarks/results/inference_free_cpu.json
    python -m benchmarks.bench_inference_free --mode gpu --batch 64 --memory_gib 48 \\
        --output benchmarks/results/inference_free_gpu.json

``--smoke`` runs a few queries (cpu) or a tiny batch (gpu): it checks the script, its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import run_stamp, write_result
from gradcache_sparton.data import load_beir
from gradcache_sparton.data.shipped import default_dev_beir_path
from gradcache_sparton.kernels import splade_max_pool
from gradcache_sparton.modeling import QueryTable, SpladeEncoder, idf_weights
from gradcache_sparton.resources import shipped_model_path

__all__ = ["cpu_query_times", "gpu_document_rows", "main", "parse_args"]

# The query length of training and evaluation (SPLADE's usual 32 tokens).
QUERY_MAX_LENGTH = 32


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("cpu", "gpu"), default="cpu")
    parser.add_argument("--passes", type=int, default=5, help="cpu: passes over the sample's queries")
    parser.add_argument("--threads", type=int, default=None, help="cpu: torch threads (default: torch's)")
    parser.add_argument("--batch", type=int, default=64, help="gpu: documents per batch")
    parser.add_argument("--document_length", type=int, default=256, help="gpu: tokens per document")
    parser.add_argument("--steps", type=int, default=10, help="gpu: timed steps per route (after 2 warm-ups)")
    parser.add_argument("--memory_gib", type=float, default=None, help="gpu: find the largest batch in this")
    parser.add_argument("--output", type=Path, default=None, help="JSON file for the rows (default: print)")
    parser.add_argument(
        "--smoke", action="store_true", help="a few queries / a tiny batch: checks the script"
    )
    return parser.parse_args(argv)


# ------------------------------------------------------------------------------------------------- cpu


def cpu_query_times(queries: Sequence[str], corpus: Sequence[str], *, passes: int) -> dict[str, Any]:
    """Seconds per query of each encoder (module doc), their medians and 90th percentiles, and the ratio."""
    from transformers import AutoTokenizer

    folder = shipped_model_path("splade-tiny-msmarco")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    encoder = SpladeEncoder.from_pretrained(folder).eval()
    table = QueryTable(idf_weights(corpus, tokenizer), special_token_ids=tokenizer.all_special_ids).eval()

    def tokenize(text: str) -> dict[str, torch.Tensor]:
        return tokenizer(text, truncation=True, max_length=QUERY_MAX_LENGTH, return_tensors="pt")

    def plain(text: str) -> torch.Tensor:
        features = tokenize(text)
        logits = encoder.model(**features).logits  # [1, S, V]
        return splade_max_pool(logits, features["attention_mask"])  # [1, S, V] -> [1, V]

    routes: dict[str, Callable[[str], object]] = {
        "splade_plain": plain,
        "splade_fused": lambda text: encoder(**tokenize(text)),  # [1, V]
        "table": lambda text: table(**tokenize(text)),  # [1, V]
        "tokenize": tokenize,
    }
    seconds: dict[str, list[float]] = {name: [] for name in routes}
    with torch.inference_mode():
        for route in routes.values():  # warm-up: first calls allocate and build caches
            route(queries[0])
        for _ in range(passes):
            for text in queries:
                for name, route in routes.items():
                    start = time.perf_counter()
                    route(text)
                    seconds[name].append(time.perf_counter() - start)
    summary = {
        name: {
            "queries": len(values),
            "median_ms": 1e3 * statistics.median(values),
            "p90_ms": 1e3 * statistics.quantiles(values, n=10)[-1],
        }
        for name, values in seconds.items()
    }
    fastest = min(summary["splade_plain"]["median_ms"], summary["splade_fused"]["median_ms"])
    summary["speedup_median"] = fastest / summary["table"]["median_ms"]
    return summary


# ------------------------------------------------------------------------------------------------- gpu


class _PlainRoute(torch.nn.Module):
    """The masked-LM's [B, S, V] logits, then the plain SPLADE pooling: sentence-transformers' document route."""

    def __init__(self, encoder: SpladeEncoder) -> None:
        super().__init__()
        self.model = encoder.model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        logits = self.model(input_ids=input_ids, attention_mask=attention_mask).logits  # [B, S, V]
        return splade_max_pool(logits, attention_mask)  # [B, S, V] -> [B, V]


def _documents(batch: int, length: int, vocab: int, device: torch.device) -> dict[str, torch.Tensor]:
    ids = torch.randint(1000, vocab, (batch, length), device=device)  # [B, S]
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def _train_step(route: torch.nn.Module, features: dict[str, torch.Tensor]) -> None:
    with torch.autocast("cuda", dtype=torch.bfloat16):
        reps = route(**features)  # [B, V]
    reps.float().sum().backward()
    route.zero_grad(set_to_none=True)


def _encode(route: torch.nn.Module, features: dict[str, torch.Tensor]) -> None:
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        route(**features)


def _docs_per_second(step: Callable[[], None], batch: int, steps: int) -> float:
    for _ in range(2):
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    return batch * steps / (time.perf_counter() - start)


def _fits(route: torch.nn.Module, batch: int, length: int, vocab: int, device: torch.device) -> bool:
    try:
        _train_step(route, _documents(batch, length, vocab, device))
        return True
    except torch.OutOfMemoryError:
        return False
    finally:
        torch.cuda.empty_cache()


def _largest_batch(route: torch.nn.Module, length: int, vocab: int, device: torch.device, limit: int) -> int:
    """The largest batch (up to ``limit``) whose training step fits: doubling, then bisecting."""
    low, high = 0, 1
    while high <= limit and _fits(route, high, length, vocab, device):
        low, high = high, high * 2
    high = min(high, limit + 1)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if _fits(route, middle, length, vocab, device) else (low, middle)
    return low


def gpu_document_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Documents/s of the fused and plain routes (training and encoding), and their largest training batch."""
    device = torch.device("cuda")
    encoder = SpladeEncoder.from_pretrained(shipped_model_path("splade-tiny-msmarco")).to(device).train()
    vocab = encoder.vocab_size
    routes = {"fused": encoder, "plain": _PlainRoute(encoder)}
    rows = []
    features = _documents(args.batch, args.document_length, vocab, device)
    for name, route in routes.items():
        row: dict[str, Any] = {"route": name, "batch": args.batch, "document_length": args.document_length}
        for kind, step in (("train", _train_step), ("encode", _encode)):
            torch.cuda.reset_peak_memory_stats(device)
            try:
                row[f"{kind}_docs_per_s"] = _docs_per_second(
                    lambda s=step, r=route: s(r, features), args.batch, args.steps
                )
                row[f"{kind}_peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
            except torch.OutOfMemoryError:
                row[f"{kind}_docs_per_s"] = "OOM"
            torch.cuda.empty_cache()
        rows.append(row)
    if args.memory_gib is not None:
        total = torch.cuda.get_device_properties(device).total_memory
        index = torch.cuda.current_device() if device.index is None else device.index  # it needs an index
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.memory_gib * 2**30 / total), index)
        limit = 64 if args.smoke else 1 << 20
        for row, route in zip(rows, routes.values(), strict=True):
            row["memory_gib"] = args.memory_gib
            row["largest_train_batch"] = _largest_batch(route, args.document_length, vocab, device, limit)
    return rows


# ------------------------------------------------------------------------------------------------- main


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    result: dict[str, Any] = {
        "meta": {**run_stamp(torch.device(args.mode if args.mode == "cpu" else "cuda")), "command": sys.argv},
    }
    if args.mode == "cpu":
        beir = load_beir(default_dev_beir_path(), split="dev")
        queries = [beir.queries[q] for q in beir.qrels]
        if args.smoke:
            queries = queries[:5]
        result["meta"]["torch_threads"] = torch.get_num_threads()
        result["meta"]["cpu_count"] = os.cpu_count()
        load_before = os.getloadavg()[0]  # other processes share the cores: the medians are under this load
        result["cpu"] = cpu_query_times(
            queries, list(beir.corpus.values()), passes=1 if args.smoke else args.passes
        )
        result["meta"]["load_average_1min"] = [load_before, os.getloadavg()[0]]
    else:
        if not torch.cuda.is_available():
            raise SystemExit("--mode gpu needs a CUDA GPU")
        if args.smoke:
            args.batch, args.document_length, args.steps = 4, 32, 1
        result["gpu"] = gpu_document_rows(args)
    print(write_result(result, args.output))
    return result


if __name__ == "__main__":
    main()
