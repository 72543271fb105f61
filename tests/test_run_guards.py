"""Run-level guards: one live run per output folder, a stopped run reported as stopped, batches and lengths
checked against the loss and the model before any step, full disks named."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gradcache_sparton.run_lock import LOCK_FILE_NAME, output_dir_lock


def _lock_record(pid: int, host: str | None = None) -> str:
    host = socket.gethostname() if host is None else host
    return json.dumps({"pid": pid, "host": host, "started": time.time(), "command": "train --fake"})


def test_output_dir_lock_refuses_a_second_live_run(tmp_path: Path) -> None:
    """A lock held by a live process (or one on another host) is refused, naming its pid and command."""
    lock = tmp_path / LOCK_FILE_NAME
    for record in (_lock_record(os.getppid()), _lock_record(1, host="elsewhere")):
        lock.write_text(record)
        with (
            pytest.raises(ValueError, match="in use by another training run") as raised,
            output_dir_lock(tmp_path),
        ):
            pass
        assert "train --fake" in str(raised.value) and str(lock) in str(raised.value)
        assert lock.read_text() == record  # the other run's lock is left alone


def test_output_dir_lock_takes_over_a_dead_runs_lock_and_removes_its_own(tmp_path: Path, caplog) -> None:
    """A lock of a dead pid on this host is taken over with a warning; the lock goes at exit, error or not."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    lock = tmp_path / "out" / LOCK_FILE_NAME
    lock.parent.mkdir()
    lock.write_text(_lock_record(dead.pid))
    with caplog.at_level(logging.WARNING, logger="gradcache_sparton.run_lock"), output_dir_lock(lock.parent):
        assert json.loads(lock.read_text())["pid"] == os.getpid()
        with output_dir_lock(lock.parent):  # re-entrant within the process
            pass
        assert lock.exists()
    assert "no longer alive" in caplog.text and not lock.exists()
    with pytest.raises(RuntimeError), output_dir_lock(lock.parent):
        raise RuntimeError("the run failed")
    assert not lock.exists()


def test_output_dir_naming_a_file_is_refused(tmp_path: Path) -> None:
    """An output_dir that is an existing file is one clear error (the lock never builds a folder over it)."""
    file = tmp_path / "a_file"
    file.write_text("x")
    with pytest.raises(ValueError, match="is an existing file"), output_dir_lock(file):
        pass
    assert file.read_text() == "x"
