"""The training and evaluation jobs behind the command line, usable from Python too.

``run_training(model_args, data_args, training_args)`` builds the tokenizer, the encoder, the training
rows and the retrieval evaluator from the argument dataclasses, trains with
:class:`~gradcache_sparton.trainer.CachedSpladeTrainer`, saves a standard masked-LM checkpoint and
evaluates it. ``run_evaluation`` evaluates a saved checkpoint on a BEIR folder.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer, BertConfig, PreTrainedTokenizerBase, set_seed

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
    load_beir,
    load_training_data,
    read_corpus,
    self_supervised_pairs,
)
from gradcache_sparton.evaluation import (
    PruningBudget,
    RetrievalEvalCallback,
    SparseRetrievalEvaluator,
    check_trec_ids,
    mean_metrics,
    write_trec_run,
)
from gradcache_sparton.modeling import SpladeEncoder
from gradcache_sparton.resources import default_tokenizer_path
from gradcache_sparton.trainer import CachedSpladeTrainer, validate_run

__all__ = [
    "build_encoder",
    "build_evaluator",
    "build_tokenizer",
    "build_train_dataset",
    "run_evaluation",
    "run_training",
]

logger = logging.getLogger(__name__)

RETRIEVAL_METRICS_FILE = "retrieval_metrics.json"


def build_tokenizer(model_args: ModelArguments) -> PreTrainedTokenizerBase:
    """The tokenizer named by ``tokenizer_name``, else the checkpoint's own, else the shipped one."""
    if model_args.tokenizer_name is not None:
        return AutoTokenizer.from_pretrained(model_args.tokenizer_name, local_files_only=True)
    if model_args.model_name_or_path is not None:
        folder = Path(model_args.model_name_or_path)
        if any((folder / name).exists() for name in ("tokenizer.json", "vocab.txt", "tokenizer_config.json")):
            return AutoTokenizer.from_pretrained(folder, local_files_only=True)
    return AutoTokenizer.from_pretrained(default_tokenizer_path())


def build_encoder(model_args: ModelArguments, tokenizer: PreTrainedTokenizerBase) -> SpladeEncoder:
    """Load the local checkpoint, or build the named BERT shape with random weights over the tokenizer's vocab."""
    special = list(tokenizer.all_special_ids) if model_args.mask_special_tokens else None
    if model_args.model_name_or_path is not None:
        if not Path(model_args.model_name_or_path).is_dir():
            raise ValueError(
                f"model_name_or_path {model_args.model_name_or_path!r} is not a local folder (no hub access): "
                "give a checkpoint folder, or leave it unset and pick a config_name"
            )
        encoder = SpladeEncoder.from_pretrained(model_args.model_name_or_path, special_token_ids=special)
    else:
        config = BertConfig(
            vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, **model_args.backbone_shape()
        )
        encoder = SpladeEncoder.from_config(config, special_token_ids=special or ())
        bias = model_args.init_decoder_bias
        if bias is None:  # logits ~ N(0, sqrt(D) x init std) at init: start k of those below zero
            bias = -INIT_DECODER_BIAS_SIGMAS * math.sqrt(config.hidden_size) * config.initializer_range
        with torch.no_grad():
            encoder.model.get_output_embeddings().bias.fill_(bias)
    encoder.check_tokenizer(tokenizer)
    return encoder


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
    if data_args.eval_beir is None or data_args.eval_beir.lower() == "none":
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
) -> SparseRetrievalEvaluator:
    """A :class:`SparseRetrievalEvaluator` on a BEIR folder; ``"default"`` is the shipped dev sample (split dev)."""
    if folder == "default":
        folder, split = str(default_dev_beir_path()), "dev"
    return SparseRetrievalEvaluator(
        load_beir(folder, split=split),
        tokenizer=tokenizer,
        query_max_length=query_max_length,
        document_max_length=document_max_length,
        batch_size=batch_size,
        top_k=top_k,
        measures=measures,
    )


