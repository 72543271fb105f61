"""sentence-transformers ``SparseEncoder`` models with the fused head and the GradCache engine.

Legend: B batch, S sequence, D hidden, V vocabulary.

A SPLADE ``SparseEncoder`` is two modules: a fill-mask ``Transformer`` (``MLMTransformer`` in older
saves) that returns the masked-LM logits [B, S, V], and ``SpladePooling``, which max-pools
log1p(relu(logits)) over S. :func:`use_sparton_head` converts such a model in place so its forward
computes the same [B, V] reps through the Sparton head from the hidden states before the decoder (the
LM transform's output, [B, S, D]), never forming the logits. The object stays a ``SparseEncoder``
with the same two modules, parameters, ``encode`` and ``save``/``save_pretrained`` output: a saved
model loads as a plain ``SparseEncoder`` anywhere, with equal reps.

- :func:`as_rep_encoder` gives the engine's view of the model, ``encoder(**features) -> [B, V]``, so
  :class:`~gradcache_sparton.engine.CachedLoss` and ``CachedSpladeTrainer`` train it.
- :func:`splade_loss_config_from` maps a sentence-transformers ``SpladeLoss`` (with
  ``SparseMultipleNegativesRankingLoss`` and FLOPS regularizers) onto our
  :class:`~gradcache_sparton.losses.SpladeLossConfig`: same loss, same gradients.
- :func:`from_sentence_transformers_columns` reads its datasets' columns (``anchor``, ``negative``,
  or by position).
- The other way: :func:`write_sentence_transformers_files` makes one of our checkpoints a
  ``SparseEncoder`` folder too (modules, ``max_seq_length`` as trained, a model card from
  :func:`model_card` / :func:`run_model_card`), so ``SparseEncoder(path)`` gives exactly our reps.

sentence-transformers is an optional extra (``pip install gradcache_sparton[sentence-transformers]``);
this module imports it only inside the functions that need it, so the trainer can recognise a
``SparseEncoder`` without importing the library.
"""

from __future__ import annotations

import json
import os
import sys
import types
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from torch import Tensor, nn

from gradcache_sparton.data.columns import NEGATIVE_PREFIX, POSITIVE_COLUMN, QUERY_COLUMN
from gradcache_sparton.losses import SpladeLossConfig
from gradcache_sparton.modeling import SpladeEncoder

if TYPE_CHECKING:
    import datasets
    from sentence_transformers import SparseEncoder

__all__ = [
    "as_rep_encoder",
    "from_sentence_transformers_columns",
    "is_sparse_encoder",
    "model_card",
    "run_model_card",
    "sentence_transformers_can_load",
    "splade_loss_config_from",
    "use_sparton_head",
    "uses_sparton_head",
    "write_sentence_transformers_files",
]

# sentence-transformers' names for the query column and a lone hard-negative column.
_ANCHOR_COLUMN = "anchor"
_NEGATIVE_COLUMN = "negative"

# What sentence-transformers 6 writes for a SPLADE SparseEncoder: the fill-mask Transformer in the
# checkpoint's root (its weights are the masked-LM's own), the pooling's config in a subfolder.
_TRANSFORMER_TYPE = "sentence_transformers.base.modules.transformer.Transformer"
_POOLING_TYPE = "sentence_transformers.sparse_encoder.modules.splade_pooling.SpladePooling"
_MASKED_POOLING_TYPE = (
    "gradcache_sparton.integrations.sentence_transformers_modules.SpecialTokenMaskedSpladePooling"
)
_POOLING_DIR = "1_SpladePooling"
_TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json", "vocab.txt")

# Feature keys the backbone reads; sentence-transformers adds bookkeeping keys ("modality", ...).
_MODEL_INPUTS = ("input_ids", "attention_mask", "token_type_ids", "position_ids")

# The instance attribute use_sparton_head sets on the model it converts (copied with it by deepcopy).
_CONVERTED_MARK = "_gradcache_sparton_head"


