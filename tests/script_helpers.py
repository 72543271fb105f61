"""Experiment scripts imported as modules (scripts/ is a folder of scripts, not a package), for tests of
their pieces. The benchmarks are a package (``benchmarks``): their tests import them by name."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def import_script(folder: str, name: str) -> ModuleType:
    """``<repository>/<folder>/<name>.py`` as the module ``name``: its folder first on ``sys.path``, as when
    the script runs, and registered in ``sys.modules`` (dataclasses resolve their module by name)."""
    directory = ROOT / folder
    if str(directory) not in sys.path:
        sys.path.insert(0, str(directory))
    spec = importlib.util.spec_from_file_location(name, directory / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
