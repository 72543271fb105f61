"""Large-batch experiment: one SPLADE model trained at effective batch 32, 256, 1,024 and 4,096.

Every run trains the same randomly initialised model (same seed) on the same pairs for the same number
of epochs with ``CachedSpladeTrainer``, in mini-batches of the same size (128, or the batch itself when
smaller): GradCache makes the loss and gradients those of the full effective batch, so the mini-batch
only sets memory and speed. Per run it reports dev nDCG@10 / MRR@10 / Recall@100 on the held-out
SciFact dev claims, the average non-zeros of query and document reps, the training wall time and the
peak GPU memory; ``--report`` builds a markdown table and a PNG plot from the runs found.

Pairs. The shipped sample (``default_train_data_path()``) has 3,204 rows, fewer than one batch of
4,096, and its rows cannot be multiplied naively: two self-supervised pairs cut from one abstract put
one pair's query sentence inside the other pair's positive, and when both land in one batch the
in-batch loss pushes that exact match down. Such collisions grow with the batch (about B / N per row),
so they would bias exactly the comparison made here. Instead (:func:`build_pairs`):

1. take every distinct positive text of the shipped training rows (2,956 texts; the sample already
   excludes every abstract relevant to a dev claim) and split it into sentences;
2. drop any sentence seen before in another text (texts of one abstract overlap) and any sentence of a
   dev-relevant abstract or dev claim (a second guard; the count is recorded, 0 expected);
3. cut each text's remaining sentences into passages of ``--sentences_per_passage`` (2) consecutive
   sentences (a lone last sentence joins the passage before it);
4. ``self_supervised_pairs(passages, pairs_per_document=1)``: one sentence of a passage is the query,
   the rest of the passage the positive. No two pairs share a sentence;
5. keep a seeded random subset whose size is a multiple of 4,096 (8,192 of ~10,800), so every batch size
   sees every pair once per epoch and drops nothing.
The labelled claims are not used: their positives are whole abstracts, which would contain the queries
of the passage pairs cut from the same abstract (the collision above), and the shipped file does not say
which rows are labelled.

Learning rate: ``--learning_rate`` at ``--lr_reference_batch`` (256), scaled by sqrt(B / 256) (the
square-root rule for Adam; ``--lr_scaling none`` keeps it fixed, ``linear`` scales with B), linear
warm-up over the first 10% of steps and linear decay. The regularizer weights ramp up (quadratically)
over the first third of each run's steps: the same share of training whatever the step count.

Model: ``bert-small`` shape (D = 512, 4 layers, 8 heads; the bert-base-uncased vocabulary and shipped
tokenizer), random weights, ``init_decoder_bias`` -1.4 (sparser than the model default, -1.0, with which
the reps collapse on these pairs: docs/experiments.md); queries truncated to 32 tokens, training passages
to 64, dev abstracts to 256. bf16 on a GPU. Needs ``datasets`` (the trainer and the pair builder).

GPU machine, from the repository root (each call under 10 minutes; one JSON per run in ``--out``):

    export PYTHONPATH=$PWD:$PYTHONPATH
    python scripts/large_batch_experiment.py --batch_sizes 32 --out $OUT/lb
    python scripts/large_batch_experiment.py --batch_sizes 256,1024,4096 --out $OUT/lb
    python scripts/large_batch_experiment.py --report DIR1 DIR2 --out merged  # table + plot

``--smoke`` runs a CPU-sized version (bert-tiny, 64 pairs, batches 8 and 32, one epoch, a dev subset).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch
import transformers

from gradcache_sparton.arguments import CachedSpladeTrainingArguments, ModelArguments
from gradcache_sparton.data import (
    BeirData,
    default_dev_beir_path,
    default_train_data_path,
    load_beir,
    load_training_data,
    self_supervised_pairs,
    split_sentences,
)
from gradcache_sparton.evaluation import SparseRetrievalEvaluator
from gradcache_sparton.pipeline import build_encoder, build_tokenizer
from gradcache_sparton.trainer import CachedSpladeTrainer

BATCH_SIZES = (32, 256, 1024, 4096)
# The pair count is a multiple of this (the largest batch), whatever --batch_sizes a call runs, so
# that runs made in separate calls train on the same pairs.
PAIR_MULTIPLE = 4096
SMOKE_BATCH_SIZES = (8, 32)
SMOKE_PAIR_MULTIPLE = 32
SMOKE_MAX_PAIRS = 64
RUN_PREFIX = "run_b"


# ---------------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------------


def passages_of(sentences: list[str], size: int) -> list[str]:
    """Consecutive groups of ``size`` sentences; a lone last sentence joins the group before it."""
    groups = [sentences[i : i + size] for i in range(0, len(sentences), size)]
    if len(groups) > 1 and len(groups[-1]) == 1:
        last = groups.pop()
        groups[-1] = groups[-1] + last
    return [" ".join(group) for group in groups if len(group) >= 2]


def build_pairs(
    *, sentences_per_passage: int, pair_multiple: int, seed: int, max_pairs: int | None = None
) -> tuple[Any, dict[str, int]]:
    """The experiment's (query, positive) pairs and their statistics (see the module docstring)."""
    rows = load_training_data(default_train_data_path())
    dev = load_beir(default_dev_beir_path(), split="dev")
    dev_relevant = {doc for judged in dev.qrels.values() for doc, rel in judged.items() if rel > 0}
    held_out = {s for doc in dev_relevant for s in split_sentences(dev.corpus[doc])}
    held_out |= set(dev.queries.values())
    seen: set[str] = set()
    passages: list[str] = []
    dropped_dev = 0
    texts = list(dict.fromkeys(rows["positive"]))  # distinct, in file order
    for text in texts:
        kept = []
        for sentence in split_sentences(text):
            if sentence in held_out:
                dropped_dev += 1
            elif sentence not in seen:
                seen.add(sentence)
                kept.append(sentence)
        passages += passages_of(kept, sentences_per_passage)
    pairs = self_supervised_pairs(passages, pairs_per_document=1, seed=seed)
    available = len(pairs)
    count = (available if max_pairs is None else min(available, max_pairs)) // pair_multiple * pair_multiple
    if count == 0:
        raise ValueError(f"only {available} pairs, fewer than one batch of {pair_multiple}")
    pairs = pairs.shuffle(seed=seed).select(range(count))
    stats = {
        "source_texts": len(texts),
        "distinct_sentences": len(seen),
        "sentences_dropped_as_dev": dropped_dev,
        "passages": len(passages),
        "pairs_available": available,
        "pairs_used": count,
    }
    return pairs, stats


