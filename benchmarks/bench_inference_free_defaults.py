"""The documented inference-free default command and its variants on the shipped dev sample, one after another.

Each variant is ``gradcache-sparton train --config default`` plus its flags (``--query_encoder idf`` and a
lever: the document FLOPS weight, a trained table and its learning rate, Li-LSR), run as its own process;
the embedded run evaluates the starting model and the trained one on the shipped SciFact dev sample (100
claims, 1,583 abstracts) and prints both with the paired 95% interval of the gain. This script keeps each
run's summary (nDCG@10 before and after, the interval, query and document non-zeros) and its full log.

    python -m benchmarks.bench_inference_free_defaults --out benchmarks/results/inference_free_defaults.json
    python -m benchmarks.bench_inference_free_defaults --variants base docs_25x_lower \\
        --extra --bf16 True --out $OUT/inference_free_defaults_gpu.json

``--extra`` flags go to every variant (after its own). Logs go beside ``--out`` (``<out stem>.<variant>.log``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from benchmarks.common import run_stamp, write_result

__all__ = ["VARIANTS", "main"]

#: name -> the flags after ``train --config default``.
VARIANTS: dict[str, list[str]] = {
    "base": ["--query_encoder", "idf"],
    "docs_25x_lower": ["--query_encoder", "idf", "--doc_reg_weight", "0.000012"],
    "learned_docs_25x_lower": ["--query_encoder", "learned_idf", "--doc_reg_weight", "0.000012"],
    "learned_shared_rate_docs_25x_lower": [
        "--query_encoder",
        "learned_idf",
        "--doc_reg_weight",
        "0.000012",
        "--query_table_learning_rate",
        "0.0001",
    ],
    "li_lsr_docs_25x_lower": ["--query_encoder", "li_lsr", "--doc_reg_weight", "0.000012"],
}
# The summary keys kept from each run's JSON.
_KEPT = (
    "eval_before_ndcg_at_10",
    "eval_ndcg_at_10",
    "eval_gain_ndcg_at_10_mean_difference",
    "eval_gain_ndcg_at_10_ci95_low",
    "eval_gain_ndcg_at_10_ci95_high",
    "eval_gain_ndcg_at_10_p_value",
    "eval_before_query_nonzeros",
    "eval_query_nonzeros",
    "eval_before_doc_nonzeros",
    "eval_doc_nonzeros",
    "train_runtime",
)


def _run(name: str, flags: list[str], extra: list[str], out: Path, work: Path) -> dict[str, object]:
    argv = ["train", "--config", "default", *flags, *extra, "--output_dir", str(work / name)]
    log = out.with_name(f"{out.stem}.{name}.log")
    start = time.perf_counter()
    with log.open("w", encoding="utf-8") as stderr:
        done = subprocess.run(
            [sys.executable, "-m", "gradcache_sparton.cli", *argv],
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            check=False,
        )
    record: dict[str, object] = {
        "command": "gradcache-sparton " + " ".join(argv[:-2]),
        "returncode": done.returncode,
        "wall_s": round(time.perf_counter() - start, 1),
        "log": log.name,
    }
    if done.returncode == 0:
        # stdout: the Trainer's log lines, then the run's summary (a JSON object), then the printed gain
        start = done.stdout.index('{\n  "output_dir"')
        summary, end = json.JSONDecoder().raw_decode(done.stdout, start)
        record.update({key: summary[key] for key in _KEPT if key in summary})
        record["printed"] = done.stdout[end:].strip()
    return record


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--out", type=Path, required=True, help="the JSON result file")
    parser.add_argument("--work_dir", type=Path, default=Path("outputs/inference_free_defaults"))
    parser.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="flags for every variant")
    args = parser.parse_args(argv)
    result: dict[str, object] = {"stamp": run_stamp(), "runs": {}}
    for name in args.variants:
        result["runs"][name] = _run(name, VARIANTS[name], args.extra, args.out, args.work_dir)
        write_result(result, args.out)  # after each run: a stopped job keeps the runs it finished
        print(json.dumps({name: result["runs"][name]}), flush=True)
    return 0 if all(run["returncode"] == 0 for run in result["runs"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
