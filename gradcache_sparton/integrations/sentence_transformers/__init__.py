"""sentence-transformers ``SparseEncoder`` models with the fused head and the GradCache engine.

Legend: B batch, S sequence, D hidden, V vocabulary.

A SPLADE ``SparseEncoder`` is two modules: a fill-mask ``Transformer`` (``MLMTransformer`` in older
saves) that returns the masked-LM logits [B, S, V], and ``SpladePooling``, which max-pools
log1p(relu(logits)) over S. :func:`use_sparton_head` converts such a model in place so its forward
computes the same [B, V] reps through the Sparton head from the hidden states before the decoder (the
LM transform's output, [B, S, D]), never forming the logits. The object stays a ``SparseEncoder``
with the same two modules, parameters, ``encode`` and ``save``/``save_pretrained`` output: a saved
model loads as a plain ``SparseEncoder`` anywhere, with equal reps.

One job per module: conversion (:mod:`.conversion`), loss mapping (:mod:`.loss_mapping`), data
columns (:mod:`.columns`), export (:mod:`.export`) and model cards (:mod:`.model_card`).

- Inference-free models both ways: a ``Router`` with a ``SparseStaticEmbedding`` query route and that
  SPLADE pair as its document route converts too (the head on the document route, the query route as is,
  trained or frozen as the module says; the engine routes by column), and
  :func:`inference_free_encoder_from` makes one our :class:`~gradcache_sparton.modeling.InferenceFreeEncoder`;
  :func:`write_sentence_transformers_files` writes one of ours as that ``Router``.
- :func:`as_rep_encoder` gives the engine's view of the model, ``encoder(**features) -> [B, V]``, so
  :class:`~gradcache_sparton.engine.CachedLoss` and ``CachedSpladeTrainer`` train it.
- :func:`splade_loss_config_from` maps a sentence-transformers ``SpladeLoss`` (with
  ``SparseMultipleNegativesRankingLoss`` and FLOPS regularizers) onto our
  :class:`~gradcache_sparton.losses.SpladeLossConfig`: same loss, same gradients
  (:func:`check_not_sentence_transformers_loss` refuses an unmapped one).
- :func:`from_sentence_transformers_columns` reads its datasets' columns (``anchor``, ``negative``,
  or by position).
- The other way: :func:`write_sentence_transformers_files` makes one of our checkpoints a
  ``SparseEncoder`` folder too (modules, ``max_seq_length`` as trained, a model card from
  :func:`model_card` / :func:`run_model_card`), so ``SparseEncoder(path)`` gives exactly our reps.

sentence-transformers is an optional extra (``pip install gradcache_sparton[sentence-transformers]``);
this package imports it only inside the functions that need it, so the trainer can recognise a
``SparseEncoder`` without importing the library.
"""

from gradcache_sparton.integrations.sentence_transformers.columns import from_sentence_transformers_columns
from gradcache_sparton.integrations.sentence_transformers.conversion import (
    as_rep_encoder,
    inference_free_encoder_from,
    is_inference_free_sparse_encoder,
    is_sparse_encoder,
    sparse_encoder_backbone,
    use_sparton_head,
    uses_sparton_head,
)
from gradcache_sparton.integrations.sentence_transformers.export import (
    sentence_transformers_can_load,
    write_sentence_transformers_files,
)
from gradcache_sparton.integrations.sentence_transformers.loss_mapping import (
    check_not_sentence_transformers_loss,
    splade_loss_config_from,
)
from gradcache_sparton.integrations.sentence_transformers.model_card import model_card, run_model_card

__all__ = [
    "as_rep_encoder",
    "check_not_sentence_transformers_loss",
    "from_sentence_transformers_columns",
    "inference_free_encoder_from",
    "is_inference_free_sparse_encoder",
    "is_sparse_encoder",
    "model_card",
    "run_model_card",
    "sentence_transformers_can_load",
    "sparse_encoder_backbone",
    "splade_loss_config_from",
    "use_sparton_head",
    "uses_sparton_head",
    "write_sentence_transformers_files",
]
