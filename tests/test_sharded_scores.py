"""Scores sharded across ranks (``shard_scores_across_ranks``): each of 2 gloo ranks scores half the queries,
and the loss and every rep gradient equal the unsharded loss's on the same (gathered) reps.

One 2-rank launch (``rank_launch.launch_ranks``, bounded in time) runs every scenario (this file is also the ranks' script); the tests read what each rank
saved. fp64 reps, so the only difference is the order in which the ranks' partial document gradients are
summed: ~1e-16 relative per term, far below the 1e-12 tolerance; a missing all-reduce (a rank's lse or
gradients from its own queries only) is an O(1) error. The fused kernel (``score_kernel='fused'``, fp32 only)
runs on fp32 reps of FUSED_ROWS rows: 3 query tiles of 16 under the interpreter, 1 on rank 0 and 2 on rank 1
(whole blocks, and document windows as on the GPU); its lse rows and query gradients are each one rank's (bitwise
the unsharded ones), its document gradients two ranks' partial fp32 sums added in another order: a few 2^-24
relative of the largest, within FUSED_RTOL.
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch
from rank_launch import launch_ranks

from gradcache_sparton.losses import SpladeLoss, SpladeLossConfig, fused_lse
from gradcache_sparton.primitives.sparse_reps import SparseReps

WORLD_SIZE = 2
RTOL = 1e-12  # see the module docstring
FUSED_RTOL = 1e-6  # see the module docstring
SCENARIOS = {  # name: (loss settings, sparse reps)
    "infonce, dense": ({"contrastive": "infonce"}, False),
    "infonce, sparse": ({"contrastive": "infonce"}, True),
    "in-batch kl_div, dense": ({"contrastive": "kl_div", "kl_in_batch": True}, False),
    "in-batch kl_div, sparse": ({"contrastive": "kl_div", "kl_in_batch": True}, True),
    "infonce, sparse, fused": ({"contrastive": "infonce", "score_kernel": "fused"}, True),
    "in-batch kl_div, sparse, fused": (
        {"contrastive": "kl_div", "kl_in_batch": True, "score_kernel": "fused"},
        True,
    ),
    "infonce, sparse, fused, document windows": ({"contrastive": "infonce", "score_kernel": "fused"}, True),
}
# Scenarios run with fused_lse's settings changed: documents in windows of 16 (3 a block of 40), every kernel
# window-major (rank 1's 2 tiles x 3 windows map otherwise than rank 0's 1 x 3 or the unsharded 3 x 3), the dense
# gradients in two passes, the second reading the first's stored softmax weights (rows of the rank's own tiles),
# the hot columns' document gradient from them (hot_columns: the rank's own rows of their weights; the second
# column's block) and the query gradient from them (each rank's chunks of its own tiles), every score tile on the
# tensor cores (the interpreter's 16 x 16 tiles would all go by pairs).
FUSED_CHANGES = {
    "infonce, sparse, fused, document windows": {
        "INTERPRETER_TILES": fused_lse.INTERPRETER_TILES._replace(
            doc_window=16,
            window_major=fused_lse.WINDOW_MAJOR_KERNELS,
            dense_split=True,
            store_weights=True,
            hot_columns=16,
            query_grad_from_stored=True,
        ),
        "SPARSE_TILE_MAX": 0,
    }
}
ROWS, VOCAB, BLOCK = 10, 40, 3  # 4 query blocks (3 + 3 + 3 + 1), 2 per rank
FUSED_ROWS = 40  # query tiles of 16 rows under the interpreter: 16 + 16 + 8


def _reps(sparse: bool, seed: int = 0, fused: bool = False) -> dict[str, torch.Tensor | SparseReps]:
    """The same relu'd fp64 reps on every rank (queries, positives, one hard-negative column) for one seed
    (``fused``: FUSED_ROWS rows, fp32)."""
    generator = torch.Generator().manual_seed(seed)
    rows, dtype = (FUSED_ROWS, torch.float32) if fused else (ROWS, torch.float64)
    reps = {c: torch.randn(rows, VOCAB, generator=generator, dtype=dtype).relu() for c in "qpn"}
    return {c: SparseReps.from_dense(r, dtype=None) if sparse else r for c, r in reps.items()}


def _loss_and_grads(
    settings: dict, sparse: bool, shard: bool, seed: int = 0
) -> tuple[float, list[list[float]]]:
    fused = settings.get("score_kernel") == "fused"
    block = None if fused else BLOCK  # the fused kernel's tiles are its own
    config = SpladeLossConfig(score_block_size=block, shard_scores_across_ranks=shard, **settings)
    reps = _reps(sparse, seed, fused)
    leaves = [r.weights if sparse else r for r in reps.values()]
    for leaf in leaves:
        leaf.requires_grad_(True)
    kwargs = {}
    if settings["contrastive"] == "kl_div":
        rows = FUSED_ROWS if fused else ROWS
        kwargs["teacher_scores"] = torch.randn(rows, 2, generator=torch.Generator().manual_seed(1))
    loss, _ = SpladeLoss(config)(reps, **kwargs)
    loss.backward()
    return float(loss), [leaf.grad.reshape(-1).tolist() for leaf in leaves]


def _loss_with_empty_rows(extra: int, kernel: str) -> None:
    """The sharded infonce loss of the fused scenario's reps with ``extra`` empty rows appended to every column
    (the same weights, so the same sizes and sums) under ``kernel``."""
    reps = {}
    for c, r in _reps(True, fused=True).items():
        offsets = torch.cat([r.offsets, r.offsets[-1:].repeat(extra)])
        reps[c] = SparseReps(offsets, r.token_ids, r.weights, r.vocab_size)
    block = BLOCK if kernel == "blocked" else None
    config = SpladeLossConfig(score_block_size=block, shard_scores_across_ranks=True, score_kernel=kernel)
    SpladeLoss(config)(reps)


def _worker(out_dir: Path) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    results = {}
    for name, (settings, sparse) in SCENARIOS.items():
        changes = FUSED_CHANGES.get(name)
        with mock.patch.multiple(fused_lse, **changes) if changes else contextlib.nullcontext():
            want = _loss_and_grads(settings, sparse, shard=False)  # no collective: every rank alone
            got = _loss_and_grads(settings, sparse, shard=True)
        results[name] = {"want": want, "got": got}
    try:  # each rank its own reps: every rank must refuse
        _loss_and_grads(*SCENARIOS["infonce, sparse"], shard=True, seed=dist.get_rank())
        results["different reps"] = "no error"
    except ValueError as error:
        results["different reps"] = str(error)
    # Rank 1 one empty row more, so 'auto' could choose another path there: fused on rank 0, blocked on rank 1.
    try:
        _loss_with_empty_rows(dist.get_rank(), "fused" if dist.get_rank() == 0 else "blocked")
        results["different row counts"] = "no error"
    except ValueError as error:
        results["different row counts"] = str(error)
    (out_dir / f"rank{dist.get_rank()}.json").write_text(json.dumps(results))


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    """Each rank's results (one bounded 2-rank launch for the module)."""
    out_dir = tmp_path_factory.mktemp("sharded")
    launch_ranks([__file__, str(out_dir)], world_size=WORLD_SIZE, log_dir=out_dir, timeout_s=120)
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(WORLD_SIZE)]


