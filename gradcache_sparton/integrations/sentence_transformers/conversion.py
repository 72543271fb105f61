"""A SPLADE ``SparseEncoder`` converted in place to compute its reps through the fused head, and the
engine's view of it.

Legend: B batch, S sequence, D hidden, V vocabulary.

Two layouts convert: the siamese SPLADE model (a fill-mask ``Transformer`` then ``SpladePooling``) and the
inference-free one, a ``Router`` whose ``"query"`` route is a ``SparseStaticEmbedding`` (one weight per
token, no transformer) and whose ``"document"`` route is that same SPLADE pair. :func:`use_sparton_head`
makes the model's forward compute the same [B, V] reps through the Sparton head from the hidden states
before the decoder, never forming the [B, S, V] logits (on the document route only; the query route runs
as sentence-transformers runs it, its weights trained or frozen as the module says); the model keeps its
type, modules, parameters and save format. :func:`as_rep_encoder` gives the engine's view of it,
``encoder(**features) -> [B, V]``, routed by column for the inference-free layout.
"""

from __future__ import annotations

import contextlib
import sys
import types
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from gradcache_sparton.data.columns import QUERY_COLUMN
from gradcache_sparton.kernels import HEAD_ACTIVATIONS
from gradcache_sparton.modeling import SpladeEncoder

if TYPE_CHECKING:
    from sentence_transformers import SparseEncoder

    from gradcache_sparton.modeling import InferenceFreeEncoder

__all__ = [
    "as_rep_encoder",
    "import_sentence_transformers",
    "inference_free_encoder_from",
    "is_inference_free_sparse_encoder",
    "is_sparse_encoder",
    "sparse_encoder_backbone",
    "use_sparton_head",
    "uses_sparton_head",
]

# Feature keys the backbone reads; sentence-transformers adds bookkeeping keys ("modality", ...).
_MODEL_INPUTS = ("input_ids", "attention_mask", "token_type_ids", "position_ids")

# The instance attribute use_sparton_head sets on the model it converts (copied with it by deepcopy).
_CONVERTED_MARK = "_gradcache_sparton_head"
# On a DataParallel replica: (device type, autocast dtype) of the thread that replicated it.
_REPLICA_AUTOCAST = "_gradcache_sparton_replica_autocast"
# The routes of an inference-free Router (Router.for_query_document's names, encode_query / encode_document's tasks).
QUERY_ROUTE, DOCUMENT_ROUTE = "query", "document"


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


def _splade_modules(model: nn.Module) -> tuple[nn.Module, nn.Module, nn.Module | None]:
    """``(transformer, pooling, router)`` of a SPLADE ``SparseEncoder``: its two modules (router None), or the
    document route's two of an inference-free ``Router`` (no checks; :func:`_check_splade_modules` makes them)."""
    first = model[0]
    if hasattr(first, "sub_modules"):  # a Router
        transformer, pooling = first.sub_modules[DOCUMENT_ROUTE]
        return transformer, pooling, first
    return first, model[1], None


