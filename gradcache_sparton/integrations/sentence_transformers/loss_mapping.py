"""A sentence-transformers ``SpladeLoss`` as our :class:`~gradcache_sparton.losses.SpladeLossConfig`:
the same loss and gradients, or a refusal naming what has no exact counterpart."""

from __future__ import annotations

import math

from torch import nn

from gradcache_sparton.integrations.sentence_transformers.conversion import import_sentence_transformers
from gradcache_sparton.losses import SpladeLossConfig

__all__ = ["check_not_sentence_transformers_loss", "splade_loss_config_from"]


def check_not_sentence_transformers_loss(loss: object) -> None:
    """``TypeError`` if ``loss`` is a sentence-transformers loss module, which takes (features, labels), not
    this trainer's reps: a ``SpladeLoss`` is mapped with :func:`splade_loss_config_from`, others have no
    counterpart. Does not import sentence-transformers."""
    if not type(loss).__module__.startswith("sentence_transformers."):
        return
    if type(loss).__name__ == "SpladeLoss":
        raise TypeError(
            "loss is a sentence-transformers SpladeLoss, which this trainer cannot call (it takes features and "
            "labels, not reps): map it first, loss=SpladeLoss(splade_loss_config_from(st_loss, "
            "reg_warmup_steps=...)), with SpladeLoss from gradcache_sparton and splade_loss_config_from from "
            "gradcache_sparton.integrations.sentence_transformers (docs/sentence_transformers.md)"
        )
    raise TypeError(
        f"loss is a sentence-transformers {type(loss).__name__}, which this trainer cannot call (it takes "
        "features and labels, not reps); only a sentence-transformers SpladeLoss maps onto ours, with "
        "splade_loss_config_from, or give a loss over reps (loss_fn(reps, step=..., **loss_kwargs))"
    )


def splade_loss_config_from(
    loss: nn.Module, *, reg_warmup_steps: int = 0, reg_warmup_shape: str = "quadratic"
) -> SpladeLossConfig:
    """Our :class:`SpladeLossConfig` for a sentence-transformers ``SpladeLoss``: the same loss and gradients.

    The mapping (sentence-transformers -> ours):

    - ``SparseMultipleNegativesRankingLoss(scale=s, similarity_fct=dot_score)`` with its default
      direction and partition (query to documents, one softmax over every positive and hard negative
      of the batch) -> ``contrastive="infonce"``, ``temperature=1/s``;
    - ``FlopsLoss`` without threshold, ``sum_v (mean_b reps[b, v])²``: on the first column ->
      ``query_regularizer="flops"``, on every other column concatenated -> ``doc_regularizer="flops"``,
      our definition exactly; the document regularizer's ``FlopsLoss(threshold=t)`` (FLOPS with l0
      masking: rows with at most t non-zeros zeroed) -> ``doc_reg_l0_threshold=floor(t)`` (a count exceeds
      t exactly when it exceeds floor(t));
    - ``query_regularizer_weight`` (None: 0) -> ``query_reg_weight``; ``document_regularizer_weight`` ->
      ``doc_reg_weight``. An inference-free model (a ``Router`` with a ``SparseStaticEmbedding`` query
      route) has no query regularizer: ``query_regularizer_weight=None`` (or 0), as sentence-transformers'
      inference-free recipe sets it.

    sentence-transformers ramps the weights with ``SpladeRegularizerWeightSchedulerCallback``
    (quadratic over the first third of training by default); pass that as ``reg_warmup_steps`` /
    ``reg_warmup_shape``. Anything without an exact counterpart is refused.

    Raises:
        TypeError: ``loss`` is not a sentence-transformers ``SpladeLoss``.
        ValueError: another base loss or similarity, non-default directions or hardness, a query FLOPS
            threshold, other regularizers, ``use_document_regularizer_only``, gathering across devices.
    """
    import_sentence_transformers()
    from sentence_transformers import util
    from sentence_transformers.sparse_encoder.losses import (
        FlopsLoss,
        SparseMultipleNegativesRankingLoss,
        SpladeLoss,
    )

    if not isinstance(loss, SpladeLoss):
        raise TypeError(f"loss must be a sentence-transformers SpladeLoss, got {type(loss).__name__}")
    base = loss.loss
    if type(base) is not SparseMultipleNegativesRankingLoss:
        raise ValueError(
            f"loss.loss must be a SparseMultipleNegativesRankingLoss, got {type(base).__name__}: "
            "no exact counterpart here"
        )
    defaults = {
        "similarity_fct": util.dot_score,
        "directions": ("query_to_doc",),
        "partition_mode": "joint",
        "gather_across_devices": False,
    }
    differing = {
        name: getattr(base, name) for name, value in defaults.items() if getattr(base, name) != value
    }
    if base.hardness_mode is not None and base.hardness_strength > 0.0:
        differing["hardness_mode"] = base.hardness_mode
    if differing:
        raise ValueError(
            "the SparseMultipleNegativesRankingLoss must use dot-product scores, directions=('query_to_doc',), "
            f"partition_mode='joint', no hardness weighting and no gathering (our trainer gathers), got {differing}"
        )
    if loss.use_document_regularizer_only:
        raise ValueError(
            "use_document_regularizer_only=True regularizes the queries together with the documents (one FLOPS "
            "over every column), which has no counterpart: the first column is the queries. For an "
            "inference-free model (no query regularizer) set use_document_regularizer_only=False and "
            "query_regularizer_weight=None"
        )
    document = loss.document_regularizer
    if type(document) is not FlopsLoss:
        raise ValueError(f"loss.document_regularizer must be a FlopsLoss, got {type(document).__name__}")
    threshold = document.threshold
    if threshold is not None and (
        isinstance(threshold, bool)
        or not isinstance(threshold, (int, float))
        or not math.isfinite(threshold)
        or threshold < 0
    ):
        raise ValueError(
            f"loss.document_regularizer's FlopsLoss threshold must be a number >= 0, got {threshold!r}"
        )
    if loss.query_regularizer_weight is not None:
        query = loss.query_regularizer
        if type(query) is not FlopsLoss or query.threshold is not None:
            raise ValueError(
                f"loss.query_regularizer must be a FlopsLoss without threshold, got {type(query).__name__}"
                f"{'' if type(query) is not FlopsLoss else f'(threshold={query.threshold})'}"
            )
    return SpladeLossConfig(
        query_reg_weight=float(loss.query_regularizer_weight or 0.0),
        doc_reg_weight=float(loss.document_regularizer_weight),
        contrastive="infonce",
        query_regularizer="flops",
        doc_regularizer="flops",
        doc_reg_l0_threshold=None if threshold is None else math.floor(threshold),
        temperature=1.0 / base.scale,
        reg_warmup_steps=reg_warmup_steps,
        reg_warmup_shape=reg_warmup_shape,
    )
