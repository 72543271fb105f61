"""A training run as the file system and the shell see it: one live run per output folder, and a run
stopped before its last step reported as such.

Two runs started into one ``output_dir`` would overwrite each other's checkpoints and final model while
both report success. :func:`output_dir_lock` creates ``output_dir/.run.lock`` with ``O_CREAT | O_EXCL``
(atomic on local file systems and NFSv3+) holding the owner's pid, host, start time and command line, and
removes it when the run ends, however it ends short of the process being killed. A second run finds the
file and stops with one error naming the first. A lock left by a killed run (its pid no longer alive on
this host) is taken over with a warning; one from another host cannot be checked and is refused, with the
file to delete named. The lock is re-entrant within a process: ``run_training`` holds it for the whole
job and ``CachedSpladeTrainer.train`` takes it only when its caller has not.

A run stopped before ``max_steps`` (SIGTERM with ``enable_jit_checkpoint``: the Trainer saves a
checkpoint and returns as if done) raises :class:`TrainingStopped` from ``run_training``: no final model
or metrics are written, and the message says how to resume. This module imports no torch, so the command
line can name the exception without loading the heavy packages.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import shutil
import socket
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

__all__ = [
    "INCOMPLETE_SUFFIX",
    "LOCK_FILE_NAME",
    "TRAIN_DATA_FILE",
    "CheckpointWriteError",
    "TrainDataRecord",
    "TrainingStopped",
    "checkpoint_write_error",
    "output_dir_lock",
    "prepare_output_dir",
]

logger = logging.getLogger(__name__)

#: The lock file's name inside ``output_dir`` (hidden; not a run file, so it never marks the folder as used).
LOCK_FILE_NAME = ".run.lock"

# Lock files this process holds (resolved path -> times taken), for re-entry.
_HELD: dict[Path, int] = {}


def prepare_output_dir(output_dir: str | os.PathLike) -> Path:
    """Create ``output_dir`` (and its parents); ``ValueError`` naming it if it is a file or cannot be created."""
    path = Path(output_dir)
    if path.exists() and not path.is_dir():
        raise ValueError(f"output_dir {str(path)!r} is an existing file, not a folder: give a folder path")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"output_dir {str(path)!r} cannot be created ({exc.strerror or exc})") from None
    if not os.access(path, os.W_OK):
        raise ValueError(f"output_dir {str(path)!r} is not writable")
    return path


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def _read_owner(lock: Path) -> dict[str, Any] | None:
    """The owner record of a lock file; None if it vanished; {} if unreadable (being written, or corrupt)."""
    try:
        text = lock.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    try:
        owner = json.loads(text)
    except json.JSONDecodeError:
        return {}
    return owner if isinstance(owner, dict) else {}


def _describe(owner: dict[str, Any]) -> str:
    if not owner:
        return "an unknown run (its lock file is empty or unreadable)"
    started = owner.get("started")
    when = (
        time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started))
        if isinstance(started, (int, float))
        else "?"
    )
    return (
        f"pid {owner.get('pid')} on host {owner.get('host')!r}, started {when}: {owner.get('command', '?')}"
    )


def _is_stale(owner: dict[str, Any]) -> bool:
    """True when the owner ran on this host and its pid is gone (a killed run)."""
    pid = owner.get("pid")
    return owner.get("host") == socket.gethostname() and isinstance(pid, int) and not _pid_alive(pid)


def _create(lock: Path) -> bool:
    """Create the lock file holding this process's record; False if it already exists."""
    try:
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    record = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": time.time(),
        "command": " ".join(sys.argv) or sys.executable,
    }
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        json.dump(record, handle)
    return True


def _acquire(lock: Path) -> None:
    if _create(lock):
        return
    owner = _read_owner(lock)
    if owner is not None and _is_stale(owner):
        logger.warning(
            "output_dir %s: taking over the lock of a run that is no longer alive (%s); its checkpoints stay, "
            "resume them with --resume_from_checkpoint",
            lock.parent,
            _describe(owner),
        )
        # Renamed away, then checked, rather than deleted: of two runs taking over at once, the later one
        # finds the earlier one's fresh lock in its hands, puts it back and stops.
        moved = lock.with_name(f"{LOCK_FILE_NAME}.stale-{os.getpid()}")
        try:
            os.rename(lock, moved)
        except FileNotFoundError:
            pass
        else:
            taken = _read_owner(moved)
            if taken == owner:
                moved.unlink(missing_ok=True)
            else:
                os.rename(moved, lock)
        if _create(lock):
            return
        owner = _read_owner(lock)
    raise ValueError(
        f"output_dir {str(lock.parent)!r} is in use by another training run ({_describe(owner or {})}): two runs "
        "in one folder overwrite each other's checkpoints. Wait for it to finish or choose another output_dir; "
        f"if that run is gone (e.g. on another machine), delete {str(lock)!r}"
    )


