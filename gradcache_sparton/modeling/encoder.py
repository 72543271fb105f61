"""``SpladeEncoder``: a masked-LM backbone whose own LM transform feeds a ``SpartonHead`` tied to its decoder.

Legend: B batch, S sequence, D hidden, V vocabulary.

The encoder computes the SPLADE (v2 and later) representation

    Y[b, v] = max_s log1p(relu(T(H)[b, s] · E[v] + bias[v])) · M[b, s]

where H [B, S, D] are the base model's last hidden states, T the model's own LM transform (dense →
activation → LayerNorm, stored in a different place by each family), E [V, D] and bias [V] the weight
and bias of the model's decoder (``get_output_embeddings()``, E tied to the input embeddings) and M the
attention mask, optionally with special-token positions removed. This is exactly what
``log1p(relu(AutoModelForMaskedLM(...).logits))`` max-pooled over S gives, but the [B, S, V] logits are
never formed: the head shares the decoder's parameters and reduces over S tile by tile. With
``activation_function="log1p_relu"`` (OpenSearch v3's "l0" activation, sentence-transformers'
``SpladePooling(activation_function="log1p_relu")``) every weight gets one more log1p:
Y = log1p(log1p(relu(.))).

The wrapped model stays a standard masked-LM: ``save_pretrained`` writes what the backbone writes plus
a small ``splade_config.json`` sidecar for the SPLADE options (:mod:`.checkpoint`). Each family's LM
transform is in :mod:`.backbones`, the decoder-only options (``bidirectional``, ``echo``) in :mod:`.llm`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from transformers import AutoConfig, PreTrainedConfig, PreTrainedTokenizerBase

from gradcache_sparton.kernels import DEFAULT_HEAD_ACTIVATION, SpartonHead
from gradcache_sparton.modeling.backbones import (
    auto_class_for,
    check_known_backbone,
    check_max_length,
    is_decoder_only,
    lm_transform,
    position_limit,
)
from gradcache_sparton.modeling.checkpoint import (
    CONFIG_LOCATION_KWARGS,
    QUERY_ENCODER_FIELD,
    SPLADE_CONFIG_NAME,
    TRAINING_OPTIONS,
    backbone_state_dict,
    check_checkpoint_files,
    load_backbone,
    read_splade_config,
)
from gradcache_sparton.modeling.llm import (
    bidirectional_mask,
    check_attention_implementation,
    default_special_token_ids,
    echo_inputs,
)
from gradcache_sparton.primitives.query_encoders import SIAMESE_QUERY_ENCODER

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["SpladeEncoder"]

# SPLADE v2 and later max-pool over the sequence; that is the only pooling the fused head computes.
_POOLINGS = ("max",)
# The options beyond pooling and masked ids with their defaults: splade_config.json and the repr name
# only those that differ.
_OPTION_DEFAULTS = {
    "prefix_length": 0,
    "bidirectional": False,
    "echo": False,
    "activation_function": DEFAULT_HEAD_ACTIVATION,
}

# Encoders whose base model builds its attention mask with transformers' ``create_bidirectional_mask``.
# Under sdpa that function reads the [B, S] mask on the host to drop it where nothing is padded
# (``padding_mask.all()``): a device sync per encoder call, which serialises the host's launches with the
# device's work at small mini-batches. A 4-D mask is taken as it is, so these get one (a stride-0 view,
# what sdpa_mask would materialise where there is padding). Not ModernBERT (its local-attention layers
# build their own masks).
_PREPARED_MASK_MODEL_TYPES = frozenset({"bert", "distilbert", "roberta", "xlm-roberta"})


def _special_tokens_after_text(tokenizer: PreTrainedTokenizerBase) -> int:
    """How many special tokens (e.g. [SEP], an EOS) ``tokenizer`` appends after every text's own tokens."""
    ids, text = tokenizer("a")["input_ids"], tokenizer("a", add_special_tokens=False)["input_ids"]
    ends = [
        start + len(text)
        for start in range(len(ids) - len(text) + 1)
        if ids[start : start + len(text)] == text
    ]
    return len(ids) - ends[-1] if ends else 0


class SpladeEncoder(nn.Module):
    """SPLADE encoder: ``encoder(**features) -> [B, V]`` sparse reps from a masked-LM backbone.

    The base model (``model.base_model``) gives [B, S, D] hidden states, the model's own LM transform
    maps them to the decoder's input, and a :class:`SpartonHead` that *shares* the decoder's weight
    [V, D] (tied to the input embeddings) and bias [V] max-pools log1p(relu(logits)) over the sequence
    without forming the logits. No parameter is copied: ``named_parameters()`` lists each once, and
    ``state_dict()`` lists the head's two tensors again as aliases ``head.weight`` / ``head.bias``.

    Supported backbones (exact classes): see :func:`supported_masked_lm_classes` — BERT, DistilBERT,
    ModernBERT, RoBERTa and XLM-RoBERTa masked-LMs, and any class added with
    :func:`register_masked_lm`.

    Args:
        model: a masked-LM ``PreTrainedModel`` (e.g. from ``AutoModelForMaskedLM``).
        pooling: how token scores are pooled over the sequence; only ``"max"`` (SPLADE v2+).
        special_token_ids: token ids whose positions are dropped from the max, on top of the attention
            mask (e.g. ``tokenizer.all_special_ids`` to keep [CLS]/[SEP]/[PAD] out of the reps). Empty: every
            attended position counts. None (the default): :func:`default_special_token_ids`, none for a
            masked LM (as in the reference SPLADE models), the config's BOS and EOS ids for a decoder-only
            LM (under causal attention the BOS position's rep is the same for every text).
        prefix_length: the first ``prefix_length`` attended tokens of every text (e.g. a fixed
            instruction prompt) are dropped from the max; the backbone still reads them. 0: none.
        bidirectional: decoder-only backbones only: every token attends to every attended token,
            later ones included, instead of the causal mask (full attention, no sliding window;
            the ``sdpa`` and ``eager`` attention implementations). Off: the family's own attention.
        echo: decoder-only backbones only: the backbone reads each text twice and only the second
            copy is pooled, so every pooled token has seen the whole text (echo embeddings).
        activation_function: the activation before the log1p, as sentence-transformers'
            ``SpladePooling`` names it: ``"relu"`` (SPLADE v2 and later) or ``"log1p_relu"``
            (log1p(log1p(relu(logits))), OpenSearch v3's "l0" activation).
    """

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        pooling: str = "max",
        special_token_ids: Sequence[int] | None = None,
        prefix_length: int = 0,
        bidirectional: bool = False,
        echo: bool = False,
        activation_function: str = DEFAULT_HEAD_ACTIVATION,
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
        check_known_backbone(model)
        if pooling not in _POOLINGS:
            raise ValueError(f"pooling must be one of {_POOLINGS}, got {pooling!r}")
        vocab_size = decoder.out_features
        if special_token_ids is None:
            special_token_ids = default_special_token_ids(model)
        ids = list(special_token_ids)
        bad = [i for i in ids if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < vocab_size]
        if bad:
            raise ValueError(f"special_token_ids must be ints in [0, {vocab_size}), got {bad}")
        ids = sorted(set(ids))
        if isinstance(prefix_length, bool) or not isinstance(prefix_length, int) or prefix_length < 0:
            raise ValueError(f"prefix_length must be an int >= 0, got {prefix_length!r}")
        for name, value in (("bidirectional", bidirectional), ("echo", echo)):
            if not isinstance(value, bool):
                raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
            if value and not is_decoder_only(type(model)):
                raise ValueError(
                    f"{name}=True is for decoder-only backbones, got {type(model).__name__} (a masked LM "
                    "already attends both ways and pools every position)"
                )
        if bidirectional:
            check_attention_implementation(model)

        self.model = model
        self.prefix_length = prefix_length
        self.bidirectional = bidirectional
        self.echo = echo
        self.head = SpartonHead.from_decoder(decoder, activation_function=activation_function)
        self.pooling = pooling
        # Max lengths it was trained with (None: unknown): the trainer sets them, splade_config.json keeps them.
        self.query_max_length: int | None = None
        self.document_max_length: int | None = None
        # LoRA settings of the adapters merged into the weights (None: none); the training pipeline sets them.
        self.lora: dict[str, Any] | None = None
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
        cls, config: PreTrainedConfig, *, model_kwargs: Mapping[str, Any] | None = None, **options: Any
    ) -> SpladeEncoder:
        """A randomly initialised encoder: ``AutoModelForMaskedLM.from_config(config, **model_kwargs)``
        (``AutoModelForCausalLM`` for a decoder-only family) wrapped with the constructor's keyword
        ``options`` (``pooling``, ``special_token_ids``, ``prefix_length``, ...)."""
        return cls(auto_class_for(config).from_config(config, **(model_kwargs or {})), **options)

    @classmethod
    def from_pretrained(
        cls,
        pretrained_model_name_or_path: str | os.PathLike,
        *,
        pooling: str | None = None,
        special_token_ids: Sequence[int] | None = None,
        prefix_length: int | None = None,
        bidirectional: bool | None = None,
        echo: bool | None = None,
        activation_function: str | None = None,
        **model_kwargs: Any,
    ) -> SpladeEncoder:
        """Load a masked-LM (or supported decoder-only LM) checkpoint, ours or any standard one, and wrap it.

        ``pretrained_model_name_or_path`` is a local folder or a hub id (downloaded where the network
        allows, as ``from_pretrained`` does: ``HF_HUB_OFFLINE=1`` or ``local_files_only=True`` forbid
        it). ``model_kwargs`` go to ``AutoModelForMaskedLM.from_pretrained``. ``pooling`` and
        ``special_token_ids`` (and the other options, ``activation_function`` among them) default to the
        checkpoint's ``splade_config.json`` if it has one, else to ``"max"``, :func:`default_special_token_ids`
        and the other options' defaults (``activation_function="relu"``); how it was trained (``query_max_length``, ``document_max_length``,
        ``lora``) comes from there too. The config is read and the family checked before
        any weights load. Of an inference-free folder (its ``query_encoder`` a table) this loads the document
        encoder, as a siamese model.
        """
        path = os.fspath(pretrained_model_name_or_path)
        location = {k: model_kwargs[k] for k in CONFIG_LOCATION_KWARGS if k in model_kwargs}
        options = read_splade_config(path, **location)
        options.pop(QUERY_ENCODER_FIELD, None)  # what encodes the folder's queries: read by model_loading
        trained = {name: options.pop(name) for name in TRAINING_OPTIONS if name in options}
        if pooling is not None:
            options["pooling"] = pooling
        if special_token_ids is not None:
            options["special_token_ids"] = special_token_ids
        for name, value in (
            ("prefix_length", prefix_length),
            ("bidirectional", bidirectional),
            ("echo", echo),
            ("activation_function", activation_function),
        ):
            if value is not None:
                options[name] = value
        config = model_kwargs.get("config")
        if not isinstance(config, PreTrainedConfig):
            if os.path.isdir(path):
                check_checkpoint_files(path)
            config = AutoConfig.from_pretrained(path, **location)
        model = load_backbone(auto_class_for(config), path, **model_kwargs)
        encoder = cls(model, **options)
        for name, value in trained.items():
            setattr(encoder, name, value)
        return encoder

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
    def query_encoder(self) -> str:
        """What encodes this model's queries (``splade_config.json``'s ``query_encoder``): ``"splade"``, itself."""
        return SIAMESE_QUERY_ENCODER

    @property
    def activation_function(self) -> str:
        """The head's activation before the log1p: ``"relu"`` or ``"log1p_relu"`` (the class doc)."""
        return self.head.activation_function

    @property
    def special_token_ids(self) -> tuple[int, ...]:
        """Token ids whose positions never contribute to the reps (empty: none)."""
        return tuple(self._special_token_ids.tolist())

    @property
    def max_length(self) -> int | None:
        """The most tokens a text may have: the backbone's table of absolute positions (less RoBERTa's offset
        of ``pad_token_id + 1``; halved under ``echo``, which reads each text twice). None for rotary
        positions (ModernBERT, decoder-only LMs), which have no table to run past."""
        return position_limit(self.config, echo=self.echo)

    def check_max_length(
        self, name: str, value: int, *, tokenizer: PreTrainedTokenizerBase | None = None
    ) -> None:
        """``ValueError`` naming the argument ``name`` if texts of ``value`` tokens would run past the
        position table (:attr:`max_length`), or if ``prefix_length`` would leave them no pooled text token
        (with ``tokenizer``, the special tokens it appends after every text count against ``value`` too):
        found before any step or encoding, not midway through."""
        check_max_length(self.config, name, value, echo=self.echo)
        if self.prefix_length == 0:
            return
        trailing = 0 if tokenizer is None else _special_tokens_after_text(tokenizer)
        if self.prefix_length + trailing >= value:
            after = f" and the {trailing} special token(s) the tokenizer appends" if trailing else ""
            raise ValueError(
                f"prefix_length={self.prefix_length}{after} leave no text token to pool in {name}={value} "
                f"tokens: every text's rep would be empty; give {name} > {self.prefix_length + trailing} or a "
                "smaller prefix_length"
            )

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
        if is_decoder_only(type(self.model)):
            # Positions count attended tokens, so left- and right-padded rows read the same.
            kwargs.setdefault("position_ids", (attention_mask.long().cumsum(-1) - 1).clamp(min=0))  # [B, S]
            if self.bidirectional:
                attention_mask = bidirectional_mask(self.model, attention_mask)  # [B, 1, S, S]
        elif (
            self.config.model_type in _PREPARED_MASK_MODEL_TYPES
            and self.config._attn_implementation == "sdpa"
        ):
            attention_mask = bidirectional_mask(self.model, attention_mask)  # [B, 1, S, S], no host read
        hidden_states = self.model.base_model(input_ids=input_ids, attention_mask=attention_mask, **kwargs)[0]
        return lm_transform(self.model, hidden_states)  # [B, S, D]

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
        # Non-zero means "attend", as the backbone itself reads the mask (transformers casts it to bool).
        # A bool mask also spares the head its 0/1 value check, a device sync per call.
        mask = attention_mask.bool()  # [B, S]
        if self._special_token_ids.numel() > 0:
            mask = mask & ~torch.isin(input_ids, self._special_token_ids)  # [B, S]
        if self.prefix_length > 0:
            mask = mask & (attention_mask.long().cumsum(-1) > self.prefix_length)  # [B, S]
        if self.echo:
            if token_type_ids is not None or "position_ids" in kwargs:
                raise ValueError(
                    "echo=True builds its own inputs: token_type_ids and position_ids are not accepted"
                )
            input_ids, attention_mask, mask = echo_inputs(input_ids, attention_mask, mask)  # [B, 2S] each
        hidden_states = self.token_hidden_states(input_ids, attention_mask, token_type_ids, **kwargs)
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
        """Write a standard masked-LM checkpoint (safetensors), the tokenizer and ``splade_config.json`` (its
        options and the model's :attr:`query_encoder`).

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
        backbone_state = None if state_dict is None else backbone_state_dict(state_dict)
        self.model.save_pretrained(
            save_directory, state_dict=backbone_state, is_main_process=is_main_process, **kwargs
        )
        if not is_main_process:
            return
        self.write_splade_config(save_directory)
        if tokenizer is not None:
            tokenizer.save_pretrained(save_directory)

    def write_splade_config(self, save_directory: str | os.PathLike) -> None:
        """Write ``save_directory/splade_config.json``: the options (those off their defaults), how the model
        was trained and its :attr:`query_encoder` (:mod:`.checkpoint`)."""
        options = {"pooling": self.pooling, "special_token_ids": list(self.special_token_ids)}
        options.update(self._changed_options())  # only those off their defaults: _OPTION_DEFAULTS
        options.update(
            {name: getattr(self, name) for name in TRAINING_OPTIONS if getattr(self, name) is not None}
        )
        options[QUERY_ENCODER_FIELD] = self.query_encoder
        with open(os.path.join(save_directory, SPLADE_CONFIG_NAME), "w", encoding="utf-8") as f:
            json.dump(options, f, indent=2)
            f.write("\n")

    def _pooling_options(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in _OPTION_DEFAULTS}

    def _changed_options(self) -> dict[str, Any]:
        return {
            name: value for name, value in self._pooling_options().items() if value != _OPTION_DEFAULTS[name]
        }

    def extra_repr(self) -> str:
        options = "".join(f", {name}={value!r}" for name, value in self._changed_options().items())
        return f"pooling={self.pooling!r}, special_token_ids={list(self.special_token_ids)}{options}"
