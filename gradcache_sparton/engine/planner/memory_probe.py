"""The measured side of ``max_memory``: :class:`MemoryPlanner` probes a column's peak memory on CUDA
(:func:`measure_fits`), sizes what stays resident, reads the budget, and hands the numbers to
:func:`~gradcache_sparton.engine.planner.memory_plan.choose_plan` (the decision, which needs no GPU).

Memory is counted as the process reserves it (``torch.cuda.memory_reserved``: what ``nvidia-smi``, other
processes and ``torch.cuda.set_per_process_memory_fraction`` see), not only as its tensors allocate it:
each probe point starts from an emptied allocator cache and records the larger of its reserved and
allocated growth (the allocator's rounding and fragmentation included); what stays resident is what the
process reserves once its cache is emptied; the probe's own points stay within the budget (a point
predicted beyond it is not run, one that runs out of memory under a cap counts as not fitting); and the
cache the probe filled is emptied once the plan is chosen, so that the step starts from what it holds.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

import torch
from torch import Tensor, nn

from gradcache_sparton.engine.autocast_state import AutocastState
from gradcache_sparton.engine.checks import rows_of
from gradcache_sparton.engine.config import GradCacheConfig
from gradcache_sparton.engine.cuda_graphs import recording_stream
from gradcache_sparton.engine.grad_state import GradState
from gradcache_sparton.engine.memory_size import AUTO, size_bytes
from gradcache_sparton.engine.option_rules import EngineFacts, check_option_rules
from gradcache_sparton.engine.planner.allocator import use_expandable_segments
from gradcache_sparton.engine.planner.memory_plan import (
    PLAN_MARGIN,
    ColumnFit,
    Footprint,
    MemoryPlan,
    choose_plan,
    padded_length,  # how the plan reads a column's padded length, which the probe must read the same way
)
from gradcache_sparton.engine.rng_state import cuda_devices_of
from gradcache_sparton.engine.settings import DEFAULT_MINI_BATCH_SIZE, checkpointing_on, plans_memory
from gradcache_sparton.engine.types import Columns
from gradcache_sparton.primitives.column_routing import call_encoder
from gradcache_sparton.primitives.sparse_reps import SPARSE_BLOCK_MAX_BYTES, SparseReps

__all__ = ["MemoryPlanner", "measure_fits"]

logger = logging.getLogger(
    "gradcache_sparton.engine.planner.memory_plan"
)  # the plan's one log line, under its name

AUTO_MARGIN = 0.10
"""``"auto"``: this fraction of what the device has free (plus what this process holds) is left aside."""
PROBE_ROWS = (8, 16, 32)
"""Row counts the probe measures (those up to the column's rows)."""
CHECK_ROUNDS = 2
"""Times a plan's mini-batches beyond ``PROBE_ROWS`` are measured at their own size (the line fitted to
small mini-batches may under-predict large ones) and the plan chosen again with those points."""
_RECORD_BYTES = 12  # reuse_argmax: a max (4 bytes) and an argmax (8) per non-zero rep entry
_SPARSE_ENTRY_BYTES = 12  # sparse_reps: a weight (4 bytes) and an int64 id (8) per non-zero
# The loss over sparse reps (losses/sparse.py) beside them: per non-zero, the weights' fp32 copy and its
# gradient (4 + 4), the paired scores' int64 keys and search positions (8 + 8 + 8) and the weights they
# gather (4 + 4), or, at another time, the blocked log-sum-exp's int64 row and id of every entry, kept for
# one pass (8 + 8, beside what the paired scores keep for their backward: ~21 bytes per query entry, at
# most ~11 per entry where queries hold at most half the entries); and at most four densified fp32
# [block, V] buffers at once (losses/blocked.py's backward: a query and a document block and a product,
# fp32 or, in the bf16 product path, half-size blocks and a block repeated three times).
_SPARSE_LOSS_ENTRY_BYTES = 40
_SPARSE_LOSS_BLOCKS = 4
# The recording stream's workspace bytes, per stream (one per GPU): _stream_workspace_bytes
_WORKSPACE_BYTES: dict[torch.cuda.Stream, int] = {}


class MemoryPlanner:
    """Plans ``config``'s unset options within its ``max_memory`` for the batches an engine runs.

    Args:
        config: the options as given (before the engine's automatic defaults), with ``max_memory`` set.
        encoder: the engine's encoder.
        facts: the engine's facts about it
            (:func:`~gradcache_sparton.engine.settings.encoder_facts`); under data parallelism a size is
            refused (the ranks would have to agree on one plan) and ``"auto"`` ignored.

    Attributes:
        plan: the plan in effect (None before the first planned step, or where nothing is planned).
    """

    def __init__(self, config: GradCacheConfig, encoder: object, facts: EngineFacts) -> None:
        check_option_rules(config, facts)
        self.config = config
        self.encoder = encoder
        self._facts = facts
        self.plan: MemoryPlan | None = None
        self._off = facts.data_parallel is True
        if self._off:
            logger.info("max_memory auto is not planned under data parallelism: the engine's defaults apply")
        self._planned_once = False
        self._counted_sparse = False  # the plan counted the reps as their non-zeros

    def needs_plan(self, columns: Columns) -> bool:
        """Whether ``columns`` are to be planned for now: a training step (autograd on) on CUDA, the first
        or one larger (rows, padded length) than the plan's. Off CUDA, warns once (for a size) and says no."""
        if self._off or not torch.is_grad_enabled():
            return False
        device = _device(columns)
        if not plans_memory(self.config, device.type, data_parallel=False):  # data parallelism: _off already
            self._off = True
            if self.config.max_memory != AUTO:
                warnings.warn(
                    f"max_memory={self.config.max_memory!r} is ignored on {device.type}: the memory plan measures "
                    f"CUDA memory; the engine's defaults apply (mini_batch_size {DEFAULT_MINI_BATCH_SIZE} unless set)",
                    stacklevel=3,
                )
            return False
        return self.plan is None or not self.plan.covers(columns)

    def plan_for(self, columns: Columns, autocast: AutocastState) -> MemoryPlan:
        """Measure, choose and log a plan for ``columns``. Turns the CUDA allocator's expandable segments on
        (:mod:`~gradcache_sparton.engine.planner.allocator`, logged). Where the plan needs activation checkpointing, turns
        it on in the encoder's model (``gradient_checkpointing_enable``, logged): it stays on for that model,
        also after training (a model's later plans keep it; checkpoints do not record it)."""
        device = _device(columns)
        use_expandable_segments()  # before the probe's segments: the budget is a cap on what is reserved
        budget = _budget_bytes(self.config.max_memory, device)
        checkpointing = checkpointing_on(self.encoder)
        facts = replace(
            self._facts,
            checkpointing=checkpointing,
            can_checkpoint=_checkpointing_owner(self.encoder) is not None,
        )
        modules = self.encoder if isinstance(self.encoder, nn.Module) else nn.Module()
        trained = [p for p in modules.parameters() if p.requires_grad]
        measured: dict[bool, dict[str, ColumnFit]] = {}
        # What one probe point may reserve: the budget less what is held and the gradients the probe creates.
        missing_grads = sum(p.numel() * p.element_size() for p in trained if p.grad is None)
        room = budget - _held_bytes(device) - missing_grads

        def measure(with_checkpointing: bool) -> dict[str, ColumnFit]:
            owner = _checkpointing_owner(self.encoder)
            if with_checkpointing and owner is not None and not checkpointing_on(self.encoder):
                owner.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            measured[with_checkpointing] = measure_fits(
                self.encoder, columns, autocast, trained, device, room=room
            )
            return measured[with_checkpointing]

        # The footprint needs the reps' width and density: measure once without, before choosing.
        fits = measure(checkpointing)
        footprint = _footprint(columns, fits, trained, device, first=not self._planned_once)
        owner = _checkpointing_owner(self.encoder)
        rows = {column: rows_of(features) for column, features in columns.items()}

        def fits_for(on: bool) -> dict[str, ColumnFit]:
            return measured[on] if on in measured else measure(on)

        try:
            plan = choose_plan(budget, rows, fits_for, footprint, self.config, facts)
            # The line is fitted to small mini-batches: measure the plan's larger ones at their own size
            # (the encoder's checkpointing is as the plan has it) and choose again where one peaks higher.
            for _ in range(CHECK_ROUNDS):
                checked = _fits_checked_at(plan, columns, autocast, trained, device, self.encoder, room=room)
                if checked is None:
                    break
                measured[plan.settings.activation_checkpointing] = checked
                plan = choose_plan(budget, rows, fits_for, footprint, self.config, facts)
        except ValueError:
            if owner is not None and not checkpointing and checkpointing_on(self.encoder):
                owner.gradient_checkpointing_disable()  # turned on to measure: back as it was
            raise
        finally:
            torch.cuda.empty_cache()  # the probe's cached blocks: the step starts from what it holds
        if (
            owner is not None
            and not checkpointing
            and not plan.settings.activation_checkpointing
            and checkpointing_on(self.encoder)
        ):
            owner.gradient_checkpointing_disable()
        self.plan = plan
        self._planned_once = True
        self._counted_sparse = plan.settings.sparse_reps == "true"
        over = plan.predicted_peak > budget * (1 - PLAN_MARGIN)  # an explicit mini_batch_size kept
        logger.log(logging.WARNING if over else logging.INFO, "%s", plan.describe())
        if owner is not None and plan.settings.activation_checkpointing and not checkpointing:
            logger.info(
                "max_memory: activation checkpointing turned on in %s (gradient_checkpointing_enable, "
                "non-reentrant); it stays on for this model",
                type(owner).__name__,
            )
        return plan

    def check_entries(self, reps: Mapping[str, Tensor | SparseReps]) -> None:
        """After Step (1): where the plan counted sparse reps and this step's non-zeros (known on the host,
        no device sync) exceed those it counted, plan the next step again at their density (one warning)."""
        if self.plan is None or not self._counted_sparse:
            return
        entries = sum(rep.weights.numel() for rep in reps.values() if isinstance(rep, SparseReps))
        if entries > self.plan.sparse_entries():
            logger.warning(
                "max_memory: this step's reps have %d non-zeros, more than the %d its plan counted; the next "
                "step is planned again at their density",
                entries,
                self.plan.sparse_entries(),
            )
            self.plan = None


def measure_fits(
    encoder: Callable[..., Tensor],
    columns: Columns,
    autocast: AutocastState,
    trained: Sequence[nn.Parameter],
    device: torch.device,
    probe_rows: Sequence[int] = PROBE_ROWS,
    peak_bytes: Callable[[Callable[[], Tensor], torch.device], tuple[int, Tensor]] | None = None,
    *,
    room: float | None = None,
) -> dict[str, ColumnFit]:
    """Each column's :class:`ColumnFit`: the peak memory of one forward and backward of its first r rows at
    its padded length, for r in ``probe_rows`` (those up to its rows), as Step (3) runs a mini-batch
    (under ``autocast``). ``peak_bytes(run, device)`` calls ``run`` and returns the peak bytes it took
    above what was held before, with ``run``'s reps (default: :func:`_cuda_peak_bytes`, the larger of the
    reserved and the allocated growth from an emptied cache).

    ``room``: bytes a point may take (the budget less what is held). Given, a point whose peak the points
    before it predict above ``room`` is not run, nor any larger one, and a point that runs out of memory
    (under a process cap) is recorded as taking more than ``room``: the probe stays within the budget,
    and the fit then says that those rows do not fit.

    The gradients the probe accumulates, and its RNG draws (dropout), are put back: training continues as
    if it had not run. Gradients that did not exist are created (zeros) before measuring, so the fit holds
    activations only, and removed after.
    """
    peak_bytes = peak_bytes or _cuda_peak_bytes
    grads = GradState.capture(trained)
    for p in trained:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    fits = {}
    try:
        # Dropout draws from the generators of the inputs' device and of every device holding a weight.
        cuda = {*cuda_devices_of(trained), *([device.index] if device.type == "cuda" else [])}
        with torch.random.fork_rng(devices=sorted(cuda)):
            for column, features in columns.items():
                batch, length = rows_of(features), padded_length(features)
                points: list[tuple[int, int]] = []
                rep = None
                for rows in sorted({min(r, batch) for r in probe_rows}):
                    if (
                        room is not None
                        and points
                        and ColumnFit.from_points(points, length).peak(rows) > room
                    ):
                        break  # predicted beyond the budget: neither this point nor a larger one is run
                    part = {name: tensor[:rows] for name, tensor in features.items()}

                    def run(part: Mapping[str, Tensor] = part, column: str = column) -> Tensor:
                        with autocast.replay(), torch.enable_grad():
                            rep = call_encoder(encoder, column, part)  # [rows, V]
                        if rep.requires_grad:  # not for a frozen route (a routed encoder's query table)
                            rep.backward(torch.ones_like(rep))
                        return rep.detach()

                    out_of_memory = False
                    try:
                        peak, rep = peak_bytes(run, device)
                    except torch.OutOfMemoryError:
                        if room is None:
                            raise
                        out_of_memory = True  # handled outside the except block, which holds the step's graph
                    if out_of_memory:
                        torch.cuda.empty_cache()
                        points.append((rows, int(room) + 1))  # more than the room: these rows do not fit
                        break
                    points.append((rows, peak))
                if rep is None:  # not even the first point fitted: the reps' width and density, no graph
                    part = {name: tensor[: points[0][0]] for name, tensor in features.items()}
                    with autocast.replay(), torch.no_grad():
                        rep = encoder(**part)  # [rows, V]
                fits[column] = ColumnFit.from_points(
                    points,
                    length,
                    width=rep.shape[-1],
                    rep_bytes=rep.element_size(),
                    density=float((rep != 0).float().mean()),
                )
    finally:
        grads.restore()
    return fits


def _fits_checked_at(
    plan: MemoryPlan,
    columns: Columns,
    autocast: AutocastState,
    trained: Sequence[nn.Parameter],
    device: torch.device,
    encoder: object,
    peak_bytes: Callable[[Callable[[], Tensor], torch.device], tuple[int, Tensor]] | None = None,
    *,
    room: float | None = None,
) -> dict[str, ColumnFit] | None:
    """The plan's fits with each mini-batch larger than the probe's measured at its own size and added
    where it peaks above the prediction; None where none does (``peak_bytes`` and ``room`` as in
    :func:`measure_fits`)."""
    fits, raised = dict(plan.fits), False
    for column, size in plan.settings.mini_batch_sizes(plan.rows).items():
        if size <= max(PROBE_ROWS):
            continue
        part = {column: columns[column]}
        measured = measure_fits(encoder, part, autocast, trained, device, (size,), peak_bytes, room=room)
        peak = measured[column].points[0][1]
        if peak > plan.fits[column].peak(size):
            fits[column], raised = fits[column].with_point(size, peak), True
    return fits if raised else None


def _cuda_peak_bytes(run: Callable[[], Tensor], device: torch.device) -> tuple[int, Tensor]:
    """``run()``'s peak above what the process held before, from an emptied cache, and its result: the
    larger of the growth of ``torch.cuda.max_memory_reserved`` (the segments it took: the allocator's
    rounding and fragmentation) and of ``max_memory_allocated`` (tensors placed in segments held before)."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()  # blocks cached by an earlier run would hide this one's segments
    allocated, reserved = torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)
    torch.cuda.reset_peak_memory_stats(device)
    result = run()
    torch.cuda.synchronize(device)
    grown = max(
        torch.cuda.max_memory_allocated(device) - allocated, torch.cuda.max_memory_reserved(device) - reserved
    )
    return grown, result


def _held_bytes(device: torch.device) -> int:
    """What the process holds on ``device`` with its allocator's cache emptied: the segments its tensors
    occupy (``memory_reserved``; the free space between them included), at least what they allocate."""
    torch.cuda.empty_cache()
    return max(torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device))


def _footprint(
    columns: Columns,
    fits: Mapping[str, ColumnFit],
    trained: Sequence[nn.Parameter],
    device: torch.device,
    *,
    first: bool,
) -> Footprint:
    """What a step holds besides its mini-batch. The optimizer's state is estimated, before the first
    optimizer step, as an Adam-like two values per trained weight; later it is allocated already. The
    reps and their gradients both dense and as their non-zeros (the plan picks; ``"auto"`` is planned
    dense, as it may stay so), the latter at ``SPARSE_DENSITY_HEADROOM`` times the probe's non-zeros
    (:meth:`ColumnFit.sparse_entries`)."""
    trainable = sum(p.numel() * p.element_size() for p in trained)
    missing = sum(p.numel() * p.element_size() for p in trained if p.grad is None)
    rep_cache = sparse_rep_cache = sparse_nnz = records = 0
    widest = 0  # the largest column's fp32 [B, V] bytes: a densified block of the sparse loss is no larger
    for column, features in columns.items():
        fit, rows = fits[column], rows_of(features)
        nnz = rows * fit.width * fit.density
        planned_nnz = fit.sparse_entries(rows)
        rep_cache += 2 * rows * fit.width * fit.rep_bytes  # reps and their gradients, [B, V] each
        sparse_rep_cache += 2 * planned_nnz * _SPARSE_ENTRY_BYTES
        sparse_nnz += planned_nnz
        records += nnz * _RECORD_BYTES
        widest = max(widest, 4 * rows * fit.width)
    sparse_loss = (
        _SPARSE_LOSS_BLOCKS * min(widest, SPARSE_BLOCK_MAX_BYTES) + _SPARSE_LOSS_ENTRY_BYTES * sparse_nnz
    )
    # First, so that the recording stream's workspace is among what is allocated whatever the plan; a
    # graphed plan counts it once more: a capture may take its workspace anew from the graphs' pool.
    workspace = _stream_workspace_bytes(device)
    return Footprint(
        allocated=_held_bytes(device),
        grads=missing,
        optimizer=2 * trainable if first else 0,
        rep_cache=int(rep_cache),
        records=int(records),
        sparse_rep_cache=int(sparse_rep_cache),
        sparse_loss=int(sparse_loss),
        graphs=workspace,
    )


def _stream_workspace_bytes(device: torch.device) -> int:
    """Bytes the first matmuls on the stream that records CUDA graphs allocate (its cuBLAS and cuBLASLt
    workspaces, kept per stream through the caching allocator), measured once per process and device: the
    first call allocates them, later calls return the same number."""
    stream = recording_stream(device)
    if stream not in _WORKSPACE_BYTES:
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        with torch.cuda.stream(stream):
            for dtype in (torch.float32, torch.bfloat16):
                square = torch.ones(16, 16, device=device, dtype=dtype)
                product = square @ square  # allocates the stream's workspace the first time
                del square, product
        torch.cuda.synchronize(device)
        _WORKSPACE_BYTES[stream] = max(torch.cuda.memory_allocated(device) - before, 0)
    return _WORKSPACE_BYTES[stream]


def _budget_bytes(max_memory: str | None, device: torch.device) -> int:
    """``max_memory`` in bytes on ``device``: a size as written, or for ``"auto"`` what is free there plus
    what this process's allocator holds, less ``AUTO_MARGIN``."""
    assert max_memory is not None
    if max_memory != AUTO:
        return size_bytes(max_memory)
    free, _ = torch.cuda.mem_get_info(device)
    return int((free + torch.cuda.memory_reserved(device)) * (1 - AUTO_MARGIN))


def _checkpointing_owner(encoder: object) -> nn.Module | None:
    """The outermost module that can turn on activation checkpointing (``gradient_checkpointing_enable``)."""
    if not isinstance(encoder, nn.Module):
        return None
    for module in encoder.modules():
        if callable(getattr(module, "gradient_checkpointing_enable", None)) and callable(
            getattr(module, "gradient_checkpointing_disable", None)
        ):
            return module
    return None


def _device(columns: Columns) -> torch.device:
    return next(iter(next(iter(columns.values())).values())).device
