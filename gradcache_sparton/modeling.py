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
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from transformers import (
    MODEL_FOR_CAUSAL_LM_MAPPING,
    MODEL_FOR_MASKED_LM_MAPPING,
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForMaskedLM,
    PreTrainedConfig,
    PreTrainedTokenizerBase,
)

from gradcache_sparton.kernels import SpartonHead

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = [
    "SPLADE_CONFIG_NAME",
    "TRAINING_OPTIONS",
    "SpladeEncoder",
    "check_checkpoint_files",
    "check_max_length",
    "load_backbone",
    "position_limit",
    "read_json_file",
    "read_splade_config",
    "register_masked_lm",
    "supported_masked_lm_classes",
]

logger = logging.getLogger(__name__)

#: File written next to the backbone's checkpoint holding the SPLADE options (pooling, masked ids).
SPLADE_CONFIG_NAME = "splade_config.json"

# SPLADE v2 and later max-pool over the sequence; that is the only pooling the fused head computes.
_POOLINGS = ("max",)

# Options beyond pooling and masked ids, saved in splade_config.json only when set.
_DECODER_OPTIONS = ("prefix_length", "bidirectional", "echo")
# Tokens kept per text in training: readers such as ``evaluate`` use them as their defaults, so a checkpoint
# is scored as it was trained.
_MAX_LENGTHS = ("query_max_length", "document_max_length")
# The keys of the ``lora`` record: the LoRA settings (the CLI's flags) whose adapters were merged into the
# weights. A record only: the checkpoint is a plain model and loads without peft.
_LORA_KEYS = ("lora_r", "lora_alpha", "lora_dropout", "lora_target_modules")
#: How the checkpoint was trained (max lengths, ``lora``), saved in splade_config.json when known.
TRAINING_OPTIONS = (*_MAX_LENGTHS, "lora")

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


def _is_decoder_only(model_class: type) -> bool:
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
        if _is_decoder_only(causal_class):
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


def _auto_class(model_class: type) -> type:
    """The Auto class that builds ``model_class`` from its config: masked-LM, or causal-LM for decoders."""
    return AutoModelForCausalLM if _is_decoder_only(model_class) else AutoModelForMaskedLM


# Attention implementations that read a [B, 1, S, S] mask as given (transformers passes a 4-D mask on
# unchanged), which is how bidirectional attention replaces the causal one.
_BIDIRECTIONAL_ATTENTION = ("sdpa", "eager")
# Encoders whose base model builds its attention mask with transformers' ``create_bidirectional_mask``.
# Under sdpa that function reads the [B, S] mask on the host to drop it where nothing is padded
# (``padding_mask.all()``): a device sync per encoder call, which serialises the host's launches with the
# device's work at small mini-batches. A 4-D mask is taken as it is, so these get one (a stride-0 view,
# what sdpa_mask would materialise where there is padding). Not ModernBERT (its local-attention layers
# build their own masks).
_PREPARED_MASK_MODEL_TYPES = frozenset({"bert", "distilbert", "roberta", "xlm-roberta"})


def _check_attention_implementation(model: nn.Module) -> None:
    implementation = model.config._attn_implementation
    if implementation not in _BIDIRECTIONAL_ATTENTION:
        raise ValueError(
            f"bidirectional=True needs attn_implementation in {_BIDIRECTIONAL_ATTENTION}, got {implementation!r} "
            "(flash attention kernels take causality from the layer, not from the mask)"
        )


def _bidirectional_mask(model: nn.Module, attention_mask: Tensor) -> Tensor:
    """[B, S] padding mask -> [B, 1, S, S]: every query attends to every attended key, later ones too."""
    _check_attention_implementation(model)
    S = attention_mask.shape[1]
    keys = attention_mask.bool()[:, None, None, :].expand(-1, 1, S, -1)  # [B, 1, S, S]
    if model.config._attn_implementation == "sdpa":
        return keys  # bool: True attends
    # eager adds the mask to the scores: 0 where attended, the dtype's minimum elsewhere.
    dtype = model.dtype
    return torch.zeros(keys.shape, dtype=dtype, device=keys.device).masked_fill(~keys, torch.finfo(dtype).min)


