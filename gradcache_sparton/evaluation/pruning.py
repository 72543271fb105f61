"""Pruning sparse reps to a budget: the top-k weights per rep and a weight threshold.

Legend: N reps, V vocabulary, nnz non-zero entries.

A :class:`PruningBudget` names separate query and document budgets (``query_top_k``, ``doc_top_k``)
and a ``threshold``; :func:`prune_reps` applies one budget to one set of reps. The index size of a
pruned corpus is its number of postings (non-zero entries, 8 bytes each as id + weight).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from gradcache_sparton.primitives.sparse_reps import SparseReps

__all__ = ["PruningBudget", "prune_reps"]


def prune_reps(reps: SparseReps, *, top_k: int | None = None, threshold: float | None = None) -> SparseReps:
    """Keep, in each rep, the entries with weight > ``threshold`` and then its ``top_k`` largest weights.

    ``None`` leaves that rule out. Equal weights at the cut keep the lower vocabulary id. The kept
    entries keep their order (ids ascending within a row).
    """
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be a positive int or None, got {top_k!r}")
    if threshold is not None and not (isinstance(threshold, (int, float)) and math.isfinite(threshold)):
        raise ValueError(f"threshold must be a finite number or None, got {threshold!r}")
    counts = reps.nonzeros_per_row()  # [N]
    rows = torch.repeat_interleave(torch.arange(reps.num_rows, device=counts.device), counts)  # [nnz]
    keep = torch.ones_like(reps.weights, dtype=torch.bool)  # [nnz]
    if threshold is not None:
        keep &= reps.weights > threshold
    if top_k is not None:
        # Weight descending, then (stable) row ascending: each row's entries by weight, ties by id.
        candidates = torch.where(keep, reps.weights, torch.full_like(reps.weights, -math.inf))
        order = torch.sort(candidates, descending=True, stable=True).indices
        order = order[torch.sort(rows[order], stable=True).indices]  # [nnz]
        rank = torch.arange(order.numel(), device=order.device) - reps.offsets[:-1][rows[order]]
        in_top = torch.zeros_like(keep)
        in_top[order[rank < top_k]] = True
        keep &= in_top
    offsets = torch.zeros_like(reps.offsets)
    offsets[1:] = torch.cumsum(torch.bincount(rows[keep], minlength=reps.num_rows), 0)
    return SparseReps(offsets, reps.token_ids[keep], reps.weights[keep], reps.vocab_size)


@dataclass(frozen=True)
class PruningBudget:
    """Top-k budgets for query and document reps and a weight threshold for both; None: no limit.

    ``PruningBudget()`` is the unpruned run (named ``full``). :meth:`parse` reads the command-line
    form ``Q:D[:T]`` (``32:128``, ``all:64``, ``all:all:0.1``).
    """

    query_top_k: int | None = None
    doc_top_k: int | None = None
    threshold: float | None = None

    def __post_init__(self) -> None:
        for name in ("query_top_k", "doc_top_k"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive int or None, got {value!r}")
        if self.threshold is not None and not (
            isinstance(self.threshold, (int, float)) and math.isfinite(self.threshold)
        ):
            raise ValueError(f"threshold must be a finite number or None, got {self.threshold!r}")

    @property
    def name(self) -> str:
        """``full``, or e.g. ``q32-d128`` / ``qall-d64-t0.1``."""
        if self == PruningBudget():
            return "full"
        parts = [f"q{self.query_top_k or 'all'}", f"d{self.doc_top_k or 'all'}"]
        if self.threshold is not None:
            parts.append(f"t{self.threshold:g}")
        return "-".join(parts)

    @classmethod
    def parse(cls, text: str) -> PruningBudget:
        """``"full"`` or ``Q:D[:T]``: query top-k, document top-k (a positive int or ``all``) and an
        optional weight threshold."""
        if text == "full":
            return cls()
        fields = text.split(":")
        if len(fields) not in (2, 3):
            raise ValueError(f"budget {text!r} must be 'full' or Q:D[:T] (e.g. 32:128, all:64, 32:128:0.1)")
        try:
            query_top_k, doc_top_k = (None if f == "all" else int(f) for f in fields[:2])
            threshold = float(fields[2]) if len(fields) == 3 else None
        except ValueError:
            raise ValueError(f"budget {text!r}: Q and D must be positive ints or 'all', T a number") from None
        return cls(query_top_k, doc_top_k, threshold)

    def apply(self, q_reps: SparseReps, d_reps: SparseReps) -> tuple[SparseReps, SparseReps]:
        """The query and document reps pruned to this budget (the same objects when it is ``full``)."""
        if self == PruningBudget():
            return q_reps, d_reps
        return (
            prune_reps(q_reps, top_k=self.query_top_k, threshold=self.threshold),
            prune_reps(d_reps, top_k=self.doc_top_k, threshold=self.threshold),
        )
