"""SciFact fine-tuning experiment: the pretrained SPLADE-tiny at effective batch 32 to 4,096, with and without
BM25 negatives, at equal epochs and at equal steps, against zero-shot and BM25 on a held-out dev split.

Data: the folder ``scripts/prepare_finetune_data.py`` writes on a CPU with bm25s (default ``.exp_data``):
20% of the SciFact train claims held out as a BEIR dev folder (full 5,183-abstract corpus), labelled
pairs of the other claims and self-supervised (sentence, rest of the abstract) pairs from the abstracts
no claim judges, each with and without BM25 negatives (ranks 10..100), and bm25s's dev metrics.

Pairs: every labelled pair plus a seeded subset of the self-supervised ones, N in all, N the largest
multiple of ``--pair_multiple`` (4,096) that the files hold: every batch size sees every pair once per
epoch and drops nothing. The ``none`` and ``bm25`` runs train on the same (query, positive) rows; ``bm25``
adds ``negative_1..--num_negatives`` (1) to each row (in-batch negatives stay in the loss).

Runs, in this order (``--time_budget_s`` stops a run that passes it and skips the rest):

1. zero-shot: the shipped ``splade-tiny-msmarco`` evaluated untrained;
2. equal epochs: ``--num_train_epochs`` (3) epochs of the N pairs at every batch and negatives setting
   (N / B x epochs optimizer steps: 128x fewer at 4,096 than at 32);
3. equal steps: the step count of batch ``--steps_reference_batch`` (1,024) at those epochs, at every
   batch (the reference batch's run is the one of step 2, not run twice).

Training goes through ``CachedSpladeTrainer`` (GradCache: the loss and gradients of the whole effective
batch, in mini-batches of at most ``--mini_batch_size`` rows that only set memory and speed), bf16 on
CUDA, AdamW, linear decay with a warm-up of 10% of the steps (rounded down), InfoNCE + FLOPS (query
5e-4, document 3e-4, from the first step, as the embedded default run). Learning rate: ``--learning_rate``
(5e-5, which gained +0.04 nDCG@10 at batch 32 in issue 16) at batch 32, scaled by sqrt(B / 32) (the
square-root rule for Adam) and capped at ``--max_learning_rate`` (2e-4): 5e-5, 1.4e-4, 2e-4, 2e-4.
Queries are truncated to 32 tokens, training documents to ``--document_max_length`` (128), dev abstracts
to 256. Each run starts from the same weights and seed. Metrics on the dev folder
(``SparseRetrievalEvaluator``): nDCG@10, MRR@10, Recall@100, average non-zeros per query and document rep.

Output (``--output_dir``): ``results.json`` (rewritten after every run, so a timeout keeps what finished),
``results.md`` (table) and ``results.png`` (plot, if matplotlib imports); a progress line per run.
``--report DIR [DIR ...]`` rebuilds the table and plot from the results.json of several calls (a run in two:
the complete one over one the time budget stopped, else the later folder's; ``calls``: every call's meta).

GPU machine (no bm25s, no internet; the datasets wheels of ../shared/device-wheels in ``.whl`` and the
ir_measures / pytrec_eval wheels in ``.exp_data/wheels``), carry ``.whl`` and ``.exp_data``, from the
repository root:

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl .exp_data/wheels/*.whl && export PYTHONPATH=/tmp/site:$PWD:$PYTHONPATH || exit; \
    python3 scripts/finetune_experiment.py --data_dir .exp_data --output_dir $OUT/ft --time_budget_s 300

``--smoke`` runs a CPU-sized version (4 pairs, batches 2 and 4, 16-token texts, 2 dev queries, 1 epoch).
``--cpu`` runs the full-size experiment without a GPU, in fp32 (minutes per run at batches 32 and 256;
none-b4096-steps took 35 minutes on a 2-core CPU).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import TrainerCallback

from gradcache_sparton.arguments import CachedSpladeTrainingArguments, ModelArguments
from gradcache_sparton.data import NEGATIVE_PREFIX, BeirData, load_beir, load_training_data
from gradcache_sparton.evaluation import SparseRetrievalEvaluator
from gradcache_sparton.pipeline import build_encoder, build_tokenizer
from gradcache_sparton.trainer import CachedSpladeTrainer

MODEL = "splade-tiny-msmarco"
BATCH_SIZES = (32, 256, 1024, 4096)
NEGATIVES = ("none", "bm25")
SCHEDULES = ("epochs", "steps")
PAIR_FILES = ("labelled", "selfsup")  # <name>.jsonl.gz and <name>_bm25.jsonl.gz
DEV_FOLDER, DEV_SPLIT = "dev", "dev"
BM25_FILE = "bm25_dev.json"
METRICS = ("ndcg_at_10", "mrr_at_10", "recall_at_100", "query_nonzeros", "doc_nonzeros")
# --smoke: tiny batches, 4 pairs, 16-token texts, a dev subset (the CPU reference head is slow).
SMOKE = {
    "batch_sizes": (2, 4),
    "pair_multiple": 4,
    "rows_per_file": 2,
    "steps_reference_batch": 4,
    "max_length": 16,
}


@dataclass(frozen=True)
class Config:
    """One training run: its negatives setting, effective batch, schedule and optimizer steps."""

    negatives: str
    batch_size: int
    schedule: str
    steps: int

    @property
    def name(self) -> str:
        return f"{self.negatives}-b{self.batch_size}-{self.schedule}"


# ---------------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------------


def pair_path(data_dir: Path, name: str, negatives: str) -> Path:
    return data_dir / f"{name}{'_bm25' if negatives == 'bm25' else ''}.jsonl.gz"


def check_data_dir(data_dir: Path) -> None:
    """Raise ``ValueError`` naming what is missing unless ``data_dir`` holds the prepared files."""
    needed = [pair_path(data_dir, n, neg) for n in PAIR_FILES for neg in NEGATIVES]
    needed.append(data_dir / DEV_FOLDER / "qrels" / f"{DEV_SPLIT}.tsv")
    missing = [str(p) for p in needed if not p.is_file()]
    if missing:
        raise ValueError(
            f"--data_dir {str(data_dir)!r} lacks {missing}: run scripts/prepare_finetune_data.py (on a CPU with "
            "bm25s) and carry its folder"
        )


def load_pairs(data_dir: Path, *, negatives: str, args: argparse.Namespace) -> tuple[Any, dict[str, int]]:
    """Every labelled pair plus a seeded subset of the self-supervised ones, N a multiple of pair_multiple.

    The row choice depends only on the row counts and the seed, so ``none`` and ``bm25`` get the same
    (query, positive) rows (the prepared files hold the same rows in the same order)."""
    import datasets

    parts = [load_training_data(pair_path(data_dir, name, negatives)) for name in PAIR_FILES]
    if args.smoke:
        parts = [part.select(range(min(SMOKE["rows_per_file"], len(part)))) for part in parts]
    labelled, selfsup = parts
    total = (len(labelled) + len(selfsup)) // args.pair_multiple * args.pair_multiple
    if total == 0:
        raise ValueError(
            f"{len(labelled) + len(selfsup)} pairs: fewer than --pair_multiple={args.pair_multiple}"
        )
    if len(labelled) > total:
        labelled = labelled.shuffle(seed=args.seed).select(range(total))
    selfsup = selfsup.shuffle(seed=args.seed).select(range(total - len(labelled)))
    pairs = datasets.concatenate_datasets([labelled, selfsup])
    if negatives == "bm25":
        available = [c for c in pairs.column_names if c.startswith(NEGATIVE_PREFIX)]
        if len(available) < args.num_negatives:
            raise ValueError(
                f"--num_negatives={args.num_negatives} but the files hold {len(available)} negatives"
            )
        keep = ["query", "positive", *[f"{NEGATIVE_PREFIX}{i + 1}" for i in range(args.num_negatives)]]
        pairs = pairs.select_columns(keep)
    return pairs, {"pairs": total, "labelled": len(labelled), "selfsup": len(selfsup)}


def dev_data(data_dir: Path, smoke: bool) -> BeirData:
    """The held-out dev folder; with ``smoke``, its first 2 queries, their judged docs and 4 others."""
    dev = load_beir(data_dir / DEV_FOLDER, split=DEV_SPLIT)
    if not smoke:
        return dev
    qrels = dict(list(dev.qrels.items())[:2])
    judged = {doc for judgements in qrels.values() for doc in judgements}
    others = [doc for doc in dev.corpus if doc not in judged][:4]
    corpus = {doc: text for doc, text in dev.corpus.items() if doc in judged or doc in others}
    return BeirData(corpus=corpus, queries={q: dev.queries[q] for q in qrels}, qrels=qrels)


# ---------------------------------------------------------------------------------------------------
# Runs
# ---------------------------------------------------------------------------------------------------


def learning_rate(batch_size: int, args: argparse.Namespace) -> float:
    """``--learning_rate`` at batch 32, x sqrt(B / 32), at most ``--max_learning_rate``."""
    return min(args.learning_rate * math.sqrt(batch_size / 32), args.max_learning_rate)


def plan(num_pairs: int, args: argparse.Namespace) -> list[Config]:
    """The runs in order: equal epochs at every (negatives, batch), then equal steps (no run twice)."""
    reference_steps = num_pairs // args.steps_reference_batch * args.num_train_epochs
    configs: list[Config] = []
    for schedule in args.schedules:
        for negatives in args.negatives:
            for batch in args.batch_sizes:
                steps = (
                    num_pairs // batch * args.num_train_epochs if schedule == "epochs" else reference_steps
                )
                same = [
                    i
                    for i, c in enumerate(configs)
                    if (c.negatives, c.batch_size, c.steps) == (negatives, batch, steps)
                ]
                if same:  # the reference batch's equal-epochs run is its equal-steps run
                    configs[same[0]] = replace(
                        configs[same[0]], schedule=f"{configs[same[0]].schedule}={schedule}"
                    )
                else:
                    configs.append(Config(negatives, batch, schedule, steps))
    return configs


class _Deadline(TrainerCallback):
    """Stop training at the first step that ends past ``deadline`` (time.monotonic())."""

    def __init__(self, deadline: float) -> None:
        self.deadline = deadline
        self.stopped = False

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if time.monotonic() > self.deadline:
            self.stopped = control.should_training_stop = True


def train_and_evaluate(
    config: Config,
    pairs: Any,
    *,
    evaluator: SparseRetrievalEvaluator,
    deadline: float,
    args: argparse.Namespace,
) -> dict[str, Any]:
    """Fine-tune the shipped model at ``config`` and return its row (dev metrics, cost, settings)."""
    cuda = torch.cuda.is_available()
    model_args = ModelArguments(model_name_or_path=MODEL)
    tokenizer = build_tokenizer(model_args)
    transformers.set_seed(args.seed)  # same start and data order in every run
    encoder = build_encoder(model_args, tokenizer)
    lr = learning_rate(config.batch_size, args)
    mini_batch_size = min(args.mini_batch_size, config.batch_size)
    with tempfile.TemporaryDirectory() as trainer_dir:
        training_args = CachedSpladeTrainingArguments(
            output_dir=trainer_dir,
            per_device_train_batch_size=config.batch_size,
            mini_batch_size=mini_batch_size,
            max_steps=config.steps,
            learning_rate=lr,
            lr_scheduler_type="linear",
            warmup_steps=config.steps // 10,
            weight_decay=0.01,
            query_reg_weight=args.query_reg_weight,
            doc_reg_weight=args.doc_reg_weight,
            reg_warmup_steps=0,
            query_max_length=args.query_max_length,
            document_max_length=args.document_max_length,
            bf16=cuda,
            seed=args.seed,
            logging_steps=max(1, config.steps // 5),
            save_strategy="no",
            report_to="none",
            disable_tqdm=True,
            dataloader_num_workers=args.dataloader_num_workers if cuda else 0,
            dataloader_pin_memory=cuda,
            dataloader_persistent_workers=cuda and args.dataloader_num_workers > 0,  # no re-fork per epoch
        )
        trainer = CachedSpladeTrainer(encoder, training_args, train_dataset=pairs, processing_class=tokenizer)
        stop = _Deadline(deadline)
        trainer.add_callback(stop)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        result = trainer.train()
        if cuda:
            torch.cuda.synchronize()
        train_wall = time.perf_counter() - start
        peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
        start = time.perf_counter()
        metrics = evaluator(trainer.model)
        eval_wall = time.perf_counter() - start
    return {
        "name": config.name,
        "negatives": config.negatives,
        "batch_size": config.batch_size,
        "schedule": config.schedule,
        "planned_steps": config.steps,
        "steps": result.global_step,
        "stopped_by_time_budget": stop.stopped and result.global_step < config.steps,
        "epochs": result.global_step * config.batch_size / len(pairs),
        "learning_rate": lr,
        "mini_batch_size": mini_batch_size,
        "train_wall_s": train_wall,
        "peak_memory_gib": peak,
        "eval_wall_s": eval_wall,
        "train_loss": result.training_loss,
        **{key: metrics[key] for key in METRICS},
        "log_history": [h for h in trainer.state.log_history if "loss" in h],
    }


def zero_shot(evaluator: SparseRetrievalEvaluator) -> dict[str, Any]:
    """The untrained shipped model on the dev folder."""
    model_args = ModelArguments(model_name_or_path=MODEL)
    encoder = build_encoder(model_args, build_tokenizer(model_args))
    encoder.to("cuda" if torch.cuda.is_available() else "cpu").eval()
    start = time.perf_counter()
    metrics = evaluator(encoder)
    return {"name": "zero-shot", "negatives": "-", "batch_size": None, "schedule": "-", "steps": 0,
            "eval_wall_s": time.perf_counter() - start, **{key: metrics[key] for key in METRICS}}  # fmt: skip


# ---------------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------------


def _num(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(results: dict[str, Any]) -> str:
    """A markdown table: BM25 and zero-shot first, then every run with its gain over zero-shot."""
    head = ["run", "negatives", "batch", "schedule", "steps", "epochs", "lr", "nDCG@10", "Δ zero-shot",
            "MRR@10", "R@100", "query nnz", "doc nnz", "train s", "peak GiB"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    zero = next((r for r in results["rows"] if r["name"] == "zero-shot"), None)
    bm25 = results.get("bm25")
    if bm25:
        lines.append(f"| BM25 (bm25s) | - | - | - | - | - | - | {bm25['ndcg_at_10']:.4f} | "
                     f"{_num(zero and bm25['ndcg_at_10'] - zero['ndcg_at_10'], '+.4f')} | {bm25['mrr_at_10']:.4f} | "
                     f"{bm25['recall_at_100']:.4f} | - | - | - | - |")  # fmt: skip
    for r in results["rows"]:
        delta = None if zero is None else r["ndcg_at_10"] - zero["ndcg_at_10"]
        steps = f"{r['steps']}" + (
            f" of {r['planned_steps']} (time budget)" if r.get("stopped_by_time_budget") else ""
        )
        lines.append(
            f"| {r['name']} | {r['negatives']} | {_num(r['batch_size'], 'd')} | {r['schedule']} | {steps} | "
            f"{_num(r.get('epochs'), '.2f')} | {_num(r.get('learning_rate'), '.1e')} | {r['ndcg_at_10']:.4f} | "
            f"{_num(delta, '+.4f')} | {r['mrr_at_10']:.4f} | {r['recall_at_100']:.4f} | "
            f"{r['query_nonzeros']:.0f} | {r['doc_nonzeros']:.0f} | {_num(r.get('train_wall_s'), '.0f')} | "
            f"{_num(r.get('peak_memory_gib'), '.2f')} |"
        )
    calls = results.get("calls", [results["meta"]])  # merge() lists every call's meta

    def joined(key: str) -> str:
        return " / ".join(dict.fromkeys(str(call[key]) for call in calls))

    return (
        f"SciFact fine-tuning of {MODEL} ({joined('device')}, torch {joined('torch')}, transformers "
        f"{joined('transformers')}, {joined('date')}{f', {len(calls)} calls' if len(calls) > 1 else ''}): "
        f"{results['pairs']}, dev {results['dev']}\n\n"
        + "\n".join(lines)
        + (f"\n\nskipped (time budget): {', '.join(results['skipped'])}" if results.get("skipped") else "")
        + "\n"
    )


def plot(results: dict[str, Any], path: Path) -> None:
    """nDCG@10 and Recall@100 against the batch, one panel per schedule run, zero-shot and BM25 as lines."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed here: no plot (the table is written)", flush=True)
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in results["rows"] if r["batch_size"] is not None]
    zero = next((r for r in results["rows"] if r["name"] == "zero-shot"), None)
    bm25 = results.get("bm25")
    # One panel column per schedule that has runs (a call may run only part of the grid).
    schedules = [s for s in SCHEDULES if any(s in r["schedule"].split("=") for r in rows)] or list(SCHEDULES)
    fig, axes = plt.subplots(2, len(schedules), figsize=(5 * len(schedules), 7), squeeze=False)
    for col, schedule in enumerate(schedules):
        for row, (key, label) in enumerate((("ndcg_at_10", "nDCG@10"), ("recall_at_100", "Recall@100"))):
            ax = axes[row][col]
            for i, negatives in enumerate(NEGATIVES):
                runs = sorted(
                    (r for r in rows if r["negatives"] == negatives and schedule in r["schedule"].split("=")),
                    key=lambda r: r["batch_size"],
                )
                if runs:
                    ax.plot([r["batch_size"] for r in runs], [r[key] for r in runs], marker="o", color=f"C{i}",
                            label=f"negatives: {negatives}")  # fmt: skip
            if zero:
                ax.axhline(zero[key], linestyle=":", color="grey", label="zero-shot")
            if bm25:
                ax.axhline(bm25[key], linestyle="--", color="C3", label="BM25")
            ax.set(xscale="log", xlabel="effective batch", ylabel=f"dev {label}", title=f"equal {schedule}")
            batches = sorted({r["batch_size"] for r in rows})
            ax.set_xticks(batches, [str(b) for b in batches])
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"plot: {path}", flush=True)


