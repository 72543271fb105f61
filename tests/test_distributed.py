"""Data-parallel GradCache on 2 CPU ranks (gloo): gradients equal single-process training on the global batch.

One launch of 2 ranks (``rank_launch.launch_ranks``, bounded: a hang fails within 150 s) runs every
scenario of ``distributed_ranks.py``; the tests compare its saved results with single-process
references computed here.

Tolerance: fp32, rtol 1e-5 relative to each parameter's largest gradient (``assert_grads_close``).
The ranks' mini-batches are cut differently from the single process's (rows 0-4 and 5-9 in
mini-batches of 2 versus rows 0-9), so trailing-padding trimming and summation order differ, and
DDP sums the two ranks' partial gradients: fp32 rounding, measured <= 3e-7 relative. A missing
gather (local loss), a missing or doubled world-size factor or a lost mini-batch is an O(1) error.
"""

from __future__ import annotations

import distributed_ranks
import pytest
import torch
from distributed_ranks import (
    ACCUMULATION_SEEDS,
    GLOBAL_BATCH,
    MINI_BATCH,
    SPARSE_MINI_BATCH,
    SPARSE_ZERO_ROW,
    UNEVEN_ROWS,
    WORLD_SIZE,
    SequentialTrainer,
    global_batch,
    rank_rows,
    scored_loss,
    sparse_global_batch,
    sparse_rank_reps,
    sparse_start_encoder,
    splade_loss,
)
from engine_helpers import assert_grads_close, dropout_free_config, grads_of, make_encoder
from rank_launch import launch_ranks
from trainer_helpers import trainer_args, trainer_model, trainer_rows

from gradcache_sparton.engine import CachedLoss, GradCache
from gradcache_sparton.engine.distributed import data_parallel_world_size
from gradcache_sparton.primitives.sparse_reps import SparseReps

RTOL_FP32 = 1e-5  # see the module docstring
# Sparse against dense reps under the gather: the same fp32 terms, possibly summed in another order
# (scores over the non-zeros by index_add instead of over V, a blocked log-sum-exp): tests/test_sparse_reps.py
# measures <= 3.1e-7 relative on losses (here bitwise equal); 1e-6 leaves room, while a misplaced row of the
# gathered non-zeros or a doubled local gradient is an O(1e-2) error (checked by mutation). Gradients: RTOL_FP32.
RTOL_SPARSE_LOSS = 1e-6


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    """Each rank's results of every scenario (one 2-rank launch for the whole module)."""
    out_dir = tmp_path_factory.mktemp("ddp")
    launch_ranks(
        [distributed_ranks.__file__, str(out_dir)], world_size=WORLD_SIZE, log_dir=out_dir, timeout_s=150
    )
    return [torch.load(out_dir / f"rank{rank}.pt", weights_only=False) for rank in range(WORLD_SIZE)]


def _single_process_grads(*, seeds: tuple[int, ...], scale: float = 1.0) -> tuple[torch.Tensor, dict]:
    """The reference: one process, cached, on each whole global batch (losses scaled, grads accumulated)."""
    encoder = make_encoder(dropout_free_config(), seed=0)
    loss = None
    for seed in seeds:
        columns, targets = global_batch(seed=seed)
        loss = CachedLoss(encoder, scored_loss, mini_batch_size=MINI_BATCH)(columns, targets=targets)
        (loss * scale).backward()
    return loss.detach(), grads_of(encoder)


@pytest.mark.parametrize("rows", ["even", "uneven"], ids=["5+5_rows", "6+4_rows"])
def test_two_ranks_match_single_process_global_batch(ranks, rows: str) -> None:
    """A cached step on 2 DDP ranks (5+5 rows, or 6+4 with 3 vs 2 replays per column) gives the loss and
    every parameter gradient of a single-process cached step on the global batch of 10."""
    ref_loss, ref_grads = _single_process_grads(seeds=ACCUMULATION_SEEDS[:1])
    for rank in ranks:
        assert rank[rows]["world_size"] == WORLD_SIZE
        torch.testing.assert_close(rank[rows]["loss"], ref_loss, rtol=RTOL_FP32, atol=0)
        assert_grads_close(rank[rows]["grads"], ref_grads, rtol=RTOL_FP32)
    # DDP all-reduced the same buckets: the ranks' gradients are bitwise equal.
    for name, grad in ranks[0][rows]["grads"].items():
        assert torch.equal(grad, ranks[1][rows]["grads"][name]), name


