"""``gradcache-sparton train --help``: the options a user sets, by theme (engine and memory first, then model,
data, loss, evaluation, the Trainer's most used), each once with one default, built from the argument
dataclasses' help texts; ``--help-all`` adds the engine options it decides by itself and the Trainer's
other options."""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["CONFIG_HELP", "HELP_ALL", "train_fields", "train_help"]

CONFIG_HELP = (
    "YAML or JSON file of argument values, or 'default' (resources/default_train.yaml, the embedded run). "
    "Without --config the embedded run applies only if no flag names a model or training data."
)
HELP_ALL = "--help-all"
# The transformers.TrainingArguments options `train --help` shows (under "run"); the rest: --help-all.
_COMMON_TRAINER_OPTIONS = (
    "output_dir",
    "overwrite_output_dir",
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "max_steps",
    "num_train_epochs",
    "learning_rate",
    "warmup_steps",
    "weight_decay",
    "lr_scheduler_type",
    "bf16",
    "fp16",
    "seed",
    "logging_steps",
    "save_strategy",
    "save_steps",
    "save_total_limit",
    "resume_from_checkpoint",
    "report_to",
    "dataloader_num_workers",
)
# Trainer options about memory and speed, shown beside the engine's. `gradient_checkpointing` is
# transformers' deprecated alias of `activation_checkpointing` where that exists (5.23+).
_MEMORY_TRAINER_OPTIONS = ("activation_checkpointing", "gradient_checkpointing", "torch_compile")
# The engine's three-state options (true, false, or left unset: decided per step from the model, the
# device and max_memory's plan, and logged; engine/settings.py): --help-all only.
_ENGINE_DECIDES = ("cuda_graphs", "reuse_argmax", "check_replay", "sparse_reps", "gather_across_ranks")
# How the loss computes its [B, (1+k)·B] scores (blocks, the kernel, ranks sharing them), never their value, each
# with an automatic default: --help-all only.
_LOSS_SCORING = ("score_block_size", "score_kernel", "shard_scores_across_ranks")


def _train_option_groups() -> dict[str, tuple[str, list[str]]]:
    """``train``'s own options by theme: title -> (description, argument names), in help order."""
    from dataclasses import fields

    from transformers import TrainingArguments

    from gradcache_sparton.arguments import CachedSpladeTrainingArguments, DataArguments, ModelArguments
    from gradcache_sparton.engine import GradCacheConfig
    from gradcache_sparton.losses import SpladeLossConfig

    trainer_names = {f.name for f in fields(TrainingArguments)}
    loss_names = [f.name for f in fields(SpladeLossConfig)]
    data_names = [f.name for f in fields(DataArguments)]
    evaluation = [name for name in data_names if name.startswith(("eval_", "retrieval_eval"))]
    engine_names = {f.name for f in fields(GradCacheConfig)}
    # The training arguments' own fields: the query column's mini-batch goes with the engine's, the rest
    # (text lengths, a resume on other data) are about the training data.
    own = [
        f.name
        for f in fields(CachedSpladeTrainingArguments)
        if f.name not in trainer_names | engine_names | set(loss_names) | set(_COMMON_TRAINER_OPTIONS)
    ]
    engine = [f.name for f in fields(GradCacheConfig) if f.name not in _ENGINE_DECIDES]
    engine[1:1] = [name for name in own if name.endswith("mini_batch_size")]  # after mini_batch_size
    training_data = [name for name in own if not name.endswith("mini_batch_size")]
    memory = [name for name in _MEMORY_TRAINER_OPTIONS if name in trainer_names]
    if "activation_checkpointing" in memory:
        memory.remove("gradient_checkpointing")  # deprecated alias: --help-all only
    return {
        "engine and memory": (
            "per_device_train_batch_size is the effective batch; these bound memory and set speed, never the "
            "loss or gradients",
            engine + memory,
        ),
        "model": ("which backbone, tokenizer, pooling and LoRA", [f.name for f in fields(ModelArguments)]),
        "data": (
            "training pairs (default: the shipped SciFact sample)",
            [n for n in data_names if n not in evaluation] + training_data,
        ),
        "loss": (
            "the SPLADE loss: contrastive term, sparsity regularizers and their warm-up",
            [name for name in loss_names if name not in _LOSS_SCORING],
        ),
        "evaluation": (
            "retrieval metrics on a BEIR folder (default: the shipped SciFact dev sample)",
            evaluation,
        ),
        "run (the Trainer's most used options)": (
            "transformers.TrainingArguments",
            list(_COMMON_TRAINER_OPTIONS),
        ),
    }


