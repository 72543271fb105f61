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

Under data parallelism (DDP, see :mod:`gradcache_sparton.engine.distributed`) Step (2) sees every
rank's reps, Step (3) replays W times this rank's gradient slice, and only the last replayed
mini-batch synchronises gradients.

Legend: B batch (rows of a column), S sequence, V rep width (the vocabulary for SPLADE).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from gradcache_sparton.engine.argmax_reuse import ArgmaxMemo, ArgmaxReuse
from gradcache_sparton.engine.autocast_state import AutocastState
from gradcache_sparton.engine.cuda_graphs import GraphedEncoder, check_cuda_graph_options
from gradcache_sparton.engine.distributed import (
    count_on_every_rank,
    data_parallel_world_size,
    ddp_no_sync_context,
    find_ddp,
    find_fsdp,
    fsdp_sync_context,
    gather_global_batch,
    holds_on_every_rank,
)
from gradcache_sparton.engine.grad_state import GradState
from gradcache_sparton.engine.mini_batch import (
    Rows,
    describe_rows,
    iter_mini_batches,
    mini_batch_order,
    row_count,
)
from gradcache_sparton.engine.rng_state import RngState, cuda_devices_of
from gradcache_sparton.engine.sparse_grads import SparseRepGrad
from gradcache_sparton.primitives.forward_memo import recording, replaying
from gradcache_sparton.primitives.host_count import HostCount
from gradcache_sparton.primitives.sparse_reps import SparseReps

__all__ = [
    "Columns",
    "EncodedBatch",
    "Features",
    "GradCache",
    "LossFn",
    "LossOutput",
    "MiniBatch",
    "MiniBatchContext",
    "ReplayState",
]

Features = Mapping[str, Tensor]
"""One column's model inputs: ``input_ids``, ``attention_mask``, ... each [B, S] (or [B, ...])."""

Columns = Mapping[str, Features]
"""Input columns in order, e.g. ``{"query": {...}, "positive": {...}, "negative_1": {...}}``."""

LossFn = Callable[..., "Tensor | tuple[Tensor, Mapping[str, Tensor]]"]
"""``loss_fn(reps, **loss_kwargs)`` -> scalar Tensor, or (scalar Tensor, components for logging)."""

MiniBatchContext = Callable[[bool], AbstractContextManager[object]]
"""Called with ``is_last`` for each replayed mini-batch; its context wraps that mini-batch's
re-encode and backward (e.g. ``lambda last: nullcontext() if last else ddp_model.no_sync()``)."""


class LossOutput(NamedTuple):
    """The loss and its detached components (empty when ``loss_fn`` returns a bare scalar)."""

    loss: Tensor
    components: dict[str, Tensor]


@dataclass(frozen=True)
class MiniBatch:
    """One mini-batch of one column: its rows (a slice, or an index tensor when grouped by length),
    its (trimmed) features, the RNG state it ran with, the fingerprint of its Step (1) reps (fp32
    row sums [mb]; None when the replay is not checked) and, with ``reuse_argmax``, what its modules
    recorded in Step (1) for the replay (None when nothing was recorded)."""

    rows: Rows
    features: dict[str, Tensor]
    rng: RngState
    fingerprint: Tensor | None = None
    memo: ArgmaxMemo | None = None


@dataclass(frozen=True)
class ReplayState:
    """What Step (3) needs from Step (1): each column's mini-batches, and the autocast state; under FSDP,
    the extra encodes that matched other ranks' counts (``padding``: copies of the first mini-batch, whose
    reps no loss sees; replayed with a zero gradient)."""

    mini_batches: dict[str, tuple[MiniBatch, ...]]
    autocast: AutocastState
    padding: tuple[MiniBatch, ...] = ()


class _Job(NamedTuple):
    """One Step (3) replay: mini-batch ``index`` of ``column``, with its rep gradient or a zero one."""

    column: str
    index: int
    mini_batch: MiniBatch
    zero_grad: bool = False


class EncodedBatch(NamedTuple):
    """Step (1)'s result: the reps without a graph, and the state to replay them with a graph."""

    reps: dict[str, Tensor | SparseReps]  # column -> [B, V], or its non-zeros with ``sparse_reps``
    replay_state: ReplayState


