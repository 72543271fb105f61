"""Optional dependencies of evaluation and export (onnx, seismic): whether they import."""

from __future__ import annotations

import importlib

__all__ = ["importable"]


def importable(*modules: str) -> bool:
    """True when every one of ``modules`` can be imported (each is imported: a broken install is False too)."""
    try:
        for module in modules:
            importlib.import_module(module)
    except ImportError:
        return False
    return True
