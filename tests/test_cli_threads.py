"""The CLI's torch thread count on a shared machine (gradcache_sparton/cli/threads.py)."""

from __future__ import annotations

import os

import pytest
import torch

from gradcache_sparton.cli import threads


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize(("busy", "expected"), [(0.0, 4), (0.4, 4), (1.0, 3), (1.6, 2), (3.9, 1), (8.0, 1)])
def test_threads_on_the_cpus_others_leave_free(monkeypatch, restore_threads, busy, expected) -> None:
    """torch runs on the CPUs that other processes leave free (one at least half used counts as taken), at
    least one and never more than its default."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads, "busy_cpus", lambda seconds=threads.SAMPLE_SECONDS: busy)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(4)))
    torch.set_num_threads(4)
    assert threads.fit_threads_to_free_cpus() == expected
    assert torch.get_num_threads() == expected


def test_omp_num_threads_is_the_users_choice(monkeypatch, restore_threads) -> None:
    """With OMP_NUM_THREADS set, nothing is measured and torch's thread count is left as it is."""
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    monkeypatch.setattr(threads, "busy_cpus", lambda seconds=threads.SAMPLE_SECONDS: pytest.fail("measured"))
    torch.set_num_threads(3)
    assert threads.fit_threads_to_free_cpus() is None and torch.get_num_threads() == 3


def test_busy_cpus_reads_the_machine() -> None:
    """On Linux the CPUs' use over a short window is a number of CPUs' worth, from 0 to the CPU count."""
    busy = threads.busy_cpus(0.05)
    assert busy is None or 0.0 <= busy <= (os.cpu_count() or 1) + 0.5


def test_only_the_command_as_a_program_fits_the_threads(monkeypatch, capsys) -> None:
    """The console command fits torch's threads; main(argv) called from Python leaves the caller's alone."""
    from gradcache_sparton.cli import app

    calls = []
    monkeypatch.setattr(app, "fit_threads_to_free_cpus", lambda: calls.append(1))
    assert app.main(["train", "--no_such_flag"]) == 2
    assert calls == []
    monkeypatch.setattr("sys.argv", ["gradcache-sparton", "train", "--no_such_flag"])
    assert app.main() == 2
    assert calls == [1]
