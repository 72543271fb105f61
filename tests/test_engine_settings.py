"""The settings' decisions that callers feeding the engine read instead of deciding them again."""

from __future__ import annotations

import pytest

from gradcache_sparton.engine import GradCacheConfig
from gradcache_sparton.engine.settings import plans_memory


@pytest.mark.parametrize(
    ("max_memory", "device_type", "data_parallel", "planned"),
    [
        ("4GiB", "cuda", False, True),
        ("auto", "cuda", False, True),
        (None, "cuda", False, False),
        ("4GiB", "cpu", False, False),
        ("auto", "cuda", True, False),
    ],
)
def test_a_memory_plan_runs_only_with_a_budget_on_one_cuda_process(
    max_memory: str | None, device_type: str, data_parallel: bool, planned: bool
) -> None:
    """max_memory plans steps only where a budget is set, on CUDA, without data parallelism: the one rule the
    engine's probe and the trainer's collator (padding to one shape) both read."""
    config = GradCacheConfig(max_memory=max_memory)
    assert plans_memory(config, device_type, data_parallel=data_parallel) is planned
