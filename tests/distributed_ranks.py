"""What the 2 ranks of tests/test_distributed.py run: its scenarios, their batches, and the worker.

``python tests/distributed_ranks.py OUT_DIR`` is one rank (launched by ``rank_launch.launch_ranks``):
it runs every scenario in turn on one gloo process group and saves what the tests compare into
``OUT_DIR/rank{r}.pt``; the single-process references are computed by the tests, from the same
batches and losses defined here.

Dropout is off throughout: each rank draws its own dropout masks (its own RNG stream, by design),
so only a dropout-free model can give the very numbers a single process gives on the global batch.

Legend: B batch (rows), W world size, V vocabulary.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path

import torch
from engine_helpers import (
    FailingEncoder,
    SpladeLikeEncoder,
    contrastive_flops_loss,
    dropout_free_config,
    grads_of,
    make_columns,
    make_encoder,
    pairwise_mse_loss,
)
from torch import Tensor
from torch.utils.data import SequentialSampler
from trainer_helpers import trainer_args, trainer_model, trainer_rows

from gradcache_sparton.engine import CachedLoss, GradCache
from gradcache_sparton.engine.distributed import gather_global_batch
from gradcache_sparton.losses import SpladeLoss, SpladeLossConfig
from gradcache_sparton.primitives.sparse_reps import SparseReps
from gradcache_sparton.trainer import CachedSpladeTrainer

__all__ = [
    "ACCUMULATION_SEEDS",
    "GLOBAL_BATCH",
    "MINI_BATCH",
    "SPARSE_MINI_BATCH",
    "SPARSE_ZERO_ROW",
    "UNEVEN_ROWS",
    "WORLD_SIZE",
    "SequentialTrainer",
    "global_batch",
    "rank_rows",
    "scored_loss",
    "sparse_global_batch",
    "sparse_rank_reps",
    "sparse_start_encoder",
    "splade_loss",
]

WORLD_SIZE = 2
GLOBAL_BATCH = 10  # 5 rows per rank
MINI_BATCH = 2  # 3 mini-batches per column and rank, the last one short
UNEVEN_ROWS = (6, 4)  # rank 0 replays 3 mini-batches per column, rank 1 two
ACCUMULATION_SEEDS = (1, 2)  # the global batches of the two accumulation micro-steps
SPARSE_MINI_BATCH = (
    4  # sparse reps on UNEVEN_ROWS: rank 0 encodes 4 + 2 rows, rank 1 4; one process 4 + 4 + 2
)
SPARSE_ZERO_ROW = 7  # global row of the fully masked positive (an all-zero rep), held by rank 1


def global_batch(seed: int) -> tuple[dict[str, dict[str, Tensor]], Tensor]:
    """Three random columns of GLOBAL_BATCH rows and one per-example target (a batch-first loss keyword)."""
    columns = make_columns(GLOBAL_BATCH, 3, seed=seed)
    targets = torch.randn(GLOBAL_BATCH, generator=torch.Generator().manual_seed(seed))
    return columns, targets


def rank_rows(rows_per_rank: tuple[int, ...], rank: int) -> slice:
    """The global rows rank ``rank`` holds when rank r holds ``rows_per_rank[r]`` consecutive rows."""
    start = sum(rows_per_rank[:rank])
    return slice(start, start + rows_per_rank[rank])


def scored_loss(reps: Mapping[str, Tensor], *, targets: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    """InfoNCE + FLOPS (batch-coupled) plus a per-example term that reads a batch-first loss keyword."""
    loss, components = contrastive_flops_loss(reps)
    return loss + pairwise_mse_loss(reps, targets=targets), components


def sparse_start_encoder() -> SpladeLikeEncoder:
    """The dropout-free encoder with its output bias lowered by 0.3: reps ~3% non-zero, as trained ones."""
    encoder = make_encoder(dropout_free_config(), seed=0)
    with torch.no_grad():
        encoder.mlm.cls.predictions.bias -= 0.3
    return encoder


def sparse_global_batch() -> dict[str, dict[str, Tensor]]:
    """The global batch of the sparse-reps scenario: three columns, positive row SPARSE_ZERO_ROW fully masked."""
    columns, _ = global_batch(seed=ACCUMULATION_SEEDS[0])
    columns["positive"]["attention_mask"][SPARSE_ZERO_ROW] = 0
    return columns


def sparse_rank_reps(rank: int) -> SparseReps:
    """Rank ``rank``'s reps for the sparse gather: 3 + rank rows over V = 11, ~40% non-zero, last row empty."""
    generator = torch.Generator().manual_seed(rank)
    dense = torch.rand(3 + rank, 11, generator=generator)  # [B_r, V]
    dense = dense.masked_fill(torch.rand(dense.shape, generator=generator) > 0.4, 0.0)
    dense[-1] = 0.0
    return SparseReps.from_dense(dense)


