"""Capture and replay of the autocast state (enabled flag and dtype per device type).

Step (3) of GradCache usually runs inside ``loss.backward()``, outside the caller's
``torch.autocast`` block. Re-encoding there without the Step (1) autocast state would run the
encoder in fp32: different reps than the loss saw (wrong gradients) and, at bf16, several times
slower. So Step (1) captures the state and Step (3) re-enters it, explicitly disabling the device
types that were disabled (a ``backward()`` called inside an autocast block must not change Step 3).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

import torch

__all__ = ["AutocastState"]

# Device types whose autocast state is always captured; the devices of the inputs are added to them.
DEFAULT_DEVICE_TYPES: tuple[str, ...] = ("cpu", "cuda")


@dataclass(frozen=True)
class AutocastState:
    """Per device type: (device type, enabled, dtype); plus whether autocast's weight cast cache is on."""

    settings: tuple[tuple[str, bool, torch.dtype], ...]
    cache_enabled: bool

    @classmethod
    def capture(cls, device_types: Iterable[str] = ()) -> AutocastState:
        """Snapshot the current thread's autocast state for CPU, CUDA and ``device_types``."""
        types = dict.fromkeys([*DEFAULT_DEVICE_TYPES, *device_types])
        return cls(
            settings=tuple(
                (device_type, torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type))
                for device_type in types
            ),
            cache_enabled=torch.is_autocast_cache_enabled(),
        )

    @contextmanager
    def replay(self, *, cache_enabled: bool | None = None) -> Iterator[None]:
        """Run the body under the captured state: enabled types re-entered, disabled types disabled.

        ``cache_enabled`` overrides the captured weight-cast cache flag (False while a CUDA graph is
        recorded: a cached cast would be another graph's memory).
        """
        cache = self.cache_enabled if cache_enabled is None else cache_enabled
        with ExitStack() as stack:
            for device_type, enabled, dtype in self.settings:
                autocast = torch.autocast(device_type, dtype=dtype, enabled=enabled, cache_enabled=cache)
                stack.enter_context(autocast)
            yield