def _import_sentence_transformers() -> types.ModuleType:
    try:
        import sentence_transformers
    except ImportError as error:
        raise ImportError(
            "this needs sentence-transformers: pip install 'gradcache_sparton[sentence-transformers]'"
        ) from error
    return sentence_transformers


def is_sparse_encoder(model: object) -> bool:
    """Whether ``model`` is a sentence-transformers ``SparseEncoder`` (never imports the library)."""
    module = sys.modules.get("sentence_transformers.sparse_encoder.model")
    return module is not None and isinstance(model, module.SparseEncoder)


def uses_sparton_head(model: object) -> bool:
    """Whether :func:`use_sparton_head` converted ``model`` (itself, or the model inside a DDP, DataParallel
    or ``torch.compile`` wrapper).

    Read from a mark that the conversion leaves on the model itself, never from its ``forward``, which
    others wrap: accelerate's mixed precision replaces ``model.forward`` with an autocast wrapper around
    the converted one.
    """
    if not isinstance(model, nn.Module):
        return False
    return _unwrapped(model).__dict__.get(_CONVERTED_MARK) is True


def _unwrapped(model: nn.Module) -> nn.Module:
    """The model inside its DDP / DataParallel / FSDP / ``torch.compile`` containers (accelerate's unwrapping;
    an accelerate mixed-precision ``forward`` is kept: it wraps the converted forward, it does not replace it)."""
    from accelerate.utils import extract_model_from_parallel

    return extract_model_from_parallel(model, keep_fp32_wrapper=True, keep_torch_compile=False)


def _check_splade_modules(model: SparseEncoder) -> None:
    """Raise unless ``model`` is [fill-mask Transformer, SpladePooling(max, relu)] over a supported backbone."""
    _import_sentence_transformers()
    from sentence_transformers import SparseEncoder
    from sentence_transformers.base.modules import Transformer
    from sentence_transformers.sparse_encoder.modules import SpladePooling

    if not isinstance(model, SparseEncoder):
        raise TypeError(f"model must be a sentence-transformers SparseEncoder, got {type(model).__name__}")
    modules = list(model.children())
    kinds = [type(module).__name__ for module in modules]
    if (
        len(modules) != 2
        or not isinstance(modules[0], Transformer)
        or not isinstance(modules[1], SpladePooling)
    ):
        raise ValueError(
            "model must be a SPLADE SparseEncoder made of exactly a fill-mask Transformer (or MLMTransformer) "
            f"and SpladePooling, got modules {kinds}"
        )
    transformer, pooling = modules
    text = transformer.modality_config.get("text", {})
    if (
        transformer.transformer_task != "fill-mask"
        or transformer.backend != "torch"
        or list(transformer.modality_config) != ["text"]
        or text.get("method") != "forward"
        or text.get("method_output_name") != "logits"
    ):
        raise ValueError(
            "model[0] must be a text-only fill-mask Transformer on the torch backend whose forward returns "
            f"the masked-LM logits, got transformer_task={transformer.transformer_task!r}, "
            f"backend={transformer.backend!r}, modality_config={transformer.modality_config!r}"
        )
    if pooling.pooling_strategy != "max" or pooling.activation_function != "relu":
        raise ValueError(
            "the fused head computes max pooling of log1p(relu(logits)) (SPLADE v2 and later), got SpladePooling("
            f"pooling_strategy={pooling.pooling_strategy!r}, activation_function={pooling.activation_function!r})"
        )
    if model.module_kwargs and any(model.module_kwargs.values()):
        raise ValueError(
            f"model passes module kwargs {model.module_kwargs!r}, which the fused forward does not read"
        )
    SpladeEncoder(transformer.auto_model)  # raises TypeError for a backbone outside the supported list


