"""Every fenced ```python and ```bash block of README.md and docs/*.md runs as written.

A page is one session: its blocks run in order, in one fresh folder, python blocks sharing one namespace
(a later snippet may use what an earlier one built, as a reader following the page would) and bash blocks
through ``bash -euo pipefail`` with ``gradcache-sparton`` and ``python`` meaning this checkout. Lines
starting with ``pip install`` are not run: the test environment is the installed one.

An HTML comment right before a block (blank lines between allowed) says how it runs:

    <!-- docs-test: slow -->                  runs on a CPU, more than a few seconds (``-m slow``)
    <!-- docs-test: long -- REASON -->        takes minutes on a CPU (the main job, a full evaluation):
                                              run by the GPU acceptance suite, on a CPU with DOCS_TEST_LONG=1
    <!-- docs-test: gpu -- REASON -->         needs a CUDA GPU; the page shows the CPU-sized variant next to it
    <!-- docs-test: multigpu -- REASON -->    needs 2 CUDA GPUs (run where there are, skipped on one)
    <!-- docs-test: skip -- REASON -->        not a program: an output's layout, a fragment of a call shown
                                              in context, a command on files only the reader has

A block without a comment runs on a CPU in seconds. ``long``, ``gpu``, ``multigpu`` and ``skip`` need a
reason; a block that needs a ``long`` or ``gpu`` block's output is marked so itself (the CPU run leaves those out). On a
machine with CUDA, ``test_docs_on_gpu`` (the user-path acceptance suite, issue 32) runs every block
but ``skip`` ones, as written.
"""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
PAGES = ("README.md", *sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")))
MODES = ("cpu", "slow", "long", "gpu", "multigpu", "skip")
_FENCE = re.compile(r"^```(python|bash)\n(.*?)^```\n", re.DOTALL | re.MULTILINE)
_MARK = re.compile(r"<!--\s*docs-test:\s*(\w+)\s*(?:--\s*(.*?))?\s*-->\s*\Z", re.DOTALL)
# Pages whose unmarked blocks are experiment recipes for the GPU machine (cross-validation over the full
# SciFact folder, which the docs name but do not ship): unmarked, they are skipped for this reason, not run.
_PAGE_DEFAULT_SKIP = {
    "docs/experiments.md": "experiment recipes run on the GPU machine over the full SciFact folder",
}
# Blocks are fast on a CPU unless marked; a CLI command starts in ~10 s on a loaded 2-core machine.
_TIMEOUT_S = {"cpu": 300, "slow": 600, "long": 1800, "gpu": 1800, "multigpu": 1800}


@dataclass(frozen=True)
class Block:
    """One fenced block: where it is, its language, its code and how it runs."""

    page: str
    line: int
    language: str
    code: str
    mode: str
    reason: str | None


def page_blocks(page: str) -> list[Block]:
    """The python and bash blocks of ``page``, in order, each with its ``docs-test`` mode."""
    text = (ROOT / page).read_text(encoding="utf-8")
    blocks = []
    for match in _FENCE.finditer(text):
        before = text[: match.start()].rstrip()
        comment = before[before.rfind("<!--") :] if before.endswith("-->") else ""
        mark = _MARK.match(comment) if comment else None
        if comment.startswith("<!--") and "docs-test" in comment and mark is None:
            raise ValueError(f"{page}: malformed docs-test comment {comment!r}")
        if mark:
            mode, reason = mark.group(1), mark.group(2)
        else:
            mode, reason = ("skip", _PAGE_DEFAULT_SKIP[page]) if page in _PAGE_DEFAULT_SKIP else ("cpu", None)
        line = text.count("\n", 0, match.start()) + 1
        if mode not in MODES:
            raise ValueError(f"{page}:{line}: docs-test mode {mode!r} is not one of {MODES}")
        if mode in ("long", "gpu", "multigpu", "skip") and not reason:
            raise ValueError(f"{page}:{line}: docs-test {mode} needs a reason (`-- why`)")
        blocks.append(Block(page, line, match.group(1), match.group(2), mode, reason))
    return blocks


def _shims(folder: Path) -> dict[str, str]:
    """Environment in which ``gradcache-sparton`` and ``python`` run this checkout's package."""
    bin_dir = folder / ".docs-test-bin"
    bin_dir.mkdir(exist_ok=True)
    for name, target in (("gradcache-sparton", "-m gradcache_sparton.cli"), ("python", ""), ("python3", "")):
        shim = bin_dir / name
        shim.write_text(f'#!/usr/bin/env bash\nexec "{sys.executable}" {target} "$@"\n')
        shim.chmod(shim.stat().st_mode | stat.S_IEXEC)
    env = dict(os.environ)
    env["PATH"] = f"{bin_dir}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}"
    return env


def run_page(page: str, folder: Path, *, modes: tuple[str, ...]) -> list[Block]:
    """Run ``page``'s blocks whose mode is in ``modes``, in order, in ``folder``; returns those run.
    Stops at the first block that fails (a later block may need its output)."""
    env = _shims(folder)
    namespace: dict[str, object] = {"__name__": "__docs_test__"}
    ran = []
    cwd = Path.cwd()
    for block in page_blocks(page):
        if block.mode not in modes:
            continue
        where = f"{block.page}:{block.line}"
        if block.language == "python":
            os.chdir(folder)
            try:
                exec(compile(block.code, where, "exec"), namespace)
            except Exception as exc:
                raise AssertionError(f"{where} (python block) failed: {type(exc).__name__}: {exc}") from exc
            finally:
                os.chdir(cwd)
        else:
            script = "\n".join(line for line in block.code.splitlines() if not line.startswith("pip install"))
            result = subprocess.run(
                ["bash", "-euo", "pipefail", "-c", script],
                cwd=folder,
                env=env,
                capture_output=True,
                text=True,
                timeout=_TIMEOUT_S[block.mode],
            )
            assert result.returncode == 0, (
                f"{where} (bash block) exited {result.returncode}:\n{script}\n--- stderr ---\n{result.stderr[-4000:]}"
            )
        ran.append(block)
    return ran


def _pages_with(*modes: str) -> list[str]:
    return [page for page in PAGES if any(block.mode in modes for block in page_blocks(page))]


def test_every_block_has_a_known_mode() -> None:
    """Every fenced python/bash block parses with a known docs-test mode, a reason where one is due, and a
    README block a person is asked to run (install, main job, Usage) is not skipped."""
    blocks = [block for page in PAGES for block in page_blocks(page)]
    assert len(blocks) > 20  # the pages are found and parsed
    readme = [block for block in blocks if block.page == "README.md"]
    usage = [block for block in readme if block.language == "python"]
    assert usage and all(block.mode == "cpu" for block in usage), "README's python snippets must run on a CPU"


@pytest.mark.slow
@pytest.mark.parametrize("page", _pages_with("cpu", "slow"))
def test_docs_blocks_run_on_cpu(page: str, tmp_path: Path) -> None:
    """The page's blocks that a CPU runs in seconds (and with DOCS_TEST_LONG=1, in minutes) run as
    written and in order, each exiting 0."""
    modes = ("cpu", "slow", "long") if os.environ.get("DOCS_TEST_LONG") else ("cpu", "slow")
    assert run_page(page, tmp_path, modes=modes)


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("page", _pages_with("cpu", "slow", "long", "gpu", "multigpu"))
def test_docs_on_gpu(page: str, tmp_path: Path) -> None:
    """User-path acceptance (issue 32): on a CUDA machine every block but `skip` ones runs as written,
    GPU-sized ones included (bf16 where the page says a GPU user would pick it); `multigpu` blocks where
    there are 2 GPUs."""
    assert torch.cuda.is_available()
    modes = ("cpu", "slow", "long", "gpu") + (("multigpu",) if torch.cuda.device_count() >= 2 else ())
    if not any(block.mode in modes for block in page_blocks(page)):
        pytest.skip(
            f"{page}: its blocks need 2 GPUs (multigpu); this machine has {torch.cuda.device_count()}"
        )
    assert run_page(page, tmp_path, modes=modes)
