"""What the engine runs a step with: :func:`resolve_settings`, the one place its options are decided.

:class:`~gradcache_sparton.engine.GradCacheConfig` holds what the user asked, None where the engine is to
decide. :func:`resolve_settings` decides it, from the encoder (a compiled one), the ranks whose batches the
loss sees (gathering) and, when ``max_memory`` is set, the measured plan
(:class:`~gradcache_sparton.engine.planner.memory_plan.MemoryPlan`), into :class:`StepSettings`: concrete values, the
only ones Steps (1)-(3) read. :class:`~gradcache_sparton.engine.GradCache` resolves them when it is built
(``GradCache.settings``) and again after each plan (``GradCache.plan``); a trainer logs them from there.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from torch import nn

from gradcache_sparton.engine.config import GradCacheConfig, is_compiled
from gradcache_sparton.engine.distributed import data_parallel_world_size
from gradcache_sparton.engine.planner.memory_plan import MemoryPlan

__all__ = [
    "DEFAULT_MINI_BATCH_SIZE",
    "StepSettings",
    "checkpointing_on",
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
    config: GradCacheConfig, encoder: object, plan: MemoryPlan | None = None, *, world_size: int | None = None
) -> StepSettings:
    """``config`` decided for ``encoder`` (and ``plan``, the options a ``max_memory`` plan chose; its
    explicit ones were kept when planning). ``world_size``: how many ranks' batches the loss sees (default:
    :func:`~gradcache_sparton.engine.distributed.data_parallel_world_size` of ``gather_across_ranks``).

    Without a plan, what ``max_memory`` would plan takes the engine's defaults: ``DEFAULT_MINI_BATCH_SIZE``
    rows, no CUDA graphs, dense reps. ``check_replay`` and ``reuse_argmax`` left None are on, off for a
    compiled encoder (``torch.compile``: its graph-less and graph-recording programs may round differently,
    and its head records nothing); ``reuse_argmax`` is off under CUDA graphs (its records are kept on the
    host). ``keep_graphs`` left None is the plan's choice, else off; off under CUDA graphs.
    ``mini_batch_length_multiple`` left None is ``GRAPHED_LENGTH_MULTIPLE`` under CUDA graphs and for
    a compiled encoder (few shapes: few graphs, few recompilations). ``gather_across_ranks`` left None
    gathers when ``torch.distributed`` runs more than one rank.
    """
    compiled = is_compiled(encoder)
    if plan is None:
        sizes = config.mini_batch_size
        if isinstance(sizes, Mapping):
            sizes = {
                column: DEFAULT_MINI_BATCH_SIZE if size is None else size for column, size in sizes.items()
            }
        mini_batch_size = DEFAULT_MINI_BATCH_SIZE if sizes is None else sizes
        cuda_graphs, reuse_argmax = bool(config.cuda_graphs), config.reuse_argmax
        sparse_reps = config.sparse_reps
        keep_graphs: bool | dict[str, int] = bool(config.keep_graphs)
        checkpointing = checkpointing_on(encoder)
    else:
        mini_batch_size, cuda_graphs = dict(plan.mini_batch_size), plan.cuda_graphs
        reuse_argmax, sparse_reps = plan.reuse_argmax, plan.sparse_reps
        keep_graphs = plan.keep_graphs if isinstance(plan.keep_graphs, bool) else dict(plan.keep_graphs)
        checkpointing = plan.checkpointing
    if cuda_graphs:
        reuse_argmax, keep_graphs = False, False
    length_multiple = config.mini_batch_length_multiple
    if length_multiple is None and (cuda_graphs or compiled):
        length_multiple = GRAPHED_LENGTH_MULTIPLE
    if world_size is None:
        world_size = data_parallel_world_size(config.gather_across_ranks)
    return StepSettings(
        mini_batch_size=mini_batch_size,
        mini_batch_tokens=config.mini_batch_tokens,
        mini_batch_length_multiple=length_multiple,
        cuda_graphs=cuda_graphs,
        activation_checkpointing=checkpointing,
        sparse_reps=sparse_reps or "false",
        reuse_argmax=not compiled if reuse_argmax is None else reuse_argmax,
        check_replay=not compiled if config.check_replay is None else config.check_replay,
        gather_across_ranks=world_size > 1,
        world_size=world_size,
        keep_graphs=keep_graphs,
        planned=plan is not None,
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
