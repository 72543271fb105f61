"""``CachedLoss``: GradCache as a drop-in loss whose ``.backward()`` runs the replay.

Uncached training reads ``loss = loss_fn({c: encoder(**columns[c]) for c in columns}); loss.backward()``.
With ``cached = CachedLoss(encoder, loss_fn, GradCacheConfig(mini_batch_size=32))`` (or
``CachedLoss(encoder, loss_fn, mini_batch_size=32)``: the config's fields as keywords) it reads
``loss = cached(columns); loss.backward()``, with the same loss value and the same gradients, at
the activation memory of one mini-batch.

How: Step (1) encodes without a graph; the reps then pass through :class:`_ReplayOnBackward`, an
autograd node that is the identity forward and whose backward receives dL/dr for every column at
once, checks it, and runs Step (3). The loss is the user's loss on those reps, so Step (2) is split
across the two calls: its forward here, its backward inside ``loss.backward()``. Everything a
step needs lives in that autograd node (freed with the graph), never on ``self``: several forwards
before one backward each replay their own mini-batches.

With ``sparse_reps`` (the engine's option, see :class:`~gradcache_sparton.engine.GradCacheConfig`) Step (1)
keeps each column as its non-zeros, a :class:`~gradcache_sparton.primitives.sparse_reps.SparseReps`;
the loss receives it with its ``weights`` routed through the same node, so ``loss.backward()`` brings
the node dL/d weights [nnz], the gradient at the non-zeros only, and Step (3) replays it as a
:class:`~gradcache_sparton.engine.sparse_grads.SparseRepGrad`, as :meth:`GradCache.step` does. Nothing of
size B x V is held from Step (1) to Step (3).

Under DDP (``accelerate launch``, ``torchrun``) the loss is the global batch's, the same on every
rank, and the gradients after DDP's averaging equal single-process training on the global batch
(see :mod:`gradcache_sparton.engine.distributed`).

Legend: B batch (rows of a column), V rep width, nnz non-zeros of a column's reps.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Literal, overload

import torch
from torch import Tensor
from torch.autograd.function import FunctionCtx

from gradcache_sparton.engine.checks import check_autograd_inputs
from gradcache_sparton.engine.config import GradCacheConfig
from gradcache_sparton.engine.gradcache import GradCache
from gradcache_sparton.engine.sparse_grads import SparseRepGrad
from gradcache_sparton.engine.types import Columns, LossFn, LossOutput, MiniBatchContext, ReplayState
from gradcache_sparton.primitives.sparse_reps import SparseReps

__all__ = ["CachedLoss"]


class CachedLoss:
    """Wrap an encoder and a loss over reps so the loss costs one mini-batch of activations.

    Args:
        encoder: ``encoder(**features) -> Tensor [B, V]``.
        loss_fn: ``loss_fn(reps: dict[str, Tensor], **loss_kwargs)`` -> scalar Tensor, or
            (scalar Tensor, dict of component Tensors for logging). With ``sparse_reps`` the reps are
            :class:`~gradcache_sparton.primitives.sparse_reps.SparseReps` (``weights`` differentiable,
            ``offsets`` and ``token_ids`` fixed), which :class:`~gradcache_sparton.losses.SpladeLoss`
            accepts.
        config: the engine's options, a :class:`~gradcache_sparton.engine.GradCacheConfig` (e.g.
            ``allow_non_finite=True`` under an fp16 ``GradScaler``, which then skips non-finite steps
            as usual, or ``sparse_reps=True`` / ``"auto"``: reps kept as their non-zeros from Step (1)
            to Step (3)).
        mini_batch_context: the engine's (see :class:`~gradcache_sparton.engine.GradCache`).
        **options: instead of ``config``, its fields as keywords (``mini_batch_size=32``). The engine is
            the ``engine`` attribute.

    Calling it returns the full-batch loss as a tensor whose ``.backward()`` runs Step (3); with
    ``return_components=True`` it returns :class:`LossOutput` ``(loss, components)``, the
    components detached. Called with gradients disabled (``torch.no_grad()``,
    ``torch.inference_mode()``: evaluation), it computes the loss and keeps nothing for a backward.
    Only ``backward()`` differentiates it (any upstream gradient: accumulation, a GradScaler's scale):
    ``torch.autograd.grad(loss, params)``, ``backward(inputs=...)``, ``create_graph=True`` and the
    backward of an evaluation loss raise ``RuntimeError`` saying why, since the parameters are reached
    by Step (3) inside the backward, not through the loss's graph.
    """

    def __init__(
        self,
        encoder: Callable[..., Tensor],
        loss_fn: LossFn,
        config: GradCacheConfig | None = None,
        *,
        mini_batch_context: MiniBatchContext | None = None,
        **options: Any,
    ) -> None:
        if not callable(loss_fn):
            raise TypeError(
                f"loss_fn must be callable as loss_fn(reps, **loss_kwargs), got {type(loss_fn).__name__}"
            )
        self.engine = GradCache(encoder, config, mini_batch_context=mini_batch_context, **options)
        self.loss_fn = loss_fn

    @overload
    def __call__(
        self, columns: Columns, *, return_components: Literal[False] = False, **loss_kwargs: object
    ) -> Tensor: ...

    @overload
    def __call__(
        self, columns: Columns, *, return_components: Literal[True], **loss_kwargs: object
    ) -> LossOutput: ...

    def __call__(
        self, columns: Columns, *, return_components: bool = False, **loss_kwargs: object
    ) -> Tensor | LossOutput:
        """The full-batch loss over ``columns``; its ``.backward()`` fills the encoder's gradients.

        The loss sees each column as a [B, V] tensor, or with ``sparse_reps`` as a :class:`SparseReps`.
        """
        if torch.is_grad_enabled():
            check_autograd_inputs(columns)
        reps, replay_state = self.engine.encode(columns, loss_kwargs=loss_kwargs)  # Step (1), inputs checked
        if torch.is_grad_enabled():
            reps = _ReplayOnBackward.attach(self.engine, replay_state, reps)
        loss, components = self.engine.compute_loss(reps, self.loss_fn, loss_kwargs)  # Step (2), forward half
        loss = loss.as_subclass(_CachedLossTensor)
        return LossOutput(loss, components) if return_components else loss


class _CachedLossTensor(Tensor):
    """The loss :class:`CachedLoss` returns: a scalar tensor like any other (every operation on it gives a
    plain tensor), except for the ways of differentiating it that Step (3) cannot serve, which raise an
    error saying so instead of torch's (which names neither the cached loss nor the cause):

    - ``torch.autograd.grad(loss, params)``: the parameters are not in the loss's graph; Step (3) reaches
      them by re-encoding inside ``loss.backward()`` and accumulates into their ``.grad``;
    - ``loss.backward(inputs=...)`` (Step (3) accumulates into every trained parameter of the encoder)
      and ``create_graph=True`` (the replayed gradients have no graph);
    - ``loss.backward()`` on a loss computed with autograd off (``torch.no_grad()``,
      ``torch.inference_mode()``: an evaluation, which kept nothing to replay).
    """

    @classmethod
    def __torch_function__(
        cls,
        func: Callable[..., object],
        types: tuple[type, ...],
        args: tuple[object, ...] = (),
        kwargs: dict[str, object] | None = None,
    ) -> object:
        kwargs = kwargs or {}
        if func is torch.autograd.grad:
            raise RuntimeError(
                "torch.autograd.grad cannot differentiate a CachedLoss: the encoder's parameters are not in the "
                "loss's graph, they get their gradients from Step (3), which re-encodes each mini-batch inside "
                "loss.backward() and accumulates into their .grad. Call loss.backward() (or "
                "accelerator.backward(loss), scaler.scale(loss).backward()) and read each parameter's .grad"
            )
        if func is Tensor.backward or func is torch.autograd.backward:
            _check_backward(args[0] if func is Tensor.backward else None, kwargs)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    def __repr__(self, *, tensor_contents: object = None) -> str:
        with torch._C.DisableTorchFunctionSubclass():
            return repr(self.as_subclass(Tensor))


def _check_backward(loss: Tensor | None, kwargs: Mapping[str, object]) -> None:
    """Raise for a backward of a cached loss that Step (3) cannot give (see :class:`_CachedLossTensor`)."""
    if kwargs.get("inputs") is not None:
        raise RuntimeError(
            "loss.backward(inputs=...) is not supported on a CachedLoss: Step (3) re-encodes inside the backward "
            "and accumulates into every trained parameter of the encoder; freeze parameters with "
            "requires_grad_(False) instead"
        )
    if kwargs.get("create_graph"):
        raise RuntimeError(
            "loss.backward(create_graph=True) is not supported on a CachedLoss: the gradients Step (3) replays "
            "have no graph of their own (no double backward)"
        )
    if loss is not None and not loss.requires_grad:
        raise RuntimeError(
            "this CachedLoss was computed with autograd off (under torch.no_grad() or torch.inference_mode()): "
            "that is an evaluation, which keeps nothing to replay. Call the CachedLoss with autograd on to train"
        )


class _ReplayOnBackward(torch.autograd.Function):
    """Identity on the reps forward; backward runs GradCache Step (3) with the reps' gradients.

    A column kept sparse (``sparse_reps``) passes its ``weights`` [nnz] through instead of [B, V]
    reps; the gradient it receives, dL/d weights, is the rep gradient at its non-zeros, and goes to
    Step (3) as a :class:`SparseRepGrad`. Everything below holds for both layouts.

    Loss scaling convention (the one place it is decided): the gradients reaching this node are
    d(g · L)/dr, where g is whatever gradient ``backward()`` brings to the loss: 1 for a plain
    ``loss.backward()``, 1/k when a trainer divides by k gradient-accumulation steps, the scale
    factor of ``scaler.scale(loss).backward()``. Step (3) backprops exactly these, so the parameter
    gradients are g · dL/dθ, as in uncached training, and Step (2)'s backward runs at the scaled
    magnitude (fp16 rep gradients do not underflow before the GradScaler's scale is applied).
    Data parallel: when the loss gathers W ranks' reps, L is the global batch's loss and Step (3)
    backprops W · d(g · L)/dr_local (``GradCache.replay``), because DDP divides the sum of the ranks'
    gradients by W: the result is g · dL/dθ of single-process training on the global batch. The
    returned loss is L itself, the same on every rank (not W · L).
    """

    @staticmethod
    def attach(
        engine: GradCache, replay_state: ReplayState, reps: Mapping[str, Tensor | SparseReps]
    ) -> dict[str, Tensor | SparseReps]:
        """Route ``reps`` (no graph; [B, V] tensors, or SparseReps by their weights) through a node that
        replays them on backward."""
        # Step (1)'s reps carry no graph; a requires-grad anchor makes this node's outputs part of one.
        anchor = torch.empty(0, requires_grad=True)
        sparse = {column: rep for column, rep in reps.items() if isinstance(rep, SparseReps)}
        tensors = [rep.weights if isinstance(rep, SparseReps) else rep for rep in reps.values()]
        outputs = _ReplayOnBackward.apply(anchor, engine, replay_state, sparse, *tensors)
        return {
            column: SparseReps(rep.offsets, rep.token_ids, output, rep.vocab_size)
            if isinstance(rep, SparseReps)
            else output
            for (column, rep), output in zip(reps.items(), outputs, strict=True)
        }

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        anchor: Tensor,
        engine: GradCache,
        replay_state: ReplayState,
        sparse: Mapping[str, SparseReps],
        *reps: Tensor,
    ) -> tuple[Tensor, ...]:
        # Only the replay state is kept (inputs and RNG states, small), never the [B, V] reps; for a
        # sparse column its ids and offsets too (Step (3) needs them to place the gradient; its weights
        # are the storage this node's output views, which the loss holds anyway).
        ctx.engine = engine
        ctx.replay_state = replay_state
        ctx.sparse = sparse
        # A column the loss does not use gets None, not zeros, so its replay is skipped.
        ctx.set_materialize_grads(False)
        return tuple(rep.view_as(rep) for rep in reps)

    @staticmethod
    def backward(ctx: FunctionCtx, *rep_grads: Tensor | None) -> tuple[None, ...]:
        mini_batches = ctx.replay_state.mini_batches
        grads: dict[str, Tensor | SparseRepGrad | None] = dict(zip(mini_batches, rep_grads, strict=True))
        for column, reps in ctx.sparse.items():
            grad = grads[column]
            if grad is not None:  # dL/d weights [nnz] -> placed by Step (1)'s mini-batches
                rows = [mb.rows for mb in mini_batches[column]]
                grads[column] = SparseRepGrad.at_sparse_reps(reps, grad, rows)
        ctx.engine.replay(ctx.replay_state, grads)  # Step (3)
        # Step (3) delivered the gradient to the encoder's parameters itself: nothing flows on to the
        # anchor, the engine, the replay state, the sparse layouts or the graph-less reps.
        return (None, None, None, None, *(None for _ in rep_grads))
