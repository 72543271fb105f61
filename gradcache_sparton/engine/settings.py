"""What the engine runs a step with: :class:`StepSettings`, every option decided, and the one place they are
decided from what was asked.

:class:`~gradcache_sparton.engine.GradCacheConfig` holds what the user asked, None where the engine is to
decide. :func:`resolve_settings` decides it from the facts about the encoder (:func:`encoder_facts`: a compiled
one, its activation checkpointing) and the ranks whose batches the loss sees (gathering), into
:class:`StepSettings`: concrete values, the only ones Steps (1)-(3) read. When ``max_memory`` is set, the planner
(:func:`~gradcache_sparton.engine.planner.memory_plan.choose_plan`) starts from the same settings and returns
them with the options it chose (``MemoryPlan.settings``). :class:`~gradcache_sparton.engine.GradCache` resolves
them when it is built (``GradCache.settings``) and takes each plan's (``GradCache.plan``); a trainer logs them
from there.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from torch import nn

from gradcache_sparton.engine.config import GradCacheConfig
from gradcache_sparton.engine.distributed import data_parallel_world_size
from gradcache_sparton.engine.option_rules import EngineFacts
from gradcache_sparton.primitives.column_routing import routes_by_column

__all__ = [
    "DEFAULT_MINI_BATCH_SIZE",
    "StepSettings",
    "checkpointing_on",
    "encoder_facts",
    "is_compiled",
    "plans_memory",
    "resolve_settings",
]

DEFAULT_MINI_BATCH_SIZE = 32
"""Rows per mini-batch when neither ``mini_batch_size`` nor a ``max_memory`` plan says."""
GRAPHED_LENGTH_MULTIPLE = 32
"""``mini_batch_length_multiple`` under CUDA graphs or for a compiled encoder when not given: rows the collator
pads to multiples of 8 then come in at most S / 32 + 1 lengths per column, one graph pair (or one compiled
program) each."""


@dataclass(frozen=True)
class StepSettings:
    """The engine's options as a step runs them, every one decided (see :class:`GradCacheConfig` for each).

    ``mini_batch_size``: rows per mini-batch, one int or one per column; ``activation_checkpointing``: the
    encoder runs with it (a plan's choice, else as the model has it); ``sparse_reps``: ``"false"``,
    ``"true"`` or ``"auto"``; ``keep_graphs``: Step (1) keeps the graphs of every mini-batch (True), of none
    (False), or of each column's last ``keep_graphs[column]`` mini-batches (a plan's choice), and Step (3)
    backprops those instead of re-encoding them; ``world_size``: how many ranks' batches the loss sees
    (``gather_across_ranks``: more than one); ``planned``: a ``max_memory`` plan decided them.

    Consistent by construction: under ``cuda_graphs`` no mini-batch reuses an argmax (the records are kept on
    the host) or keeps its graph (a graphed mini-batch replays its own recorded graph), and mini-batch
    lengths are rounded to ``GRAPHED_LENGTH_MULTIPLE`` unless a multiple was given (few shapes: few graphs).
    """

    mini_batch_size: int | dict[str, int]
    mini_batch_tokens: int | None
    mini_batch_length_multiple: int | None
    cuda_graphs: bool
    activation_checkpointing: bool
    sparse_reps: str
    reuse_argmax: bool
    check_replay: bool
    gather_across_ranks: bool
    world_size: int
    keep_graphs: bool | dict[str, int] = False
    planned: bool = False

    def __post_init__(self) -> None:
        if self.cuda_graphs:
            object.__setattr__(self, "reuse_argmax", False)
            object.__setattr__(self, "keep_graphs", False)
            if self.mini_batch_length_multiple is None:
                object.__setattr__(self, "mini_batch_length_multiple", GRAPHED_LENGTH_MULTIPLE)

    def mini_batch_sizes(self, columns: Mapping[str, object]) -> dict[str, int]:
        """Each column's mini-batch size (a mapping was checked to have one entry per column)."""
        if isinstance(self.mini_batch_size, Mapping):
            return {column: self.mini_batch_size[column] for column in columns}
        return dict.fromkeys(columns, self.mini_batch_size)

    def kept_mini_batches(self, column: str, count: int) -> int:
        """How many of the last of ``column``'s ``count`` mini-batches keep their Step (1) graph."""
        if isinstance(self.keep_graphs, Mapping):
            return min(self.keep_graphs.get(column, 0), count)
        return count if self.keep_graphs else 0

    def mini_batch_size_text(self) -> str:
        """``mini_batch_size`` as logs write it: ``32``, or per column ``query 64, positive 32``."""
        if isinstance(self.mini_batch_size, Mapping):
            return ", ".join(f"{column} {size}" for column, size in self.mini_batch_size.items())
        return str(self.mini_batch_size)

    def describe(self) -> str:
        """One line: every setting, for a log."""

        def on(value: bool) -> str:
            return "on" if value else "off"

        return (
            f"mini_batch_size {self.mini_batch_size_text()}{' (planned within max_memory)' if self.planned else ''}; "
            f"mini_batch_tokens {self.mini_batch_tokens}; mini_batch_length_multiple "
            f"{self.mini_batch_length_multiple}; cuda_graphs {on(self.cuda_graphs)}; activation checkpointing "
            f"{on(self.activation_checkpointing)}; sparse_reps {self.sparse_reps}; reuse_argmax "
            f"{on(self.reuse_argmax)}; keep_graphs {self._keep_graphs_text()}; check_replay "
            f"{on(self.check_replay)}; gather_across_ranks "
            f"{on(self.gather_across_ranks)} ({self.world_size} rank(s) per loss)"
        )

    def _keep_graphs_text(self) -> str:
        if isinstance(self.keep_graphs, Mapping) and any(self.keep_graphs.values()):
            return ", ".join(f"{column} {count} mini-batch(es)" for column, count in self.keep_graphs.items())
        return "all" if self.keep_graphs is True else "off"