def write_results(results: dict[str, Any], out: Path, *, with_plot: bool) -> None:
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    (out / "results.md").write_text(table(results))
    if with_plot:
        plot(results, out / "results.png")


def _row_order(row: dict[str, Any]) -> tuple:
    """Zero-shot, then equal epochs, then equal steps; without negatives before BM25; by batch."""
    if row["batch_size"] is None:
        return (0,)
    negatives = NEGATIVES.index(row["negatives"]) if row["negatives"] in NEGATIVES else len(NEGATIVES)
    return (1, "epochs" not in row["schedule"].split("="), negatives, row["batch_size"], row["name"])


def merge(folders: list[Path]) -> dict[str, Any]:
    """The results.json of several calls as one, its ``calls`` the meta of each (``meta``: the last's).

    A run named in two folders: a complete one supersedes one the time budget stopped, whatever the
    folder order; between two complete (or two stopped) ones, the later folder's. ``planned`` and
    ``skipped`` are the union over the calls (``skipped`` less the runs some call ran). Rows are sorted:
    zero-shot, equal epochs, equal steps; without negatives first; by batch."""
    merged: dict[str, Any] = {}
    rows: dict[str, dict] = {}
    calls: list[dict] = []
    planned: list[str] = []
    skipped: list[str] = []
    for folder in folders:
        results = json.loads((folder / "results.json").read_text())
        for row in results["rows"]:
            kept = rows.get(row["name"])
            if kept is None or not row.get("stopped_by_time_budget") or kept.get("stopped_by_time_budget"):
                rows[row["name"]] = row  # never a stopped run over a complete one
        calls.extend(results.get("calls", [results["meta"]]))
        planned.extend(n for n in results.get("planned", []) if n not in planned)
        skipped.extend(n for n in results.get("skipped", []) if n not in skipped)
        merged = results
    return {
        **merged,
        "calls": calls,
        "planned": planned,
        "skipped": [name for name in skipped if name not in rows],
        "rows": sorted(rows.values(), key=_row_order),
    }


