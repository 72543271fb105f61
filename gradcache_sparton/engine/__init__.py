"""The GradCache engine: exact very-large-batch training of any encoder under any loss over reps.

- :class:`CachedLoss`: drop-in, ``loss = cached(columns); loss.backward()``.
- :class:`GradCache`: the engine, Steps (1)-(3) as methods, :meth:`GradCache.step` for one call.
- :class:`GradCacheConfig`: every option of both, as asked (the trainer's arguments inherit it); what a
  step runs with, every option decided, is ``GradCache.settings``
  (:class:`~gradcache_sparton.engine.settings.StepSettings`, decided by
  :func:`~gradcache_sparton.engine.settings.resolve_settings`).
- The types they take and return: :data:`Columns`, :data:`Features`, :data:`LossFn`,
  :class:`LossOutput`, :class:`EncodedBatch`, :class:`ReplayState`, :data:`MiniBatchContext`.

The pieces inside stay importable from their modules (``engine.rng_state``, ``engine.mini_batch``,
``engine.distributed``, ...); the layout is described in :mod:`gradcache_sparton.engine.gradcache`.
"""

from gradcache_sparton.engine.cached_loss import CachedLoss
from gradcache_sparton.engine.config import GradCacheConfig
from gradcache_sparton.engine.gradcache import GradCache
from gradcache_sparton.engine.types import (
    Columns,
    EncodedBatch,
    Features,
    LossFn,
    LossOutput,
    MiniBatchContext,
    ReplayState,
)

__all__ = [
    "CachedLoss",
    "Columns",
    "EncodedBatch",
    "Features",
    "GradCache",
    "GradCacheConfig",
    "LossFn",
    "LossOutput",
    "MiniBatchContext",
    "ReplayState",
]
