"""The training and evaluation jobs behind the command line, usable from Python too.

``run_training(model_args, data_args, training_args)`` builds the tokenizer, the encoder, the training
rows and the retrieval evaluator from the argument dataclasses, trains with
:class:`~gradcache_sparton.trainer.CachedSpladeTrainer` (the whole backbone, or LoRA adapters only:
:func:`add_lora_adapters`), saves a standard masked-LM checkpoint and evaluates it. ``run_evaluation``
evaluates a saved checkpoint on a BEIR folder; ``run_export`` encodes a BEIR corpus with it into a seismic
or Anserini file.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from transformers import AutoConfig, AutoTokenizer, BertConfig, PreTrainedTokenizerBase, set_seed
from transformers.trainer_utils import get_last_checkpoint

from gradcache_sparton.arguments import (
    INIT_DECODER_BIAS_SIGMAS,
    CachedSpladeTrainingArguments,
    DataArguments,
    ModelArguments,
)
from gradcache_sparton.data import (
    beir_training_pairs,
    default_dev_beir_path,
    default_train_data_path,
    iter_corpus,
    load_beir,
    load_training_data,
    read_corpus,
    self_supervised_pairs,
)
from gradcache_sparton.data.columns import text_columns_of
from gradcache_sparton.evaluation import (
    EXPORT_FORMATS,
    PruningBudget,
    RetrievalEvalCallback,
    SparseRetrievalEvaluator,
    check_trec_ids,
    export_corpus,
    mean_metrics,
    write_trec_run,
)
from gradcache_sparton.mining import check_output_path
from gradcache_sparton.modeling import (
    SpladeEncoder,
    check_checkpoint_files,
    check_max_length,
    position_limit,
    read_splade_config,
)
from gradcache_sparton.resources import SHIPPED_MODELS, default_tokenizer_path, shipped_model_path
from gradcache_sparton.run_state import TrainingStopped, output_dir_lock
from gradcache_sparton.trainer import CachedSpladeTrainer, validate_run

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = [
    "add_lora_adapters",
    "beir_folder",
    "build_encoder",
    "build_evaluator",
    "build_tokenizer",
    "build_train_dataset",
    "checkpoint_max_lengths",
    "looks_like_local_path",
    "resolve_model_location",
    "run_evaluation",
    "run_export",
    "run_training",
]

logger = logging.getLogger(__name__)

RETRIEVAL_METRICS_FILE = "retrieval_metrics.json"
# Sub-folder of output_dir where a LoRA run also saves its adapters alone (peft's format).
LORA_ADAPTER_DIR = "adapter"
# Max lengths for a checkpoint that does not say what it was trained with (SPLADE's usual query length;
# most BEIR documents fit in 256 tokens).
DEFAULT_MAX_LENGTHS = {"query_max_length": 32, "document_max_length": 256}
# How a table and messages name the shipped dev sample (beir_path "default").
DEFAULT_BEIR_NAME = "scifact-dev"
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


def build_encoder(model_args: ModelArguments, tokenizer: PreTrainedTokenizerBase) -> SpladeEncoder:
    """Load the checkpoint (local folder, shipped name or hub id), or build the named BERT shape with random
    weights over the tokenizer's vocab. A checkpoint keeps the options it was saved with (splade_config.json)
    unless ``mask_special_tokens`` asks for masking or ``prefix_length`` / ``bidirectional`` / ``echo``
    are given."""
    special = list(tokenizer.all_special_ids) if model_args.mask_special_tokens else None
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
    ``encoder.lora`` (saved in ``splade_config.json``). ``ValueError`` naming ``lora_target_modules`` if it
    matches no module, names the embeddings or the decoder, or is not given for an architecture peft has
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
    # peft matches a module whose name is a target or ends with "." + a target.
    matched = {
        module
        for name, module in model.named_modules()
        if any(name == target or name.endswith(f".{target}") for target in targets)
    }
    if not matched:
        raise ValueError(
            f"lora_target_modules {targets} match no module of {type(model).__name__}; its linear layers are "
            f"named {_linear_names(model)}"
        )
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


def build_train_dataset(data_args: DataArguments, *, seed: int) -> Any:
    """Training rows from every source given (concatenated), or the shipped SciFact sample."""
    import datasets

    parts = []
    if data_args.uses_default_train_data:
        parts.append(load_training_data(default_train_data_path()))
    if data_args.train_data is not None:
        parts.append(load_training_data(data_args.train_data))
    if data_args.train_beir is not None:
        parts.append(beir_training_pairs(load_beir(data_args.train_beir, split=data_args.train_beir_split)))
    if data_args.self_supervised_corpus is not None:
        corpus = read_corpus(data_args.self_supervised_corpus)
        parts.append(
            self_supervised_pairs(
                [doc.text for doc in corpus], titles=[doc.title for doc in corpus], seed=seed
            )
        )
    column_sets = {tuple(part.column_names) for part in parts}
    if len(column_sets) > 1:
        raise ValueError(
            f"training sources have different columns {sorted(column_sets)}: they cannot be mixed"
        )
    dataset = parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)
    if data_args.max_train_samples is not None:
        dataset = dataset.shuffle(seed=seed).select(range(min(data_args.max_train_samples, len(dataset))))
    return dataset


def build_evaluator(
    data_args: DataArguments,
    tokenizer: PreTrainedTokenizerBase,
    *,
    query_max_length: int,
    document_max_length: int,
) -> SparseRetrievalEvaluator | None:
    """The retrieval evaluator on ``eval_beir`` ('default': the shipped dev sample; 'none': no evaluator)."""
    if not data_args.evaluates:
        return None
    return _beir_evaluator(
        data_args.eval_beir,
        data_args.eval_beir_split,
        tokenizer,
        query_max_length=query_max_length,
        document_max_length=document_max_length,
        batch_size=data_args.eval_batch_size,
    )


def _beir_evaluator(
    folder: str,
    split: str,
    tokenizer: PreTrainedTokenizerBase,
    *,
    query_max_length: int,
    document_max_length: int,
    batch_size: int,
    top_k: int = 100,
    measures: Sequence[str] | None = None,
    retrieval: str = "exhaustive",
) -> SparseRetrievalEvaluator:
    """A :class:`SparseRetrievalEvaluator` on a BEIR folder; ``"default"`` is the shipped dev sample (split dev)."""
    folder = beir_folder(folder, split=split)
    return SparseRetrievalEvaluator(
        load_beir(folder, split=split),
        tokenizer=tokenizer,
        query_max_length=query_max_length,
        document_max_length=document_max_length,
        batch_size=batch_size,
        top_k=top_k,
        measures=measures,
        retrieval=retrieval,
    )


def beir_folder(path: str | Path, *, split: str | None = None) -> str:
    """The BEIR folder ``path`` names: ``"default"`` is the shipped SciFact dev sample, whose one split is
    ``dev``; ``ValueError`` for another ``split`` there (naming the one it has), not a silent ``dev``."""
    if str(path) != "default":
        return str(path)
    if split is not None and split != "dev":
        raise ValueError(
            f"split {split!r}: the default BEIR folder (the shipped SciFact dev sample, {DEFAULT_BEIR_NAME}) has "
            "only the split 'dev'; give --beir_path a BEIR folder with qrels/" + f"{split}.tsv"
        )
    return str(default_dev_beir_path())


def checkpoint_max_lengths(
    model_name_or_path: str, *, query_max_length: int | None = None, document_max_length: int | None = None
) -> tuple[int, int]:
    """(query, document) max lengths to encode a checkpoint's texts with: the given ones, else those it was
    trained with (its ``splade_config.json``), else :data:`DEFAULT_MAX_LENGTHS`; documents never shorter
    than the default 256 unless given (nor past the position table): training truncates documents to save
    time, retrieval reads them whole, and a model trained at 128 tokens ranks better at 256 (5-fold
    ``crossval`` of the default run, docs/experiments.md), so every model is compared at one length by
    default. For a local checkpoint, its files are checked
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
        if given is None and name == "document_max_length":
            limit = position_limit(config, echo=bool(trained.get("echo"))) if config is not None else None
            value = max(value, min(DEFAULT_MAX_LENGTHS[name], limit or DEFAULT_MAX_LENGTHS[name]))
        if config is not None:
            check_max_length(config, name, value, echo=bool(trained.get("echo")))
        lengths.append(value)
    if query_max_length is None or document_max_length is None:
        logger.info("Encoding at query/document max lengths %d/%d tokens.", *lengths)
    return lengths[0], lengths[1]


