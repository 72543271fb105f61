"""The values the GradCache engine takes and hands between its steps.

Legend: B batch (rows of a column), S sequence, V rep width, mb rows of a mini-batch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import NamedTuple

from torch import Tensor

from gradcache_sparton.engine.argmax_reuse import ArgmaxMemo
from gradcache_sparton.engine.autocast_state import AutocastState
from gradcache_sparton.engine.mini_batch import Rows
from gradcache_sparton.engine.rng_state import RngState
from gradcache_sparton.primitives.sparse_reps import SparseReps

__all__ = [
    "Columns",
    "EncodedBatch",
    "Features",
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
    row sums [mb]; None when the replay is not checked), with ``reuse_argmax`` what its modules
    recorded in Step (1) for the replay (None when nothing was recorded) and, with ``keep_graphs``, its
    Step (1) reps [mb, V] with their graph, which Step (3) backprops instead of re-encoding (None: replayed)."""

    rows: Rows
    features: dict[str, Tensor]
    rng: RngState
    fingerprint: Tensor | None = None
    memo: ArgmaxMemo | None = None
    graph: Tensor | None = None


@dataclass(frozen=True)
class ReplayState:
    """What Step (3) needs from Step (1): each column's mini-batches, and the autocast state; under FSDP,
    the extra encodes that matched other ranks' counts (``padding``: copies of the first mini-batch, whose
    reps no loss sees; replayed with a zero gradient)."""

    mini_batches: dict[str, tuple[MiniBatch, ...]]
    autocast: AutocastState
    padding: tuple[MiniBatch, ...] = ()


class EncodedBatch(NamedTuple):
    """Step (1)'s result: the reps without a graph, and the state to replay them with a graph."""

    reps: dict[str, Tensor | SparseReps]  # column -> [B, V], or its non-zeros with ``sparse_reps``
    replay_state: ReplayState
