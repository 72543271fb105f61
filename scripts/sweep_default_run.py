"""Sweep learning rate, length and seed of the embedded default run, against its untrained start.

The learning-rate sweeps behind ``resources/default_train.yaml``'s earlier settings (docs/training.md;
the current ones, 150 steps at 128 document tokens, came from ``train --config default`` runs recorded
there):

    python scripts/sweep_default_run.py --out sweep.json                                # the pretrained start
    python scripts/sweep_default_run.py --document_max_length 128 --steps 150 --out sweep.json
    python scripts/sweep_default_run.py --start random --out sweep.json                 # the earlier random-init run

``--start pretrained``: the shipped SPLADE-tiny (``splade-tiny-msmarco``) at the default run's settings
(effective batch 32 in one mini-batch, 32/64 tokens unless given, AdamW, 10% warm-up, FLOPS 5e-4 / 3e-4 from the
first step). ``--start random``: bert-tiny with ``init_decoder_bias`` -0.5 at an effective batch of 256
(mini-batches of 64), the regularizer warmed up over half the steps. Every configuration trains on the
shipped SciFact sample and is evaluated on the shipped dev sample; the untrained start is evaluated once
(``before``), and each row carries its nDCG@10 gain over it. Rows are printed as they finish and written
to ``--out`` after each one, so an interrupted sweep keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import transformers

from gradcache_sparton.arguments import CachedSpladeTrainingArguments, DataArguments, ModelArguments
from gradcache_sparton.pipeline import build_encoder, build_evaluator, build_tokenizer, build_train_dataset
from gradcache_sparton.trainer import CachedSpladeTrainer

# Per start: the model and the settings the sweep does not vary.
STARTS: dict[str, dict[str, Any]] = {
    "pretrained": {
        "model": ModelArguments(model_name_or_path="splade-tiny-msmarco"),
        "batch": 32,
        "mini_batch": 32,
        "reg_weights": (5e-4, 3e-4),
        "reg_warmup_fraction": 0.0,
    },
    "random": {
        "model": ModelArguments(config_name="bert-tiny", init_decoder_bias=-0.5),
        "batch": 256,
        "mini_batch": 64,
        "reg_weights": (3e-3, 2e-3),
        "reg_warmup_fraction": 0.5,
    },
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--start", choices=sorted(STARTS), default="pretrained")
    parser.add_argument("--steps", type=int, nargs="+", default=[40, 80])
    parser.add_argument("--learning_rates", type=float, nargs="+", default=[5e-5, 1e-4, 2e-4])
    parser.add_argument("--seeds", type=int, nargs="+", default=[42])
    parser.add_argument("--query_max_length", type=int, default=32)
    parser.add_argument("--document_max_length", type=int, default=64)
    parser.add_argument("--out", default="sweep.json")
    args = parser.parse_args()
    start = STARTS[args.start]
    transformers.logging.set_verbosity_error()
    lengths = {"query_max_length": args.query_max_length, "document_max_length": args.document_max_length}
    tokenizer = build_tokenizer(start["model"])
    data = build_train_dataset(DataArguments(), seed=42)
    evaluator = build_evaluator(DataArguments(), tokenizer, **lengths)
    evaluator.show_progress = False
    transformers.set_seed(42)
    before = evaluator(build_encoder(start["model"], tokenizer))
    print({"before": before}, flush=True)
    results: dict[str, Any] = {"start": args.start, "lengths": lengths, "before": before, "rows": []}
    query_weight, doc_weight = start["reg_weights"]
    for steps in args.steps:
        for lr in args.learning_rates:
            for seed in args.seeds:
                training_args = CachedSpladeTrainingArguments(
                    output_dir="/tmp/gradcache-sparton-sweep", overwrite_output_dir=True,
                    per_device_train_batch_size=start["batch"], mini_batch_size=start["mini_batch"],
                    max_steps=steps, learning_rate=lr, warmup_steps=max(1, steps // 10), weight_decay=0.01,
                    query_reg_weight=query_weight, doc_reg_weight=doc_weight,
                    reg_warmup_steps=int(steps * start["reg_warmup_fraction"]), logging_steps=1,
                    save_strategy="no", report_to="none", seed=seed, disable_tqdm=True, **lengths,
                )  # fmt: skip
                transformers.set_seed(seed)
                encoder = build_encoder(start["model"], tokenizer)
                trainer = CachedSpladeTrainer(
                    encoder, training_args, train_dataset=data, processing_class=tokenizer
                )
                began = time.monotonic()
                trainer.train()
                train_s = time.monotonic() - began
                losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
                metrics = evaluator(trainer.model)
                row = {"steps": steps, "lr": lr, "seed": seed, "train_s": round(train_s, 1),
                       "loss_first": losses[0], "loss_last": losses[-1], **metrics,
                       "ndcg_gain": metrics["ndcg_at_10"] - before["ndcg_at_10"]}  # fmt: skip
                print(row, flush=True)
                results["rows"].append(row)
                with open(args.out, "w", encoding="utf-8") as f:
                    json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
