"""Run checks before any work: `--fsdp` on the CPU and `score_kernel='fused'` where it cannot run (validate_run), a
SparseEncoder under FSDP (check_sharding)."""

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


@pytest.mark.parametrize("sparse_reps", [None, "false", "auto"])
def test_fused_score_kernel_without_sparse_reps_is_refused(tmp_path: Path, monkeypatch, sparse_reps) -> None:
    """score_kernel='fused' with reps that may be dense on a step is refused before the model is built, naming
    both options (before: the first dense step stopped the run, after the evaluation before training); with
    sparse_reps true on a CUDA device it passes."""
    args = CachedSpladeTrainingArguments(
        output_dir=str(tmp_path / "run"), score_kernel="fused", sparse_reps=sparse_reps, report_to="none"
    )
    monkeypatch.setattr(
        CachedSpladeTrainingArguments, "device", property(lambda self: torch.device("cuda", 0))
    )
    with pytest.raises(
        ValueError,
        match=rf"score_kernel='fused' scores sparse reps only, but sparse_reps is {sparse_reps or 'unset'} ",
    ):
        validate_run(args, num_train_rows=10_000)
    args.sparse_reps = "true"
    validate_run(args, num_train_rows=10_000)


def test_fused_score_kernel_on_the_cpu_is_refused(tmp_path: Path, monkeypatch) -> None:
    """score_kernel='fused' on the CPU outside the Triton interpreter is refused before the model is built,
    naming the device (before: the first step stopped the run); under the interpreter (the tests' CPU kernels)
    it passes."""
    args = CachedSpladeTrainingArguments(
        output_dir=str(tmp_path / "run"),
        score_kernel="fused",
        sparse_reps="true",
        use_cpu=True,
        report_to="none",
    )
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(
        ValueError, match="score_kernel='fused' runs Triton kernels on a CUDA GPU, but this run is on cpu"
    ):
        validate_run(args, num_train_rows=10_000)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    validate_run(args, num_train_rows=10_000)


def test_a_sparse_encoder_under_fsdp_is_refused() -> None:
    """A SparseEncoder under FSDP is refused when the trainer is built, naming fsdp and the SparseEncoder
    (before: its first save gathered the shards on the main process alone and hung); DDP and a SpladeEncoder
    under FSDP pass."""
    from types import SimpleNamespace

    from gradcache_sparton.run_checks import check_sharding

    def trainer(fsdp: bool) -> SimpleNamespace:
        plugin = SimpleNamespace(fsdp_version=2)
        accelerator = SimpleNamespace(state=SimpleNamespace(fsdp_plugin=plugin))
        return SimpleNamespace(is_deepspeed_enabled=False, is_fsdp_enabled=fsdp, accelerator=accelerator)

    with pytest.raises(ValueError, match="fsdp with a sentence-transformers SparseEncoder"):
        check_sharding(trainer(True), sparse_encoder=True)
    check_sharding(trainer(False), sparse_encoder=True)
    check_sharding(trainer(True), sparse_encoder=False)
