"""The backbones ``SpladeEncoder`` reads: each family's LM transform, the registry of them, and their
position tables.

Legend: B batch, S sequence, D hidden, V vocabulary.

A masked LM's logits are ``decoder(T(H))``: H [B, S, D] the base model's last hidden states, T the
family's LM transform (dense → activation → LayerNorm, stored in a different place by each family) and
the decoder its ``get_output_embeddings()``. The encoder runs T itself and hands T(H) to the fused head,
so it must know where each family keeps T: :func:`supported_masked_lm_classes` lists the families it
knows, :func:`register_masked_lm` teaches it another. Decoder-only LMs (Llama, Mistral, Qwen) have no
transform: ``lm_head`` reads the base model's output.

Importing a transformers model class imports ``torch._dynamo`` and with it triton, so every model class
is imported inside the functions that need it: importing this module imports neither.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from torch import Tensor, nn
from transformers import (
    MODEL_FOR_CAUSAL_LM_MAPPING,
    MODEL_FOR_MASKED_LM_MAPPING,
    AutoModelForCausalLM,
    AutoModelForMaskedLM,
    PreTrainedConfig,
)

__all__ = [
    "auto_class_for",
    "check_known_backbone",
    "check_max_length",
    "is_decoder_only",
    "lm_transform",
    "position_limit",
    "register_masked_lm",
    "supported_masked_lm_classes",
]


def _bert_transform(model: nn.Module, hidden_states: Tensor) -> Tensor:
    """BERT: ``cls.predictions.transform`` (dense → config.hidden_act → LayerNorm)."""
    return model.cls.predictions.transform(hidden_states)


def _distilbert_transform(model: nn.Module, hidden_states: Tensor) -> Tensor:
    """DistilBERT: the transform lives on the model itself (``vocab_transform`` → activation → LN)."""
    return model.vocab_layer_norm(model.activation(model.vocab_transform(hidden_states)))


def _roberta_transform(model: nn.Module, hidden_states: Tensor) -> Tensor:
    """RoBERTa / XLM-R: ``lm_head.dense`` → gelu → ``lm_head.layer_norm`` (lm_head.forward minus decoder)."""
    from transformers.activations import gelu  # the very function RobertaLMHead.forward calls

    head = model.lm_head
    return head.layer_norm(gelu(head.dense(hidden_states)))


def _modernbert_transform(model: nn.Module, hidden_states: Tensor) -> Tensor:
    """ModernBERT: ``head`` (dense → config.classifier_activation → LayerNorm), then ``decoder``."""
    return model.head(hidden_states)


def _decoder_only_transform(model: nn.Module, hidden_states: Tensor) -> Tensor:
    """Decoder-only LMs: none. The final norm is inside the base model; ``lm_head`` reads its output."""
    return hidden_states


@functools.cache
def _lm_transforms() -> dict[type, Callable[[nn.Module, Tensor], Tensor]]:
    """Masked-LM class -> its LM transform, the step between the base model's output and the decoder.

    Each entry repeats, op for op, what that class's own forward does before calling its decoder
    (``get_output_embeddings()``), whose weight and bias the head uses; the tests compare against the
    full logits of each class's own forward. Keyed by exact class: a subclass may change its forward.
    """
    from transformers import (
        BertForMaskedLM,
        DistilBertForMaskedLM,
        LlamaForCausalLM,
        MistralForCausalLM,
        ModernBertForMaskedLM,
        Qwen2ForCausalLM,
        Qwen3ForCausalLM,
        RobertaForMaskedLM,
        XLMRobertaForMaskedLM,
    )

    return {
        BertForMaskedLM: _bert_transform,
        DistilBertForMaskedLM: _distilbert_transform,
        ModernBertForMaskedLM: _modernbert_transform,
        RobertaForMaskedLM: _roberta_transform,
        XLMRobertaForMaskedLM: _roberta_transform,
        # Decoder-only: the head ties to lm_head (no bias; tied or untied input embeddings).
        LlamaForCausalLM: _decoder_only_transform,
        MistralForCausalLM: _decoder_only_transform,
        Qwen2ForCausalLM: _decoder_only_transform,
        Qwen3ForCausalLM: _decoder_only_transform,
    }


def is_decoder_only(model_class: type) -> bool:
    """Whether ``model_class`` is a supported decoder-only (causal) LM."""
    return _lm_transforms().get(model_class) is _decoder_only_transform


def supported_masked_lm_classes() -> tuple[str, ...]:
    """Names of the backbone classes ``SpladeEncoder`` knows the LM transform of (masked and decoder-only LMs)."""
    return tuple(sorted(cls.__name__ for cls in _lm_transforms()))


def register_masked_lm(model_class: type, transform: Callable[[nn.Module, Tensor], Tensor]) -> None:
    """Teach :class:`SpladeEncoder` a masked-LM class whose head is a transform followed by a linear decoder.

    The model's logits must be ``model.get_output_embeddings()(transform(model, H))``, with H [B, S, D]
    the last hidden states of ``model.base_model`` and the decoder an ``nn.Linear(D, V)``: the encoder
    then computes the SPLADE reps of those logits with the fused head, never forming them. Check it
    as the tests do for the built-in families: reps and every gradient against
    ``log1p(relu(model(**features).logits))`` max-pooled over S.

    ``from_config`` / ``from_pretrained`` also need the class to be its config's
    ``AutoModelForMaskedLM`` class (``AutoModelForMaskedLM.register(ConfigClass, model_class)``).
    Registering the same transform again is a no-op.

    Args:
        model_class: the exact ``PreTrainedModel`` subclass (subclasses are not covered: they may
            change the forward).
        transform: ``transform(model, hidden_states [B, S, D]) -> [B, S, D]``, the decoder's input.

    Raises:
        TypeError: ``model_class`` is not a ``PreTrainedModel`` subclass, ``transform`` not callable.
        ValueError: ``model_class`` is registered with another transform.
    """
    from transformers import PreTrainedModel

    if not isinstance(model_class, type) or not issubclass(model_class, PreTrainedModel):
        raise TypeError(f"model_class must be a PreTrainedModel subclass, got {model_class!r}")
    if not callable(transform):
        raise TypeError(f"transform must be callable as transform(model, hidden_states), got {transform!r}")
    transforms = _lm_transforms()
    if transforms.get(model_class, transform) is not transform:
        raise ValueError(f"{model_class.__name__} is already registered with another transform")
    transforms[model_class] = transform


def _unsupported_message(class_name: str) -> str:
    return (
        f"{class_name} is not a supported masked-LM backbone: SpladeEncoder needs to know where each "
        f"family keeps its LM transform, and knows {', '.join(supported_masked_lm_classes())}"
    )


def _masked_lm_class_for(config: PreTrainedConfig) -> type:
    """The ``AutoModelForMaskedLM`` class of ``config``, checked to be supported (before any weights load)."""
    if not isinstance(config, PreTrainedConfig):
        raise TypeError(f"config must be a transformers PreTrainedConfig, got {type(config).__name__}")
    if type(config) not in MODEL_FOR_MASKED_LM_MAPPING and type(config) in MODEL_FOR_CAUSAL_LM_MAPPING:
        causal_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
        if is_decoder_only(causal_class):
            return causal_class
    if type(config) not in MODEL_FOR_MASKED_LM_MAPPING:
        raise ValueError(
            f"config is a {type(config).__name__}, which has no masked-LM class in AutoModelForMaskedLM: "
            "SPLADE needs a model with an MLM head"
        )
    model_class = MODEL_FOR_MASKED_LM_MAPPING[type(config)]
    if model_class not in _lm_transforms():
        raise ValueError(_unsupported_message(model_class.__name__))
    return model_class


def auto_class_for(config: PreTrainedConfig) -> type:
    """The Auto class that builds ``config``'s model (masked-LM, or causal-LM for a decoder-only family),
    the model class checked to be supported before any weights load."""
    return AutoModelForCausalLM if is_decoder_only(_masked_lm_class_for(config)) else AutoModelForMaskedLM


def check_known_backbone(model: nn.Module) -> None:
    """Raise ``TypeError`` unless ``model``'s exact class has a known LM transform (:func:`register_masked_lm`)."""
    if type(model) not in _lm_transforms():
        raise TypeError(_unsupported_message(type(model).__name__))