# ---------------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------------


def _choices(text: str, allowed: tuple, name: str, cast: type = str) -> list:
    values = [cast(v) for v in text.split(",")]
    bad = [v for v in values if allowed and v not in allowed]
    if bad or not values:
        raise ValueError(f"{name} must be a comma list of {allowed}, got {text!r}")
    return values


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--data_dir", type=Path, default=Path(".exp_data"), help="prepare_finetune_data.py's folder"
    )
    p.add_argument("--output_dir", type=Path, required=True, help="results.json / .md / .png go here")
    p.add_argument("--report", nargs="+", type=Path, metavar="DIR", help="only merge results.json of DIRs")
    p.add_argument(
        "--time_budget_s", type=float, default=300.0, help="stop and skip runs past this (seconds)"
    )
    p.add_argument(
        "--batch_sizes", help=f"comma list (default {BATCH_SIZES}; --smoke: {SMOKE['batch_sizes']})"
    )
    p.add_argument("--negatives", default=",".join(NEGATIVES), help=f"comma list of {NEGATIVES}")
    p.add_argument("--schedules", default=",".join(SCHEDULES), help=f"comma list of {SCHEDULES}")
    p.add_argument("--num_train_epochs", type=int, default=3, help="epochs of the equal-epochs runs")
    p.add_argument("--steps_reference_batch", type=int, default=1024, help="equal steps = its steps")
    p.add_argument("--num_negatives", type=int, default=1, help="BM25 negatives per row (of the file's k)")
    p.add_argument("--pair_multiple", type=int, default=4096, help="the pair count is a multiple of this")
    p.add_argument("--learning_rate", type=float, default=5e-5, help="at batch 32, x sqrt(B/32)")
    p.add_argument("--max_learning_rate", type=float, default=2e-4)
    p.add_argument("--mini_batch_size", type=int, default=256, help="GradCache mini-batch (memory only)")
    p.add_argument("--query_reg_weight", type=float, default=5e-4)
    p.add_argument("--doc_reg_weight", type=float, default=3e-4)
    p.add_argument("--query_max_length", type=int, default=32)
    p.add_argument("--document_max_length", type=int, default=128, help="training documents (tokens)")
    p.add_argument("--eval_document_max_length", type=int, default=256, help="dev abstracts (tokens)")
    p.add_argument("--eval_batch_size", type=int, default=256)
    p.add_argument("--dataloader_num_workers", type=int, default=4, help="on CUDA (0 on CPU)")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--smoke", action="store_true", help="CPU-sized check: 4 rows, batches 2 and 4")
    p.add_argument(
        "--cpu", action="store_true", help="full-size runs without a GPU (fp32, minutes per small-batch run)"
    )
    args = p.parse_args(argv)
    if args.smoke:
        args.pair_multiple = SMOKE["pair_multiple"]
        args.steps_reference_batch = SMOKE["steps_reference_batch"]
        args.num_train_epochs = 1
        args.mini_batch_size = min(args.mini_batch_size, 2)
        args.query_max_length = args.document_max_length = args.eval_document_max_length = SMOKE["max_length"]
        args.eval_batch_size = 8
    default_batches = SMOKE["batch_sizes"] if args.smoke else BATCH_SIZES
    args.batch_sizes = _choices(
        args.batch_sizes or ",".join(map(str, default_batches)), (), "--batch_sizes", int
    )
    args.negatives = _choices(args.negatives, NEGATIVES, "--negatives")
    args.schedules = _choices(args.schedules, SCHEDULES, "--schedules")
    too_big = [b for b in args.batch_sizes if b < 1 or args.pair_multiple % b]
    if too_big:
        raise ValueError(f"--batch_sizes must divide --pair_multiple={args.pair_multiple}, got {too_big}")
    if args.num_train_epochs < 1 or args.num_negatives < 1:
        raise ValueError("--num_train_epochs and --num_negatives must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = args.output_dir
    out.mkdir(parents=True, exist_ok=True)
    if args.report:
        merged = merge(args.report)
        write_results(merged, out, with_plot=True)
        print(table(merged), flush=True)
        return 0
    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke and not args.cpu:
        print(
            "no GPU: the experiment needs one (use --smoke for a CPU check, or --cpu for full-size runs in fp32 "
            "on the CPU, slow)",
            file=sys.stderr,
        )
        return 2
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # dataloader workers fork after tokenizing
    begin = time.monotonic()
    deadline = begin + args.time_budget_s
    check_data_dir(args.data_dir)
    pairs = {
        negatives: load_pairs(args.data_dir, negatives=negatives, args=args) for negatives in args.negatives
    }
    dev = dev_data(args.data_dir, args.smoke)
    bm25_path = args.data_dir / BM25_FILE
    tokenizer = build_tokenizer(ModelArguments(model_name_or_path=MODEL))
    evaluator = SparseRetrievalEvaluator(
        dev,
        tokenizer=tokenizer,
        query_max_length=args.query_max_length,
        document_max_length=args.eval_document_max_length,
        batch_size=args.eval_batch_size,
        autocast_dtype=torch.bfloat16 if cuda else None,
        show_progress=False,
    )
    num_pairs, pair_stats = next(iter(pairs.values()))[1]["pairs"], next(iter(pairs.values()))[1]
    configs = plan(num_pairs, args)
    results: dict[str, Any] = {
        "meta": {
            "device": torch.cuda.get_device_name() if cuda else platform.processor() or "cpu",
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "date": datetime.date.today().isoformat(),
            "command": " ".join(sys.argv),
            "args": {k: str(v) for k, v in vars(args).items()},
        },
        "pairs": pair_stats,
        "dev": {"queries": len(dev.queries), "documents": len(dev.corpus)},
        "bm25": None if args.smoke or not bm25_path.is_file() else json.loads(bm25_path.read_text()),
        "planned": [c.name for c in configs],
        "rows": [],
        "skipped": [],
    }
    row = zero_shot(evaluator)
    results["rows"].append(row)
    write_results(results, out, with_plot=False)
    print(f"[{time.monotonic() - begin:6.0f} s] zero-shot: nDCG@10 {row['ndcg_at_10']:.4f} "
          f"R@100 {row['recall_at_100']:.4f} nnz q/d {row['query_nonzeros']:.0f}/{row['doc_nonzeros']:.0f}",
          flush=True)  # fmt: skip
    for index, config in enumerate(configs):
        if time.monotonic() > deadline:
            results["skipped"] = [c.name for c in configs[index:]]
            print(f"time budget {args.time_budget_s:.0f} s spent: skipping {results['skipped']}", flush=True)
            break
        row = train_and_evaluate(
            config, pairs[config.negatives][0], evaluator=evaluator, deadline=deadline, args=args
        )
        results["rows"].append(row)
        write_results(results, out, with_plot=False)
        print(
            f"[{time.monotonic() - begin:6.0f} s] {index + 1}/{len(configs)} {config.name}: {row['steps']} steps, "
            f"nDCG@10 {row['ndcg_at_10']:.4f} ({row['ndcg_at_10'] - results['rows'][0]['ndcg_at_10']:+.4f}) "
            f"R@100 {row['recall_at_100']:.4f} nnz q/d {row['query_nonzeros']:.0f}/{row['doc_nonzeros']:.0f}, "
            f"train {row['train_wall_s']:.0f} s, eval {row['eval_wall_s']:.0f} s"
            + (" (stopped by the time budget)" if row["stopped_by_time_budget"] else ""),
            flush=True,
        )
    write_results(results, out, with_plot=True)
    print("\n" + table(results), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