def _choices(field: Any) -> list[str]:
    """The values a field takes, if it lists them: its ``choices`` (as ``HfArgumentParser`` passes them to
    argparse), or its enum type's values (the Trainer's strategies), else none."""
    import enum
    import typing

    if "choices" in field.metadata:
        return [str(choice) for choice in field.metadata["choices"]]
    for kind in (field.type, *typing.get_args(field.type)):
        if isinstance(kind, type) and issubclass(kind, enum.Enum):
            return [str(member.value) for member in kind]
    return []


def train_fields() -> dict[str, Any]:
    """Every ``train`` argument's dataclass field (``dataclasses.Field``), by name."""
    from dataclasses import fields

    from gradcache_sparton.arguments import CachedSpladeTrainingArguments, DataArguments, ModelArguments

    return {
        f.name: f
        for cls in (ModelArguments, DataArguments, CachedSpladeTrainingArguments)
        for f in fields(cls)
        if f.init
    }


def train_help(*, show_all: bool) -> str:
    """``train``'s help: general, then this project's options by theme, the Trainer's most used ones, then the
    Trainer's other options (with ``show_all``; else one line pointing at ``--help-all``).

    Built from the dataclass fields' help texts into a parser used for display only (the parsing parser is
    ``HfArgumentParser``'s), each option once under its underscore name."""
    from dataclasses import MISSING

    display = argparse.ArgumentParser(
        prog="gradcache-sparton train",
        usage="gradcache-sparton train [--config FILE|default] [--NAME VALUE ...]",
        description="Train a SPLADE model with GradCache. Flags override --config. Bool flags take a value "
        "(--bf16 True). The defaults shown are the arguments' own; with no --config and no flag naming a model "
        "or training data, the embedded run's values apply over them (resources/default_train.yaml).",
        formatter_class=lambda prog: argparse.RawDescriptionHelpFormatter(
            prog, max_help_position=32, width=110
        ),
        add_help=False,
    )
    general = display.add_argument_group("general")
    general.add_argument("-h", "--help", action="store_true", help="Show this help and exit.")
    general.add_argument(
        HELP_ALL, action="store_true", help="Show every option, the Trainer's own too, and exit."
    )
    general.add_argument("--config", metavar="CONFIG", help=CONFIG_HELP)
    remaining = train_fields()

    def add(group: Any, name: str) -> None:
        field = remaining.pop(name)
        boolean = isinstance(field.default, bool)
        choices = _choices(field)
        metavar = (
            field.metadata.get("metavar")
            or (f"{{{','.join(choices)}}}" if choices else None)
            or ("BOOL" if boolean else name.upper())
        )
        default = "" if field.default is MISSING or field.default is None else f" [default: {field.default}]"
        group.add_argument(f"--{name}", metavar=metavar, help=field.metadata.get("help", "") + default)

    for title, (description, names) in _train_option_groups().items():
        group = display.add_argument_group(title, description)
        for name in names:
            if name in remaining:
                add(group, name)
    if show_all:
        decided = display.add_argument_group(
            "engine options it decides by itself",
            "left unset, each is decided per step from the model, the device and max_memory's plan, and logged "
            "at the first step; set one to force it",
        )
        for name in _ENGINE_DECIDES:
            add(decided, name)
        scoring = display.add_argument_group(
            "how the loss computes its scores", "each with an automatic default; never the loss's value"
        )
        for name in _LOSS_SCORING:
            add(scoring, name)
        trainer = display.add_argument_group("the Trainer's other options (transformers.TrainingArguments)")
        for name in sorted(remaining):
            add(trainer, name)
    else:
        hidden = len(remaining) - len(_ENGINE_DECIDES) - len(_LOSS_SCORING)
        display.epilog = (
            f"The engine decides {', '.join(_ENGINE_DECIDES)} by itself (logged at the first step), the loss "
            f"computes its scores as {', '.join(_LOSS_SCORING)} say (automatic by default), and the Trainer has "
            f"{hidden} other options (transformers.TrainingArguments): gradcache-sparton train {HELP_ALL}"
        )
    return display.format_help()
