"""max_memory's allocator setting (engine/planner/allocator.py): expandable segments are turned on once, logged, and a
user's own allocator configuration that names them is kept."""

from __future__ import annotations

import logging

import pytest
import torch

from gradcache_sparton.engine.planner import allocator


@pytest.fixture
def calls(monkeypatch) -> list[str]:
    seen: list[str] = []
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", seen.append, raising=False)
    monkeypatch.setattr(torch.cuda.memory, "_set_allocator_settings", seen.append, raising=False)
    monkeypatch.setattr(allocator, "_turned_on", False)
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)
    return seen


def test_turned_on_once_and_logged(calls, caplog) -> None:
    """The first call sets expandable_segments:True and logs how to keep fixed segments; later calls set nothing."""
    with caplog.at_level(logging.INFO, logger="gradcache_sparton.engine.planner.memory_plan"):
        assert allocator.use_expandable_segments() is True
        assert allocator.use_expandable_segments() is True
    assert calls == ["expandable_segments:True"]
    assert sum("expandable segments" in record.getMessage() for record in caplog.records) == 1


@pytest.mark.parametrize("variable", ["PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"])
@pytest.mark.parametrize(
    "value", ["expandable_segments:False", "max_split_size_mb:64,expandable_segments:True"]
)
def test_users_own_setting_is_kept(calls, monkeypatch, variable, value) -> None:
    """An allocator configuration that names expandable_segments (on or off) is the user's: nothing is set."""
    monkeypatch.setenv(variable, value)
    assert allocator.use_expandable_segments() is False
    assert calls == []
