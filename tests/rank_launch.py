"""Several CPU ranks for the data-parallel tests: one bounded launcher and one rank entry, shared by them all.

``launch_ranks(argv, ...)`` starts ``python tests/rank_launch.py ARGV`` once per rank with the environment
``torchrun`` gives (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR/PORT) and this checkout first
on ``PYTHONPATH``, and waits with a deadline: a hang fails the test, it never blocks the suite. When a rank
fails, the others get FAILURE_GRACE_S to end on their own before they are killed, so that the report tells a
rank that crashed after its peers' work was done from one that left them blocked in a collective. The report
gives, for each rank, how it ended (its exit code or signal, or killed by the launcher at the deadline or
after another rank's failure) and when, which rank failed first, and the tail of each rank's stderr.

The rank entry (this file run as a script) runs ARGV, a script's path or ``-m module``, as ``python ARGV``
would, then leaves. When the work returned: every rank meets at a barrier (one rank destroying the group while
another still needs it hangs, pytorch#75097), destroys the process group, flushes its output and exits with
``os._exit(0)``. That skips the interpreter's finalization and the C++ static destructors, where gloo's
threads are torn down: they outlive ``destroy_process_group`` (torch 2.13: its worker and TCP loop threads
still run after it, with every model freed), and in one CI run in about 22 a rank of
tests/test_fsdp_resume_st.py aborted at exit after its work was done ("terminate called without an active
exception", what a C++ thread destructed while still joinable gives). When the work raised, the rank prints
the traceback and exits 1 at once (no barrier: its peers may be inside a collective); a non-zero
``SystemExit`` leaves with its code.

What the ranks run and save is each test's own (its scenarios live beside it); the launcher only starts,
bounds, ends and reports them. A test whose rank 0 alone reports one JSON object saves it with
``write_rank0_results(out_dir, results)`` and reads it back with ``rank0_results(script, out_dir, ...)``.
"""

from __future__ import annotations

import json
import logging
import os
import runpy
import signal
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, NoReturn

__all__ = ["FAILURE_GRACE_S", "ROOT", "launch_ranks", "rank0_results", "write_rank0_results"]

ROOT = Path(__file__).resolve().parents[1]
RESULTS_FILE = "results.json"  # what rank 0 writes with write_rank0_results
# After a rank fails, how long the others may take to end on their own: a peer past its last collective
# exits within a second (the rank entry's teardown), one blocked in a collective never does.
FAILURE_GRACE_S = 5.0
POLL_S = 0.05  # how often the launcher looks at the ranks: the resolution of the report's times
STDERR_TAIL_CHARS = 3000  # of each rank's stderr in the failure report


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class _Rank:
    """One launched rank: its process, its output files, how it ended and when (seconds from the start)."""

    rank: int
    process: subprocess.Popen
    stdout: IO[str]
    stderr: IO[str]
    ended_s: float | None = None
    killed_because: str | None = None  # set when the launcher killed it

    def ending(self) -> str:
        """How the rank ended, in words: its exit code or signal, and whether the launcher killed it."""
        if self.killed_because is not None:
            return f"rank {self.rank}: {self.killed_because}; killed by the launcher at {self.ended_s:.2f} s"
        code = self.process.returncode
        how = f"exit {code}" if code >= 0 else f"killed by {_signal_name(-code)}"
        return f"rank {self.rank}: {how} at {self.ended_s:.2f} s"


def _signal_name(number: int) -> str:
    return next((s.name for s in signal.Signals if s.value == number), f"signal {number}")


