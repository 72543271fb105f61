"""Configuration of a training run as dataclasses, for ``transformers.HfArgumentParser`` and the CLI.

Three groups, one concept each:
- :class:`ModelArguments`: which backbone (a local checkpoint, or a named shape built with random
  weights), which tokenizer, the pooling options and LoRA (peft) adapters.
- :class:`DataArguments`: where training pairs and the retrieval dev set come from.
- :class:`CachedSpladeTrainingArguments`: ``transformers.TrainingArguments`` plus the GradCache and
  SPLADE-loss knobs. ``per_device_train_batch_size`` is the *effective* batch per device (what the
  contrastive loss sees); ``mini_batch_size`` only bounds memory and never changes the result.

Every ``__post_init__`` raises ``ValueError`` naming the field, before any model or data is built.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from transformers import TrainingArguments

from gradcache_sparton.data.columns import QUERY_COLUMN
from gradcache_sparton.engine import GradCacheConfig
from gradcache_sparton.kernels import HEAD_ACTIVATIONS, check_head_activation
from gradcache_sparton.losses import SpladeLossConfig
from gradcache_sparton.primitives.option_field import option
from gradcache_sparton.primitives.option_types import check_value_types
from gradcache_sparton.primitives.query_encoders import QUERY_ENCODERS

__all__ = [
    "BACKBONE_PRESETS",
    "INIT_DECODER_BIAS_SIGMAS",
    "QUERY_TABLE_LEARNING_RATE_SCALE",
    "CachedSpladeTrainingArguments",
    "DataArguments",
    "ModelArguments",
    "default_dataloader_workers",
    "load_config_file",
]

logger = logging.getLogger(__name__)

# Named BERT shapes (random init; no hub access is ever needed). The names follow Google's BERT
# miniatures (Turc et al., 2019) and bert-base; all use the bert-base-uncased WordPiece vocabulary.
_SHAPE_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
BACKBONE_PRESETS: dict[str, dict[str, int]] = {
    name: dict(zip(_SHAPE_KEYS, shape, strict=True))
    for name, shape in {
        "bert-tiny": (128, 2, 2, 512),
        "bert-mini": (256, 4, 4, 1024),
        "bert-small": (512, 4, 8, 2048),
        "bert-medium": (512, 8, 8, 2048),
        "bert-base-uncased": (768, 12, 12, 3072),
    }.items()
}


# Default decoder-bias start of a random-init head, in standard deviations of its initial logits. Measured
# before any training on the shipped dev sample (scripts/scan_init_decoder_bias.py): bert-tiny (sigma 0.23)
# at -0.5 and bert-small (sigma 0.45) at -1.0 both start with ~5k active terms per query and the best or
# near-best nDCG@10 of their scans (0.157, 0.207); with bias 0 about 30k terms are active.
INIT_DECODER_BIAS_SIGMAS = 2.2

# A trained query table's learning rate over the encoder's by default: sentence-transformers' ratio (1e-3 against
# 2e-5), measured on the shipped dev sample in docs/inference_free.md.
QUERY_TABLE_LEARNING_RATE_SCALE = 50


def _has_accelerator() -> bool:
    """Whether torch sees an accelerator (CUDA, XPU, MPS, ...), where pinned host memory is of use."""
    import torch

    return torch.accelerator.is_available()


# Most dataloader workers a process starts by default when batches are tokenized as they are read: 4 kept one
# H200 busy on 512-pair batches of real text (0.81 of the engine with 4 against 0.43 with none, before the
# token cache); more only take CPU from other processes.
_MAX_DEFAULT_WORKERS = 4


def default_dataloader_workers(*, accelerator: bool) -> int:
    """Dataloader workers a training process starts by default: on an accelerator, one per CPU this process
    may use (its share of ``os.sched_getaffinity`` among the node's ``LOCAL_WORLD_SIZE`` processes) less the
    one the main process keeps, at most ``_MAX_DEFAULT_WORKERS``; 0 on one CPU, and 0 without an accelerator
    (the model then trains on the same cores that would tokenize: nothing runs beside it)."""
    if not accelerator:
        return 0
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    processes = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
    return max(0, min(_MAX_DEFAULT_WORKERS, cpus // processes - 1))


def _positive(value: Any, name: str, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int{' or None' if allow_none else ''}, got {value!r}")


@dataclass
class ModelArguments:
    """The backbone: a local masked-LM checkpoint, or a named shape with random weights."""

    model_name_or_path: str | None = option(
        None,
        "A masked-LM checkpoint (ours or any standard BERT/DistilBERT/RoBERTa/XLM-R one): a local "
        "folder, 'splade-tiny-msmarco' (the pretrained SPLADE model shipped with the package, the embedded "
        "run's start) or a hub id (downloaded where the network allows; HF_HUB_OFFLINE=1 forbids it). "
        "Wins over config_name.",
    )
    config_name: str = option(
        "bert-tiny",
        "Backbone shape built with random weights when model_name_or_path is not given. Larger: better reps, "
        "slower steps.",
        choices=sorted(BACKBONE_PRESETS),
    )
    hidden_size: int | None = option(None, "Override the preset's hidden size D.")
    num_hidden_layers: int | None = option(None, "Override the preset's layers.")
    num_attention_heads: int | None = option(None, "Override the preset's heads.")
    intermediate_size: int | None = option(None, "Override the preset's FFN width.")
    init_decoder_bias: float | None = option(
        None,
        "Random init only: start value of the decoder bias. Default: -2.2 standard deviations of the "
        "initial logits (-2.2 x sqrt(hidden_size) x initializer_range: -0.5 for bert-tiny, -1.0 for "
        "bert-small). A fresh head with bias 0 activates ~all 30k terms, whose huge dot products saturate "
        "the contrastive loss; the default starts it sparse and mostly lexical (docs/training.md). 0 keeps "
        "the config's init.",
    )
    tokenizer_name: str | None = option(
        None,
        "Tokenizer folder or hub id. Default: the checkpoint's own tokenizer if it has one, else the "
        "bert-base-uncased tokenizer shipped with the package.",
    )
    mask_special_tokens: bool | None = option(
        None,
        "True: drop every special token's positions ([CLS]/[SEP]/[PAD], BOS/EOS) from the max-pooling. "
        "False: pool them all. Default: the checkpoint's choice, else none dropped for a masked LM and the "
        "BOS/EOS positions dropped for a decoder-only LM (docs/llm.md).",
    )
    prefix_length: int | None = option(
        None,
        "The first k attended tokens of every text (e.g. an instruction prefix) are read but not "
        "pooled. Default: the checkpoint's value (0 for a new model).",
    )
    bidirectional: bool | None = option(
        None,
        "Decoder-only backbones (Llama, Qwen2/3, Mistral): every token attends to later tokens "
        "too (docs/llm.md). Default: the checkpoint's value (off for a new model).",
    )
    echo: bool | None = option(
        None,
        "Decoder-only backbones: read each text twice and pool only the second copy (echo "
        "embeddings; 2x the tokens). Default: the checkpoint's value (off for a new model).",
    )
    activation_function: str | None = option(
        None,
        "The SPLADE head's activation before the log1p, as sentence-transformers' SpladePooling names it. "
        "'relu': log1p(relu(logits)) (SPLADE). 'log1p_relu': log1p(log1p(relu(logits))) (OpenSearch v3's 'l0' "
        "activation: flatter weights, so a term's weight grows more slowly with its logit). Default: the "
        "checkpoint's value (relu for a new model or a checkpoint that names none). Saved with the model and "
        "exported to sentence-transformers.",
        choices=HEAD_ACTIVATIONS,
    )
    query_encoder: str | None = option(
        None,
        "How queries are encoded: 'splade' (the same SPLADE encoder as documents, siamese), 'idf' "
        "(inference-free: a fixed weight per token, no transformer at query time), 'learned_idf' (the same "
        "table, trained) or 'li_lsr' (the table computed from the token embeddings, weight = log1p(relu(E.w + "
        "b)), w and b trained, fitted to the IDF at the start). The table starts from the checkpoint's "
        "query_table.safetensors if it has one, else from the IDF of the training documents "
        "(docs/inference_free.md). Default: the query encoder the checkpoint's splade_config.json records (a "
        "folder without the record: inference-free if it has a query table, else splade); given, it decides, "
        "whatever the checkpoint records.",
        choices=QUERY_ENCODERS,
    )
    lora_r: int = option(
        0,
        "LoRA rank (peft): > 0 trains low-rank adapters on lora_target_modules instead of every "
        "weight; the embeddings and the decoder the SPLADE head shares stay frozen, so the head's backward "
        "skips their [V, D] gradient. Higher: more capacity, more trainable weights. 0: off (full "
        "fine-tuning). The saved model has the adapters merged in; OUTPUT_DIR/adapter holds them alone. "
        "Needs the peft extra.",
    )
    lora_alpha: int | None = option(
        None, "LoRA scale: the adapters' update is multiplied by lora_alpha / lora_r. Default: 2 x lora_r."
    )
    lora_dropout: float = option(
        0.0, "Dropout on the adapters' input, in [0, 1): regularizes small training sets. 0: none."
    )
    lora_target_modules: str | None = option(
        None,
        "Comma list of the modules that get adapters, by name or name suffix (e.g. "
        "q_proj,k_proj,v_proj,o_proj): more modules, more capacity and memory. Default: peft's choice for "
        "the architecture (q_proj,v_proj for Llama/Qwen/Mistral, query,value for BERT/RoBERTa); an "
        "architecture peft has none for needs it given.",
    )

    def __post_init__(self) -> None:
        if self.model_name_or_path is None and self.config_name not in BACKBONE_PRESETS:
            raise ValueError(
                f"config_name must be one of {sorted(BACKBONE_PRESETS)} (shapes built with random weights; "
                f"to start from a pretrained checkpoint give it as model_name_or_path), got {self.config_name!r}"
            )
        for name in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"):
            _positive(getattr(self, name), name, allow_none=True)
        if self.model_name_or_path is not None:
            # The shape and the decoder's starting bias belong to a model built at random, not a checkpoint.
            shape = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
            ignored = [name for name in (*shape, "init_decoder_bias") if getattr(self, name) is not None]
            if ignored:
                raise ValueError(
                    f"{', '.join(ignored)} would have no effect with model_name_or_path "
                    f"{self.model_name_or_path!r} (they shape a model built with random weights): drop them, or "
                    "drop model_name_or_path to build that shape"
                )
        if self.prefix_length is not None and self.prefix_length < 0:
            raise ValueError(f"prefix_length must be >= 0, got {self.prefix_length}")
        if self.activation_function is not None:
            check_head_activation(self.activation_function)
        if self.query_encoder is not None and self.query_encoder not in QUERY_ENCODERS:
            raise ValueError(
                f"query_encoder must be one of {list(QUERY_ENCODERS)}, got {self.query_encoder!r}"
            )
        self._check_lora()

    def _check_lora(self) -> None:
        if isinstance(self.lora_r, bool) or not isinstance(self.lora_r, int) or self.lora_r < 0:
            raise ValueError(f"lora_r must be an int >= 0 (0: LoRA off), got {self.lora_r!r}")
        _positive(self.lora_alpha, "lora_alpha", allow_none=True)
        if not 0 <= self.lora_dropout < 1:
            raise ValueError(f"lora_dropout must be in [0, 1), got {self.lora_dropout!r}")
        self.lora_target_module_names()  # a malformed list is an error even with LoRA off
        if self.lora_r == 0:
            given = [
                name
                for name, is_set in (
                    ("lora_alpha", self.lora_alpha is not None),
                    ("lora_dropout", self.lora_dropout != 0),
                    ("lora_target_modules", self.lora_target_modules is not None),
                )
                if is_set
            ]
            if given:
                raise ValueError(
                    f"{', '.join(given)} set but lora_r is 0 (LoRA off): give lora_r > 0 to train adapters, or "
                    f"drop {', '.join(given)}"
                )
        elif importlib.util.find_spec("peft") is None:
            raise ValueError(f"lora_r={self.lora_r} needs peft: pip install 'gradcache_sparton[peft]'")

    def lora_target_module_names(self) -> list[str] | None:
        """``lora_target_modules`` as a list of names (None: peft's default for the architecture)."""
        value = self.lora_target_modules
        if value is None:
            return None
        names = [name.strip() for name in value.split(",")] if isinstance(value, str) else []
        if not names or not all(names):
            raise ValueError(
                f"lora_target_modules must be a comma list of module names such as 'q_proj,v_proj' (no empty "
                f"entry), got {value!r}"
            )
        return names

    def encoder_options(self) -> dict[str, Any]:
        """The pooling options given explicitly (``prefix_length``, ``bidirectional``, ``echo``,
        ``activation_function``)."""
        names = ("prefix_length", "bidirectional", "echo", "activation_function")
        return {name: getattr(self, name) for name in names if getattr(self, name) is not None}

    def backbone_shape(self) -> dict[str, int]:
        """The preset's shape with the explicit overrides applied."""
        shape = dict(BACKBONE_PRESETS[self.config_name])
        for name in shape:
            if getattr(self, name) is not None:
                shape[name] = getattr(self, name)
        if shape["hidden_size"] % shape["num_attention_heads"]:
            raise ValueError(
                f"hidden_size={shape['hidden_size']} must be a multiple of "
                f"num_attention_heads={shape['num_attention_heads']}"
            )
        return shape


@dataclass
class DataArguments:
    """Training pairs and the retrieval dev set. With no source given, the shipped SciFact sample is used."""

    train_data: list[str] | None = option(
        None,
        "Training files (jsonl/json/csv/parquet, optionally compressed) with columns query, positive "
        "[, negative_1..k | negatives] [, numeric extras such as teacher_scores].",
    )
    train_beir: str | None = option(
        None, "A BEIR folder (corpus.jsonl, queries.jsonl, qrels/<split>.tsv) to train on its pairs."
    )
    train_beir_split: str = option("train", "qrels split of train_beir.")
    self_supervised_corpus: str | None = option(
        None,
        "A BEIR folder whose corpus.jsonl becomes self-supervised pairs (a sentence as the query, "
        "the rest of the document as the positive): for corpora with few labels.",
    )
    max_train_samples: int | None = option(
        None, "Keep only the first N training rows (after shuffling with the seed)."
    )
    eval_beir: str | None = option(
        "default",
        "BEIR folder for retrieval evaluation (nDCG@10, MRR@10, Recall@100) after training and at "
        "each eval step: 'default' is the shipped SciFact dev sample, 'none' disables it.",
    )
    eval_beir_split: str = option("dev", "qrels split of eval_beir.")
    eval_batch_size: int = option(64, "Texts encoded at once during evaluation.")
    eval_before_training: bool = option(
        False,
        "Also evaluate the starting model before training (not when resuming), to report the gain: "
        "logged and in the summary as eval_before_* (the embedded run does).",
    )
    retrieval_eval_steps: int | None = option(
        None, "Also run the retrieval evaluation every N optimizer steps (it always runs at the end)."
    )

    def __post_init__(self) -> None:
        _positive(self.max_train_samples, "max_train_samples", allow_none=True)
        _positive(self.eval_batch_size, "eval_batch_size")
        _positive(self.retrieval_eval_steps, "retrieval_eval_steps", allow_none=True)
        if self.train_data is not None and len(self.train_data) == 0:
            raise ValueError("train_data is an empty list of files")
        # Settings that would have no effect in the combination given: refused rather than ignored.
        ignored = []
        if not self.evaluates:
            ignored += [name for name, value, default in self._eval_settings() if value != default]
        if self.train_beir is None and self.train_beir_split != "train":
            ignored.append("train_beir_split (without train_beir)")
        if ignored:
            raise ValueError(
                f"{', '.join(ignored)} would have no effect"
                f"{' with eval_beir none' if not self.evaluates else ''}: drop {'it' if len(ignored) == 1 else 'them'}"
            )
        if not self.evaluates and self.eval_before_training:
            # Not refused: the embedded run's config sets it, and `--eval_beir none` alone must stay valid.
            logger.info("eval_before_training has no effect with eval_beir none.")

    @property
    def evaluates(self) -> bool:
        """Whether a retrieval evaluator runs (``eval_beir`` is not 'none')."""
        return self.eval_beir is not None and self.eval_beir.lower() != "none"

    def _eval_settings(self) -> list[tuple[str, Any, Any]]:
        """(name, value, default) of the settings that only the retrieval evaluation reads."""
        return [
            ("retrieval_eval_steps", self.retrieval_eval_steps, None),
            ("eval_beir_split", self.eval_beir_split, "dev"),
            ("eval_batch_size", self.eval_batch_size, 64),
        ]

    @property
    def uses_default_train_data(self) -> bool:
        return self.train_data is None and self.train_beir is None and self.self_supervised_corpus is None


def _engine_field(name: str, *, default: Any, note: str = "") -> Any:
    """The engine's field ``name`` (:class:`GradCacheConfig`'s help text, plus ``note``) with the trainer's
    ``default``: the one way a training argument overrides an engine option's default or type."""
    engine = next(f for f in fields(GradCacheConfig) if f.name == name)
    help_text = f"{engine.metadata['help']} {note}".strip()
    return field(default=default, metadata={**engine.metadata, "help": help_text})


@dataclass
class CachedSpladeTrainingArguments(SpladeLossConfig, GradCacheConfig, TrainingArguments):
    """``TrainingArguments`` plus the GradCache engine's settings and the SPLADE loss settings.

    The engine settings are :class:`~gradcache_sparton.engine.GradCacheConfig`'s fields, inherited
    (``mini_batch_size``, ``mini_batch_tokens``, ``mini_batch_length_multiple``, ``check_replay``,
    ``sparse_reps``, ``reuse_argmax``, ``cuda_graphs``, ...): the same names, help texts and checks, and
    :meth:`grad_cache_config` is the engine's configuration (what it runs with, the engine decides and the
    trainer logs). As flags, ``mini_batch_size`` is one int (``query_mini_batch_size`` sets the query
    column's), ``max_memory`` defaults to ``auto`` (plan within the free GPU memory) and
    ``allow_non_finite`` to on under fp16.

    The loss settings are :class:`~gradcache_sparton.losses.SpladeLossConfig`'s fields, inherited: the
    same names, defaults, help texts and checks (``contrastive``, ``temperature``, ``query_regularizer``,
    ``doc_regularizer``, ``query_reg_weight``, ``doc_reg_weight``, ``reg_warmup_steps``,
    ``reg_warmup_shape``). ``warmup_steps`` is ``TrainingArguments``' learning-rate warm-up.
    ``SpladeLossConfig`` is the first base so that the loss fields come after ``TrainingArguments``'
    fields, which keep their positions; ``__post_init__`` calls every base's checks explicitly.

    Changed defaults: ``per_device_train_batch_size=256`` (the effective batch per device),
    ``dataloader_drop_last=True`` (a small final batch spikes a contrastive loss),
    ``remove_unused_columns=False`` (the collator needs the text columns), ``prediction_loss_only=True``,
    and on a GPU the batch copied to it without waiting (``accelerator_config`` ``non_blocking``, from pinned
    memory) and, where the trainer cannot tokenize the training set before training, ``dataloader_num_workers``
    (persistent) so that batches are tokenized while the device trains (:meth:`pretokenized_batches`).
    """

    output_dir: str | None = option(
        None, "Where checkpoints and the final model go. Default: outputs/splade-<date>-<time>."
    )
    per_device_train_batch_size: int = option(
        256,
        "Effective batch per device (process): the contrastive loss sees this x the number of processes "
        "rows at once (in-batch negatives). It does not bound memory: mini_batch_size does.",
    )
    dataloader_drop_last: bool = option(
        True, "Drop the last incomplete batch (a small batch spikes the loss)."
    )
    remove_unused_columns: bool = option(False, "Must stay False: the collator needs them.")
    dataloader_num_workers: int | None = option(
        None,
        "Processes that read, tokenize and pad the next batches while the device trains on this one (0: "
        "the main process, between steps). Default: 0 when the trainer tokenizes every training text before "
        "training (a training set of at most 300,000 texts: a batch is then only padded); otherwise "
        "on a GPU min(4, the CPUs this process may use - 1), 0 on a single CPU; 0 when training on the CPU "
        "(the model uses those cores itself).",
    )
    dataloader_persistent_workers: bool | None = option(
        None,
        "Keep the dataloader workers between epochs instead of starting them again. Default: on "
        "whenever there are workers.",
    )
    prediction_loss_only: bool = option(True, "Evaluation computes the loss only.")
    # The engine's fields (GradCacheConfig) that take another type or default as training flags, each with
    # the engine's help text (_engine_field): mini_batch_size is one int here (query_mini_batch_size sets the
    # query column's); the trainer plans within the free GPU memory by default; allow_non_finite follows fp16.
    mini_batch_size: int | None = _engine_field("mini_batch_size", default=None)
    max_memory: str | None = _engine_field("max_memory", default="auto")
    allow_non_finite: bool | None = _engine_field(
        "allow_non_finite", default=None, note="Default: on under fp16, off otherwise."
    )
    query_mini_batch_size: int | None = option(
        None, "Mini-batch size for the (short) query column; default: mini_batch_size."
    )
    query_table_learning_rate: float | None = option(
        None,
        "Learning rate of an inference-free model's trained query table (learned_idf, li_lsr, or a "
        "sentence-transformers SparseStaticEmbedding): its own optimizer parameter group, under the same "
        "schedule and weight decay. Default: learning_rate x 50 (docs/inference_free.md).",
    )
    query_max_length: int = option(32, "Queries are truncated to this many tokens (a multiple of 8).")
    document_max_length: int = option(
        256, "Positives and negatives are truncated to this many tokens (multiple of 8)."
    )
    overwrite_output_dir: bool = option(
        False, "Allow writing into an output_dir that already holds another run's files."
    )
    allow_changed_train_data: bool = option(
        False,
        "Let resume_from_checkpoint continue on training data other than the checkpoint's (its rows "
        "differ): the switch is logged and recorded in the checkpoints' train_data.json. Off: such a resume "
        "is refused.",
    )

    @property
    def n_gpu(self) -> int:
        """GPUs this process trains on: at most one. With several GPUs visible and no distributed launch, the
        Trainer would wrap the model in ``nn.DataParallel``, which splits every replayed mini-batch across
        the GPUs without replaying its scatter (the replay check then fails); several GPUs train through
        ``accelerate launch`` or ``torchrun`` (DDP, FSDP2), one process each."""
        return min(super().n_gpu, 1)

    def pretokenized_batches(self) -> None:
        """Called by the trainer when every training text was tokenized before training (its token cache):
        a batch is then a gather and a pad, milliseconds in the main process, so the default worker count
        becomes 0 (and persistent workers off); counts, persistence or a prefetch factor the user gave are
        kept. Workers then only add their processes and copies: on an H200 (512-pair batches of SciFact
        text, ``benchmarks/bench_trainer_feed.py``, 2026-11-29) the trainer without workers was never
        slower than with 4 (1.01 against 0.99 of ``CachedLoss`` alone in one call, 0.88 against 0.85 in
        another, docs/training.md)."""
        if self._default_workers:
            self.dataloader_num_workers = 0
            if self._default_persistent_workers:
                self.dataloader_persistent_workers = False

    def __post_init__(self) -> None:
        if self.output_dir is None:
            self.output_dir = time.strftime("outputs/splade-%Y%m%d-%H%M%S")
        SpladeLossConfig.__post_init__(self)  # the loss settings, checked now, not at the first step
        accelerator = _has_accelerator() and not self.use_cpu
        if self.dataloader_pin_memory and not accelerator:
            self.dataloader_pin_memory = False  # pinning needs an accelerator; torch warns on every epoch
        # Whether the worker settings were left to their defaults: batches read from the trainer's token cache
        # need no workers (pretokenized_batches).
        self._default_workers = (
            self.dataloader_num_workers is None and self.dataloader_prefetch_factor is None
        )
        self._default_persistent_workers = self.dataloader_persistent_workers is None
        if self.dataloader_num_workers is None:
            self.dataloader_num_workers = default_dataloader_workers(accelerator=accelerator)
        elif isinstance(self.dataloader_num_workers, bool) or not isinstance(
            self.dataloader_num_workers, int
        ):
            raise ValueError(
                f"dataloader_num_workers must be an int >= 0, got {self.dataloader_num_workers!r}"
            )
        elif self.dataloader_num_workers < 0:
            raise ValueError(f"dataloader_num_workers must be >= 0, got {self.dataloader_num_workers}")
        if self.dataloader_persistent_workers is None:
            self.dataloader_persistent_workers = self.dataloader_num_workers > 0
        if self.accelerator_config is None and self.dataloader_pin_memory:
            # From pinned memory the batch's copy to the device is queued, not waited for: the host goes on
            # while the device finishes the step before (accelerate's default copy blocks).
            self.accelerator_config = {"non_blocking": True}
        TrainingArguments.__post_init__(self)
        if self.allow_non_finite is None:
            self.allow_non_finite = bool(self.fp16)  # a GradScaler skips non-finite steps
        _positive(self.query_mini_batch_size, "query_mini_batch_size", allow_none=True)
        rate = self.query_table_learning_rate
        if rate is not None and (type(rate) not in (int, float) or not 0 < rate < float("inf")):
            raise ValueError(
                f"query_table_learning_rate must be a positive finite float or None, got {rate!r}"
            )
        GradCacheConfig.__post_init__(self)  # the engine settings, checked now, not at the first step
        _positive(self.query_max_length, "query_max_length")
        _positive(self.document_max_length, "document_max_length")
        if self.mini_batch_size is not None and self.per_device_train_batch_size < self.mini_batch_size:
            raise ValueError(
                f"per_device_train_batch_size={self.per_device_train_batch_size} (the effective batch) is smaller "
                f"than mini_batch_size={self.mini_batch_size}: lower mini_batch_size or raise the batch"
            )
        if self.remove_unused_columns:
            raise ValueError("remove_unused_columns must be False: the collator reads the text columns")

    def table_learning_rate(self) -> float:
        """A trained query table's: ``query_table_learning_rate``, else ``QUERY_TABLE_LEARNING_RATE_SCALE`` x ours."""
        rate = self.query_table_learning_rate
        return self.learning_rate * QUERY_TABLE_LEARNING_RATE_SCALE if rate is None else float(rate)

    def grad_cache_config(self, columns: Iterable[str]) -> GradCacheConfig:
        """The :class:`GradCacheConfig` these arguments describe for a batch of ``columns``: a copy of the
        inherited fields, with ``query_mini_batch_size`` for the query column when given (the other columns'
        left to ``max_memory``'s plan when ``mini_batch_size`` is not set)."""
        values = {f.name: getattr(self, f.name) for f in fields(GradCacheConfig)}
        if self.query_mini_batch_size is not None:
            values["mini_batch_size"] = {
                column: self.query_mini_batch_size if column == QUERY_COLUMN else self.mini_batch_size
                for column in columns
            }
        return GradCacheConfig(**values)

    def splade_loss_config(self, *, inference_free: bool = False) -> SpladeLossConfig:
        """The :class:`SpladeLossConfig` these arguments describe: a copy of the inherited fields; for an
        inference-free model (queries by a table: a query costs its tokens whatever their weights) no query
        regularizer, logged. The family's other default: :meth:`table_learning_rate`."""
        config = SpladeLossConfig(**{f.name: getattr(self, f.name) for f in fields(SpladeLossConfig)})
        if inference_free and config.query_reg_weight:
            logger.info(
                "Inference-free model: no query regularizer (query_reg_weight %g -> 0).",
                self.query_reg_weight,
            )
            config = dataclasses.replace(config, query_reg_weight=0.0)
        return config


def load_config_file(path: Path) -> dict[str, Any]:
    """The mapping of argument names to values in a ``--config`` YAML or JSON file (``train``, and the recipe of
    ``crossval``); ``ValueError`` naming file and line, or the key whose value its argument cannot take
    (:func:`~gradcache_sparton.primitives.option_types.check_value_types`: ``keep_graphs: 1``)."""
    if not path.is_file():
        raise ValueError(f"--config {str(path)!r} does not exist (give a .yaml/.json file or 'default')")
    text = path.read_text(encoding="utf-8")
    suffix = path.suffix.lower()
    if suffix in (".yaml", ".yml"):
        import yaml

        try:
            values = yaml.safe_load(text) or {}
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" line {mark.line + 1}" if mark is not None else ""
            problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
            raise ValueError(f"--config {str(path)!r}{where}: not valid YAML ({problem})") from None
    elif suffix == ".json":
        try:
            values = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(
                f"--config {str(path)!r} line {exc.lineno}: not valid JSON ({exc.msg})"
            ) from None
    else:
        raise ValueError(f"--config must be a .yaml, .yml or .json file or 'default', got {str(path)!r}")
    if not isinstance(values, dict):
        raise ValueError(f"--config {str(path)!r} must hold a mapping of argument names to values")
    check_value_types(
        values,
        (ModelArguments, DataArguments, CachedSpladeTrainingArguments),
        source=f"--config {str(path)!r}",
    )
    return values
