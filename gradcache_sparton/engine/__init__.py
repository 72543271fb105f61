"""The GradCache engine: exact very-large-batch training of any encoder under any loss over reps.

- :class:`CachedLoss`: drop-in, ``loss = cached(columns); loss.backward()``.
- :class:`GradCache`: the engine, Steps (1)-(3) as methods, :meth:`GradCache.step` for one call.
- :class:`RngState`, :class:`AutocastState`: what Step (1) captures and Step (3) replays;
  :class:`GradState`: the gradients Step (3) restores when it fails midway; :class:`SparseRepGrad`:
  rep gradients kept at the reps' non-zeros between Step (2) and Step (3) (``sparse_rep_grads``).
- :func:`iter_mini_batches`: a column cut into mini-batches (consecutive rows, or grouped by length
  under a token budget), each trimmed of its trailing padding.
- :func:`gather_global_batch`, :func:`ddp_no_sync_context`: the data-parallel pieces both use under DDP.
"""

from gradcache_sparton.engine.autocast_state import AutocastState
from gradcache_sparton.engine.cached_loss import CachedLoss
from gradcache_sparton.engine.distributed import ddp_no_sync_context, gather_global_batch
from gradcache_sparton.engine.grad_state import GradState
from gradcache_sparton.engine.gradcache import (
    Columns,
    EncodedBatch,
    Features,
    GradCache,
    LossFn,
    LossOutput,
    MiniBatch,
    MiniBatchContext,
    ReplayState,
)
from gradcache_sparton.engine.mini_batch import Rows, iter_mini_batches, row_slices
from gradcache_sparton.engine.rng_state import RngState
from gradcache_sparton.engine.sparse_grads import SparseRepGrad

__all__ = [
    "AutocastState",
    "CachedLoss",
    "Columns",
    "EncodedBatch",
    "Features",
    "GradCache",
    "GradState",
    "LossFn",
    "LossOutput",
    "MiniBatch",
    "MiniBatchContext",
    "ReplayState",
    "RngState",
    "Rows",
    "SparseRepGrad",
    "ddp_no_sync_context",
    "gather_global_batch",
    "iter_mini_batches",
    "row_slices",
]