def use_sparton_head(model: SparseEncoder) -> SparseEncoder:
    """Make a SPLADE ``SparseEncoder`` compute its reps with the fused Sparton head, in place.

    After the call, ``model(features)["sentence_embedding"]`` (and so ``encode``, every
    sentence-transformers loss and evaluator) equals what it was before, computed as
    ``SpladeEncoder(model[0].auto_model)(**features)``: the backbone's hidden states, its own LM
    transform, and a head sharing the decoder's weight and bias, with no [B, S, V] logits (so
    ``token_embeddings`` is no longer among the outputs). The modules, parameters, state dict and
    saved files are unchanged: a saved model is a standard ``SparseEncoder``. Calling it again is a
    no-op.

    Args:
        model: a ``SparseEncoder`` made of a fill-mask ``Transformer`` (or ``MLMTransformer``) over a
            backbone listed by :func:`~gradcache_sparton.modeling.supported_masked_lm_classes`, then
            ``SpladePooling(pooling_strategy="max", activation_function="relu")``.

    Returns:
        ``model`` itself.

    Raises:
        TypeError: not a ``SparseEncoder``, or an unsupported backbone class.
        ValueError: other modules, sum pooling or the ``log1p_relu`` activation, module kwargs.
    """
    if uses_sparton_head(model):
        return model
    _check_splade_modules(model)
    pooling = model[1]
    if pooling.embedding_dimension is None:  # what SpladePooling's own first forward records
        pooling.embedding_dimension = model[0].auto_model.get_output_embeddings().out_features
    # An instance attribute, so type(model), its modules and its save format stay sentence-transformers'.
    model.forward = types.MethodType(_sparton_forward, model)
    # nn.DataParallel (which sentence-transformers' trainer picks when several GPUs are visible and no
    # launcher is used) copies the instance __dict__ into each replica, forward included: rebind it there.
    model._replicate_for_data_parallel = types.MethodType(_replicate_with_own_forward, model)
    # The mark uses_sparton_head reads: whatever later wraps this forward (accelerate's autocast, a
    # compiled or DDP container around the model), the model itself stays recognisable.
    setattr(model, _CONVERTED_MARK, True)
    return model


def _replicate_with_own_forward(self: SparseEncoder) -> SparseEncoder:
    """``nn.Module._replicate_for_data_parallel``, with the instance ``forward`` bound to the replica.

    The converted forward (and any wrapper bound over it, such as accelerate's autocast) is a method bound
    to ``self``: copied as is, every replica would run the original model's weights on its own device.
    """
    replica = type(self)._replicate_for_data_parallel(self)
    forward = replica.__dict__.get("forward")
    if isinstance(forward, types.MethodType) and forward.__self__ is self:
        replica.forward = types.MethodType(forward.__func__, replica)
    replica.__dict__.pop("_replicate_for_data_parallel", None)
    return replica