def dev_data(smoke: bool) -> BeirData:
    """The shipped dev set; with ``smoke``, its first 10 queries, their relevant docs and 40 others."""
    dev = load_beir(default_dev_beir_path(), split="dev")
    if not smoke:
        return dev
    qrels = dict(list(dev.qrels.items())[:10])
    relevant = {doc for judged in qrels.values() for doc in judged}
    others = [doc for doc in dev.corpus if doc not in relevant][:40]
    corpus = {doc: text for doc, text in dev.corpus.items() if doc in relevant or doc in others}
    return BeirData(corpus=corpus, queries={q: dev.queries[q] for q in qrels}, qrels=qrels)


# ---------------------------------------------------------------------------------------------------
# One run
# ---------------------------------------------------------------------------------------------------


def learning_rate(batch_size: int, args: argparse.Namespace) -> float:
    ratio = batch_size / args.lr_reference_batch
    factor = {"sqrt": math.sqrt(ratio), "linear": ratio, "none": 1.0}[args.lr_scaling]
    return args.learning_rate * factor


def run(batch_size: int, pairs: Any, pair_stats: dict, args: argparse.Namespace, out: Path) -> dict:
    """Train at effective ``batch_size``, evaluate, write ``run_b<batch>.json``; return its record."""
    cuda = torch.cuda.is_available()
    model_args = ModelArguments(config_name=args.config_name, init_decoder_bias=args.init_decoder_bias)
    tokenizer = build_tokenizer(model_args)
    transformers.set_seed(args.seed)  # the same initial weights in every run
    encoder = build_encoder(model_args, tokenizer)
    evaluator = SparseRetrievalEvaluator(
        dev_data(args.smoke),
        tokenizer=tokenizer,
        query_max_length=args.query_max_length,
        document_max_length=args.eval_document_max_length,
        autocast_dtype=torch.bfloat16 if cuda else None,
        show_progress=False,
    )
    device = "cuda" if cuda else "cpu"
    baseline = evaluator(encoder.to(device))

    steps_per_epoch = len(pairs) // batch_size
    total_steps = steps_per_epoch * args.num_train_epochs
    lr = learning_rate(batch_size, args)
    mini_batch_size = min(args.mini_batch_size, batch_size)
    training_args = CachedSpladeTrainingArguments(
        output_dir=str(out / f"trainer_b{batch_size}"),
        overwrite_output_dir=True,
        per_device_train_batch_size=batch_size,
        mini_batch_size=mini_batch_size,
        num_train_epochs=args.num_train_epochs,
        learning_rate=lr,
        lr_scheduler_type="linear",
        warmup_steps=math.ceil(0.1 * total_steps),
        weight_decay=0.01,
        reg_warmup_steps=math.ceil(total_steps / 3),
        temperature=args.temperature,
        query_max_length=args.query_max_length,
        document_max_length=args.document_max_length,
        bf16=cuda,
        seed=args.seed,
        logging_steps=max(1, total_steps // 10),
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=2 if cuda else 0,
        dataloader_persistent_workers=cuda,
    )
    trainer = CachedSpladeTrainer(encoder, training_args, train_dataset=pairs, processing_class=tokenizer)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    result = trainer.train()
    if cuda:
        torch.cuda.synchronize()
    wall = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    start = time.perf_counter()
    metrics = evaluator(trainer.model)
    eval_wall = time.perf_counter() - start

    record = {
        "batch_size": batch_size,
        "mini_batch_size": mini_batch_size,
        "learning_rate": lr,
        "epochs": args.num_train_epochs,
        "steps": result.global_step,
        "planned_steps": total_steps,
        "pairs": len(pairs),
        "train_wall_s": wall,
        "train_sequences_per_s": 2 * len(pairs) * args.num_train_epochs / wall,
        "eval_wall_s": eval_wall,
        "peak_memory_gib": peak,
        "dev": metrics,
        "dev_before_training": baseline,
        "train_loss": result.training_loss,
        "log_history": [h for h in trainer.state.log_history if "loss" in h],
        "pair_stats": pair_stats,
        "meta": metadata(args),
    }
    (out / f"{RUN_PREFIX}{batch_size}.json").write_text(json.dumps(record, indent=1))
    print(
        f"batch {batch_size}: nDCG@10 {metrics['ndcg_at_10']:.4f} MRR@10 {metrics['mrr_at_10']:.4f} "
        f"(before training {baseline['ndcg_at_10']:.4f}), nnz q/d {metrics['query_nonzeros']:.0f}/"
        f"{metrics['doc_nonzeros']:.0f}, {wall:.0f} s, peak {_fmt(peak)} GiB",
        flush=True,
    )
    return record


def metadata(args: argparse.Namespace) -> dict:
    cuda = torch.cuda.is_available()
    return {
        "device": torch.cuda.get_device_name() if cuda else platform.processor() or "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "date": datetime.date.today().isoformat(),
        "command": " ".join(sys.argv),
        "args": {k: v for k, v in vars(args).items() if k not in ("report", "out")},
    }


# ---------------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------------


def _fmt(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def load_runs(folders: list[Path]) -> list[dict]:
    """Every ``run_b<batch>.json`` in ``folders``, one per batch size (the last folder given wins)."""
    runs: dict[int, dict] = {}
    for folder in folders:
        for path in sorted(folder.glob(f"{RUN_PREFIX}*.json")):
            record = json.loads(path.read_text())
            runs[record["batch_size"]] = record
    return [runs[b] for b in sorted(runs)]


def report(runs: list[dict], out: Path) -> None:
    """``large_batch.md`` (table), ``large_batch.json`` (all runs) and ``large_batch.png`` (plot)."""
    if not runs:
        print(f"no {RUN_PREFIX}*.json found: nothing to report", flush=True)
        return
    out.mkdir(parents=True, exist_ok=True)
    head = ["effective batch", "mini-batch", "lr", "steps", "nDCG@10", "MRR@10", "R@100", "query nnz",
            "doc nnz", "train s", "peak GiB"]  # fmt: skip
    first = runs[0]["dev_before_training"]
    lines = [
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
        f"| before training | - | - | 0 | {first['ndcg_at_10']:.4f} | {first['mrr_at_10']:.4f} | "
        f"{first['recall_at_100']:.4f} | {first['query_nonzeros']:.0f} | {first['doc_nonzeros']:.0f} | - | - |",
    ]
    for r in runs:
        d = r["dev"]
        lines.append(
            f"| {r['batch_size']} | {r['mini_batch_size']} | {r['learning_rate']:.2e} | {r['steps']} | "
            f"{d['ndcg_at_10']:.4f} | {d['mrr_at_10']:.4f} | {d['recall_at_100']:.4f} | "
            f"{d['query_nonzeros']:.0f} | {d['doc_nonzeros']:.0f} | {r['train_wall_s']:.0f} | "
            f"{_fmt(r['peak_memory_gib'])} |"
        )
    meta = runs[-1]["meta"]
    stats = runs[-1]["pair_stats"]
    text = (
        f"Large-batch experiment ({meta['device']}, torch {meta['torch']}, transformers "
        f"{meta['transformers']}, {meta['date']}): {runs[-1]['pairs']} pairs, {runs[-1]['epochs']} epochs, "
        f"pair statistics {stats}\n\n" + "\n".join(lines) + "\n"
    )
    (out / "large_batch.md").write_text(text)
    (out / "large_batch.json").write_text(json.dumps(runs, indent=1))
    print("\n" + text, flush=True)
    plot(runs, out / "large_batch.png")


def plot(runs: list[dict], path: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed here: no plot (the table is written)", flush=True)
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = [r["batch_size"] for r in runs]
    fig, (quality, cost) = plt.subplots(1, 2, figsize=(10, 4))
    for key, label in (("ndcg_at_10", "nDCG@10"), ("mrr_at_10", "MRR@10")):
        quality.plot(batches, [r["dev"][key] for r in runs], marker="o", label=label)
        quality.axhline(runs[0]["dev_before_training"][key], linestyle=":", color="grey")
    quality.set(xscale="log", xlabel="effective batch", ylabel="SciFact dev", title="Retrieval quality")
    quality.set_xticks(batches, [str(b) for b in batches])
    quality.legend(title="dotted: before training")
    cost.plot(batches, [r["train_wall_s"] for r in runs], marker="o", color="C2", label="train wall time (s)")
    cost.set(xscale="log", xlabel="effective batch", ylabel="seconds", title="Cost (same epochs)")
    cost.set_xticks(batches, [str(b) for b in batches])
    if all(r["peak_memory_gib"] is not None for r in runs):
        memory = cost.twinx()
        memory.plot(batches, [r["peak_memory_gib"] for r in runs], marker="s", color="C3")
        memory.set_ylabel("peak GPU memory (GiB)", color="C3")
    cost.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"plot: {path}", flush=True)


# ---------------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="folder for run_b<batch>.json, the table and the plot")
    p.add_argument("--batch_sizes", help=f"comma list of effective batches to run (default {BATCH_SIZES})")
    p.add_argument(
        "--report",
        nargs="*",
        metavar="DIR",
        help="only build the table and plot from the run_b*.json in these folders (default: --out)",
    )
    p.add_argument("--config_name", default="bert-small", help="backbone shape (random init)")
    p.add_argument("--mini_batch_size", type=int, default=128, help="GradCache mini-batch (memory only)")
    p.add_argument("--num_train_epochs", type=int, default=20)
    p.add_argument("--learning_rate", type=float, default=1e-4, help="at --lr_reference_batch")
    p.add_argument("--lr_reference_batch", type=int, default=256)
    p.add_argument("--lr_scaling", choices=("sqrt", "linear", "none"), default="sqrt")
    p.add_argument(
        "--init_decoder_bias",
        type=float,
        default=-1.4,
        help="decoder bias of the random-init head: -1.4 (~3.1 initial-logit deviations for bert-small) starts "
        "the reps at ~500-700 terms per query; the model default (-1.0) lets them collapse on these pairs",
    )
    p.add_argument("--temperature", type=float, default=1.0, help="InfoNCE temperature")
    p.add_argument("--sentences_per_passage", type=int, default=2)
    p.add_argument("--query_max_length", type=int, default=32)
    p.add_argument("--document_max_length", type=int, default=64, help="training passages (tokens)")
    p.add_argument("--eval_document_max_length", type=int, default=256, help="dev abstracts (tokens)")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--smoke", action="store_true", help="CPU-sized check of the script")
    args = p.parse_args()
    if args.smoke:
        args.config_name = "bert-tiny"
        args.num_train_epochs = 1
        args.mini_batch_size = min(args.mini_batch_size, 8)
        args.document_max_length = 32
        args.eval_document_max_length = 64
    default = SMOKE_BATCH_SIZES if args.smoke else BATCH_SIZES
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")] if args.batch_sizes else list(default)
    if any(b < 1 for b in args.batch_sizes):
        raise ValueError(f"--batch_sizes must be positive, got {args.batch_sizes}")
    multiple = SMOKE_PAIR_MULTIPLE if args.smoke else PAIR_MULTIPLE
    too_big = [b for b in args.batch_sizes if multiple % b]
    if too_big:
        raise ValueError(f"--batch_sizes must divide {multiple} (every run sees every pair), got {too_big}")
    return args


def main() -> int:
    args = parse_args()
    out = Path(args.out)
    if args.report is not None:
        report(load_runs([Path(d) for d in args.report] or [out]), out)
        return 0
    if not torch.cuda.is_available() and not args.smoke:
        print("no GPU: the experiment needs one (use --smoke for a CPU check)", file=sys.stderr)
        return 2
    # The dataloader workers fork after the evaluator has tokenized: keep the tokenizer single-threaded.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    out.mkdir(parents=True, exist_ok=True)
    pairs, stats = build_pairs(
        sentences_per_passage=args.sentences_per_passage,
        pair_multiple=SMOKE_PAIR_MULTIPLE if args.smoke else PAIR_MULTIPLE,
        seed=args.seed,
        max_pairs=SMOKE_MAX_PAIRS if args.smoke else None,
    )
    print(f"pairs: {stats}", flush=True)
    for batch_size in args.batch_sizes:
        run(batch_size, pairs, stats, args, out)
    report(load_runs([out]), out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
