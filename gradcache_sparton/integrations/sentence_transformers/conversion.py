"""A SPLADE ``SparseEncoder`` converted in place to compute its reps through the fused head, and the
engine's view of it.

Legend: B batch, S sequence, D hidden, V vocabulary.

:func:`use_sparton_head` makes the model's forward compute the same [B, V] reps through the Sparton head
from the hidden states before the decoder, never forming the [B, S, V] logits; the model keeps its type,
modules, parameters and save format. :func:`as_rep_encoder` gives the engine's view of it,
``encoder(**features) -> [B, V]``.
"""

from __future__ import annotations

import contextlib
import sys
import types
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from gradcache_sparton.modeling import SpladeEncoder

if TYPE_CHECKING:
    from sentence_transformers import SparseEncoder

__all__ = [
    "as_rep_encoder",
    "import_sentence_transformers",
    "is_sparse_encoder",
    "use_sparton_head",
    "uses_sparton_head",
]

# Feature keys the backbone reads; sentence-transformers adds bookkeeping keys ("modality", ...).
_MODEL_INPUTS = ("input_ids", "attention_mask", "token_type_ids", "position_ids")

# The instance attribute use_sparton_head sets on the model it converts (copied with it by deepcopy).
_CONVERTED_MARK = "_gradcache_sparton_head"
# On a DataParallel replica: (device type, autocast dtype) of the thread that replicated it.
_REPLICA_AUTOCAST = "_gradcache_sparton_replica_autocast"


def import_sentence_transformers() -> types.ModuleType:
    """The sentence_transformers module, or an ``ImportError`` that says how to install it."""
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
    import_sentence_transformers()
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
    The replica also keeps the autocast dtype in force here, in the caller's thread: DataParallel runs
    each replica in a thread of its own and re-enters autocast there without a dtype, so a bf16 run would
    get the thread default, fp16 (autocast state is thread-local).
    """
    replica = type(self)._replicate_for_data_parallel(self)
    forward = replica.__dict__.get("forward")
    if isinstance(forward, types.MethodType) and forward.__self__ is self:
        replica.forward = types.MethodType(forward.__func__, replica)
    replica.__dict__.pop("_replicate_for_data_parallel", None)
    device_type = next(self.parameters()).device.type
    if torch.is_autocast_enabled(device_type):
        replica.__dict__[_REPLICA_AUTOCAST] = (device_type, torch.get_autocast_dtype(device_type))
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
    with _replica_autocast(self):
        input["sentence_embedding"] = encoder(**{key: input[key] for key in _MODEL_INPUTS if key in input})
    return input


def _replica_autocast(model: nn.Module) -> contextlib.AbstractContextManager[None]:
    """The caller's autocast dtype again, in a DataParallel replica's thread where autocast is on (else
    nothing): see :func:`_replicate_with_own_forward`."""
    kept = model.__dict__.get(_REPLICA_AUTOCAST)
    if kept is None or not torch.is_autocast_enabled(kept[0]):
        return contextlib.nullcontext()
    return torch.autocast(kept[0], dtype=kept[1])


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
