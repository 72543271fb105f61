"""The sentence-transformers issue 3441 case: the largest document batch of an inference-free ``Router`` model's
training step in a given GPU memory, with sentence-transformers' own loss step against ours.

Legend: B batch (query-document pairs), S sequence, V vocabulary.

The model: sentence-transformers' inference-free layout over ``--model`` (default the shipped SPLADE-tiny),
a ``Router`` with a learned ``SparseStaticEmbedding`` query route and a fill-mask ``Transformer`` +
``SpladePooling`` document route. One training step (bf16 autocast, the loss's backward, an AdamW step: what
each trainer's ``training_step`` runs) on B queries (``--query_length`` tokens) and B documents
(``--document_length`` tokens, random non-special ids), in two ways:

- ``sentence_transformers``: the model as sentence-transformers runs it, its ``SpladeLoss`` over
  ``SparseMultipleNegativesRankingLoss`` without a query regularizer (the document route forms the
  [B, S, V] logits: the out-of-memory of issue 3441);
- ``ours``: the same model after ``use_sparton_head`` (the fused head on the document route), the same loss
  mapped by ``splade_loss_config_from``, through the GradCache engine (``CachedLoss`` over ``as_rep_encoder``,
  ``--mini_batch_size`` rows per forward): what ``CachedSpladeTrainer.compute_loss`` runs for this model.

With ``--memory_gib`` (``torch.cuda.set_per_process_memory_fraction``), the largest B of each whose step
fits (doubling, then bisecting, up to ``--max_batch``; a result equal to it means at least), and ``ratio``,
ours over theirs. Without it, one step of each at ``--batch`` and its peak memory.

    python -m benchmarks.bench_st_inference_free --memory_gib 48 \\
        --output benchmarks/results/st_inference_free_3441_h200.json

``--smoke`` runs tiny batches (on the CPU with ``--device cpu``): it checks the script, its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import copy
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import run_stamp, write_result
from gradcache_sparton.resources import shipped_model_path

__all__ = ["largest_batches", "main", "parse_args", "router_model", "step_functions"]

ROUTES = ("sentence_transformers", "ours")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="masked-LM folder (default: the shipped SPLADE-tiny)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--batch", type=int, default=64, help="pairs per step without --memory_gib")
    parser.add_argument("--query_length", type=int, default=32)
    parser.add_argument("--document_length", type=int, default=256)
    parser.add_argument("--mini_batch_size", type=int, default=64, help="ours: rows per forward")
    parser.add_argument("--memory_gib", type=float, default=None, help="find the largest batch in this")
    parser.add_argument("--max_batch", type=int, default=1 << 16, help="the batch search stops here")
    parser.add_argument("--output", type=Path, default=None, help="JSON file for the result (default: print)")
    parser.add_argument("--smoke", action="store_true", help="tiny batches: checks the script")
    return parser.parse_args(argv)


def router_model(folder: str, device: torch.device) -> Any:
    """sentence-transformers' inference-free model over ``folder``: learned all-ones query weights (its default)."""
    from sentence_transformers import SparseEncoder
    from sentence_transformers.base.modules import Router, Transformer
    from sentence_transformers.sparse_encoder.modules import SparseStaticEmbedding, SpladePooling

    transformer = Transformer(folder, transformer_task="fill-mask", model_kwargs={"local_files_only": True})
    static = SparseStaticEmbedding(tokenizer=transformer.tokenizer, frozen=False)
    router = Router.for_query_document(
        query_modules=[static], document_modules=[transformer, SpladePooling("max")]
    )
    return SparseEncoder(modules=[router], similarity_fn_name="dot", device=str(device)).train()


def _st_loss(model: Any) -> Any:
    from sentence_transformers.sparse_encoder.losses import SparseMultipleNegativesRankingLoss, SpladeLoss

    return SpladeLoss(
        model,
        loss=SparseMultipleNegativesRankingLoss(model),
        document_regularizer_weight=3e-4,
        query_regularizer_weight=None,
    )


