"""torch's CPU threads for a command, from the CPUs that other processes leave free.

torch runs each operation on all of its intra-op threads (one per core by default) and waits for the
slowest at an OpenMP barrier. Where another process keeps a core busy, the thread that shares that core
gets a fraction of it, and every operation waits for it: on a 2-core machine with one busy process, the
default run's steps take several times as long on 2 threads as on 1 (docs/training.md has the numbers).
The passive wait policy (``OMP_WAIT_POLICY=PASSIVE``) also helps, but OpenMP reads it once, when torch
loads, before any command runs.

So each command run as a program (``gradcache-sparton ...``, ``python -m gradcache_sparton.cli ...``; not
``main(argv)`` called from Python, whose threads are the caller's) starts by measuring, over a short window,
how busy the CPUs it may run on are (from ``/proc/stat``, less its own use), and runs torch on the cores
left free (at least one). ``OMP_NUM_THREADS``, when set, is the user's choice and is kept.
"""

from __future__ import annotations

import logging
import os
import time

__all__ = ["SAMPLE_SECONDS", "busy_cpus", "fit_threads_to_free_cpus"]

logger = logging.getLogger(__name__)

SAMPLE_SECONDS = 0.5
"""How long the CPUs are watched: long enough to average over the scheduler's time slices (a few ms)."""
_BUSY_SHARE = 0.5
"""A CPU counts as taken when other processes use at least this share of it (rounding of ``busy_cpus``)."""


def _cpu_ticks() -> tuple[int, int] | None:
    """(busy, total) clock ticks of all CPUs since boot, from ``/proc/stat``; None where it cannot be read."""
    try:
        with open("/proc/stat", encoding="ascii") as handle:
            fields = [int(value) for value in handle.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle and iowait
    total = sum(fields[:8])  # user nice system idle iowait irq softirq steal (guest is inside user)
    return total - idle, total


def busy_cpus(seconds: float = SAMPLE_SECONDS) -> float | None:
    """How many CPUs' worth of time other processes used over the next ``seconds`` (this process's own use
    subtracted); None where ``/proc/stat`` is not available (not Linux)."""
    start, own_start = _cpu_ticks(), os.times()
    if start is None:
        return None
    time.sleep(seconds)
    end, own_end = _cpu_ticks(), os.times()
    if end is None or end[1] <= start[1]:
        return None
    cpus = os.cpu_count() or 1
    ticks_per_cpu = (end[1] - start[1]) / cpus  # the window's ticks per CPU (USER_HZ)
    own = (own_end.user + own_end.system) - (own_start.user + own_start.system)  # seconds
    busy = (end[0] - start[0]) / ticks_per_cpu - own / seconds
    return max(0.0, busy)


def fit_threads_to_free_cpus() -> int | None:
    """Set torch's intra-op threads to the CPUs this process may use that others leave free (at least one,
    at most torch's default); the count set, or None where ``OMP_NUM_THREADS`` is set or the CPUs' use
    cannot be read (torch's default then stands)."""
    if os.environ.get("OMP_NUM_THREADS"):
        return None
    import torch

    busy = busy_cpus()
    if busy is None:
        return None
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    default = torch.get_num_threads()
    taken = int(busy + (1 - _BUSY_SHARE))  # a CPU at least half used by others counts as taken
    threads = max(1, min(default, usable - taken))
    if threads < default:
        logger.info(
            "Other processes keep %.1f of %d CPUs busy: torch runs on %d thread(s) instead of %d (an operation "
            "split over a busy core waits for it); OMP_NUM_THREADS sets the count instead.",
            busy,
            usable,
            threads,
            default,
        )
        torch.set_num_threads(threads)
    return threads
