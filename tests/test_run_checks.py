"""validate_run's refusal of ``--fsdp`` on the CPU, before any work."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gradcache_sparton.arguments import CachedSpladeTrainingArguments
from gradcache_sparton.run_checks import validate_run


@pytest.mark.parametrize("processes", [1, 2])
def test_fsdp_on_the_cpu_is_refused(tmp_path: Path, monkeypatch, processes: int) -> None:
    """`--fsdp` on the CPU is refused naming --fsdp and the CPU (before: under a launcher accelerate ignored it
    and trained under DDP, exit 0); the same arguments on a CUDA device pass."""
    args = CachedSpladeTrainingArguments(
        output_dir=str(tmp_path / "run"), fsdp="full_shard auto_wrap", use_cpu=True, report_to="none"
    )
    monkeypatch.setattr(CachedSpladeTrainingArguments, "world_size", property(lambda self: processes))
    with pytest.raises(ValueError, match=rf"--fsdp on the CPU \({processes} process"):
        validate_run(args, num_train_rows=10_000)
    monkeypatch.setattr(
        CachedSpladeTrainingArguments, "device", property(lambda self: torch.device("cuda", 0))
    )
    validate_run(args, num_train_rows=10_000)