def _ids(batch: int, length: int, vocab: int, device: torch.device) -> dict[str, torch.Tensor]:
    ids = torch.randint(1000, vocab, (batch, length), device=device)  # [B, S], no special token
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def step_functions(
    model: Any, args: argparse.Namespace, device: torch.device
) -> dict[str, Callable[[int], float]]:
    """Per route, ``step(batch) -> loss``: one training step on random pairs (module doc)."""
    from gradcache_sparton.engine import CachedLoss
    from gradcache_sparton.integrations.sentence_transformers import (
        as_rep_encoder,
        splade_loss_config_from,
        use_sparton_head,
    )
    from gradcache_sparton.losses import SpladeLoss

    vocab = len(model.tokenizer)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16)
    ours_model = use_sparton_head(copy.deepcopy(model))
    st_loss, our_loss = _st_loss(model), SpladeLoss(splade_loss_config_from(_st_loss(ours_model)))
    encoder = as_rep_encoder(ours_model)

    def run(parameters: Any, loss_of: Callable[[], torch.Tensor]) -> float:
        optimizer = torch.optim.AdamW(parameters, lr=1e-5)
        try:
            with autocast:
                loss = loss_of()
            loss.backward()
            optimizer.step()
            return float(loss.detach())
        finally:
            optimizer.zero_grad(set_to_none=True)
            del optimizer

    def theirs(batch: int) -> float:
        def loss_of() -> torch.Tensor:
            query = {**_ids(batch, args.query_length, vocab, device), "task": "query"}
            document = {**_ids(batch, args.document_length, vocab, device), "task": "document"}
            return sum(st_loss([query, document], labels=None).values())

        return run(model.parameters(), loss_of)

    def ours(batch: int) -> float:
        def loss_of() -> torch.Tensor:
            columns = {
                "query": _ids(batch, args.query_length, vocab, device),
                "positive": _ids(batch, args.document_length, vocab, device),
            }
            return CachedLoss(encoder, our_loss, mini_batch_size=args.mini_batch_size)(columns)

        return run(ours_model.parameters(), loss_of)

    return {"sentence_transformers": theirs, "ours": ours}


def _fits(step: Callable[[int], float], batch: int, device: torch.device) -> bool:
    try:
        step(batch)
        return True
    except torch.OutOfMemoryError:
        return False
    except RuntimeError as error:  # cuBLAS reports an allocation it could not make as its own error
        if "CUBLAS_STATUS_ALLOC_FAILED" not in str(error):
            raise
        return False
    finally:
        if device.type == "cuda":
            torch.cuda.empty_cache()


def largest_batches(
    steps: dict[str, Callable[[int], float]], device: torch.device, limit: int
) -> dict[str, int]:
    """Per route, the largest batch (up to ``limit``) whose step fits: doubling, then bisecting."""
    found = {}
    for name, step in steps.items():
        low, high = 0, 1
        while high <= limit and _fits(step, high, device):
            low, high = high, high * 2
        high = min(high, limit + 1)
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (middle, high) if _fits(step, middle, device) else (low, middle)
        found[name] = low
    return found


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda needs a CUDA GPU (or pass --device cpu with --smoke)")
    if args.memory_gib is not None and device.type != "cuda":
        raise SystemExit("--memory_gib needs --device cuda")
    if args.smoke:
        args.batch, args.query_length, args.document_length, args.mini_batch_size = 4, 8, 16, 2
        args.max_batch = min(args.max_batch, 64)
    folder = args.model or str(shipped_model_path("splade-tiny-msmarco"))
    model = router_model(folder, device)
    steps = step_functions(model, args, device)
    result: dict[str, Any] = {
        "meta": {**run_stamp(device), "command": sys.argv, "model": folder},
        "settings": {
            key: getattr(args, key)
            for key in ("query_length", "document_length", "mini_batch_size", "memory_gib", "max_batch")
        },
    }
    if args.memory_gib is None:
        rows = {}
        for name, step in steps.items():
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            row: dict[str, Any] = {"batch": args.batch}
            try:
                row["loss"] = step(args.batch)
                if device.type == "cuda":
                    row["peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
            except torch.OutOfMemoryError:
                row["loss"] = "OOM"
            rows[name] = row
        result["steps"] = rows
    else:
        total = torch.cuda.get_device_properties(device).total_memory
        index = torch.cuda.current_device() if device.index is None else device.index  # it needs an index
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.memory_gib * 2**30 / total), index)
        largest = largest_batches(steps, device, args.max_batch)
        result["largest_train_batch"] = largest
        result["ratio"] = largest["ours"] / max(1, largest["sentence_transformers"])
        result["ours_capped"] = largest["ours"] == args.max_batch
    print(write_result(result, args.output))
    return result


if __name__ == "__main__":
    main()
