"""The CUDA caching allocator's expandable segments, turned on for ``max_memory``.

A budget is a cap on what the process reserves (what ``nvidia-smi``, other processes and a per-process
memory fraction see). With fixed-size segments the allocator's cache fragments: a step whose tensors fit
can still need a new segment while a held one has room, and run out of memory under a cap that its
allocated bytes are well within (measured on an H200: under an 8 GiB cap, a replayed mini-batch ran out
with 1.25 GiB reserved but unallocated). Expandable segments grow one mapping per stream instead, so that
what is reserved stays close to what is allocated: with them the planned 2, 4 and 8 GiB steps held as
process caps where the fixed segments failed at two (``tests/test_memory_cap.py``, 2026-11-28).

The setting is the process's: once on it stays on (segments already reserved keep their kind). A user's
own choice (``expandable_segments`` in ``PYTORCH_CUDA_ALLOC_CONF`` or ``PYTORCH_ALLOC_CONF``, on or off)
is kept.
"""

from __future__ import annotations

import logging
import os

import torch

__all__ = ["use_expandable_segments"]

logger = logging.getLogger("gradcache_sparton.engine.planner.memory_plan")  # beside the plan's own line

_SETTING = "expandable_segments"
_ENVIRONMENT = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
_turned_on = False


def use_expandable_segments() -> bool:
    """Turn the CUDA allocator's expandable segments on for this process (logged, once), unless the user's
    allocator configuration names them; True where they are on after the call by this function."""
    global _turned_on
    if _turned_on:
        return True
    if any(_SETTING in os.environ.get(name, "") for name in _ENVIRONMENT):
        return False  # the user's choice
    # The runtime form of the variable: torch's accelerator-wide setter, or (older torch) the CUDA one.
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None) or getattr(
        torch.cuda.memory, "_set_allocator_settings", None
    )
    if setter is None:
        return False
    setter(f"{_SETTING}:True")
    _turned_on = True
    logger.info(
        "max_memory: the CUDA allocator's expandable segments are on for this process (what it reserves stays "
        "close to what it allocates, so the budget holds as a cap); set PYTORCH_CUDA_ALLOC_CONF="
        "expandable_segments:False to keep fixed segments"
    )
    return True
