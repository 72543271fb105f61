"""The planner: what a memory budget (``max_memory``) chooses on the first step, in its own room.

- :mod:`~gradcache_sparton.engine.planner.memory_probe`: :class:`MemoryPlanner` measures a column's peak
  memory on CUDA (a short probe) and makes the plan;
- :mod:`~gradcache_sparton.engine.planner.memory_plan`: :func:`choose_plan`, the fastest step whose
  predicted peak fits the budget, from the measured fits; :class:`MemoryPlan`, the settings chosen (the
  engine's :class:`~gradcache_sparton.engine.settings.StepSettings`) and the numbers they were chosen from;
- :mod:`~gradcache_sparton.engine.planner.allocator`: the CUDA caching allocator's expandable segments,
  turned on for a plan.

The planner reads the user's ``GradCacheConfig`` and the encoder's facts, starts from the settings they decide
(:mod:`gradcache_sparton.engine.settings`) and returns them with the options left unset chosen; the rules
between options (:mod:`gradcache_sparton.engine.option_rules`) say what it may choose. Import from the modules.
"""

__all__: list[str] = []