def run_training(
    model_args: ModelArguments, data_args: DataArguments, training_args: CachedSpladeTrainingArguments
) -> dict[str, float]:
    """Train, save the final checkpoint to ``output_dir`` and return the training + retrieval metrics
    (``eval_*``; with ``eval_before_training`` also the starting model's, ``eval_before_*``).

    Holds ``output_dir``'s lock throughout (``ValueError`` naming the other run if one holds it). A run that
    stops before ``max_steps`` (SIGTERM under ``enable_jit_checkpoint``) writes no final model or metrics and
    raises :class:`~gradcache_sparton.run_state.TrainingStopped`, which names the checkpoint to resume from.
    """
    # Data, run checks and evaluator first: a bad argument stops the run before the model is built.
    train_dataset = build_train_dataset(data_args, seed=training_args.seed)
    validate_run(
        training_args,
        num_train_rows=len(train_dataset),
        text_columns=text_columns_of(train_dataset.column_names),
    )
    # One live run per output_dir (the saving process holds the lock for all processes of the run).
    lock = output_dir_lock(training_args.output_dir) if training_args.should_save else nullcontext()
    with lock:
        return _run_training(model_args, data_args, training_args, train_dataset)


def _run_training(
    model_args: ModelArguments,
    data_args: DataArguments,
    training_args: CachedSpladeTrainingArguments,
    train_dataset: Any,
) -> dict[str, float]:
    if model_args.lora_r and (training_args.resume_from_checkpoint or training_args.load_best_model_at_end):
        raise ValueError(
            "resume_from_checkpoint and load_best_model_at_end are not supported with lora_r > 0: the Trainer's "
            "checkpoints hold the unmerged adapters under peft's tensor names, which are not loaded back; "
            "start a new run from a finished run's merged output_dir instead"
        )
    tokenizer = build_tokenizer(model_args)
    evaluator = build_evaluator(
        data_args,
        tokenizer,
        query_max_length=training_args.query_max_length,
        document_max_length=training_args.document_max_length,
    )
    set_seed(training_args.seed)  # the random init too, not only what the Trainer seeds later
    encoder = build_encoder(model_args, tokenizer)
    encoder.lora = None  # this run's record, not a loaded checkpoint's
    peft_model = add_lora_adapters(encoder, model_args) if model_args.lora_r else None
    if evaluator is not None and torch.cuda.is_available() and training_args.bf16:
        evaluator.autocast_dtype = torch.bfloat16
    trainer = CachedSpladeTrainer(
        encoder, training_args, train_dataset=train_dataset, processing_class=tokenizer
    )
    if evaluator is not None and data_args.retrieval_eval_steps is not None:
        trainer.add_callback(
            RetrievalEvalCallback(evaluator, trainer=trainer, eval_steps=data_args.retrieval_eval_steps)
        )
    before: dict[str, float] = {}
    if evaluator is not None and data_args.eval_before_training and not training_args.resume_from_checkpoint:
        before = {f"eval_before_{k}": v for k, v in evaluator(trainer.model).items()}  # the starting model
        trainer.log(dict(before))
    result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    if trainer.state.global_step < trainer.state.max_steps:  # stopped (SIGTERM under enable_jit_checkpoint)
        raise TrainingStopped(
            step=trainer.state.global_step,
            max_steps=trainer.state.max_steps,
            checkpoint=get_last_checkpoint(training_args.output_dir),
        )
    if peft_model is not None:
        if trainer.args.should_save:
            peft_model.save_pretrained(Path(training_args.output_dir) / LORA_ADAPTER_DIR)  # adapters alone
        peft_model.merge_and_unload()  # into the backbone's weights, in place: the checkpoint is a plain model
    trainer.save_model()
    metrics = dict(result.metrics)
    if evaluator is not None:
        retrieval = {**before, **{f"eval_{k}": v for k, v in evaluator(trainer.model).items()}}
        trainer.log(dict(retrieval))
        metrics.update(retrieval)
        if trainer.args.should_save:
            path = Path(training_args.output_dir) / RETRIEVAL_METRICS_FILE
            path.write_text(json.dumps(retrieval, indent=2) + "\n", encoding="utf-8")
    return metrics


