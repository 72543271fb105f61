"""benchmarks/bench_trainer_feed.py: a CPU smoke run of every variant, and the trainer's dataloader defaults
(with and without its token cache)."""

from __future__ import annotations

import json

import pytest
from trainer_helpers import trainer_model

from benchmarks import bench_trainer_feed as script
from gradcache_sparton.arguments import CachedSpladeTrainingArguments, default_dataloader_workers
from gradcache_sparton.data import default_train_data_path, load_training_data, token_cache
from gradcache_sparton.trainer import CachedSpladeTrainer


def test_smoke_run_times_every_variant_against_the_engine(tmp_path) -> None:
    """Every variant (engine alone, with the optimizer, trainer with and without workers, the CLI path) runs a
    few CPU steps and is written with its pairs/s and its ratio over the engine alone."""
    out = tmp_path / "feed.json"
    assert script.main(["--smoke", "--out", str(out)]) == 0
    payload = json.loads(out.read_text())
    assert set(payload["rows"]) == set(script.VARIANTS)
    for name, row in payload["rows"].items():
        assert row["pairs_per_s"] > 0 and row["ratio"] > 0, name
    assert payload["rows"]["engine"]["ratio"] == 1.0
    assert payload["rows"]["trainer"]["dataloader_num_workers"] == 0  # the token cache: no workers
    assert payload["meta"]["smoke"] is True


@pytest.mark.parametrize(
    ("cpus", "processes", "expected"), [(1, "1", 0), (2, "1", 1), (16, "1", 4), (16, "8", 1), (16, "4", 3)]
)
def test_default_workers_leave_the_main_process_a_cpu(monkeypatch, cpus, processes, expected) -> None:
    """On an accelerator the default worker count is the process's share of its CPUs less one, at most 4."""
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(cpus)))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", processes)
    assert default_dataloader_workers(accelerator=True) == expected
    assert default_dataloader_workers(accelerator=False) == 0


def test_workers_default_resolved_and_persistent(monkeypatch, tmp_path) -> None:
    """The arguments resolve dataloader workers (persistent whenever there are some) and, with pinned memory, a
    copy to the device that does not wait; an explicit count is kept and a negative one is refused naming the
    field."""
    monkeypatch.setattr("gradcache_sparton.arguments._has_accelerator", lambda: True)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(8)))
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    args = CachedSpladeTrainingArguments(output_dir=str(tmp_path), use_cpu=False, report_to="none")
    assert args.dataloader_num_workers == 4 and args.dataloader_persistent_workers is True
    assert args.dataloader_pin_memory and args.accelerator_config.non_blocking is True
    cpu = CachedSpladeTrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    assert cpu.dataloader_num_workers == 0 and cpu.dataloader_persistent_workers is False
    assert cpu.accelerator_config.non_blocking is False
    kept = CachedSpladeTrainingArguments(output_dir=str(tmp_path), dataloader_num_workers=2, report_to="none")
    assert kept.dataloader_num_workers == 2
    with pytest.raises(ValueError, match="dataloader_num_workers"):
        CachedSpladeTrainingArguments(output_dir=str(tmp_path), dataloader_num_workers=-1, report_to="none")


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ({}, (0, False)),
        ({"dataloader_num_workers": 2}, (2, True)),
        ({"dataloader_prefetch_factor": 3}, (4, True)),
    ],
)
def test_trainer_pads_cached_batches_in_the_main_process(
    monkeypatch, tmp_path, tokenizer, given, expected
) -> None:
    """When the trainer tokenized every training text before training (its token cache), the default worker
    count becomes 0 and persistent workers off; a worker count or a prefetch factor the user gave is kept.
    A training set too large for the cache keeps the default workers."""
    monkeypatch.setattr("gradcache_sparton.arguments._has_accelerator", lambda: True)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(8)))
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    # The trainer sets it where it starts workers: the test keeps it to itself.
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")

    def trainer(rows):
        args = CachedSpladeTrainingArguments(
            output_dir=str(tmp_path), use_cpu=False, report_to="none", per_device_train_batch_size=4,
            query_max_length=16, document_max_length=32,
            dataloader_pin_memory=False, **given,
        )  # fmt: skip
        return CachedSpladeTrainer(
            trainer_model(tokenizer), args, train_dataset=rows, processing_class=tokenizer
        )

    rows = load_training_data(default_train_data_path()).select(range(8))
    args = trainer(rows).args
    assert (args.dataloader_num_workers, args.dataloader_persistent_workers) == expected
    monkeypatch.setattr(token_cache, "TOKEN_CACHE_MAX_TEXTS", 8)  # 8 rows x 3 texts: no cache
    uncached = trainer(rows).args
    assert (uncached.dataloader_num_workers, uncached.dataloader_persistent_workers) == (
        given.get("dataloader_num_workers", 4),
        True,
    )
