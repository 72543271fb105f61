"""Checks of a training run before it starts (arguments, data columns, parallelism, resume and output
folders): each raises one ``ValueError`` naming the setting, before any step. ``run_training`` calls
:func:`validate_run` before the model is built, and :class:`~gradcache_sparton.trainer.CachedSpladeTrainer`
the rest when it is built or starts training."""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from transformers import Trainer
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from gradcache_sparton.arguments import CachedSpladeTrainingArguments
from gradcache_sparton.data.columns import TEACHER_COLUMN, text_columns_of
from gradcache_sparton.losses import SpladeLoss
from gradcache_sparton.losses.fused_lse import kernels_run_on
from gradcache_sparton.modeling import read_json_file

__all__ = [
    "check_loss_reads_columns",
    "check_output_dir_is_free",
    "check_resume_checkpoint",
    "check_sharding",
    "validate_run",
]

# Files whose presence in output_dir means another run already wrote there.
_RUN_FILES = ("trainer_state.json", "model.safetensors", "config.json", "training_args.bin")


def check_sharding(trainer: Trainer, *, sparse_encoder: bool = False) -> None:
    """Refuse the parallelisms GradCache cannot run under, naming the setting and what works instead;
    ``sparse_encoder``: the trainer's model is a sentence-transformers ``SparseEncoder``."""
    if trainer.is_deepspeed_enabled:
        raise ValueError(
            "deepspeed: DeepSpeed runs the backward itself (engine.backward) and partitions the parameters "
            "outside the calls GradCache replays in loss.backward(); CachedSpladeTrainer does not support it. "
            "Shard with FSDP2 instead (--fsdp full_shard with fsdp_version 2), or train with DDP"
        )
    version = (
        getattr(trainer.accelerator.state.fsdp_plugin, "fsdp_version", 1) if trainer.is_fsdp_enabled else 2
    )
    if version != 2:
        raise ValueError(
            f"fsdp: FSDP version {version} is not supported with the cached loss (its forwards all-gather "
            "parameters per mini-batch on every rank, and ranks replaying different numbers of mini-batches "
            "would wait on each other); set fsdp_version 2 in --fsdp_config (FSDP2, fully_shard)"
        )
    if sparse_encoder and trainer.is_fsdp_enabled:
        raise ValueError(
            "fsdp with a sentence-transformers SparseEncoder: its save_pretrained gathers the sharded weights on "
            "the main process alone, so the first checkpoint or the final save would hang waiting for the other "
            "ranks; train the SparseEncoder under DDP (no --fsdp), or shard a SpladeEncoder (the train command's "
            "model), whose checkpoints also load as a SparseEncoder"
        )


def check_loss_reads_columns(loss: Any, dataset: Any) -> None:
    """``ValueError`` naming the dataset's numeric columns (each reaches the loss as a keyword argument) that
    ``loss`` does not read: a ``SpladeLoss`` reads ``teacher_scores`` under ``contrastive`` 'margin_mse' or
    'kl_div' only; another loss, the keywords its signature names (any, with ``**kwargs``)."""
    names = getattr(dataset, "column_names", None)
    if not names:
        return
    try:
        texts = text_columns_of(names)
    except ValueError:  # the dataset's validation names what is missing
        return
    extras = [name for name in names if name not in texts]
    if isinstance(loss, SpladeLoss):
        reads = {TEACHER_COLUMN} if loss.config.contrastive in ("margin_mse", "kl_div") else set()
        what = f"SpladeLoss with contrastive={loss.config.contrastive!r}"
    else:
        try:
            parameters = inspect.signature(loss).parameters.values()
        except (TypeError, ValueError):  # no signature to read: the loss's own call decides
            return
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
            return
        reads = {p.name for p in parameters if p.kind is not inspect.Parameter.POSITIONAL_ONLY}
        what = f"loss {getattr(loss, '__qualname__', type(loss).__name__)}"
    unread = [name for name in extras if name not in reads]
    if unread:
        raise ValueError(
            f"dataset column(s) {unread} reach the loss as keyword arguments, and the {what} reads none of "
            "them: teacher scores ([B, 1+k], a teacher_scores column) are read by contrastive='margin_mse' or "
            f"'kl_div' (--contrastive); otherwise drop the column(s) from the data (dataset.remove_columns({unread}))"
        )