def run_evaluation(
    model_name_or_path: str,
    *,
    beir_path: str | Sequence[str] | None = None,
    split: str = "dev",
    query_max_length: int | None = None,
    document_max_length: int | None = None,
    batch_size: int = 64,
    device: str | None = None,
    measures: Sequence[str] | None = None,
    top_k: int = 100,
    budgets: Sequence[PruningBudget] = (PruningBudget(),),
    retrieval: str = "exhaustive",
    run_prefix: str | Path | None = None,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Retrieval metrics of a saved checkpoint on one or several BEIR folders (default: the shipped
    SciFact dev sample), at one or several pruning budgets.

    One folder and one budget: its metrics as a flat dict (``ndcg_at_10``, ...). Otherwise a table,
    row label -> metrics: ``<dataset>`` (or ``<dataset> <budget>``) per folder, then ``mean`` (or
    ``mean <budget>``) over the folders when there are several. A dataset is named by its folder.
    Every folder is loaded and checked, and every measure parsed, before the model is loaded. With
    ``run_prefix``, each row's TREC run is written to ``{run_prefix}.{dataset}.{budget}.trec``; one that exists
    is an error before any work unless ``overwrite``.
    ``retrieval``: ``"exhaustive"`` or ``"seismic"`` (an inverted index, exact by default).
    Max lengths left None are those the checkpoint was trained with (:func:`checkpoint_max_lengths`).
    """
    device = _check_device(device)
    query_max_length, document_max_length = checkpoint_max_lengths(
        model_name_or_path, query_max_length=query_max_length, document_max_length=document_max_length
    )
    folders = [beir_path or "default"] if beir_path is None or isinstance(beir_path, str) else list(beir_path)
    if not folders:
        raise ValueError("beir_path is an empty list: give at least one BEIR folder")
    if not budgets or len({b.name for b in budgets}) != len(budgets):
        raise ValueError(f"budgets must be distinct and at least one, got {[b.name for b in budgets]}")
    model_args = ModelArguments(model_name_or_path=model_name_or_path)
    tokenizer = build_tokenizer(model_args)
    evaluators: dict[str, SparseRetrievalEvaluator] = {}
    for folder in folders:
        name = DEFAULT_BEIR_NAME if folder == "default" else "_".join(Path(folder).name.split())
        name = name if name not in evaluators else f"{name}-{len(evaluators)}"
        evaluators[name] = _beir_evaluator(
            folder,
            split,
            tokenizer,
            query_max_length=query_max_length,
            document_max_length=document_max_length,
            batch_size=batch_size,
            top_k=top_k,
            measures=measures,
            retrieval=retrieval,
        )
        if run_prefix is not None:
            check_trec_ids(evaluators[name].query_ids, name=f"{folder}: query")
            check_trec_ids(evaluators[name].doc_ids, name=f"{folder}: doc")
            for budget in budgets:
                check_output_path(
                    _run_file(run_prefix, name, budget), overwrite=overwrite, suffixes=(".trec",)
                )
    encoder = build_encoder(model_args, tokenizer)
    encoder.check_max_length("query_max_length", query_max_length)
    encoder.check_max_length("document_max_length", document_max_length)
    encoder.to(device).eval()
    table: dict[str, dict[str, float]] = {}
    by_budget: dict[str, list[dict[str, float]]] = {}
    for name, evaluator in evaluators.items():
        for result in evaluator.evaluate(encoder, budgets=budgets):
            budget = result.budget.name
            table[name if len(budgets) == 1 else f"{name} {budget}"] = result.metrics
            by_budget.setdefault(budget, []).append(result.metrics)
            if run_prefix is not None:
                write_trec_run(_run_file(run_prefix, name, result.budget), result.run, tag=f"{name}.{budget}")
    if len(evaluators) == 1 and len(budgets) == 1:
        return next(iter(table.values()))
    if len(evaluators) > 1:
        for budget, rows in by_budget.items():
            table["mean" if len(budgets) == 1 else f"mean {budget}"] = mean_metrics(rows)
    return table


def _run_file(run_prefix: str | Path, dataset: str, budget: PruningBudget) -> str:
    return f"{run_prefix}.{dataset}.{budget.name}.trec"


def _check_device(device: str | None) -> str:
    """``device``, or cuda where available, else cpu; ``ValueError`` for cuda on a machine without it."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} but CUDA is not available here: use --device cpu")
    return device