def test_sparse_reps_gathered_across_ranks_match_dense_and_single_process(ranks) -> None:
    """On 2 DDP ranks (6+4 rows, mini-batches of 4: 4+2 and 4), GradCache.step and CachedLoss with
    sparse_reps=True gather every rank's non-zeros for SpladeLoss (InfoNCE in score blocks straddling the
    ranks, FLOPS) and give the loss, its components and every parameter gradient of the dense reps gathered,
    and of one process on the global batch of 10; the ranks hold different numbers of non-zeros and rank 1
    an all-zero row."""
    encoder = sparse_start_encoder()
    columns = sparse_global_batch()
    reference = GradCache(encoder, mini_batch_size=SPARSE_MINI_BATCH).step(columns, splade_loss())
    ref_grads = grads_of(encoder)
    # The premises: ~3% non-zero reps, different non-zero counts per rank, the all-zero row on rank 1.
    global_reps, _ = GradCache(encoder, mini_batch_size=SPARSE_MINI_BATCH, sparse_reps=True).encode(columns)
    per_row = {name: rep.nonzeros_per_row() for name, rep in global_reps.items()}
    entries = sum(rep.num_rows * rep.vocab_size for rep in global_reps.values())
    assert 0.01 < sum(int(n.sum()) for n in per_row.values()) / entries < 0.1
    assert int(per_row["positive"][SPARSE_ZERO_ROW]) == 0 and UNEVEN_ROWS[0] <= SPARSE_ZERO_ROW
    assert all(int(n[: UNEVEN_ROWS[0]].sum()) != int(n[UNEVEN_ROWS[0] :].sum()) for n in per_row.values())
    assert max(float(g.abs().max()) for g in ref_grads.values()) > 0
    for rank in ranks:
        dense = rank["sparse_reps"][False]
        assert set(rank["sparse_reps"][True]["layouts"].values()) == {SparseReps.__name__}
        assert set(dense["layouts"].values()) == {torch.Tensor.__name__}
        for sparse in (rank["sparse_reps"][True], rank["sparse_reps"]["cached_loss"]):
            for expected_loss, expected_parts, expected_grads in (
                (dense["loss"], dense["components"], dense["grads"]),
                (reference.loss, reference.components, ref_grads),
            ):
                torch.testing.assert_close(sparse["loss"], expected_loss, rtol=RTOL_SPARSE_LOSS, atol=0)
                for name, value in expected_parts.items():
                    torch.testing.assert_close(
                        sparse["components"][name], value, rtol=RTOL_SPARSE_LOSS, atol=0, msg=name
                    )
                assert_grads_close(sparse["grads"], expected_grads, rtol=RTOL_FP32)


def test_sparse_gather_concatenates_ranks_and_routes_gradients_to_local_weights(ranks) -> None:
    """Gathering SparseReps of 3 and 4 rows with different non-zero counts (each rank's last row empty) gives,
    on every rank, bitwise the rows of rank 0 then rank 1, and each rank's weights receive exactly the
    gradient of the gathered weights at their own entries (no world-size factor: that is Step (3)'s);
    a column without non-zeros on any rank gathers to 3 empty rows."""
    parts = [sparse_rank_reps(rank) for rank in range(WORLD_SIZE)]
    expected = SparseReps.concat(parts)
    nnz = [part.weights.numel() for part in parts]
    assert nnz[0] != nnz[1] and all(int(part.nonzeros_per_row()[-1]) == 0 for part in parts)
    for rank, result in enumerate(ranks):
        gathered = result["sparse_gather"]["reps"]
        for name in ("offsets", "token_ids", "weights"):
            assert torch.equal(getattr(gathered, name), getattr(expected, name)), name
        assert gathered.vocab_size == expected.vocab_size
        first = sum(nnz[:rank])
        assert torch.equal(
            result["sparse_gather"]["grad"], torch.arange(first + 1, first + nnz[rank] + 1).float()
        )
        empty = result["sparse_gather"]["empty"]
        assert empty.num_rows == 3 and empty.weights.numel() == 0 and not empty.offsets.any()


