"""Several CPU ranks for the data-parallel tests: one bounded launcher, shared by every such test.

``launch_ranks`` starts ``python ARGV ...`` once per rank with the environment ``torchrun`` gives
(RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR/PORT) and this checkout first on
``PYTHONPATH``, waits with a deadline, and kills every rank if one fails or the deadline passes: a hang
fails the test, it never blocks the suite. What the ranks run and save is each test's own (its scenarios
live beside it); the launcher only starts, bounds and reports them.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

__all__ = ["ROOT", "launch_ranks"]

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch_ranks(argv: Sequence[str], *, world_size: int, log_dir: Path, timeout_s: float) -> None:
    """Run ``python *argv`` on ``world_size`` gloo-ready ranks, each in ``log_dir`` with its output in
    ``log_dir/rank{r}.log``; return when all exit 0, else raise AssertionError with the ranks' log tails
    within ``timeout_s``."""
    port = _free_port()
    processes = []
    for rank in range(world_size):
        env = {
            **os.environ,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size),
            "GLOO_SOCKET_IFNAME": "lo",
            "OMP_NUM_THREADS": "1",
            "TOKENIZERS_PARALLELISM": "false",
            # The ranks import the package of this checkout (e.g. a git worktree), not the installed one.
            "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
        }
        log = open(log_dir / f"rank{rank}.log", "w")  # noqa: SIM115 (closed below)
        command = [sys.executable, *argv]
        process = subprocess.Popen(command, env=env, cwd=log_dir, stdout=log, stderr=subprocess.STDOUT)
        processes.append((process, log))
    deadline = time.monotonic() + timeout_s
    try:
        while any(p.poll() is None for p, _ in processes):
            if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p, _ in processes):
                break
            time.sleep(0.2)
    finally:
        for process, log in processes:
            if process.poll() is None:
                process.kill()
            process.wait()
            log.close()
    failed = [rank for rank, (p, _) in enumerate(processes) if p.returncode != 0]
    if failed:
        logs = "\n".join(
            f"--- rank {rank} (exit {processes[rank][0].returncode}):\n"
            + (log_dir / f"rank{rank}.log").read_text()[-3000:]
            for rank in range(world_size)
        )
        raise AssertionError(f"ranks {failed} failed or ran past {timeout_s} s:\n{logs}")
