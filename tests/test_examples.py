"""The README's Usage snippets and the examples/ recipes run as written (snippets at tiny sizes) on a CPU."""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ("engine_on_cpu.py", "train_and_encode.py", "own_training_loop.py")

# Per README Usage snippet, in order: (text as written, tiny stand-in). Each text must occur in its
# snippet, so a README edit that drops one fails here instead of running a full-size training.
TINY = (
    (
        ("BertConfig(vocab_size=len(tokenizer))", "BertConfig(vocab_size=len(tokenizer), hidden_size=32, "
         "num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)"),
        ("per_device_train_batch_size=1024,", "per_device_train_batch_size=8, max_steps=1, report_to='none',"),
        ("mini_batch_size=64,", "mini_batch_size=4,"),
        ("load_training_data(default_train_data_path())", "load_training_data(default_train_data_path()).select(range(16))"),
    ),
    (
        ("batch_size=1024,", "batch_size=8,"),
        ("mini_batch_size=64)", "mini_batch_size=4)"),
        ("for step, batch in enumerate(loader):", "for step, batch in zip(range(1), loader):"),
    ),
)  # fmt: skip


def usage_snippets() -> list[str]:
    """The python code blocks of the README's "## Usage" section, in order."""
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Usage\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, flags=re.DOTALL)


def test_readme_usage_snippets_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The Trainer snippet trains a step and saves a checkpoint; the own-loop snippet, continuing from it,
    takes a finite cached step that changes the weights. Only the sizes differ from what the README says."""
    snippets = usage_snippets()
    assert len(snippets) == len(TINY), (
        f"expected {len(TINY)} python snippets in README Usage, got {len(snippets)}"
    )
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, object] = {"__name__": "readme_usage"}
    for i, (snippet, replacements) in enumerate(zip(snippets, TINY, strict=True)):
        for written, tiny in replacements:
            assert written in snippet, f"README Usage snippet {i + 1} no longer contains {written!r}"
            snippet = snippet.replace(written, tiny)
        if i == 1:  # the own loop: remember the weights it should change
            before = [p.detach().clone() for p in namespace["model"].parameters()]
        exec(compile(snippet, f"README.md Usage snippet {i + 1}", "exec"), namespace)
        if i == 0:
            assert namespace["trainer"].state.global_step == 1
            assert (tmp_path / "outputs" / "run" / "config.json").is_file()
    loss = namespace["loss"]
    assert isinstance(loss, torch.Tensor) and math.isfinite(loss.item())
    after = list(namespace["model"].parameters())
    assert any(not torch.equal(a.detach(), b) for a, b in zip(after, before, strict=True))


@pytest.mark.parametrize("name", EXAMPLES)
def test_example_runs(name: str) -> None:
    """Each examples/ recipe runs to completion on this machine, as a user would start it."""
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / name)], capture_output=True, text=True, timeout=600, cwd=ROOT
    )
    assert result.returncode == 0, result.stderr[-3000:]