def _check_splade_modules(model: SparseEncoder) -> None:
    """Raise unless ``model`` is [fill-mask Transformer, SpladePooling(max, relu or log1p_relu)] over a supported
    backbone, or a ``Router`` with a ``SparseStaticEmbedding`` query route and such a pair as its document route."""
    import_sentence_transformers()
    from sentence_transformers import SparseEncoder
    from sentence_transformers.base.modules import Router, Transformer
    from sentence_transformers.sparse_encoder.modules import SparseStaticEmbedding, SpladePooling

    if not isinstance(model, SparseEncoder):
        raise TypeError(f"model must be a sentence-transformers SparseEncoder, got {type(model).__name__}")
    modules = list(model.children())
    kinds = [type(module).__name__ for module in modules]
    if len(modules) == 1 and isinstance(modules[0], Router):
        router = modules[0]
        routes = {name: [type(m).__name__ for m in route] for name, route in router.sub_modules.items()}
        query_route = list(router.sub_modules[QUERY_ROUTE]) if QUERY_ROUTE in router.sub_modules else []
        if (
            set(routes) != {QUERY_ROUTE, DOCUMENT_ROUTE}
            or router.route_mappings
            or len(query_route) != 1
            or not isinstance(query_route[0], SparseStaticEmbedding)
        ):
            raise ValueError(
                "an inference-free SparseEncoder must be a Router with exactly a 'query' route of one "
                "SparseStaticEmbedding and a 'document' route of a fill-mask Transformer and SpladePooling "
                f"(Router.for_query_document, no route_mappings), got routes {routes} and route_mappings "
                f"{router.route_mappings}"
            )
        modules = list(router.sub_modules[DOCUMENT_ROUTE])
        kinds = routes[DOCUMENT_ROUTE]
        where = "the document route"
    else:
        where = "model"
    if (
        len(modules) != 2
        or not isinstance(modules[0], Transformer)
        or not isinstance(modules[1], SpladePooling)
    ):
        raise ValueError(
            f"{where} must be a SPLADE SparseEncoder made of exactly a fill-mask Transformer (or MLMTransformer) "
            f"and SpladePooling (or a Router of such a document route and a SparseStaticEmbedding query route), "
            f"got modules {kinds}"
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
            f"the Transformer of {where} must be a text-only fill-mask Transformer on the torch backend whose "
            f"forward returns the masked-LM logits, got transformer_task={transformer.transformer_task!r}, "
            f"backend={transformer.backend!r}, modality_config={transformer.modality_config!r}"
        )
    if pooling.pooling_strategy != "max" or pooling.activation_function not in HEAD_ACTIVATIONS:
        raise ValueError(
            "the fused head computes max pooling of log1p(relu(logits)) (SPLADE v2 and later) or of "
            "log1p(log1p(relu(logits))) (activation_function='log1p_relu'), got SpladePooling("
            f"pooling_strategy={pooling.pooling_strategy!r}, activation_function={pooling.activation_function!r})"
        )
    if model.module_kwargs and any(model.module_kwargs.values()):
        raise ValueError(
            f"model passes module kwargs {model.module_kwargs!r}, which the fused forward does not read"
        )
    SpladeEncoder(transformer.auto_model)  # raises TypeError for a backbone outside the supported list


def is_inference_free_sparse_encoder(model: object) -> bool:
    """Whether ``model`` is a ``SparseEncoder`` whose one module is a ``Router`` (never imports the library):
    the inference-free layout :func:`use_sparton_head` converts (which checks its routes)."""
    if not is_sparse_encoder(model):
        return False
    modules = list(model.children())
    return len(modules) == 1 and type(modules[0]).__name__ == "Router"


def sparse_encoder_backbone(model: SparseEncoder) -> nn.Module:
    """The masked LM of a SPLADE ``SparseEncoder`` (its document route's, for the inference-free layout).

    Raises as :func:`use_sparton_head` does for another layout.
    """
    _check_splade_modules(model)
    return _splade_modules(model)[0].auto_model


