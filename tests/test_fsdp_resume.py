"""Resuming an inference-free run under FSDP2 on 2 CPU ranks (gloo): the trained query table comes back.

One launch of 2 ranks (``rank_launch.launch_ranks``; this file is also the ranks' script). For a learned
``QueryTable`` and a ``LiLsrTable``, each rank shards a tiny inference-free model as the Trainer's FSDP2
does (each ``BertLayer`` a unit, the root for the rest: the table's parameters are ``DTensor`` shards of
the root's unit), takes one cached step and an SGD update, and rank 0 writes a checkpoint from the gathered
full state dict (the trainer's ``save_model`` under FSDP). A fresh sharded model from the same start then
loads the checkpoint with ``load_checkpoint_weights(sharded=True)``, what ``_load_from_checkpoint`` runs
under FSDP; rank 0 saves how far each tensor is from the saved one. The copy is exact (0), and the step
moved the table far from its start (a resume that left the table as it started fails).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from rank_launch import rank0_results, write_rank0_results

WORLD_SIZE = 2
GLOBAL_ROWS, MINI_BATCH = 8, 2
LEARNING_RATE = 1.0  # SGD: moves the table's entries by about the gradient, far from their start
TABLES = ("learned_idf", "li_lsr")


def _model(table: str) -> torch.nn.Module:
    """The same seeded start on every rank: a tiny dropout-free encoder and a trainable table."""
    from engine_helpers import dropout_free_config
    from transformers import BertForMaskedLM

    from gradcache_sparton.modeling import InferenceFreeEncoder, LiLsrTable, QueryTable, SpladeEncoder

    torch.manual_seed(0)
    encoder = SpladeEncoder(BertForMaskedLM(dropout_free_config()))
    embedding = encoder.model.get_input_embeddings().weight  # [V, D]
    if table == "learned_idf":
        query_table = QueryTable(torch.rand(embedding.shape[0]) + 0.5, special_token_ids=[0], frozen=False)
    else:
        query_table = LiLsrTable(embedding, torch.rand(embedding.shape[1]), 1.0, special_token_ids=[0])
    return InferenceFreeEncoder.from_document_encoder(encoder, query_table)


def _shard(model: torch.nn.Module) -> torch.nn.Module:
    """FSDP2 as the Trainer's ``transformer_layer_cls_to_wrap: [BertLayer]``: each layer, then the root."""
    from torch.distributed.fsdp import fully_shard
    from transformers.models.bert.modeling_bert import BertLayer

    for module in [m for m in model.modules() if isinstance(m, BertLayer)]:
        fully_shard(module)
    fully_shard(model)
    return model


def _full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor of the sharded ``model`` whole (every rank takes part)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))


def _worker(out_dir: Path) -> None:
    """Train, save, resume and compare each table kind on this rank; rank 0 writes the distances."""
    import torch.distributed as dist
    from engine_helpers import make_columns
    from torch.distributed.tensor import DTensor

    from gradcache_sparton.engine import CachedLoss
    from gradcache_sparton.losses import SpladeLoss, SpladeLossConfig
    from gradcache_sparton.modeling import load_checkpoint_weights, load_query_table

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    rows = slice(rank * GLOBAL_ROWS // WORLD_SIZE, (rank + 1) * GLOBAL_ROWS // WORLD_SIZE)
    columns = {c: {k: v[rows] for k, v in f.items()} for c, f in make_columns(GLOBAL_ROWS, 2, seed=1).items()}
    loss = SpladeLoss(SpladeLossConfig(query_reg_weight=0.0, doc_reg_weight=0.1))
    results = {}
    for table in TABLES:
        model = _shard(_model(table))
        start = _full_state(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
        CachedLoss(model, loss, mini_batch_size=MINI_BATCH)(columns).backward()
        optimizer.step()
        trained = _full_state(model)
        checkpoint = out_dir / table
        if rank == 0:
            model.save_pretrained(checkpoint, state_dict=trained)
        dist.barrier()
        resumed = _shard(_model(table))
        load_checkpoint_weights(resumed, checkpoint, sharded=True)
        got = _full_state(resumed)
        saved_table = load_query_table(checkpoint).state_dict()
        results[table] = {
            "table_sharded": all(isinstance(p, DTensor) for p in resumed.query_table.parameters()),
            "table_moved": max(
                float((trained[k] - start[k]).abs().max()) for k in trained if "query_table" in k
            ),
            "table_vs_file": {
                k: float((got[f"query_table.{k}"] - v).abs().max()) for k, v in saved_table.items()
            },
            "vs_trained": {k: float((got[k] - v).abs().max()) for k, v in trained.items()},
        }
    write_rank0_results(out_dir, results)


@pytest.fixture(scope="module")
def resumed(tmp_path_factory) -> dict:
    """Rank 0's distances for each table kind (one 2-rank launch for the module, bounded in time)."""
    out_dir = tmp_path_factory.mktemp("fsdp_resume")
    return rank0_results(__file__, out_dir, world_size=WORLD_SIZE, timeout_s=150)


@pytest.mark.slow
@pytest.mark.parametrize("table", TABLES)
def test_fsdp_resume_restores_the_trained_query_table(resumed: dict, table: str) -> None:
    """Resuming under FSDP2 copies the checkpoint's query table into the sharded table exactly, and every
    backbone tensor too, after a step that moved the table (before: the table stayed as the run started)."""
    result = resumed[table]
    assert result["table_sharded"]  # the table is in the root's FSDP unit: a plain copy would not do
    assert result["table_moved"] > 1e-3
    assert set(result["table_vs_file"]) and all(d == 0.0 for d in result["table_vs_file"].values())
    assert all(d == 0.0 for d in result["vs_trained"].values()), result["vs_trained"]


@pytest.mark.parametrize("table", TABLES)
def test_unsharded_resume_restores_the_query_table_through_the_same_copy(tmp_path, table: str) -> None:
    """One process (sharded False): the checkpoint's table and backbone are copied into the model exactly."""
    from gradcache_sparton.modeling import load_checkpoint_weights

    saved = _model(table)
    with torch.no_grad():
        for p in saved.parameters():
            p.add_(torch.rand_like(p))
    saved.save_pretrained(tmp_path)
    resumed = _model(table)
    load_checkpoint_weights(resumed, tmp_path, sharded=False)
    for name, tensor in saved.state_dict().items():
        torch.testing.assert_close(resumed.state_dict()[name], tensor, rtol=0, atol=0, msg=name)


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))