def lm_transform(model: nn.Module, hidden_states: Tensor) -> Tensor:
    """The input of ``model``'s vocabulary projection: its family's LM transform of H [B, S, D] -> [B, S, D]."""
    return _lm_transforms()[type(model)](model, hidden_states)


def position_limit(config: PreTrainedConfig, *, echo: bool = False) -> int | None:
    """The most tokens a text may have under ``config``: its table of absolute positions
    (``max_position_embeddings``, less RoBERTa's offset of ``pad_token_id + 1``), halved under ``echo``
    (each text read twice). None for rotary positions (ModernBERT, decoder-only LMs): no table to run past."""
    if config.model_type in ("bert", "distilbert"):
        limit = config.max_position_embeddings
    elif config.model_type in ("roberta", "xlm-roberta"):
        limit = config.max_position_embeddings - (config.pad_token_id or 0) - 1
    else:
        return None
    if getattr(config, "position_embedding_type", "absolute") not in (None, "absolute"):
        return None
    return limit // 2 if echo else limit


def check_max_length(config: PreTrainedConfig, name: str, value: int, *, echo: bool = False) -> None:
    """``ValueError`` naming the argument ``name``, its ``value`` and the limit if texts of ``value`` tokens
    would run past the position table of ``config`` (:func:`position_limit`)."""
    limit = position_limit(config, echo=echo)
    if limit is not None and value > limit:
        raise ValueError(
            f"{name}={value} is more tokens than the model can read: its position table "
            f"(max_position_embeddings={config.max_position_embeddings}) holds {limit}; give {name} <= {limit}"
        )