def splade_loss() -> SpladeLoss:
    """InfoNCE (in-batch + hard negatives) and FLOPS on both sides, the scores in blocks of 4 rows, so that
    a block straddles the ranks' rows (6 + 4)."""
    return SpladeLoss(SpladeLossConfig(query_reg_weight=0.3, doc_reg_weight=0.2, score_block_size=4))


def _select(columns: Mapping[str, Mapping[str, Tensor]], rows: slice) -> dict[str, dict[str, Tensor]]:
    return {name: {key: value[rows] for key, value in features.items()} for name, features in columns.items()}


class SequentialTrainer(CachedSpladeTrainer):
    """``CachedSpladeTrainer`` reading rows in order: accelerate deals batch i to rank i mod W, so the
    ranks' batches of a micro-step are, in rank order, the single-process batch of W times the rows."""

    def _get_train_sampler(self, *args, **kwargs):
        return SequentialSampler(self.train_dataset)


def _cached_step(ddp, columns, targets, rank_slice: slice) -> dict[str, object]:
    """One CachedLoss step on this rank's rows of the global batch through the DDP-wrapped encoder."""
    cached = CachedLoss(ddp, scored_loss, mini_batch_size=MINI_BATCH)
    loss = cached(_select(columns, rank_slice), targets=targets[rank_slice])
    loss.backward()
    return {"loss": loss.detach(), "world_size": cached.engine.world_size}


