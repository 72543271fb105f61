"""gradcache_sparton: exact very-large-batch SPLADE training.

Two pieces, combined:
- a GradCache engine (embed mini-batches without a graph, compute the loss on the full batch of
  reps, cache the rep gradients, re-embed with RNG/autocast replayed and backprop), and
- Sparton, a fused Triton SPLADE head that never materialises the [B, S, V] logits.

Triton is imported lazily: ``import gradcache_sparton`` works on machines without a GPU. The trainer,
its arguments and the pipeline import ``transformers.Trainer`` (which imports triton), so they load on
first use of their names.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from gradcache_sparton.data import (
    BeirData,
    TrainingCollator,
    beir_training_pairs,
    load_beir,
    load_training_data,
    self_supervised_pairs,
)
from gradcache_sparton.engine import CachedLoss, GradCache, GradCacheConfig, LossOutput
from gradcache_sparton.evaluation import EncodingSettings, SparseRetrievalEvaluator
from gradcache_sparton.kernels import SpartonHead, sparton_head, sparton_head_reference
from gradcache_sparton.losses import (
    SpladeLoss,
    SpladeLossConfig,
    WarmupSchedule,
    dot_scores,
    flops_regularizer,
    info_nce_loss,
    kl_div_loss,
    l1_regularizer,
    margin_mse_loss,
)
from gradcache_sparton.mining import mine_hard_negatives
from gradcache_sparton.modeling import InferenceFreeEncoder, QueryTable, SpladeEncoder, register_masked_lm
from gradcache_sparton.resources import default_tokenizer_path
from gradcache_sparton.version import __version__

if TYPE_CHECKING:
    from gradcache_sparton.arguments import CachedSpladeTrainingArguments, DataArguments, ModelArguments
    from gradcache_sparton.evaluation.callback import RetrievalEvalCallback
    from gradcache_sparton.integrations.sentence_transformers import use_sparton_head
    from gradcache_sparton.pipeline import run_evaluation, run_training
    from gradcache_sparton.trainer import CachedSpladeTrainer


_LAZY = {
    "CachedSpladeTrainer": "gradcache_sparton.trainer",
    "CachedSpladeTrainingArguments": "gradcache_sparton.arguments",
    "DataArguments": "gradcache_sparton.arguments",
    "ModelArguments": "gradcache_sparton.arguments",
    "RetrievalEvalCallback": "gradcache_sparton.evaluation.callback",
    "run_evaluation": "gradcache_sparton.pipeline",
    "run_training": "gradcache_sparton.pipeline",
    "use_sparton_head": "gradcache_sparton.integrations.sentence_transformers",
}

__all__ = [
    "BeirData",
    "CachedLoss",
    "CachedSpladeTrainer",
    "CachedSpladeTrainingArguments",
    "DataArguments",
    "EncodingSettings",
    "GradCache",
    "GradCacheConfig",
    "InferenceFreeEncoder",
    "LossOutput",
    "ModelArguments",
    "QueryTable",
    "RetrievalEvalCallback",
    "SparseRetrievalEvaluator",
    "SpartonHead",
    "SpladeEncoder",
    "SpladeLoss",
    "SpladeLossConfig",
    "TrainingCollator",
    "WarmupSchedule",
    "__version__",
    "beir_training_pairs",
    "default_tokenizer_path",
    "dot_scores",
    "flops_regularizer",
    "info_nce_loss",
    "kl_div_loss",
    "l1_regularizer",
    "load_beir",
    "load_training_data",
    "margin_mse_loss",
    "mine_hard_negatives",
    "register_masked_lm",
    "run_evaluation",
    "run_training",
    "self_supervised_pairs",
    "sparton_head",
    "sparton_head_reference",
    "use_sparton_head",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'gradcache_sparton' has no attribute {name!r}")
