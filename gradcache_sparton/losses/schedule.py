"""Warm-up schedule for the regularizer weights.

SPLADE (Formal et al. 2021) starts the FLOPS weights at 0 and raises them quadratically to their final
value over the first T steps (T = 50,000 in its MS MARCO configurations): strong sparsity pressure on
a freshly initialised head collapses the reps to zero before the ranking loss can shape them.

    weight(step) = final_weight · min(1, step / warmup_steps) ** p,   p = 2 (quadratic) or 1 (linear)

``warmup_steps = 0`` means the full weight from step 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["WARMUP_SHAPES", "WarmupSchedule", "warmup_weight"]

# Shape name -> exponent p of the ramp.
WARMUP_SHAPES: dict[str, int] = {"quadratic": 2, "linear": 1}


def _check_step(step: int) -> None:
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
    warmup_steps: int = field(
        default=0, metadata={"help": "Steps of the warm-up ramp, >= 0 (0: full weight from the start)."}
    )
    shape: str = field(
        default="quadratic", metadata={"help": "Ramp shape: 'quadratic' (SPLADE) or 'linear'."}
    )

    def __post_init__(self) -> None:
        if isinstance(self.final_weight, bool) or not isinstance(self.final_weight, (int, float)):
            raise TypeError(f"final_weight must be a float, got {type(self.final_weight).__name__}")
        if not self.final_weight >= 0 or self.final_weight == float("inf"):
            raise ValueError(f"final_weight must be a finite number >= 0, got {self.final_weight}")
        if isinstance(self.warmup_steps, bool) or not isinstance(self.warmup_steps, int):
            raise TypeError(f"warmup_steps must be an int, got {type(self.warmup_steps).__name__}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.shape not in WARMUP_SHAPES:
            raise ValueError(f"shape must be one of {sorted(WARMUP_SHAPES)}, got {self.shape!r}")

    def __call__(self, step: int) -> float:
        """The weight at ``step`` (optimizer steps taken so far, >= 0)."""
        _check_step(step)
        if self.warmup_steps == 0:
            return float(self.final_weight)
        progress = min(1.0, step / self.warmup_steps)
        return float(self.final_weight) * progress ** WARMUP_SHAPES[self.shape]
