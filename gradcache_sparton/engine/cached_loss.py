"""``CachedLoss``: GradCache as a drop-in loss whose ``.backward()`` runs the replay.

Uncached training reads ``loss = loss_fn({c: encoder(**columns[c]) for c in columns}); loss.backward()``.
With ``cached = CachedLoss(encoder, loss_fn, mini_batch_size=32)`` it reads
``loss = cached(columns); loss.backward()``, with the same loss value and the same gradients, at
the activation memory of one mini-batch.

How: Step (1) encodes without a graph; the reps then pass through :class:`_ReplayOnBackward`, an
autograd node that is the identity forward and whose backward receives dL/dr for every column at
once, checks it, and runs Step (3). The loss is the user's loss on those reps, so Step (2) is split
across the two calls: its forward here, its backward inside ``loss.backward()``. Everything a
step needs lives in that autograd node (freed with the graph), never on ``self``: several forwards
before one backward each replay their own mini-batches.

Under DDP (``accelerate launch``, ``torchrun``) the loss is the global batch's, the same on every
rank, and the gradients after DDP's averaging equal single-process training on the global batch
(see :mod:`gradcache_sparton.engine.distributed`).

Legend: B batch (rows of a column), V rep width.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Literal, overload

import torch
from torch import Tensor
from torch.autograd.function import FunctionCtx

from gradcache_sparton.engine.gradcache import (
    Columns,
    GradCache,
    LossFn,
    LossOutput,
    ReplayState,
)

__all__ = ["CachedLoss"]


class CachedLoss:
    """Wrap an encoder and a loss over reps so the loss costs one mini-batch of activations.

    Args:
        encoder: ``encoder(**features) -> Tensor [B, V]``.
        loss_fn: ``loss_fn(reps: dict[str, Tensor], **loss_kwargs)`` -> scalar Tensor, or
            (scalar Tensor, dict of component Tensors for logging).
        mini_batch_size, mini_batch_tokens, **engine_options: the engine's settings, passed on as
            ``GradCache(encoder, mini_batch_size=..., mini_batch_tokens=..., **engine_options)``
            (documented there; the two that cut the batch are named here), e.g.
            ``allow_non_finite=True`` under an fp16 ``GradScaler``, which then skips non-finite steps
            as usual, or ``check_replay=False``. The engine is the ``engine`` attribute.

    Calling it returns the full-batch loss as a tensor whose ``.backward()`` runs Step (3); with
    ``return_components=True`` it returns :class:`LossOutput` ``(loss, components)``, the
    components detached. Called with gradients disabled (evaluation), it computes the loss and
    keeps nothing for a backward.
    """

    def __init__(
        self,
        encoder: Callable[..., Tensor],
        loss_fn: LossFn,
        *,
        mini_batch_size: int | Mapping[str, int],
        mini_batch_tokens: int | None = None,
        **engine_options: Any,
    ) -> None:
        if not callable(loss_fn):
            raise TypeError(
                f"loss_fn must be callable as loss_fn(reps, **loss_kwargs), got {type(loss_fn).__name__}"
            )
        self.engine = GradCache(
            encoder, mini_batch_size=mini_batch_size, mini_batch_tokens=mini_batch_tokens, **engine_options
        )
        if self.engine.sparse_rep_grads:
            raise ValueError(
                "sparse_rep_grads applies to GradCache.step only: inside loss.backward() autograd holds the "
                "dense rep gradients for the whole replay, so a sparse copy would save nothing"
            )
        if self.engine.sparse_reps:
            raise ValueError(
                "sparse_reps applies to GradCache.step only: CachedLoss hands the loss's dense rep gradients "
                "to the replay through autograd"
            )
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
        """The full-batch loss over ``columns``; its ``.backward()`` fills the encoder's gradients."""
        reps, replay_state = self.engine.encode(columns, loss_kwargs=loss_kwargs)  # Step (1), inputs checked
        if torch.is_grad_enabled():
            reps = _ReplayOnBackward.attach(self.engine, replay_state, reps)
        output = self.engine.compute_loss(reps, self.loss_fn, loss_kwargs)  # Step (2), forward half
        return output if return_components else output.loss


class _ReplayOnBackward(torch.autograd.Function):
    """Identity on the reps forward; backward runs GradCache Step (3) with the reps' gradients.

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
    def attach(engine: GradCache, replay_state: ReplayState, reps: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """Route ``reps`` (no graph) through a node that replays them on backward."""
        # Step (1)'s reps carry no graph; a requires-grad anchor makes this node's outputs part of one.
        anchor = torch.empty(0, requires_grad=True)
        outputs = _ReplayOnBackward.apply(anchor, engine, replay_state, *reps.values())
        return dict(zip(reps, outputs, strict=True))

    @staticmethod
    def forward(
        ctx: FunctionCtx, anchor: Tensor, engine: GradCache, replay_state: ReplayState, *reps: Tensor
    ) -> tuple[Tensor, ...]:
        # Only the replay state is kept (inputs and RNG states, small), never the [B, V] reps.
        ctx.engine = engine
        ctx.replay_state = replay_state
        # A column the loss does not use gets None, not zeros, so its replay is skipped.
        ctx.set_materialize_grads(False)
        return tuple(rep.view_as(rep) for rep in reps)

    @staticmethod
    def backward(ctx: FunctionCtx, *rep_grads: Tensor | None) -> tuple[None, ...]:
        columns = ctx.replay_state.mini_batches
        ctx.engine.replay(ctx.replay_state, dict(zip(columns, rep_grads, strict=True)))  # Step (3)
        # Step (3) delivered the gradient to the encoder's parameters itself: nothing flows on to the
        # anchor, the engine, the replay state or the graph-less reps.
        return (None, None, None, *(None for _ in rep_grads))