def resolve_settings(
    config: GradCacheConfig, facts: EngineFacts, *, world_size: int | None = None
) -> StepSettings:
    """``config`` decided for an encoder with ``facts`` (:func:`encoder_facts`), before any plan.
    ``world_size``: how many ranks' batches the loss sees (default:
    :func:`~gradcache_sparton.engine.distributed.data_parallel_world_size` of ``gather_across_ranks``).

    What ``max_memory`` would plan takes the engine's defaults until a plan chooses it
    (:func:`~gradcache_sparton.engine.planner.memory_plan.choose_plan`, from these settings):
    ``DEFAULT_MINI_BATCH_SIZE`` rows, no CUDA graphs, dense reps, no graphs kept, activation checkpointing as
    the model has it. ``check_replay`` and ``reuse_argmax`` left None are on, off for a compiled encoder
    (``torch.compile``: its graph-less and graph-recording programs may round differently, and its head
    records nothing). ``mini_batch_length_multiple`` left None is ``GRAPHED_LENGTH_MULTIPLE`` for a compiled
    encoder (few shapes: few recompilations) and under CUDA graphs (:class:`StepSettings`).
    ``gather_across_ranks`` left None gathers when ``torch.distributed`` runs more than one rank.
    """
    sizes = config.mini_batch_size
    if isinstance(sizes, Mapping):
        sizes = {column: DEFAULT_MINI_BATCH_SIZE if size is None else size for column, size in sizes.items()}
    length_multiple = config.mini_batch_length_multiple
    if length_multiple is None and facts.compiled:
        length_multiple = GRAPHED_LENGTH_MULTIPLE
    if world_size is None:
        world_size = data_parallel_world_size(config.gather_across_ranks)
    return StepSettings(
        mini_batch_size=DEFAULT_MINI_BATCH_SIZE if sizes is None else sizes,
        mini_batch_tokens=config.mini_batch_tokens,
        mini_batch_length_multiple=length_multiple,
        cuda_graphs=bool(config.cuda_graphs),
        activation_checkpointing=facts.checkpointing,
        sparse_reps=config.sparse_reps or "false",
        reuse_argmax=not facts.compiled if config.reuse_argmax is None else config.reuse_argmax,
        check_replay=not facts.compiled if config.check_replay is None else config.check_replay,
        gather_across_ranks=world_size > 1,
        world_size=world_size,
        keep_graphs=bool(config.keep_graphs),
    )


def encoder_facts(encoder: object, *, data_parallel: bool | None = None) -> EngineFacts:
    """What the options' rules and the settings read about ``encoder``: a module or a function, whether it
    routes by column, is compiled, has activation checkpointing on; ``data_parallel`` as the engine knows it
    (None: not known)."""
    return EngineFacts(
        module=isinstance(encoder, nn.Module),
        routes_by_column=routes_by_column(encoder),
        data_parallel=data_parallel,
        compiled=is_compiled(encoder),
        checkpointing=checkpointing_on(encoder),
    )


def plans_memory(config: GradCacheConfig, device_type: str, *, data_parallel: bool) -> bool:
    """Whether ``max_memory`` plans the steps of an engine on ``device_type`` (``"cuda"``, ``"cpu"``, ...):
    a budget is set, the device is CUDA (the plan measures CUDA memory) and no data parallelism runs (its
    ranks would have to agree on one plan: a size is refused there, ``"auto"`` ignored). A caller that feeds
    the engine (a trainer's collator) reads it, rather than deciding it again: a planned run pads every batch
    to its max lengths, so the plan made on the first batch covers the run."""
    return config.max_memory is not None and device_type == "cuda" and not data_parallel


def checkpointing_on(encoder: object) -> bool:
    """Whether a module of ``encoder`` has activation checkpointing on (transformers' flag)."""
    if not isinstance(encoder, nn.Module):
        return False
    return any(getattr(module, "gradient_checkpointing", False) is True for module in encoder.modules())


def is_compiled(encoder: object) -> bool:
    """Whether ``encoder`` is, or holds, a module compiled with ``torch.compile`` (a wrapper) or
    ``nn.Module.compile()`` (in place)."""
    if not isinstance(encoder, nn.Module):
        return False
    return any(
        hasattr(module, "_orig_mod") or getattr(module, "_compiled_call_impl", None) is not None
        for module in encoder.modules()
    )
