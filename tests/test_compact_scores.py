"""The sparse blocked log-sum-exp over each query block's active columns (``losses/blocked.py``, "Active
columns"): forward and every gradient against a plain dense fp64 PyTorch reference, and which plan ran.

Legend: B queries, V vocabulary, U a query block's active columns.

Reference: ``logsumexp(cat([q @ d.T for d in docs], 1) / temperature, 1)`` on the densified reps in fp64,
its gradient read at each column's non-zeros. The blocked loss adds the same non-zero products in another
order, so fp64 agrees to ~1e-16 per term: RTOL_FP64 = 1e-12 of the largest value leaves 1e4 x room, while a
dropped column, block or non-zero is an O(1e-2) or larger error. fp32 weights: each score sums at most ~60
products of magnitude <= 1.1² and its rounding is ~n·2^-24 relative at worst (~4e-6), a softmax weight's
as much again: RTOL_FP32 = 1e-5 of the largest value.

Also run as the script of a 2-rank gloo launch (``rank_launch.launch_ranks``): compacted blocks sharded
across ranks.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from rank_launch import launch_ranks

from gradcache_sparton.losses import blocked as blocked_module
from gradcache_sparton.losses.sparse import sparse_blocked_logsumexp, sparse_score_plan
from gradcache_sparton.primitives.sparse_reps import SparseReps

RTOL_FP64 = 1e-12  # see the module docstring
RTOL_FP32 = 1e-5  # see the module docstring
VOCAB = 3000  # V / 2 = 1,500 columns: Zipf blocks compact, uniform blocks of 16 rows x 300 terms do not
TEMPERATURE = 0.7


def _reps(
    rows: int, nnz: int, *, zipf: bool, seed: int, empty: tuple[int, ...] = (), dtype=torch.float64
) -> SparseReps:
    """``rows`` reps of ``nnz`` distinct ids each (none for the rows in ``empty``), weights in [0.1, 1.1).

    ``zipf``: ids drawn with probability ∝ 1 / rank^1.1 (word frequencies: a few ids in most rows, as
    trained SPLADE reps on text); else uniform over V (random-init-like).
    """
    generator = torch.Generator().manual_seed(seed)
    rank = torch.arange(1, VOCAB + 1, dtype=torch.float64)
    probs = rank.pow(-1.1) if zipf else torch.ones(VOCAB, dtype=torch.float64)
    dense = torch.zeros(rows, VOCAB, dtype=dtype)
    for row in range(rows):
        if row in empty:
            continue
        ids = torch.multinomial(probs, nnz, replacement=False, generator=generator)
        dense[row, ids] = (torch.rand(nnz, generator=generator, dtype=torch.float64) + 0.1).to(dtype)
    return SparseReps.from_dense(dense, dtype=None)


def _dense_reference(
    q: SparseReps, docs: list[SparseReps], grad_lse: torch.Tensor
) -> tuple[torch.Tensor, list]:
    """lse [B] and the gradient of ``(grad_lse · lse).sum()`` at each column's non-zeros, all in fp64."""
    dense = [r.to_dense().double().requires_grad_(True) for r in (q, *docs)]
    scores = torch.cat([dense[0] @ d.T for d in dense[1:]], dim=1) / TEMPERATURE  # [B, (1+k)·B]
    lse = torch.logsumexp(scores, dim=1)
    (lse * grad_lse).sum().backward()
    return lse.detach(), [
        d.grad[r.row_ids(), r.token_ids.long()] for d, r in zip(dense, (q, *docs), strict=True)
    ]


def _blocked(q: SparseReps, docs: list[SparseReps], grad_lse: torch.Tensor, block_size: int) -> tuple:
    leaves = [r.weights.detach().clone().requires_grad_(True) for r in (q, *docs)]
    layouts = [
        SparseReps(r.offsets, r.token_ids, w, r.vocab_size) for r, w in zip((q, *docs), leaves, strict=True)
    ]
    lse = sparse_blocked_logsumexp(layouts[0], layouts[1:], temperature=TEMPERATURE, block_size=block_size)
    (lse * grad_lse).sum().backward()
    return lse.detach(), [leaf.grad for leaf in leaves]


def _assert_close(got: torch.Tensor, want: torch.Tensor, rtol: float) -> None:
    scale = want.abs().max().clamp_min(1e-30)
    assert float((got.double() - want).abs().max()) <= rtol * float(scale)