def run_export(
    model_name_or_path: str,
    *,
    beir_path: str | Path = "default",
    output_file: str | Path,
    export_format: str = "seismic",
    document_max_length: int | None = None,
    batch_size: int = 64,
    chunk_size: int = 4096,
    scale: float = 100.0,
    device: str | None = None,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Encode the corpus of a BEIR folder with a saved checkpoint and write it for an inverted index
    (:func:`~gradcache_sparton.evaluation.export_corpus`: ``seismic`` or ``anserini`` JSON lines); returns
    a summary (file, documents, format, max length, seconds).

    ``beir_path`` ``"default"`` is the shipped SciFact dev sample's corpus. Everything is checked before the
    model is loaded: the format, the corpus (every line), that
    ``output_file`` ends in ``.jsonl`` or ``.json`` and does not exist (unless ``overwrite``), and that
    its folder can be created. The document max length defaults to the one the checkpoint was trained
    with.
    """
    if export_format not in EXPORT_FORMATS:
        raise ValueError(f"export_format must be one of {EXPORT_FORMATS}, got {export_format!r}")
    for name, value in (("batch_size", batch_size), ("chunk_size", chunk_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if not scale > 0:
        raise ValueError(f"scale must be > 0, got {scale!r}")
    # JSON lines, uncompressed: what export_corpus writes, and what seismic and Anserini read.
    output_file = check_output_path(output_file, overwrite=overwrite, suffixes=(".jsonl", ".json"))
    device = _check_device(device)
    _, document_max_length = checkpoint_max_lengths(
        model_name_or_path, document_max_length=document_max_length
    )
    beir_path = beir_folder(beir_path)
    # A first streaming pass checks every line and counts the documents; the export streams a second one:
    # memory stays one chunk of texts and reps whatever the corpus size.
    num_documents = sum(1 for _ in iter_corpus(beir_path))
    if num_documents == 0:
        raise ValueError(f"beir_path {str(beir_path)!r}: its corpus holds no documents")
    try:
        output_file.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"output_file {str(output_file)!r}: cannot create its folder ({exc})") from None
    model_args = ModelArguments(model_name_or_path=model_name_or_path)
    tokenizer = build_tokenizer(model_args)
    encoder = build_encoder(model_args, tokenizer)
    encoder.check_max_length("document_max_length", document_max_length)
    encoder.to(device).eval()
    began = time.monotonic()
    count = export_corpus(
        encoder,
        ((document.doc_id, document.full_text) for document in iter_corpus(beir_path)),
        output_file,
        tokenizer=tokenizer,
        export_format=export_format,
        max_length=document_max_length,
        batch_size=batch_size,
        chunk_size=chunk_size,
        scale=scale,
        device=device,
        total=num_documents,
    )
    seconds = time.monotonic() - began
    logger.info(
        "Exported %d documents to %s in %.1f s (%.0f docs/s).", count, output_file, seconds, count / seconds
    )
    return {
        "output_file": str(output_file),
        "documents": count,
        "format": export_format,
        "document_max_length": document_max_length,
        "seconds": round(seconds, 2),
    }
