"""The examples/ recipes run as written on a CPU (the README's and docs' snippets: tests/test_docs.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ("engine_on_cpu.py", "train_and_encode.py", "own_training_loop.py")


@pytest.mark.parametrize("name", EXAMPLES)
def test_example_runs(name: str) -> None:
    """Each examples/ recipe runs to completion on this machine, as a user would start it."""
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / name)], capture_output=True, text=True, timeout=600, cwd=ROOT
    )
    assert result.returncode == 0, result.stderr[-3000:]
