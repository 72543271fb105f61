"""GradCache under FSDP2 (``fully_shard``) on 2 CPU ranks (gloo): gradients equal one process on the global batch.

One launch of 2 ranks (``rank_launch.launch_ranks``, bounded in time) runs every scenario below (this file is also the ranks' script); the tests read
what each rank saved. Each scenario shards a tiny dropout-free BERT (each layer and the root as FSDP
units), takes its rank's rows of a global batch, runs one cached step and compares every parameter's
full gradient (``DTensor.full_tensor()``) with one unsharded process's cached step on the whole batch.

Tolerance: fp32, rtol 1e-5 relative to each parameter's largest gradient (``assert_grads_close``), as
tests/test_distributed.py: the ranks cut other mini-batches than the single process, and the reduce-
scatter sums two partial gradients, so only summation order differs (rounding, ~3e-7); a missing
gather, a wrong world-size factor or a lost mini-batch is an O(1) error.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from rank_launch import launch_ranks

WORLD_SIZE = 2
GLOBAL_ROWS, MINI_BATCH = 12, 3
SCENARIOS = {  # name: rows per rank, encoder, reuse_argmax
    "equal rows": ((6, 6), "plain", False),
    "unequal rows": ((9, 3), "plain", False),  # 3 mini-batches per column against 1: padded replays
    "unequal rows, Sparton head, reuse_argmax": ((8, 4), "sparton", True),
    "activation checkpointing": ((9, 3), "checkpointed", False),
    "LoRA adapters": ((9, 3), "lora", False),  # frozen base weights beside trainable adapters in each unit
}
RTOL_FP32 = 1e-5  # see the module docstring


def _encoder(kind: str) -> torch.nn.Module:
    from engine_helpers import dropout_free_config, make_encoder

    from gradcache_sparton import SpladeEncoder

    if kind == "plain":
        return make_encoder(dropout_free_config())
    if kind == "checkpointed":
        encoder = make_encoder(dropout_free_config())
        encoder.mlm.gradient_checkpointing_enable({"use_reentrant": False})
        return encoder.train()
    if kind == "lora":
        import peft

        encoder = make_encoder(dropout_free_config())
        torch.manual_seed(
            1
        )  # LoRA's B matrices start at zero: give them values, so every path carries a gradient
        config = peft.LoraConfig(
            r=4, lora_alpha=8, target_modules=["query", "value"], init_lora_weights=False
        )
        encoder.mlm = peft.get_peft_model(encoder.mlm, config)
        return encoder
    torch.manual_seed(0)
    return SpladeEncoder.from_config(dropout_free_config()).train()


def _layers(encoder: torch.nn.Module) -> list[torch.nn.Module]:
    """The BERT layers, each an FSDP unit (found by type: peft nests the model under other names)."""
    from transformers.models.bert.modeling_bert import BertLayer

    return [module for module in encoder.modules() if isinstance(module, BertLayer)]


def _units_with_trainable_parameters(encoder: torch.nn.Module, layers: list[torch.nn.Module]) -> int:
    """How many FSDP units (each layer, and the root for every parameter outside them) have a parameter
    to train: those reduce gradients (LoRA leaves the root's embeddings frozen)."""
    inside = {id(p) for layer in layers for p in layer.parameters()}
    root = any(p.requires_grad and id(p) not in inside for p in encoder.parameters())
    return sum(any(p.requires_grad for p in layer.parameters()) for layer in layers) + root


def _count_reduce_scatters() -> dict[str, int]:
    """Wrap the collectives FSDP2 reduces gradients with (which one depends on the torch version)."""
    import torch.distributed as dist

    counts = {"calls": 0}
    for name in ("reduce_scatter_single", "reduce_scatter_tensor"):
        original = getattr(dist, name, None)
        if original is None:
            continue

        def counting(*args, _original=original, **kwargs):
            counts["calls"] += 1
            return _original(*args, **kwargs)

        setattr(dist, name, counting)
    return counts


def _worker(out_dir: Path) -> None:
    """Every scenario on this rank; rank 0 writes the comparisons."""
    import torch.distributed as dist
    from engine_helpers import contrastive_flops_loss, grads_of, make_columns
    from torch.distributed.fsdp import fully_shard

    from gradcache_sparton.engine import CachedLoss

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    counts = _count_reduce_scatters()
    results = {}
    for name, (rows, kind, reuse_argmax) in SCENARIOS.items():
        columns = make_columns(GLOBAL_ROWS, 2, seed=1)
        reference = _encoder(kind)
        CachedLoss(reference, contrastive_flops_loss, mini_batch_size=MINI_BATCH, gather_across_ranks=False)(
            columns
        ).backward()
        expected = grads_of(reference)
        encoder = _encoder(kind)
        units = _layers(encoder)
        reducing_units = _units_with_trainable_parameters(encoder, units)
        for layer in units:
            fully_shard(layer)
        fully_shard(encoder)
        start = sum(rows[:rank])
        local = {c: {k: v[start : start + rows[rank]] for k, v in f.items()} for c, f in columns.items()}
        cached = CachedLoss(
            encoder, contrastive_flops_loss, mini_batch_size=MINI_BATCH, reuse_argmax=reuse_argmax
        )
        before = counts["calls"]
        cached(local).backward()
        reduce_scatters = counts["calls"] - before
        actual = {}
        for param_name, p in encoder.named_parameters():  # every rank joins each all-gather
            actual[param_name] = p.grad.full_tensor() if p.grad is not None else torch.zeros(p.shape)
        results[name] = {
            "grads": {k: v.tolist() for k, v in actual.items()},
            "expected": {k: v.tolist() for k, v in expected.items()},
            "reduce_scatters": reduce_scatters,
            "reducing_units": reducing_units,
        }
    (out_dir / f"rank{rank}.json").write_text(json.dumps(results))


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    """Each rank's results of every scenario (one 2-rank launch for the module, bounded in time)."""
    out_dir = tmp_path_factory.mktemp("fsdp")
    launch_ranks([__file__, str(out_dir)], world_size=WORLD_SIZE, log_dir=out_dir, timeout_s=150)
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(WORLD_SIZE)]


@pytest.mark.slow
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_fsdp_ranks_match_one_process_on_the_global_batch(ranks: list[dict], scenario: str) -> None:
    """Under FSDP2, equal or unequal rows per rank (padded with zero-gradient replays), with the fused head
    and reuse_argmax, activation checkpointing or LoRA adapters: every parameter's gradient equals one
    process's on the global batch, on every rank."""
    from engine_helpers import assert_grads_close

    for result in ranks:
        got = {k: torch.tensor(v) for k, v in result[scenario]["grads"].items()}
        want = {k: torch.tensor(v) for k, v in result[scenario]["expected"].items()}
        assert_grads_close(got, want, rtol=RTOL_FP32)


@pytest.mark.slow
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_fsdp_reduces_gradients_once_per_step(ranks: list[dict], scenario: str) -> None:
    """Only the last replayed mini-batch reduce-scatters: one reduction per FSDP unit with trainable
    parameters and step, on every rank, however many mini-batches it replays."""
    for result in ranks:
        assert result[scenario]["reduce_scatters"] == result[scenario]["reducing_units"]


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))