def _echo_inputs(
    input_ids: Tensor, attention_mask: Tensor, pool_mask: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """Each row's attended tokens twice, right-padded to [B, 2S]; only the second copy keeps ``pool_mask``.

    Row b with L_b attended tokens t (in order, wherever its padding was) becomes [t, t] (2·L_b
    tokens) then padding; position p < L_b reads t[p], L_b <= p < 2·L_b reads t[p - L_b].
    """
    B, S = input_ids.shape
    attended = attention_mask.bool()  # [B, S]
    # Stable sort puts the attended positions first, in order: a left-padded row is compacted too.
    order = torch.sort((~attended).to(torch.int8), dim=1, stable=True).indices  # [B, S]
    ids, pool = input_ids.gather(1, order), pool_mask.gather(1, order)  # [B, S]
    lengths = attended.sum(dim=1, keepdim=True)  # [B, 1]
    position = torch.arange(2 * S, device=input_ids.device).expand(B, -1)  # [B, 2S]
    second = position >= lengths  # [B, 2S]
    source = torch.where(second, position - lengths, position).clamp(max=S - 1)  # [B, 2S]
    echo_mask = position < 2 * lengths  # [B, 2S]
    echo_ids = ids.gather(1, source).masked_fill(~echo_mask, 0)  # [B, 2S]
    echo_pool = pool.gather(1, source) & second & echo_mask  # [B, 2S]
    return echo_ids, echo_mask.to(attention_mask.dtype), echo_pool


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
            mask (e.g. ``tokenizer.all_special_ids`` to keep [CLS]/[SEP]/[PAD] out of the reps). Empty
            (the default, as in the reference SPLADE models): every attended position counts.
        prefix_length: the first ``prefix_length`` attended tokens of every text (e.g. a fixed
            instruction prompt) are dropped from the max; the backbone still reads them. 0: none.
        bidirectional: decoder-only backbones only: every token attends to every attended token,
            later ones included, instead of the causal mask (full attention, no sliding window;
            the ``sdpa`` and ``eager`` attention implementations). Off: the family's own attention.
        echo: decoder-only backbones only: the backbone reads each text twice and only the second
            copy is pooled, so every pooled token has seen the whole text (echo embeddings).
    """

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        pooling: str = "max",
        special_token_ids: Sequence[int] = (),
        prefix_length: int = 0,
        bidirectional: bool = False,
        echo: bool = False,
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
        if isinstance(prefix_length, bool) or not isinstance(prefix_length, int) or prefix_length < 0:
            raise ValueError(f"prefix_length must be an int >= 0, got {prefix_length!r}")
        for name, value in (("bidirectional", bidirectional), ("echo", echo)):
            if not isinstance(value, bool):
                raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
            if value and not _is_decoder_only(type(model)):
                raise ValueError(
                    f"{name}=True is for decoder-only backbones, got {type(model).__name__} (a masked LM "
                    "already attends both ways and pools every position)"
                )
        if bidirectional:
            _check_attention_implementation(model)

        self.model = model
        self.prefix_length = prefix_length
        self.bidirectional = bidirectional
        self.echo = echo
        self.head = SpartonHead.from_decoder(decoder)
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
        cls,
        config: PreTrainedConfig,
        *,
        pooling: str = "max",
        special_token_ids: Sequence[int] = (),
        prefix_length: int = 0,
        bidirectional: bool = False,
        echo: bool = False,
        **model_kwargs: Any,
    ) -> SpladeEncoder:
        """A randomly initialised encoder (``AutoModelForMaskedLM.from_config(config, **model_kwargs)``,
        ``AutoModelForCausalLM`` for a decoder-only family)."""
        model_class = _masked_lm_class_for(config)
        model = _auto_class(model_class).from_config(config, **model_kwargs)
        return cls(
            model,
            pooling=pooling,
            special_token_ids=special_token_ids,
            prefix_length=prefix_length,
            bidirectional=bidirectional,
            echo=echo,
        )

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
        **model_kwargs: Any,
    ) -> SpladeEncoder:
        """Load a masked-LM (or supported decoder-only LM) checkpoint, ours or any standard one, and wrap it.

        ``pretrained_model_name_or_path`` is a local folder or a hub id (downloaded where the network
        allows, as ``from_pretrained`` does: ``HF_HUB_OFFLINE=1`` or ``local_files_only=True`` forbid
        it). ``model_kwargs`` go to ``AutoModelForMaskedLM.from_pretrained``. ``pooling`` and
        ``special_token_ids`` default to the checkpoint's ``splade_config.json`` if it has one, else to
        ``"max"`` and no masked ids; how it was trained (``query_max_length``, ``document_max_length``,
        ``lora``) comes from there too. The config is read and the family checked before
        any weights load.
        """
        path = os.fspath(pretrained_model_name_or_path)
        location = {k: model_kwargs[k] for k in _CONFIG_LOCATION_KWARGS if k in model_kwargs}
        options = read_splade_config(path, **location)
        trained = {name: options.pop(name) for name in TRAINING_OPTIONS if name in options}
        if pooling is not None:
            options["pooling"] = pooling
        if special_token_ids is not None:
            options["special_token_ids"] = special_token_ids
        for name, value in (
            ("prefix_length", prefix_length),
            ("bidirectional", bidirectional),
            ("echo", echo),
        ):
            if value is not None:
                options[name] = value
        config = model_kwargs.get("config")
        if not isinstance(config, PreTrainedConfig):
            if os.path.isdir(path):
                check_checkpoint_files(path)
            config = AutoConfig.from_pretrained(path, **location)
        model_class = _masked_lm_class_for(config)
        model = load_backbone(_auto_class(model_class), path, **model_kwargs)
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
    def special_token_ids(self) -> tuple[int, ...]:
        """Token ids whose positions never contribute to the reps (empty: none)."""
        return tuple(self._special_token_ids.tolist())

    @property
    def max_length(self) -> int | None:
        """The most tokens a text may have: the backbone's table of absolute positions (less RoBERTa's offset
        of ``pad_token_id + 1``; halved under ``echo``, which reads each text twice). None for rotary
        positions (ModernBERT, decoder-only LMs), which have no table to run past."""
        return position_limit(self.config, echo=self.echo)

    def check_max_length(self, name: str, value: int) -> None:
        """``ValueError`` naming the argument ``name`` if texts of ``value`` tokens would run past the
        position table (:attr:`max_length`): found before any step or encoding, not midway through."""
        check_max_length(self.config, name, value, echo=self.echo)

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
        if _is_decoder_only(type(self.model)):
            # Positions count attended tokens, so left- and right-padded rows read the same.
            kwargs.setdefault("position_ids", (attention_mask.long().cumsum(-1) - 1).clamp(min=0))  # [B, S]
            if self.bidirectional:
                attention_mask = _bidirectional_mask(self.model, attention_mask)  # [B, 1, S, S]
        elif (
            self.config.model_type in _PREPARED_MASK_MODEL_TYPES
            and self.config._attn_implementation == "sdpa"
        ):
            attention_mask = _bidirectional_mask(self.model, attention_mask)  # [B, 1, S, S], no host read
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
            input_ids, attention_mask, mask = _echo_inputs(input_ids, attention_mask, mask)  # [B, 2S] each
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
        # The decoder-only options only when set, so other checkpoints keep the two-key file.
        options.update({name: value for name, value in self._pooling_options().items() if value})
        options.update(
            {name: getattr(self, name) for name in TRAINING_OPTIONS if getattr(self, name) is not None}
        )
        with open(os.path.join(save_directory, SPLADE_CONFIG_NAME), "w", encoding="utf-8") as f:
            json.dump(options, f, indent=2)
            f.write("\n")
        if tokenizer is not None:
            tokenizer.save_pretrained(save_directory)

    def _pooling_options(self) -> dict[str, Any]:
        return {"prefix_length": self.prefix_length, "bidirectional": self.bidirectional, "echo": self.echo}

    def extra_repr(self) -> str:
        options = "".join(f", {name}={value!r}" for name, value in self._pooling_options().items() if value)
        return f"pooling={self.pooling!r}, special_token_ids={list(self.special_token_ids)}{options}"


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


def read_splade_config(path: str, **location: Any) -> dict[str, Any]:
    """The options of a checkpoint's ``splade_config.json`` (``{}`` if it has none), checked.

    ``path`` is a local folder or a hub id; ``location`` are ``from_pretrained``'s hub arguments
    (``revision``, ``cache_dir``, ``token``, ``subfolder``, ``local_files_only``).
    """
    file = os.path.join(path, location.get("subfolder") or "", SPLADE_CONFIG_NAME)
    if not os.path.isdir(path):
        file = _hub_file(path, **location)
    if file is None or not os.path.isfile(file):
        return {}
    options = read_json_file(file)
    allowed = {"pooling", "special_token_ids", *_DECODER_OPTIONS, *TRAINING_OPTIONS}
    if not isinstance(options, dict) or set(options) - allowed:
        raise ValueError(
            f"{file} must hold a JSON object with pooling and special_token_ids (and optionally "
            f"{', '.join([*_DECODER_OPTIONS, *TRAINING_OPTIONS])}), got {options!r}"
        )
    for name in _MAX_LENGTHS:
        value = options.get(name)
        if value is not None and not _is_positive_int(value):
            raise ValueError(f"{file}: {name} must be a positive int, got {value!r}")
    if "lora" in options:
        _check_lora_record(options["lora"], file)
    return options


def _is_positive_int(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and value >= 1


def _check_lora_record(lora: Any, file: str) -> None:
    """``ValueError`` naming the file unless ``lora`` is a record of the LoRA settings (``_LORA_KEYS``)."""
    record = lora if isinstance(lora, dict) and set(lora) == set(_LORA_KEYS) else None
    dropout = None if record is None else record["lora_dropout"]
    targets = None if record is None else record["lora_target_modules"]
    if not (
        record is not None
        and _is_positive_int(record["lora_r"])
        and _is_positive_int(record["lora_alpha"])
        and isinstance(dropout, (int, float))
        and not isinstance(dropout, bool)
        and 0 <= dropout < 1
        and isinstance(targets, list)
        and len(targets) > 0
        and all(isinstance(name, str) and name for name in targets)
    ):
        raise ValueError(
            f"{file}: lora must be an object of {', '.join(_LORA_KEYS)} (positive ints, a dropout in [0, 1), a "
            f"non-empty list of module names), got {lora!r}"
        )


def _hub_file(repo_id: str, **location: Any) -> str | None:
    """``splade_config.json`` of a hub checkpoint (cached or downloaded), None if the repo has none."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError

    try:
        return hf_hub_download(repo_id, SPLADE_CONFIG_NAME, **location)
    except (EntryNotFoundError, LocalEntryNotFoundError):
        # No such file, or offline and not cached: the default options. (A repo or network that is not
        # there fails clearly in AutoConfig.from_pretrained right after.)
        return None