def _sparton_forward(self: SparseEncoder, input: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
    """``SparseEncoder.forward`` through the fused head: sets ``input["sentence_embedding"]`` [B, V].

    ``kwargs`` are dropped, as ``SparseEncoder.forward`` drops them for these two modules (neither
    declares forward kwargs).
    """
    if "cu_seq_lens_q" in input:
        raise ValueError(
            "the fused head needs padded [B, S] inputs, got flattened (unpadded) ones: set "
            "model[0].unpad_inputs = False"
        )
    modality = input.get("modality", "text")
    if modality != "text":
        raise ValueError(f"the fused head encodes text only, got modality {modality!r}")
    # Built per call: it holds no state, only the backbone's own modules and parameters, so it can
    # never go stale (device moves, dtype casts, re-tied decoders).
    encoder = SpladeEncoder(self[0].auto_model, special_token_ids=getattr(self[1], "special_token_ids", ()))
    input["sentence_embedding"] = encoder(**{key: input[key] for key in _MODEL_INPUTS if key in input})
    return input


class _RepEncoder(nn.Module):
    """``encoder(**features) -> [B, V]`` over a ``SparseEncoder`` (or its DDP / compiled wrapper)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, **features: Tensor) -> Tensor:
        return self.model(dict(features))["sentence_embedding"]  # [B, V]


def as_rep_encoder(model: nn.Module) -> nn.Module:
    """The engine's view of a converted ``SparseEncoder``: ``encoder(**features) -> [B, V]``.

    ``model`` may be wrapped (DistributedDataParallel, ``torch.compile``, accelerate's mixed-precision
    ``forward``); the view calls it as is, so the wrapper's hooks and autocast run. Under DDP pass
    ``mini_batch_context`` to the engine yourself (``CachedSpladeTrainer`` does), since the view hides
    the wrapper from it.

    Raises:
        ValueError: the (unwrapped) model was not converted with :func:`use_sparton_head`.
    """
    if not uses_sparton_head(model):
        inner = _unwrapped(model) if isinstance(model, nn.Module) else model
        raise ValueError(
            f"model ({type(inner).__name__}) must be a SparseEncoder converted with use_sparton_head(model), "
            "so that its reps come from the fused head"
        )
    return _RepEncoder(model)


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
      our definition exactly;
    - ``query_regularizer_weight`` (None: 0) -> ``query_reg_weight``; ``document_regularizer_weight`` ->
      ``doc_reg_weight``.

    sentence-transformers ramps the weights with ``SpladeRegularizerWeightSchedulerCallback``
    (quadratic over the first third of training by default); pass that as ``reg_warmup_steps`` /
    ``reg_warmup_shape``. Anything without an exact counterpart is refused.

    Raises:
        TypeError: ``loss`` is not a sentence-transformers ``SpladeLoss``.
        ValueError: another base loss or similarity, non-default directions or hardness, FLOPS
            thresholds, other regularizers, ``use_document_regularizer_only``, gathering across devices.
    """
    _import_sentence_transformers()
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
            "use_document_regularizer_only=True has no counterpart: the first column is the queries"
        )
    regularizers = {"document_regularizer": loss.document_regularizer}
    if loss.query_regularizer_weight is not None:
        regularizers["query_regularizer"] = loss.query_regularizer
    for name, regularizer in regularizers.items():
        if type(regularizer) is not FlopsLoss or regularizer.threshold is not None:
            raise ValueError(
                f"loss.{name} must be a FlopsLoss without threshold, got {type(regularizer).__name__}"
                f"{'' if type(regularizer) is not FlopsLoss else f'(threshold={regularizer.threshold})'}"
            )
    return SpladeLossConfig(
        query_reg_weight=float(loss.query_regularizer_weight or 0.0),
        doc_reg_weight=float(loss.document_regularizer_weight),
        contrastive="infonce",
        query_regularizer="flops",
        doc_regularizer="flops",
        temperature=1.0 / base.scale,
        reg_warmup_steps=reg_warmup_steps,
        reg_warmup_shape=reg_warmup_shape,
    )


def from_sentence_transformers_columns(
    dataset: datasets.Dataset, *, positional: bool = False
) -> datasets.Dataset:
    """Rename a sentence-transformers training dataset's columns to ours (query, positive, negative_1..k).

    - Named: ``anchor`` -> ``query`` and a lone ``negative`` -> ``negative_1``; ``positive`` and
      ``negative_<i>`` are already ours.
    - ``positional=True`` (sentence-transformers' own rule, where names do not matter): the string
      columns in order are the query, the positive, then hard negatives; numeric columns (labels,
      teacher scores) keep their names.

    A dataset that already has a ``query`` column, or that is not a ``datasets.Dataset``, is returned
    unchanged (validation reports what is wrong with it). Renaming touches no data.

    Raises:
        ValueError: a renamed column would collide with an existing one, or ``positional=True`` with
            fewer than two string columns.
    """
    import datasets

    if not isinstance(dataset, datasets.Dataset) or QUERY_COLUMN in dataset.column_names:
        return dataset
    names = dataset.column_names
    if positional:
        texts = [
            n
            for n in names
            if isinstance(dataset.features[n], datasets.Value)
            and dataset.features[n].dtype in ("string", "large_string")
        ]
        if len(texts) < 2:
            raise ValueError(
                "train_dataset needs at least two string columns (query, positive, then hard negatives, by "
                f"position), got columns {names}"
            )
        targets = [QUERY_COLUMN, POSITIVE_COLUMN] + [
            f"{NEGATIVE_PREFIX}{i}" for i in range(1, len(texts) - 1)
        ]
        mapping = dict(zip(texts, targets, strict=True))
    else:
        mapping = {_ANCHOR_COLUMN: QUERY_COLUMN, _NEGATIVE_COLUMN: f"{NEGATIVE_PREFIX}1"}
    mapping = {old: new for old, new in mapping.items() if old in names and old != new}
    kept = set(names) - set(mapping)
    collisions = sorted(new for new in mapping.values() if new in kept)
    if collisions:
        raise ValueError(
            f"renaming train_dataset columns {mapping} to this trainer's names would overwrite existing "
            f"columns {collisions}: rename them first"
        )
    return dataset.rename_columns(mapping) if mapping else dataset