def test_sparse_reps_auto_takes_one_layout_on_every_rank(ranks) -> None:
    """sparse_reps="auto" under the gather takes the dense layout on every rank when rank 0 alone would
    keep its (all-zero) reps sparse and rank 1 alone its ~93% non-zero reps dense."""
    alone = [rank["auto_layouts"][False] for rank in ranks]
    assert set(alone[0].values()) == {SparseReps.__name__} and set(alone[1].values()) == {"Tensor"}
    for rank in ranks:
        assert set(rank["auto_layouts"][True].values()) == {"Tensor"}


def test_gradient_accumulation_under_ddp_matches_single_process(ranks) -> None:
    """Two accumulation micro-steps (the first under the Trainer's outer no_sync, each loss / 2) on 2 ranks
    give the gradients of the same two micro-steps on the global batches in one process."""
    _, ref_grads = _single_process_grads(seeds=ACCUMULATION_SEEDS, scale=0.5)
    for rank in ranks:
        assert_grads_close(rank["accumulation"]["grads"], ref_grads, rtol=RTOL_FP32)


def test_only_the_last_replayed_mini_batch_synchronises(ranks) -> None:
    """A cached step all-reduces the gradient buckets once (as one plain backward does), not once per
    replayed mini-batch (9 here); under accumulation once per optimizer step."""
    for rank in ranks:
        per_sync = rank["reductions_per_sync"]
        assert per_sync >= 1
        for scenario in ("even", "uneven", "accumulation"):
            assert rank[scenario]["reductions"] == per_sync, scenario


