"""Memory sizes as users write them (``"4GiB"``, ``"512MiB"``, ``"24GB"``, ``"auto"``): parsed and printed.

The spelling of :class:`~gradcache_sparton.engine.GradCacheConfig`'s ``max_memory``; the planner that uses
it is :mod:`~gradcache_sparton.engine.planner.memory_plan`.
"""

from __future__ import annotations

import re

__all__ = ["AUTO", "format_bytes", "parse_max_memory", "size_bytes"]

AUTO = "auto"
"""``max_memory="auto"``: what the CUDA device has free when the first step is planned, less a margin."""

# Decimal (SI) and binary (IEC) units, matched case-insensitively.
_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*([a-z]+)")
_ACCEPTED = "a size such as '4GiB', '512MiB' or '24GB' (units B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), 'auto' or 'none'"


def parse_max_memory(value: object) -> str | None:
    """``max_memory`` in one spelling: None (off; also ``"none"``), ``"auto"``, or a size as given (its
    case kept, surrounding spaces removed), checked to be a positive whole number of bytes.

    Raises:
        ValueError: naming ``max_memory`` and the accepted forms (a bare number, an unknown unit, zero).
    """
    if value is None:
        return None
    if not isinstance(value, str):
        raise ValueError(f"max_memory must be {_ACCEPTED}, got {value!r} ({type(value).__name__})")
    text = value.strip()
    if text.lower() == "none":
        return None
    if text.lower() == AUTO:
        return AUTO
    size_bytes(text)  # raises for anything else
    return text


def size_bytes(text: str) -> int:
    """The bytes ``text`` (a size such as ``"4GiB"``) stands for, rounded down.

    Raises:
        ValueError: ``text`` is not a size with a unit, or is under one byte.
    """
    match = _SIZE.fullmatch(text.strip().lower())
    if match is None or match.group(2) not in _UNITS:
        raise ValueError(f"max_memory must be {_ACCEPTED}, got {text!r}")
    size = int(float(match.group(1)) * _UNITS[match.group(2)])
    if size < 1:
        raise ValueError(f"max_memory must be at least 1 byte, got {text!r}")
    return size


def format_bytes(size: float) -> str:
    """``size`` bytes in GiB (or MiB under one GiB) with two decimals, e.g. ``"3.50 GiB"``."""
    if abs(size) >= 2**30:
        return f"{size / 2**30:.2f} GiB"
    return f"{size / 2**20:.2f} MiB"
