"""Does the trainer feed the engine? Steady-state pairs/s of the engine alone against the trainer and the CLI path.

One process, real SciFact text (the shipped sample's triplets: query, positive, another row's positive as
negative_1), a 6-layer BERT-base-width SPLADE from a config (random weights, decoder bias -1.9 for a
trained-like sparsity), bf16 on CUDA, 512-row batches and 64-row mini-batches, the same engine settings
(``CachedSpladeTrainingArguments.grad_cache_config``) everywhere:

- ``engine``: ``CachedLoss`` alone on batches tokenized before timing and already on the device (loss and
  backward; no optimizer): what the trainer could reach at best;
- ``engine+optimizer``: the same plus the Trainer's default optimizer step (fused AdamW where available,
  gradient clipping at ``max_grad_norm``), for where the rest of a gap goes;
- ``trainer``: ``CachedSpladeTrainer`` with its defaults (the token cache, batches padded in the main
  process, pinned memory, ...) on a ``datasets.Dataset`` of the rows' text;
- ``trainer-workers``: the same with the dataloader workers the trainer starts where it has no token cache
  (4 on a GPU machine of 5 or more CPUs), for what they cost;
- ``cli``: the ``gradcache-sparton train`` path: its parser's defaults (flags as a user gives them), the rows
  read from a JSON lines file by ``build_train_dataset``, the model by ``build_encoder``.

Each is timed over ``--steps`` steps after ``--warmup`` steps (the first plans ``max_memory`` and records
any CUDA graphs), one device sync at either end; ``pairs_per_s`` is rows per second, and ``ratio`` each
one's over ``engine``'s. Run on the GPU machine from the repository root:

    export PYTHONPATH=$PWD:$PYTHONPATH HF_HUB_OFFLINE=1
    python benchmarks/bench_trainer_feed.py --out $OUT/trainer_feed.json

``--smoke`` runs it on a CPU at tiny sizes in seconds (its numbers mean nothing).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer, TrainerCallback

from benchmarks.common import run_stamp, write_result
from benchmarks.harness import autocast, free_memory, name_list
from benchmarks.real_workload.models import random_model, save_model_dir
from benchmarks.real_workload.workloads import FULL, SMOKE, Scale, read_scifact_pairs, scifact_triplets
from gradcache_sparton.resources import default_tokenizer_path

__all__ = ["VARIANTS", "StepClock", "main", "parse_args"]

VARIANTS = ("engine", "engine+optimizer", "trainer", "trainer-workers", "cli")
DECODER_BIAS = -1.9  # rep density of a trained SPLADE on this text (about 1-2% of the vocabulary)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="JSON file to write the results to")
    parser.add_argument("--variants", type=name_list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--batch", type=int, default=512, help="rows (pairs) per step")
    parser.add_argument("--mini_batch", type=int, default=64, help="rows per mini-batch")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("--steps", type=int, default=10, help="timed steps")
    parser.add_argument("--decoder_bias", type=float, default=DECODER_BIAS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--smoke", action="store_true", help="tiny sizes on the CPU: a check, not a measurement"
    )
    args = parser.parse_args(argv)
    if args.smoke:
        args.batch, args.mini_batch, args.warmup, args.steps = 8, 4, 1, 2
    for name in ("batch", "mini_batch", "warmup", "steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    return args


class StepClock(TrainerCallback):
    """Wall time at the end of every step from the warm-up's last on (device synced there)."""

    def __init__(self, warmup: int, last: int, sync: Callable[[], None]) -> None:
        self.marks: dict[int, float] = {}
        self.warmup, self.last, self.sync = warmup, last, sync

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.warmup <= state.global_step <= self.last:
            self.sync()
            self.marks[state.global_step] = time.perf_counter()


