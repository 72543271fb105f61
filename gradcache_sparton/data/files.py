"""Opening text files that may be compressed (``.gz``, ``.bz2``, ``.xz``; ``.zst`` with ``zstandard``).

A file cut short (a copy or download that stopped), a corrupted stream or bytes that are not UTF-8 surface
from the decompressors as ``EOFError``, ``zlib.error``, ``lzma.LZMAError``, ``OSError`` or
``UnicodeDecodeError``, none naming the file. :func:`open_text` turns each into one ``ValueError`` naming
the file and the line being read.
"""

from __future__ import annotations

import bz2
import gzip
import lzma
import zlib
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import TextIO

__all__ = ["COMPRESSIONS", "READ_ERRORS", "TextFile", "format_suffix", "open_text"]

#: Compression suffixes the readers of training and mining files take (``.zst`` needs ``zstandard``).
COMPRESSIONS = (".gz", ".bz2", ".xz", ".zst")


def format_suffix(path: Path) -> str | None:
    """``path``'s lowercased format suffix under an optional compression one (``a.JSONL.gz`` -> ``.jsonl``);
    None when it has none."""
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] in COMPRESSIONS:
        suffixes = suffixes[:-1]
    return suffixes[-1] if suffixes else None


#: What a cut or corrupted compressed stream, or undecodable bytes, raise while being read.
READ_ERRORS = (EOFError, OSError, zlib.error, lzma.LZMAError, UnicodeDecodeError)


class TextFile:
    """A text file open for reading whose read errors name the file (and line): iterate it or ``read`` it."""

    def __init__(self, handle: TextIO, path: Path) -> None:
        self._handle, self.path = handle, path

    def _fault(self, exc: BaseException, line: int | None) -> ValueError:
        where = f"{self.path}:{line}" if line is not None else str(self.path)
        if isinstance(exc, UnicodeDecodeError):
            return ValueError(f"{where}: not UTF-8 text ({exc.reason})")
        detail = str(exc).strip() or type(exc).__name__
        return ValueError(
            f"{where}: the file is truncated or corrupted ({detail}); copy or download it again"
        )

    def __iter__(self) -> Iterator[str]:
        line = 0
        try:
            for line, text in enumerate(self._handle, start=1):  # noqa: B007 (line is read after a fault)
                yield text
        except READ_ERRORS as exc:
            raise self._fault(exc, line + 1) from None

    def read(self, size: int = -1) -> str:
        try:
            return self._handle.read(size)
        except READ_ERRORS as exc:
            raise self._fault(exc, None) from None

    def close(self) -> None:
        self._handle.close()

    def __enter__(self) -> TextFile:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def open_text(path: Path) -> TextFile:
    """Open ``path`` for reading UTF-8 text, decompressing by its suffix; read errors name the file and line."""
    path = Path(path)
    return TextFile(_open_decompressed(path), path)


def _open_decompressed(path: Path) -> TextIO:
    suffix = path.suffix.lower()
    if suffix == ".gz":
        return gzip.open(path, "rt", encoding="utf-8")
    if suffix == ".bz2":
        return bz2.open(path, "rt", encoding="utf-8")
    if suffix == ".xz":
        return lzma.open(path, "rt", encoding="utf-8")
    if suffix == ".zst":
        try:
            import zstandard
        except ImportError:
            raise ValueError(
                f"reading {str(path)!r} needs the zstandard package (pip install zstandard)"
            ) from None
        return zstandard.open(path, "rt", encoding="utf-8")
    return path.open("r", encoding="utf-8")
