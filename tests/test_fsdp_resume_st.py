"""Resuming a sentence-transformers ``SparseEncoder`` run under FSDP2 on 2 CPU ranks (gloo): the weights come back.

One launch of 2 ranks (``rank_launch.launch_ranks``; this file is also the ranks' script). The test writes a
tiny SparseEncoder (fill-mask Transformer + SpladePooling) as the run's start, and a copy with every weight
moved as its checkpoint. Each rank loads the start, swaps in the fused head as the trainer does, shards it as
the Trainer's FSDP2 does (each ``BertLayer`` a unit, then the root), and resumes through the trainer's own
``_load_from_checkpoint`` (FSDP on); rank 0 saves how far each gathered tensor is from the checkpoint's.
Before, that branch's plain ``load_state_dict`` of the full tensors into the shards raised a size mismatch.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from rank_launch import rank0_results, write_rank0_results

WORLD_SIZE = 2


def _sparse_encoder(folder: Path):
    """A SparseEncoder read from ``folder`` on the CPU (no hub)."""
    from sentence_transformers import SparseEncoder

    return SparseEncoder(str(folder), device="cpu", local_files_only=True)


def _sharded_start(folder: Path):
    """The run's start with the fused head, FSDP2-sharded as ``transformer_layer_cls_to_wrap: [BertLayer]``."""
    from torch.distributed.fsdp import fully_shard
    from transformers.models.bert.modeling_bert import BertLayer

    from gradcache_sparton.integrations.sentence_transformers import use_sparton_head

    model = _sparse_encoder(folder)
    use_sparton_head(model)
    for module in [m for m in model.modules() if isinstance(m, BertLayer)]:
        fully_shard(module)
    fully_shard(model)
    return model


def _worker(out_dir: Path) -> None:
    """Resume the sharded start from the checkpoint on this rank; rank 0 writes the distances."""
    from types import SimpleNamespace

    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.tensor import DTensor

    from gradcache_sparton.trainer import CachedSpladeTrainer

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    checkpoint = out_dir / "checkpoint"
    saved = _sparse_encoder(checkpoint).state_dict()
    model = _sharded_start(out_dir / "start")
    trainer = SimpleNamespace(  # what _load_from_checkpoint reads of the trainer under FSDP2
        accelerator=SimpleNamespace(unwrap_model=lambda m: m),
        _sparse_encoder=True,
        is_fsdp_enabled=True,
        model=model,
    )
    CachedSpladeTrainer._load_from_checkpoint(trainer, str(checkpoint))
    got = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    results = {
        "sharded": all(isinstance(p, DTensor) for p in model.parameters()),
        "vs_checkpoint": {k: float((got[k] - v).abs().max()) for k, v in saved.items()},
        "missing": sorted(set(saved) - set(got)),
    }
    write_rank0_results(out_dir, results)


@pytest.fixture(scope="module")
def resumed(tmp_path_factory) -> dict:
    """Rank 0's distances after resuming (one 2-rank launch for the module, bounded in time)."""
    from engine_helpers import save_small_masked_lm
    from sentence_transformers import SparseEncoder
    from sentence_transformers.base.modules import Transformer
    from sentence_transformers.sparse_encoder.modules import SpladePooling

    out_dir = tmp_path_factory.mktemp("fsdp_resume_st")
    backbone = save_small_masked_lm(out_dir / "backbone")
    transformer = Transformer(
        str(backbone),
        transformer_task="fill-mask",
        max_seq_length=32,
        model_kwargs={"local_files_only": True},
    )
    model = SparseEncoder(modules=[transformer, SpladePooling("max")], device="cpu")
    model.save_pretrained(str(out_dir / "start"))
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.rand_like(p))  # every weight far from the start's
    model.save_pretrained(str(out_dir / "checkpoint"))
    return rank0_results(__file__, out_dir, world_size=WORLD_SIZE, timeout_s=150)


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("sentence_transformers") is None, reason="needs the sentence-transformers extra"
)
def test_fsdp_resume_restores_a_sparse_encoders_weights(resumed: dict) -> None:
    """Resuming a SparseEncoder under FSDP2 copies every checkpoint tensor into the shards exactly (before: a
    plain load_state_dict of the full tensors into the DTensor shards, a size-mismatch RuntimeError)."""
    assert resumed["sharded"]
    assert not resumed["missing"]
    assert resumed["vs_checkpoint"] and all(d == 0.0 for d in resumed["vs_checkpoint"].values()), resumed


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))