def use_sparton_head(model: SparseEncoder) -> SparseEncoder:
    """Make a SPLADE ``SparseEncoder`` compute its reps with the fused Sparton head, in place.

    After the call, ``model(features)["sentence_embedding"]`` (and so ``encode``, every
    sentence-transformers loss and evaluator) equals what it was before, computed as
    ``SpladeEncoder(model[0].auto_model)(**features)``: the backbone's hidden states, its own LM
    transform, and a head sharing the decoder's weight and bias, with no [B, S, V] logits (so
    ``token_embeddings`` is no longer among the outputs). The modules, parameters, state dict and
    saved files are unchanged: a saved model is a standard ``SparseEncoder``. Calling it again is a
    no-op.

    For an inference-free ``Router`` (module doc) only the document route is fused; the query route (the
    ``SparseStaticEmbedding``) runs as before, learned or frozen as its ``frozen`` says.

    Args:
        model: a ``SparseEncoder`` made of a fill-mask ``Transformer`` (or ``MLMTransformer``) over a
            backbone listed by :func:`~gradcache_sparton.modeling.supported_masked_lm_classes`, then
            ``SpladePooling(pooling_strategy="max")`` with ``activation_function="relu"`` or ``"log1p_relu"``
            (OpenSearch v3's log1p(log1p(relu(.))), which the fused head computes as such); or of one
            ``Router`` with a ``"query"`` route of one ``SparseStaticEmbedding`` and a ``"document"`` route of
            those two.

    Returns:
        ``model`` itself.

    Raises:
        TypeError: not a ``SparseEncoder``, or an unsupported backbone class.
        ValueError: other modules or routes, sum pooling, module kwargs.
    """
    if uses_sparton_head(model):
        return model
    _check_splade_modules(model)
    transformer, pooling, _ = _splade_modules(model)
    if pooling.embedding_dimension is None:  # what SpladePooling's own first forward records
        pooling.embedding_dimension = transformer.auto_model.get_output_embeddings().out_features
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
    declares forward kwargs). For a ``Router``, its ``task`` / ``modality`` (keyword or feature, as the
    Router reads them) pick the route: the document route is fused, any other runs as sentence-transformers
    runs it.
    """
    transformer, pooling, router = _splade_modules(self)
    learned_query_weight = None
    if router is not None:
        task = kwargs.get("task", input.get("task"))
        modality = kwargs.get("modality", input.get("modality"))
        if router._resolve_route(task=task, modality=modality) != DOCUMENT_ROUTE:
            return type(self).forward(self, input, **kwargs)  # the query route, unchanged
        learned_query_weight = router.sub_modules[QUERY_ROUTE][0].weight
    if "cu_seq_lens_q" in input:
        raise ValueError(
            "the fused head needs padded [B, S] inputs, got flattened (unpadded) ones: set "
            "the fill-mask Transformer's unpad_inputs = False"
        )
    modality = input.get("modality", "text")
    if modality != "text":
        raise ValueError(f"the fused head encodes text only, got modality {modality!r}")
    # Built per call: it holds no state, only the backbone's own modules and parameters, so it can
    # never go stale (device moves, dtype casts, re-tied decoders).
    encoder = SpladeEncoder(
        transformer.auto_model,
        special_token_ids=getattr(pooling, "special_token_ids", ()),
        activation_function=pooling.activation_function,
    )
    with _replica_autocast(self):
        reps = encoder(**{key: input[key] for key in _MODEL_INPUTS if key in input})  # [B, V]
    if learned_query_weight is not None and learned_query_weight.requires_grad and torch.is_grad_enabled():
        # Adds exactly 0, but the backward reaches the learned query weights: under DDP the last replayed
        # mini-batch (a document one) then synchronises their gradient too (InferenceFreeEncoder does the same).
        reps = reps + learned_query_weight[:1].sum() * 0  # [B, V] + [] -> [B, V]
    input["sentence_embedding"] = reps
    return input


def _replica_autocast(model: nn.Module) -> contextlib.AbstractContextManager[None]:
    """The caller's autocast dtype again, in a DataParallel replica's thread where autocast is on (else
    nothing): see :func:`_replicate_with_own_forward`."""
    kept = model.__dict__.get(_REPLICA_AUTOCAST)
    if kept is None or not torch.is_autocast_enabled(kept[0]):
        return contextlib.nullcontext()
    return torch.autocast(kept[0], dtype=kept[1])


def inference_free_encoder_from(model: SparseEncoder) -> InferenceFreeEncoder:
    """Our :class:`~gradcache_sparton.modeling.InferenceFreeEncoder` over an inference-free ``SparseEncoder``
    (module doc): the document route's masked LM (shared, not copied) and a
    :class:`~gradcache_sparton.modeling.QueryTable` holding a copy of the ``SparseStaticEmbedding``'s weights
    (frozen as it is). ``model(**features, column=...)`` then gives ``encode_query`` / ``encode_document``'s
    reps (queries tokenized with special tokens, whose positions the table drops); ``save_pretrained`` writes
    our format. Truncation lengths are kept: ``query_max_length`` is the query tokenizer's
    ``model_max_length`` plus the special tokens our tokenization adds, ``document_max_length`` the
    Transformer's ``max_seq_length``.

    Raises:
        TypeError / ValueError: as :func:`use_sparton_head` for another layout; also for a siamese model.
    """
    _check_splade_modules(model)
    transformer, pooling, router = _splade_modules(model)
    if router is None:
        raise ValueError(
            "model is a siamese SparseEncoder (no Router with a SparseStaticEmbedding query route): load it "
            "with SpladeEncoder.from_pretrained, or build a query table with `gradcache-sparton idf`"
        )
    from gradcache_sparton.modeling import InferenceFreeEncoder, QueryTable

    static = router.sub_modules[QUERY_ROUTE][0]
    tokenizer = static.tokenizer
    table = QueryTable(
        static.weight.detach(), special_token_ids=tokenizer.all_special_ids, frozen=bool(static.frozen)
    )
    encoder = InferenceFreeEncoder(
        transformer.auto_model,
        query_table=table,
        special_token_ids=tuple(getattr(pooling, "special_token_ids", ())),
        activation_function=pooling.activation_function,
    )
    query_length = getattr(tokenizer, "model_max_length", None)
    if isinstance(query_length, int) and query_length < 1_000_000:  # tokenizers without a limit say ~1e30
        encoder.query_max_length = query_length + tokenizer.num_special_tokens_to_add(pair=False)
    encoder.document_max_length = transformer.max_seq_length
    return encoder


class _RepEncoder(nn.Module):
    """``encoder(**features) -> [B, V]`` over a ``SparseEncoder`` (or its DDP / compiled wrapper)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, **features: Tensor) -> Tensor:
        return self.model(dict(features))["sentence_embedding"]  # [B, V]