def _write_json(path: str, value: object) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(value, f, indent=2)
        f.write("\n")


def sentence_transformers_can_load(encoder: SpladeEncoder) -> bool:
    """Whether :func:`write_sentence_transformers_files` can describe ``encoder``: a masked LM whose
    positions all pool (special tokens aside); not a decoder-only LM, nor echo or prefix options."""
    from transformers import MODEL_FOR_MASKED_LM_MAPPING

    # sentence-transformers builds the backbone with AutoModelForMaskedLM from the saved config.
    auto_masked_lm = MODEL_FOR_MASKED_LM_MAPPING.get(type(encoder.config), None) is type(encoder.model)
    return auto_masked_lm and not (encoder.bidirectional or encoder.echo or encoder.prefix_length)


def write_sentence_transformers_files(
    directory: str | os.PathLike,
    *,
    encoder: SpladeEncoder,
    max_seq_length: int,
    card: str | None = None,
) -> None:
    """Make a saved :class:`SpladeEncoder` checkpoint a sentence-transformers ``SparseEncoder`` as well.

    Writes, next to what ``encoder.save_pretrained(directory, tokenizer=...)`` wrote (the masked-LM
    weights, config and tokenizer, which both libraries read as they are): ``modules.json``,
    ``sentence_bert_config.json`` (the fill-mask task and ``max_seq_length``),
    ``config_sentence_transformers.json`` (dot-product similarity), ``1_SpladePooling/config.json``
    (max pooling of log1p(relu(logits))) and ``README.md`` (``card``, default :func:`model_card`).
    Needs no sentence-transformers install. ``SparseEncoder(directory)`` then gives the encoder's reps.

    With ``special_token_ids``, whose positions sentence-transformers' own ``SpladePooling`` cannot
    drop, the pooling module is
    :class:`~gradcache_sparton.integrations.sentence_transformers_modules.SpecialTokenMaskedSpladePooling`:
    ``SparseEncoder(directory)`` refuses to import it (a module outside its namespace), and
    ``SparseEncoder(directory, trust_remote_code=True)`` with gradcache_sparton installed loads the
    exact reps. Never the wrong reps.

    Args:
        directory: a folder holding ``encoder.save_pretrained(directory, tokenizer=...)``'s output.
        encoder: the encoder saved there (its vocabulary size and options are recorded).
        max_seq_length: the truncation length sentence-transformers applies to every text; pass the
            length the model was trained with (documents').
        card: the README.md text.

    Raises:
        TypeError / ValueError, before anything is written: not a SpladeEncoder, a non-positive
            ``max_seq_length`` or one beyond the backbone's positions, no model or tokenizer in
            ``directory``.
    """
    if not isinstance(encoder, SpladeEncoder):
        raise TypeError(f"encoder must be a SpladeEncoder, got {type(encoder).__name__}")
    if not sentence_transformers_can_load(encoder):
        raise ValueError(
            f"a {type(encoder.model).__name__} encoder with {encoder.extra_repr()} has no sentence-transformers "
            "equivalent (its fill-mask Transformer reads masked LMs with every position pooled)"
        )
    if isinstance(max_seq_length, bool) or not isinstance(max_seq_length, int) or max_seq_length < 1:
        raise ValueError(f"max_seq_length must be a positive int, got {max_seq_length!r}")
    positions = getattr(encoder.config, "max_position_embeddings", None)
    if positions is not None and max_seq_length > positions:
        raise ValueError(
            f"max_seq_length {max_seq_length} exceeds the backbone's max_position_embeddings {positions}"
        )
    directory = os.fspath(directory)
    if not os.path.isfile(os.path.join(directory, "config.json")):
        raise ValueError(
            f"{directory} holds no saved model (config.json): call encoder.save_pretrained first"
        )
    if not any(os.path.isfile(os.path.join(directory, name)) for name in _TOKENIZER_FILES):
        raise ValueError(
            f"{directory} holds no tokenizer, which sentence-transformers loads from the same folder: "
            "save with encoder.save_pretrained(directory, tokenizer=tokenizer)"
        )
    from gradcache_sparton.version import __version__

    special = list(encoder.special_token_ids)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": _TRANSFORMER_TYPE},
        {
            "idx": 1,
            "name": "1",
            "path": _POOLING_DIR,
            "type": _MASKED_POOLING_TYPE if special else _POOLING_TYPE,
        },
    ]
    pooling = {
        "pooling_strategy": encoder.pooling,
        "activation_function": "relu",
        "embedding_dimension": encoder.vocab_size,
    }
    if special:
        pooling["special_token_ids"] = special
    _write_json(os.path.join(directory, "modules.json"), modules)
    _write_json(
        os.path.join(directory, "sentence_bert_config.json"),
        {
            "transformer_task": "fill-mask",
            "modality_config": {"text": {"method": "forward", "method_output_name": "logits"}},
            "module_output_name": "token_embeddings",
            "max_seq_length": max_seq_length,
        },
    )
    import torch
    import transformers

    _write_json(
        os.path.join(directory, "config_sentence_transformers.json"),
        {
            "model_type": "SparseEncoder",
            "__version__": {
                "gradcache_sparton": __version__,
                "transformers": transformers.__version__,
                "pytorch": torch.__version__,
            },
            "prompts": {"query": "", "document": ""},
            "default_prompt_name": None,
            "similarity_fn_name": "dot",
        },
    )
    os.makedirs(os.path.join(directory, _POOLING_DIR), exist_ok=True)
    _write_json(os.path.join(directory, _POOLING_DIR, "config.json"), pooling)
    if card is None:
        card = model_card(encoder=encoder, max_seq_length=max_seq_length)
    with open(os.path.join(directory, "README.md"), "w", encoding="utf-8") as f:
        f.write(card)


