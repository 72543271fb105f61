"""Real-workload training-step benchmark: ours (GradCache + Sparton) vs sentence-transformers, one process.

Full steps on batches of real (query, positive, negative_1) triplets, every provider on the same tensors,
for several mini-batch budgets and options; pairs/s and peak memory per configuration, and issue 15's
targets. What a step is, the providers, options, workloads, models and measurement: the docstring of
``benchmarks/real_workload/__init__.py`` (the harness this script runs).

Run on the GPU machine from the repository root (with it on ``PYTHONPATH``, as below, or as
``python -m benchmarks.bench_real_workload``). One (model, workload) with the default four budgets
(17 configurations, 2 timed steps each) takes about 5 minutes on an H100 for base/scifact, less for
the others, so a session of 10-minute calls runs them one or two per call and merges the JSON files:

    export PYTHONPATH=$PWD:$PYTHONPATH PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True HF_HUB_OFFLINE=1
    python benchmarks/bench_real_workload.py --models base --workloads scifact --output_dir $OUT/rw1
    python benchmarks/bench_real_workload.py --models base --workloads short --output_dir $OUT/rw2
    python benchmarks/bench_real_workload.py --models tiny --output_dir $OUT/rw3
    python benchmarks/bench_real_workload.py --merge rw1/real_workload.json rw2/real_workload.json \
        rw3/real_workload.json --output_dir rw        # one table, targets and plot (no GPU needed)

``--time_budget_s`` (420) records every configuration not started by then as skipped, so a call ends
in about 8 minutes whatever it was given.

It writes ``real_workload.json`` (rows, targets, calibration, device, versions, date; rewritten after
every configuration), ``real_workload.md`` and, when matplotlib is importable, ``real_workload.png``
(pairs/s against peak memory) under ``--output_dir``. ``--smoke`` runs everything at tiny sizes (a
tiny random model instead of the pretrained one, few rows) on a CPU in seconds; its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import AutoTokenizer

from benchmarks.harness import int_list, name_list
from benchmarks.real_workload.configs import SETTINGS, Config, header, plan, uncached_configs
from benchmarks.real_workload.measure import Bench
from benchmarks.real_workload.models import default_model_path, prepare_models
from benchmarks.real_workload.report import finish, merge, metadata, record
from benchmarks.real_workload.workloads import (
    FULL,
    SMOKE,
    build_workload,
    read_scifact_pairs,
    scifact_triplets,
    short_triplets,
)
from gradcache_sparton.resources import default_tokenizer_path

__all__ = ["main", "parse_args"]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output_dir", required=True, help="folder for real_workload.json / .md / .png")
    parser.add_argument("--model_path", type=Path, default=default_model_path(),
                        help="pretrained SPLADE-tiny directory (default: the package's copy, else ../shared's)")  # fmt: skip
    parser.add_argument("--models", type=name_list(("base", "tiny")), default=["base", "tiny"])
    parser.add_argument("--workloads", type=name_list(("scifact", "short")), default=["scifact", "short"])
    parser.add_argument("--providers", type=name_list(("ours", "st", "ours-uncached")), default=["ours", "st", "ours-uncached"])  # fmt: skip
    parser.add_argument("--reuse_argmax", choices=("off", "on", "both"), default="both",
                        help="ours without / with reuse_argmax (the replay skips the head's forward), or both")  # fmt: skip
    parser.add_argument("--sparse_reps", choices=("off", "on", "both"), default="off",
                        help="ours with the reps of Step (1) kept dense / as their non-zeros (sparse_reps), or both")  # fmt: skip
    parser.add_argument("--checkpointing", choices=("off", "on", "both"), default="off",
                        help="every provider without / with activation checkpointing in the backbone, or both")  # fmt: skip
    parser.add_argument("--compile", choices=("off", "on", "both"), default="off",
                        help="every provider with its backbone eager / under torch.compile, or both")  # fmt: skip
    parser.add_argument("--compile_mode", choices=("default", "reduce-overhead"),
                        default="default", help="torch.compile's mode for compiled backbones (reduce-overhead: CUDA graphs)")  # fmt: skip
    parser.add_argument("--mini_batch_length_multiple", type=int, default=None,
                        help="ours: round each mini-batch's length up to this multiple (few static shapes; "
                        "a compiled backbone of ours is then compiled with static shapes)")  # fmt: skip
    parser.add_argument("--cuda_graphs", choices=("off", "on", "both"), default="off",
                        help="ours without / with each mini-batch replayed as a CUDA graph (GradCache(cuda_graphs=True); "
                        "needs --mini_batch_length_multiple), or both")  # fmt: skip
    parser.add_argument("--token_budgets", action=argparse.BooleanOptionalAction, default=True,
                        help="also run every provider with token-budget mini-batches")  # fmt: skip
    parser.add_argument("--effective_batch", type=int, default=1024, help="pairs per step (every provider)")
    parser.add_argument("--mini_batches", type=int_list, default=[16, 32, 64, 128],
                        help="rows per mini-batch; token budgets are these times the mean passage length")  # fmt: skip
    parser.add_argument(
        "--steps", type=int, default=2, help="at most this many timed steps per configuration"
    )
    parser.add_argument(
        "--seconds_per_config", type=float, default=5.0, help="timed steps are cut to fit about this long"
    )
    parser.add_argument("--time_budget_s", type=float, default=420.0,
                        help="configurations not started by then are recorded as skipped")  # fmt: skip
    parser.add_argument(
        "--target_density", type=float, default=0.02, help="rep non-zeros of the base-width start"
    )
    parser.add_argument("--busy_fraction", action=argparse.BooleanOptionalAction, default=False,
                        help="profile one more step per configuration for the device-busy fraction (CUDA)")  # fmt: skip
    parser.add_argument("--profile_host", action=argparse.BooleanOptionalAction, default=False,
                        help="with --busy_fraction: also record the host's operators (slow) and write their table")  # fmt: skip
    parser.add_argument("--sync_audit", action=argparse.BooleanOptionalAction, default=False,
                        help="run one more step per configuration counting its host-device syncs by call site (CUDA)")  # fmt: skip
    parser.add_argument("--cprofile", action=argparse.BooleanOptionalAction, default=False,
                        help="run one more step per configuration under cProfile and write its table (CUDA)")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--merge", nargs="+", type=Path, metavar="JSON",
                        help="merge real_workload.json files of several runs into --output_dir (no GPU work)")  # fmt: skip
    parser.add_argument(
        "--smoke", action="store_true", help="tiny sizes (tiny random models) for a CPU check"
    )
    args = parser.parse_args(argv)
    if args.effective_batch < 1:
        parser.error(f"--effective_batch must be >= 1, got {args.effective_batch}")
    if args.mini_batch_length_multiple is not None and args.mini_batch_length_multiple < 1:
        parser.error(f"--mini_batch_length_multiple must be >= 1, got {args.mini_batch_length_multiple}")
    if args.cuda_graphs != "off" and args.mini_batch_length_multiple is None:
        parser.error("--cuda_graphs needs --mini_batch_length_multiple (one graph per mini-batch shape)")
    if not 0 < args.target_density < 1:
        parser.error(f"--target_density must be in (0, 1), got {args.target_density}")
    if "tiny" in args.models and not args.smoke and not (args.model_path / "config.json").is_file():
        if any(a.startswith("--model_path") for a in (sys.argv[1:] if argv is None else argv)):
            parser.error(
                f"--model_path {args.model_path} has no config.json (the pretrained SPLADE-tiny directory)"
            )
        # Neither the package's copy nor ../shared's: run what can run, say what is missing.
        print(f"no pretrained SPLADE-tiny at {args.model_path}: the tiny model is skipped", flush=True)
        args.models = [m for m in args.models if m != "tiny"]
        if not args.models:
            parser.error("--models has nothing left to run")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.merge:
        return merge(args.merge, Path(args.output_dir))
    start = time.monotonic()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not args.smoke:
        print("no GPU: the full-size benchmark needs one (use --smoke for a CPU check)", file=sys.stderr)
        return 2
    scale = SMOKE if args.smoke else FULL
    out = Path(args.output_dir)
    meta = metadata(device, args)
    with_st = "st" in args.providers and meta["sentence_transformers"] is not None
    if "st" in args.providers and not with_st:
        print("sentence-transformers is not installed: its rows are skipped", flush=True)
    bench = Bench(args, device)
    if args.mini_batch_length_multiple is not None and args.compile != "off":
        # One program per static shape: (lengths per column) x (graph-less, graph-recording) passes.
        torch._dynamo.config.recompile_limit = 64
    meta["token_budget_parameter"] = bench.token_param
    print(f"{meta['device']}, torch {meta['torch']}, sentence-transformers {meta['sentence_transformers']}, "
          f"our token-budget option: {bench.token_param}", flush=True)  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(
        args.model_path if "tiny" in args.models and not args.smoke else default_tokenizer_path()
    )
    n_batches = args.steps + 2  # two warm-up steps at most
    triplets = scifact_triplets(read_scifact_pairs(), args.seed)[: args.effective_batch * n_batches]
    rows_by_name = {"scifact": triplets}
    if "short" in args.workloads:
        rows_by_name["short"] = short_triplets(triplets, tokenizer, scale.short_tokens, args.seed)
    workloads = [
        build_workload(name, rows_by_name[name], tokenizer, scale, args.effective_batch, n_batches, device)
        for name in args.workloads
    ]
    meta["workloads"] = {
        w.name: {"mean_query_tokens": w.mean_query_tokens, "mean_doc_tokens": w.mean_doc_tokens}
        for w in workloads
    }
    print(f"workloads: {json.dumps(meta['workloads'])} ({time.monotonic() - start:.0f} s)", flush=True)
    rows: list[dict] = []
    deadline = start + args.time_budget_s
    with tempfile.TemporaryDirectory(prefix="bench_real_workload_") as tmp:
        models = prepare_models(args, scale, tokenizer, workloads, Path(tmp), device)
        meta["models"] = {name: info for name, (_, info) in models.items()}
        for model_name, (path, _) in models.items():
            for workload in workloads:
                configs: list[Config] = []
                if {"ours", "st"} & set(args.providers):
                    configs = plan(model_name, workload, args.mini_batches, args.effective_batch,
                                   bench.token_param if "ours" in args.providers else None, with_st,
                                   reuse=SETTINGS[args.reuse_argmax], sparse_reps=SETTINGS[args.sparse_reps],
                                   token_budgets=args.token_budgets, checkpointing=SETTINGS[args.checkpointing],
                                   compiled=SETTINGS[args.compile], compile_mode=args.compile_mode,
                                   mini_batch_length_multiple=args.mini_batch_length_multiple,
                                   cuda_graphs=SETTINGS[args.cuda_graphs])  # fmt: skip
                    if "ours" not in args.providers:
                        configs = [c for c in configs if c.provider != "ours"]
                if "ours-uncached" in args.providers:
                    configs += [
                        Config(
                            model_name,
                            workload.name,
                            "ours-uncached",
                            batch=args.effective_batch,
                            compiled=k,
                            compile_mode=args.compile_mode if k else "default",
                        )
                        for k in SETTINGS[args.compile]
                    ]
                for config in configs:
                    if time.monotonic() > deadline:
                        rows.append({**header(config), "status": "skipped (time budget)"})
                        continue
                    if config.provider == "ours-uncached":
                        for smaller in uncached_configs(config):
                            row = bench.run(smaller, path, workload)
                            record(rows, row, out, meta, start)
                            if row["status"] != "OOM" or time.monotonic() > deadline:
                                break
                        continue
                    record(rows, bench.run(config, path, workload), out, meta, start)
    print(f"\n{meta['device']}, torch {meta['torch']}, {meta['dtype']}; {time.monotonic() - start:.0f} s\n")
    return finish(out, meta, rows)


if __name__ == "__main__":
    sys.exit(main())
