"""The training and evaluation jobs behind the command line, usable from Python too.

``run_training(model_args, data_args, training_args)`` builds the tokenizer, the encoder, the training
rows and the retrieval evaluator from the argument dataclasses, trains with
:class:`~gradcache_sparton.trainer.CachedSpladeTrainer` (the whole backbone, or LoRA adapters only:
:func:`add_lora_adapters`), saves a standard masked-LM checkpoint and evaluates it. ``run_evaluation``
evaluates a saved checkpoint on a BEIR folder; ``run_export`` encodes a BEIR corpus with it into a seismic
or Anserini file.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from collections.abc import Sequence
from contextlib import nullcontext
from itertools import islice
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase, set_seed
from transformers.trainer_utils import get_last_checkpoint

from gradcache_sparton.arguments import CachedSpladeTrainingArguments, DataArguments, ModelArguments
from gradcache_sparton.data import (
    DEFAULT_BEIR_NAME,
    BeirData,
    beir_folder,
    beir_training_pairs,
    default_train_data_path,
    iter_corpus,
    load_beir,
    load_training_data,
    read_corpus,
    self_supervised_pairs,
)
from gradcache_sparton.data.columns import text_columns_of
from gradcache_sparton.data.output import check_output_path
from gradcache_sparton.evaluation import (
    EXPORT_FORMATS,
    EncodingSettings,
    PruningBudget,
    RetrievalEvalCallback,
    SparseRetrievalEvaluator,
    check_scale,
    check_trec_ids,
    export_corpus,
    mean_metrics,
    write_trec_run,
)
from gradcache_sparton.evaluation.significance import paired_run_comparison
from gradcache_sparton.integrations.sentence_transformers import (
    sentence_transformers_can_load,
    write_sentence_transformers_files,
)
from gradcache_sparton.model_loading import (
    add_lora_adapters,
    build_encoder,
    build_tokenizer,
    checkpoint_max_lengths,
    resolve_model_location,
)
from gradcache_sparton.modeling import (
    QUERY_TABLE_NAME,
    TOKEN_WEIGHTS_NAME,
    InferenceFreeEncoder,
    QueryTable,
    SpladeEncoder,
    idf_weights,
    load_query_encoder,
    save_query_table,
    write_token_weights,
)
from gradcache_sparton.primitives.query_encoders import INFERENCE_FREE_QUERY_ENCODERS
from gradcache_sparton.run_checks import validate_run
from gradcache_sparton.run_state import TrainingStopped, output_dir_lock
from gradcache_sparton.trainer import CachedSpladeTrainer

__all__ = [
    "build_evaluator",
    "build_train_dataset",
    "query_weights_file",
    "run_evaluation",
    "run_export",
    "run_idf",
    "run_training",
]

logger = logging.getLogger(__name__)

RETRIEVAL_METRICS_FILE = "retrieval_metrics.json"
# Sub-folder of output_dir where a LoRA run also saves its adapters alone (peft's format).
LORA_ADAPTER_DIR = "adapter"


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
    encoding = EncodingSettings(
        tokenizer,
        query_max_length=query_max_length,
        document_max_length=document_max_length,
        batch_size=data_args.eval_batch_size,
    )
    return SparseRetrievalEvaluator(
        _beir_data(data_args.eval_beir, data_args.eval_beir_split), encoding=encoding
    )


def _beir_data(folder: str, split: str) -> BeirData:
    """A BEIR folder's queries, corpus and ``split`` qrels; ``"default"`` is the shipped dev sample (split dev)."""
    return load_beir(beir_folder(folder, split=split), split=split)


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
        from gradcache_sparton.mining import batch_teacher_for_run

        # Before the model: the teacher's checks, its reps of every training text, its model freed.
        batch_teacher = batch_teacher_for_run(training_args, train_dataset)
        return _run_training(model_args, data_args, training_args, train_dataset, batch_teacher)