def model_card(
    *,
    encoder: SpladeEncoder,
    max_seq_length: int,
    base_model: str | None = None,
    train_data: str | None = None,
    settings: Mapping[str, object] | None = None,
    metrics: Mapping[str, float] | None = None,
) -> str:
    """A README.md for a checkpoint: base model, data, training settings, metrics and how to load it.

    ``base_model`` defaults to the backbone config's ``_name_or_path`` (empty for a random init).
    """
    base = base_model if base_model is not None else getattr(encoder.config, "_name_or_path", "") or ""
    special = list(encoder.special_token_ids)
    header = ["---", "library_name: sentence-transformers", "pipeline_tag: feature-extraction", "tags:"]
    header += [
        f"- {tag}" for tag in ("sentence-transformers", "sparse-encoder", "splade", "gradcache_sparton")
    ]
    if base and not os.path.isabs(base):
        header.append(f"base_model: {base}")
    header.append("---")
    lines = [
        *header,
        "",
        "# SPLADE sparse encoder",
        "",
        f"A SPLADE model trained with gradcache_sparton (GradCache and the fused Sparton head). It maps text to "
        f"{encoder.vocab_size}-dimensional sparse vectors, one weight per vocabulary token, scored by dot product.",
        "",
        "## Model",
        "",
        f"- Base model: {_shown_base_model(base) if base else 'randomly initialised from a config'}",
        f"- Architecture: {type(encoder.model).__name__}, max pooling of log1p(relu(logits))",
        f"- Maximum sequence length: {max_seq_length} tokens",
        f"- Special-token positions dropped from the pooling: {special if special else 'none'}",
        "",
        "## Usage",
        "",
        "```python",
        "from sentence_transformers import SparseEncoder",
        "",
        f"model = SparseEncoder(path{', trust_remote_code=True' if special else ''})",
        'embeddings = model.encode(["a query", "a document"])',
        "```",
        "",
        "```python",
        "from gradcache_sparton import SpladeEncoder",
        "",
        "encoder = SpladeEncoder.from_pretrained(path)",
        "```",
    ]
    if special:
        lines += [
            "",
            "Loading in sentence-transformers needs `trust_remote_code=True` and gradcache_sparton installed: "
            "its own SpladePooling cannot drop special-token positions.",
        ]
    if train_data:
        lines += ["", "## Training data", "", train_data]
    if settings:
        lines += ["", "## Training settings", "", "| setting | value |", "|---|---|"]
        lines += [f"| {name} | {value} |" for name, value in settings.items()]
    if metrics:
        lines += ["", "## Metrics", "", "| metric | value |", "|---|---|"]
        lines += [f"| {name} | {value:.4f} |" for name, value in metrics.items()]
    return "\n".join(lines) + "\n"


