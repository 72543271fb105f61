"""What every benchmark records about where it ran: one run stamp for all of benchmarks/.

Imported by the benchmark scripts as ``from benchmarks.common import run_stamp``: benchmarks/ is a
package, so a script runs from the repository root as ``python -m benchmarks.<script>`` (or as
``python benchmarks/<script>.py`` with the repository root on ``PYTHONPATH``).
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import platform
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

__all__ = ["headless_pyplot", "run_stamp", "write_result"]


def run_stamp(device: torch.device | None = None) -> dict[str, str | None]:
    """Device name, torch / CUDA / triton / transformers / NCCL versions and the UTC date of this run.

    ``device`` defaults to the current CUDA device when there is one, else the CPU. Versions of packages
    that are not installed (triton on a CPU machine) and NCCL off CUDA are None.
    """
    if device is None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device.type == "cuda"
    return {
        "device": torch.cuda.get_device_name(device) if cuda else platform.processor() or "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": _version("triton"),
        "transformers": _version("transformers"),
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None,
        "date": datetime.datetime.now(datetime.timezone.utc).date().isoformat(),
    }


def write_result(result: Mapping[str, Any], path: Path | None) -> str:
    """``result`` as indented JSON: written to ``path`` (its folder created, a final newline) unless it is
    None, and returned, for the script to print."""
    text = json.dumps(result, indent=2)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n", encoding="utf-8")
    return text


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def headless_pyplot() -> Any | None:
    """``matplotlib.pyplot`` on the file-only Agg backend, or None where matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt
