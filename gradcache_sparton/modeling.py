"""``SpladeEncoder``: a masked-LM backbone whose own LM transform feeds a ``SpartonHead`` tied to its decoder.

Legend: B batch, S sequence, D hidden, V vocabulary.

The encoder computes the SPLADE (v2 and later) representation

    Y[b, v] = max_s log1p(relu(T(H)[b, s] · E[v] + bias[v])) · M[b, s]

where H [B, S, D] are the base model's last hidden states, T the model's own LM transform (dense →
activation → LayerNorm, stored in a different place by each family), E [V, D] and bias [V] the weight
and bias of the model's decoder (``get_output_embeddings()``, E tied to the input embeddings) and M the
attention mask, optionally with special-token positions removed. This is exactly what
``log1p(relu(AutoModelForMaskedLM(...).logits))`` max-pooled over S gives, but the [B, S, V] logits are
never formed: the head shares the decoder's parameters and reduces over S tile by tile.

The wrapped model stays a standard masked-LM: ``save_pretrained`` writes what the backbone writes (one
tied [V, D] matrix, safetensors) plus a small ``splade_config.json`` sidecar for the SPLADE options,
which ``AutoModelForMaskedLM`` ignores.

Importing a transformers model class imports ``torch._dynamo`` and with it triton, so every model class
is imported inside the functions that need it: importing this module imports neither.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from transformers import AutoConfig, AutoModelForMaskedLM, PreTrainedConfig, PreTrainedTokenizerBase
from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING

from gradcache_sparton.kernels import SpartonHead

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["SPLADE_CONFIG_NAME", "SpladeEncoder", "supported_masked_lm_classes"]

#: File written next to the backbone's checkpoint holding the SPLADE options (pooling, masked ids).
SPLADE_CONFIG_NAME = "splade_config.json"

# SPLADE v2 and later max-pool over the sequence; that is the only pooling the fused head computes.
_POOLINGS = ("max",)

# Hub-location arguments of ``from_pretrained`` that also apply to reading the config alone.
_CONFIG_LOCATION_KWARGS = ("cache_dir", "revision", "subfolder", "token", "local_files_only")


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
        RobertaForMaskedLM,
        XLMRobertaForMaskedLM,
    )

    return {
        BertForMaskedLM: _bert_transform,
        DistilBertForMaskedLM: _distilbert_transform,
        RobertaForMaskedLM: _roberta_transform,
        XLMRobertaForMaskedLM: _roberta_transform,
    }


def supported_masked_lm_classes() -> tuple[str, ...]:
    """Names of the masked-LM classes ``SpladeEncoder`` knows the LM transform of."""
    return tuple(sorted(cls.__name__ for cls in _lm_transforms()))


def _unsupported_message(class_name: str) -> str:
    return (
        f"{class_name} is not a supported masked-LM backbone: SpladeEncoder needs to know where each "
        f"family keeps its LM transform, and knows {', '.join(supported_masked_lm_classes())}"
    )


def _masked_lm_class_for(config: PreTrainedConfig) -> type:
    """The ``AutoModelForMaskedLM`` class of ``config``, checked to be supported (before any weights load)."""
    if not isinstance(config, PreTrainedConfig):
        raise TypeError(f"config must be a transformers PreTrainedConfig, got {type(config).__name__}")
    if type(config) not in MODEL_FOR_MASKED_LM_MAPPING:
        raise ValueError(
            f"config is a {type(config).__name__}, which has no masked-LM class in AutoModelForMaskedLM: "
            "SPLADE needs a model with an MLM head"
        )
    model_class = MODEL_FOR_MASKED_LM_MAPPING[type(config)]
    if model_class not in _lm_transforms():
        raise ValueError(_unsupported_message(model_class.__name__))
    return model_class


class SpladeEncoder(nn.Module):
    """SPLADE encoder: ``encoder(**features) -> [B, V]`` sparse reps from a masked-LM backbone.

    The base model (``model.base_model``) gives [B, S, D] hidden states, the model's own LM transform
    maps them to the decoder's input, and a :class:`SpartonHead` that *shares* the decoder's weight
    [V, D] (tied to the input embeddings) and bias [V] max-pools log1p(relu(logits)) over the sequence
    without forming the logits. No parameter is copied: ``named_parameters()`` lists each once, and
    ``state_dict()`` lists the head's two tensors again as aliases ``head.weight`` / ``head.bias``.

    Supported backbones (exact classes): see :func:`supported_masked_lm_classes` — BERT, DistilBERT,
    RoBERTa and XLM-RoBERTa masked-LMs.

    Args:
        model: a masked-LM ``PreTrainedModel`` (e.g. from ``AutoModelForMaskedLM``).
        pooling: how token scores are pooled over the sequence; only ``"max"`` (SPLADE v2+).
        special_token_ids: token ids whose positions are dropped from the max, on top of the attention
            mask (e.g. ``tokenizer.all_special_ids`` to keep [CLS]/[SEP]/[PAD] out of the reps). Empty
            (the default, as in the reference SPLADE models): every attended position counts.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        pooling: str = "max",
        special_token_ids: Sequence[int] = (),
    ) -> None:
        super().__init__()
        from transformers import PreTrainedModel

        if not isinstance(model, PreTrainedModel):
            raise TypeError(
                f"model must be a transformers masked-LM PreTrainedModel, got {type(model).__name__}"
            )
        decoder = model.get_output_embeddings()
        if not isinstance(decoder, nn.Linear):
            raise TypeError(
                f"model is a {type(model).__name__}, which has no masked-LM head (its "
                "get_output_embeddings() is not an nn.Linear): load it with AutoModelForMaskedLM"
            )
        if type(model) not in _lm_transforms():
            raise TypeError(_unsupported_message(type(model).__name__))
        if pooling not in _POOLINGS:
            raise ValueError(f"pooling must be one of {_POOLINGS}, got {pooling!r}")
        vocab_size = decoder.out_features
        ids = list(special_token_ids)
        bad = [i for i in ids if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < vocab_size]
        if bad:
            raise ValueError(f"special_token_ids must be ints in [0, {vocab_size}), got {bad}")
        ids = sorted(set(ids))

        self.model = model
        self.head = SpartonHead.from_decoder(decoder)
        self.pooling = pooling
        # Not persistent: the ids live in splade_config.json, the state dict stays the backbone's.
        self.register_buffer(
            "_special_token_ids",
            torch.tensor(ids, dtype=torch.long, device=decoder.weight.device),
            persistent=False,
        )
        self.train(model.training)

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_config(
        cls,
        config: PreTrainedConfig,
        *,
        pooling: str = "max",
        special_token_ids: Sequence[int] = (),
        **model_kwargs: Any,
    ) -> SpladeEncoder:
        """A randomly initialised encoder (``AutoModelForMaskedLM.from_config(config, **model_kwargs)``)."""
        _masked_lm_class_for(config)
        model = AutoModelForMaskedLM.from_config(config, **model_kwargs)
        return cls(model, pooling=pooling, special_token_ids=special_token_ids)

    @classmethod
    def from_pretrained(
        cls,
        pretrained_model_name_or_path: str | os.PathLike,
        *,
        pooling: str | None = None,
        special_token_ids: Sequence[int] | None = None,
        **model_kwargs: Any,
    ) -> SpladeEncoder:
        """Load a masked-LM checkpoint (ours or any standard one) and wrap it.

        ``model_kwargs`` go to ``AutoModelForMaskedLM.from_pretrained``; ``local_files_only`` defaults
        to True (training runs never reach the hub; pass False to allow a download). ``pooling`` and
        ``special_token_ids`` default to the directory's ``splade_config.json`` if it has one, else to
        ``"max"`` and no masked ids. The config is read and the family checked before any weights load.
        """
        path = os.fspath(pretrained_model_name_or_path)
        model_kwargs.setdefault("local_files_only", True)
        options = _read_splade_config(path)
        if pooling is not None:
            options["pooling"] = pooling
        if special_token_ids is not None:
            options["special_token_ids"] = special_token_ids
        config = model_kwargs.get("config")
        if not isinstance(config, PreTrainedConfig):
            location = {k: model_kwargs[k] for k in _CONFIG_LOCATION_KWARGS if k in model_kwargs}
            config = AutoConfig.from_pretrained(path, **location)
        _masked_lm_class_for(config)
        model = AutoModelForMaskedLM.from_pretrained(path, **model_kwargs)
        return cls(model, **options)

    # ------------------------------------------------------------------ interface

    @property
    def config(self) -> PreTrainedConfig:
        """The backbone's config (the Trainer and the hub tooling read it)."""
        return self.model.config

    @property
    def vocab_size(self) -> int:
        """V, the decoder's output size: the width of the reps."""
        return self.head.vocab_size

    @property
    def special_token_ids(self) -> tuple[int, ...]:
        """Token ids whose positions never contribute to the reps (empty: none)."""
        return tuple(self._special_token_ids.tolist())

    def check_tokenizer(self, tokenizer: PreTrainedTokenizerBase) -> None:
        """Raise ValueError unless ``len(tokenizer)`` equals V: rep index v must mean token id v."""
        if not isinstance(tokenizer, PreTrainedTokenizerBase):
            raise TypeError(f"tokenizer must be a PreTrainedTokenizerBase, got {type(tokenizer).__name__}")
        if len(tokenizer) != self.vocab_size:
            raise ValueError(
                f"tokenizer has {len(tokenizer)} tokens but the model's decoder has vocab_size "
                f"{self.vocab_size}: rep dimensions would not line up with token ids"
            )

    def tie_weights(self) -> None:
        """Re-tie the backbone (``model.tie_weights()``) and point the head at its current decoder.

        Needed after anything that replaces the decoder module or its parameter objects (e.g.
        ``model.set_output_embeddings``); forward refuses to run on a stale head.
        """
        self.model.tie_weights()
        self.head.tie_weights(self.model.get_output_embeddings())

    # ------------------------------------------------------------------ forward

    def token_hidden_states(
        self,
        input_ids: Tensor,
        attention_mask: Tensor,
        token_type_ids: Tensor | None = None,
        **kwargs: Any,
    ) -> Tensor:
        """[B, S] features -> [B, S, D] LM-transformed hidden states, the head's (and decoder's) input."""
        if token_type_ids is not None:
            kwargs["token_type_ids"] = token_type_ids
        hidden_states = self.model.base_model(input_ids=input_ids, attention_mask=attention_mask, **kwargs)[0]
        return _lm_transforms()[type(self.model)](self.model, hidden_states)  # [B, S, D]

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor,
        token_type_ids: Tensor | None = None,
        **kwargs: Any,
    ) -> Tensor:
        """[B, S] ``input_ids``/``attention_mask`` (and ``token_type_ids``) -> [B, V] SPLADE reps.

        Extra keyword arguments (e.g. ``position_ids``) go to the base model.
        """
        decoder = self.model.get_output_embeddings()
        if self.head.weight is not decoder.weight or self.head.bias is not decoder.bias:
            raise RuntimeError(
                "the SPLADE head no longer shares the decoder's parameters (was the decoder replaced?): "
                "call encoder.tie_weights()"
            )
        hidden_states = self.token_hidden_states(input_ids, attention_mask, token_type_ids, **kwargs)
        # Non-zero means "attend", as the backbone itself reads the mask (transformers casts it to bool).
        # A bool mask also spares the head its 0/1 value check, a device sync per call.
        mask = attention_mask.bool()  # [B, S]
        if self._special_token_ids.numel() > 0:
            mask = mask & ~torch.isin(input_ids, self._special_token_ids)  # [B, S]
        return self.head(hidden_states, mask)  # [B, S, D] · [V, D] -> [B, V], logits never formed

    # ------------------------------------------------------------------ checkpointing and saving

    def gradient_checkpointing_enable(
        self, gradient_checkpointing_kwargs: dict[str, Any] | None = None, **kwargs: Any
    ) -> None:
        """Activation checkpointing in the backbone; the head keeps only [B, V] argmaxes, nothing to redo.

        Calls the backbone's ``activation_checkpointing_enable`` where transformers has it, else its
        ``gradient_checkpointing_enable`` (the older name); ``kwargs`` pass through.
        """
        enable = getattr(self.model, "activation_checkpointing_enable", None)
        if enable is not None:
            enable(activation_checkpointing_kwargs=gradient_checkpointing_kwargs, **kwargs)
        else:
            self.model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs=gradient_checkpointing_kwargs, **kwargs
            )

    def activation_checkpointing_enable(
        self, activation_checkpointing_kwargs: dict[str, Any] | None = None, **kwargs: Any
    ) -> None:
        """The newer transformers name of :meth:`gradient_checkpointing_enable` (the Trainer calls either)."""
        self.gradient_checkpointing_enable(activation_checkpointing_kwargs, **kwargs)

    def gradient_checkpointing_disable(self) -> None:
        """Turn the backbone's activation checkpointing off again."""
        disable = getattr(self.model, "activation_checkpointing_disable", None)
        if disable is not None:
            disable()
        else:
            self.model.gradient_checkpointing_disable()

    def save_pretrained(
        self,
        save_directory: str | os.PathLike,
        *,
        tokenizer: PreTrainedTokenizerBase | None = None,
        state_dict: Mapping[str, Tensor] | None = None,
        safe_serialization: bool = True,
        is_main_process: bool = True,
        **kwargs: Any,
    ) -> None:
        """Write a standard masked-LM checkpoint (safetensors), the tokenizer and ``splade_config.json``.

        ``AutoModelForMaskedLM.from_pretrained(save_directory)`` loads the result unchanged. Accepts the
        Trainer's call ``save_pretrained(output_dir, state_dict=..., safe_serialization=...)``: a given
        ``state_dict`` is this encoder's (keys as :meth:`state_dict` names them), e.g. gathered from a
        distributed run; its ``head.*`` aliases are dropped and the ``model.`` prefix removed. Other
        ``kwargs`` go to the backbone's ``save_pretrained``.
        """
        if not safe_serialization:
            raise ValueError("safe_serialization must be True: SpladeEncoder writes safetensors only")
        if tokenizer is not None:
            self.check_tokenizer(tokenizer)
        backbone_state = None if state_dict is None else _backbone_state_dict(state_dict)
        self.model.save_pretrained(
            save_directory, state_dict=backbone_state, is_main_process=is_main_process, **kwargs
        )
        if not is_main_process:
            return
        options = {"pooling": self.pooling, "special_token_ids": list(self.special_token_ids)}
        with open(os.path.join(save_directory, SPLADE_CONFIG_NAME), "w", encoding="utf-8") as f:
            json.dump(options, f, indent=2)
            f.write("\n")
        if tokenizer is not None:
            tokenizer.save_pretrained(save_directory)

    def extra_repr(self) -> str:
        return f"pooling={self.pooling!r}, special_token_ids={list(self.special_token_ids)}"


def _backbone_state_dict(state_dict: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """An encoder state dict -> the backbone's: strip ``model.``, drop the head's aliases."""
    backbone: dict[str, Tensor] = {}
    for key, value in state_dict.items():
        if key.startswith("model."):
            backbone[key.removeprefix("model.")] = value
        elif key not in ("head.weight", "head.bias"):
            raise ValueError(
                "state_dict must be a SpladeEncoder state dict (keys 'model.*' and 'head.*'), "
                f"got key {key!r}"
            )
    return backbone


def _read_splade_config(path: str) -> dict[str, Any]:
    """Options from ``path/splade_config.json`` if ``path`` is a directory holding one, else ``{}``."""
    file = os.path.join(path, SPLADE_CONFIG_NAME)
    if not os.path.isfile(file):
        return {}
    with open(file, encoding="utf-8") as f:
        options = json.load(f)
    if not isinstance(options, dict) or set(options) - {"pooling", "special_token_ids"}:
        raise ValueError(
            f"{file} must hold a JSON object with pooling and special_token_ids, got {options!r}"
        )
    return options