def launch_ranks(argv: Sequence[str], *, world_size: int, log_dir: Path, timeout_s: float) -> None:
    """Run ``python ARGV`` (a script's path or ``-m module``, then its arguments) through the rank entry on
    ``world_size`` gloo-ready ranks, each in ``log_dir`` with its output in ``log_dir/rank{r}.out`` and
    ``.err``; return when all exit 0 within ``timeout_s``, else raise AssertionError with the report (module
    docstring)."""
    port = _free_port()
    ranks = []
    started = time.monotonic()
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
        stdout = open(log_dir / f"rank{rank}.out", "w")  # noqa: SIM115 (closed below)
        stderr = open(log_dir / f"rank{rank}.err", "w")  # noqa: SIM115 (closed below)
        command = [sys.executable, __file__, *argv]
        process = subprocess.Popen(command, env=env, cwd=log_dir, stdout=stdout, stderr=stderr)
        ranks.append(_Rank(rank, process, stdout, stderr))
    deadline, past_deadline = started + timeout_s, f"timed out: still running at the {timeout_s:g} s deadline"
    first_failure = None
    try:
        while any(r.ended_s is None for r in ranks) and time.monotonic() <= deadline:
            now = time.monotonic() - started
            for r in ranks:
                if r.ended_s is None and r.process.poll() is not None:
                    r.ended_s = now
                    if r.process.returncode != 0 and first_failure is None:
                        first_failure = r
                        if started + now + FAILURE_GRACE_S < deadline:
                            deadline = started + now + FAILURE_GRACE_S
                            past_deadline = f"still running {FAILURE_GRACE_S:g} s after rank {r.rank} failed"
            time.sleep(POLL_S)
    finally:
        for r in ranks:
            if r.process.poll() is None:
                r.process.kill()
                r.killed_because = past_deadline
            r.process.wait()
            if r.ended_s is None:
                r.ended_s = time.monotonic() - started
            r.stdout.close()
            r.stderr.close()
    if all(r.process.returncode == 0 for r in ranks):
        return
    first = "none on its own (the deadline passed)" if first_failure is None else first_failure.ending()
    lines = [
        f"{world_size} ranks of `python {' '.join(map(str, argv))}` failed after "
        f"{time.monotonic() - started:.1f} s (deadline {timeout_s:g} s); output: {log_dir}/rank{{r}}.out, .err",
        f"first to fail: {first}",
        "each rank, in the order they ended:",
        *(f"  {r.ending()}" for r in sorted(ranks, key=lambda r: r.ended_s)),
    ]
    for r in ranks:
        tail = (log_dir / f"rank{r.rank}.err").read_text()[-STDERR_TAIL_CHARS:] or "(empty)"
        lines.append(f"--- rank {r.rank} stderr (last {STDERR_TAIL_CHARS} characters):\n{tail}")
    raise AssertionError("\n".join(lines))


def write_rank0_results(out_dir: Path, results: dict) -> None:
    """Rank 0 writes ``results`` to ``out_dir/results.json`` for ``rank0_results``; the other ranks, nothing."""
    import torch.distributed as dist

    if dist.get_rank() == 0:
        (out_dir / RESULTS_FILE).write_text(json.dumps(results))


def rank0_results(script: str, out_dir: Path, *, world_size: int, timeout_s: float) -> dict:
    """Run ``python script out_dir`` on ``world_size`` ranks (``launch_ranks``, bounded by ``timeout_s``) and
    return what its rank 0 wrote with ``write_rank0_results``."""
    launch_ranks([script, str(out_dir)], world_size=world_size, log_dir=out_dir, timeout_s=timeout_s)
    return json.loads((out_dir / RESULTS_FILE).read_text())


def _exit(code: int) -> NoReturn:
    """Flush what the rank wrote, then end the process now: no atexit handler, no finalization."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _run_rank(argv: list[str]) -> NoReturn:
    """The rank entry: run ``argv`` as ``python argv`` would, then leave (module docstring)."""
    began = time.monotonic()
    prefix = f"rank_launch: rank {os.environ['RANK']}:"
    try:
        if argv[0] == "-m":
            sys.argv, sys.path[0] = argv[1:], os.getcwd()
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv, sys.path[0] = argv, str(Path(argv[0]).resolve().parent)
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as stop:  # sys.exit(main()), argparse's errors: Python's own meaning of the code
        if stop.code not in (None, 0):
            if not isinstance(stop.code, int):
                print(stop.code, file=sys.stderr)
            _exit(stop.code if isinstance(stop.code, int) else 1)
    except BaseException:
        traceback.print_exc()
        print(f"{prefix} the work raised after {time.monotonic() - began:.2f} s: exit 1", file=sys.stderr)
        _exit(1)
    dist = sys.modules.get("torch.distributed")  # imported by the work if it made a process group
    if dist is not None and dist.is_initialized():
        print(f"{prefix} work done in {time.monotonic() - began:.2f} s; barrier", file=sys.stderr, flush=True)
        try:
            dist.barrier()
            dist.destroy_process_group()
        except BaseException:
            traceback.print_exc()
            print(f"{prefix} leaving the process group raised: exit 1", file=sys.stderr)
            _exit(1)
        print(f"{prefix} process group destroyed; exit 0", file=sys.stderr)
    _exit(0)


if __name__ == "__main__":
    _run_rank(sys.argv[1:])