def _shown_base_model(base: str) -> str:
    """``base`` as a model card names it: a hub id as is, the package's copy of a shipped model by its name,
    another local folder by its own name; never the training machine's absolute path."""
    from gradcache_sparton.resources import SHIPPED_MODELS, shipped_model_path

    if not os.path.isabs(base):
        return base
    for name in SHIPPED_MODELS:
        if os.path.realpath(base) == os.path.realpath(shipped_model_path(name)):
            return f"{name} (shipped with gradcache_sparton)"
    return f"{os.path.basename(os.path.normpath(base))} (a local folder)"


def run_model_card(trainer: Any, encoder: SpladeEncoder) -> str:
    """:func:`model_card` for ``encoder`` as ``trainer`` (a ``CachedSpladeTrainer``) trained it so far.

    Settings come from the trainer's arguments and loss, the data line from its train dataset, the
    metrics are the latest value of each ``eval_*`` entry in ``trainer.state.log_history``.
    """
    args, state = trainer.args, trainer.state
    world = max(1, args.world_size)
    settings: dict[str, object] = {
        "global batch (rows per loss)": args.per_device_train_batch_size * world,
        "mini_batch_size": args.mini_batch_size,
        "gradient_accumulation_steps": args.gradient_accumulation_steps,
        "optimizer steps": state.global_step,
        "learning_rate": args.learning_rate,
        "query_max_length": args.query_max_length,
        "document_max_length": args.document_max_length,
        "loss": repr(trainer.loss),
        "precision": "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32",
    }
    dataset = trainer.train_dataset
    train_data = None
    if dataset is not None:
        name = getattr(getattr(dataset, "info", None), "dataset_name", None)
        columns = getattr(dataset, "column_names", None)
        train_data = f"{len(dataset):,} rows{f' of {name}' if name else ''}, columns {columns}"
    metrics: dict[str, float] = {}
    for entry in state.log_history:
        for key, value in entry.items():
            if (
                key.startswith("eval_")
                and isinstance(value, (int, float))
                and not key.endswith(("_runtime", "_per_second"))
            ):
                metrics[key] = float(value)
    return model_card(
        encoder=encoder,
        max_seq_length=args.document_max_length,
        train_data=train_data,
        settings=settings,
        metrics=metrics,
    )