def _training_args(
    args: argparse.Namespace, scale: Scale, device: torch.device, out: Path, **extra: Any
) -> Any:
    from gradcache_sparton.arguments import CachedSpladeTrainingArguments

    return CachedSpladeTrainingArguments(
        output_dir=str(out),
        per_device_train_batch_size=args.batch,
        mini_batch_size=args.mini_batch,
        query_max_length=scale.query_max_len,
        document_max_length=scale.doc_max_len,
        bf16=device.type == "cuda",
        max_steps=args.warmup + args.steps,
        save_strategy="no",
        report_to="none",
        logging_steps=10_000,
        disable_tqdm=True,
        seed=args.seed,
        **extra,
    )


def _rate(args: argparse.Namespace, marks: Sequence[float]) -> dict[str, Any]:
    """Pairs/s over the timed steps (``marks``: the wall clock at the warm-up's end and after each timed step),
    each step's seconds, and pairs/s at the median step (what a step costs when nothing waits: an epoch's
    first batch, for one, waits for its tokenization unless the texts were tokenized up front)."""
    steps = [b - a for a, b in itertools.pairwise(marks)]
    seconds = marks[-1] - marks[0]
    return {
        "seconds": round(seconds, 4),
        "pairs_per_s": round(args.steps * args.batch / seconds, 1),
        "median_step_pairs_per_s": round(args.batch / statistics.median(steps), 1),
        "step_s": [round(step, 3) for step in steps],
    }


def _peak(device: torch.device) -> dict[str, float]:
    if device.type != "cuda":
        return {}
    return {"peak_reserved_gib": round(torch.cuda.max_memory_reserved(device) / 2**30, 3)}


def _engine(
    args: argparse.Namespace, scale: Scale, device: torch.device, model_dir: Path, rows: list[dict[str, str]],
    tmp: Path, *, optimizer: bool,
) -> dict[str, Any]:  # fmt: skip
    """``CachedLoss`` alone on pre-tokenized device batches (and, with ``optimizer``, the Trainer's step)."""
    from gradcache_sparton import SpladeEncoder
    from gradcache_sparton.data import TrainingCollator
    from gradcache_sparton.engine import CachedLoss
    from gradcache_sparton.losses import SpladeLoss

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    training = _training_args(args, scale, device, tmp / "engine")
    collate = TrainingCollator(  # as the trainer builds it: with max_memory, one shape (one plan)
        tokenizer,
        query_max_length=scale.query_max_len,
        document_max_length=scale.doc_max_len,
        pad_to_max_length=training.max_memory is not None,
    )
    batches = []
    for i in range(args.warmup + args.steps):
        chosen = [rows[(i * args.batch + k) % len(rows)] for k in range(args.batch)]
        columns = collate(chosen)["columns"]
        batches.append({c: {n: t.to(device) for n, t in f.items()} for c, f in columns.items()})
    torch.manual_seed(args.seed)
    encoder = SpladeEncoder.from_pretrained(model_dir).to(device).train()
    cached = CachedLoss(
        encoder, SpladeLoss(training.splade_loss_config()), training.grad_cache_config(batches[0])
    )
    params = [p for p in encoder.parameters() if p.requires_grad]
    fused = device.type == "cuda"
    opt = torch.optim.AdamW(params, lr=training.learning_rate, fused=fused) if optimizer else None
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    marks: list[float] = []
    for i, columns in enumerate(batches):
        if i >= args.warmup:
            sync()
            marks.append(time.perf_counter())
        with autocast(device):
            loss = cached(columns, step=i)
        loss.backward()
        if opt is not None:
            torch.nn.utils.clip_grad_norm_(params, training.max_grad_norm)
            opt.step()
            opt.zero_grad(set_to_none=True)
        elif i < len(batches) - 1:
            encoder.zero_grad(set_to_none=True)
    sync()
    return _rate(args, [*marks, time.perf_counter()])


