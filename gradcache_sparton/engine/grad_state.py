"""Capture and restore of parameter gradients, so that a Step (3) that fails midway leaves ``.grad`` as it was.

Step (3) of GradCache backpropagates one mini-batch at a time, each accumulating into ``.grad``. An
exception or an out-of-memory error in mini-batch k would otherwise leave the gradients of the k - 1
mini-batches before it on top of what ``.grad`` held (e.g. earlier gradient-accumulation micro-steps):
a silently wrong gradient if the caller catches the error and goes on. So Step (3) captures the
gradients before its first backward and restores them, bit for bit, when it fails.

Memory: a parameter whose ``.grad`` is None costs nothing (the common case: the optimizer zeroed the
gradients with ``set_to_none``); an existing gradient is copied once (a gradient-accumulation
micro-step after the first), as large as the parameter. Keeping the copy rather than moving the
gradient aside leaves Step (3) itself untouched: gradients accumulate in the same order as without
the capture (bitwise the same result), and under DDP the synchronising backward all-reduces the
accumulated gradient as it does in uncached training.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from torch import Tensor, nn

__all__ = ["GradState"]


@dataclass(frozen=True)
class GradState:
    """Per parameter: the ``.grad`` tensor it had (None or the very tensor object) and a copy of its values."""

    # (parameter, its .grad tensor object or None, a copy of the values or None)
    saved: tuple[tuple[nn.Parameter | Tensor, Tensor | None, Tensor | None], ...]

    @classmethod
    def capture(cls, parameters: Iterable[nn.Parameter | Tensor]) -> GradState:
        """Snapshot the gradients of ``parameters`` (a copy only where a gradient exists)."""
        return cls(
            saved=tuple((p, p.grad, None if p.grad is None else p.grad.detach().clone()) for p in parameters)
        )

    def restore(self) -> None:
        """Put every gradient back as captured: None stays None; values restored bit for bit.

        A dense gradient is copied back into the tensor object the parameter had, which keeps its
        identity (DDP's ``gradient_as_bucket_view`` gradients stay views of their bucket).
        """
        for parameter, grad, values in self.saved:
            if grad is not None and values is not None and not grad.is_sparse:
                grad.detach().copy_(values)
                values = grad
            parameter.grad = values
