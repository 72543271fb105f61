"""Several CPU ranks for the data-parallel tests: one bounded launcher, shared by every such test.

``launch_ranks`` starts ``python ARGV ...`` once per rank with the environment ``torchrun`` gives
(RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR/PORT) and this checkout first on
``PYTHONPATH``, waits with a deadline, and kills every rank if one fails or the deadline passes: a hang
fails the test, it never blocks the suite. What the ranks run and save is each test's own (its scenarios
live beside it); the launcher only starts, bounds and reports them.

A test whose rank 0 alone reports one JSON object ends its worker with ``finish_rank(out_dir, results)`` and
reads the object back with ``rank0_results(script, out_dir, ...)``.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

__all__ = ["ROOT", "finish_rank", "launch_ranks", "rank0_results"]

ROOT = Path(__file__).resolve().parents[1]
RESULTS_FILE = "results.json"  # what rank 0 writes with finish_rank


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


def finish_rank(out_dir: Path, results: dict) -> None:
    """End a rank's worker: rank 0 writes ``results`` to ``out_dir/results.json``, then every rank waits for
    the others and leaves the process group (the barrier first: one rank destroying the group while another
    still needs it hangs, pytorch#75097)."""
    import torch.distributed as dist

    if dist.get_rank() == 0:
        (out_dir / RESULTS_FILE).write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


def rank0_results(script: str, out_dir: Path, *, world_size: int, timeout_s: float) -> dict:
    """Run ``python script out_dir`` on ``world_size`` ranks (``launch_ranks``, bounded by ``timeout_s``) and
    return what its rank 0 wrote with ``finish_rank``."""
    launch_ranks([script, str(out_dir)], world_size=world_size, log_dir=out_dir, timeout_s=timeout_s)
    return json.loads((out_dir / RESULTS_FILE).read_text())
