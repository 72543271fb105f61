"""Opening text files that may be compressed (``.gz``, ``.bz2``, ``.xz``; ``.zst`` with ``zstandard``)."""

from __future__ import annotations

import bz2
import gzip
import lzma
from pathlib import Path
from typing import TextIO

__all__ = ["open_text"]


def open_text(path: Path) -> TextIO:
    """Open ``path`` for reading UTF-8 text, decompressing by its suffix."""
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