class GradCache:
    """Gradient caching for an encoder: Steps (1)-(3) of GradCache as methods, :meth:`step` for all.

    Args:
        encoder: ``encoder(**features) -> Tensor [B, V]``, usually an ``nn.Module``.
        mini_batch_size: rows encoded at once; an int for every column or a mapping with one entry
            per column (e.g. short queries in larger mini-batches than long passages). Memory for
            activations is that of one mini-batch; larger is faster until it no longer fits.
        mini_batch_tokens: length-grouped, token-budget mini-batches: each column's rows are taken
            longest first and packed into mini-batches of at most this many padded tokens (rows x
            the mini-batch's longest row, which it is cut to) and at most ``mini_batch_size`` rows;
            the reps are put back in the column's order before the loss, so the result is the same
            as without grouping (up to fp32 summation order). Bounds activation memory by tokens
            rather than rows, and saves the padding of mixed lengths. Every column needs a 2-D
            ``attention_mask``. None (default): consecutive rows, ``mini_batch_size`` at a time.
        pad_to_multiple_of: round each mini-batch's cut length (its longest row) up to a multiple of
            this, at most the column's width: the extra positions are the column's own padding, so
            the result is unchanged and mini-batches come in a few shapes (at most ceil(S / m) + 1
            lengths per column), which a compiled encoder with static shapes (one program per shape)
            needs. None (default): each mini-batch is cut to its longest row.
        same_batch_size: require every column, and every batch-first tensor in ``loss_kwargs``, to
            have the same number of rows, checked before any encoding (what contrastive losses over
            query/positive/negative columns need). Set False for losses whose columns differ.
        allow_non_finite: let a non-finite loss or rep gradient through instead of raising
            ``FloatingPointError``. Set it when a ``GradScaler`` (fp16) is in charge: it sees the
            non-finite parameter gradients the replay produces, skips the optimizer step and lowers
            its scale, as in uncached training.
        show_progress: show a tqdm bar over the mini-batches of Step (1) and Step (3).
        gather_across_ranks: compute the loss on every rank's reps (the global batch), with gradients
            equal to single-process training on it once DDP has averaged them (see
            :mod:`~gradcache_sparton.engine.distributed`). None (default): when ``torch.distributed``
            is initialized with more than one rank; False: each rank's loss sees its own rows only.
        mini_batch_context: default for :meth:`replay`'s ``mini_batch_context``. None: when the encoder
            is ``DistributedDataParallel`` (also under ``torch.compile``), every replayed mini-batch
            but the last runs under its ``no_sync()``; when it is an FSDP2 module (``fully_shard``),
            gradient reduction is off for every mini-batch but the last; otherwise no context.
        check_replay: prove on every step that Step (3) reproduced Step (1): each mini-batch's reps
            are fingerprinted (fp32 row sums, compared bitwise on the device, read back once at the
            end of Step (3)); a mismatch raises ``RuntimeError`` naming the likely causes (train/eval
            mode or parameters changed between forward and backward, randomness that is not
            replayed) after restoring ``.grad``. Set False for an encoder that is legitimately not
            deterministic (e.g. a compiled encoder whose graph-less and graph-recording programs
            round differently).
        sparse_rep_grads: in :meth:`step`, keep each column's rep gradient between Step (2) and
            Step (3) only at the non-zeros of its reps (see :mod:`~gradcache_sparton.engine.sparse_grads`).
            Exact only for encoders whose gradient is zero wherever a rep is zero (a SPLADE head's
            relu: the fused Sparton head and the plain one); not checked. True: always; "auto": per
            column, when it takes fewer bytes than the dense [B, V] gradient (measured density);
            False (default): dense. Two device syncs per column when on.
        sparse_reps: keep the reps themselves sparse from Step (1) on: each mini-batch's [mb, V] reps
            become a :class:`~gradcache_sparton.sparse_reps.SparseReps` (vocabulary ids and
            weights of its non-zeros) right after encoding, Step (2)'s loss receives every column as
            one (``loss_fn`` must accept them: :class:`~gradcache_sparton.losses.SpladeLoss` does) and
            returns gradients w.r.t. their weights, which go to Step (3) as :class:`SparseRepGrad`.
            Memory grows with the non-zeros, not with B x V. Exact under the same condition as
            ``sparse_rep_grads`` (not checked). True: always; "auto": for the whole step, when the
            first mini-batch's non-zeros take fewer bytes than its dense reps (on every rank when
            gathering across ranks, so that all gather one layout); False (default): dense.
            :meth:`step` and :class:`~gradcache_sparton.engine.CachedLoss`. When gathering across ranks,
            the loss gets every rank's non-zeros (padded to the largest rank's count for the collective,
            never [B, V]).
        reuse_argmax: let Step (3) skip the SPLADE head's forward: in Step (1) every Sparton head in the
            encoder (:class:`~gradcache_sparton.kernels.SpartonHead`, called eagerly) records its max
            and argmax over the sequence where its gradient can be non-zero (12 bytes per such entry,
            about a non-zero rep entry: 1-3% of B x V for trained SPLADE models, up to all of it for a
            random head), and the replay rebuilds the head's output and backward from that record, bit
            for bit the backward it would have run (see :mod:`~gradcache_sparton.engine.argmax_reuse`). Saves
            the head's [B, S, D] x [D, V] product once per step; costs the records' memory until their
            mini-batch is replayed (no device sync: each record is compacted to its live entries one
            mini-batch later, when its size has reached the host without waiting). With
            ``check_replay``, the replay of a recorded head is checked on its input (its hidden
            states, fingerprinted alike), since its output is rebuilt, not recomputed. An encoder whose forward records
            nothing (no Sparton head, or a compiled one) runs as without the option, with a warning.
        cuda_graphs: replay each mini-batch's Step (1) forward, and its Step (3) forward and backward,
            as one CUDA graph per mini-batch shape (see :mod:`~gradcache_sparton.engine.cuda_graphs`):
            removes the host's per-kernel cost, which bounds small mini-batches. Each shape is
            recorded the first time it comes (an eager warm-up, then the capture); the results are
            those of eager execution (Step (3) still reproduces Step (1) bit for bit). Needs an
            ``nn.Module`` encoder on one CUDA device whose forward and backward issue no host sync,
            and ``pad_to_multiple_of`` (few shapes); not with ``mini_batch_tokens``, ``reuse_argmax``
            or data parallelism. Each trained parameter's ``.grad`` is then one tensor kept across
            steps (the graphs add into it; zeroed where ``.grad`` was None).

    Attributes:
        world_size: how many ranks' batches the loss sees (1 when not gathering).
    """

    def __init__(
        self,
        encoder: Callable[..., Tensor],
        *,
        mini_batch_size: int | Mapping[str, int],
        mini_batch_tokens: int | None = None,
        pad_to_multiple_of: int | None = None,
        same_batch_size: bool = True,
        allow_non_finite: bool = False,
        show_progress: bool = False,
        gather_across_ranks: bool | None = None,
        mini_batch_context: MiniBatchContext | None = None,
        check_replay: bool = True,
        sparse_rep_grads: bool | Literal["auto"] = False,
        sparse_reps: bool | Literal["auto"] = False,
        reuse_argmax: bool = False,
        cuda_graphs: bool = False,
    ) -> None:
        if not callable(encoder):
            raise TypeError(f"encoder must be callable as encoder(**features), got {type(encoder).__name__}")
        sizes = mini_batch_size.items() if isinstance(mini_batch_size, Mapping) else [("", mini_batch_size)]
        named = [
            (f"mini_batch_size[{column!r}]" if column else "mini_batch_size", size) for column, size in sizes
        ]
        if mini_batch_tokens is not None:
            named.append(("mini_batch_tokens", mini_batch_tokens))
        if pad_to_multiple_of is not None:
            named.append(("pad_to_multiple_of", pad_to_multiple_of))
        for where, size in named:
            if isinstance(size, bool) or not isinstance(size, int):
                raise TypeError(f"{where} must be an int, got {type(size).__name__}")
            if size < 1:
                raise ValueError(f"{where} must be >= 1, got {size}")
        self.encoder = encoder
        self.mini_batch_size = mini_batch_size
        self.mini_batch_tokens = mini_batch_tokens
        self.pad_to_multiple_of = pad_to_multiple_of
        self.same_batch_size = same_batch_size
        self.allow_non_finite = allow_non_finite
        self.show_progress = show_progress
        self.world_size = data_parallel_world_size(gather_across_ranks)
        ddp, fsdp = find_ddp(encoder), find_fsdp(encoder)
        if mini_batch_context is None and ddp is not None:
            mini_batch_context = ddp_no_sync_context(ddp)
        if mini_batch_context is None and fsdp is not None:
            mini_batch_context = fsdp_sync_context(fsdp)
        self.mini_batch_context = mini_batch_context
        self.check_replay = check_replay
        if sparse_rep_grads not in (False, True, "auto"):
            raise ValueError(f"sparse_rep_grads must be False, True or 'auto', got {sparse_rep_grads!r}")
        self.sparse_rep_grads = sparse_rep_grads
        if sparse_reps not in (False, True, "auto"):
            raise ValueError(f"sparse_reps must be False, True or 'auto', got {sparse_reps!r}")
        self.sparse_reps = sparse_reps
        if not isinstance(reuse_argmax, bool):
            raise TypeError(f"reuse_argmax must be a bool, got {type(reuse_argmax).__name__}")
        self.reuse_argmax = reuse_argmax
        # Data-parallel training needs one (synchronising) backward per rank and step, and agreement
        # across ranks before Step (3) starts.
        self._data_parallel = self.world_size > 1 or ddp is not None or fsdp is not None
        # Under FSDP each forward and backward is a collective: every rank must run as many of each.
        self._equal_passes = fsdp is not None and data_parallel_world_size(None) > 1
        self._graphs = self._graphed_encoder(cuda_graphs)

    def _graphed_encoder(self, cuda_graphs: bool) -> GraphedEncoder | None:
        """The CUDA-graph replayer of ``cuda_graphs=True``, after checking that the options allow it."""
        if not isinstance(cuda_graphs, bool):
            raise TypeError(f"cuda_graphs must be a bool, got {type(cuda_graphs).__name__}")
        if not cuda_graphs:
            return None
        check_cuda_graph_options(
            pad_to_multiple_of=self.pad_to_multiple_of,
            mini_batch_tokens=self.mini_batch_tokens,
            reuse_argmax=self.reuse_argmax,
            module_encoder=isinstance(self.encoder, nn.Module),
            data_parallel=self._data_parallel,
        )
        assert isinstance(self.encoder, nn.Module)
        return GraphedEncoder.of(self.encoder)

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
        if self.sparse_rep_grads or self.sparse_reps:
            rep_grads = self._keep_at_nonzeros(reps, rep_grads, replay_state)
        del reps  # Step (3) needs only the gradients: free the reps before re-encoding
        self.replay(replay_state, rep_grads)  # Step (3)
        return output

    def encode(self, columns: Columns, *, loss_kwargs: Mapping[str, object] | None = None) -> EncodedBatch:
        """Step (1): encode every mini-batch of every column without a graph.

        The inputs are checked once, here, before any encoding: the columns (:meth:`check_columns`:
        shapes, one device), their token ids against the encoder's vocabulary
        (:meth:`check_token_ids`) and, when given, the batch-first tensors among the loss's keyword
        arguments (:meth:`check_loss_kwargs`); later steps trust them.

        Before each mini-batch the CPU generator and the generators of every CUDA device its inputs
        (and the encoder's parameters) live on are captured; the autocast state is captured once.
        Each mini-batch's trailing padding is trimmed first (see :func:`iter_mini_batches`); with
        ``mini_batch_tokens`` the rows are grouped by length, and each column's reps are still
        returned in its row order. Every column is cut into mini-batches before the first is
        encoded, so reading the row lengths back waits for no encoder work. With ``sparse_reps`` each
        mini-batch's reps are kept as their non-zeros (one device sync each) and the column is a
        :class:`~gradcache_sparton.sparse_reps.SparseReps` in its row order.
        """
        self.check_columns(columns)
        if loss_kwargs:
            self.check_loss_kwargs(columns, loss_kwargs)
        self.check_token_ids(columns)
        sizes = self._mini_batch_sizes(columns)
        encoder_devices = _cuda_devices_of_encoder(self.encoder)
        if self._graphs is not None:
            _check_graphable(columns, encoder_devices)
            self._graphs.check_parameters()
        input_device_types = {t.device.type for features in columns.values() for t in features.values()}
        autocast = AutocastState.capture(input_device_types)
        reps: dict[str, Tensor | SparseReps] = {}
        mini_batches: dict[str, tuple[MiniBatch, ...]] = {}
        keep_sparse: bool | None = None if self.sparse_reps == "auto" else bool(self.sparse_reps)
        plans = {
            column: list(
                iter_mini_batches(
                    features,
                    _rows(features),
                    sizes[column],
                    mini_batch_tokens=self.mini_batch_tokens,
                    pad_to_multiple_of=self.pad_to_multiple_of,
                )
            )
            for column, features in columns.items()
        }
        planned = sum(map(len, plans.values()))
        extra = 0
        if self._equal_passes:  # FSDP: as many forwards as the rank with the most mini-batches
            extra = count_on_every_rank(planned, _device_of(columns)) - planned
        argmax_reuse = ArgmaxReuse() if self.reuse_argmax else None  # this Step (1)'s head records
        with (
            torch.no_grad(),
            _quiet_reentrant_checkpoint(),
            self._progress(planned + extra, "GradCache Step (1) encode") as bar,
        ):
            for column, plan in plans.items():
                batch_size = _rows(columns[column])
                column_reps: Tensor | None = None  # [B, V], rows in the column's order
                sparse_parts: list[SparseReps] = []  # with sparse_reps: each mini-batch's non-zeros
                # With sparse_reps, the last mini-batch's dense reps until the next is queued, and their
                # non-zero count on its way to the host (read then: no wait on the device's queue).
                dense_part: tuple[Tensor, HostCount] | None = None
                reference: Tensor | None = None  # [0, V]: the width, dtype and device every rep must have
                column_mini_batches: list[MiniBatch] = []
                for rows, mb_features in plan:
                    rng = RngState.capture((*cuda_devices_of(mb_features.values()), *encoder_devices))
                    memo = argmax_reuse.memo() if argmax_reuse is not None else None
                    if self._graphs is not None:
                        rep = self._graphs.encode(mb_features, rng, autocast)  # [mb, V]
                    else:
                        try:
                            with recording(memo) if memo is not None else nullcontext():
                                rep = self.encoder(**mb_features)  # [mb, V]
                        except Exception as error:
                            error.add_note(_encode_failure_note(self.encoder, column, rows, mb_features))
                            raise
                    if memo is not None and not memo:
                        warnings.warn(
                            "reuse_argmax=True, but the encoder's forward recorded nothing to reuse (it calls no "
                            "SpartonHead eagerly: none, or compiled): Step (3) runs the full forward",
                            stacklevel=2,
                        )
                        memo = None
                    _check_rep(rep, column, rows, reference)
                    reference = rep.new_empty((0, *rep.shape[1:]))
                    if keep_sparse is None:
                        keep_sparse = _sparse_is_smaller(rep)
                        if self.world_size > 1:  # the gathered columns take one layout on every rank
                            keep_sparse = holds_on_every_rank(keep_sparse, rep.device)
                    if keep_sparse and rep.ndim == 2:
                        if dense_part is not None:
                            sparse_parts.append(_sparse_part(*dense_part))
                        dense_part = (rep, HostCount(torch.count_nonzero(rep)))
                    elif isinstance(rows, slice) and rows == slice(0, batch_size):
                        column_reps = rep  # one mini-batch of every row, in order: no copy
                    else:
                        if column_reps is None:
                            column_reps = rep.new_empty((batch_size, *rep.shape[1:]))
                        column_reps[rows] = rep  # [mb, V] -> its rows of [B, V]
                    fingerprint = _fingerprint(rep) if self.check_replay else None
                    column_mini_batches.append(
                        MiniBatch(
                            rows=rows, features=mb_features, rng=rng, fingerprint=fingerprint, memo=memo
                        )
                    )
                    bar.update()
                mini_batches[column] = tuple(column_mini_batches)
                if dense_part is not None:
                    sparse_parts.append(_sparse_part(*dense_part))
                if sparse_parts:
                    reps[column] = _in_column_order(SparseReps.concat(sparse_parts), mini_batches[column])
                    continue
                assert column_reps is not None  # a column has at least one row (check_columns)
                reps[column] = column_reps
            padding = []
            first_rows, first_features = next(iter(plans.values()))[0]
            for _ in range(extra):  # reps unused: the encode only joins the other ranks' collectives
                rng = RngState.capture((*cuda_devices_of(first_features.values()), *encoder_devices))
                self.encoder(**first_features)
                padding.append(MiniBatch(rows=first_rows, features=first_features, rng=rng))
                bar.update()
        replay_state = ReplayState(mini_batches=mini_batches, autocast=autocast, padding=tuple(padding))
        return EncodedBatch(reps, replay_state)

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
        leaves = {column: _leaf(rep) for column, rep in reps.items()}
        with torch.enable_grad():
            loss, components = self.compute_loss(leaves, loss_fn, loss_kwargs)
        loss.backward()
        grads = {column: _differentiable(leaf).grad for column, leaf in leaves.items()}
        return LossOutput(loss.detach(), components), grads

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
        caller's autocast block. Parameter gradients accumulate into ``.grad``.

        When gathering across ranks (``world_size`` W > 1), the gradients backpropagated are
        W · ``rep_grads``: DDP's average over ranks then gives single-process gradients (the scaling
        convention is written once, in ``cached_loss._ReplayOnBackward``). Under data parallelism a
        rank with nothing to replay runs one zero-gradient replay, so that every rank runs the one
        backward that synchronises gradients.

        Args:
            replay_state: from :meth:`encode`.
            rep_grads: per column dL/dr [B, V], as from :meth:`rep_gradients` (or kept at the reps'
                non-zeros, :class:`SparseRepGrad`); a column whose gradient is None is skipped (the
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
        if not self.allow_non_finite:
            named = {
                f"the gradient of column {column!r}": g.values if isinstance(g, SparseRepGrad) else g
                for column, g in grads.items()
            }
            if self._data_parallel:
                _raise_if_non_finite_on_any_rank(named, _replay_device(replay_state))
            else:
                _raise_if_non_finite(named)
        jobs = [
            _Job(column, k, mb) for column in grads for k, mb in enumerate(replay_state.mini_batches[column])
        ]
        first_column, first_mini_batches = next(iter(replay_state.mini_batches.items()))
        if not jobs and self._data_parallel:
            # The other ranks' last backward waits for this rank's gradients: replay one mini-batch
            # with a zero gradient rather than none (the loss ignores every column on this rank).
            jobs = [_Job(first_column, 0, first_mini_batches[0], zero_grad=True)]
        if self._equal_passes:  # FSDP: as many replays as the rank with the most, zero-gradient ones
            spare = replay_state.padding or first_mini_batches[:1]
            for i in range(count_on_every_rank(len(jobs), _replay_device(replay_state)) - len(jobs)):
                jobs.append(_Job(first_column, 0, spare[i % len(spare)], zero_grad=True))
        context = mini_batch_context or self.mini_batch_context or (lambda is_last: nullcontext())
        parameters = _parameters_of(self.encoder)
        # A failure in mini-batch k must not leave mini-batches 1..k-1 in .grad: put it back as it was.
        grad_state = GradState.capture(parameters or ())
        index, checked, differs = 0, [], []
        try:
            if self._graphs is not None:
                self._graphs.check_parameters()
                self._graphs.attach_grads()  # after the capture above: a failure puts .grad back
            with self._progress(len(jobs), "GradCache Step (3) replay") as bar:
                for index, (column, k, mb, zero_grad) in enumerate(jobs):
                    with context(index == len(jobs) - 1), mb.rng.replay():
                        if self._graphs is not None:
                            # Forward and backward in one graph launch (no data parallelism: no scaling).
                            grad = _mini_batch_grad(grads[column], k, mb)
                            rep = self._graphs.replay(mb.features, grad, mb.rng, replay_state.autocast)
                        else:
                            with (
                                replay_state.autocast.replay(),
                                torch.enable_grad(),
                                replaying(mb.memo) if mb.memo is not None else nullcontext(),
                            ):
                                rep = self.encoder(**mb.features)  # [mb, V]
                            if mb.memo is not None and not mb.memo.fully_taken:
                                raise RuntimeError(
                                    f"the replayed forward (column {column!r}, {describe_rows(mb.rows)}) took "
                                    f"back fewer of its {len(mb.memo)} Step (1) records: the encoder did not "
                                    "take the same path through its modules twice"
                                )
                            if zero_grad:  # the zero-gradient replays above
                                grad = torch.zeros_like(rep)
                            else:
                                grad = _mini_batch_grad(grads[column], k, mb)
                            if self.world_size > 1:
                                # W · dL/dr: DDP's average then gives single-process gradients (_ReplayOnBackward)
                                grad = grad * self.world_size
                            _check_replayed_rep(rep, grad, column, mb.rows)
                        if self.check_replay and mb.fingerprint is not None:
                            # Compared on the device; read back once, after the last mini-batch. A rep rebuilt
                            # from records is checked on the recording modules' inputs instead.
                            checked.append((column, mb))
                            memo_differs = None if mb.memo is None else mb.memo.differs()
                            differs.append(
                                _fingerprints_differ(_fingerprint(rep), mb.fingerprint)
                                if memo_differs is None
                                else memo_differs
                            )
                        if self._graphs is None:
                            rep.backward(grad)
                    bar.update()
            index = len(jobs)
            _raise_if_not_reproduced(checked, differs)
        except BaseException as error:
            grad_state.restore()
            error.add_note(_failure_note(jobs, index, restored=parameters is not None))
            raise

    def _keep_at_nonzeros(
        self,
        reps: Mapping[str, Tensor | SparseReps],
        rep_grads: Mapping[str, Tensor | None],
        replay_state: ReplayState,
    ) -> dict[str, Tensor | SparseRepGrad | None]:
        """Each column's dL/dr kept only where its reps are non-zero (``sparse_rep_grads``), or, for
        sparse reps (``sparse_reps``), its gradient at their weights in Step (1)'s mini-batch order."""
        kept: dict[str, Tensor | SparseRepGrad | None] = {}
        for column, grad in rep_grads.items():
            column_reps = reps[column]
            if grad is not None and isinstance(column_reps, SparseReps):
                rows = [mb.rows for mb in replay_state.mini_batches[column]]
                kept[column] = SparseRepGrad.at_sparse_reps(column_reps, grad, rows)
                continue
            if grad is None or grad.ndim != 2 or not self.sparse_rep_grads:
                kept[column] = grad  # unused column, or reps that are not [B, V]: dense
                continue
            rows = [mb.rows for mb in replay_state.mini_batches[column]]
            sparse = SparseRepGrad.at_nonzeros(column_reps, grad, rows)
            dense_bytes = grad.numel() * grad.element_size()
            kept[column] = sparse if self.sparse_rep_grads is True or sparse.nbytes < dense_bytes else grad
        return kept

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
                depend on the reps while gradients are enabled.
            FloatingPointError: the loss is not finite, unless ``allow_non_finite``.
            ValueError: when gathering across ranks, ranks passed different columns, keywords,
                trailing shapes, dtypes or rep layouts (dense or sparse) (raised on every rank).
        """
        if self.world_size > 1:
            # Every rank's rows in rank order; only this rank's slice carries a graph (to ``reps``).
            reps, loss_kwargs = gather_global_batch(reps, loss_kwargs)
        result = loss_fn(reps, **loss_kwargs)
        if isinstance(result, tuple):
            if len(result) != 2 or not isinstance(result[1], Mapping):
                raise TypeError(
                    "loss_fn must return a scalar Tensor or a tuple (scalar Tensor, dict of component "
                    f"Tensors), got a tuple of length {len(result)}"
                )
            loss, components = result
        else:
            loss, components = result, {}
        if not isinstance(loss, Tensor) or not loss.is_floating_point():
            kind = f"a {loss.dtype} Tensor" if isinstance(loss, Tensor) else type(loss).__name__
            raise TypeError(f"loss_fn must return a floating-point scalar Tensor, got {kind}")
        if loss.ndim != 0:
            raise ValueError(f"loss_fn must return a scalar (0-dim) Tensor, got shape {tuple(loss.shape)}")
        for name, value in components.items():
            if not isinstance(value, Tensor):
                raise TypeError(f"loss component {name!r} must be a Tensor, got {type(value).__name__}")
        if torch.is_grad_enabled() and not loss.requires_grad:
            raise ValueError("loss_fn's loss does not depend on the reps (it has no graph)")
        detached = {name: value.detach() for name, value in components.items()}
        if not self.allow_non_finite:
            _raise_if_non_finite({"the loss": loss.detach()}, components=detached)
        return LossOutput(loss, detached)

    def check_columns(self, columns: Columns) -> None:
        """Raise TypeError/ValueError naming the column and feature for malformed input columns."""
        if not isinstance(columns, Mapping) or not columns:
            raise ValueError("columns must be a non-empty mapping of column name -> features")
        batch_sizes: dict[str, int] = {}
        for column, features in columns.items():
            if not isinstance(features, Mapping) or not features:
                raise TypeError(f"column {column!r} must be a non-empty mapping of feature name -> Tensor")
            for name, value in features.items():
                if not isinstance(value, Tensor):
                    raise TypeError(
                        f"feature {name!r} of column {column!r} must be a torch.Tensor, got "
                        f"{type(value).__name__} (tokenize with return_tensors='pt')"
                    )
                if value.ndim == 0:
                    raise ValueError(f"feature {name!r} of column {column!r} must have a batch dimension")
            rows = {name: value.shape[0] for name, value in features.items()}
            if len(set(rows.values())) != 1:
                raise ValueError(f"features of column {column!r} have different batch sizes: {rows}")
            batch_sizes[column] = _rows(features)
            if batch_sizes[column] == 0:
                raise ValueError(f"column {column!r} is an empty batch (0 rows)")
            mask = features.get("attention_mask")
            if self.mini_batch_tokens is not None and (mask is None or mask.ndim != 2):
                raise ValueError(
                    f"mini_batch_tokens needs an attention_mask [B, S] in every column to measure row "
                    f"lengths; column {column!r} has {'none' if mask is None else f'one of shape {list(mask.shape)}'}"
                )
        _check_one_device(columns)
        if self.same_batch_size and len(set(batch_sizes.values())) != 1:
            raise ValueError(
                f"columns have different batch sizes {batch_sizes}; the loss needs them equal "
                "(pass same_batch_size=False for a loss whose columns differ in size)"
            )
        if isinstance(self.mini_batch_size, Mapping) and set(self.mini_batch_size) != set(columns):
            missing = sorted(set(columns) - set(self.mini_batch_size))
            extra = sorted(set(self.mini_batch_size) - set(columns))
            raise ValueError(
                f"mini_batch_size must have one entry per column: missing {missing}, not columns {extra}"
            )

    def check_loss_kwargs(self, columns: Columns, loss_kwargs: Mapping[str, object]) -> None:
        """With ``same_batch_size``, batch-first tensors in ``loss_kwargs`` must match the rows of ``columns``
        (already checked by :meth:`check_columns`)."""
        if not self.same_batch_size:
            return
        batch_size = _rows(next(iter(columns.values())))
        for name, value in loss_kwargs.items():
            if isinstance(value, Tensor) and value.ndim >= 1 and value.shape[0] != batch_size:
                raise ValueError(
                    f"loss keyword {name!r} has {value.shape[0]} rows but the columns have {batch_size} "
                    "(per-example loss inputs are batch-first)"
                )

    def check_token_ids(self, columns: Columns) -> None:
        """Raise ValueError naming the column when its ``input_ids`` fall outside the encoder's vocabulary.

        The vocabulary is the number of rows of the input embeddings of the transformers models inside the
        encoder (``get_input_embeddings()``; the largest if there are several); an encoder without one is
        not checked. An id outside it would otherwise fail inside the embedding lookup, naming nothing (on
        CPU), or end the CUDA context with a device-side assert. One device sync for all columns.
        """
        vocab_size = _input_vocab_size(self.encoder)
        named = {
            column: ids
            for column, features in columns.items()
            if isinstance(ids := features.get("input_ids"), Tensor)
            and ids.numel()
            and not ids.is_floating_point()
        }
        if vocab_size is None or not named:
            return
        # [columns, 2] (min, max) on the columns' one device, read back at once.
        bounds = torch.stack([torch.stack([ids.min(), ids.max()]).to(torch.int64) for ids in named.values()])
        for column, (low, high) in zip(named, bounds.tolist(), strict=True):
            if low < 0 or high >= vocab_size:
                raise ValueError(
                    f"column {column!r} has input_ids from {low} to {high}, but the encoder's vocabulary (its input "
                    f"embeddings) has {vocab_size} entries, ids 0 to {vocab_size - 1}: was it tokenized with "
                    "another model's tokenizer?"
                )

    def _mini_batch_sizes(self, columns: Columns) -> dict[str, int]:
        if isinstance(self.mini_batch_size, Mapping):
            return {column: self.mini_batch_size[column] for column in columns}
        return dict.fromkeys(columns, self.mini_batch_size)

    @contextmanager
    def _progress(self, total: int, description: str) -> Iterator[tqdm]:
        bar = tqdm(total=total, desc=description, unit="mini-batch", disable=not self.show_progress)
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


def _rows(features: Features) -> int:
    return next(iter(features.values())).shape[0]


def check_autograd_inputs(columns: Columns) -> None:
    """Raise ValueError naming the column and feature for a tensor made under ``torch.inference_mode()``,
    which Step (3)'s re-encoding, inside the backward, cannot use in autograd. For steps that will backprop."""
    for column, features in columns.items():
        for name, value in features.items():
            if isinstance(value, Tensor) and value.is_inference():
                raise ValueError(
                    f"feature {name!r} of column {column!r} was created under torch.inference_mode(), and the "
                    "cached loss needs autograd: Step (3) re-encodes it inside loss.backward(). Create the batch "
                    "outside inference_mode (torch.no_grad() is fine) or pass value.clone() made outside it"
                )


def _check_one_device(columns: Columns) -> None:
    # Every tensor of every column on one device (the encoder's, which the columns' tensors go into together).
    devices = {
        column: sorted({str(value.device) for value in features.values() if isinstance(value, Tensor)})
        for column, features in columns.items()
    }
    for column, found in devices.items():
        if len(found) > 1:
            placed = {name: str(value.device) for name, value in columns[column].items()}
            raise ValueError(f"the features of column {column!r} are on different devices: {placed}")
    if len({tuple(found) for found in devices.values()}) > 1:
        placed = ", ".join(f"{column!r} on {found[0]}" for column, found in devices.items())
        raise ValueError(
            f"the columns are on different devices ({placed}): move every column to the encoder's device"
        )


def _input_vocab_size(encoder: Callable[..., Tensor]) -> int | None:
    """The largest input-embedding size among the transformers models inside ``encoder`` (None: none found)."""
    if not isinstance(encoder, nn.Module):
        return None
    sizes = []
    for module in encoder.modules():
        get_input_embeddings = getattr(module, "get_input_embeddings", None)
        if not callable(get_input_embeddings):
            continue
        try:
            embeddings = get_input_embeddings()
        except (AttributeError, NotImplementedError):  # a model class without input embeddings
            continue
        size = getattr(embeddings, "num_embeddings", None)
        if isinstance(size, int):
            sizes.append(size)
    return max(sizes) if sizes else None


def _encode_failure_note(
    encoder: Callable[..., Tensor], column: str, rows: Rows, features: Mapping[str, Tensor]
) -> str:
    """Where Step (1) failed, and the devices when the inputs are not where the encoder's parameters are."""
    note = f"GradCache Step (1) failed encoding column {column!r} ({describe_rows(rows)})"
    inputs = sorted({str(value.device) for value in features.values()})
    if isinstance(encoder, nn.Module):
        parameters = sorted({str(p.device) for p in encoder.parameters()})
        if parameters and not set(inputs) <= set(parameters):
            note += f"; its inputs are on {', '.join(inputs)}, the encoder's parameters on {', '.join(parameters)}"
    return note


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


def _mini_batch_grad(grad: Tensor | SparseRepGrad, k: int, mb: MiniBatch) -> Tensor:
    # A column's rep gradient -> mini-batch k's [mb, V] slice.
    if isinstance(grad, SparseRepGrad):
        return grad.mini_batch(k)  # kept non-zeros -> [mb, V]
    return grad[mb.rows]  # [B, V] -> [mb, V]


def _check_graphable(columns: Columns, encoder_devices: tuple[int, ...]) -> None:
    # cuda_graphs: every input and the encoder on one and the same CUDA device.
    devices = {t.device for features in columns.values() for t in features.values()}
    if len(encoder_devices) != 1 or devices != {torch.device("cuda", encoder_devices[0])}:
        found = ", ".join(sorted(map(str, devices)))
        raise ValueError(
            "cuda_graphs=True needs the encoder's parameters and every column's tensors on one CUDA device; "
            f"the encoder is on CUDA devices {list(encoder_devices)}, the columns on {found}"
        )


def _sparse_part(rep: Tensor, nnz: HostCount) -> SparseReps:
    """A mini-batch's [mb, V] reps as their non-zeros, their count read from the host (no device sync)."""
    return SparseReps.from_dense(rep, dtype=None, nnz=nnz.value())


def _sparse_is_smaller(rep: Tensor) -> bool:
    """``sparse_reps="auto"``: whether [mb, V] reps take fewer bytes as SparseReps (an int32 id and a
    value per non-zero, an int64 offset per row) than dense (one device sync)."""
    if rep.ndim != 2:
        return False
    sparse_bytes = int(torch.count_nonzero(rep)) * (4 + rep.element_size()) + 8 * (rep.shape[0] + 1)
    return sparse_bytes < rep.numel() * rep.element_size()


def _in_column_order(reps: SparseReps, mini_batches: tuple[MiniBatch, ...]) -> SparseReps:
    # reps: the column's rows in Step (1)'s mini-batch order; length-grouped mini-batches are put back.
    order = mini_batch_order([mb.rows for mb in mini_batches], reps.offsets.device)  # [B]
    if order is None:
        return reps  # consecutive mini-batches: already in the column's order
    return reps.select(torch.argsort(order))  # [B]: column row -> its mini-batch position


def _leaf(rep: Tensor | SparseReps) -> Tensor | SparseReps:
    # Step (2)'s leaves: the dense reps, or the weights of sparse reps (their ids and offsets are fixed).
    if isinstance(rep, SparseReps):
        weights = rep.weights.detach().requires_grad_()
        return SparseReps(rep.offsets, rep.token_ids, weights, rep.vocab_size)
    return rep.detach().requires_grad_()


def _differentiable(leaf: Tensor | SparseReps) -> Tensor:
    return leaf.weights if isinstance(leaf, SparseReps) else leaf


def _check_rep(rep: object, column: str, rows: Rows, reference: Tensor | None) -> None:
    # reference: [0, V] like the column's earlier reps, which every mini-batch must match in width and dtype.
    if not isinstance(rep, Tensor):
        raise TypeError(f"encoder must return a Tensor [B, V], got {type(rep).__name__} (column {column!r})")
    expected = row_count(rows)
    if rep.ndim < 1 or rep.shape[0] != expected:
        raise ValueError(
            f"encoder returned shape {tuple(rep.shape)} for {expected} rows of column {column!r}; "
            "expected the batch dimension first"
        )
    if reference is not None and (
        rep.shape[1:] != reference.shape[1:] or rep.dtype != reference.dtype or rep.device != reference.device
    ):
        raise ValueError(
            f"encoder returned {list(rep.shape[1:])} {rep.dtype} on {rep.device} for {describe_rows(rows)} of "
            f"column {column!r} but {list(reference.shape[1:])} {reference.dtype} on {reference.device} "
            "for its earlier rows: every mini-batch of a column must give reps of one width, dtype and device"
        )


def _fingerprint(rep: Tensor) -> Tensor:
    """[mb, ...] -> [mb]: each row's fp32 sum, a cheap digest equal bit for bit for bitwise-equal reps.

    Computed the same way in Step (1) and Step (3): one layout (so one summation order), no graph,
    and outside autocast (CUDA autocast would cast the input to fp32 first, another kernel).
    """
    rows = rep.detach().contiguous().view(rep.shape[0], math.prod(rep.shape[1:]))  # [mb, ...] -> [mb, V]
    with torch.no_grad(), torch.autocast(rep.device.type, enabled=False):
        return rows.sum(dim=1, dtype=torch.float32)  # [mb, V] -> [mb]


def _fingerprints_differ(replayed: Tensor, first: Tensor) -> Tensor:
    # Compared as bits: NaN (allow_non_finite) equals itself, and -0.0 differs from 0.0.
    return (replayed.view(torch.int32) != first.view(torch.int32)).any()


def _raise_if_not_reproduced(checked: list[tuple[str, MiniBatch]], differs: list[Tensor]) -> None:
    if not differs:
        return
    # One device sync for every mini-batch's comparison.
    flags = torch.stack([flag.to(differs[0].device) for flag in differs]).tolist()
    bad = [
        f"column {column!r} {describe_rows(mb.rows)}"
        for (column, mb), flag in zip(checked, flags, strict=True)
        if flag
    ]
    if not bad:
        return
    rebuilt = any(mb.memo is not None for _, mb in checked)
    raise RuntimeError(
        f"GradCache Step (3) did not reproduce Step (1): the replayed reps of {len(bad)} of {len(checked)} "
        f"mini-batches differ from the reps the loss saw ({'; '.join(bad[:3])}{'; ...' if len(bad) > 3 else ''}), "
        + (
            "as the Sparton head's inputs show (reuse_argmax: its hidden states, weight or bias are not "
            "Step (1)'s), "
            if rebuilt
            else ""
        )
        + "so their gradients would belong to another function. Likely causes: the encoder's train/eval "
        "mode changed between the forward and the backward (model.eval() or model.train() in between); "
        "parameters were modified in place between the forward and the backward (e.g. optimizer.step() "
        "before loss.backward()); randomness the engine does not replay (Python's `random`, NumPy, a "
        "torch.Generator of the encoder's own: only torch's default CPU generator and the default "
        "generators of the CUDA devices in use are replayed). For an encoder that is legitimately not "
        "deterministic, pass check_replay=False."
    )


def _failure_note(jobs: list[_Job], index: int, *, restored: bool) -> str:
    if index < len(jobs):
        column, _, mb, _ = jobs[index]
        where = (
            f"in replayed mini-batch {index + 1} of {len(jobs)} (column {column!r}, {describe_rows(mb.rows)})"
        )
    else:
        where = f"after replaying all {len(jobs)} mini-batches"
    if not restored:
        return (
            f"GradCache Step (3) failed {where}; the encoder is not an nn.Module, so its gradients could not "
            "be restored: .grad may hold the mini-batches replayed before the failure (zero it before retrying)"
        )
    return (
        f"GradCache Step (3) failed {where}; the encoder's .grad was restored to what it was before the step"
    )


def _check_replayed_rep(rep: Tensor, grad: Tensor, column: str, rows: Rows) -> None:
    if not isinstance(rep, Tensor) or not rep.requires_grad:
        raise RuntimeError(
            f"the replayed rep (column {column!r}, {describe_rows(rows)}) does not require grad: the encoder "
            "ran without autograd (is it left under torch.no_grad(), or are all its parameters frozen?)"
        )
    if rep.shape != grad.shape or rep.dtype != grad.dtype:
        raise RuntimeError(
            f"the replayed rep (column {column!r}, {describe_rows(rows)}) is {tuple(rep.shape)} {rep.dtype} "
            "but Step (1) produced "
            f"{tuple(grad.shape)} {grad.dtype}: the encoder is not deterministic given RNG and autocast state"
        )


def _replay_device(replay_state: ReplayState) -> torch.device:
    first_mini_batch = next(iter(replay_state.mini_batches.values()))[0]
    return next(iter(first_mini_batch.features.values())).device


def _raise_if_non_finite_on_any_rank(tensors: Mapping[str, Tensor], device: torch.device) -> None:
    # Ranks raising alone would leave the others waiting in their synchronising backward: agree first
    # (one 1-element all-reduce on the inputs' device, which the process group's backend serves).
    flags = [torch.isfinite(t).all().to(device) for t in tensors.values()]
    finite_here = torch.stack(flags).all() if flags else torch.ones((), dtype=torch.bool, device=device)
    if holds_on_every_rank(finite_here, device):
        return
    if not bool(finite_here):
        _raise_if_non_finite(tensors)
    raise FloatingPointError(
        "non-finite rep gradients on another rank; stopping before Step (3) on every rank. If a GradScaler "
        "is in charge (fp16), pass allow_non_finite=True so it can skip the step."
    )


def _raise_if_non_finite(
    tensors: Mapping[str, Tensor], components: Mapping[str, Tensor] | None = None
) -> None:
    if not tensors:
        return
    # One device sync for all checks, not one per tensor.
    flags = [torch.isfinite(t).all() for t in tensors.values()]
    finite = torch.stack([flag.to(flags[0].device) for flag in flags]).cpu().tolist()
    if all(finite):
        return
    bad = [name for name, ok in zip(tensors, finite, strict=True) if not ok]
    message = f"non-finite values in {', '.join(bad)}; stopping before Step (3)"
    if components:
        bad_components = [name for name, value in components.items() if not torch.isfinite(value).all()]
        message += f" (non-finite loss components: {bad_components or 'none'})"
    raise FloatingPointError(
        message + ". If a GradScaler is in charge (fp16), pass allow_non_finite=True so it can skip the step."
    )
