"""Losses over sparse reps: contrastive (InfoNCE, MarginMSE), regularizers (FLOPS, L1) and the SPLADE loss.

Every loss follows the package's loss contract, ``loss_fn(reps: Mapping[str, Tensor], **loss_kwargs)``
returning a scalar or ``(scalar, components)``: ``reps`` maps column names to [B, V] reps in order
(queries, positives, then one column per hard negative). They are pure functions of ``reps``, so the
same loss runs on an uncached batch and on the full concatenated batch inside the GradCache engine.
"""

from gradcache_sparton.losses.columns import ContrastiveColumns, split_columns
from gradcache_sparton.losses.contrastive import info_nce_loss, margin_mse_loss
from gradcache_sparton.losses.regularizers import (
    REGULARIZERS,
    flops_regularizer,
    get_regularizer,
    l1_regularizer,
)
from gradcache_sparton.losses.schedule import WARMUP_SHAPES, WarmupSchedule, warmup_weight
from gradcache_sparton.losses.scores import dot_scores, paired_scores
from gradcache_sparton.losses.splade import CONTRASTIVE_LOSSES, SpladeLoss, SpladeLossConfig

__all__ = [
    "CONTRASTIVE_LOSSES",
    "REGULARIZERS",
    "WARMUP_SHAPES",
    "ContrastiveColumns",
    "SpladeLoss",
    "SpladeLossConfig",
    "WarmupSchedule",
    "dot_scores",
    "flops_regularizer",
    "get_regularizer",
    "info_nce_loss",
    "l1_regularizer",
    "margin_mse_loss",
    "paired_scores",
    "split_columns",
    "warmup_weight",
]
