"""Sweep learning rate, regularizer weights and length of the embedded default run (fast on a GPU).

The measurement behind ``resources/default_train.yaml`` (docs/training.md):

    python scripts/sweep_default_run.py --out sweep.json

Each configuration starts from the same random init (bert-tiny, ``init_decoder_bias`` -0.5, seed 42),
trains on the shipped SciFact sample at an effective batch of 256 (mini-batches of 64) and is evaluated
on the shipped dev sample.
"""

from __future__ import annotations

import argparse
import json

import transformers

from gradcache_sparton.arguments import CachedSpladeTrainingArguments, DataArguments, ModelArguments
from gradcache_sparton.pipeline import build_encoder, build_evaluator, build_tokenizer, build_train_dataset
from gradcache_sparton.trainer import CachedSpladeTrainer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, nargs="+", default=[8, 30])
    parser.add_argument("--learning_rates", type=float, nargs="+", default=[1e-4, 3e-4, 1e-3, 3e-3])
    parser.add_argument("--reg_weights", type=float, nargs="+", default=[5e-4, 3e-4, 3e-3, 2e-3],
                        help="query/doc weight pairs, flattened")  # fmt: skip
    parser.add_argument("--out", default="sweep.json")
    args = parser.parse_args()
    transformers.logging.set_verbosity_error()
    tokenizer = build_tokenizer(ModelArguments())
    data = build_train_dataset(DataArguments(), seed=42)
    evaluator = build_evaluator(DataArguments(), tokenizer, query_max_length=32, document_max_length=64)
    evaluator.show_progress = False
    pairs = list(zip(args.reg_weights[::2], args.reg_weights[1::2], strict=True))
    results = []
    for steps in args.steps:
        for lr in args.learning_rates:
            for query_weight, doc_weight in pairs:
                training_args = CachedSpladeTrainingArguments(
                    output_dir="/tmp/gradcache-sparton-sweep", overwrite_output_dir=True,
                    per_device_train_batch_size=256, mini_batch_size=64, query_max_length=32,
                    document_max_length=64, max_steps=steps, learning_rate=lr, warmup_steps=1, weight_decay=0.01,
                    query_reg_weight=query_weight, doc_reg_weight=doc_weight, reg_warmup_steps=steps // 2,
                    logging_steps=1, save_strategy="no", report_to="none", seed=42, disable_tqdm=True,
                )  # fmt: skip
                transformers.set_seed(42)
                encoder = build_encoder(
                    ModelArguments(config_name="bert-tiny", init_decoder_bias=-0.5), tokenizer
                )
                trainer = CachedSpladeTrainer(
                    encoder, training_args, train_dataset=data, processing_class=tokenizer
                )
                trainer.train()
                losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
                row = {"steps": steps, "lr": lr, "query_weight": query_weight, "doc_weight": doc_weight,
                       "loss_first": losses[0], "loss_last": losses[-1], **evaluator(trainer.model)}  # fmt: skip
                print(row, flush=True)
                results.append(row)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
