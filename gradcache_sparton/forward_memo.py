"""Forward memos: what a module records in GradCache Step (1) so that Step (3) can skip its forward.

Step (3) re-runs each mini-batch's forward only to rebuild the graph that its backward needs. Some
modules can rebuild their part of that graph from much less than their forward costs. The Sparton
head is one: its backward needs only the max and argmax over the sequence
(:mod:`gradcache_sparton.kernels.head`). A replay that reuses Step (1)'s max and argmax skips the
[B, S, D] x [D, V] product: 2·D·V FLOPs per token, against about 2 x 7M per layer for the encoder
(BERT-base width, V = 30,522), so about a third of a 6-layer forward and a fifth of a 12-layer one.

The engine (``GradCache(..., reuse_argmax=True)``) gives each mini-batch a :class:`ForwardMemo`. It
encodes the mini-batch in Step (1) under :func:`recording` and replays it in Step (3) under
:func:`replaying`. A module that supports memos:

- while recording (:func:`recording_memo`), computes as usual and appends what its backward needs
  with :meth:`ForwardMemo.record`;
- while replaying (:func:`replaying_memo`), takes its record back with :meth:`ForwardMemo.take`, in
  call order, and builds its output and backward from it, without the forward's work. It reports
  with :meth:`ForwardMemo.report` whether its inputs were bitwise Step (1)'s. This is the replay check
  (``check_replay``) for a forward that no longer recomputes its output.

The memo is found through a context variable, so the encoder's signature is unchanged. A module that
knows nothing of memos runs as before. Only eager forwards record: code traced by ``torch.compile``
reads no context variable, and the engine warns when a mini-batch recorded nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from contextvars import ContextVar
from typing import Literal

import torch
from torch import Tensor

__all__ = ["ForwardMemo", "recording", "recording_memo", "replaying", "replaying_memo"]


class ForwardMemo:
    """One mini-batch's records, in the order its forward made them.

    Each record is taken back once, in that order; taking drops the memo's reference to it, so a
    record's memory is freed as soon as its replayed backward has run.
    """

    def __init__(self) -> None:
        self._records: list[object | None] = []
        self._taken = 0
        self._differs: list[Tensor] = []  # one bool per record taken: its inputs were not Step (1)'s

    def __len__(self) -> int:
        """How many records Step (1) made."""
        return len(self._records)

    def record(self, entry: object) -> None:
        """Append what a module's replay will need (Step (1))."""
        self._records.append(entry)

    def take(self) -> object:
        """The next record, in Step (1)'s order (Step (3)).

        Raises:
            RuntimeError: the replay asks for more records than Step (1) made, so it does not follow
                Step (1)'s path through the encoder.
        """
        if self._taken >= len(self._records):
            raise RuntimeError(
                f"the replayed forward asked for record {self._taken + 1} but Step (1) made "
                f"{len(self._records)}: the encoder did not take the same path through its modules twice"
            )
        entry = self._records[self._taken]
        self._records[self._taken] = None
        self._taken += 1
        return entry

    def report(self, differs: Tensor) -> None:
        """A replayed module's check: a bool scalar on the device, True where its inputs were not bitwise
        Step (1)'s. Nothing is read back here."""
        self._differs.append(differs)

    @property
    def fully_taken(self) -> bool:
        """Whether the replay took every record Step (1) made."""
        return self._taken == len(self._records)

    def differs(self) -> Tensor | None:
        """A bool scalar on the device: whether any replayed module reported inputs other than Step (1)'s;
        None when none reported."""
        if not self._differs:
            return None
        return torch.stack([flag.to(self._differs[0].device) for flag in self._differs]).any()


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
