"""The rules between the engine's options: one table, checked in one place.

Each row of :data:`OPTION_RULES` says what an option, when asked for, needs: another option off, or a fact
about the encoder and where it runs. :func:`check_option_rules` raises one ``ValueError`` per option naming
every need it lacks (``cuda_graphs=True needs no mini_batch_tokens (...); reuse_argmax off (...)``). It runs
twice: on the options alone when a :class:`~gradcache_sparton.engine.GradCacheConfig` is made (the facts not
known yet: those rows wait), and on the options with the facts when the engine is built. A memory plan
chooses an option only where its rows allow it (:func:`unmet_needs`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

from gradcache_sparton.engine.memory_size import AUTO

__all__ = ["CONFLICTS", "OPTION_RULES", "EngineFacts", "OptionRule", "check_option_rules", "unmet_needs"]


@dataclass(frozen=True)
class EngineFacts:
    """What the rules read besides the options; None where not known yet (the options checked alone).

    ``module``: the encoder is an ``nn.Module``; ``routes_by_column``: it encodes each column its own way;
    ``data_parallel``: it runs under DDP or FSDP, or the loss gathers the batch across ranks; ``compiled``:
    it is compiled (``torch.compile``); ``checkpointing``: its activation checkpointing is on;
    ``can_checkpoint``: its model can turn it on (what a memory plan reads).
    """

    module: bool | None = None
    routes_by_column: bool | None = None
    data_parallel: bool | None = None
    compiled: bool = False
    checkpointing: bool = False
    can_checkpoint: bool = False

    def graphs_possible(self, options: Any) -> bool:
        """Whether a plan may choose CUDA graphs: a module, not compiled (its programs record nothing to
        replay as a graph), no row of :data:`OPTION_RULES` against them."""
        return self.module is True and not self.compiled and not unmet_needs("cuda_graphs", options, self)


class OptionRule(NamedTuple):
    """``option``, when asked for, cannot run with ``conflict`` (a name in :data:`CONFLICTS`): it needs
    ``need``, as the error says."""

    option: str
    conflict: str
    need: str


# When each option counts as asked for (its rows apply): the value given, never an engine default.
_ASKED: dict[str, Callable[[Any], bool]] = {
    "cuda_graphs": lambda options: options.cuda_graphs is True,
    "keep_graphs": lambda options: options.keep_graphs is True,
    "max_memory": lambda options: options.max_memory not in (None, AUTO),  # auto is ignored where unmet
}

CONFLICTS: dict[str, Callable[[Any, EngineFacts], bool]] = {
    "mini_batch_tokens": lambda options, facts: options.mini_batch_tokens is not None,
    "reuse_argmax": lambda options, facts: options.reuse_argmax is True,
    "keep_graphs": lambda options, facts: options.keep_graphs is True,
    "a function encoder": lambda options, facts: facts.module is False,
    "a column-routing encoder": lambda options, facts: facts.routes_by_column is True,
    "data parallelism": lambda options, facts: facts.data_parallel is True,
}
"""What a rule's conflict is, as a test on the options and the facts (True: present)."""

OPTION_RULES: tuple[OptionRule, ...] = (
    OptionRule(
        "cuda_graphs", "mini_batch_tokens", "no mini_batch_tokens (a row count per mini-batch: a graph each)"
    ),
    OptionRule("cuda_graphs", "reuse_argmax", "reuse_argmax off (its records are kept on the host)"),
    OptionRule(
        "cuda_graphs", "keep_graphs", "keep_graphs off (a graphed mini-batch replays its own recorded graph)"
    ),
    OptionRule(
        "cuda_graphs", "a function encoder", "an nn.Module encoder (its parameters' .grad are recorded)"
    ),
    OptionRule("cuda_graphs", "a column-routing encoder", "an encoder that does not route by column"),
    OptionRule("cuda_graphs", "data parallelism", "no data parallelism (DDP's gradient hooks communicate)"),
    OptionRule(
        "keep_graphs",
        "data parallelism",
        "no data parallelism (DDP, FSDP, gathering across ranks: DDP decides in each forward whether that "
        "mini-batch's backward synchronises gradients, and Step (1) runs every forward before the loss; leave "
        "keep_graphs unset, off there)",
    ),
    OptionRule(
        "max_memory",
        "data parallelism",
        "no data parallelism (DDP, FSDP, gathering across ranks: every rank would have to run the same plan; "
        "set mini_batch_size and activation_checkpointing instead, or max_memory auto, which is ignored there)",
    ),
)
"""Every exclusion between the engine's options, and between an option and the encoder or where it runs."""


def unmet_needs(option: str, options: Any, facts: EngineFacts) -> list[str]:
    """The needs of ``option`` (a name in :data:`OPTION_RULES`) that ``options`` and ``facts`` do not meet,
    whether or not it is asked for (a plan asks this before choosing it)."""
    return [
        rule.need
        for rule in OPTION_RULES
        if rule.option == option and CONFLICTS[rule.conflict](options, facts)
    ]


def check_option_rules(options: Any, facts: EngineFacts | None = None) -> None:
    """Raise ``ValueError`` for the first option ``options`` asks for whose rows are not met, naming every
    need it lacks. ``options``: a :class:`~gradcache_sparton.engine.GradCacheConfig` (or anything with its
    fields); ``facts``: the encoder's, where known."""
    facts = EngineFacts() if facts is None else facts
    for option, asked in _ASKED.items():
        if asked(options):
            unmet = unmet_needs(option, options, facts)
            if unmet:
                raise ValueError(f"{option}={getattr(options, option)!r} needs {'; '.join(unmet)}")