def validate_run(
    args: CachedSpladeTrainingArguments,
    *,
    num_train_rows: int | None,
    text_columns: Sequence[str] | None = None,
) -> None:
    """Raise ``ValueError`` naming the argument if the run could not start or would train nothing.

    Cheap checks for before the model is built (``run_training`` calls it first, the trainer again):
    a ``report_to`` integration whose package is missing, an ``output_dir`` that is a file, a
    ``resume_from_checkpoint`` that is not a checkpoint folder, no optimizer step at all
    (``num_train_epochs`` 0 without ``max_steps``, or fewer ``num_train_rows`` than one global batch while
    ``dataloader_drop_last`` drops it), ``fsdp`` on the CPU (accelerate would ignore it and train under DDP),
    an ``in_batch_teacher`` under several processes, ``score_kernel='fused'`` where its kernels cannot run
    (reps not kept sparse on every step, or a device without them), and a batch that gives
    InfoNCE no negative to contrast with (one row in the global batch and no negative among ``text_columns``:
    the loss is 0 at every step).
    """
    from transformers.integrations import get_available_reporting_integrations

    available = get_available_reporting_integrations()
    missing = [name for name in args.report_to or () if name not in available]
    if missing:
        raise ValueError(
            f"report_to {missing} needs its package installed (e.g. pip install {missing[0]}); available here: "
            f"{available or 'none'} (report_to none turns reporting off)"
        )
    if args.output_dir is not None and Path(args.output_dir).exists() and not Path(args.output_dir).is_dir():
        raise ValueError(
            f"output_dir {args.output_dir!r} is an existing file, not a folder: give a folder path"
        )
    if isinstance(args.resume_from_checkpoint, str):
        check_resume_checkpoint(args.resume_from_checkpoint)
    if args.max_steps <= 0 and args.num_train_epochs <= 0:
        raise ValueError(
            f"num_train_epochs must be > 0 when max_steps is not set, got {args.num_train_epochs}: nothing "
            "would train"
        )
    global_batch = args.per_device_train_batch_size * max(1, args.world_size)
    if num_train_rows is not None and args.dataloader_drop_last and num_train_rows < global_batch:
        raise ValueError(
            f"the training data has {num_train_rows} rows, fewer than one batch of {global_batch} "
            "(per_device_train_batch_size x processes): with dataloader_drop_last nothing would train; lower "
            "per_device_train_batch_size or add rows"
        )
    if args.fsdp and args.device.type == "cpu":
        raise ValueError(
            f"--fsdp on the CPU ({args.world_size} process{'es' if args.world_size > 1 else ''}): accelerate shards only across GPU processes, so "
            "under a launcher the flag would be ignored and the run train unsharded under DDP (one process: the "
            "Trainer refuses it); drop --fsdp on the CPU, or run on CUDA GPUs (torchrun --nproc_per_node N)"
        )
    if args.in_batch_teacher is not None and args.world_size > 1:
        raise ValueError(
            f"in_batch_teacher with {args.world_size} processes: each process's collator scores its own rows "
            "([B, (1+k)·B]), while the loss sees the batch gathered from every process, whose other processes' "
            "documents the teacher never scored; train on one process (docs/distillation.md)"
        )
    if args.score_kernel == "fused" and args.sparse_reps != "true":
        raise ValueError(
            f"score_kernel='fused' scores sparse reps only, but sparse_reps is {args.sparse_reps or 'unset'} (dense reps on "
            "every step, or on the steps 'auto' or a memory plan keeps dense, where the loss would stop the run): "
            "set sparse_reps true, or leave score_kernel 'auto' (the fused kernels for sparse reps on a GPU from "
            "losses.fused_lse.FUSED_MIN_QUERIES queries on, the blocked path elsewhere)"
        )
    if args.score_kernel == "fused" and not kernels_run_on(args.device):
        raise ValueError(
            f"score_kernel='fused' runs Triton kernels on a CUDA GPU, but this run is on {args.device.type}: "
            "leave score_kernel 'auto' (the blocked path there) or run on a GPU"
        )
    has_negatives = text_columns is not None and len(text_columns) > 2  # query, positive, negatives...
    if args.contrastive == "infonce" and global_batch == 1 and text_columns is not None and not has_negatives:
        raise ValueError(
            "per_device_train_batch_size 1 x 1 process with no negative column: InfoNCE would score each query "
            "against its own positive only, a loss of 0 at every step that trains nothing; raise "
            "per_device_train_batch_size (in-batch negatives) or add hard negatives (gradcache-sparton mine)"
        )


def check_resume_checkpoint(path: str) -> None:
    """Raise unless ``path`` is a local Trainer checkpoint folder (it is never looked up on a hub)."""
    folder = Path(path)
    if not folder.is_dir():
        raise ValueError(
            f"resume_from_checkpoint {path!r} is not a folder: give a checkpoint-N folder written by an earlier "
            "run (e.g. OUTPUT_DIR/checkpoint-500)"
        )
    if not (folder / "trainer_state.json").is_file():
        raise ValueError(
            f"resume_from_checkpoint {path!r} has no trainer_state.json: it is not a checkpoint-N folder of a "
            "training run (to start from a model's weights, use model_name_or_path)"
        )
    # A cut file is named, with its line (the weights are checked when they load, before any step).
    if not isinstance(read_json_file(folder / "trainer_state.json"), dict):
        raise ValueError(
            f"{folder / 'trainer_state.json'} must hold a JSON object: it is not a Trainer state"
        )


def check_output_dir_is_free(output_dir: str | None) -> None:
    """Raise if ``output_dir`` holds another run's checkpoints or model files."""
    if output_dir is None:
        return
    path = Path(output_dir)
    if not path.is_dir():
        return
    found = [name for name in _RUN_FILES if (path / name).exists()]
    found += sorted(p.name for p in path.glob(f"{PREFIX_CHECKPOINT_DIR}-*") if p.is_dir())
    if found:
        raise ValueError(
            f"output_dir {str(path)!r} already holds another run ({', '.join(found[:4])}"
            f"{', ...' if len(found) > 4 else ''}): choose a new output_dir, pass resume_from_checkpoint to "
            "continue that run, or set overwrite_output_dir to write over it"
        )
