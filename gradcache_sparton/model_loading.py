"""From a model's name to the objects that encode with it: where the name points (a local folder, a shipped
model, a hub id), the tokenizer and the :class:`~gradcache_sparton.modeling.SpladeEncoder` it names (or a
BERT shape with random weights), LoRA adapters on that encoder, and the lengths to encode a checkpoint's
texts at. The training, evaluation, export and mining jobs all build their models here.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from transformers import AutoConfig, AutoTokenizer, BertConfig, PreTrainedTokenizerBase

from gradcache_sparton.arguments import INIT_DECODER_BIAS_SIGMAS, ModelArguments
from gradcache_sparton.modeling import (
    QUERY_ENCODER_FIELD,
    QUERY_TABLE_NAME,
    InferenceFreeEncoder,
    LiLsrTable,
    QueryTable,
    SpladeEncoder,
    check_checkpoint_files,
    check_max_length,
    idf_weights,
    li_lsr_table_from,
    load_query_encoder,
    position_limit,
    read_splade_config,
)
from gradcache_sparton.primitives.query_encoders import SIAMESE_QUERY_ENCODER
from gradcache_sparton.resources import SHIPPED_MODELS, default_tokenizer_path, shipped_model_path

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = [
    "DEFAULT_MAX_LENGTHS",
    "add_lora_adapters",
    "build_encoder",
    "build_tokenizer",
    "checkpoint_max_lengths",
    "looks_like_local_path",
    "resolve_model_location",
]

logger = logging.getLogger(__name__)

# Max lengths for a checkpoint that does not say what it was trained with (SPLADE's usual query length;
# most BEIR documents fit in 256 tokens).
DEFAULT_MAX_LENGTHS = {"query_max_length": 32, "document_max_length": 256}
# Files whose presence in a checkpoint folder means it carries its own tokenizer.
_TOKENIZER_FILES = ("tokenizer.json", "vocab.txt", "tokenizer_config.json")


def resolve_model_location(name: str, *, argument: str = "model_name_or_path") -> str:
    """Where ``model_name_or_path`` / ``tokenizer_name`` points: a local folder as given (``~`` expanded), a
    shipped model's name (:data:`~gradcache_sparton.resources.SHIPPED_MODELS`) as its folder in the package,
    anything else as a hub id (downloaded where the network allows; ``HF_HUB_OFFLINE=1`` forbids it).

    ``ValueError`` naming ``argument`` at once, without touching the network, for a name that looks like a
    local path (:func:`looks_like_local_path`) but is no folder, and for a hub id that is not in the local
    hub cache while ``HF_HUB_OFFLINE`` is set or the hub cannot be reached (a 3 s connection check, instead
    of the hub client's minute of retries).
    """
    path = Path(name).expanduser()
    if path.is_dir():
        return str(path) if name.startswith("~") else name
    shipped = shipped_model_path(name)
    if shipped is not None:
        return str(shipped)
    if path.exists():
        raise ValueError(f"{argument} {name!r} is a file; give the checkpoint's folder")
    if looks_like_local_path(name):
        raise ValueError(f"{argument} {name!r}: no such folder{_nearby_checkpoints(path)}")
    if "/" in name:
        logger.info("%s %r is no local folder: trying it as a hub id.", argument, name)
    _check_hub_reachable(argument, name)
    return name


def looks_like_local_path(name: str) -> bool:
    """Whether ``name`` can only mean a local path, not a hub id (``owner/name``): it starts with '.', '~'
    or '/', holds a backslash, more than one '/' or a trailing one, or its first part is an existing folder
    (``outputs/run`` once ``outputs/`` exists)."""
    if name.startswith((".", "~", "/")) or "\\" in name or name.count("/") > 1 or name.endswith("/"):
        return True
    return "/" in name and Path(name.split("/", 1)[0]).is_dir()


def _nearby_checkpoints(path: Path) -> str:
    """A hint naming the checkpoint folders (holding a ``config.json``) beside ``path``, newest first."""
    parent = path.parent
    if not parent.is_dir():
        return f" (nor its parent {str(parent)!r})"
    found = sorted(
        (
            child
            for child in parent.iterdir()
            if (child / "config.json").is_file() and any(child.glob("*.safetensors"))
        ),
        key=lambda child: child.stat().st_mtime,
        reverse=True,
    )
    if not found:
        return f" ({str(parent)!r} holds no checkpoint folder)"
    names = ", ".join(str(child) for child in found[:5])
    return f"; checkpoints in {str(parent)!r}: {names}{', ...' if len(found) > 5 else ''}"


def _check_hub_reachable(argument: str, name: str) -> None:
    """``ValueError`` at once if the hub id ``name`` is not cached locally and cannot be downloaded now."""
    from huggingface_hub import constants, try_to_load_from_cache

    if isinstance(try_to_load_from_cache(name, "config.json"), str):
        return  # cached: loads without the network (with HF_HUB_OFFLINE=1 too)
    shipped = f"not a local folder, not a shipped model {list(SHIPPED_MODELS)}"
    if constants.HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE"):
        raise ValueError(f"{argument} {name!r} is {shipped}, and HF_HUB_OFFLINE is set: no hub download")
    if any(os.environ.get(proxy) for proxy in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return  # the proxy decides what is reachable; the hub client reports its own error
    import socket
    from urllib.parse import urlsplit

    endpoint = urlsplit(constants.ENDPOINT)
    host, port = (
        endpoint.hostname or "huggingface.co",
        endpoint.port or (443 if endpoint.scheme == "https" else 80),
    )
    try:
        socket.create_connection((host, port), timeout=3).close()
    except OSError as exc:
        raise ValueError(
            f"{argument} {name!r} is {shipped}, and the hub ({host}) cannot be reached ({exc}); "
            "set HF_HUB_OFFLINE=1 to work offline"
        ) from None


def _load_error(argument: str, name: str, exc: Exception) -> ValueError:
    first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if Path(name).expanduser().is_dir() or shipped_model_path(name) is not None:
        return ValueError(f"{argument} {name!r} could not be loaded: {first_line}")
    return ValueError(
        f"{argument} {name!r} is not a local folder, not a shipped model {list(SHIPPED_MODELS)} and could not be "
        f"loaded from the hub{' (HF_HUB_OFFLINE is set)' if os.environ.get('HF_HUB_OFFLINE') else ''}: {first_line}"
    )


def build_tokenizer(model_args: ModelArguments) -> PreTrainedTokenizerBase:
    """The tokenizer named by ``tokenizer_name``, else the checkpoint's own, else the shipped one."""
    named = model_args.tokenizer_name or model_args.model_name_or_path
    argument = "tokenizer_name" if model_args.tokenizer_name is not None else "model_name_or_path"
    if named is None:
        return AutoTokenizer.from_pretrained(default_tokenizer_path())
    location = resolve_model_location(named, argument=argument)
    folder = Path(location)
    if argument == "model_name_or_path" and folder.is_dir():
        has_tokenizer = any((folder / name).exists() for name in _TOKENIZER_FILES)
        location = location if has_tokenizer else str(default_tokenizer_path())
    try:
        return AutoTokenizer.from_pretrained(location)
    except OSError as exc:
        raise _load_error(argument, named, exc) from None


def build_encoder(
    model_args: ModelArguments,
    tokenizer: PreTrainedTokenizerBase,
    *,
    idf_documents: Iterable[str] | None = None,
) -> SpladeEncoder:
    """Load the checkpoint (local folder, shipped name or hub id), or build the named BERT shape with random
    weights over the tokenizer's vocab. A checkpoint keeps the options it was saved with (splade_config.json)
    unless ``mask_special_tokens`` is given (True: mask the tokenizer's special ids, False: none) or
    ``prefix_length`` / ``bidirectional`` / ``echo`` / ``activation_function`` are.

    The query encoder (docs/inference_free.md): ``model_args.query_encoder`` if given, else the one the
    checkpoint folder records (:func:`~gradcache_sparton.modeling.load_query_encoder`; a folder from before
    the record: its query table's if it has one, else ``"splade"``). The flag decides this model's query
    encoder and the folder's table is where a table starts: ``"splade"`` gives the document encoder
    (siamese); ``"idf"`` / ``"learned_idf"`` an :class:`~gradcache_sparton.modeling.InferenceFreeEncoder`
    whose table is frozen / trained, the checkpoint's, else the IDF of ``idf_documents`` (the training
    documents; ``ValueError`` if there are none); ``"li_lsr"`` a
    :class:`~gradcache_sparton.modeling.LiLsrTable`, the checkpoint's, else fitted to that table over the
    document encoder's input embeddings. A Li-LSR checkpoint read as ``idf`` / ``learned_idf`` gives the
    table it induces. ``ValueError`` naming the files, before any weights load, for a folder whose recorded
    query encoder its files contradict."""
    saved, table = _saved_query_encoder(model_args.model_name_or_path)
    query_encoder = model_args.query_encoder or saved
    if query_encoder != saved:
        logger.info("query_encoder=%r over a checkpoint whose query encoder is %r.", query_encoder, saved)
    if table is None and saved != SIAMESE_QUERY_ENCODER and query_encoder != SIAMESE_QUERY_ENCODER:
        name = model_args.model_name_or_path
        raise ValueError(
            f"model_name_or_path {name!r} (a hub id) records query_encoder {saved!r}, whose "
            f"{QUERY_TABLE_NAME} is read from a local folder only: download the repository (e.g. `hf download "
            f"{name} --local-dir DIR`) and give DIR, or pass query_encoder='splade' for its document encoder"
        )
    encoder = _build_document_encoder(model_args, tokenizer)
    if query_encoder == SIAMESE_QUERY_ENCODER:
        return encoder
    if table is None:
        if idf_documents is None:
            raise ValueError(
                f"query_encoder={query_encoder!r} needs a query table: model_name_or_path has no "
                "query_table.safetensors and there are no training documents to compute the IDF from "
                "(`gradcache-sparton idf` writes one)"
            )
        table = QueryTable(idf_weights(idf_documents, tokenizer), special_token_ids=tokenizer.all_special_ids)
        logger.info("Query table: the IDF of the training documents.")
    if query_encoder == "li_lsr" and not isinstance(table, LiLsrTable):
        table, fit = li_lsr_table_from(table, encoder.model.get_input_embeddings().weight)
        logger.info(
            "Query table: Li-LSR over the input embeddings, fitted to the IDF over %d tokens (RMSE %.3f, "
            "correlation %.3f).",
            fit["fit_tokens"],
            fit["fit_rmse"],
            fit["fit_correlation"],
        )
    elif query_encoder != "li_lsr" and isinstance(table, LiLsrTable):
        logger.info(
            "query_encoder=%r: the checkpoint's Li-LSR table is used as the fixed table it induces.",
            query_encoder,
        )
        table = QueryTable(table.weight.detach(), special_token_ids=table.special_token_ids)
    table.requires_grad_(query_encoder != "idf")
    return InferenceFreeEncoder.from_document_encoder(encoder, table)


def _saved_query_encoder(model_name_or_path: str | None) -> tuple[str, QueryTable | None]:
    """The query encoder of the checkpoint ``model_name_or_path`` names and its table: a local folder's (a
    shipped model's too) as :func:`~gradcache_sparton.modeling.load_query_encoder` reads them, a hub
    checkpoint's as its ``splade_config.json`` records it (its table not downloaded: None), a model built
    at random ``"splade"``."""
    if model_name_or_path is None:
        return SIAMESE_QUERY_ENCODER, None
    location = resolve_model_location(model_name_or_path)
    if Path(location).is_dir():
        return load_query_encoder(location)
    return read_splade_config(location).get(QUERY_ENCODER_FIELD, SIAMESE_QUERY_ENCODER), None


def _build_document_encoder(model_args: ModelArguments, tokenizer: PreTrainedTokenizerBase) -> SpladeEncoder:
    """:func:`build_encoder`'s SPLADE encoder (the documents' side of an inference-free model)."""
    masked = {True: list(tokenizer.all_special_ids), False: [], None: None}
    special = masked[model_args.mask_special_tokens]
    if model_args.model_name_or_path is not None:
        location = resolve_model_location(model_args.model_name_or_path)
        try:
            encoder = SpladeEncoder.from_pretrained(
                location, special_token_ids=special, **model_args.encoder_options()
            )
        except OSError as exc:
            raise _load_error("model_name_or_path", model_args.model_name_or_path, exc) from None
    else:
        config = BertConfig(
            vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, **model_args.backbone_shape()
        )
        encoder = SpladeEncoder.from_config(
            config, special_token_ids=special or (), **model_args.encoder_options()
        )
        bias = model_args.init_decoder_bias
        if bias is None:  # logits ~ N(0, sqrt(D) x init std) at init: start k of those below zero
            bias = -INIT_DECODER_BIAS_SIGMAS * math.sqrt(config.hidden_size) * config.initializer_range
        with torch.no_grad():
            encoder.model.get_output_embeddings().bias.fill_(bias)
    encoder.check_tokenizer(tokenizer)
    return encoder


def add_lora_adapters(encoder: SpladeEncoder, model_args: ModelArguments) -> Any:
    """Inject LoRA adapters (``model_args.lora_*``) into the encoder's backbone, in place, as
    ``peft.get_peft_model`` does; every other weight is frozen, the decoder the SPLADE head shares and the
    embeddings included, so the head's backward computes no [V, D] weight gradient.

    Returns the ``PeftModel`` (for ``save_pretrained`` and ``merge_and_unload``) and records the settings in
    ``encoder.lora`` (saved in ``splade_config.json``). ``ValueError`` naming ``lora_target_modules`` if one of
    them matches no module, names the embeddings or the decoder, or is not given for an architecture peft has
    no default for; nothing is changed then.
    """
    import peft
    from peft.utils import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING

    if model_args.lora_r < 1:
        raise ValueError(f"lora_r must be > 0 to add LoRA adapters, got {model_args.lora_r}")
    model = encoder.model
    targets = model_args.lora_target_module_names()
    if targets is None:
        targets = TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING.get(model.config.model_type)
        if targets is None:
            raise ValueError(
                f"lora_target_modules: peft has no default for {type(model).__name__} (model type "
                f"{model.config.model_type!r}): give them; its linear layers are named {_linear_names(model)}"
            )
    # peft matches a module whose name is a target or ends with "." + a target; each target must match one.
    matches = {
        target: {
            module for name, module in model.named_modules() if name == target or name.endswith(f".{target}")
        }
        for target in targets
    }
    missing = [target for target, found in matches.items() if not found]
    if missing:
        raise ValueError(
            f"lora_target_modules {missing} match no module of {type(model).__name__} (of {list(targets)}); "
            f"its linear layers are named {_linear_names(model)}"
        )
    matched = set().union(*matches.values())
    shared = {model.get_input_embeddings(), model.get_output_embeddings()}
    if matched & shared:
        raise ValueError(
            f"lora_target_modules {targets} name the embeddings or the decoder: the SPLADE head shares them "
            "and they stay frozen; target the attention or MLP layers (e.g. q_proj,v_proj)"
        )
    alpha = model_args.lora_alpha or 2 * model_args.lora_r
    config = peft.LoraConfig(
        r=model_args.lora_r,
        lora_alpha=alpha,
        lora_dropout=model_args.lora_dropout,
        target_modules=list(targets),
    )
    peft_model = peft.get_peft_model(model, config)  # in place: encoder.model now holds the adapters
    trainable, total = peft_model.get_nb_trainable_parameters()
    logger.info(
        "LoRA r=%d, alpha=%d, dropout=%g on %s: %d of %d parameters trainable (%.3f%%).",
        model_args.lora_r,
        alpha,
        model_args.lora_dropout,
        ",".join(targets),
        trainable,
        total,
        100 * trainable / total,
    )
    encoder.lora = {
        "lora_r": model_args.lora_r,
        "lora_alpha": alpha,
        "lora_dropout": model_args.lora_dropout,
        "lora_target_modules": list(targets),
    }
    return peft_model


def _linear_names(model: PreTrainedModel) -> list[str]:
    """The distinct last name parts of the model's ``nn.Linear`` layers but the decoder, sorted."""
    decoder = model.get_output_embeddings()
    return sorted(
        {
            name.rsplit(".", 1)[-1]
            for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear) and module is not decoder
        }
    )


