"""Running a mini-batch eagerly: the encoder's forward in Step (1), its forward and backward in Step (3).

One of the ways :class:`~gradcache_sparton.engine.GradCache` runs a mini-batch, chosen once when it is
built: this one (the default), :class:`~gradcache_sparton.engine.run_memo.MemoRun`
(``reuse_argmax``: Step (3) rebuilds the Sparton head from Step (1)'s record) and
:class:`~gradcache_sparton.engine.cuda_graphs.GraphRun` (``cuda_graphs``). Each has the same four methods;
the engine captures and replays the RNG state around them, and checks what they return.

Legend: mb rows of a mini-batch, V rep width.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from gradcache_sparton.engine.argmax_reuse import ArgmaxMemo
from gradcache_sparton.engine.autocast_state import AutocastState
from gradcache_sparton.engine.checks import check_replayed_rep, encode_failure_note
from gradcache_sparton.engine.mini_batch import Rows
from gradcache_sparton.engine.rng_state import RngState
from gradcache_sparton.engine.types import Columns, Features, MiniBatch
from gradcache_sparton.primitives.column_routing import call_encoder, routes_by_column

__all__ = ["EagerRun"]


class EagerRun:
    """Each mini-batch as the encoder's own eager forward (and, in Step (3), backward)."""

    def __init__(self, encoder: Callable[..., Tensor]) -> None:
        self.encoder = encoder
        self._routed = routes_by_column(encoder)  # called with its column (primitives/column_routing)

    def start_encode(self, columns: Columns) -> None:
        """Called once per step before Step (1)'s first mini-batch."""

    def encode(
        self, column: str, rows: Rows, features: Features, rng: RngState, autocast: AutocastState
    ) -> tuple[Tensor, ArgmaxMemo | None]:
        """Step (1) for one mini-batch, run under the caller's ``no_grad``: its reps [mb, V] and what its
        modules recorded for the replay (None: nothing). ``rng`` and ``autocast`` are the state it runs
        under (already in effect)."""
        try:
            return call_encoder(self.encoder, column, features, routed=self._routed), None  # [mb, V]
        except Exception as error:
            error.add_note(encode_failure_note(self.encoder, column, rows, features))
            raise

    def start_replay(self) -> None:
        """Called once per step before Step (3)'s first mini-batch, after ``.grad`` was captured."""

    def replay(self, column: str, mb: MiniBatch, grad: Tensor | None, autocast: AutocastState) -> Tensor:
        """Step (3) for one mini-batch, run inside its replayed RNG state: re-encode it under Step (1)'s
        autocast state and backprop ``grad`` [mb, V] (None: a zero gradient) into the parameters' ``.grad``.
        Returns the replayed reps [mb, V], for the replay check."""
        with autocast.replay(), torch.enable_grad():
            rep = self.replay_forward(column, mb)  # [mb, V]
        grad = torch.zeros_like(rep) if grad is None else grad
        check_replayed_rep(rep, grad, column, mb.rows)
        rep.backward(grad)
        return rep

    def replay_forward(self, column: str, mb: MiniBatch) -> Tensor:
        """Step (3)'s forward of one mini-batch, with a graph."""
        return call_encoder(self.encoder, column, mb.features, routed=self._routed)
