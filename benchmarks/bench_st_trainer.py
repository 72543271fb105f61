"""The two-line sentence-transformers path end to end: ``CachedSpladeTrainer`` on a ``SparseEncoder`` against
sentence-transformers' own ``SparseEncoderTrainer`` + ``CachedSpladeLoss``, same model, data and batch.

One process, real SciFact text (the shipped sample's triplets as ``anchor, positive, negative``: the query,
its abstract, another row's abstract), a random-init BERT-base-width ``SparseEncoder`` (6 layers, decoder
bias -1.9 for a trained-like sparsity, dropout off) built from a config, bf16 on CUDA, 512-row batches and
64-row mini-batches, the same SPLADE loss (``SparseMultipleNegativesRankingLoss`` with FLOPS 5e-4 on the
queries and 3e-4 on the documents; ours maps it with ``splade_loss_config_from``). Rows:

- ``ours``: ``CachedSpladeTrainer(model, CachedSpladeTrainingArguments(...), ...)`` at its defaults
  (``use_sparton_head`` is applied to the model in place, the token cache and no dataloader workers,
  ``max_memory`` auto);
- ``st``: ``SparseEncoderTrainer(model, SparseEncoderTrainingArguments(...), loss=CachedSpladeLoss(...))`` at
  its defaults (no dataloader workers);
- ``st-workers``: theirs with the dataloader workers our trainer starts where it has no token cache (4 on a
  GPU machine of 5 or more CPUs), so that the comparison is not only the feed.

Each is timed over ``--steps`` steps after ``--warmup`` steps (optimizer steps included, a device sync at
either end); ``pairs_per_s`` is rows per second, ``peak_reserved_gib`` the process's reserved peak over the
run (``torch.cuda.max_memory_reserved``, reset before each), and ``speedup`` / ``memory_ratio`` ours over
``st``'s. Run on the GPU machine from the repository root, with sentence-transformers installed:

    export PYTHONPATH=$PWD:$PYTHONPATH HF_HUB_OFFLINE=1
    python benchmarks/bench_st_trainer.py --out $OUT/st_trainer.json

``--smoke`` runs it on a CPU at tiny sizes in seconds (its numbers mean nothing).
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer, BertConfig, BertForMaskedLM

from benchmarks.bench_trainer_feed import StepClock
from benchmarks.common import run_stamp, write_result
from benchmarks.harness import free_memory, name_list
from benchmarks.real_workload.workloads import read_scifact_pairs, scifact_triplets
from gradcache_sparton.resources import default_tokenizer_path

__all__ = ["PROVIDERS", "main", "parse_args"]

PROVIDERS = ("ours", "st", "st-workers")
QUERY_REG, DOC_REG = 5e-4, 3e-4
QUERY_MAX_LENGTH, DOCUMENT_MAX_LENGTH = 64, 256


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="JSON file to write the results to")
    parser.add_argument("--providers", type=name_list(PROVIDERS), default=list(PROVIDERS))
    parser.add_argument("--batch", type=int, default=512, help="rows (pairs) per step")
    parser.add_argument("--mini_batch", type=int, default=64, help="rows per mini-batch, both cached losses")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("--steps", type=int, default=10, help="timed steps")
    parser.add_argument("--decoder_bias", type=float, default=-1.9)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--smoke", action="store_true", help="tiny sizes on the CPU: a check, not a measurement"
    )
    args = parser.parse_args(argv)
    args.query_max_length, args.document_max_length = QUERY_MAX_LENGTH, DOCUMENT_MAX_LENGTH
    if args.smoke:
        args.batch, args.mini_batch, args.layers, args.warmup, args.steps = 8, 4, 1, 1, 1
        args.query_max_length, args.document_max_length = 16, 32
    for name in ("batch", "mini_batch", "layers", "warmup", "steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    return args


def build_model(args: argparse.Namespace, folder: Path, device: torch.device) -> Any:
    """A random-init SPLADE ``SparseEncoder`` (BERT-base width; ``--smoke``: 32 wide), dropout off."""
    from sentence_transformers import SparseEncoder
    from sentence_transformers.base.modules import Transformer
    from sentence_transformers.sparse_encoder.modules import SpladePooling

    width = {"hidden_size": 32, "num_attention_heads": 2, "intermediate_size": 64} if args.smoke else {}
    config = BertConfig(
        num_hidden_layers=args.layers, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **width
    )
    torch.manual_seed(args.seed)
    mlm = BertForMaskedLM(config)
    with torch.no_grad():
        mlm.cls.predictions.bias.fill_(args.decoder_bias)
    mlm.save_pretrained(folder)
    AutoTokenizer.from_pretrained(default_tokenizer_path()).save_pretrained(folder)
    transformer = Transformer(
        str(folder), transformer_task="fill-mask", model_kwargs={"local_files_only": True}
    )
    transformer.max_seq_length = args.document_max_length
    return SparseEncoder(modules=[transformer, SpladePooling("max")], device=str(device))


def _their_loss(model: Any, mini_batch: int) -> Any:
    from sentence_transformers.sparse_encoder.losses import (
        CachedSpladeLoss,
        SparseMultipleNegativesRankingLoss,
    )

    return CachedSpladeLoss(
        model,
        loss=SparseMultipleNegativesRankingLoss(model),
        document_regularizer_weight=DOC_REG,
        query_regularizer_weight=QUERY_REG,
        mini_batch_size=mini_batch,
    )


def _common(args: argparse.Namespace, device: torch.device, out: Path) -> dict[str, Any]:
    """The Trainer arguments both providers share."""
    return {
        "output_dir": str(out),
        "per_device_train_batch_size": args.batch,
        "max_steps": args.warmup + args.steps,
        "learning_rate": 2e-5,
        "bf16": device.type == "cuda",
        "save_strategy": "no",
        "report_to": "none",
        "logging_steps": 10_000,
        "disable_tqdm": True,
        "dataloader_drop_last": True,
        "seed": args.seed,
    }


def run_provider(
    provider: str, args: argparse.Namespace, model: Any, dataset: Any, device: torch.device, tmp: Path
) -> dict[str, Any]:
    """One provider's run: steady-state pairs/s and the reserved peak."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    clock = StepClock(args.warmup, args.warmup + args.steps, sync)
    common = _common(args, device, tmp / provider)
    if provider == "ours":
        from gradcache_sparton import CachedSpladeTrainer, CachedSpladeTrainingArguments, SpladeLoss
        from gradcache_sparton.integrations.sentence_transformers import splade_loss_config_from

        training = CachedSpladeTrainingArguments(
            **common,
            mini_batch_size=args.mini_batch,
            query_max_length=args.query_max_length,
            document_max_length=args.document_max_length,
        )
        loss = SpladeLoss(splade_loss_config_from(_their_loss(model, args.mini_batch)))
        trainer = CachedSpladeTrainer(
            model,
            training,
            train_dataset=dataset,
            processing_class=model.tokenizer,
            loss=loss,
            callbacks=[clock],
        )
        workers = training.dataloader_num_workers
    else:
        from sentence_transformers import SparseEncoderTrainer, SparseEncoderTrainingArguments

        if provider == "st-workers":
            from gradcache_sparton.arguments import default_dataloader_workers

            common["dataloader_num_workers"] = default_dataloader_workers(accelerator=device.type == "cuda")
        training = SparseEncoderTrainingArguments(**common)
        trainer = SparseEncoderTrainer(
            model=model,
            args=training,
            train_dataset=dataset,
            loss=_their_loss(model, args.mini_batch),
            callbacks=[clock],
        )
        workers = training.dataloader_num_workers
    trainer.train()
    seconds = clock.marks[args.warmup + args.steps] - clock.marks[args.warmup]
    row: dict[str, Any] = {
        "seconds": round(seconds, 4),
        "pairs_per_s": round(args.steps * args.batch / seconds, 1),
        "dataloader_num_workers": workers,
    }
    if device.type == "cuda":
        row["peak_reserved_gib"] = round(torch.cuda.max_memory_reserved(device) / 2**30, 3)
        row["peak_allocated_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 3)
    return row


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        import sentence_transformers
    except ImportError:
        print("needs sentence-transformers (pip install sentence-transformers)", file=sys.stderr)
        return 2
    import datasets

    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    triplets = scifact_triplets(read_scifact_pairs(), seed=args.seed)
    rows = [{"anchor": t["query"], "positive": t["positive"], "negative": t["negative_1"]} for t in triplets]
    rows = rows[: args.batch * (args.warmup + args.steps)] if args.smoke else rows
    dataset = datasets.Dataset.from_list(rows)
    results: dict[str, Any] = {
        "meta": {
            **run_stamp(device),
            "sentence_transformers": sentence_transformers.__version__,
            "command": " ".join(["python", "benchmarks/bench_st_trainer.py", *(argv or sys.argv[1:])]),
            "rows": len(rows),
            "batch": args.batch,
            "mini_batch": args.mini_batch,
            "layers": args.layers,
            "warmup_steps": args.warmup,
            "timed_steps": args.steps,
            "decoder_bias": args.decoder_bias,
            "query_max_length": args.query_max_length,
            "document_max_length": args.document_max_length,
            # Theirs adds SpladeRegularizerWeightSchedulerCallback (FLOPS weights from 0 up); ours keeps them.
            "regularizer_weights": {"query": QUERY_REG, "document": DOC_REG},
            "smoke": args.smoke,
        },
        "rows": {},
    }
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        base = build_model(args, tmp / "model", device)
        for provider in args.providers:
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            model = copy.deepcopy(base).train()  # the same start for every provider
            results["rows"][provider] = run_provider(provider, args, model, dataset, device, tmp)
            print(f"{provider}: {json.dumps(results['rows'][provider])}", flush=True)
            del model
            free_memory(device)
    found = results["rows"]
    if "ours" in found and "st" in found:
        found["ours"]["speedup_vs_st"] = round(found["ours"]["pairs_per_s"] / found["st"]["pairs_per_s"], 3)
        if "peak_reserved_gib" in found["st"]:
            ratio = found["ours"]["peak_reserved_gib"] / found["st"]["peak_reserved_gib"]
            found["ours"]["memory_ratio_vs_st"] = round(ratio, 3)
    write_result(results, args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
