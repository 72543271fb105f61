"""The rules between the engine's options: every row of the table fires, with one error naming the option and
what it needs, from the options alone or from the engine built on an encoder."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch

from gradcache_sparton.engine import GradCache, GradCacheConfig
from gradcache_sparton.engine.option_rules import (
    CONFLICTS,
    OPTION_RULES,
    EngineFacts,
    OptionRule,
    check_option_rules,
)

# One way to present each conflict: options beside the rule's own, and facts.
CONFLICTING: dict[str, tuple[dict[str, object], EngineFacts]] = {
    "mini_batch_tokens": ({"mini_batch_tokens": 64}, EngineFacts()),
    "reuse_argmax": ({"reuse_argmax": True}, EngineFacts()),
    "keep_graphs": ({"keep_graphs": True}, EngineFacts()),
    "a function encoder": ({}, EngineFacts(module=False)),
    "a column-routing encoder": ({}, EngineFacts(routes_by_column=True)),
    "data parallelism": ({}, EngineFacts(data_parallel=True)),
}


def test_every_conflict_has_a_test_and_a_rule() -> None:
    """The conflicts the rules name are exactly the ones the table can test (no row without its test)."""
    assert set(CONFLICTS) == set(CONFLICTING) == {rule.conflict for rule in OPTION_RULES}


def _breaking(rule: OptionRule) -> tuple[dict[str, object], EngineFacts]:
    options, facts = CONFLICTING[rule.conflict]
    return {rule.option: "4GiB" if rule.option == "max_memory" else True, **options}, facts


@pytest.mark.parametrize("rule", OPTION_RULES, ids=lambda rule: f"{rule.option}-{rule.conflict}")
def test_each_rule_fires_with_one_error_naming_the_option_and_its_need(rule: OptionRule) -> None:
    """Each row of the table, broken, raises one ValueError `OPTION=VALUE needs NEED`; its options alone
    pass where the row needs a fact about the encoder (that part waits for the engine)."""
    options, facts = _breaking(rule)
    config: object
    if facts != EngineFacts():
        config = GradCacheConfig(**options)  # the options alone are fine
    else:
        with pytest.raises(ValueError, match=rf"^{rule.option}=.* needs .*{re.escape(rule.need)}"):
            GradCacheConfig(**options)
        config = SimpleNamespace(**{**vars(GradCacheConfig()), **options})  # the options, unchecked
    with pytest.raises(ValueError, match=rf"^{rule.option}=.* needs .*{re.escape(rule.need)}") as caught:
        check_option_rules(config, facts)
    assert str(caught.value).count(" needs ") == 1


def test_the_engine_checks_the_rules_against_its_encoder() -> None:
    """Built on a plain function, a GradCache asked for CUDA graphs names the nn.Module it needs, before any
    step; on a module the same options are accepted."""
    with pytest.raises(ValueError, match=r"cuda_graphs=True needs an nn\.Module encoder"):
        GradCache(lambda **features: features["input_ids"].float(), cuda_graphs=True)
    assert GradCache(torch.nn.Linear(2, 2), cuda_graphs=True).settings.cuda_graphs


def test_auto_max_memory_and_options_left_unset_are_never_refused() -> None:
    """Only options asked for are checked: max_memory auto, and every option left unset, pass under data
    parallelism (the engine decides them there)."""
    check_option_rules(GradCacheConfig(max_memory="auto"), EngineFacts(module=True, data_parallel=True))
