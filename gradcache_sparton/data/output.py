"""Write training rows to a jsonl file atomically, never clobbering an existing file by accident."""

from __future__ import annotations

import gzip
import json
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

from gradcache_sparton.data.validation import validate_training_dataset

if TYPE_CHECKING:
    import datasets

__all__ = ["check_output_path", "write_training_file"]

_OUTPUT_SUFFIXES = (".jsonl", ".jsonl.gz")


def check_output_path(
    path: str | Path, *, overwrite: bool, suffixes: tuple[str, ...] = _OUTPUT_SUFFIXES
) -> Path:
    """Raise ``ValueError`` unless ``path`` ends in one of ``suffixes`` (default ``.jsonl`` /
    ``.jsonl.gz``, what :func:`write_training_file` writes), is not a directory, and does not exist (or
    ``overwrite``); cheap, so callers run it before any work. Returns the Path."""
    path = Path(path)
    if not path.name.lower().endswith(suffixes):
        raise ValueError(f"output file must end in one of {list(suffixes)}, got {str(path)!r}")
    if path.is_dir():
        raise ValueError(f"output file {str(path)!r} is a directory")
    if path.exists() and not overwrite:
        raise ValueError(
            f"output file {str(path)!r} exists: pass overwrite=True (CLI: --overwrite) to replace it"
        )
    return path


def _new_file_mode() -> int:
    """The mode ``open(path, "w")`` would give a new file: 0666 less the process umask."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def _write_rows(dataset: datasets.Dataset, stream: BinaryIO) -> None:
    for row in dataset.with_format(None):
        stream.write((json.dumps(row, ensure_ascii=False) + "\n").encode("utf-8"))


def write_training_file(dataset: datasets.Dataset, path: str | Path, *, overwrite: bool = False) -> Path:
    """Write training rows as jsonl (gzip'd for ``.jsonl.gz``), one object per row, columns in the
    dataset's order, atomically: a temporary file in the same folder is filled, flushed to disk and
    renamed over ``path``, so a reader never sees half a file and a failure leaves ``path`` as it was.

    The rows are checked first (``validate_training_dataset``: what ``train`` will read), and the path
    with :func:`check_output_path` (again just before the rename). The parent folder is created if
    needed. The gzip header carries no timestamp: equal rows give byte-equal files. Returns the path.
    """
    path = check_output_path(path, overwrite=overwrite)
    validate_training_dataset(dataset)
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    tmp = Path(tmp_name)
    try:
        with os.fdopen(descriptor, "wb") as raw:
            if path.suffix.lower() == ".gz":
                with gzip.GzipFile(filename="", fileobj=raw, mode="wb", mtime=0) as compressed:
                    _write_rows(dataset, compressed)
            else:
                _write_rows(dataset, raw)
            raw.flush()
            os.fsync(raw.fileno())
        tmp.chmod(_new_file_mode())  # mkstemp creates 0600; give the file the usual permissions
        check_output_path(path, overwrite=overwrite)  # nothing appeared there meanwhile
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path