def run_training(
    model_args: ModelArguments, data_args: DataArguments, training_args: CachedSpladeTrainingArguments
) -> dict[str, float]:
    """Train, save the final checkpoint to ``output_dir`` and return the training + retrieval metrics."""
    # Data, run checks and evaluator first: a bad argument stops the run before the model is built.
    train_dataset = build_train_dataset(data_args, seed=training_args.seed)
    validate_run(training_args, num_train_rows=len(train_dataset))
    tokenizer = build_tokenizer(model_args)
    evaluator = build_evaluator(
        data_args,
        tokenizer,
        query_max_length=training_args.query_max_length,
        document_max_length=training_args.document_max_length,
    )
    set_seed(training_args.seed)  # the random init too, not only what the Trainer seeds later
    encoder = build_encoder(model_args, tokenizer)
    if evaluator is not None and torch.cuda.is_available() and training_args.bf16:
        evaluator.autocast_dtype = torch.bfloat16
    trainer = CachedSpladeTrainer(
        encoder, training_args, train_dataset=train_dataset, processing_class=tokenizer
    )
    if evaluator is not None and data_args.retrieval_eval_steps is not None:
        trainer.add_callback(
            RetrievalEvalCallback(evaluator, trainer=trainer, eval_steps=data_args.retrieval_eval_steps)
        )
    result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.save_model()
    metrics = dict(result.metrics)
    if evaluator is not None:
        retrieval = {f"eval_{k}": v for k, v in evaluator(trainer.model).items()}
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
    query_max_length: int = 32,
    document_max_length: int = 256,
    batch_size: int = 64,
    device: str | None = None,
    measures: Sequence[str] | None = None,
    top_k: int = 100,
    budgets: Sequence[PruningBudget] = (PruningBudget(),),
    run_prefix: str | Path | None = None,
) -> dict[str, Any]:
    """Retrieval metrics of a saved checkpoint on one or several BEIR folders (default: the shipped
    SciFact dev sample), at one or several pruning budgets.

    One folder and one budget: its metrics as a flat dict (``ndcg_at_10``, ...). Otherwise a table,
    row label -> metrics: ``<dataset>`` (or ``<dataset> <budget>``) per folder, then ``mean`` (or
    ``mean <budget>``) over the folders when there are several. A dataset is named by its folder.
    Every folder is loaded and checked, and every measure parsed, before the model is loaded. With
    ``run_prefix``, each row's TREC run is written to ``{run_prefix}.{dataset}.{budget}.trec``.
    """
    folders = [beir_path or "default"] if beir_path is None or isinstance(beir_path, str) else list(beir_path)
    if not folders:
        raise ValueError("beir_path is an empty list: give at least one BEIR folder")
    if not budgets or len({b.name for b in budgets}) != len(budgets):
        raise ValueError(f"budgets must be distinct and at least one, got {[b.name for b in budgets]}")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} but CUDA is not available here: use --device cpu")
    model_args = ModelArguments(model_name_or_path=model_name_or_path)
    tokenizer = build_tokenizer(model_args)
    evaluators: dict[str, SparseRetrievalEvaluator] = {}
    for folder in folders:
        name = "scifact-dev" if folder == "default" else "_".join(Path(folder).name.split())
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
        )
        if run_prefix is not None:
            check_trec_ids(evaluators[name].query_ids, name=f"{folder}: query")
            check_trec_ids(evaluators[name].doc_ids, name=f"{folder}: doc")
    encoder = build_encoder(model_args, tokenizer)
    encoder.to(device).eval()
    table: dict[str, dict[str, float]] = {}
    by_budget: dict[str, list[dict[str, float]]] = {}
    for name, evaluator in evaluators.items():
        for result in evaluator.evaluate(encoder, budgets=budgets):
            budget = result.budget.name
            table[name if len(budgets) == 1 else f"{name} {budget}"] = result.metrics
            by_budget.setdefault(budget, []).append(result.metrics)
            if run_prefix is not None:
                write_trec_run(f"{run_prefix}.{name}.{budget}.trec", result.run, tag=f"{name}.{budget}")
    if len(evaluators) == 1 and len(budgets) == 1:
        return next(iter(table.values()))
    if len(evaluators) > 1:
        for budget, rows in by_budget.items():
            table["mean" if len(budgets) == 1 else f"mean {budget}"] = mean_metrics(rows)
    return table
