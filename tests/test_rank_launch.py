"""The multi-rank tests' launcher and rank entry (``rank_launch``): a rank whose work is done exits 0 whatever
the interpreter's teardown would do, and a failure is reported rank by rank.

This file is also the ranks' script: ``python tests/test_rank_launch.py SCENARIO OUT_DIR``, one scenario per
test. In CI a rank of tests/test_fsdp_resume_st.py once aborted at interpreter exit after its work was done
("terminate called without an active exception", likely a gloo thread torn down then), and the failure read
like a timeout; the ``gloo`` scenario stands an atexit ``os.abort()`` in for that teardown (atexit handlers and
C++ static destructors both run only at a normal process exit, which the entry's ``os._exit`` skips).
"""

from __future__ import annotations

import atexit
import os
import sys
import time
from pathlib import Path

import pytest
from rank_launch import FAILURE_GRACE_S, launch_ranks


def _scenario(name: str, out_dir: Path) -> None:
    """What rank ``RANK`` runs in scenario ``name``."""
    rank = int(os.environ["RANK"])
    if name == "gloo":  # work through a gloo group, then a teardown that would abort
        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo")
        total = torch.ones(1)
        dist.all_reduce(total)
        (out_dir / f"sum{rank}.txt").write_text(str(int(total)))
        print(f"rank {rank} summed {int(total)}")  # not flushed here: the entry flushes
        atexit.register(os.abort)
    elif name == "abort" and rank == 1:
        print("rank 1 aborts now", file=sys.stderr, flush=True)
        os.abort()
    elif name == "raise":  # rank 1 fails, rank 0 waits for it as in a collective
        if rank == 1:
            raise ValueError("rank 1's rows are bad")
        time.sleep(600)
    elif name == "hang" and rank == 0:
        time.sleep(600)


def test_rank_entry_exits_zero_once_the_work_is_done_whatever_teardown_does(tmp_path) -> None:
    """Two gloo ranks whose process would abort at interpreter exit exit 0: the entry passes a barrier,
    destroys the process group, flushes the rank's output and leaves with os._exit(0)."""
    launch_ranks([__file__, "gloo", str(tmp_path)], world_size=2, log_dir=tmp_path, timeout_s=120)
    for rank in range(2):
        assert (tmp_path / f"sum{rank}.txt").read_text() == "2"
        assert (tmp_path / f"rank{rank}.out").read_text() == f"rank {rank} summed 2\n"
        assert "process group destroyed; exit 0" in (tmp_path / f"rank{rank}.err").read_text()


def test_a_crashed_rank_is_reported_first_beside_a_peer_that_finished(tmp_path) -> None:
    """Rank 1 killed by SIGABRT while rank 0 exits 0 on its own within the grace: the report names SIGABRT,
    rank 1 as the first to fail, rank 0's exit 0, and rank 1's stderr."""
    with pytest.raises(AssertionError) as failure:
        launch_ranks([__file__, "abort", str(tmp_path)], world_size=2, log_dir=tmp_path, timeout_s=60)
    report = str(failure.value)
    assert "first to fail: rank 1: killed by SIGABRT at " in report, report
    assert "  rank 0: exit 0 at " in report and "rank 1 aborts now" in report, report


def test_a_failing_rank_exits_1_with_its_traceback_and_its_blocked_peer_is_killed_after_the_grace(
    tmp_path,
) -> None:
    """Rank 1's work raising exits 1 with its traceback in the report; rank 0, blocked, is killed
    FAILURE_GRACE_S after that (not at the deadline), and the report says so."""
    began = time.monotonic()
    with pytest.raises(AssertionError) as failure:
        launch_ranks([__file__, "raise", str(tmp_path)], world_size=2, log_dir=tmp_path, timeout_s=120)
    assert time.monotonic() - began < 60  # the grace, not the deadline
    report = str(failure.value)
    assert "first to fail: rank 1: exit 1 at " in report, report
    assert "ValueError: rank 1's rows are bad" in report, report
    assert (
        f"rank 0: still running {FAILURE_GRACE_S:g} s after rank 1 failed; killed by the launcher" in report
    )


def test_a_hung_rank_is_reported_as_timed_out(tmp_path) -> None:
    """A rank still running at the deadline is killed and reported as timed out, beside its peer's exit 0;
    no rank failed on its own."""
    with pytest.raises(AssertionError) as failure:
        launch_ranks([__file__, "hang", str(tmp_path)], world_size=2, log_dir=tmp_path, timeout_s=8)
    report = str(failure.value)
    assert "first to fail: none on its own (the deadline passed)" in report, report
    assert "rank 0: timed out: still running at the 8 s deadline; killed by the launcher at " in report, (
        report
    )
    assert "  rank 1: exit 0 at " in report, report


if __name__ == "__main__":
    _scenario(sys.argv[1], Path(sys.argv[2]))
