"""Losses over sparse reps: contrastive (InfoNCE, MarginMSE, listwise KL), regularizers (FLOPS, L1),
the SPLADE loss and the sparsity statistics logged with it.

Every loss follows the package's loss contract, ``loss_fn(reps: Mapping[str, Tensor], **loss_kwargs)``
returning a scalar or ``(scalar, components)``: ``reps`` maps column names to [B, V] reps in order
(queries, positives, then one column per hard negative). They are pure functions of ``reps``, so the
same loss runs on an uncached batch and on the full concatenated batch inside the GradCache engine.
Each public function checks its input; :class:`SpladeLoss` checks a step's input once and calls the
same computations unchecked.
"""

from gradcache_sparton.losses.columns import ContrastiveColumns, split_columns
from gradcache_sparton.losses.contrastive import info_nce_loss, kl_div_loss, margin_mse_loss
from gradcache_sparton.losses.regularizers import (
    REGULARIZERS,
    flops_regularizer,
    get_regularizer,
    l1_regularizer,
)
from gradcache_sparton.losses.schedule import WARMUP_SHAPES, WarmupSchedule, warmup_weight
from gradcache_sparton.losses.scores import dot_scores, paired_scores
from gradcache_sparton.losses.sparsity import activation_rate, expected_flops, mean_nonzeros, nonzeros_per_row
from gradcache_sparton.losses.splade import CONTRASTIVE_LOSSES, SpladeLoss, SpladeLossConfig

__all__ = [
    "CONTRASTIVE_LOSSES",
    "REGULARIZERS",
    "WARMUP_SHAPES",
    "ContrastiveColumns",
    "SpladeLoss",
    "SpladeLossConfig",
    "WarmupSchedule",
    "activation_rate",
    "dot_scores",
    "expected_flops",
    "flops_regularizer",
    "get_regularizer",
    "info_nce_loss",
    "kl_div_loss",
    "l1_regularizer",
    "margin_mse_loss",
    "mean_nonzeros",
    "nonzeros_per_row",
    "paired_scores",
    "split_columns",
    "warmup_weight",
]
