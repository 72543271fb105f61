"""Warm-up schedule for the regularizer weights.

SPLADE (Formal et al. 2021) starts the FLOPS weights at 0 and raises them quadratically to their final
value over the first T steps (T = 50,000 in its MS MARCO configurations): strong sparsity pressure on
a freshly initialised head collapses the reps to zero before the ranking loss can shape them.

    weight(step) = final_weight · min(1, step / warmup_steps) ** p,   p = 2 (quadratic) or 1 (linear)

``warmup_steps = 0`` means the full weight from step 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from gradcache_sparton.primitives.option_field import option

__all__ = ["WARMUP_SHAPES", "WarmupSchedule", "check_step", "warmup_weight"]

# Shape name -> exponent p of the ramp.
WARMUP_SHAPES: dict[str, int] = {"quadratic": 2, "linear": 1}


def check_weight(value: float, *, name: str) -> None:
    """Raise unless ``value`` is a finite number >= 0 (a regularizer weight); ``name`` names the field."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float, got {type(value).__name__}")
    if not (value >= 0 and math.isfinite(value)):
        raise ValueError(f"{name} must be a finite number >= 0, got {value}")


def check_warmup(steps: int, shape: str, *, steps_name: str, shape_name: str) -> None:
    """Raise unless ``steps`` is an int >= 0 and ``shape`` one of :data:`WARMUP_SHAPES`.

    The one check of warm-up settings: :class:`WarmupSchedule` and
    :class:`~gradcache_sparton.losses.SpladeLossConfig` (``reg_warmup_steps``, ``reg_warmup_shape``) use
    it, each naming its own fields.
    """
    if isinstance(steps, bool) or not isinstance(steps, int):
        raise TypeError(f"{steps_name} must be an int, got {type(steps).__name__}")
    if steps < 0:
        raise ValueError(f"{steps_name} must be >= 0, got {steps}")
    if shape not in WARMUP_SHAPES:
        raise ValueError(f"{shape_name} must be one of {sorted(WARMUP_SHAPES)}, got {shape!r}")


def check_step(step: int) -> None:
    """Raise unless ``step`` (optimizer steps taken) is an int >= 0."""
    if isinstance(step, bool) or not isinstance(step, int):
        raise TypeError(f"step must be an int (optimizer steps taken), got {type(step).__name__}")
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")


def warmup_weight(step: int, *, final_weight: float, warmup_steps: int, shape: str = "quadratic") -> float:
    """The regularizer weight at ``step``: ``final_weight · min(1, step / warmup_steps) ** p``.

    Args:
        step: optimizer steps taken so far (a trainer's ``global_step``), >= 0.
        final_weight: the weight reached at ``warmup_steps`` and kept afterwards, >= 0.
        warmup_steps: length of the ramp, >= 0; 0 gives ``final_weight`` at every step.
        shape: ``"quadratic"`` (SPLADE's) or ``"linear"``.
    """
    return WarmupSchedule(final_weight=final_weight, warmup_steps=warmup_steps, shape=shape)(step)


@dataclass(frozen=True)
class WarmupSchedule:
    """A regularizer weight warmed up from 0 to ``final_weight`` over ``warmup_steps`` (see module doc).

    Stateless and immutable: call it with the current step; it keeps no step counter of its own.
    """

    final_weight: float = field(metadata={"help": "Weight reached at the end of the warm-up, >= 0."})
    warmup_steps: int = option(0, "Steps of the warm-up ramp, >= 0 (0: full weight from the start).")
    shape: str = option("quadratic", "Ramp shape: 'quadratic' (SPLADE) or 'linear'.")

    def __post_init__(self) -> None:
        check_weight(self.final_weight, name="final_weight")
        check_warmup(self.warmup_steps, self.shape, steps_name="warmup_steps", shape_name="shape")

    def __call__(self, step: int) -> float:
        """The weight at ``step`` (optimizer steps taken so far, >= 0)."""
        check_step(step)
        if self.warmup_steps == 0:
            return float(self.final_weight)
        progress = min(1.0, step / self.warmup_steps)
        return float(self.final_weight) * progress ** WARMUP_SHAPES[self.shape]
