"""What the 2 ranks of tests/test_inference_free.py's data-parallel test run: one cached step of an
inference-free model with a learned query table, wrapped in DDP, on this rank's half of a global batch.

``python tests/inference_free_ranks.py OUT_DIR`` is one rank (launched by ``rank_launch.launch_ranks``); it
saves its loss and gradients to ``OUT_DIR/rank{r}.pt``. Dropout is off (each rank draws its own masks).
"""

from __future__ import annotations

import sys
from datetime import timedelta
from pathlib import Path

import torch
from engine_helpers import dropout_free_config, grads_of, make_columns
from transformers import BertForMaskedLM

from gradcache_sparton.engine import CachedLoss
from gradcache_sparton.losses import SpladeLoss, SpladeLossConfig
from gradcache_sparton.modeling import InferenceFreeEncoder, QueryTable, SpladeEncoder

__all__ = ["GLOBAL_BATCH", "MINI_BATCH", "WORLD_SIZE", "global_batch", "learned_model", "loss"]

WORLD_SIZE = 2
GLOBAL_BATCH = 8  # 4 rows per rank
MINI_BATCH = 3  # 2 mini-batches per column and rank, the last one short


def learned_model() -> InferenceFreeEncoder:
    """The same seeded model on every rank: a tiny dropout-free SPLADE encoder and a learned query table."""
    torch.manual_seed(0)
    config = dropout_free_config()
    encoder = SpladeEncoder(BertForMaskedLM(config))
    weight = torch.rand(config.vocab_size, generator=torch.Generator().manual_seed(1)) + 0.5
    return InferenceFreeEncoder.from_document_encoder(encoder, QueryTable(weight, frozen=False))


def global_batch() -> dict[str, dict[str, torch.Tensor]]:
    return make_columns(GLOBAL_BATCH, 3)


def loss() -> SpladeLoss:
    return SpladeLoss(SpladeLossConfig(query_reg_weight=0.0, doc_reg_weight=0.1))


def _worker(out_dir: Path) -> None:
    import os

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    model = learned_model()
    ddp = DistributedDataParallel(model)
    rows = slice(rank * GLOBAL_BATCH // WORLD_SIZE, (rank + 1) * GLOBAL_BATCH // WORLD_SIZE)
    columns = {c: {k: v[rows] for k, v in f.items()} for c, f in global_batch().items()}
    value = CachedLoss(ddp, loss(), mini_batch_size=MINI_BATCH)(columns)
    value.backward()
    torch.save({"loss": value.detach(), "grads": grads_of(model)}, out_dir / f"rank{rank}.pt")


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))