def _trainer(
    args: argparse.Namespace, scale: Scale, device: torch.device, model_dir: Path, rows: list[dict[str, str]],
    tmp: Path, *, variant: str,
) -> dict[str, Any]:  # fmt: skip
    """``CachedSpladeTrainer`` with its defaults (or no workers), or the CLI's path to it."""
    import datasets

    from gradcache_sparton import SpladeEncoder
    from gradcache_sparton.arguments import default_dataloader_workers
    from gradcache_sparton.trainer import CachedSpladeTrainer

    out = tmp / variant
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if variant == "cli":
        from gradcache_sparton.cli.train import train_parser
        from gradcache_sparton.model_loading import build_encoder
        from gradcache_sparton.pipeline import build_train_dataset

        data_file = tmp / "train.jsonl"
        data_file.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
        argv = [
            "--model_name_or_path", str(model_dir), "--train_data", str(data_file), "--eval_beir", "none",
            "--output_dir", str(out), "--per_device_train_batch_size", str(args.batch),
            "--mini_batch_size", str(args.mini_batch), "--query_max_length", str(scale.query_max_len),
            "--document_max_length", str(scale.doc_max_len), "--max_steps", str(args.warmup + args.steps),
            "--save_strategy", "no", "--report_to", "none", "--logging_steps", "10000", "--disable_tqdm", "true",
            "--seed", str(args.seed), *(["--bf16"] if device.type == "cuda" else []),
        ]  # fmt: skip
        model_args, data_args, training = train_parser().parse_args_into_dataclasses(args=argv)[:3]
        dataset = build_train_dataset(data_args, seed=training.seed)
        torch.manual_seed(args.seed)
        encoder = build_encoder(model_args, tokenizer)
    else:
        extra = {}
        if variant == "trainer-workers":
            extra = {"dataloader_num_workers": default_dataloader_workers(accelerator=device.type == "cuda")}
        training = _training_args(args, scale, device, out, **extra)
        dataset = datasets.Dataset.from_list(rows)
        torch.manual_seed(args.seed)
        encoder = SpladeEncoder.from_pretrained(model_dir)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    clock = StepClock(args.warmup, args.warmup + args.steps, sync)
    trainer = CachedSpladeTrainer(
        encoder, training, train_dataset=dataset, processing_class=tokenizer, callbacks=[clock]
    )
    trainer.train()
    marks = [clock.marks[step] for step in range(args.warmup, args.warmup + args.steps + 1)]
    workers = {
        "dataloader_num_workers": training.dataloader_num_workers,
        "dataloader_persistent_workers": training.dataloader_persistent_workers,
        "dataloader_pin_memory": training.dataloader_pin_memory,
    }
    return {**_rate(args, marks), **workers}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    scale = SMOKE if args.smoke else FULL
    tokenizer = AutoTokenizer.from_pretrained(default_tokenizer_path())
    rows = scifact_triplets(read_scifact_pairs(), seed=args.seed)
    rows = rows[: max(args.batch * 2, 64)] if args.smoke else rows
    results: dict[str, Any] = {
        "meta": {
            **run_stamp(device),
            "command": " ".join(["python", "benchmarks/bench_trainer_feed.py", *(argv or sys.argv[1:])]),
            "rows": len(rows),
            "batch": args.batch,
            "mini_batch": args.mini_batch,
            "query_max_length": scale.query_max_len,
            "document_max_length": scale.doc_max_len,
            "warmup_steps": args.warmup,
            "timed_steps": args.steps,
            "decoder_bias": args.decoder_bias,
            "model": f"random init D{scale.base_hidden} L{scale.base_layers}",
            "smoke": args.smoke,
        },
        "rows": {},
    }
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        model = random_model(scale, len(tokenizer), args.seed)
        with torch.no_grad():
            model.get_output_embeddings().bias.fill_(args.decoder_bias)
        model_dir = save_model_dir(model, tokenizer, tmp / "model")
        del model
        for variant in args.variants:
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            if variant.startswith("engine"):
                row = _engine(
                    args, scale, device, model_dir, rows, tmp, optimizer=variant == "engine+optimizer"
                )
            else:
                row = _trainer(args, scale, device, model_dir, rows, tmp, variant=variant)
            results["rows"][variant] = {**row, **_peak(device)}
            print(f"{variant}: {json.dumps(results['rows'][variant])}", flush=True)
            free_memory(device)
    engine = results["rows"].get("engine", {}).get("pairs_per_s")
    if engine:
        for row in results["rows"].values():
            row["ratio"] = round(row["pairs_per_s"] / engine, 3)
    write_result(results, args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
