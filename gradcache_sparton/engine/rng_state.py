"""Capture and replay of the random-number state that an encoder forward consumes (dropout).

GradCache encodes every mini-batch twice: once without a graph (Step 1) and once with one (Step 3).
Both passes must draw the same dropout masks, or the gradients of Step 3 belong to a different
function than the reps the loss saw. So Step (1) captures the generator states just before each
mini-batch, and Step (3) replays them inside :func:`torch.random.fork_rng`, which restores the
global streams on exit: replaying leaves the caller's random stream exactly where Step (1) left it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["RngState", "cuda_devices_of"]


def cuda_devices_of(tensors: Iterable[Tensor]) -> tuple[int, ...]:
    """The sorted, distinct CUDA device indices the given tensors live on (empty for CPU-only)."""
    return tuple(sorted({t.device.index for t in tensors if t.device.type == "cuda"}))


@dataclass(frozen=True)
class RngState:
    """The CPU generator state and the state of each listed CUDA device's default generator."""

    cpu: Tensor
    # (device index, state) per CUDA device; empty when everything lives on the CPU.
    cuda: tuple[tuple[int, Tensor], ...]

    @classmethod
    def capture(cls, cuda_devices: Iterable[int] = ()) -> RngState:
        """Snapshot the CPU generator and the generators of ``cuda_devices``.

        Call this after the inputs have been moved to their device: the devices to capture are the
        ones the forward will draw from, and moving tensors can initialise CUDA.
        """
        return cls(
            cpu=torch.get_rng_state(),
            cuda=tuple((index, torch.cuda.get_rng_state(index)) for index in sorted(set(cuda_devices))),
        )

    @contextmanager
    def replay(self) -> Iterator[None]:
        """Run the body with the captured states; on exit every global stream is as it was before."""
        with torch.random.fork_rng(devices=[index for index, _ in self.cuda]):
            torch.set_rng_state(self.cpu)
            for index, state in self.cuda:
                torch.cuda.set_rng_state(state, index)
            yield