def test_rank_with_nothing_to_replay_still_synchronises(ranks) -> None:
    """When rank 1's loss uses no column, it runs one zero-gradient replay: no hang, and the averaged
    gradients are rank 0's contribution alone (2 · G backpropagated on rank 0, / 2 by DDP)."""
    encoder = make_encoder(dropout_free_config(), seed=0)
    columns, _ = global_batch(seed=ACCUMULATION_SEEDS[0])
    rows = rank_rows((GLOBAL_BATCH // 2, GLOBAL_BATCH // 2), 0)
    generator = torch.Generator().manual_seed(3)  # the worker's fixed rep gradients G
    total = 0
    for features in columns.values():
        rep = encoder(**{key: value[rows] for key, value in features.items()})  # [B_0, V]
        total = total + (rep * torch.randn(rep.shape, generator=generator)).sum()
    total.backward()
    ref_grads = grads_of(encoder)
    for rank in ranks:
        assert_grads_close(rank["zero_job"]["grads"], ref_grads, rtol=RTOL_FP32)


def test_non_finite_gradient_on_one_rank_stops_every_rank(ranks) -> None:
    """A NaN in rank 1's rep gradient raises FloatingPointError on both ranks before Step (3) (no hang)."""
    assert "gradient of column 'positive'" in ranks[1]["non_finite_error"]
    assert "another rank" in ranks[0]["non_finite_error"]


def test_ranks_with_different_columns_raise_the_same_clear_error(ranks) -> None:
    """Rank 0 passing 3 columns and rank 1 two, or a column dense on rank 0 and sparse on rank 1, raises the
    same ValueError naming both layouts on each rank."""
    errors = [rank["layout_error"] for rank in ranks]
    assert errors[0] is not None and errors[0] == errors[1]
    assert "rank 0: rep 'query'" in errors[0] and "rep 'negative'" in errors[0] and "rank 1:" in errors[0]
    errors = [rank["layout_mix_error"] for rank in ranks]
    assert errors[0] is not None and errors[0] == errors[1]
    assert "rank 0: rep 'query' [5] torch.float32; rank 1: rep 'query' sparse over 5" in errors[0]


@pytest.mark.parametrize("sparse_reps", ["false", "true"])
def test_trainer_on_two_ranks_matches_single_process_global_batch(
    ranks, tmp_path, tokenizer, sparse_reps
) -> None:
    """CachedSpladeTrainer on 2 gloo ranks, 8 rows per device, 2 accumulation steps, with dense reps and
    with ``sparse_reps`` (non-zeros gathered across the ranks): parameters after 2 SGD steps equal
    single-process training (dense) with 16 rows per device; the logs say 16 rows per loss."""
    model = trainer_model(tokenizer)
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    args = trainer_args(tmp_path / "single", per_device_batch=8 * WORLD_SIZE)
    trainer = SequentialTrainer(model, args, train_dataset=trainer_rows(), processing_class=tokenizer)
    trainer.train()
    logged = [log for log in trainer.state.log_history if "loss" in log]
    start_log = (
        "Effective batch: 8 per device x 2 process(es) = 16 rows per loss (reps gathered across processes) "
        f"(x 2 accumulation steps per optimizer step); mini_batch_size 3; sparse_reps {sparse_reps}."
    )
    for index, rank in enumerate(ranks):
        result = rank["trainer sparse_reps" if sparse_reps == "true" else "trainer"]
        assert result["world_size"] == WORLD_SIZE
        ranked = [log for log in result["logs"] if "loss" in log]
        assert [log["global_batch_size"] for log in ranked] == [16, 16]
        # Logged once, by the main process.
        assert result["start_log"] == ([start_log] if index == 0 else [])
        # The logged loss is the global batch's (the same on every rank), not W times it. Sparse reps sum
        # the regularizers over the 16 rows' non-zeros instead of 16 x V dense entries, in another order:
        # about sqrt(16 · 30,522) · 2**-24 = 4e-5 relative (measured 1.4e-5), far below a factor of W.
        rel = 1e-4 if sparse_reps == "true" else 1e-5
        assert [log["loss"] for log in ranked] == pytest.approx([log["loss"] for log in logged], rel=rel)
        for name, param in model.named_parameters():
            # fp32, SGD: parameters move by lr x gradient, so gradient errors show at their full size;
            # the differences are summation order (measured 7e-9) against moves of up to 4e-4.
            torch.testing.assert_close(result["params"][name], param.detach(), rtol=1e-5, atol=1e-7, msg=name)
    moved = max((p.detach() - initial[n]).abs().max().item() for n, p in model.named_parameters())
    assert moved > 1e-4, f"parameters moved by at most {moved}: the comparison would be vacuous"


def test_gather_across_ranks_needs_a_process_group() -> None:
    """gather_across_ranks=True without torch.distributed initialized, or a non-bool, is refused up front."""
    assert data_parallel_world_size(None) == 1 and data_parallel_world_size(False) == 1
    with pytest.raises(ValueError, match="gather_across_ranks=True needs an initialized"):
        GradCache(torch.nn.Identity(), mini_batch_size=2, gather_across_ranks=True)
    with pytest.raises(TypeError, match="gather_across_ranks must be a bool or None"):
        GradCache(torch.nn.Identity(), mini_batch_size=2, gather_across_ranks="yes")  # type: ignore[arg-type]


def test_replay_failing_midway_under_ddp_restores_bucket_view_grads(ranks) -> None:
    """Under DDP with gradient_as_bucket_view, a replay failing in the same non-final mini-batch on every
    rank restores the accumulated .grad bitwise in its bucket views (no hang), and the next step's
    gradients are bitwise those of a run without the failed step."""
    for rank in ranks:
        result = rank["failure"]
        assert result["error"] == "replay failed"
        assert result["restored_in_place"]
        assert result["bitwise_equal_after"]