def _run_engine_scenarios(rank: int) -> dict[str, object]:
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel

    results: dict[str, object] = {}
    config = dropout_free_config()
    encoder = make_encoder(config, seed=0)
    ddp = DistributedDataParallel(encoder)
    bucket_reductions = []

    def counting_hook(state, bucket):
        bucket_reductions.append(1)
        return allreduce_hook(state, bucket)

    ddp.register_comm_hook(None, counting_hook)
    columns, targets = global_batch(seed=ACCUMULATION_SEEDS[0])
    even = tuple([GLOBAL_BATCH // WORLD_SIZE] * WORLD_SIZE)

    # The bucket all-reduces of one plain synchronised backward (DDP's buckets after the first step).
    for _ in range(2):
        del bucket_reductions[:]
        ddp(**_select(columns, rank_rows(even, rank))["query"]).sum().backward()
        ddp.zero_grad()
    results["reductions_per_sync"] = len(bucket_reductions)

    for name, rows in (("even", even), ("uneven", UNEVEN_ROWS)):
        del bucket_reductions[:]
        results[name] = _cached_step(ddp, columns, targets, rank_rows(rows, rank))
        results[name]["grads"] = grads_of(encoder)
        results[name]["reductions"] = len(bucket_reductions)
        ddp.zero_grad()

    # Gradient accumulation as the Trainer does it: the first micro-step wholly under no_sync.
    del bucket_reductions[:]
    for seed in ACCUMULATION_SEEDS:
        micro_columns, micro_targets = global_batch(seed=seed)
        cached = CachedLoss(ddp, scored_loss, mini_batch_size=MINI_BATCH)
        rows = rank_rows(even, rank)
        with ddp.no_sync() if seed != ACCUMULATION_SEEDS[-1] else torch.enable_grad():
            (cached(_select(micro_columns, rows), targets=micro_targets[rows]) / 2).backward()
    results["accumulation"] = {"grads": grads_of(encoder), "reductions": len(bucket_reductions)}
    ddp.zero_grad()

    # A rank whose loss uses no column still runs the synchronising backward (zero gradient).
    engine = GradCache(ddp, mini_batch_size=MINI_BATCH)
    local = _select(columns, rank_rows(even, rank))
    reps, replay_state = engine.encode(local)
    rep_grads = _zero_job_rep_grads(reps) if rank == 0 else dict.fromkeys(reps)
    engine.replay(replay_state, rep_grads)
    results["zero_job"] = {"grads": grads_of(encoder)}
    ddp.zero_grad()

    # A non-finite rep gradient on one rank stops every rank before Step (3).
    rep_grads = _zero_job_rep_grads(reps)
    if rank == 1:
        rep_grads["positive"][0, 0] = float("nan")
    try:
        engine.replay(replay_state, rep_grads)
        results["non_finite_error"] = None
    except FloatingPointError as error:
        results["non_finite_error"] = str(error)

    # Ranks disagreeing on the columns raise the same clear error on every rank, before any rep gather.
    names = ["query", "positive", "negative"] if rank == 0 else ["query", "positive"]
    try:
        CachedLoss(ddp, scored_loss, mini_batch_size=MINI_BATCH)(
            {name: local[name] for name in names}, targets=targets[rank_rows(even, rank)]
        )
        results["layout_error"] = None
    except ValueError as error:
        results["layout_error"] = str(error)
    # The sparse gather itself: each rank's weights get the gradient of the gathered weights at their entries
    # (the gathered weight at global entry j is weighted by j + 1). Then a column without non-zeros anywhere.
    local_sparse = sparse_rank_reps(rank)
    weights = local_sparse.weights.clone().requires_grad_()
    gathered, _ = gather_global_batch(
        {"query": SparseReps(local_sparse.offsets, local_sparse.token_ids, weights, local_sparse.vocab_size)},
        {},
    )
    entries = gathered["query"].weights
    (entries * torch.arange(1, entries.numel() + 1)).sum().backward()
    empty, _ = gather_global_batch({"query": SparseReps.from_dense(torch.zeros(rank + 1, 11))}, {})
    results["sparse_gather"] = {"reps": gathered["query"], "grad": weights.grad, "empty": empty["query"]}
    # A column dense on rank 0 and sparse on rank 1 cannot be concatenated: the same clear error on each rank.
    dense_column = torch.rand(3, 5)
    try:
        gather_global_batch({"query": dense_column if rank == 0 else SparseReps.from_dense(dense_column)}, {})
        results["layout_mix_error"] = None
    except ValueError as error:
        results["layout_mix_error"] = str(error)

    # Sparse reps gathered across ranks: GradCache.step with sparse_reps off and on, from the same ~3%
    # non-zero start, SpladeLoss, uneven rows in mini-batches of 4 that do not divide rank 0's 6.
    results["sparse_reps"] = {}
    sparse_columns = sparse_global_batch()
    rows = rank_rows(UNEVEN_ROWS, rank)
    for sparse in (False, True):
        sparse_encoder = sparse_start_encoder()
        engine = GradCache(
            DistributedDataParallel(sparse_encoder), mini_batch_size=SPARSE_MINI_BATCH, sparse_reps=sparse
        )
        reps, _ = engine.encode(_select(sparse_columns, rows))
        loss, components = engine.step(_select(sparse_columns, rows), splade_loss())
        results["sparse_reps"][sparse] = {
            "loss": loss,
            "components": components,
            "grads": grads_of(sparse_encoder),
            "layouts": {name: type(rep).__name__ for name, rep in reps.items()},
        }
    # The same through CachedLoss (what the Trainer runs): loss.backward() replays the gathered sparse reps.
    sparse_encoder = sparse_start_encoder()
    cached = CachedLoss(
        DistributedDataParallel(sparse_encoder),
        splade_loss(),
        mini_batch_size=SPARSE_MINI_BATCH,
        sparse_reps=True,
    )
    loss, components = cached(_select(sparse_columns, rows), return_components=True)
    loss.backward()
    results["sparse_reps"]["cached_loss"] = {
        "loss": loss.detach(),
        "components": components,
        "grads": grads_of(sparse_encoder),
    }
    # sparse_reps="auto" when only rank 0's first mini-batch is sparse (its queries fully masked, all-zero
    # reps) and rank 1's ~93% dense: every rank must take the dense layout, or the gather cannot agree.
    auto_columns = _select(columns, rank_rows(even, rank))
    if rank == 0:
        auto_columns["query"]["attention_mask"] = torch.zeros_like(auto_columns["query"]["attention_mask"])
    results["auto_layouts"] = {}
    for gather in (False, True):  # each rank alone, then agreeing
        engine = GradCache(ddp, mini_batch_size=MINI_BATCH, sparse_reps="auto", gather_across_ranks=gather)
        reps, _ = engine.encode(auto_columns)
        results["auto_layouts"][gather] = {name: type(rep).__name__ for name, rep in reps.items()}
    return results


def _run_failure_scenario(rank: int) -> dict[str, object]:
    """A replay failing midway under DDP with gradient_as_bucket_view (the same mini-batch on every rank,
    before the synchronising one), between two synchronised steps, against the same two steps alone."""
    from torch.nn.parallel import DistributedDataParallel

    rows = rank_rows(tuple([GLOBAL_BATCH // WORLD_SIZE] * WORLD_SIZE), rank)
    (first, first_targets), (second, second_targets) = (
        global_batch(seed=seed) for seed in ACCUMULATION_SEEDS
    )
    results: dict[str, object] = {}
    final_grads = []
    for fail in (False, True):
        encoder = make_encoder(dropout_free_config(), seed=0)
        failing = FailingEncoder(encoder, fail_on=0, error=RuntimeError("replay failed"))
        ddp = DistributedDataParallel(failing, gradient_as_bucket_view=True)
        _cached_step(ddp, first, first_targets, rows)  # .grad now holds bucket views
        if fail:
            before = {name: (p.grad.data_ptr(), p.grad.clone()) for name, p in encoder.named_parameters()}
            failing.replays, failing.fail_on = 0, 2
            try:
                _cached_step(ddp, second, second_targets, rows)
            except RuntimeError as error:
                results["error"] = str(error)
            failing.fail_on = 0
            results["restored_in_place"] = all(
                p.grad.data_ptr() == before[name][0] and torch.equal(p.grad, before[name][1])
                for name, p in encoder.named_parameters()
            )
        _cached_step(ddp, second, second_targets, rows)
        final_grads.append(grads_of(encoder))
    without, with_failure = final_grads
    results["bitwise_equal_after"] = all(torch.equal(without[name], with_failure[name]) for name in without)
    return results


def _zero_job_rep_grads(reps: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Fixed random rep gradients (the same on every rank) for rank 0's direct replay."""
    generator = torch.Generator().manual_seed(3)
    return {name: torch.randn(rep.shape, generator=generator) for name, rep in reps.items()}


def _run_trainer_scenario(out_dir: Path, **overrides: object) -> dict[str, object]:
    from transformers import AutoTokenizer

    from gradcache_sparton.resources import default_tokenizer_path

    tokenizer = AutoTokenizer.from_pretrained(default_tokenizer_path())
    model = trainer_model(tokenizer)
    args = trainer_args(out_dir, per_device_batch=8, ddp_backend="gloo", ddp_timeout=60, **overrides)
    trainer = SequentialTrainer(model, args, train_dataset=trainer_rows(), processing_class=tokenizer)
    messages: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: messages.append(record.getMessage())
    trainer_logger = logging.getLogger("gradcache_sparton.trainer")
    trainer_logger.addHandler(handler)
    trainer_logger.setLevel(logging.INFO)
    try:
        trainer.train()
    finally:
        trainer_logger.removeHandler(handler)
    return {
        "params": {name: p.detach().clone() for name, p in model.named_parameters()},
        "logs": trainer.state.log_history,
        "world_size": args.world_size,
        "start_log": [message for message in messages if message.startswith("Effective batch")],
    }


def _worker(out_dir: Path) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    results = _run_engine_scenarios(rank)
    results["failure"] = _run_failure_scenario(rank)
    # accelerate finds the process group initialized and uses it (gloo, MULTI_CPU).
    results["trainer"] = _run_trainer_scenario(out_dir / "trainer")
    results["trainer sparse_reps"] = _run_trainer_scenario(out_dir / "trainer_sparse", sparse_reps="true")
    torch.save(results, out_dir / f"rank{rank}.pt")


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))
