"""The GradCache engine: an effective batch of any size for the activation memory of one mini-batch.

GradCache (Gao et al. 2021, "Scaling Deep Contrastive Learning Batch Size under Memory Limited
Setup") splits the gradient of a batch-coupled loss L(f(x_1), ..., f(x_B)) at the reps r_i = f(x_i):
dL/dθ = Σ_i (dL/dr_i) · (dr_i/dθ). So:

- Step (1) :meth:`GradCache.encode`: encode every mini-batch of every column without a graph,
  saving the RNG state before each mini-batch and the autocast state once.
- Step (2) :meth:`GradCache.rep_gradients`: compute the loss on the full batch of reps, backprop
  to the reps only, and keep their gradients dL/dr (the cache).
- Step (3) :meth:`GradCache.replay`: re-encode each mini-batch with its RNG and autocast state
  replayed (the same function the loss saw, dropout included) and backprop its slice of dL/dr.

The parameter gradients equal uncached training's; the activation memory is that of one
mini-batch, plus the [B, V] reps and their gradients (with ``sparse_reps``, their non-zeros only).
Nothing here knows about SPLADE: any encoder ``encoder(**features) -> [B, V]`` and any loss over
reps. No cache is kept on the engine: what Step (1) produces is returned, and lives only as long as
the caller keeps it (one step).

The pieces, one concept a module, are listed in :mod:`gradcache_sparton.engine`.

Legend: B batch (rows of a column), S sequence, V rep width (the vocabulary for SPLADE).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, nullcontext
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from gradcache_sparton.engine.autocast_state import AutocastState
from gradcache_sparton.engine.checks import (
    check_autograd_inputs,
    check_columns,
    check_loss_kwargs,
    check_loss_output,
    check_rep,
    check_token_ids,
    fingerprint,
    fingerprints_differ,
    raise_if_non_finite,
    raise_if_not_reproduced,
    replay_failure_note,
    rows_of,
)
from gradcache_sparton.engine.config import GradCacheConfig
from gradcache_sparton.engine.cuda_graphs import GraphRun
from gradcache_sparton.engine.distributed import (
    count_on_every_rank,
    data_parallel_world_size,
    ddp_no_sync_context,
    find_ddp,
    find_fsdp,
    fsdp_sync_context,
    gather_global_batch,
)
from gradcache_sparton.engine.grad_state import GradState
from gradcache_sparton.engine.kept_graphs import (
    backprop_kept,
    encode_order,
    kept_counts,
)
from gradcache_sparton.engine.mini_batch import Rows, iter_mini_batches
from gradcache_sparton.engine.option_rules import check_option_rules
from gradcache_sparton.engine.planner.memory_plan import MemoryPlan
from gradcache_sparton.engine.planner.memory_probe import MemoryPlanner
from gradcache_sparton.engine.reps import StepReps, leaf, leaf_grad, mini_batch_grad, replay_grads
from gradcache_sparton.engine.rng_state import RngState, cuda_devices_of
from gradcache_sparton.engine.run_eager import EagerRun
from gradcache_sparton.engine.run_memo import MemoRun
from gradcache_sparton.engine.settings import StepSettings, encoder_facts, resolve_settings
from gradcache_sparton.engine.sparse_grads import SparseRepGrad
from gradcache_sparton.engine.types import (
    Columns,
    EncodedBatch,
    LossFn,
    LossOutput,
    MiniBatch,
    MiniBatchContext,
    ReplayState,
)
from gradcache_sparton.primitives.column_routing import call_encoder, trains_column
from gradcache_sparton.primitives.sparse_reps import SparseReps

__all__ = ["GradCache"]


class _Job(NamedTuple):
    """One Step (3) replay: mini-batch ``index`` of ``column``, with its rep gradient or a zero one."""

    column: str
    index: int
    mini_batch: MiniBatch
    zero_grad: bool = False


class GradCache:
    """Gradient caching for an encoder: Steps (1)-(3) of GradCache as methods, :meth:`step` for all.

    Args:
        encoder: ``encoder(**features) -> Tensor [B, V]``, usually an ``nn.Module``.
        config: the engine's options, a :class:`~gradcache_sparton.engine.GradCacheConfig` (documented
            there: mini-batch size, token budget, ``sparse_reps``, ``reuse_argmax``, ``cuda_graphs``, ...).
        mini_batch_context: default for :meth:`replay`'s ``mini_batch_context``. None: when the encoder
            is ``DistributedDataParallel`` (also under ``torch.compile``), every replayed mini-batch
            but the last runs under its ``no_sync()``; when it is an FSDP2 module (``fully_shard``),
            gradient reduction is off for every mini-batch but the last; otherwise no context.
        **options: instead of ``config``, its fields as keywords: ``GradCache(encoder, mini_batch_size=8)``
            is ``GradCache(encoder, GradCacheConfig(mini_batch_size=8))``.

    Attributes:
        config: the options as given (None where the engine decides).
        settings: what the steps run with, every option decided
            (:func:`~gradcache_sparton.engine.settings.resolve_settings`): from ``config`` and the encoder's
            facts when built; with ``max_memory``, each plan's (:meth:`plan`).
        world_size: how many ranks' batches the loss sees (1 when not gathering).
    """

    def __init__(
        self,
        encoder: Callable[..., Tensor],
        config: GradCacheConfig | None = None,
        *,
        mini_batch_context: MiniBatchContext | None = None,
        **options: Any,
    ) -> None:
        if not callable(encoder):
            raise TypeError(f"encoder must be callable as encoder(**features), got {type(encoder).__name__}")
        if config is not None and (options or not isinstance(config, GradCacheConfig)):
            raise TypeError(
                "pass the engine's options as one GradCacheConfig or as its fields as keywords, not both; got "
                f"config={type(config).__name__} and {sorted(options)}"
            )
        self.config = GradCacheConfig(**options) if config is None else config
        self.encoder = encoder
        self.world_size = data_parallel_world_size(self.config.gather_across_ranks)
        ddp, fsdp = find_ddp(encoder), find_fsdp(encoder)
        if mini_batch_context is None and ddp is not None:
            mini_batch_context = ddp_no_sync_context(ddp)
        if mini_batch_context is None and fsdp is not None:
            mini_batch_context = fsdp_sync_context(fsdp)
        self.mini_batch_context = mini_batch_context
        # Data-parallel training needs one (synchronising) backward per rank and step, and agreement
        # across ranks before Step (3) starts.
        self._data_parallel = self.world_size > 1 or ddp is not None or fsdp is not None
        facts = encoder_facts(encoder, data_parallel=self._data_parallel)
        check_option_rules(self.config, facts)  # a plan chooses CUDA graphs only where these allow them
        self.settings: StepSettings = resolve_settings(self.config, facts, world_size=self.world_size)
        # Under FSDP each forward and backward is a collective: every rank must run as many of each.
        self._equal_passes = fsdp is not None and data_parallel_world_size(None) > 1
        self._run = self._mini_batch_run()
        self._kept_run = EagerRun(encoder)  # keep_graphs: Step (1) with a graph, the encoder's own forward
        # max_memory: the options left unset are planned on the first step (memory_plan).
        self._planner = None if self.config.max_memory is None else MemoryPlanner(self.config, encoder, facts)

    @property
    def memory_plan(self) -> MemoryPlan | None:
        """The options ``max_memory`` chose, with the measured numbers (None before the first planned step,
        or without ``max_memory``)."""
        return None if self._planner is None else self._planner.plan

    def plan(self, columns: Columns, autocast: AutocastState | None = None) -> StepSettings:
        """The planning phase (with ``max_memory``, before Step (1) when a plan is due: a training step on
        CUDA, the first or one with a batch larger or longer than the plan's): measure and choose the options
        left unset (:mod:`~gradcache_sparton.engine.planner.memory_plan`), take the plan's :attr:`settings` and
        choose how mini-batches run. The plan may turn on the model's activation checkpointing (logged; it
        stays on). Without a plan due, the settings in effect. ``autocast``: the step's (default: captured
        now, as Step (1) does)."""
        if self._planner is None or not self._planner.needs_plan(columns):
            return self.settings
        if autocast is None:
            autocast = AutocastState.capture({t.device.type for f in columns.values() for t in f.values()})
        self._run = EagerRun(self.encoder)  # a previous plan's CUDA graphs are freed before measuring
        self.settings = self._planner.plan_for(columns, autocast).settings
        self._run = self._mini_batch_run()
        return self.settings

    def _mini_batch_run(self) -> EagerRun | MemoRun | GraphRun:
        """How every mini-batch of Step (1) and Step (3) runs, chosen from :attr:`settings`."""
        if self.settings.cuda_graphs:
            assert isinstance(self.encoder, nn.Module)  # option_rules: checked when the engine was built
            return GraphRun(self.encoder)
        if self.settings.reuse_argmax:
            return MemoRun(self.encoder, warn_unrecorded=self.config.reuse_argmax is True)
        return EagerRun(self.encoder)

    def step(self, columns: Columns, loss_fn: LossFn, **loss_kwargs: object) -> LossOutput:
        """One full GradCache step: the loss is computed and the encoder's ``.grad`` accumulated.

        Equivalent to ``loss_fn({c: encoder(**columns[c]) for c in columns}, **loss_kwargs)
        .backward()`` with an upstream gradient of 1. For GradScaler or gradient accumulation
        scaling, use :class:`~gradcache_sparton.engine.CachedLoss`, whose loss takes ``.backward()``.

        Returns:
            The detached loss and its detached components.
        """
        if torch.is_inference_mode_enabled():
            raise RuntimeError(
                "GradCache.step was called under torch.inference_mode(): its Steps (2) and (3) need autograd "
                "(they backpropagate the loss); call it outside inference_mode (use torch.no_grad() or the "
                "loss alone for evaluation)"
            )
        check_autograd_inputs(columns)
        reps, replay_state = self.encode(columns, loss_kwargs=loss_kwargs)  # Step (1)
        output, rep_grads = self.rep_gradients(reps, loss_fn, **loss_kwargs)  # Step (2)
        # Sparse columns' gradients are placed by mini-batch.
        grads = replay_grads(reps, rep_grads, replay_state.mini_batches)
        del reps  # Step (3) needs only the gradients: free the reps before re-encoding
        self.replay(replay_state, grads)  # Step (3)
        return output

    def encode(self, columns: Columns, *, loss_kwargs: Mapping[str, object] | None = None) -> EncodedBatch:
        """Step (1): encode every mini-batch of every column without a graph.

        The inputs are checked once, here, before any encoding (:mod:`~gradcache_sparton.engine.checks`):
        the columns (shapes, one device, what the options need), their token ids against the encoder's
        vocabulary and, when given, the batch-first tensors among the loss's keyword arguments; later
        steps trust them.

        Before each mini-batch the CPU generator and the generators of every CUDA device its inputs
        (and the encoder's parameters) live on are captured; the autocast state is captured once.
        Each mini-batch's trailing padding is trimmed first (see :func:`iter_mini_batches`); with
        ``mini_batch_tokens`` the rows are grouped by length, and each column's reps are still
        returned in its row order. Every column is cut into mini-batches before the first is
        encoded, so reading the row lengths back waits for no encoder work. With ``sparse_reps`` each
        column is a :class:`~gradcache_sparton.primitives.sparse_reps.SparseReps` in its row order. With
        ``max_memory``, a plan that is due is made first (:meth:`plan`).
        """
        check_columns(columns, self.config)
        if loss_kwargs and self.config.same_batch_size:
            check_loss_kwargs(columns, loss_kwargs)
        check_token_ids(columns, self.encoder)
        autocast = AutocastState.capture(
            {t.device.type for features in columns.values() for t in features.values()}
        )
        settings = self.plan(columns, autocast)
        self._run.start_encode(columns)
        encoder_devices = _cuda_devices_of_encoder(self.encoder)
        sizes = settings.mini_batch_sizes(columns)
        plans = {
            column: list(
                iter_mini_batches(
                    features,
                    rows_of(features),
                    sizes[column],
                    mini_batch_tokens=settings.mini_batch_tokens,
                    mini_batch_length_multiple=settings.mini_batch_length_multiple,
                )
            )
            for column, features in columns.items()
        }
        planned = sum(map(len, plans.values()))
        extra = 0
        if self._equal_passes:  # FSDP: as many forwards as the rank with the most mini-batches
            extra = count_on_every_rank(planned, _device_of(columns)) - planned
        kept = kept_counts(settings, plans, self.encoder)  # keep_graphs: each column's last ones, run last
        step_reps = StepReps(settings.sparse_reps, self.world_size)
        references: dict[str, Tensor] = {}  # [0, V]: the width, dtype and device each column's reps must have
        encoded: dict[str, list[MiniBatch]] = {column: [] for column in plans}
        with (
            torch.no_grad(),
            _quiet_reentrant_checkpoint(),
            self._progress(planned + extra, "Step (1) encode") as bar,
        ):
            for column, k in encode_order(plans, kept):
                rows, features = plans[column][k]
                rng = RngState.capture((*cuda_devices_of(features.values()), *encoder_devices))
                keep = k >= len(plans[column]) - kept[column]
                with torch.enable_grad() if keep else nullcontext():
                    run = self._kept_run if keep else self._run
                    rep, memo = run.encode(column, rows, features, rng, autocast)  # [mb, V]
                check_rep(rep, column, rows, references.get(column))
                references[column] = rep.new_empty((0, *rep.shape[1:]))
                step_reps.add(column, rows_of(columns[column]), rows, rep.detach())
                mark = fingerprint(rep) if settings.check_replay and not keep else None
                graph = rep if keep and rep.requires_grad else None  # none made: replayed (and refused there)
                encoded[column].append(MiniBatch(rows, features, rng, mark, memo, graph))
                bar.update()
            mini_batches = {column: tuple(mbs) for column, mbs in encoded.items()}
            reps: dict[str, Tensor | SparseReps] = {
                column: step_reps.column(column, mini_batches[column]) for column in plans
            }
            padding = self._encode_padding(plans, extra, encoder_devices, bar)
        if self._planner is not None:
            self._planner.check_entries(reps)  # sparse reps beyond the plan's count: planned again
        return EncodedBatch(reps, ReplayState(mini_batches=mini_batches, autocast=autocast, padding=padding))

    def rep_gradients(
        self, reps: Mapping[str, Tensor | SparseReps], loss_fn: LossFn, **loss_kwargs: object
    ) -> tuple[LossOutput, dict[str, Tensor | None]]:
        """Step (2): the loss on the full batch of reps, backpropagated to the reps only.

        The reps enter as fresh leaves, so this backward stops at them (parameters of ``loss_fn``
        itself, e.g. a learned temperature, receive their gradient here as in uncached training).
        When gathering across ranks, the loss is the global one and the gradients are those of this
        rank's rows.

        Returns:
            The detached loss with its components, and per column dL/dr [B, V] (None for a column
            the loss does not use); for a :class:`SparseReps` column, dL/d weights [nnz] (the
            gradient at its non-zeros, in its entries' order).
        """
        leaves = {column: leaf(rep) for column, rep in reps.items()}
        with torch.enable_grad():
            loss, components = self.compute_loss(leaves, loss_fn, loss_kwargs)
        loss.backward()
        return LossOutput(loss.detach(), components), {
            column: leaf_grad(rep) for column, rep in leaves.items()
        }

    def replay(
        self,
        replay_state: ReplayState,
        rep_grads: Mapping[str, Tensor | SparseRepGrad | None],
        *,
        mini_batch_context: MiniBatchContext | None = None,
    ) -> None:
        """Step (3): re-encode each mini-batch under its replayed state and backprop its gradient slice.

        The global RNG streams are untouched (each replay runs inside ``fork_rng``), and Step (1)'s
        autocast state is re-entered even when this runs inside ``backward()``, outside the
        caller's autocast block. Parameter gradients accumulate into ``.grad``. A mini-batch that kept its
        Step (1) graph (``keep_graphs``) is backpropagated through it instead, before any replay; a graph is
        freed by its backward, so a Step (3) that failed is retried with the whole step.

        When gathering across ranks (``world_size`` W > 1), the gradients backpropagated are
        W · ``rep_grads``: DDP's average over ranks then gives single-process gradients (the scaling
        convention is written once, in ``cached_loss._ReplayOnBackward``). Under data parallelism a
        rank with nothing to replay runs one zero-gradient replay, so that every rank runs the one
        backward that synchronises gradients.

        Args:
            replay_state: from :meth:`encode`.
            rep_grads: per column dL/dr [B, V], as from :meth:`rep_gradients` (or, for sparse reps, placed
                by mini-batch: :class:`SparseRepGrad`); a column whose gradient is None is skipped (the
                loss does not depend on it).
            mini_batch_context: factory called with ``is_last`` for each mini-batch; its context
                wraps that mini-batch's re-encode and backward (the hook through which data-parallel
                training skips gradient synchronisation on all but the last). Default: the engine's.

        Raises:
            FloatingPointError: a column's gradient is not finite (before any re-encoding), unless
                ``allow_non_finite``; under data parallelism on every rank when it is so on any.
            RuntimeError: a replayed rep does not require grad, or differs in shape or dtype from
                Step (1)'s; with ``check_replay``, after the last mini-batch, when a replayed
                mini-batch's reps are not bitwise Step (1)'s (the message names the likely causes).

        Whatever fails once re-encoding has begun (one of the errors above, the encoder's own, an
        out-of-memory error in any mini-batch's forward or backward), the encoder's parameter
        gradients are first restored bit for bit to what they were before Step (3) (None stays
        None; see :mod:`~gradcache_sparton.engine.grad_state`); the error then propagates with a
        note naming the mini-batch and saying so.
        """
        grads = {column: grad for column, grad in rep_grads.items() if grad is not None}
        unknown = set(grads) - set(replay_state.mini_batches)
        if unknown:
            raise ValueError(f"rep_grads has columns {sorted(unknown)} that Step (1) did not encode")
        if not self.config.allow_non_finite:
            named = {
                f"the gradient of column {column!r}": g.values if isinstance(g, SparseRepGrad) else g
                for column, g in grads.items()
            }
            raise_if_non_finite(
                named, every_rank=_replay_device(replay_state) if self._data_parallel else None
            )
        jobs = self._jobs(replay_state, grads)
        context = mini_batch_context or self.mini_batch_context or (lambda is_last: nullcontext())
        parameters = _parameters_of(self.encoder)
        # A failure in mini-batch k must not leave mini-batches 1..k-1 in .grad: put it back as it was.
        grad_state = GradState.capture(parameters or ())
        index, checked, differs = 0, [], []
        try:
            self._run.start_replay()
            with self._progress(len(jobs), "Step (3) replay") as bar:
                for index, job in enumerate(jobs):
                    mb = job.mini_batch
                    if mb.graph is not None:  # keep_graphs: Step (1)'s own graph, no re-encoding
                        with context(index == len(jobs) - 1):
                            backprop_kept(job.column, mb, self._job_grad(job, grads))
                        bar.update()
                        continue
                    with context(index == len(jobs) - 1), mb.rng.replay():
                        rep = self._run.replay(
                            job.column, mb, self._job_grad(job, grads), replay_state.autocast
                        )
                    if self.settings.check_replay and mb.fingerprint is not None:
                        # Compared on the device, read back once after the last mini-batch; a rep rebuilt from
                        # records (reuse_argmax) is checked on the recording modules' inputs instead.
                        memo_differs = None if mb.memo is None else mb.memo.differs()
                        checked.append((job.column, mb))
                        differs.append(
                            fingerprints_differ(fingerprint(rep), mb.fingerprint)
                            if memo_differs is None
                            else memo_differs
                        )
                    bar.update()
            index = len(jobs)
            raise_if_not_reproduced(checked, differs)
        except BaseException as error:
            grad_state.restore()
            where = (
                None
                if index >= len(jobs)
                else (index, len(jobs), jobs[index].column, jobs[index].mini_batch.rows)
            )
            error.add_note(replay_failure_note(where, done=len(jobs), restored=parameters is not None))
            raise

    def compute_loss(
        self, reps: Mapping[str, Tensor | SparseReps], loss_fn: LossFn, loss_kwargs: Mapping[str, object]
    ) -> LossOutput:
        """Step (2), forward half: ``loss_fn(reps, **loss_kwargs)``, checked.

        Returns:
            The loss (with its graph to ``reps``) and its components, detached for logging so they
            never keep the graph or the cache alive.

        Raises:
            TypeError/ValueError: ``loss_fn`` returned something other than a scalar floating
                tensor (optionally with a dict of tensor components), or a loss that does not
                depend on the reps while gradients are enabled. Whatever ``loss_fn`` raises on reps
                that ``max_memory``'s plan made sparse carries a note saying so.
            FloatingPointError: the loss is not finite, unless ``allow_non_finite``.
            ValueError: when gathering across ranks, ranks passed different columns, keywords,
                trailing shapes, dtypes or rep layouts (dense or sparse) (raised on every rank).
        """
        if self.world_size > 1:
            # Every rank's rows in rank order; only this rank's slice carries a graph (to ``reps``).
            reps, loss_kwargs = gather_global_batch(reps, loss_kwargs)
        try:
            loss, components = check_loss_output(loss_fn(reps, **loss_kwargs))
        except Exception as error:
            planned = (
                self._planner is not None
                and self.config.sparse_reps is None
                and self.settings.sparse_reps == "true"
            )
            if planned:
                error.add_note(
                    "max_memory's plan keeps the reps sparse (SparseReps: sparse_reps was left unset and dense "
                    "reps do not fit the budget); a loss that takes dense [B, V] reps only needs "
                    "sparse_reps='false' (and a larger max_memory or an explicit mini_batch_size)"
                )
            # A loss written for dense [B, V] tensors, called with SparseReps, fails on the object itself
            # (`'SparseReps' object has no attribute 'T'`): say which option made them sparse.
            sparse = any(isinstance(rep, SparseReps) for rep in reps.values())
            if (
                sparse
                and not planned
                and isinstance(error, (AttributeError, TypeError))
                and "SparseReps" in str(error)
            ):
                why = (
                    " (sparse_reps='auto' found this step's reps sparse enough)"
                    if self.config.sparse_reps == "auto"
                    else ""
                )
                raise TypeError(
                    f"loss_fn failed on SparseReps reps ({type(error).__name__}: {error}): sparse_reps="
                    f"{self.config.sparse_reps!r}{why} passes each column as its non-zeros, not a [B, V] tensor. "
                    "Give a loss that accepts SparseReps (as SpladeLoss does), or set sparse_reps='false'"
                ) from error
            raise
        if not self.config.allow_non_finite:
            raise_if_non_finite({"the loss": loss.detach()}, components=components)
        return LossOutput(loss, components)

    # ------------------------------------------------------------------ helpers of the steps

    def _encode_padding(
        self,
        plans: Mapping[str, list[tuple[Rows, dict[str, Tensor]]]],
        extra: int,
        encoder_devices: tuple[int, ...],
        bar: tqdm,
    ) -> tuple[MiniBatch, ...]:
        """FSDP: ``extra`` encodes of the first mini-batch, whose reps no loss sees: they only join the
        other ranks' collectives (replayed with a zero gradient)."""
        padding = []
        first_column = next(iter(plans))
        first_rows, first_features = plans[first_column][0]
        for _ in range(extra):
            rng = RngState.capture((*cuda_devices_of(first_features.values()), *encoder_devices))
            call_encoder(self.encoder, first_column, first_features)
            padding.append(MiniBatch(rows=first_rows, features=first_features, rng=rng))
            bar.update()
        return tuple(padding)

    def _jobs(self, replay_state: ReplayState, grads: Mapping[str, object]) -> list[_Job]:
        """Step (3)'s replays: every mini-batch of every column with a gradient; under data parallelism at
        least one, and under FSDP as many as the rank with the most (the extra ones with a zero gradient)."""
        jobs = [  # a column that reaches no trainable parameter (a frozen query table) has nothing to replay
            _Job(column, k, mb)
            for column in grads
            if trains_column(self.encoder, column)
            for k, mb in enumerate(replay_state.mini_batches[column])
        ]
        # keep_graphs (never under data parallelism): the kept graphs first, freeing their memory for the replays.
        jobs.sort(key=lambda job: job.mini_batch.graph is None)
        first_column, first_mini_batches = next(iter(replay_state.mini_batches.items()))
        if not jobs and self._data_parallel:
            # The other ranks' last backward waits for this rank's gradients: replay one mini-batch
            # with a zero gradient rather than none (the loss ignores every column on this rank).
            jobs = [_Job(first_column, 0, first_mini_batches[0], zero_grad=True)]
        if self._equal_passes:  # FSDP: as many replays as the rank with the most, zero-gradient ones
            spare = replay_state.padding or first_mini_batches[:1]
            for i in range(count_on_every_rank(len(jobs), _replay_device(replay_state)) - len(jobs)):
                jobs.append(_Job(first_column, 0, spare[i % len(spare)], zero_grad=True))
        return jobs

    def _job_grad(self, job: _Job, grads: Mapping[str, Tensor | SparseRepGrad]) -> Tensor | None:
        """The gradient a replay backprops: its mini-batch's slice [mb, V], or None for a zero one."""
        if job.zero_grad:
            return None
        grad = mini_batch_grad(grads[job.column], job.index, job.mini_batch)
        # W · dL/dr: DDP's average then gives single-process gradients (the convention: _ReplayOnBackward).
        return grad * self.world_size if self.world_size > 1 else grad

    @contextmanager
    def _progress(self, total: int, description: str) -> Iterator[tqdm]:
        bar = tqdm(
            total=total,
            desc=f"GradCache {description}",
            unit="mini-batch",
            disable=not self.config.show_mini_batch_progress,
        )
        try:
            yield bar
        finally:
            bar.close()


@contextmanager
def _quiet_reentrant_checkpoint() -> Iterator[None]:
    # An encoder with reentrant gradient checkpointing warns on every graph-less forward that its
    # inputs do not require grad. Step (1) is graph-less by design; Step (3) runs with a graph.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="None of the inputs have requires_grad=True")
        yield


def _device_of(columns: Columns) -> torch.device:
    """The device of the columns' tensors (one device: ``check_columns``)."""
    return next(iter(next(iter(columns.values())).values())).device


def _replay_device(replay_state: ReplayState) -> torch.device:
    first_mini_batch = next(iter(replay_state.mini_batches.values()))[0]
    return next(iter(first_mini_batch.features.values())).device


def _cuda_devices_of_encoder(encoder: Callable[..., Tensor]) -> tuple[int, ...]:
    # Dropout draws from the generator of the device it runs on, which for a model split across GPUs
    # is not only the inputs' device: capture every device holding a parameter too.
    if isinstance(encoder, nn.Module):
        return cuda_devices_of(encoder.parameters())
    return ()


def _parameters_of(encoder: Callable[..., Tensor]) -> list[nn.Parameter] | None:
    # The parameters Step (3) accumulates into; None when the encoder is a plain function.
    if isinstance(encoder, nn.Module):
        return [p for p in encoder.parameters() if p.requires_grad]
    return None