@contextmanager
def output_dir_lock(output_dir: str | os.PathLike) -> Iterator[Path]:
    """Hold ``output_dir``'s lock for the block (created with the folder if needed, and the folder removed
    again if the block wrote nothing in it); yields the folder.

    ``ValueError`` naming the other run if one holds it, or naming ``output_dir`` if it is a file.
    """
    created = not Path(output_dir).exists()
    folder = prepare_output_dir(output_dir)
    lock = (folder / LOCK_FILE_NAME).resolve()
    if lock not in _HELD:
        _acquire(lock)
    _HELD[lock] = _HELD.get(lock, 0) + 1
    try:
        yield folder
    finally:
        _HELD[lock] -= 1
        if not _HELD[lock]:
            del _HELD[lock]
            lock.unlink(missing_ok=True)
            if created and not any(folder.iterdir()):  # a run refused before writing leaves nothing behind
                folder.rmdir()


class TrainingStopped(RuntimeError):
    """A training run ended before its last step (a SIGTERM under ``enable_jit_checkpoint``, a callback's
    stop): what it saved is a checkpoint to resume from, not a final model.

    Attributes: ``step`` and ``max_steps`` (optimizer steps), ``checkpoint`` (the latest checkpoint folder,
    or None if none was saved).
    """

    def __init__(self, *, step: int, max_steps: int, checkpoint: str | None) -> None:
        self.step, self.max_steps, self.checkpoint = step, max_steps, checkpoint
        if checkpoint is None:
            how = "no checkpoint was saved: start the run again"
        else:
            how = f"resume it with the same command plus --resume_from_checkpoint {checkpoint}"
        super().__init__(
            f"training stopped at step {step} of {max_steps} (a stop signal or a callback): no final model or "
            f"metrics were written; {how}"
        )


#: Appended to a checkpoint folder whose writing failed, so that nothing (``get_last_checkpoint``, a resume)
#: takes it for a complete checkpoint; the ``checkpoint-*`` name still marks the output_dir as used.
INCOMPLETE_SUFFIX = ".incomplete"
# Free bytes below which a failed write is put down to a full disk: torch.save's writer reports a short
# write as "enforce fail at inline_container.cc" without the errno, and the partial file has by then taken
# what space there was.
_FULL_DISK_BYTES = 64 << 20


class CheckpointWriteError(OSError):
    """Writing a checkpoint or the final model failed (``errno`` ENOSPC when the disk is full); the message
    names the file being written and where the partial folder went."""


def checkpoint_write_error(
    folder: str | os.PathLike, exc: BaseException, *, mark_incomplete: bool
) -> CheckpointWriteError:
    """The error to raise for ``exc`` from writing into ``folder``: names the file being written (the newest
    in the folder) and says "no space left" when the disk is full (errno ENOSPC, or almost no space free).
    With ``mark_incomplete`` the folder is renamed with :data:`INCOMPLETE_SUFFIX`."""
    folder = Path(folder)
    files = [path for path in folder.rglob("*") if path.is_file()] if folder.is_dir() else []
    newest = max(files, key=lambda path: path.stat().st_mtime_ns, default=None)
    existing = next((parent for parent in (folder, *folder.parents) if parent.exists()), Path("."))
    free = shutil.disk_usage(existing).free
    full = getattr(exc, "errno", None) == errno.ENOSPC or free < _FULL_DISK_BYTES
    target = newest if newest is not None else folder
    cause = f"no space left on the device ({free / 2**20:.1f} MiB free)" if full else str(exc).strip()
    moved = ""
    if mark_incomplete and folder.is_dir():
        incomplete = folder.with_name(folder.name + INCOMPLETE_SUFFIX)
        try:
            os.rename(folder, incomplete)
            moved = f"; the partial checkpoint was renamed {incomplete} (not resumable; delete it)"
        except OSError:
            moved = f"; the partial checkpoint {folder} is incomplete (delete it)"
    return CheckpointWriteError(
        errno.ENOSPC if full else getattr(exc, "errno", None) or errno.EIO,
        f"writing {target} failed: {cause}{moved}. Free space (or choose an output_dir with room) and resume "
        "from the last complete checkpoint",
    )


#: The record of the training data a run's checkpoint (or final model) was trained on, in its folder.
TRAIN_DATA_FILE = "train_data.json"
# Rows hashed at once: a fixed size, so that the same rows always give the same digest.
_HASH_BATCH_ROWS = 1024


def _column_batches(dataset: Any) -> Iterator[dict[str, list[Any]]]:
    """The rows of ``dataset`` as column batches of :data:`_HASH_BATCH_ROWS` rows (a ``datasets.Dataset``
    through its own batched reader, any other sized dataset row by row)."""
    if hasattr(dataset, "iter") and hasattr(dataset, "column_names"):
        yield from dataset.iter(batch_size=_HASH_BATCH_ROWS)
        return
    for start in range(0, len(dataset), _HASH_BATCH_ROWS):
        rows = [dataset[i] for i in range(start, min(start + _HASH_BATCH_ROWS, len(dataset)))]
        yield {key: [row[key] for row in rows] for key in rows[0]}


