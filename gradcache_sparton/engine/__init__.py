"""The GradCache engine: exact very-large-batch training of any encoder under any loss over reps.

- :class:`CachedLoss`: drop-in, ``loss = cached(columns); loss.backward()``.
- :class:`GradCache`: the engine, Steps (1)-(3) as methods, :meth:`GradCache.step` for one call.
- :class:`GradCacheConfig`: every option of both, as asked (the trainer's arguments inherit it); what a
  step runs with, every option decided, is ``GradCache.settings``
  (:class:`~gradcache_sparton.engine.settings.StepSettings`, decided by
  :func:`~gradcache_sparton.engine.settings.resolve_settings`).
- The types they take and return: :data:`Columns`, :data:`Features`, :data:`LossFn`,
  :class:`LossOutput`, :class:`EncodedBatch`, :class:`ReplayState`, :data:`MiniBatchContext`.

The pieces, one concept a module, each importable from its module:

- the engine, Steps (1)-(3): :mod:`.gradcache`; as a drop-in loss: :mod:`.cached_loss`; the values taken and
  handed between the steps: :mod:`.types`;
- the options: :mod:`.config`; the rules between them, one table: :mod:`.option_rules`; the settings every
  step runs with, decided from them: :mod:`.settings`;
- the checks: :mod:`.checks`; a column cut into mini-batches: :mod:`.mini_batch`;
- how one mini-batch runs (chosen once, when the engine is built): eagerly, :mod:`.run_eager`; with a forward
  memo, :mod:`.run_memo`; as CUDA graphs, :mod:`.cuda_graphs`; Step (3) rebuilding the head from Step (1)'s
  argmax (``reuse_argmax``): :mod:`.argmax_reuse`; mini-batches that keep their Step (1) graph for Step (3)
  instead of a replay (``keep_graphs``): :mod:`.kept_graphs`;
- a memory budget (``max_memory``): its sizes, :mod:`.memory_size`; what it chooses on the first step, the
  planner (:mod:`.planner`: the plan, its measured probe and the allocator it sets);
- the reps in either layout: :mod:`.reps`; the sparse layout's gradients: :mod:`.sparse_grads`;
- the captured states: :mod:`.rng_state`, :mod:`.autocast_state`, :mod:`.grad_state`;
- data parallelism: :mod:`.distributed` (Step (2) sees every rank's reps, Step (3) replays W times this rank's
  gradient slice, and only the last replayed mini-batch synchronises gradients).
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
