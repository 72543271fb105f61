"""``max_memory``: the engine options that make a step fastest within a memory budget, from a measured probe.

On the first training step (and again when a batch is longer or larger than the one planned for), on
CUDA only, :class:`~gradcache_sparton.engine.planner.memory_probe.MemoryPlanner` measures, per column at the batch's padded length, the peak memory
as the process reserves it (the growth of ``torch.cuda.max_memory_reserved``, at least that of
``max_memory_allocated``: what ``nvidia-smi`` and a per-process memory cap see) of one mini-batch's forward
and backward as Step (3) runs it (under
the step's autocast) at a few row counts, fits ``peak(rows) = fixed + per_row * rows``
(:class:`ColumnFit`), and :func:`choose_plan` picks:

- the largest mini-batch per column whose predicted peak, plus what stays resident during the step
  (:class:`Footprint`: weights and whatever is held, gradients, the optimizer's state, the reps of the
  whole batch and their gradients, ``reuse_argmax``'s records), stays within the budget less a margin;
- ``reuse_argmax`` (when left to its default) off where its records would cost more than a tenth of the
  mini-batch (they hold about 12 bytes per non-zero rep entry: much at a fresh model's density);
- CUDA graphs at 32 rows where the largest eager mini-batch is small (under 96 rows: there the host's
  per-kernel cost dominates; issue 37's table) and the graphs' pool fits;
- the sparse rep cache (``sparse_reps``, when left unset) where the dense reps and their gradients leave
  no plan that fits (mini-batches under 16 rows, or the loss over the whole batch beyond the budget), before
  activation checkpointing (:func:`choose_plan` says why);
- activation checkpointing of the backbone where not even 16 rows fit without it (and the model has
  ``gradient_checkpointing_enable``), measured again with it;
- ``keep_graphs`` with the room left beside the rest of the step (:func:`choose_kept_graphs`): the last
  mini-batches of each column keep their Step (1) graph, which Step (3) backprops without encoding them
  again (a graph held from Step (1) to Step (3) costs what its mini-batch's measured peak does). With memory
  to spare that is every mini-batch: an uncached step.

Every explicit setting is kept (a ``mini_batch_size``, ``cuda_graphs``, ``reuse_argmax``, ``sparse_reps``,
``keep_graphs``, checkpointing turned on); the plan only decides how rows are cut and run and how the reps are
held, never the loss or the gradients (sparse reps give the dense ones up to fp32 summation order): the probe's
gradients and RNG draws are put back. It logs one line with the measured numbers
(:meth:`MemoryPlan.describe`) and is kept on the engine (``GradCache.memory_plan``), which runs its settings
(``MemoryPlan.settings``: the engine's settings before the plan, with the options it chose; ``GradCache.settings``).

Off CUDA there is nothing to measure: a size is ignored with one warning, ``"auto"`` quietly. Under data
parallelism the ranks would have to agree on one plan: a size is refused when the engine is built,
``"auto"`` is ignored.

Legend: B rows of a column, S its padded length, V rep width.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

from torch import Tensor

from gradcache_sparton.engine.checks import rows_of
from gradcache_sparton.engine.config import GradCacheConfig
from gradcache_sparton.engine.memory_size import format_bytes
from gradcache_sparton.engine.option_rules import EngineFacts
from gradcache_sparton.engine.settings import StepSettings, resolve_settings
from gradcache_sparton.engine.types import Columns

__all__ = [
    "ColumnFit",
    "Footprint",
    "MemoryPlan",
    "choose_kept_graphs",
    "choose_plan",
    "padded_length",
]

PLAN_MARGIN = 0.05
"""Fraction of the budget kept free: the fit's error, the allocator's rounding, small temporaries."""
MIN_ROWS = 16
"""Fewer rows than this (or the column's rows, if fewer) per mini-batch: activation checkpointing instead."""
GRAPH_ROWS = 32
"""Rows per mini-batch under CUDA graphs chosen by the plan."""
GRAPHS_BELOW_ROWS = 96
"""CUDA graphs (at ``GRAPH_ROWS``) when the largest eager mini-batch is under this many rows."""
GRAPH_FIXED_FACTOR = 4.0
GRAPH_ROW_FACTOR = 1.15
"""A graphed mini-batch's peak against its eager fit (``fixed + per_row * rows``): ``GRAPH_FIXED_FACTOR *
fixed + GRAPH_ROW_FACTOR * per_row * rows``. Once recorded, every shape's graphs keep their pool reserved,
with their static inputs and outputs and the autocast copies of the weights: what an eager mini-batch
frees. Fitted to the reserved peaks of 16 and 32 graphed rows (3.39 and 4.34 GiB; 6-layer BERT-base width,
three columns, 1,024 rows, H200, benchmarks/results/max_memory_h200_reserved.json), whose eager fit was
221.55 MiB + 51.61 MiB per row at 256 tokens, with 1.61 GiB resident; one factor of 1.25 on both before
predicted 3.77 GiB for 30 graphed rows, which held 4.26."""
REUSE_ARGMAX_KEEP = 0.9
"""``reuse_argmax`` stays on (when left to its default) if it keeps this fraction of the mini-batch rows."""
KEEP_MAX_SPLIT = 4
"""A column planned whole whose graph does not fit may be cut into up to this many mini-batches, so that more
of its rows keep their graph (smaller mini-batches run slower: a bound on the trade)."""
SPARSE_DENSITY_HEADROOM = 1.5
"""Sparse reps are planned for this many times the non-zeros the probe saw (at most every entry): their memory
follows the non-zeros, which training moves after the plan (a regularizer warming up from zero lets them
grow), where dense reps take the same bytes at any density. A step whose reps outgrow it has the next step
planned again (:meth:`~gradcache_sparton.engine.planner.memory_probe.MemoryPlanner.check_entries`)."""


@dataclass(frozen=True)
class ColumnFit:
    """Measured peak of one mini-batch's forward and backward in a column: ``fixed + per_row * rows`` bytes
    above what the process held before it (reserved, at least allocated), at padded ``length``; and the
    column's reps (width, bytes per entry, fraction non-zero) as the probe saw them."""

    fixed: float
    per_row: float
    length: int
    width: int = 0
    rep_bytes: int = 4
    density: float = 1.0
    points: tuple[tuple[int, int], ...] = ()  # the measured (rows, peak bytes) the line was fitted to

    @classmethod
    def from_points(cls, points: Sequence[tuple[int, int]], length: int, **reps: float) -> ColumnFit:
        """The least-squares line through (rows, peak bytes) ``points``, raised so that it lies on or
        above every point (a conservative fit). One point: a line through the origin."""
        if not points:
            raise ValueError("ColumnFit needs at least one measured point")
        rows = [float(r) for r, _ in points]
        peaks = [float(p) for _, p in points]
        if len(set(rows)) < 2:
            per_row, fixed = max(peaks) / max(rows[0], 1.0), 0.0
        else:
            mean_r, mean_p = sum(rows) / len(rows), sum(peaks) / len(peaks)
            per_row = sum((r - mean_r) * (p - mean_p) for r, p in zip(rows, peaks, strict=True)) / sum(
                (r - mean_r) ** 2 for r in rows
            )
            per_row = max(per_row, 0.0)
            fixed = max(p - per_row * r for r, p in zip(rows, peaks, strict=True))
        return cls(fixed=fixed, per_row=per_row, length=length, **reps, points=tuple(points))

    def with_point(self, rows: int, peak: int) -> ColumnFit:
        """The fit again with one more measured point (it then lies on or above that one too)."""
        reps = {"width": self.width, "rep_bytes": self.rep_bytes, "density": self.density}
        return ColumnFit.from_points([*self.points, (rows, peak)], self.length, **reps)

    def peak(self, rows: int) -> float:
        """Predicted peak bytes of a mini-batch of ``rows`` rows."""
        return self.fixed + self.per_row * rows

    def sparse_entries(self, rows: int) -> float:
        """Non-zero rep entries that ``rows`` rows are planned for as sparse reps (``SPARSE_DENSITY_HEADROOM``)."""
        return min(rows * self.width, SPARSE_DENSITY_HEADROOM * rows * self.width * self.density)

    def _line(self, graphs: bool) -> tuple[float, float]:
        """(fixed, per_row) bytes of a mini-batch run eagerly, or replayed as CUDA graphs."""
        if graphs:
            return GRAPH_FIXED_FACTOR * self.fixed, GRAPH_ROW_FACTOR * self.per_row
        return self.fixed, self.per_row

    def graphed_peak(self, rows: int) -> float:
        """Predicted peak bytes of a mini-batch of ``rows`` rows replayed as CUDA graphs."""
        fixed, per_row = self._line(graphs=True)
        return fixed + per_row * rows

    def largest(self, room: float, cap: int, graphs: bool = False) -> int:
        """Most rows (at most ``cap``) whose peak (graphed where ``graphs``) fits in ``room`` bytes; 0 if none."""
        fixed, per_row = self._line(graphs)
        if per_row <= 0:
            return cap if fixed <= room else 0
        return max(0, min(cap, math.floor((room - fixed) / per_row)))


@dataclass(frozen=True)
class Footprint:
    """What stays held during a step besides the mini-batch being run, in bytes (reserved by the process,
    as the probe counts it: :mod:`~gradcache_sparton.engine.planner.memory_probe`).

    ``allocated``: already held when planning, reserved with the allocator's cache emptied (weights, the
    batch, gradients and optimizer state that exist); ``grads``: parameter gradients not allocated yet;
    ``optimizer``: optimizer state not allocated yet (estimated); ``rep_cache``: the whole batch's dense [B, V] reps and their gradients;
    ``records``: ``reuse_argmax``'s records of the whole batch, were it on; ``sparse_rep_cache``: the reps
    and their gradients kept as their non-zeros instead (``sparse_reps``); ``sparse_loss``: the
    temporaries of the loss over sparse reps (its densified [block, V] buffers and its copies per non-zero);
    ``graphs``: what recording CUDA graphs adds once besides each graph's pool, the recording stream's
    cuBLAS workspaces (measured). (CUDA graphs add into buffers that become the parameters' ``.grad``: no
    more than ``grads``.)
    """

    allocated: int
    grads: int
    optimizer: int
    rep_cache: int
    records: int
    sparse_rep_cache: int
    sparse_loss: int
    graphs: int = 0

    def resident(self, *, records: bool, sparse: bool) -> int:
        """Bytes held through Step (3), with or without ``reuse_argmax``'s records, with dense or sparse reps."""
        reps = self.sparse_rep_cache if sparse else self.rep_cache
        return self.allocated + self.grads + self.optimizer + reps + (self.records if records else 0)

    def loss_peak(self, *, sparse: bool) -> int:
        """Bytes at Step (2), the loss over the whole batch: what is resident, the reps and their gradients,
        and the loss's temporaries: for dense reps about half as much again (a regularizer's |r|, the loss's
        own gradients), for sparse ones ``sparse_loss``."""
        held = self.allocated + self.grads + self.optimizer
        if sparse:
            return held + self.sparse_rep_cache + self.sparse_loss
        return held + self.rep_cache * 3 // 2


@dataclass(frozen=True)
class MemoryPlan:
    """What a budget chose, with the numbers it was chosen from: ``settings``, the step's every option decided
    (the configured ones kept, the plan's choices for those left unset); ``predicted_peak`` and ``resident``,
    bytes; each column's measured ``fits`` and ``rows``; and the ``reason``, in words."""

    budget: int
    settings: StepSettings
    predicted_peak: int
    resident: int
    fits: dict[str, ColumnFit]
    rows: dict[str, int]
    reason: str

    def covers(self, columns: Columns) -> bool:
        """Whether ``columns`` are no larger (rows, padded length) than the batch this plan measured."""
        if set(columns) != set(self.rows):
            return False
        return all(
            rows_of(features) <= self.rows[column] and padded_length(features) <= self.fits[column].length
            for column, features in columns.items()
        )

    def sparse_entries(self) -> int:
        """The non-zero rep entries of the whole batch (every column) the plan counted for sparse reps."""
        return int(sum(self.fits[column].sparse_entries(rows) for column, rows in self.rows.items()))

    def describe(self) -> str:
        """One line: what was chosen and why, with the measured numbers."""
        settings = self.settings
        columns = ", ".join(
            f"{column} {size} rows (probe at length {self.fits[column].length}: "
            f"{format_bytes(self.fits[column].fixed)} + {format_bytes(self.fits[column].per_row)}/row)"
            for column, size in settings.mini_batch_sizes(self.rows).items()
        )
        reps = {"true": "sparse (non-zeros)", "false": "dense", "auto": "auto (counted dense)"}
        kept = settings.keep_graphs
        if isinstance(kept, dict) and any(kept.values()):
            kept_text = ", ".join(f"{column} {count}" for column, count in kept.items())
        else:
            kept_text = "all" if kept is True else "none"
        return (
            f"max_memory {format_bytes(self.budget)}: mini-batches {columns}; CUDA graphs "
            f"{'on' if settings.cuda_graphs else 'off'}, activation checkpointing "
            f"{'on' if settings.activation_checkpointing else 'off'}, reuse_argmax "
            f"{'on' if settings.reuse_argmax else 'off'}, reps {reps[settings.sparse_reps]}, mini-batches keeping "
            f"their graph {kept_text}; predicted peak "
            f"{format_bytes(self.predicted_peak)} (resident {format_bytes(self.resident)}); {self.reason}"
        )

    def log_values(self) -> dict[str, float]:
        """The plan as numbers for a trainer's logs."""
        settings = self.settings
        values = {
            "memory_plan_budget_gib": round(self.budget / 2**30, 3),
            "memory_plan_predicted_peak_gib": round(self.predicted_peak / 2**30, 3),
            "memory_plan_cuda_graphs": float(settings.cuda_graphs),
            "memory_plan_checkpointing": float(settings.activation_checkpointing),
        }
        values["memory_plan_sparse_reps"] = float(settings.sparse_reps == "true")
        if isinstance(settings.keep_graphs, dict):
            for column, count in settings.keep_graphs.items():
                values[f"memory_plan_keep_graphs_{column}"] = float(count)
        for column, size in settings.mini_batch_sizes(self.rows).items():
            values[f"memory_plan_mini_batch_size_{column}"] = float(size)
        return values


@dataclass(frozen=True)
class _Candidate:
    """Settings the plan weighs, with what their memory counts: ``records``, ``reuse_argmax``'s records held
    (counted also where a compiled encoder's head will record nothing); ``sparse``, the reps held as their
    non-zeros (``"auto"`` counted dense); the predicted ``peak`` and the ``resident`` bytes."""

    settings: StepSettings
    records: bool
    sparse: bool
    peak: int
    resident: int

    @property
    def sizes(self) -> dict[str, int]:
        """Each column's mini-batch rows (a plan's settings name every column)."""
        sizes = self.settings.mini_batch_size
        assert isinstance(sizes, dict)
        return sizes


@dataclass(frozen=True)
class _Problem:
    """What :func:`choose_plan` plans for: the budget in bytes, each column's rows, what stays resident, the
    options as asked (``config``: None where the plan chooses), the encoder's facts and the settings before
    any plan (``base``: the configured options decided, :func:`~gradcache_sparton.engine.settings.resolve_settings`)."""

    budget: int
    rows: Mapping[str, int]
    footprint: Footprint
    config: GradCacheConfig
    facts: EngineFacts
    base: StepSettings

    @property
    def explicit(self) -> dict[str, int | None]:
        """Each column's mini-batch size as configured, None where planned."""
        return self.config.mini_batch_sizes(self.rows)

    @property
    def usable(self) -> float:
        """The budget less ``PLAN_MARGIN``: what a predicted peak may reach."""
        return self.budget * (1 - PLAN_MARGIN)


def choose_plan(
    budget: int,
    rows: Mapping[str, int],
    measure: Callable[[bool], Mapping[str, ColumnFit]],
    footprint: Footprint,
    config: GradCacheConfig,
    facts: EngineFacts | None = None,
) -> MemoryPlan:
    """The fastest settings whose predicted peak stays within ``budget`` bytes (less ``PLAN_MARGIN``), as the
    plan's :class:`~gradcache_sparton.engine.settings.StepSettings` (``MemoryPlan.settings``: what the step runs).

    ``measure(checkpointing)`` gives each column's :class:`ColumnFit` (called again with True only when
    nothing fits without checkpointing). Mini-batch rows never exceed a column's ``rows``. ``config``: the
    options as the user gave them (each left unset is planned, each set is kept, as
    :func:`~gradcache_sparton.engine.settings.resolve_settings` decides it); ``facts``: the encoder's
    (compiled, activation checkpointing on or possible, CUDA graphs possible).

    The rep cache, when ``sparse_reps`` is left unset: dense first, sparse (the reps and their gradients
    kept as their non-zeros) only where no dense plan fits in that checkpointing mode, i.e. where dense
    mini-batches would be under ``MIN_ROWS`` rows or the loss over the whole batch would exceed the budget.
    Dense where it fits: it is the faster cache at batches that fit dense at all (BERT-base width, V 30,522,
    1,024 rows, reps ~2% non-zero: 1.19 s a step against 1.33 s sparse; docs/benchmarks.md), and its memory
    does not depend on how many non-zeros training makes. Sparse before activation checkpointing: that
    recomputes the backbone's forward in every replayed mini-batch (about a quarter more encoder work a
    step), more than the sparse cache's ~12%, so a sparse plan without checkpointing is the better of the two.

    Raises:
        ValueError: naming ``max_memory``, when not even ``MIN_ROWS`` rows fit (with checkpointing where
            possible, and sparse reps where left unset) and no mini-batch size was set explicitly.
    """
    facts = EngineFacts() if facts is None else facts
    problem = _Problem(budget, rows, footprint, config, facts, resolve_settings(config, facts))
    modes = [True] if facts.checkpointing else [False, *([True] if facts.can_checkpoint else [])]
    layouts = [False, True] if config.sparse_reps is None else [config.sparse_reps == "true"]
    last: tuple[bool, dict[str, ColumnFit], _Candidate] | None = None
    for checkpointing in modes:
        fits = dict(measure(checkpointing))
        tried = []
        for sparse in layouts:
            candidates = _candidates(problem, fits, checkpointing, sparse)
            chosen = _pick(candidates, problem)
            if chosen is not None:
                return _plan(problem, fits, chosen, checkpointing)
            tried += candidates
        last = (checkpointing, fits, min(tried, key=lambda c: c.resident))
    assert last is not None
    checkpointing, fits, smallest = last
    if any(size is not None for size in problem.explicit.values()):
        # explicit: kept, warned
        return _plan(problem, fits, smallest, checkpointing)
    need = smallest.resident + max(fits[c].peak(min(MIN_ROWS, rows[c])) for c in rows)
    reps = "the batch's reps as their non-zeros" if smallest.sparse else "the batch's dense reps"
    advice = "" if True in layouts else " keep the reps sparse (sparse_reps true),"
    raise ValueError(
        f"max_memory {format_bytes(budget)} is too small for this model and batch: {MIN_ROWS} rows per "
        f"mini-batch need a predicted {format_bytes(need)} (resident {format_bytes(smallest.resident)}: "
        f"weights, gradients, optimizer state, {reps}), the loss over the whole batch "
        f"{format_bytes(footprint.loss_peak(sparse=smallest.sparse))}, activation checkpointing "
        f"{'on' if checkpointing else 'not available'}, and {PLAN_MARGIN:.0%} is kept free; raise max_memory, "
        f"lower per_device_train_batch_size,{advice} or set mini_batch_size to run regardless"
    )


def _candidates(
    problem: _Problem, fits: Mapping[str, ColumnFit], checkpointing: bool, sparse: bool
) -> list[_Candidate]:
    usable, rows, footprint, config = problem.usable, problem.rows, problem.footprint, problem.config
    compiled_default = config.reuse_argmax is None and problem.facts.compiled  # its head records nothing
    graphs_options = [False]
    if config.cuda_graphs is True:  # asked for: kept (the engine says if it cannot run them)
        graphs_options = [True]
    elif config.cuda_graphs is None and problem.facts.graphs_possible(config):
        graphs_options = [False, True]
    candidates = []
    for graphs in graphs_options:
        if graphs:
            records_options = [False]
        else:
            records_options = [True, False] if config.reuse_argmax is None else [config.reuse_argmax]
        for records in records_options:
            resident = footprint.resident(records=records, sparse=sparse)
            resident += footprint.graphs if graphs else 0
            sizes = {}
            for column, cap in rows.items():
                explicit = problem.explicit[column]
                largest = fits[column].largest(usable - resident, cap, graphs)
                if graphs and config.cuda_graphs is None:
                    largest = min(largest, GRAPH_ROWS)
                sizes[column] = explicit if explicit is not None else largest
            mini_batch = max(
                fits[c].graphed_peak(sizes[c]) if graphs else fits[c].peak(sizes[c]) for c in rows
            )
            peak = max(resident + mini_batch, footprint.loss_peak(sparse=sparse))
            settings = replace(
                problem.base,
                mini_batch_size=sizes,
                cuda_graphs=graphs,
                activation_checkpointing=checkpointing,
                # Left to its default: on where the plan counts its records, off for a compiled encoder and
                # under CUDA graphs (StepSettings).
                reuse_argmax=records and not compiled_default,
                sparse_reps=config.sparse_reps or ("true" if sparse else "false"),
                planned=True,
            )
            candidates.append(_Candidate(settings, records, sparse, int(peak), resident))
    return candidates


def _pick(candidates: list[_Candidate], problem: _Problem) -> _Candidate | None:
    """The fitting candidate expected fastest: the largest eager mini-batches (``reuse_argmax`` on if it
    keeps ``REUSE_ARGMAX_KEEP`` of the rows), CUDA graphs instead where those are under ``GRAPHS_BELOW_ROWS``
    rows (or graphs were asked for); None if none fits."""
    rows, usable, config = problem.rows, problem.usable, problem.config
    planned = [c for c in rows if problem.explicit[c] is None]

    def fitting(candidate: _Candidate) -> bool:
        enough = all(candidate.sizes[c] >= min(MIN_ROWS, rows[c]) for c in planned)
        return enough and candidate.peak <= usable

    eager = [c for c in candidates if not c.settings.cuda_graphs and fitting(c)]
    graphed = [c for c in candidates if c.settings.cuda_graphs and fitting(c)]
    best = None
    if eager:
        on = next((c for c in eager if c.records), None)
        off = next((c for c in eager if not c.records), None)
        best = on or off
        if on is not None and off is not None:
            kept = min(on.sizes[c] / max(off.sizes[c], 1) for c in rows)
            best = on if kept >= REUSE_ARGMAX_KEEP else off
    if not graphed:
        return best
    if config.cuda_graphs is True or best is None:
        return graphed[0]
    # Graphs pay where the eager mini-batches are small; a column that fits whole is not "small".
    split = [best.sizes[c] for c in planned if best.sizes[c] < rows[c]]
    return graphed[0] if split and min(split) < GRAPHS_BELOW_ROWS else best


def _plan(
    problem: _Problem, fits: dict[str, ColumnFit], chosen: _Candidate, checkpointing: bool
) -> MemoryPlan:
    usable, rows, footprint, config = problem.usable, problem.rows, problem.footprint, problem.config
    reasons = []
    planned = [c for c in rows if problem.explicit[c] is None]
    if chosen.peak > usable:
        reasons.append(
            f"WARNING: the explicit mini_batch_size is predicted to exceed the budget less {PLAN_MARGIN:.0%}"
        )
    if chosen.settings.cuda_graphs and config.cuda_graphs is None:
        reasons.append(
            f"CUDA graphs: the largest eager mini-batch that fits is under {GRAPHS_BELOW_ROWS} rows"
        )
    if chosen.sparse and config.sparse_reps is None:
        dense_loss = footprint.loss_peak(sparse=False)
        if dense_loss > usable:
            why = f"the loss over the whole batch would peak at {format_bytes(dense_loss)}"
        elif planned:
            why = f"not {MIN_ROWS} rows per mini-batch fit beside them"
        else:
            why = "the explicit mini-batches would not fit beside them"
        reasons.append(
            f"sparse reps: with the dense reps and their gradients ({format_bytes(footprint.rep_cache)}) {why}; "
            f"as their non-zeros they take {format_bytes(footprint.sparse_rep_cache)}"
        )
    if checkpointing and not problem.facts.checkpointing:
        reasons.append(f"activation checkpointing: not {MIN_ROWS} rows fit without it")
    if planned and all(chosen.sizes[c] >= rows[c] for c in planned):
        reasons.append("the whole batch fits in one mini-batch per column")
    sizes, peak = dict(chosen.sizes), chosen.peak
    kept = dict.fromkeys(rows, 0) if config.keep_graphs is None else None
    if config.keep_graphs is not False and not chosen.settings.cuda_graphs and chosen.peak <= usable:
        # Graphs kept from Step (1) to Step (3) sit beside the reps, the loss's temporaries or the backward
        # of another kept one; the other mini-batches run before them (Step (1)) and after them (Step (3)).
        held = max(footprint.loss_peak(sparse=chosen.sparse), chosen.resident)
        if config.keep_graphs:  # True: every mini-batch, counted in the predicted peak
            kept_bytes = sum(
                math.ceil(rows[c] / sizes[c]) * fits[c].peak(min(sizes[c], rows[c])) for c in rows
            )
            peak = max(peak, int(held + kept_bytes))
            if peak > usable:
                reasons.append(
                    f"WARNING: keep_graphs is predicted to exceed the budget less {PLAN_MARGIN:.0%}"
                )
        else:
            new_sizes, kept, kept_bytes = choose_kept_graphs(usable - held, rows, sizes, fits, planned)
            peak = max(peak, int(held + kept_bytes))
            if any(kept.values()):
                sizes = new_sizes
                whole = all(kept[c] * sizes[c] >= rows[c] for c in rows)
                reasons.append(
                    "every mini-batch keeps its graph (an uncached step)"
                    if whole
                    else f"the graphs that fit beside the step ({format_bytes(kept_bytes)}) are kept"
                )
    if not reasons:
        reasons.append("the largest mini-batches within the budget")
    settings = replace(chosen.settings, mini_batch_size={c: max(1, sizes[c]) for c in rows})
    return MemoryPlan(
        budget=problem.budget,
        settings=settings if kept is None else replace(settings, keep_graphs=kept),
        predicted_peak=peak,
        resident=chosen.resident,
        fits=fits,
        rows=dict(rows),
        reason="; ".join(reasons),
    )


def choose_kept_graphs(
    room: float,
    rows: Mapping[str, int],
    sizes: Mapping[str, int],
    fits: Mapping[str, ColumnFit],
    planned: Sequence[str],
) -> tuple[dict[str, int], dict[str, int], float]:
    """Which mini-batches keep their Step (1) graph within ``room`` bytes: per column of planned mini-batch
    size (``planned``; an explicit size says how much activation memory its column may take, and keeps none),
    in order, as many of its last mini-batches as fit, each costing its measured peak (``fits[column].peak``
    at its size: its saved activations and its backward's temporaries). A column planned whole (one
    mini-batch of all its rows) whose graph does not fit may be cut into up to ``KEEP_MAX_SPLIT`` mini-batches
    (at least ``MIN_ROWS`` rows each) where that keeps more of its rows; a column the budget already splits
    is not cut smaller (an 8 GiB plan that cut 418-row query mini-batches to 108 to keep three ran at 792
    pairs/s on an H200, where the uncut plan had run at 1,069-1,077).

    Returns:
        Each column's mini-batch size, its count of kept mini-batches, and the bytes the kept graphs take.
    """
    new_sizes, counts, used = dict(sizes), dict.fromkeys(rows, 0), 0.0
    for column in planned:
        n_rows, size = rows[column], max(1, min(sizes[column], rows[column]))
        best = (0, sizes[column], 0, 0.0)  # kept rows, mini-batch size, kept mini-batches, their bytes
        for split in range(1, (KEEP_MAX_SPLIT if size >= n_rows else 1) + 1):
            cut = math.ceil(size / split)
            if split > 1 and cut < MIN_ROWS:
                break
            each = fits[column].peak(cut)
            count = math.ceil(n_rows / cut)
            if each > 0 and room < math.inf:
                count = max(0, min(count, math.floor((room - used) / each)))
            kept_rows = min(count * cut, n_rows)
            if kept_rows > best[0]:
                best = (kept_rows, cut, count, count * each)
        _, new_sizes[column], counts[column], cost = best
        used += cost
    return new_sizes, counts, used


def padded_length(features: Mapping[str, Tensor]) -> int:
    """The column's padded length (its attention mask's width; 1 without a 2-D one)."""
    mask = features.get("attention_mask")
    return int(mask.shape[1]) if mask is not None and mask.ndim == 2 else 1