def _train_data_identity(dataset: Any) -> dict[str, Any] | None:
    """The rows' count, columns and sha256 (each batch of rows as sorted-key JSON, in order) of a training
    set; None for one without a length (a stream), which cannot be compared."""
    if dataset is None or not hasattr(dataset, "__len__") or not hasattr(dataset, "__getitem__"):
        return None
    digest, columns = hashlib.sha256(), None
    for batch in _column_batches(dataset):
        columns = columns or sorted(batch)
        digest.update(json.dumps(batch, sort_keys=True, default=str).encode("utf-8"))
    return {"rows": len(dataset), "columns": columns or [], "sha256": digest.hexdigest()}


def _describe_data(identity: dict[str, Any]) -> str:
    return f"{identity['rows']} rows of columns {identity['columns']}, sha256 {identity['sha256'][:12]}"


def _is_identity(value: Any) -> bool:
    """Whether ``value`` is a training data identity as :func:`_train_data_identity` writes it."""
    return (
        isinstance(value, dict)
        and isinstance(value.get("rows"), int)
        and isinstance(value.get("columns"), list)
        and isinstance(value.get("sha256"), str)
    )


def _read_train_data_record(path: Path) -> dict[str, Any]:
    """A checkpoint's ``train_data.json`` as :meth:`TrainDataRecord.write` writes it; ``ValueError`` naming
    the file if it is not valid JSON or not that record (e.g. edited by hand)."""
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} line {exc.lineno}: not valid JSON ({exc.msg})") from None
    switches = record.get("switches", []) if isinstance(record, dict) else None
    if (
        not isinstance(record, dict)
        or not (record.get("train_data") is None or _is_identity(record["train_data"]))
        or not isinstance(switches, list)
        or not all(
            isinstance(s, dict) and _is_identity(s.get("before")) and _is_identity(s.get("after"))
            for s in switches
        )
    ):
        raise ValueError(
            f"{path} is not a training data record: it must hold an object with train_data (rows, columns, "
            "sha256) and switches (a list of before/after records), as training writes it; restore the "
            "checkpoint's file or remove it (then this run's data cannot be checked against the checkpoint's)"
        )
    return record


class TrainDataRecord:
    """What ``train_data.json`` says of a run's training data: its identity now and any switch a resume made
    (see the module docstring). The identity is computed once, when first needed."""

    def __init__(self, dataset: Any) -> None:
        self._dataset = dataset
        self._identity: dict[str, Any] | None = None
        self._switches: list[dict[str, Any]] = []

    def identity(self) -> dict[str, Any] | None:
        if self._identity is None:
            self._identity = _train_data_identity(self._dataset)
        return self._identity

    def resume(self, checkpoint: str | os.PathLike, *, allow_changed: bool) -> None:
        """Compare the data with ``checkpoint``'s record: ``ValueError`` if they differ, unless
        ``allow_changed``, which logs the switch and keeps it (with the checkpoint's earlier switches)."""
        path = Path(checkpoint) / TRAIN_DATA_FILE
        if not path.is_file():
            logger.warning(
                "resume_from_checkpoint %s records no training data (no %s): whether this run's data are the "
                "checkpoint's cannot be checked",
                checkpoint,
                TRAIN_DATA_FILE,
            )
            return
        earlier = _read_train_data_record(path)
        self._switches = list(earlier.get("switches", []))
        before, now = earlier.get("train_data"), self.identity()
        if before is None or now is None or before == now:
            return
        step = _checkpoint_step(Path(checkpoint))
        if not allow_changed:
            raise ValueError(
                f"resume_from_checkpoint {str(checkpoint)!r} was trained on other data ({_describe_data(before)}) "
                f"than this run's training data ({_describe_data(now)}): resume with the checkpoint's training "
                "data, or pass allow_changed_train_data to continue on these (the switch is recorded in "
                f"{TRAIN_DATA_FILE})"
            )
        logger.warning(
            "resume_from_checkpoint %s: the training data change at step %s (%s before, %s from now on); "
            "allow_changed_train_data is set, the switch is recorded in %s",
            checkpoint,
            step,
            _describe_data(before),
            _describe_data(now),
            TRAIN_DATA_FILE,
        )
        self._switches.append({"step": step, "before": before, "after": now})

    def write(self, folder: str | os.PathLike) -> None:
        """Write ``folder/train_data.json`` (nothing for data that cannot be identified)."""
        identity = self.identity()
        if identity is None:
            return
        record = {"train_data": identity, "switches": self._switches}
        (Path(folder) / TRAIN_DATA_FILE).write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")


def _checkpoint_step(checkpoint: Path) -> int | None:
    try:
        state = json.loads((checkpoint / "trainer_state.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None
    return state.get("global_step") if isinstance(state, dict) else None
