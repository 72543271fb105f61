"""Loading training rows from files (jsonl/json/csv/parquet, optionally compressed) or a Dataset."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from gradcache_sparton.data.files import COMPRESSIONS, READ_ERRORS, format_suffix, open_text
from gradcache_sparton.data.validation import RowError, check_dataset_type, validate_training_dataset

if TYPE_CHECKING:
    import datasets

__all__ = ["load_training_data"]

_LOAD_BUILDERS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}


def _builder_for(path: Path) -> str:
    suffix = format_suffix(path)
    if suffix not in _LOAD_BUILDERS:
        raise ValueError(
            f"cannot tell the format of {str(path)!r}: expected one of {sorted(_LOAD_BUILDERS)} "
            f"(optionally compressed: {list(COMPRESSIONS)})"
        )
    return _LOAD_BUILDERS[suffix]


def _is_blank(path: Path) -> bool:
    """True when a text file holds only whitespace (datasets would fail on it with a bare StopIteration)."""
    with open_text(path) as handle:
        while chunk := handle.read(1 << 16):
            if chunk.strip():
                return False
    return True


def _json_fault(path: Path) -> str | None:
    """Where a JSON (lines) file is malformed, as an error message with its line; None if it is not."""
    with open_text(path) as handle:
        text = handle.read()
    try:
        json.loads(text)
        return None  # one JSON document
    except json.JSONDecodeError as whole:
        for line_number, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                json.loads(line)
            except json.JSONDecodeError as exc:
                # Not JSON lines either: report the document's error if its first line is already wrong.
                if line_number == whole.lineno or line_number > 1:
                    return f"{path}:{line_number}: not valid JSON ({exc.msg})"
                return f"{path}:{whole.lineno}: not valid JSON ({whole.msg})"
    return None


def _load_files(paths: list[Path], cache_dir: str | Path | None) -> datasets.Dataset:
    import datasets

    for path in paths:
        if path.is_dir():
            raise ValueError(
                f"training data path {str(path)!r} is a directory: give its files (e.g. {path}/*.jsonl)"
            )
        if not path.is_file():
            raise ValueError(f"training data file {str(path)!r} does not exist")
    builders = {_builder_for(path) for path in paths}
    if len(builders) != 1:
        raise ValueError(f"all training files must have one format, got {sorted(builders)}")
    builder = builders.pop()
    if builder != "parquet":
        for path in paths:
            if _is_blank(path):
                raise ValueError(f"training data file {str(path)!r} is empty: it holds no rows")
    try:
        return datasets.load_dataset(
            builder,
            data_files=[str(path) for path in paths],
            split="train",
            cache_dir=None if cache_dir is None else str(cache_dir),
        )
    # A malformed line surfaces as a generation error without the file's line number, a cut or corrupted
    # compressed file as the decompressor's error naming no file: find them.
    except (datasets.exceptions.DatasetGenerationError, *READ_ERRORS) as exc:
        for path in paths:
            if builder != "parquet":
                for _ in open_text(path):  # a cut or corrupted stream: ValueError naming file and line
                    pass
            fault = _json_fault(path) if builder == "json" else None
            if fault is not None:
                raise ValueError(fault) from None
        raise ValueError(f"could not load training data {[str(p) for p in paths]}: {exc!r}") from exc


def load_training_data(
    source: str | Path | Sequence[str | Path] | datasets.Dataset,
    *,
    cache_dir: str | Path | None = None,
) -> datasets.Dataset:
    """Load training rows from files (jsonl/json/csv/parquet, optionally .gz/.bz2/.xz/.zst) or take a
    ``datasets.Dataset`` as it is, and validate it with :func:`validate_training_dataset`.

    Several files must share one format. ``cache_dir`` is passed to ``datasets.load_dataset``. Returns
    the dataset unchanged (validation never rewrites rows). One clear error for: a directory, a missing
    file, an empty file, a malformed JSON line (naming the file and line), a ``DatasetDict`` (pick a
    split) and a streaming ``IterableDataset``.
    """

    paths: list[Path] = []
    if isinstance(source, (str, Path)):
        paths = [Path(source)]
        dataset = _load_files(paths, cache_dir)
    elif isinstance(source, Sequence) and all(isinstance(p, (str, Path)) for p in source):
        if not source:
            raise ValueError("source is an empty list of files")
        paths = [Path(p) for p in source]
        dataset = _load_files(paths, cache_dir)
    else:
        check_dataset_type(source, name="source")  # a DatasetDict, a stream or another type: one clear error
        dataset = source
    try:
        validate_training_dataset(dataset)
    except RowError as exc:
        if not paths:
            raise
        raise ValueError(f"{_row_location(paths, exc.row)}: {exc}") from None
    return dataset


def _row_location(paths: list[Path], row: int) -> str:
    """Where row ``row`` of the rows loaded from ``paths`` came from: ``file:line`` for JSON lines files (one
    row per non-blank line), else the files and the row index."""
    if all(path.name.lower().split(".")[1:2] == ["jsonl"] for path in paths):
        count = 0
        for path in paths:
            with open_text(path) as handle:
                for line_number, line in enumerate(handle, start=1):
                    if line.strip():
                        if count == row:
                            return f"{path}:{line_number}"
                        count += 1
    return f"{', '.join(str(path) for path in paths)} (row {row}, counting from 0)"