class _RoutedRepEncoder(nn.Module):
    """``encoder(**features, column=name) -> [B, V]`` over an inference-free ``SparseEncoder``: the query column
    through the Router's query route, every other column through its (fused) document route.

    The collator tokenizes queries with special tokens and ``SparseStaticEmbedding`` is fed queries without
    them (its own tokenization): their positions are masked out here, so a query's rep is the module's.
    """

    routes_by_column = True

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        static = _splade_modules(_unwrapped(model))[2].sub_modules[QUERY_ROUTE][0]
        self.__dict__["_static"] = static  # not a submodule: the model owns it (and its parameter)
        self.register_buffer(
            "_special_token_ids",
            torch.tensor(sorted(set(static.tokenizer.all_special_ids))),
            persistent=False,
        )

    def trains_column(self, column: str) -> bool:
        """Whether encoding ``column`` reaches a trainable parameter (the query column's: learned weights)."""
        return column != QUERY_COLUMN or self._static.weight.requires_grad

    def forward(self, *, column: str, **features: Tensor) -> Tensor:
        if column == QUERY_COLUMN:
            special = torch.isin(
                features["input_ids"], self._special_token_ids.to(features["input_ids"].device)
            )
            features = {**features, "attention_mask": features["attention_mask"] * ~special}  # [B, S]
            return self.model(dict(features), task=QUERY_ROUTE)["sentence_embedding"]  # [B, V]
        return self.model(dict(features), task=DOCUMENT_ROUTE)["sentence_embedding"]  # [B, V]


def as_rep_encoder(model: nn.Module) -> nn.Module:
    """The engine's view of a converted ``SparseEncoder``: ``encoder(**features) -> [B, V]``; for the
    inference-free ``Router``, ``encoder(**features, column=name)`` (queries by the query route, other
    columns by the document route; :mod:`~gradcache_sparton.primitives.column_routing`).

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
    return (
        _RoutedRepEncoder(model)
        if is_inference_free_sparse_encoder(_unwrapped(model))
        else _RepEncoder(model)
    )