# Weight files a checkpoint folder may hold, in the order transformers prefers them.
_WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


def read_json_file(file: str | os.PathLike) -> Any:
    """The JSON value in ``file``; ``ValueError`` naming the file and line if it is cut short or malformed."""
    try:
        with open(file, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"{os.fspath(file)} line {exc.lineno}: not valid JSON ({exc.msg}); the file is truncated or corrupted"
        ) from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"{os.fspath(file)}: not a UTF-8 text file ({exc.reason})") from None


def _weight_files(folder: str) -> list[str]:
    """The weight files of a local checkpoint folder (every shard of a sharded one); [] if it has none."""
    for name in _WEIGHT_FILES:
        file = os.path.join(folder, name)
        if not os.path.isfile(file):
            continue
        if not name.endswith(".index.json"):
            return [file]
        index = read_json_file(file)
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict):
            raise ValueError(f"{file} has no weight_map: the shard index is truncated or corrupted")
        return [os.path.join(folder, shard) for shard in sorted(set(weight_map.values()))]
    return []


def check_checkpoint_files(folder: str | os.PathLike) -> None:
    """``ValueError`` naming the file unless a local checkpoint folder has a readable ``config.json`` and
    complete weight files (safetensors headers checked against the file sizes: a cut file is caught here,
    before any weights load). Reads headers only."""
    from safetensors import SafetensorError, safe_open

    folder = os.fspath(folder)
    config_file = os.path.join(folder, "config.json")
    if not os.path.isfile(config_file):
        raise ValueError(
            f"checkpoint folder {folder!r} has no config.json: it is not a complete model checkpoint "
            "(save_pretrained writes config.json next to the weights)"
        )
    read_json_file(config_file)
    files = _weight_files(folder)
    if not files:
        raise ValueError(
            f"checkpoint folder {folder!r} has no weights: expected one of {', '.join(_WEIGHT_FILES)}"
        )
    for file in files:
        if not os.path.isfile(file):
            raise ValueError(f"checkpoint folder {folder!r}: shard {os.path.basename(file)} is missing")
        if file.endswith(".safetensors"):
            try:
                with safe_open(file, framework="pt"):
                    pass
            except (SafetensorError, OSError) as exc:
                raise ValueError(
                    f"{file} is truncated or corrupted ({str(exc).strip().splitlines()[0]}): the checkpoint "
                    "cannot be loaded; copy or save it again"
                ) from None


