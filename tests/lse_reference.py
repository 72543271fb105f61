"""The fp64 reference of the fused sparse log-sum-exp (``losses/fused_lse.py``) and its error bound's scales, shared
by the interpreter tests (``test_fused_lse.py``) and the compiled ones (``test_fused_lse_gpu.py``).

Legend: B queries, N documents (the document columns' rows), V vocabulary."""

from __future__ import annotations

import torch

from gradcache_sparton.primitives.sparse_reps import SparseReps

__all__ = ["assert_grads_within_bound", "assert_lse_within_bound", "lse_reference", "sparse_leaves"]


def sparse_leaves(columns: list[torch.Tensor]) -> list[SparseReps]:
    """Each dense [B, V] column as sparse reps whose weights are leaves (their gradients are compared)."""
    reps = [SparseReps.from_dense(c) for c in columns]
    for r in reps:
        r.weights.requires_grad_(True)
    return reps


def lse_reference(
    columns: list[torch.Tensor], upstream: torch.Tensor, *, temperature: float
) -> dict[str, list[torch.Tensor]]:
    """fp64 lse [B] and the gradients of sum(upstream · lse) of the queries ``columns[0]`` against every row of
    the document columns ``columns[1:]``, and the same quantities from absolute values (the bound's scales)."""
    q, *docs = [c.double().requires_grad_(True) for c in columns]
    scores = torch.cat([q @ d.T for d in docs], dim=1) / temperature  # [B, N]
    lse = torch.logsumexp(scores, dim=1)
    (lse * upstream.double()).sum().backward()
    with torch.no_grad():
        p = torch.softmax(scores, dim=1) * upstream.double().abs()[:, None] / temperature  # [B, N] |dL/ds|
        abs_q = p @ torch.cat([d.detach() for d in docs])  # [B, V]
        abs_d = (p.T @ q.detach()).split([d.shape[0] for d in docs])  # per column [rows, V]
        lse_scale = scores.abs().amax(dim=1) + torch.log(torch.tensor(float(scores.shape[1])))
    return {
        "lse": [lse.detach(), lse_scale],
        "grads": [q.grad, *(d.grad for d in docs)],
        "scales": [abs_q, *abs_d],
    }


def assert_lse_within_bound(lse: torch.Tensor, want: dict[str, list[torch.Tensor]], tol: float) -> None:
    """``|lse - reference| <= tol · scale`` for every query (``want``: :func:`lse_reference`)."""
    reference, scale = want["lse"]
    assert ((lse.double() - reference).abs() <= tol * scale).all()


def assert_grads_within_bound(
    reps: list[SparseReps], want: dict[str, list[torch.Tensor]], tols: list[float]
) -> None:
    """Each column's weight gradients within ``tol · scale`` of the reference at its non-zeros (``want``:
    :func:`lse_reference`; ``tols``: one per column)."""
    for r, grad, scale, tol in zip(reps, want["grads"], want["scales"], tols, strict=True):
        at = (r.row_ids(), r.token_ids.long())
        assert ((r.weights.grad.double() - grad[at]).abs() <= tol * scale[at] + 1e-12).all()