def _run_training(
    model_args: ModelArguments,
    data_args: DataArguments,
    training_args: CachedSpladeTrainingArguments,
    train_dataset: Any,
    batch_teacher: Any,
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
    idf_documents = (
        _training_documents(train_dataset)
        if model_args.query_encoder in INFERENCE_FREE_QUERY_ENCODERS
        else None
    )
    encoder = build_encoder(model_args, tokenizer, idf_documents=idf_documents)
    encoder.lora = None  # this run's record, not a loaded checkpoint's
    peft_model = add_lora_adapters(encoder, model_args) if model_args.lora_r else None
    if evaluator is not None and torch.cuda.is_available() and training_args.bf16:
        evaluator.encoding = dataclasses.replace(evaluator.encoding, autocast_dtype=torch.bfloat16)
    trainer = CachedSpladeTrainer(
        encoder,
        training_args,
        train_dataset=train_dataset,
        processing_class=tokenizer,
        batch_teacher=batch_teacher,
    )
    if evaluator is not None and data_args.retrieval_eval_steps is not None:
        trainer.add_callback(
            RetrievalEvalCallback(evaluator, trainer=trainer, eval_steps=data_args.retrieval_eval_steps)
        )
    before: dict[str, float] = {}
    before_run = None
    if evaluator is not None and data_args.eval_before_training and not training_args.resume_from_checkpoint:
        (start,) = evaluator.evaluate(trainer.model)  # the starting model
        before, before_run = {f"eval_before_{k}": v for k, v in start.metrics.items()}, start.run
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
        (end,) = evaluator.evaluate(trainer.model)
        retrieval = {**before, **{f"eval_{k}": v for k, v in end.metrics.items()}}
        if before_run is not None:  # the gain per dev query: mean, 95% bootstrap interval, p-value
            gain = paired_run_comparison(before_run, end.run, evaluator.data.qrels)
            retrieval.update({f"eval_gain_ndcg_at_10_{k}": v for k, v in gain.items()})
        trainer.log(dict(retrieval))
        metrics.update(retrieval)
        if trainer.args.should_save:
            path = Path(training_args.output_dir) / RETRIEVAL_METRICS_FILE
            path.write_text(json.dumps(retrieval, indent=2) + "\n", encoding="utf-8")
    return metrics


def _training_documents(train_dataset: Any) -> list[str]:
    """The distinct document texts of the training rows (positives and hard negatives), in first-seen order:
    the corpus an inference-free model's IDF query table is computed from when its checkpoint has none."""
    texts: dict[str, None] = {}
    for name in text_columns_of(train_dataset.column_names)[1:]:
        for value in train_dataset[name]:
            texts.update(dict.fromkeys(value if isinstance(value, list) else [value]))
    return list(texts)


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
    encoding = EncodingSettings(
        build_tokenizer(model_args),
        query_max_length=query_max_length,
        document_max_length=document_max_length,
        batch_size=batch_size,
    )
    evaluators: dict[str, SparseRetrievalEvaluator] = {}
    for folder in folders:
        name = DEFAULT_BEIR_NAME if folder == "default" else "_".join(Path(folder).name.split())
        name = name if name not in evaluators else f"{name}-{len(evaluators)}"
        evaluators[name] = SparseRetrievalEvaluator(
            _beir_data(folder, split), encoding=encoding, top_k=top_k, measures=measures, retrieval=retrieval
        )
        if run_prefix is not None:
            check_trec_ids(evaluators[name].query_ids, name=f"{folder}: query")
            check_trec_ids(evaluators[name].doc_ids, name=f"{folder}: doc")
            for budget in budgets:
                check_output_path(
                    _run_file(run_prefix, name, budget), overwrite=overwrite, suffixes=(".trec",)
                )
    encoder = build_encoder(model_args, encoding.tokenizer)
    encoding.check_encoder(encoder)
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
    if export_format not in (*EXPORT_FORMATS, "onnx"):
        raise ValueError(f"export_format must be one of {(*EXPORT_FORMATS, 'onnx')}, got {export_format!r}")
    if export_format == "onnx":
        return _export_onnx(
            model_name_or_path,
            beir_path=beir_path,
            output_file=output_file,
            document_max_length=document_max_length,
            overwrite=overwrite,
        )
    for name, value in (("batch_size", batch_size), ("chunk_size", chunk_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    check_scale(scale)
    # JSON lines, uncompressed: what export_corpus writes, and what seismic and Anserini read.
    output_file = check_output_path(output_file, overwrite=overwrite, suffixes=(".jsonl", ".json"))
    _check_query_weights_file(model_name_or_path, output_file, overwrite=overwrite)
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
    tokenizer, encoder = _load_export_model(model_name_or_path, output_file, document_max_length)
    encoder.to(device).eval()
    began = time.monotonic()
    count = export_corpus(
        encoder,
        ((document.doc_id, document.full_text) for document in iter_corpus(beir_path)),
        output_file,
        encoding=EncodingSettings(
            tokenizer, document_max_length=document_max_length, batch_size=batch_size, device=device
        ),
        export_format=export_format,
        chunk_size=chunk_size,
        scale=scale,
        total=num_documents,
    )
    seconds = time.monotonic() - began
    logger.info(
        "Exported %d documents to %s in %.1f s (%.0f docs/s).", count, output_file, seconds, count / seconds
    )
    summary = {
        "output_file": str(output_file),
        "documents": count,
        "format": export_format,
        "document_max_length": document_max_length,
        "seconds": round(seconds, 2),
    }
    summary.update(_write_query_weights(encoder, tokenizer, output_file))
    return summary


def query_weights_file(output_file: str | Path) -> Path:
    """Where ``export`` writes an inference-free model's query table beside the index file ``output_file``:
    ``corpus.jsonl`` -> ``corpus.idf.json`` (token -> weight, :func:`~gradcache_sparton.modeling.write_token_weights`)."""
    output_file = Path(output_file)
    return output_file.with_name(f"{output_file.stem}.{TOKEN_WEIGHTS_NAME}")


def _check_query_weights_file(model_name_or_path: str, output_file: Path, *, overwrite: bool) -> None:
    """An inference-free model's table goes beside the exported file (:func:`query_weights_file`): like
    ``output_file``, it must not exist unless ``overwrite``."""
    location = resolve_model_location(model_name_or_path)
    if Path(location).is_dir() and load_query_encoder(location)[0] in INFERENCE_FREE_QUERY_ENCODERS:
        check_output_path(query_weights_file(output_file), overwrite=overwrite, suffixes=(".json",))


def _load_export_model(
    model_name_or_path: str, output_file: Path, document_max_length: int
) -> tuple[PreTrainedTokenizerBase, SpladeEncoder]:
    """``export``'s model, after every check on the inputs: creates ``output_file``'s folder (``ValueError``
    where it cannot), then loads the tokenizer and the encoder and checks ``document_max_length`` against
    the encoder's positions."""
    try:
        output_file.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"output_file {str(output_file)!r}: cannot create its folder ({exc})") from None
    model_args = ModelArguments(model_name_or_path=model_name_or_path)
    tokenizer = build_tokenizer(model_args)
    model = build_encoder(model_args, tokenizer)
    model.check_max_length("document_max_length", document_max_length)
    return tokenizer, model


def _write_query_weights(
    model: SpladeEncoder, tokenizer: PreTrainedTokenizerBase, output_file: Path
) -> dict[str, str]:
    """An inference-free model's queries are looked up, not encoded: its query table goes beside the
    exported ``output_file`` (:func:`query_weights_file`); the summary's entry for it (none for other models)."""
    if not isinstance(model, InferenceFreeEncoder):
        return {}
    table_file = query_weights_file(output_file)
    write_token_weights(model.query_table, tokenizer, table_file)
    return {"query_weights_file": str(table_file)}


# Documents of the corpus that an ONNX export is checked on (fp32 and fp64 PyTorch beside onnxruntime).
ONNX_CHECK_DOCUMENTS = 32


def _export_onnx(
    model_name_or_path: str,
    *,
    beir_path: str | Path,
    output_file: str | Path,
    document_max_length: int | None,
    overwrite: bool,
) -> dict[str, Any]:
    """``run_export(export_format="onnx")``: the document encoder as an ONNX model
    (:func:`~gradcache_sparton.evaluation.onnx_export.export_onnx`), checked with onnxruntime against PyTorch
    on the first :data:`ONNX_CHECK_DOCUMENTS` documents of the corpus within the derived bound; a failed check
    removes the file and raises."""
    from gradcache_sparton.evaluation.onnx_export import check_onnx_reps, export_onnx, onnx_available

    if not onnx_available():
        raise ValueError(
            "--format onnx needs onnx, onnxscript and onnxruntime: pip install 'gradcache_sparton[onnx]'"
        )
    output_file = check_output_path(output_file, overwrite=overwrite, suffixes=(".onnx",))
    _check_query_weights_file(model_name_or_path, output_file, overwrite=overwrite)
    _, document_max_length = checkpoint_max_lengths(
        model_name_or_path, document_max_length=document_max_length
    )
    texts = [
        document.full_text for document in islice(iter_corpus(beir_folder(beir_path)), ONNX_CHECK_DOCUMENTS)
    ]
    if not texts:
        raise ValueError(
            f"beir_path {str(beir_path)!r}: its corpus holds no documents to check the export on"
        )
    tokenizer, model = _load_export_model(model_name_or_path, output_file, document_max_length)
    # An inference-free model serves its document side as ONNX, its query table as a token -> weight file.
    encoder = model.document_encoder() if isinstance(model, InferenceFreeEncoder) else model
    began = time.monotonic()
    export_onnx(encoder, output_file)
    check = check_onnx_reps(output_file, encoder, texts, tokenizer=tokenizer, max_length=document_max_length)
    if not check.passed:
        output_file.unlink()
        raise RuntimeError(
            f"the ONNX export's reps differ from PyTorch's beyond the bound ({check}): nothing was written"
        )
    logger.info("Exported the document encoder to %s (%s).", output_file, check)
    summary = {
        "output_file": str(output_file),
        "format": "onnx",
        "document_max_length": document_max_length,
        "checked_documents": check.texts,
        "max_abs_diff_to_pytorch": check.max_abs_diff_to_torch,
        "onnx_error_vs_fp64": check.onnx_error,
        "bound": check.bound,
        "seconds": round(time.monotonic() - began, 2),
    }
    summary.update(_write_query_weights(model, tokenizer, output_file))
    return summary


def run_idf(
    model_name_or_path: str, *, beir_path: str = "default", output_dir: str | Path, overwrite: bool = False
) -> dict[str, Any]:
    """Make an inference-free model: ``model_name_or_path``'s document encoder and a frozen query table holding
    the IDF of a BEIR corpus (``"default"``: the shipped SciFact dev sample) under its tokenizer.

    ``output_dir`` receives the document encoder's checkpoint and tokenizer (unless it is the model's own
    folder, which then only gains the table and its ``splade_config.json`` the ``query_encoder`` ``"idf"``),
    ``query_table.safetensors`` and ``idf.json`` (docs/inference_free.md), and where sentence-transformers has the model's equivalent (a masked LM, the
    tokenizer in the folder) its inference-free ``Router`` files (documents truncated at the checkpoint's
    ``document_max_length``, else the backbone's positions). ``ValueError`` before any work, unless
    ``overwrite``, if ``output_dir`` already has a query table or ``idf.json``, or, when it is not the model's
    own folder, holds any file (another checkpoint's would be replaced); and if the corpus is empty or
    unreadable. The table files replace a symlink in their place, never the file it points to.
    """
    output_dir = Path(output_dir)
    if output_dir.is_file():
        raise ValueError(f"output_dir {str(output_dir)!r} is a file")
    location = Path(resolve_model_location(model_name_or_path))
    own_folder = location.is_dir() and output_dir.is_dir() and location.resolve() == output_dir.resolve()
    if not overwrite:
        tables = [n for n in (QUERY_TABLE_NAME, TOKEN_WEIGHTS_NAME) if os.path.lexists(output_dir / n)]
        if tables:
            raise ValueError(
                f"output_dir {str(output_dir)!r} already has a {' and '.join(tables)}: pass overwrite=True "
                "(CLI: --overwrite)"
            )
        held = sorted(p.name for p in output_dir.iterdir()) if output_dir.is_dir() and not own_folder else []
        if held:
            raise ValueError(
                f"output_dir {str(output_dir)!r} is not the model's folder and holds files ({', '.join(held[:5])}"
                f"{', ...' if len(held) > 5 else ''}) that the document encoder's would replace: give a new or "
                "empty folder, the model's own folder (only the table files and its query encoder's record are added), or overwrite=True (CLI: "
                "--overwrite)"
            )
    beir_path = beir_folder(beir_path)
    texts = [document.full_text for document in iter_corpus(beir_path)]  # every line checked before the model
    if not texts:
        raise ValueError(f"beir_path {str(beir_path)!r}: its corpus holds no documents")
    model_args = ModelArguments(model_name_or_path=model_name_or_path, query_encoder="splade")
    tokenizer = build_tokenizer(model_args)
    encoder = build_encoder(model_args, tokenizer)  # the document side (a table the model had is replaced)
    table = QueryTable(idf_weights(texts, tokenizer), special_token_ids=tokenizer.all_special_ids)
    inference_free = InferenceFreeEncoder.from_document_encoder(encoder, table)
    output_dir.mkdir(parents=True, exist_ok=True)
    if own_folder:  # the table, and its query encoder recorded in the folder's splade_config.json
        inference_free.write_splade_config(output_dir)
        save_query_table(table, output_dir)
    else:
        inference_free.save_pretrained(output_dir, tokenizer=tokenizer)
    write_token_weights(table, tokenizer, output_dir / TOKEN_WEIGHTS_NAME)
    has_tokenizer = any((output_dir / name).is_file() for name in ("tokenizer_config.json", "vocab.txt"))
    if has_tokenizer and sentence_transformers_can_load(inference_free):
        length = (
            encoder.document_max_length or getattr(encoder.config, "max_position_embeddings", None) or 512
        )
        write_sentence_transformers_files(output_dir, encoder=inference_free, max_seq_length=length)
    logger.info("Query table: the IDF of %d documents, written to %s.", len(texts), output_dir)
    return {"output_dir": str(output_dir), "documents": len(texts), "vocab_size": table.vocab_size}
