"""The code base is ruff clean and ruff formatted (the dev extra installs ruff), and its modules stay short."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_check_is_clean() -> None:
    """`ruff check` and `ruff format --check` over the repository report nothing."""
    # This interpreter's ruff, not PATH's: the test must not depend on an activated venv.
    if importlib.util.find_spec("ruff") is None:
        pytest.skip(f"ruff is not installed for {sys.executable} (pip install -e '.[dev]')")
    for args in (["check"], ["format", "--check"]):
        command = [sys.executable, "-m", "ruff", *args, str(ROOT)]
        result = subprocess.run(command, capture_output=True, text=True, check=False)
        assert result.returncode == 0, result.stdout + result.stderr


def test_package_uses_only_public_transformers_and_argparse_api() -> None:
    """No module imports from transformers' internal model paths or reads argparse's private ``_actions``."""
    private = ("from transformers.models.", "import transformers.models.", "._actions")
    found = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for path in sorted((ROOT / "gradcache_sparton").rglob("*.py"))
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if any(pattern in line for pattern in private)
    ]
    assert not found, found


MAX_MODULE_LINES = 600


def test_no_module_of_the_package_is_over_600_lines() -> None:
    """Every module of gradcache_sparton stays short enough to read as one job (the house issue's bound):
    a module that grows past it is split by concept, not left to grow."""
    package = ROOT / "gradcache_sparton"
    long = {
        str(path.relative_to(package)): count
        for path in sorted(package.rglob("*.py"))
        if (count := len(path.read_text(encoding="utf-8").splitlines())) > MAX_MODULE_LINES
    }
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"
