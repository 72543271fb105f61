"""``keep_graphs``: the mini-batches whose Step (1) graph Step (3) backprops instead of re-encoding them.

A kept mini-batch runs Step (1) with a graph (the encoder's own forward) and Step (3) backprops that graph:
its rows cost one forward, not two, for the memory of their activations from Step (1) to Step (3). A column's
kept mini-batches are its last ones, and Step (1) runs them after every other mini-batch of the step, so no
other forward runs beside the graphs held; Step (3) backprops them first, freeing that memory before the
replays. Which and how many: ``StepSettings.keep_graphs`` (every one, none, or a ``max_memory`` plan's count
per column, :func:`~gradcache_sparton.engine.planner.memory_plan.choose_kept_graphs`).

Legend: mb rows of a mini-batch, V rep width.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
from torch import Tensor

from gradcache_sparton.engine.checks import check_replayed_rep
from gradcache_sparton.engine.settings import StepSettings
from gradcache_sparton.engine.types import MiniBatch
from gradcache_sparton.primitives.column_routing import trains_column

__all__ = ["backprop_kept", "encode_order", "kept_counts"]


def kept_counts(
    settings: StepSettings, plans: Mapping[str, Sequence[object]], encoder: Callable[..., Tensor]
) -> dict[str, int]:
    """How many of each column's last mini-batches (``plans``: the column's mini-batches) keep their graph:
    none with autograd off (an evaluation), nor for a column that trains nothing (a frozen query table)."""
    return {
        column: settings.kept_mini_batches(column, len(plan))
        if torch.is_grad_enabled() and trains_column(encoder, column)
        else 0
        for column, plan in plans.items()
    }


def encode_order(plans: Mapping[str, Sequence[object]], kept: Mapping[str, int]) -> list[tuple[str, int]]:
    """Step (1)'s order, (column, mini-batch index): every mini-batch that is replayed, then the kept ones
    (each column's in its order)."""
    replayed = [(c, k) for c, plan in plans.items() for k in range(len(plan) - kept[c])]
    return replayed + [(c, k) for c, plan in plans.items() for k in range(len(plan) - kept[c], len(plan))]


def backprop_kept(column: str, mb: MiniBatch, grad: Tensor | None) -> None:
    """Step (3) for a mini-batch that kept its graph: backprop ``grad`` [mb, V] (None: a zero gradient)
    through it into the parameters' ``.grad``; the graph is freed."""
    assert mb.graph is not None
    grad = torch.zeros_like(mb.graph) if grad is None else grad
    check_replayed_rep(mb.graph, grad, column, mb.rows)
    mb.graph.backward(grad)
