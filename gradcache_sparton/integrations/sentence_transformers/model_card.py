"""The README.md of a checkpoint: base model, data, training settings, metrics and how to load it."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from gradcache_sparton.modeling import InferenceFreeEncoder, SpladeEncoder

__all__ = ["model_card", "run_model_card"]


def model_card(
    *,
    encoder: SpladeEncoder,
    max_seq_length: int,
    base_model: str | None = None,
    train_data: str | None = None,
    settings: Mapping[str, object] | None = None,
    metrics: Mapping[str, float] | None = None,
) -> str:
    """A README.md for a checkpoint: base model, data, training settings, metrics and how to load it.

    ``base_model`` defaults to the backbone config's ``_name_or_path`` (empty for a random init).
    """
    base = base_model if base_model is not None else getattr(encoder.config, "_name_or_path", "") or ""
    special = list(encoder.special_token_ids)
    inference_free = isinstance(encoder, InferenceFreeEncoder)
    header = ["---", "library_name: sentence-transformers", "pipeline_tag: feature-extraction", "tags:"]
    header += [
        f"- {tag}" for tag in ("sentence-transformers", "sparse-encoder", "splade", "gradcache_sparton")
    ]
    if inference_free:
        header += ["- asymmetric", "- inference-free"]
    if base and not os.path.isabs(base):
        header.append(f"base_model: {base}")
    header.append("---")
    lines = [
        *header,
        "",
        f"# {'Inference-free ' if inference_free else ''}SPLADE sparse encoder",
        "",
        f"A SPLADE model trained with gradcache_sparton (GradCache and the fused Sparton head). It maps text to "
        f"{encoder.vocab_size}-dimensional sparse vectors, one weight per vocabulary token, scored by dot product."
        + (
            " Inference-free: documents are encoded by the SPLADE model, queries by a per-token weight table "
            "(no transformer)."
            if inference_free
            else ""
        ),
        "",
        "## Model",
        "",
        f"- Base model: {_shown_base_model(base) if base else 'randomly initialised from a config'}",
        f"- Architecture: {type(encoder.model).__name__}, max pooling of {_pooled_weight(encoder.activation_function)}",
        f"- Maximum sequence length: {max_seq_length} tokens",
        f"- Special-token positions dropped from the pooling: {special if special else 'none'}",
        "",
        "## Usage",
        "",
        "```python",
        "from sentence_transformers import SparseEncoder",
        "",
        f"model = SparseEncoder(path{', trust_remote_code=True' if special else ''})",
        *(
            [
                'query_embeddings = model.encode_query(["a query"])',
                'document_embeddings = model.encode_document(["a document"])',
            ]
            if inference_free
            else ['embeddings = model.encode(["a query", "a document"])']
        ),
        "```",
        "",
        "```python",
        f"from gradcache_sparton import {type(encoder).__name__}",
        "",
        f"encoder = {type(encoder).__name__}.from_pretrained(path)",
        "```",
    ]
    if special:
        lines += [
            "",
            "Loading in sentence-transformers needs `trust_remote_code=True` and gradcache_sparton installed: "
            "its own SpladePooling cannot drop special-token positions.",
        ]
    if train_data:
        lines += ["", "## Training data", "", train_data]
    if settings:
        lines += ["", "## Training settings", "", "| setting | value |", "|---|---|"]
        lines += [f"| {name} | {value} |" for name, value in settings.items()]
    if metrics:
        lines += ["", "## Metrics", "", "| metric | value |", "|---|---|"]
        lines += [f"| {name} | {value:.4f} |" for name, value in metrics.items()]
    return "\n".join(lines) + "\n"


def _pooled_weight(activation_function: str) -> str:
    """What the head max-pools, written out for the card."""
    if activation_function == "log1p_relu":
        return "log1p(log1p(relu(logits))) (the log1p_relu activation)"
    return "log1p(relu(logits))"


def _shown_base_model(base: str) -> str:
    """``base`` as a model card names it: a hub id as is, the package's copy of a shipped model by its name,
    another local folder by its own name; never the training machine's absolute path."""
    from gradcache_sparton.resources import SHIPPED_MODELS, shipped_model_path

    if not os.path.isabs(base):
        return base
    for name in SHIPPED_MODELS:
        if os.path.realpath(base) == os.path.realpath(shipped_model_path(name)):
            return f"{name} (shipped with gradcache_sparton)"
    return f"{os.path.basename(os.path.normpath(base))} (a local folder)"


def run_model_card(trainer: Any, encoder: SpladeEncoder) -> str:
    """:func:`model_card` for ``encoder`` as ``trainer`` (a ``CachedSpladeTrainer``) trained it so far.

    Settings come from the trainer's arguments and loss, the data line from its train dataset, the
    metrics are the latest value of each ``eval_*`` entry in ``trainer.state.log_history``.
    """
    args, state = trainer.args, trainer.state
    world = max(1, args.world_size)
    engine = getattr(trainer, "engine_settings", None)
    settings: dict[str, object] = {
        "global batch (rows per loss)": args.per_device_train_batch_size * world,
        # As the engine ran it (trainer.engine_settings, once it has trained), else as asked.
        "mini_batch_size": args.mini_batch_size if engine is None else engine.mini_batch_size,
        "gradient_accumulation_steps": args.gradient_accumulation_steps,
        "optimizer steps": state.global_step,
        "learning_rate": args.learning_rate,
        "query_max_length": args.query_max_length,
        "document_max_length": args.document_max_length,
        "loss": repr(trainer.loss),
        "precision": "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32",
    }
    dataset = trainer.train_dataset
    train_data = None
    if dataset is not None:
        name = getattr(getattr(dataset, "info", None), "dataset_name", None)
        columns = getattr(dataset, "column_names", None)
        train_data = f"{len(dataset):,} rows{f' of {name}' if name else ''}, columns {columns}"
    metrics: dict[str, float] = {}
    for entry in state.log_history:
        for key, value in entry.items():
            if (
                key.startswith("eval_")
                and isinstance(value, (int, float))
                and not key.endswith(("_runtime", "_per_second"))
            ):
                metrics[key] = float(value)
    return model_card(
        encoder=encoder,
        max_seq_length=args.document_max_length,
        train_data=train_data,
        settings=settings,
        metrics=metrics,
    )