def checkpoint_max_lengths(
    model_name_or_path: str, *, query_max_length: int | None = None, document_max_length: int | None = None
) -> tuple[int, int]:
    """(query, document) max lengths to encode a checkpoint's texts with: the given ones, else those it was
    trained with (its ``splade_config.json``), else :data:`DEFAULT_MAX_LENGTHS`; documents never shorter
    than the default 256 unless given (nor past the position table): training truncates documents to save
    time, retrieval reads them whole, and a model trained at 128 tokens ranks better at 256 (5-fold
    ``crossval`` of the default run, docs/experiments.md), so every model is compared at one length by
    default. A length not given is capped at what the model's position table holds (with a warning); a given
    one past it is an error. For a local checkpoint, its files are checked
    (:func:`~gradcache_sparton.modeling.check_checkpoint_files`) and each length against its position table,
    before any weights load: ``ValueError`` naming the length, its value and the limit."""
    location = resolve_model_location(model_name_or_path)
    trained = read_splade_config(location)
    # A local checkpoint's position table is known before any weights load (a hub one's, once loaded).
    config = None
    if Path(location).is_dir():
        check_checkpoint_files(location)
        config = AutoConfig.from_pretrained(location)
    lengths = []
    for name, given in (("query_max_length", query_max_length), ("document_max_length", document_max_length)):
        value = given if given is not None else trained.get(name) or DEFAULT_MAX_LENGTHS[name]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
        limit = position_limit(config, echo=bool(trained.get("echo"))) if config is not None else None
        if given is None and name == "document_max_length":
            value = max(value, min(DEFAULT_MAX_LENGTHS[name], limit or DEFAULT_MAX_LENGTHS[name]))
        if given is None and limit is not None and value > limit:  # what the model can read, said
            value = limit // 8 * 8  # lengths are multiples of 8, as the collator pads them
            logger.warning(
                "%s: %d tokens, what %s's position table holds (%d).", name, value, model_name_or_path, limit
            )
        if config is not None:
            check_max_length(config, name, value, echo=bool(trained.get("echo")))
        lengths.append(value)
    if query_max_length is None or document_max_length is None:
        logger.info("Encoding at query/document max lengths %d/%d tokens.", *lengths)
    return lengths[0], lengths[1]
