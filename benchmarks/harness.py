"""The step-timing harness the training-step benchmarks share: timing, sync audit, profilers, OOM handling.

A step is any callable on one batch (``Step``); ``StepTimer`` times it between two device syncs and, on
request, runs one more step under ``torch.cuda.set_sync_debug_mode`` (host-device syncs by call site),
``torch.profiler`` (device-busy seconds) or cProfile (host time by function). Used by
``benchmarks/bench_real_workload.py`` (through ``benchmarks.real_workload``) and
``benchmarks/bench_sparse_cache.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "GiB",
    "Step",
    "StepTimer",
    "autocast",
    "free_memory",
    "int_list",
    "is_oom",
    "measured_row",
    "name_list",
]

GiB = 2**30
Step = Callable[[Any], None]


def autocast(device: torch.device) -> contextlib.AbstractContextManager[object]:
    """bf16 autocast on CUDA; fp32 (no autocast) on the CPU, where the smoke runs are."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()  # CPU (smoke): fp32


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def is_oom(exc: BaseException) -> bool:
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and ("out of memory" in text.lower() or "ALLOC_FAILED" in text)


def measured_row(
    row: dict[str, Any], measure: Callable[[], dict[str, Any]], device: torch.device
) -> dict[str, Any]:
    """``row`` updated with ``measure()``'s numbers and ``status`` "ok", or status "OOM" / "error: ..." (one
    broken configuration must not lose the others' rows); memory is freed either way."""
    status = "ok"
    try:
        row.update(measure())
    except Exception as exc:
        if is_oom(exc):
            status = "OOM"
        else:
            traceback.print_exc()
            status = f"error: {type(exc).__name__}: {exc}"[:300]
    # Outside the except block: the traceback (and the step's graph it references) is gone.
    free_memory(device)
    row["status"] = status
    return row


def int_list(text: str) -> list[int]:
    """argparse type: a comma list of positive integers."""
    values = [int(x) for x in text.split(",") if x.strip()]
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected a comma list of positive integers, got {text!r}")
    return values


def name_list(allowed: Sequence[str]) -> Callable[[str], list[str]]:
    """argparse type: a comma list of names out of ``allowed``."""

    def parse(text: str) -> list[str]:
        names = [x.strip() for x in text.split(",") if x.strip()]
        bad = [n for n in names if n not in allowed]
        if not names or bad:
            raise argparse.ArgumentTypeError(f"expected a comma list of {', '.join(allowed)}, got {text!r}")
        return names

    return parse


class StepTimer:
    """Times steps on ``device``; the profilers write their tables to ``output_dir``."""

    def __init__(self, device: torch.device, output_dir: Path, *, profile_host: bool = False) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.output_dir = Path(output_dir)
        self.profile_host = profile_host

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def timed(self, step: Step, batch: Any) -> float:
        """Seconds of one step, CUDA-synchronized wall time."""
        self.sync()
        start = time.perf_counter()
        step(batch)
        self.sync()
        return time.perf_counter() - start

    def sync_sites(self, step: Step, batch: Any) -> dict[str, int]:
        """Host-device synchronisations of one step, by call site (the innermost frames outside torch).

        One step runs under ``torch.cuda.set_sync_debug_mode("warn")``: every operation that waits for
        the device (``.item()``, ``.tolist()``, ``nonzero``, a copy to the host, ...) warns, and each
        warning is attributed to the innermost three Python frames outside torch that issued it; a
        sync with no such frame (e.g. from autograd's worker thread) is counted under an empty site.
        """
        import warnings

        sites: dict[str, int] = {}
        show = warnings.showwarning

        def record(message, category, filename, lineno, file=None, line=None) -> None:
            if "synchronizing" not in str(message):
                return show(message, category, filename, lineno, file, line)
            frames = [
                f for f in traceback.extract_stack()[:-1]
                if "/torch/" not in f.filename and Path(f.filename).name != "warnings.py"
            ]  # fmt: skip
            site = " <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(frames[-3:]))
            sites[site] = sites.get(site, 0) + 1

        self.sync()
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            torch.cuda.set_sync_debug_mode("warn")
            try:
                step(batch)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        self.sync()
        return dict(sorted(sites.items(), key=lambda kv: -kv[1]))

    def busy_seconds(self, step: Step, batch: Any, stem: str) -> float:
        """Device-busy seconds of one step: the sum of its kernels' durations under torch.profiler.

        Only the device's activity is recorded, unless ``profile_host``: then the host's operators
        too (a profiled 16-row step then outlasts a 4-minute call: ~200,000 events), and the step's
        operators by host time (self CPU, top 40) go to ``profile_<stem>.txt`` in the output folder.
        """
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CUDA]
        if self.profile_host:
            activities.append(ProfilerActivity.CPU)
        with profile(activities=activities) as prof:
            self.timed(step, batch)
        averages = prof.key_averages()
        if self.profile_host:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            table = averages.table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=60)
            (self.output_dir / f"profile_{stem}.txt").write_text(table)
        busy = sum(e.self_device_time_total for e in averages if e.device_type.name == "CUDA") / 1e6
        if busy <= 0:  # a step launches kernels: none recorded is a profiler failure, not an idle device
            raise RuntimeError("torch.profiler recorded no device kernels for the profiled step")
        return busy

    def python_profile(self, step: Step, batch: Any, stem: str) -> float:
        """Host seconds of one step under cProfile; its functions by own and by cumulative time (top 60
        each) go to ``cprofile_<stem>.txt`` in the output folder. Where the host bounds the step, this
        is where its time goes (cProfile's own cost inflates small Python functions)."""
        import cProfile
        import io
        import pstats

        profiler = cProfile.Profile()
        self.sync()
        start = time.perf_counter()
        profiler.enable()
        step(batch)
        profiler.disable()
        self.sync()
        seconds = time.perf_counter() - start
        text = io.StringIO()
        stats = pstats.Stats(profiler, stream=text)
        stats.sort_stats("tottime").print_stats(60)
        stats.sort_stats("cumulative").print_stats(60)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        (self.output_dir / f"cprofile_{stem}.txt").write_text(text.getvalue())
        return seconds
