"""The settings: the decisions callers feeding the engine read instead of deciding them again, the facts they
are decided from, and the two records an engine option is declared in."""

from __future__ import annotations

import ast
import dataclasses
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from gradcache_sparton.engine import GradCacheConfig
from gradcache_sparton.engine.option_rules import EngineFacts
from gradcache_sparton.engine.settings import StepSettings, encoder_facts, plans_memory, resolve_settings

PACKAGE = Path(__file__).resolve().parents[1] / "gradcache_sparton"


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


def test_engine_options_are_declared_in_two_records() -> None:
    """Each GradCacheConfig field is declared as a field of GradCacheConfig (what was asked) and StepSettings
    (what a step runs) only: no other class of the package (a plan's record, a command's options) declares an
    engine option again; the trainer's arguments may give one another default through ``_engine_field``,
    which takes the engine's declaration (its help text)."""
    options = {field.name for field in dataclasses.fields(GradCacheConfig)}
    declared = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.ClassDef) or node.name in ("GradCacheConfig", "StepSettings"):
                continue
            for item in node.body:
                if not (isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)):
                    continue
                value = item.value
                derived = isinstance(value, ast.Call) and getattr(value.func, "id", None) == "_engine_field"
                if item.target.id in options and not derived:
                    declared.append(f"{path.relative_to(PACKAGE)}: {node.name}.{item.target.id}")
    assert not declared, "engine options declared again:\n" + "\n".join(declared)
    settings = {field.name for field in dataclasses.fields(StepSettings)}
    assert options - settings == {
        "max_memory",
        "same_batch_size",
        "allow_non_finite",
        "show_mini_batch_progress",
    }


def test_encoder_facts_and_settings_read_the_encoder() -> None:
    """encoder_facts reads a module, a function, data parallelism as given, compilation and activation
    checkpointing; the settings decided from them follow (a compiled encoder: no replay check, lengths of 32)."""
    linear = torch.nn.Linear(2, 2)
    assert encoder_facts(linear) == EngineFacts(module=True, routes_by_column=False)
    assert encoder_facts(torch.tanh, data_parallel=True).module is False
    assert encoder_facts(torch.tanh, data_parallel=True).data_parallel is True
    compiled = encoder_facts(torch.compile(linear))
    assert compiled.compiled and not resolve_settings(GradCacheConfig(), compiled).check_replay
    assert resolve_settings(GradCacheConfig(), compiled).mini_batch_length_multiple == 32


def test_settings_under_cuda_graphs_are_consistent() -> None:
    """StepSettings with cuda_graphs on reuse no argmax, keep no graph and round lengths to 32 unless a
    multiple was given, however they were made (decided, or a plan's settings with CUDA graphs chosen)."""
    facts = encoder_facts(torch.nn.Linear(2, 2))
    eager = resolve_settings(GradCacheConfig(keep_graphs=True), facts)
    assert eager.reuse_argmax and eager.keep_graphs is True and eager.mini_batch_length_multiple is None
    graphed = replace(eager, cuda_graphs=True, keep_graphs={"query": 2})
    assert (graphed.reuse_argmax, graphed.keep_graphs, graphed.mini_batch_length_multiple) == (
        False,
        False,
        32,
    )
    assert graphed.kept_mini_batches("query", 4) == 0
    given = resolve_settings(GradCacheConfig(cuda_graphs=True, mini_batch_length_multiple=8), facts)
    assert given.mini_batch_length_multiple == 8 and not given.reuse_argmax
