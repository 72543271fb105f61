"""Running a mini-batch with a forward memo (``reuse_argmax``): Step (3) rebuilds what Step (1) recorded.

In Step (1) every memo-aware module of the encoder (the Sparton head, called eagerly) records what its
backward needs in the mini-batch's memo (an :class:`~gradcache_sparton.engine.argmax_reuse.ArgmaxMemo`,
made by the Step's own :class:`~gradcache_sparton.engine.argmax_reuse.ArgmaxReuse`); in Step (3) it
takes the record back and builds its output and backward from it, skipping its forward's work (see
:mod:`~gradcache_sparton.primitives.forward_memo`, the contract, and :mod:`~gradcache_sparton.engine.argmax_reuse`). Everything else runs as in
:class:`~gradcache_sparton.engine.run_eager.EagerRun`. With ``check_replay``, a rebuilt module's replay
is checked on its inputs (reported to the memo), since its output is rebuilt, not recomputed.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

from torch import Tensor

from gradcache_sparton.engine.argmax_reuse import ArgmaxMemo, ArgmaxReuse
from gradcache_sparton.engine.autocast_state import AutocastState
from gradcache_sparton.engine.mini_batch import Rows, describe_rows
from gradcache_sparton.engine.rng_state import RngState
from gradcache_sparton.engine.run_eager import EagerRun
from gradcache_sparton.engine.types import Columns, Features, MiniBatch
from gradcache_sparton.primitives.forward_memo import recording, replaying

__all__ = ["MemoRun"]


class MemoRun(EagerRun):
    """Each mini-batch eagerly, its memo-aware modules recorded in Step (1) and rebuilt in Step (3).

    Args:
        encoder: the encoder.
        warn_unrecorded: warn when a mini-batch's forward records nothing (``reuse_argmax=True`` given
            explicitly); otherwise (the automatic default) such a mini-batch silently runs its full forward.
    """

    def __init__(self, encoder: Callable[..., Tensor], *, warn_unrecorded: bool) -> None:
        super().__init__(encoder)
        self.warn_unrecorded = warn_unrecorded
        # The records of the Step (1) under way: each Step (1) owns its own (another step's, run before its
        # replay, neither compacts nor waits on them); every memo keeps its owner.
        self._records: ArgmaxReuse | None = None

    def start_encode(self, columns: Columns) -> None:
        self._records = ArgmaxReuse()

    def encode(
        self, column: str, rows: Rows, features: Features, rng: RngState, autocast: AutocastState
    ) -> tuple[Tensor, ArgmaxMemo | None]:
        assert self._records is not None  # start_encode comes first
        memo = self._records.memo()
        with recording(memo):
            rep, _ = super().encode(column, rows, features, rng, autocast)
        if memo:
            return rep, memo
        if self.warn_unrecorded:
            warnings.warn(
                "reuse_argmax=True, but the encoder's forward recorded nothing to reuse (it calls no "
                "SpartonHead eagerly: none, or compiled): Step (3) runs the full forward",
                stacklevel=4,
            )
        return rep, None

    def replay_forward(self, column: str, mb: MiniBatch) -> Tensor:
        if mb.memo is None:
            return super().replay_forward(column, mb)
        with replaying(mb.memo):
            rep = super().replay_forward(column, mb)  # [mb, V]
        if not mb.memo.fully_taken:
            raise RuntimeError(
                f"the replayed forward (column {column!r}, {describe_rows(mb.rows)}) took back fewer of its "
                f"{len(mb.memo)} Step (1) records: the encoder did not take the same path through its modules twice"
            )
        return rep
