"""Forward memos: what a module records in GradCache Step (1) so that Step (3) can skip its forward.

Step (3) re-runs each mini-batch's forward only to rebuild the graph that its backward needs. Some
modules can rebuild their part of that graph from much less than their forward costs. The Sparton
head is one: its backward needs only the max and argmax over the sequence
(:mod:`gradcache_sparton.kernels.sparton_ops`). A replay that reuses Step (1)'s max and argmax skips the
[B, S, D] x [D, V] product: 2·D·V FLOPs per token, against about 2 x 7M per layer for the encoder
(BERT-base width, V = 30,522), so about a third of a 6-layer forward and a fifth of a 12-layer one.

This module is the contract between the two sides, below both. The engine
(``GradCache(..., reuse_argmax=True)``) gives each mini-batch a memo (a :class:`ForwardMemo`: its own is
:class:`gradcache_sparton.engine.argmax_reuse.ArgmaxMemo`). It encodes the mini-batch in Step (1) under
:func:`recording` and replays it in Step (3) under :func:`replaying`. A module that supports memos:

- while recording (:func:`recording_memo`), computes as usual and hands the memo what its backward
  needs with :meth:`ForwardMemo.record`;
- while replaying (:func:`replaying_memo`), takes it back with :meth:`ForwardMemo.take`, in call
  order, and builds its output and backward from it, without the forward's work. The memo checks
  that the inputs it is given are bitwise Step (1)'s and tells the engine, whose replay check
  (``check_replay``) then covers a forward that no longer recomputes its output.

The memo is found through a context variable, so the encoder's signature is unchanged. A module that
knows nothing of memos runs as before. Only eager forwards record: code traced by ``torch.compile``
reads no context variable, and the engine warns when a mini-batch recorded nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from contextvars import ContextVar
from typing import Literal, Protocol

import torch
from torch import Tensor

__all__ = ["ForwardMemo", "recording", "recording_memo", "replaying", "replaying_memo"]


class ForwardMemo(Protocol):
    """One mini-batch's memo, as a max-pooling head sees it (legend: B batch, S sequence, D hidden, V
    vocabulary)."""

    def record(
        self, hidden_states: Tensor, weight: Tensor, bias: Tensor | None, max_logits: Tensor, argmax: Tensor
    ) -> None:
        """Step (1): the head's forward ran on H [B, S, D], E [V, D] and bias [V] (or None) and gave the
        [B, V] max and argmax over S; keep what its replay needs."""

    def take(self, hidden_states: Tensor, weight: Tensor, bias: Tensor | None) -> tuple[Tensor, Tensor]:
        """Step (3): the [B, V] (max, argmax) that the head's next call recorded in Step (1), in call order,
        for the replay's H, E and bias (whether they are Step (1)'s is the memo's check, reported to the
        engine, not raised here)."""


_ACTIVE: ContextVar[tuple[ForwardMemo, Literal["record", "replay"]] | None] = ContextVar(
    "gradcache_sparton_forward_memo", default=None
)


def recording(memo: ForwardMemo) -> AbstractContextManager[ForwardMemo]:
    """Step (1): memo-aware modules called inside append their records to ``memo``."""
    return _activated(memo, "record")


def replaying(memo: ForwardMemo) -> AbstractContextManager[ForwardMemo]:
    """Step (3): memo-aware modules called inside take their records back from ``memo``."""
    return _activated(memo, "replay")


@contextmanager
def _activated(memo: ForwardMemo, mode: Literal["record", "replay"]) -> Iterator[ForwardMemo]:
    token = _ACTIVE.set((memo, mode))
    try:
        yield memo
    finally:
        _ACTIVE.reset(token)


def recording_memo() -> ForwardMemo | None:
    """The memo to record into, when a module runs inside :func:`recording` (eagerly); else None."""
    return _active("record")


def replaying_memo() -> ForwardMemo | None:
    """The memo to take records from, when a module runs inside :func:`replaying` (eagerly); else None."""
    return _active("replay")


def _active(mode: Literal["record", "replay"]) -> ForwardMemo | None:
    if torch.compiler.is_compiling():
        return None  # a traced graph is replayed as it is: it neither records nor takes
    active = _ACTIVE.get()
    if active is None or active[1] != mode:
        return None
    return active[0]
