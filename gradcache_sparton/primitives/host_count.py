"""Reading a count from the device without stalling the host's queue of work.

Keeping only the non-zeros of a tensor (``nonzero``) needs their number on the host to size the output,
and reading it right away makes the host wait until the device has finished everything queued so far.
Inside a GradCache step that is once per mini-batch: the host cannot queue the next mini-batch while the
device works. :class:`HostCount` starts the copy of the count to pinned host memory behind the work
queued so far and records an event; :meth:`HostCount.value` later waits for that event only. Read one
mini-batch late, after the host has queued the next mini-batch, the wait leaves the device busy. With
the count known, ``torch.nonzero_static(..., size=n)`` keeps the non-zeros without a sync.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["HostCount"]


class HostCount:
    """A 0-d integer tensor's value, read on the host later: on CUDA, copied to pinned memory behind the
    work queued so far and read after waiting for that work only; elsewhere read as it is."""

    def __init__(self, count: Tensor) -> None:
        if count.ndim != 0 or count.is_floating_point():
            raise ValueError(
                f"count must be a 0-d integer tensor, got {count.dtype} of shape {tuple(count.shape)}"
            )
        self._event: torch.cuda.Event | None = None
        if count.is_cuda:
            self._host = torch.empty((), dtype=count.dtype, pin_memory=True)
            self._host.copy_(count, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(count.device))
        else:
            self._host = count

    def value(self) -> int:
        """The count (on CUDA, waits for the work queued before it was taken, not for later work)."""
        if self._event is not None:
            self._event.synchronize()
        return int(self._host)