@pytest.mark.slow
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_sharded_scores_equal_unsharded(ranks: list[dict], scenario: str) -> None:
    """Each rank scoring half the query blocks gives, on every rank, the unsharded loss and every rep gradient."""
    rtol = FUSED_RTOL if "fused" in scenario else RTOL
    for result in ranks:
        (want_loss, want_grads), (got_loss, got_grads) = result[scenario]["want"], result[scenario]["got"]
        assert got_loss == pytest.approx(want_loss, rel=rtol)
        for got, want in zip(got_grads, want_grads, strict=True):
            scale = max(abs(w) for w in want)
            assert max(abs(g - w) for g, w in zip(got, want, strict=True)) <= rtol * scale


@pytest.mark.slow
def test_sharded_scores_refuse_different_reps_on_every_rank(ranks: list[dict]) -> None:
    """Ranks passing different reps (no gather) get the same ValueError on every rank, not a wrong loss."""
    for result in ranks:
        assert "different reps" in result["different reps"]


@pytest.mark.slow
def test_sharded_scores_refuse_different_row_counts_whichever_path(ranks: list[dict]) -> None:
    """Ranks whose batches differ by empty rows only (same weights, sizes and sums), one in the fused path and one
    in the blocked one (as 'auto' picks by the row count), get the same ValueError on every rank, not a hang."""
    for result in ranks:
        assert "different reps" in result["different row counts"]


def test_sharding_without_a_process_group_is_the_unsharded_loss() -> None:
    """Outside torch.distributed (one process) the sharded setting computes every query block itself."""
    for settings, sparse in SCENARIOS.values():
        assert _loss_and_grads(settings, sparse, shard=True) == _loss_and_grads(settings, sparse, shard=False)


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))