def _case(rows: int, *, zipf: bool, dtype=torch.float64, negatives: int = 1) -> tuple:
    """Queries (~20 terms; rows 3 and 4 empty), positives and ``negatives`` hard-negative columns (~40 terms;
    a positive and a negative row empty), and a random upstream gradient [B]."""
    q = _reps(rows, 20, zipf=zipf, seed=1, empty=(3, 4), dtype=dtype)
    if not zipf:
        q = _reps(rows, 300, zipf=False, seed=1, empty=(3, 4), dtype=dtype)
    docs = [_reps(rows, 40, zipf=zipf, seed=2 + c, empty=(c + 1,), dtype=dtype) for c in range(1 + negatives)]
    grad_lse = torch.randn(rows, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    return q, docs, grad_lse


@pytest.mark.parametrize("block_size", [1, 7, 16, 45, 64])
def test_compacted_blocks_match_the_dense_fp64_reference(block_size: int) -> None:
    """Skewed (Zipf) reps: every query block is compacted to its active columns, and lse and the gradients of
    the queries and of both document columns (positives, hard negatives) equal the dense fp64 computation;
    block sizes that divide B = 45 or not, empty query and document rows."""
    q, docs, grad_lse = _case(45, zipf=True)
    plan = sparse_score_plan(q, block_size=block_size)
    assert all(block.columns is not None and block.width < VOCAB / 2 for block in plan)
    assert [(b.start, b.stop) for b in plan] == [
        (i, min(i + block_size, 45)) for i in range(0, 45, block_size)
    ]
    want_lse, want_grads = _dense_reference(q, docs, grad_lse)
    got_lse, got_grads = _blocked(q, docs, grad_lse, block_size)
    _assert_close(got_lse, want_lse, RTOL_FP64)
    for got, want in zip(got_grads, want_grads, strict=True):
        _assert_close(got, want, RTOL_FP64)


def test_compacted_blocks_in_fp32_match_the_fp64_reference() -> None:
    """fp32 weights take the same compacted blocks and agree with the fp64 reference to fp32 rounding."""
    q, docs, grad_lse = _case(45, zipf=True, dtype=torch.float32, negatives=2)
    assert all(block.columns is not None for block in sparse_score_plan(q, block_size=8))
    want_lse, want_grads = _dense_reference(q, docs, grad_lse)
    got_lse, got_grads = _blocked(q, docs, grad_lse, 8)
    assert got_lse.dtype == torch.float32
    _assert_close(got_lse, want_lse, RTOL_FP32)
    for got, want in zip(got_grads, want_grads, strict=True):
        _assert_close(got, want, RTOL_FP32)


def test_uniform_reps_keep_the_whole_vocabulary_plan() -> None:
    """Random-init-like reps (300 uniform terms a row of V = 3,000): a block's active columns span most of V, so the plan is
    today's (blocks of block_size rows over all V), and the result still equals the reference."""
    q, docs, grad_lse = _case(45, zipf=False)
    plan = sparse_score_plan(q, block_size=16)
    assert [(b.start, b.stop, b.columns, b.width) for b in plan] == [
        (i, min(i + 16, 45), None, VOCAB) for i in range(0, 45, 16)
    ]
    want_lse, want_grads = _dense_reference(q, docs, grad_lse)
    got_lse, got_grads = _blocked(q, docs, grad_lse, 16)
    _assert_close(got_lse, want_lse, RTOL_FP64)
    for got, want in zip(got_grads, want_grads, strict=True):
        _assert_close(got, want, RTOL_FP64)


def test_query_blocks_are_capped_and_mixed_plans_stay_exact(monkeypatch) -> None:
    """Query blocks are min(block_size, COMPACT_QUERY_ROWS) rows while documents keep block_size; a block too
    wide to pay runs over all V inside a compacted plan, and the mix equals the reference."""
    monkeypatch.setattr(blocked_module, "COMPACT_QUERY_ROWS", 8)
    skewed = _reps(40, 20, zipf=True, seed=1)
    wide = _reps(8, 400, zipf=False, seed=5)  # one block of 8 rows over ~2,000 of 3,000 ids
    q = SparseReps.concat([skewed, wide])
    plan = sparse_score_plan(q, block_size=32)
    assert [(b.start, b.stop) for b in plan] == [(i, i + 8) for i in range(0, 48, 8)]
    assert [b.columns is None for b in plan] == [False] * 5 + [True]
    docs = [_reps(48, 40, zipf=True, seed=2), _reps(48, 40, zipf=True, seed=3)]
    grad_lse = torch.randn(48, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    want_lse, want_grads = _dense_reference(q, docs, grad_lse)
    got_lse, got_grads = _blocked(q, docs, grad_lse, 32)
    _assert_close(got_lse, want_lse, RTOL_FP64)
    for got, want in zip(got_grads, want_grads, strict=True):
        _assert_close(got, want, RTOL_FP64)


def test_plan_columns_are_the_blocks_sorted_active_ids_padded() -> None:
    """Each compacted block's U is exactly the sorted unique ids of its rows' non-zeros, and its width is
    |U| + 1 (the column that takes a document's entries outside U) padded to COMPACT_COLUMN_MULTIPLE; an
    all-empty block has U empty and one padded width."""
    q = _reps(20, 20, zipf=True, seed=4, empty=(16, 17, 18, 19))
    for block in sparse_score_plan(q, block_size=4):
        ids = q.to_dense(block.start, block.stop).ne(0).any(dim=0).nonzero()[:, 0]
        assert torch.equal(block.columns, ids)
        multiple = blocked_module.COMPACT_COLUMN_MULTIPLE
        assert block.width == -(-(ids.numel() + 1) // multiple) * multiple
    assert sparse_score_plan(q, block_size=4)[-1].columns.numel() == 0


def test_document_nonzeros_in_u_get_their_gradient_and_others_none() -> None:
    """A document's non-zeros at the query block's columns receive exactly softmax · q / temperature (a
    compaction that dropped a needed column would leave them 0); those outside U receive exactly 0."""
    dense_q = torch.zeros(2, VOCAB, dtype=torch.float64)
    dense_q[0, [5, 9]] = torch.tensor([0.5, 2.0], dtype=torch.float64)
    dense_q[1, 2999] = 1.5  # the last id: U = {5, 9, 2999}
    dense_d = torch.zeros(2, VOCAB, dtype=torch.float64)
    dense_d[0, [5, 7, 9, 11]] = torch.tensor([1.0, 3.0, 0.25, 4.0], dtype=torch.float64)
    dense_d[1, [6, 2999]] = torch.tensor([2.0, 0.5], dtype=torch.float64)
    q, d = SparseReps.from_dense(dense_q, dtype=None), SparseReps.from_dense(dense_d, dtype=None)
    assert [int(b.columns.numel()) for b in sparse_score_plan(q, block_size=2)] == [3]
    grad_lse = torch.ones(2, dtype=torch.float64)
    _, (_, grad_d) = _blocked(q, [d], grad_lse, 2)
    _, (_, want_d) = _dense_reference(q, [d], grad_lse)
    assert torch.allclose(grad_d, want_d, rtol=1e-15, atol=0)
    by_id = dict(zip(d.token_ids.tolist()[:4], grad_d[:4].tolist(), strict=True))
    assert by_id[7] == 0 and by_id[11] == 0 and by_id[5] > 0 and by_id[9] > 0
    assert grad_d[4] == 0 and grad_d[5] > 0  # row 1: id 6 outside U, id 2999 in U


def _sharded_worker(out_dir: Path) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    q, docs, grad_lse = _case(45, zipf=True)
    results = {}
    for shard in (False, True):
        leaves = [r.weights.detach().clone().requires_grad_(True) for r in (q, *docs)]
        layouts = [
            SparseReps(r.offsets, r.token_ids, w, VOCAB) for r, w in zip((q, *docs), leaves, strict=True)
        ]
        lse = sparse_blocked_logsumexp(
            layouts[0], layouts[1:], temperature=TEMPERATURE, block_size=7, shard_across_ranks=shard
        )
        (lse * grad_lse).sum().backward()
        results[str(shard)] = [lse.tolist(), *(leaf.grad.tolist() for leaf in leaves)]
    (out_dir / f"rank{dist.get_rank()}.json").write_text(json.dumps(results))


@pytest.mark.slow
def test_compacted_blocks_sharded_across_ranks_equal_unsharded(tmp_path) -> None:
    """Two gloo ranks, each scoring its contiguous half of the compacted query blocks, give every rank the
    unsharded lse and gradients (the document gradients summed across ranks: fp64 order only)."""
    launch_ranks([__file__, str(tmp_path)], world_size=2, log_dir=tmp_path, timeout_s=120)
    for rank in range(2):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for got, want in zip(result["True"], result["False"], strict=True):
            _assert_close(torch.tensor(got), torch.tensor(want), RTOL_FP64)


if __name__ == "__main__":
    _sharded_worker(Path(sys.argv[1]))
