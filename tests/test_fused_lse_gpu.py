"""The fused sparse log-sum-exp compiled on a GPU, at the GPU's own tiles (``fused_lse.GPU_TILES``) and the real
vocabulary: lse and every gradient against a dense fp64 computation, the fused SpladeLoss against the blocked one,
the rule by which ``score_kernel='auto'`` takes the kernels, and document blocks that never wait for the device.
The CPU tests (``test_fused_lse.py``) run the same kernels through the interpreter at interpreter tiles; these
check what 'auto' runs where it runs.

Legend: B queries, N = 2B documents (positives, one hard-negative column), V vocabulary.

Shapes: B = 601 (query tiles of 64: 9 full and one of 25), V = 30,522, ~48 non-zeros a query and ~190 a
document (trained SPLADE's sparsity), an all-zero query, duplicate documents. Tolerance (the bound of
docs/losses.md, "The fused kernel"): ``|got - want| <= TOL · scale``, ``scale`` the same quantity from absolute
values in fp64; fp32 sums of n terms err by at most n · 2^-24 of that, and the largest n here (a gradient: N =
1,202 documents, plus a score's <= 256 products, the exp and the split) is < 1,600: TOL = 1,600 · 2^-24 ≈ 9.5e-5,
plus 2^-16 for the backward's 2 bf16 parts of each softmax weight (bf16 tiles). A lost tile, document block or
split part (one bf16 part alone: 2^-9 relative) is far outside it.
"""

from __future__ import annotations

import pytest
import torch
from lse_reference import (
    assert_grads_within_bound,
    assert_lse_within_bound,
    lse_reference,
    sparse_leaves,
)

from gradcache_sparton.losses import SpladeLoss, SpladeLossConfig, fused_lse
from gradcache_sparton.losses.doc_blocks import DocBlocks
from gradcache_sparton.losses.fused_lse import fused_sparse_logsumexp, use_fused_kernel
from gradcache_sparton.primitives.sparse_reps import SparseReps

pytestmark = [pytest.mark.gpu, pytest.mark.kernel]

B, V, TEMPERATURE = 601, 30522, 0.05
TOL = 1600 * 2.0**-24  # see the module docstring
SPLIT = 2.0**-16  # 2 bf16 parts of an fp32 softmax weight: within 2^-16 of it


