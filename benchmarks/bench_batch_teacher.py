"""The in-batch teacher's cost (``--in_batch_teacher``): building it (every training text encoded once) and, per
training step, scoring one batch's [B, (1+k)·B] matrix on the CPU, what the collator adds to each step.

Legend: R training rows, B batch rows, k negatives a row, (1+k)·B documents a batch.

The rows: SciFact queries with their positive and ``--negatives`` random abstracts
(:func:`benchmarks.scifact_text.training_rows`). The ``--teacher`` spec is built once over the R rows
(:func:`~gradcache_sparton.mining.build_batch_teacher`, on ``--device``; its seconds written), then the ensemble,
and each of its teachers alone, scores ``--batches`` batches of ``--batch_size`` rows drawn from them (one untimed
first): the median and largest milliseconds a batch on this machine's CPU, with ``torch.get_num_threads()``
threads (the collator's process: the main one, or a dataloader worker).

    python -m benchmarks.bench_batch_teacher --beir_path /path/to/scifact --output benchmarks/results/batch_teacher_cpu.json

``--smoke`` (64 rows, batches of 16) checks the script; its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import datasets
import torch

from benchmarks.common import run_stamp, write_result
from benchmarks.scifact_text import training_rows
from gradcache_sparton.mining import BatchTeacher, build_batch_teacher, parse_teacher_spec

__all__ = ["main", "parse_args"]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--beir_path", default="default", help="BEIR folder of the texts ('default': the sample)"
    )
    parser.add_argument("--rows", type=int, default=4096, help="training rows the teacher encodes (R)")
    parser.add_argument("--negatives", type=int, default=3, help="negatives a row (k)")
    parser.add_argument("--batch_size", type=int, default=1024, help="rows a batch (B)")
    parser.add_argument("--batches", type=int, default=10, help="timed batches")
    parser.add_argument(
        "--teacher",
        default="splade-tiny-msmarco:0.5,bm25:0.5",
        help="the --in_batch_teacher spec (built once)",
    )
    parser.add_argument("--device", default=None, help="where the teachers encode (default: cuda if any)")
    parser.add_argument("--smoke", action="store_true", help="64 rows, batches of 16: checks the script only")
    parser.add_argument("--output", type=Path, default=None, help="JSON result file")
    args = parser.parse_args(argv)
    if args.smoke:
        args.rows, args.batch_size, args.batches = 64, 16, 2
    return args


def _timed_batches(teacher: Any, rows: list[dict[str, str]], args: argparse.Namespace) -> list[float]:
    """Milliseconds of each of ``args.batches`` batches' scores (one untimed first)."""
    rng = random.Random(0)
    names = ["positive", *(f"negative_{j + 1}" for j in range(args.negatives))]
    times = []
    for step in range(args.batches + 1):
        batch = rng.sample(rows, args.batch_size)
        queries, columns = [r["query"] for r in batch], [[r[n] for r in batch] for n in names]
        start = time.perf_counter()
        scores = teacher(queries, columns)
        if step:
            times.append(1000 * (time.perf_counter() - start))
        assert scores.shape == (args.batch_size, (1 + args.negatives) * args.batch_size)
    return times


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    rows = training_rows(args.beir_path, args.rows, args.negatives)
    document_columns = ["positive", *(f"negative_{j + 1}" for j in range(args.negatives))]
    dataset = datasets.Dataset.from_list(rows)
    result: dict[str, Any] = {
        "stamp": run_stamp(),
        "command": "python -m benchmarks.bench_batch_teacher "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "rows": len(rows),
        "distinct_queries": len({row["query"] for row in rows}),
        "distinct_documents": len({row[name] for row in rows for name in document_columns}),
        "batch_size": args.batch_size,
        "negatives": args.negatives,
        "cpu_threads": torch.get_num_threads(),
        "teachers": {},
    }
    start = time.perf_counter()
    teacher = build_batch_teacher(args.teacher, dataset, device=args.device, show_progress=False)
    result["teacher"], result["build_seconds"] = args.teacher, round(time.perf_counter() - start, 2)
    names, _ = parse_teacher_spec(args.teacher)
    parts = {args.teacher: teacher}
    if len(teacher.reps) > 1:  # each teacher alone, its reps as built
        for name, reps in zip(names, teacher.reps, strict=True):
            parts[name] = BatchTeacher(
                teacher.query_row,
                teacher.document_row,
                [reps],
                weights=[1.0],
                normalisation="minmax",
                scale=30.0,
            )
    for name, scorer in parts.items():
        times = _timed_batches(scorer, rows, args)
        entry = {"batch_ms_median": round(statistics.median(times), 1), "batch_ms_max": round(max(times), 1)}
        result["teachers"][name] = entry
        print(name, entry, flush=True)
    print(write_result(result, args.output))
    return 0


if __name__ == "__main__":
    sys.exit(main())
