"""Measuring one configuration: a fresh model and optimizer, warm-up, timed steps, peak memory and, on
request, one more step under each profiler (``benchmarks/harness.py``)."""

from __future__ import annotations

import argparse
import math
import statistics
from pathlib import Path
from typing import Any

import torch

from benchmarks.harness import GiB, StepTimer, measured_row
from benchmarks.real_workload.configs import Config, file_stem, header
from benchmarks.real_workload.models import nonzeros_per_row
from benchmarks.real_workload.steps import make_ours, make_sentence_transformers, token_budget_parameter
from benchmarks.real_workload.workloads import Workload, take_rows
from gradcache_sparton import SpladeEncoder

__all__ = ["Bench"]

NNZ_ROWS = 64  # rows whose reps' non-zeros a row reports (eval mode, fp32)


class Bench:
    """Runs configurations; each builds its model from a directory, times its steps and frees it."""

    def __init__(self, args: argparse.Namespace, device: torch.device) -> None:
        self.args = args
        self.device = device
        self.cuda = device.type == "cuda"
        self.token_param = token_budget_parameter()
        self.timer = StepTimer(device, Path(args.output_dir), profile_host=args.profile_host)

    def measure(self, config: Config, path: Path, workload: Workload) -> dict[str, Any]:
        """Warm-up, timed steps and the row's numbers (raises on out-of-memory)."""
        if config.provider == "st":
            step, model = make_sentence_transformers(config, path, self.device)
        else:
            step, model = make_ours(config, path, self.device, self.token_param)
        batches = [take_rows(b, config.batch) for b in workload.batches]
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        last = first = self.timer.timed(step, batches[0])
        warmup = 1
        # A compiled backbone compiles in the first step and may recompile in the second (other shapes);
        # CUDA graphs record the shapes met in the first two steps: with one warm-up step (the first
        # graphed configuration of a process, whose first step compiles Triton's kernels, took > 2 s)
        # the timed step recorded graphs too: 319 pairs/s at 16 rows against 691 with two (H200).
        second = first < 2.0 or config.compiled or config.cuda_graphs
        if second and len(batches) > 2 and not self.args.smoke:
            last = self.timer.timed(step, batches[1])
            warmup = 2
        n_timed = max(
            1, min(self.args.steps, len(batches) - warmup, math.floor(self.args.seconds_per_config / last))
        )
        times = [self.timer.timed(step, batches[warmup + i]) for i in range(n_timed)]
        median = statistics.median(times)
        row: dict[str, Any] = {
            "step_s_median": median,
            "step_s": times,
            "pairs_per_s": config.batch / median,
            "warmup_steps": warmup,
            "warmup_s": first,
            "timed_steps": n_timed,
        }
        if self.cuda:
            row["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / GiB
            row["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / GiB
            if self.args.busy_fraction:
                row["busy_fraction"] = self.timer.busy_seconds(step, batches[0], file_stem(config)) / median
            if self.args.cprofile:
                row["cprofile_step_s"] = self.timer.python_profile(step, batches[0], file_stem(config))
            if self.args.sync_audit:
                sites = self.timer.sync_sites(step, batches[0])
                row["syncs_per_step"] = sum(sites.values())
                row["sync_sites"] = sites
        if isinstance(model, SpladeEncoder):
            row["nnz_per_row"] = nonzeros_per_row(model, take_rows(batches[0], NNZ_ROWS))  # after training
        return row

    def run(self, config: Config, path: Path, workload: Workload) -> dict[str, Any]:
        """One row: the measurements, or status "OOM" / "error: ..."; memory is freed either way."""
        return measured_row(header(config), lambda: self.measure(config, path, workload), self.device)