def _batch(kind: str, seed: int = 0, common: int = V) -> list[torch.Tensor]:
    """Queries, positives, negatives [B, V] on the GPU, >= 0, sparse as trained reps, with the awkward rows; with
    ``common`` < V, a quarter of each row's ids drawn from the first ``common`` (words most rows hold)."""
    generator = torch.Generator(device="cuda").manual_seed(seed)

    def column(nnz: int) -> torch.Tensor:
        ids = torch.randint(0, V, (B, nnz), generator=generator, device="cuda")
        ids[:, : nnz // 4] %= common
        values = torch.rand(B, nnz, generator=generator, device="cuda") * 2.5
        dense = torch.zeros(B, V, device="cuda").scatter_(1, ids, values)
        if kind == "bf16":
            return dense.to(torch.bfloat16).float()
        return dense + (dense != 0) * 1e-3 * torch.rand(B, V, generator=generator, device="cuda")

    q, pos, neg = column(48), column(190), column(190)
    q[3] = 0  # an empty query: lse = log N
    pos[9] = pos[10] = neg[20]  # one document three times
    return [q, pos, neg]


@pytest.mark.parametrize("variant", list(fused_lse.VARIANTS))
@pytest.mark.parametrize("kind", ["bf16", "fp32"])
def test_compiled_fused_lse_and_grads_match_fp64(monkeypatch, kind: str, variant: str) -> None:
    """On the GPU, under every named setting (GPU_TILES is one; a windowed one runs programs side by side that add
    into the same query gradient rows: atomics a sequential interpreter cannot check): lse [B] and the gradients of
    queries, positives and negatives equal dense fp64 within the bound (bf16 values: bf16 tiles and the split;
    other fp32 values: ieee fp32 tiles)."""
    monkeypatch.setattr(fused_lse, "GPU_TILES", fused_lse.VARIANTS[variant])
    columns = _batch(kind)
    upstream = torch.randn(B, generator=torch.Generator(device="cuda").manual_seed(1), device="cuda")
    reps = sparse_leaves(columns)
    lse = fused_sparse_logsumexp(reps[0], reps[1:], temperature=TEMPERATURE)
    (lse * upstream).sum().backward()
    want = lse_reference(columns, upstream, temperature=TEMPERATURE)
    assert_lse_within_bound(lse, want, TOL)
    assert_grads_within_bound(reps, want, [TOL + (SPLIT if kind == "bf16" else 0.0)] * 3)


@pytest.mark.parametrize(
    "variant",
    [
        "window256_stored_hot1024",
        "window256_stored_hot1024_query",
        "window256_stored_hot1024_query_split_store256",
        "window256_stored_hot2048at25_query_split_store256",
    ],
)
@pytest.mark.parametrize("kind", ["bf16", "fp32"])
def test_compiled_hot_columns_match_fp64(monkeypatch, kind: str, variant: str) -> None:
    """On the GPU under a setting with hot columns: reps with 64 common words (every query tile holds them) at
    temperature 1.0 (every score tile dense: the blocks after the first leave the routes): the later blocks take the
    hot columns' document gradient from the stored weights (``_hot_kernel``, its GPU tiles), and with
    ``query_grad_from_stored`` the query gradient too (``_query_grad_kernel``; with ``store_split`` and ``bn_store``
    the weights stored as bf16 parts by a pass 256 documents wide); lse and every gradient equal dense fp64 within
    the bound."""
    from gradcache_sparton.losses import fused_lse_triton

    monkeypatch.setattr(fused_lse, "GPU_TILES", fused_lse.VARIANTS[variant])
    launch, launches = fused_lse_triton.launch_backward, []

    def recorded(*args, **kwargs):
        launches.append((kwargs["hot"], kwargs["query_chunks"]))
        launch(*args, **kwargs)

    monkeypatch.setattr(fused_lse_triton, "launch_backward", recorded)
    columns = _batch(kind, seed=3, common=64)
    upstream = torch.randn(B, generator=torch.Generator(device="cuda").manual_seed(4), device="cuda")
    reps = sparse_leaves(columns)
    lse = fused_sparse_logsumexp(reps[0], reps[1:], temperature=1.0)
    (lse * upstream).sum().backward()
    hot, chunks = zip(*launches, strict=True)
    assert hot[0] is None and all(h is not None for h in hot[1:]), hot
    from_stored = fused_lse.GPU_TILES.query_grad_from_stored
    assert chunks[0] is None and all((c is not None) == from_stored for c in chunks[1:]), chunks
    assert int((hot[1].ids < V).sum()) >= 64, hot[1].ids  # the common words at least
    want = lse_reference(columns, upstream, temperature=1.0)
    assert_lse_within_bound(lse, want, TOL)
    assert_grads_within_bound(reps, want, [TOL + (SPLIT if kind == "bf16" else 0.0)] * 3)


def test_compiled_fused_loss_matches_blocked() -> None:
    """SpladeLoss (InfoNCE) with score_kernel='fused' gives the blocked path's loss and every gradient on the GPU
    (bf16-valued reps, as bf16 autocast makes them), within the bound."""
    columns = _batch("bf16", seed=2)
    results = {}
    for kernel in ("fused", "blocked"):
        reps = dict(zip("qpn", sparse_leaves(columns), strict=True))
        loss, _ = SpladeLoss(SpladeLossConfig(score_kernel=kernel, temperature=TEMPERATURE))(reps)
        loss.backward()
        results[kernel] = (loss, [r.weights.grad for r in reps.values()])
    (fused, fused_grads), (blocked, blocked_grads) = results["fused"], results["blocked"]
    # Both are within the bound of the fp64 value, so their difference within twice it (as test_fused_lse.py).
    assert fused.item() == pytest.approx(blocked.item(), rel=2 * TOL)
    for got, want in zip(fused_grads, blocked_grads, strict=True):
        assert (got - want).abs().max() <= (2 * TOL + SPLIT) * want.abs().max()


def test_auto_takes_the_kernels_from_fused_min_queries_on() -> None:
    """score_kernel='auto' on the GPU: the fused kernels from FUSED_MIN_QUERIES queries on (fp32 weights), the
    blocked path below it and for fp64 weights."""
    threshold = fused_lse.FUSED_MIN_QUERIES
    assert isinstance(threshold, int) and threshold > 1

    def reps(rows: int, dtype: torch.dtype = torch.float32) -> SparseReps:
        offsets = torch.arange(rows + 1, device="cuda")  # one entry a row
        return SparseReps(
            offsets,
            torch.zeros(rows, dtype=torch.int32, device="cuda"),
            torch.ones(rows, dtype=dtype, device="cuda"),
            V,
        )

    assert use_fused_kernel(reps(threshold), [reps(threshold)], "auto")
    assert not use_fused_kernel(reps(threshold - 1), [reps(threshold - 1)], "auto")
    assert not use_fused_kernel(reps(threshold, torch.float64), [reps(threshold, torch.float64)], "auto")


def test_document_blocks_never_wait_for_the_device() -> None:
    """DocBlocks writes, clears and gathers each block's entries without a host-device sync: one a block stalled the
    kernels' launches (a Python 0.0 written at tensor indices). torch's sync debug mode raises on any."""
    reps = SparseReps.from_dense(_batch("bf16")[1])
    blocks = DocBlocks(reps, 256)  # reads the offsets back once, before the blocks
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        grads = [
            block.grad_dt[block.entries] for block in blocks.blocks(reps.weights, torch.bfloat16, grads=True)
        ]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert len(grads) == -(-B // 256) and sum(g.numel() for g in grads) == reps.weights.numel()