def _names(keys: Sequence[str], limit: int = 8) -> str:
    keys = sorted(keys)
    return ", ".join(keys[:limit]) + (f", ... ({len(keys)} in all)" if len(keys) > limit else "")


def _common_prefix(missing: Sequence[str], unexpected: Sequence[str]) -> str | None:
    """The one prefix that makes every unexpected key a missing one (a wrapper's keys), else None."""
    needed = set(missing)
    prefixes = {key[: -len(name)] for name in needed for key in unexpected if key.endswith(f".{name}")}
    if len(prefixes) != 1:
        return None
    prefix = prefixes.pop()
    return prefix if all(key.removeprefix(prefix) in needed for key in unexpected) else None


def load_backbone(auto_class: type, path: str | os.PathLike, **model_kwargs: Any) -> PreTrainedModel:
    """``auto_class.from_pretrained(path, **model_kwargs)``, refused unless every tensor of the model was in
    the checkpoint with its shape.

    ``ValueError`` naming the checkpoint's weight files and the missing, mismatched and unexpected tensors when
    any model tensor is missing or of another shape (it would otherwise start random: a renamed tensor, a
    wrapper's ``state_dict()`` with prefixed keys). Tensors tied to another (the decoder to the input
    embeddings) are not counted as missing: transformers ties them. Extra tensors alone (e.g. a pre-training
    checkpoint's pooler) are only logged, as every model weight then loaded.
    """
    path = os.fspath(path)
    model_kwargs.pop("output_loading_info", None)
    files = _weight_files(path) if os.path.isdir(path) else []
    where = ", ".join(files) if files else path
    try:
        model, info = auto_class.from_pretrained(path, output_loading_info=True, **model_kwargs)
    except RuntimeError as exc:
        if "ignore_mismatched_sizes" not in str(exc):
            raise
        # transformers refuses tensors of another shape itself, after logging a report of them.
        raise ValueError(
            f"checkpoint {where} does not match the model its config.json describes: tensors of another shape "
            "(listed in the loading report above)"
        ) from None
    missing = sorted(info.get("missing_keys") or ())
    mismatched = [key for key, *_ in info.get("mismatched_keys") or ()]
    unexpected = sorted(info.get("unexpected_keys") or ())
    errors = list(info.get("error_msgs") or ())
    if missing or mismatched or errors:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)} tensor(s) the model needs: {_names(missing)}")
        if mismatched:
            parts.append(f"{len(mismatched)} of another shape: {_names(mismatched)}")
        if unexpected:
            parts.append(f"{len(unexpected)} tensor(s) the model does not have: {_names(unexpected)}")
        parts.extend(errors[:2])
        prefix = _common_prefix(missing, unexpected)
        hint = (
            f"the file's keys carry the prefix {prefix!r}: it is a wrapper's state_dict(), not the model's"
            if prefix
            else "a wrapper's state_dict() has prefixed keys"
        )
        raise ValueError(
            f"checkpoint {where} does not match {type(model).__name__} ({'; '.join(parts)}): those weights would "
            f"start random. A checkpoint must be written by save_pretrained ({hint})"
        )
    if unexpected:
        logger.warning(
            "checkpoint %s holds %d tensor(s) %s has no use for (ignored; every model tensor loaded): %s",
            where,
            len(unexpected),
            type(model).__name__,
            _names(unexpected),
        )
    return model


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
