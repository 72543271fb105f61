"""Probe the first epochs of the large-batch experiment for several head starts (GPU).

Legend: B effective batch.

From random weights, a SPLADE head that starts with thousands of active terms gives dot products that
saturate InfoNCE; the loss then falls fastest by switching every term off, and the reps collapse to
zeros within the warm-up (relu passes no gradient afterwards). This script runs
``scripts/large_batch_experiment.py``'s training for a few epochs at each (``init_decoder_bias``,
temperature) pair and batch size, and prints, per run, the dev nDCG@10 and the logged (step, loss,
query non-zeros, document non-zeros): enough to see which starts survive. The numbers behind the
experiment's choice of -1.4 are in docs/experiments.md.

    export PYTHONPATH=$PWD:$PYTHONPATH
    python scripts/probe_experiment_start.py --out $OUT/probe --settings=-1.0:1,-1.4:1 --batch_sizes 256,4096
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import large_batch_experiment as experiment  # scripts/large_batch_experiment.py, beside this script


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for the runs' JSON")
    parser.add_argument(
        "--settings",
        default="-1.0:1,-1.2:1,-1.4:1,-1.0:10,-1.2:5",
        help="comma list of init_decoder_bias:temperature pairs",
    )
    parser.add_argument("--batch_sizes", default="256,1024,4096")
    parser.add_argument("--epochs", type=int, default=4)
    args = parser.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    settings = [tuple(float(x) for x in item.split(":")) for item in args.settings.split(",")]
    pairs, stats = experiment.build_pairs(
        sentences_per_passage=2, pair_multiple=experiment.PAIR_MULTIPLE, seed=42
    )
    for bias, temperature in settings:
        folder = Path(args.out) / f"bias{bias}_t{temperature}"
        folder.mkdir(parents=True, exist_ok=True)
        for batch in (int(b) for b in args.batch_sizes.split(",")):
            sys.argv = [sys.argv[0], "--out", str(folder), "--num_train_epochs", str(args.epochs),
                        f"--init_decoder_bias={bias}", f"--temperature={temperature}"]  # fmt: skip
            record = experiment.run(batch, pairs, stats, experiment.parse_args(), folder)
            trajectory = [
                (h["step"], round(h["loss"], 2), round(h["nnz_query"]), round(h["nnz_doc"]))
                for h in record["log_history"]
            ]
            print(
                f"bias {bias} T {temperature} batch {batch}: dev nDCG@10 "
                f"{record['dev_before_training']['ndcg_at_10']:.3f} -> {record['dev']['ndcg_at_10']:.3f}, "
                f"(step, loss, nnz q, nnz d) {trajectory}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
