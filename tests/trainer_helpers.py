"""Shared pieces of the trainer tests: a tiny seeded SpladeEncoder over the real vocabulary, the
comparison's training arguments, and the first rows of the shipped SciFact sample."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import BertConfig

from gradcache_sparton.arguments import CachedSpladeTrainingArguments
from gradcache_sparton.data import default_train_data_path, load_training_data
from gradcache_sparton.modeling import SpladeEncoder

__all__ = ["TRAINER_ROWS", "trainer_args", "trainer_model", "trainer_rows"]

TRAINER_ROWS = 64  # 2 optimizer steps x 2 accumulation micro-steps x 2 ranks x 8 rows


def trainer_args(output_dir: Path, *, per_device_batch: int, **overrides) -> CachedSpladeTrainingArguments:
    """Arguments of the trainer comparison: SGD (moves parameters by lr x gradient), 2 accumulation steps."""
    values = {
        "output_dir": str(output_dir),
        "per_device_train_batch_size": per_device_batch,
        "gradient_accumulation_steps": 2,
        "mini_batch_size": 3,
        "query_max_length": 16,
        "document_max_length": 32,
        "max_steps": 2,
        "optim": "sgd",
        "learning_rate": 1e-3,
        "query_reg_weight": 1e-3,
        "doc_reg_weight": 1e-3,
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": "none",
        "use_cpu": True,
        "seed": 7,
        "disable_tqdm": True,
        "dataloader_num_workers": 0,
    }
    values.update(overrides)
    return CachedSpladeTrainingArguments(**values)


def trainer_model(tokenizer, *, dropout: float = 0.0) -> SpladeEncoder:
    """A tiny seeded SpladeEncoder over the real vocabulary (dropout-free unless asked)."""
    config = BertConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
    )
    torch.manual_seed(0)
    return SpladeEncoder.from_config(config)


def trainer_rows():
    """The first TRAINER_ROWS rows of the shipped SciFact training sample."""
    return load_training_data(default_train_data_path()).select(range(TRAINER_ROWS))
