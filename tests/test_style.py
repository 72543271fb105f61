"""The code base is ruff clean and ruff formatted (the dev extra installs ruff)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_check_is_clean() -> None:
    """`ruff check` and `ruff format --check` over the repository report nothing."""
    ruff = shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff is not installed (pip install -e '.[dev]')")
    for args in (["check"], ["format", "--check"]):
        result = subprocess.run([ruff, *args, str(ROOT)], capture_output=True, text=True, check=False)
        assert result.returncode == 0, result.stdout + result.stderr
