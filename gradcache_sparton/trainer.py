"""``CachedSpladeTrainer``: the SPLADE encoder, the SPLADE loss and the GradCache engine in ``transformers.Trainer``.

What it overrides, and why (everything else, from optimizers and schedulers to mixed precision,
gradient accumulation, checkpoints and ``report_to`` integrations, is the Trainer's own):
- ``compute_loss``: the loss is :class:`~gradcache_sparton.engine.CachedLoss` over the batch's
  columns; the Trainer's own ``accelerator.backward(loss)`` then runs GradCache Step (3).
- ``log``: adds the loss components, the sparsity statistics and the training throughput, and with
  ``max_memory`` the engine's plan (``memory_plan_*`` entries, once per plan; ``memory_plan`` holds it).
  The settings the engine runs with are logged as it decides them (``engine_settings`` holds them), never
  predicted here: the engine alone decides its options (:mod:`gradcache_sparton.engine.settings`).
- ``_save`` / ``_load_from_checkpoint`` / ``_load_best_model``: checkpoints are standard masked-LM
  checkpoints (``SpladeEncoder.save_pretrained``), not a state dict of the wrapper, and are read back
  strictly (every tensor from the file).
- ``_save_checkpoint``: a failed write (a full disk) names the file and renames the partial folder
  ``checkpoint-N.incomplete``.
- ``train``: refuses an ``output_dir`` that holds another run, before anything starts, and holds the
  folder's lock (one live run per folder, :mod:`gradcache_sparton.run_state`).

Loss scaling lives in one place, the engine's replay node (see ``engine/cached_loss.py``): the
Trainer divides the loss by the gradient-accumulation steps and AMP scales it; both reach the
replay as the incoming gradient, so parameter gradients equal uncached training's.

Multi-GPU: launched with ``accelerate launch`` (or ``torchrun``) the Trainer wraps the model in
DistributedDataParallel and nothing here changes. ``per_device_train_batch_size`` rows go to each
process; the engine gathers every process's reps, so the loss (in-batch negatives, FLOPS) sees the
global batch of per-device x processes rows, runs every replayed mini-batch but the last under
``no_sync``, and scales the replay so the gradients DDP averages equal one process training on the
global batch (see ``engine/distributed.py``). Under gradient accumulation the Trainer's own
``no_sync`` around non-final micro-steps composes with it: one all-reduce per optimizer step.

Fully sharded (``--fsdp full_shard`` with ``fsdp_version`` 2, FSDP2, the Trainer's default): the engine
runs as many forwards and backwards on every rank and reduce-scatters once per step (see
``engine/distributed.py``); ``save_model`` gathers the full state dict and writes the same standard
checkpoint as one process, and resuming loads it back into the shards. FSDP version 1 and DeepSpeed
(whose engine runs the backward itself) are refused when the Trainer is built.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from transformers import PreTrainedTokenizerBase, Trainer
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

from gradcache_sparton.arguments import CachedSpladeTrainingArguments
from gradcache_sparton.data import TrainingCollator, validate_training_dataset
from gradcache_sparton.data.token_cache import TokenCache
from gradcache_sparton.engine import CachedLoss, GradCache
from gradcache_sparton.engine.distributed import ddp_no_sync_context, find_ddp
from gradcache_sparton.engine.planner.memory_plan import MemoryPlan
from gradcache_sparton.engine.settings import StepSettings, plans_memory
from gradcache_sparton.integrations.sentence_transformers import (
    as_rep_encoder,
    check_not_sentence_transformers_loss,
    from_sentence_transformers_columns,
    is_inference_free_sparse_encoder,
    is_sparse_encoder,
    run_model_card,
    sentence_transformers_can_load,
    sparse_encoder_backbone,
    use_sparton_head,
    write_sentence_transformers_files,
)
from gradcache_sparton.losses import SpladeLoss
from gradcache_sparton.modeling import (
    InferenceFreeEncoder,
    SpladeEncoder,
    load_checkpoint_weights,
    load_full_state_dict,
    query_table_parameters,
)
from gradcache_sparton.run_checks import (
    check_loss_reads_columns,
    check_output_dir_is_free,
    check_resume_checkpoint,
    check_sharding,
    validate_run,
)
from gradcache_sparton.run_state import (
    CheckpointWriteError,
    TrainDataRecord,
    checkpoint_write_error,
    output_dir_lock,
)

__all__ = ["CachedSpladeTrainer"]

logger = logging.getLogger(__name__)

# Loss components (SpladeLoss) counting non-zeros per rep: 0 means the reps collapsed.
_NONZERO_COMPONENTS = ("nnz_query", "nnz_doc")


class CachedSpladeTrainer(Trainer):
    """Train a :class:`~gradcache_sparton.modeling.SpladeEncoder` at any effective batch size.

    Args:
        model: the encoder (``model(**features) -> [B, V]``), or a sentence-transformers SPLADE
            ``SparseEncoder``, which is converted in place to the fused head
            (:func:`~gradcache_sparton.integrations.sentence_transformers.use_sparton_head`: same reps,
            type and save format) and saved in its own format; an inference-free one (a ``Router`` with a
            ``SparseStaticEmbedding`` query route) has the head on its document route and no query regularizer.
        args: :class:`CachedSpladeTrainingArguments`; ``per_device_train_batch_size`` is the batch per
            process, the loss sees it times the number of processes (the global batch),
            ``mini_batch_size`` bounds memory.
        train_dataset: rows with ``query``, ``positive`` [, negatives] [, numeric extras]
            (see :mod:`gradcache_sparton.data`), validated before training. sentence-transformers'
            ``anchor`` / ``negative`` columns are renamed; for a ``SparseEncoder`` the string
            columns are read by position, as sentence-transformers does.
        processing_class: the tokenizer; its vocabulary must match the model's decoder.
        loss: any loss over reps (``loss_fn(reps, step=..., **loss_kwargs)``); default
            ``SpladeLoss(args.splade_loss_config())``. It receives ``step=state.global_step`` so
            regularizer warm-up follows optimizer steps (and resumes with them).
        data_collator: default :class:`~gradcache_sparton.data.TrainingCollator` with the arguments'
            max lengths; with ``max_memory``, padding every batch to them (one shape: the plan made on the
            first batch covers the run instead of a probe at each longer batch).
        batch_teacher: with ``in_batch_teacher`` (required then): the teacher's scores of each batch
            (:func:`~gradcache_sparton.mining.batch_teacher_for_run`), attached by the default collator.
        Everything else goes to ``transformers.Trainer``.
    """

    def __init__(
        self,
        model: SpladeEncoder | nn.Module,
        args: CachedSpladeTrainingArguments,
        *,
        train_dataset: Any = None,
        processing_class: PreTrainedTokenizerBase,
        loss: Any = None,
        data_collator: Any = None,
        batch_teacher: Any = None,
        **kwargs: Any,
    ) -> None:
        if not isinstance(args, CachedSpladeTrainingArguments):
            raise TypeError(f"args must be CachedSpladeTrainingArguments, got {type(args).__name__}")
        check_not_sentence_transformers_loss(loss)
        if loss is None:
            inference_free = isinstance(model, InferenceFreeEncoder) or is_inference_free_sparse_encoder(
                model
            )
            loss = SpladeLoss(args.splade_loss_config(inference_free=inference_free))
        self._sparse_encoder = is_sparse_encoder(model)
        # The engine over the model the Trainer passes (see _cached_loss), and which model and columns it was for.
        self._engine: CachedLoss | None = None
        self._engine_key: tuple[nn.Module, tuple[str, ...]] | None = None
        if self._sparse_encoder:
            # In place: same reps, module types and save format, computed by the fused head.
            use_sparton_head(model)
            encoder = SpladeEncoder(
                sparse_encoder_backbone(model), special_token_ids=()
            )  # a view, for its checks
        elif isinstance(model, SpladeEncoder):
            encoder = model
        else:
            raise TypeError(
                "model must be a SpladeEncoder or a sentence-transformers SparseEncoder, "
                f"got {type(model).__name__}"
            )
        encoder.check_tokenizer(processing_class)
        encoder.check_max_length("query_max_length", args.query_max_length, tokenizer=processing_class)
        encoder.check_max_length("document_max_length", args.document_max_length, tokenizer=processing_class)
        text_columns = None
        if train_dataset is not None:
            # sentence-transformers' columns: anchor/negative names; by position for its own models.
            train_dataset = from_sentence_transformers_columns(train_dataset, positional=self._sparse_encoder)
            # Repeated pairs: load_training_data warns of them in the data (once, not again here), and the
            # collator of each batch where copies meet (the in-batch false negatives themselves).
            text_columns = validate_training_dataset(train_dataset, warn_repeats=False)
        validate_run(
            args,
            num_train_rows=None if train_dataset is None else len(train_dataset),
            text_columns=text_columns,
        )
        if isinstance(kwargs.get("eval_dataset"), Mapping):  # several named evaluation sets
            kwargs["eval_dataset"] = {
                name: from_sentence_transformers_columns(dataset, positional=self._sparse_encoder)
                for name, dataset in kwargs["eval_dataset"].items()
            }
        elif kwargs.get("eval_dataset") is not None:
            kwargs["eval_dataset"] = from_sentence_transformers_columns(
                kwargs["eval_dataset"], positional=self._sparse_encoder
            )
        token_cache = None
        if (
            data_collator is None
        ):  # before the workers' one-thread setting: the tokenizer's threads tokenize it
            token_cache = TokenCache.for_dataset(
                processing_class,
                train_dataset,
                text_columns,
                query_max_length=args.query_max_length,
                document_max_length=args.document_max_length,
            )
        if token_cache is not None:
            args.pretokenized_batches()
            logger.info(
                "Every training text is tokenized before training: a batch is only padded "
                "(dataloader_num_workers %d).",
                args.dataloader_num_workers,
            )
        if args.dataloader_num_workers > 0:
            # The workers fork from this process, which may have tokenized with the tokenizer's thread pool (an
            # evaluator's encoding): a forked pool deadlocks, so each worker tokenizes on one thread (which
            # tokenizers would otherwise fall back to with a warning per worker).
            os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        evaluated = kwargs.get("eval_dataset")
        for dataset in [
            train_dataset,
            *(evaluated.values() if isinstance(evaluated, Mapping) else [evaluated]),
        ]:
            check_loss_reads_columns(loss, dataset)
        with_teacher = batch_teacher is not None
        if (args.in_batch_teacher is not None) != with_teacher or (
            with_teacher and data_collator is not None
        ):
            raise ValueError(
                "in_batch_teacher needs its batch_teacher (gradcache_sparton.mining.batch_teacher_for_run(args, "
                "train_dataset)) and the default collator, and a batch_teacher needs in_batch_teacher set"
            )
        if data_collator is None:
            data_collator = TrainingCollator(
                processing_class,
                query_max_length=args.query_max_length,
                document_max_length=args.document_max_length,
                # one shape where a max_memory plan is made; elsewhere batches keep their own lengths
                pad_to_max_length=plans_memory(args, args.device.type, data_parallel=args.world_size > 1),
                token_cache=token_cache,
                batch_teacher=batch_teacher,
            )
        super().__init__(
            model=model,
            args=args,
            train_dataset=train_dataset,
            processing_class=processing_class,
            data_collator=data_collator,
            **kwargs,
        )
        check_sharding(self, sparse_encoder=self._sparse_encoder)
        self.loss = loss
        # The loss needs no labels: without this, evaluation calls model(**inputs) instead of compute_loss.
        self.can_return_loss = True
        self._component_sums: dict[str, Tensor] = {}
        self._component_calls = 0
        self._train_data = TrainDataRecord(self.train_dataset)  # train_data.json beside each checkpoint
        self._sequences_since_log = 0
        self._last_log_time: float | None = None
        # Rows so far whose positive repeated another row's in its batch, as the batches report them (the
        # collator's own count stays in a dataloader worker's process when there are workers).
        self._repeated_positives = 0
        # The settings the training engine runs with (logged when they change) and, with max_memory, its plan
        # in effect (logged once per plan; see log).
        self.engine_settings: StepSettings | None = None
        self.memory_plan: MemoryPlan | None = None
        self._memory_plan_logged: MemoryPlan | None = None

    # ------------------------------------------------------------------ training

    def train(self, resume_from_checkpoint: str | bool | None = None, **kwargs: Any) -> Any:
        """``Trainer.train`` after checking that ``output_dir`` holds no other run."""
        if isinstance(resume_from_checkpoint, str):
            check_resume_checkpoint(resume_from_checkpoint)
        if not resume_from_checkpoint and not self.args.overwrite_output_dir:
            check_output_dir_is_free(self.args.output_dir)
        checkpoint = (
            get_last_checkpoint(self.args.output_dir)
            if resume_from_checkpoint is True
            else resume_from_checkpoint
        )
        if isinstance(checkpoint, str):  # the same training data as the checkpoint's, or the switch recorded
            self._train_data.resume(checkpoint, allow_changed=self.args.allow_changed_train_data)
        world = max(1, self.args.world_size)
        if world == 1 and torch.cuda.is_available() and torch.cuda.device_count() > 1:
            logger.warning(
                "%d GPUs are visible and this process trains on one (%s): the cached loss does not run under "
                "nn.DataParallel. To train on all of them, launch one process each: `accelerate launch "
                "--multi_gpu --num_processes %d --module gradcache_sparton.cli train ...` (docs/training.md).",
                torch.cuda.device_count(),
                self.args.device,
                torch.cuda.device_count(),
            )
        if isinstance(
            self.model, SpladeEncoder
        ):  # saved checkpoints remember the lengths they were trained at
            self.model.query_max_length = self.args.query_max_length
            self.model.document_max_length = self.args.document_max_length
        self._last_log_time = time.perf_counter()
        # One live run per output_dir; re-entrant, so run_training's lock over the whole job covers this.
        saves = self.args.should_save and self.args.output_dir is not None
        lock = output_dir_lock(self.args.output_dir) if saves else nullcontext()
        with lock:
            result = super().train(resume_from_checkpoint=resume_from_checkpoint, **kwargs)
        if self.state.global_step < self.state.max_steps:
            logger.warning(
                "Training stopped at step %d of %d (a stop signal or a callback): the model is not the finished "
                "run's; resume from the last checkpoint with resume_from_checkpoint.",
                self.state.global_step,
                self.state.max_steps,
            )
        return result

    def compute_loss(
        self,
        model: nn.Module,
        inputs: Mapping[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: Tensor | int | None = None,
    ) -> Tensor | tuple[Tensor, dict[str, Tensor]]:
        """The full-batch SPLADE loss through the GradCache engine; ``backward()`` replays the mini-batches.

        The :class:`CachedLoss` wraps the model the Trainer passes (DDP- or compile-wrapped); everything
        one step needs lives in the loss tensor's graph, not on the engine. Under several
        processes it gathers their reps (the loss, logged as is, is the global batch's, the same on
        every process) and synchronises gradients on the last replayed mini-batch only.
        """
        columns, loss_kwargs = inputs["columns"], inputs["loss_kwargs"]
        cached = self._cached_loss(model, columns)
        loss, components = cached(columns, return_components=True, step=self.state.global_step, **loss_kwargs)
        if model.training:
            self._record(components, columns)
            self._repeated_positives += inputs.get("repeated_positives", 0)
            self._note_engine_settings(cached.engine)
        return (loss, components) if return_outputs else loss

    def _note_engine_settings(self, engine: GradCache) -> None:
        """Keep, and log when they change, the settings the training engine ran this step with (decided when
        it was built, and by each ``max_memory`` plan), and its plan; the first time, after the effective
        batch."""
        if engine.memory_plan is not None:
            self.memory_plan = engine.memory_plan
        if engine.settings == self.engine_settings:
            return
        first, self.engine_settings = self.engine_settings is None, engine.settings
        if not self.is_world_process_zero():
            return
        if first:
            world = max(1, self.args.world_size)
            logger.info(
                "Effective batch: %d per device x %d process(es) = %d rows per loss%s (x %d accumulation steps "
                "per optimizer step); mini_batch_size %s%s; sparse_reps %s.",
                self.args.per_device_train_batch_size,
                world,
                self.args.per_device_train_batch_size * world,
                " (reps gathered across processes)" if world > 1 else "",
                self.args.gradient_accumulation_steps,
                engine.settings.mini_batch_size_text(),
                self._unplanned_note(engine),
                engine.settings.sparse_reps,
            )
        logger.info("GradCache engine settings: %s.", engine.settings.describe())

    def _unplanned_note(self, engine: GradCache) -> str:
        """What the start line says of a ``max_memory`` that planned nothing on one process off CUDA (under
        data parallelism the engine says it when built): where plans run and what applies instead."""
        device = self.args.device.type
        if (
            engine.config.max_memory is None
            or self.args.world_size > 1
            or plans_memory(engine.config, device, data_parallel=False)
        ):
            return ""
        return (
            f" (max_memory {engine.config.max_memory} is planned on one CUDA device only: on {device}, the "
            "engine's defaults apply to the options left unset)"
        )

    def _cached_loss(self, model: nn.Module, columns: Mapping[str, Any]) -> CachedLoss:
        """The GradCache engine over ``model``, built from the arguments (the one place it is): kept across
        steps (its CUDA graphs are recorded once), rebuilt when the Trainer passes another model (its
        DDP- or compile-wrapped one in training, the plain one in evaluation) or other columns."""
        if (
            self._engine is None
            or self._engine_key is None
            or self._engine_key[0] is not model
            or (self._engine_key[1] != tuple(columns))
        ):
            encoder, mini_batch_context = model, None
            if self._sparse_encoder:  # called with a features dict; the view hides DDP from the engine
                encoder, ddp = as_rep_encoder(model), find_ddp(model)
                mini_batch_context = None if ddp is None else ddp_no_sync_context(ddp)
            config = self.args.grad_cache_config(columns)
            self._engine = CachedLoss(encoder, self.loss, config, mini_batch_context=mini_batch_context)
            self._engine_key = (model, tuple(columns))
        return self._engine

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        """``Trainer.create_optimizer``, with a trained query table's parameters in a group of their own at
        ``args.table_learning_rate()`` (same weight decay and schedule); an optimizer given to the
        Trainer is left as it is."""
        created = self.optimizer is None
        optimizer = super().create_optimizer(model)
        table = {id(p) for p in query_table_parameters(self.model if model is None else model)}
        if not created or not table:
            return optimizer
        moved, decay = [], 0.0
        for group in optimizer.param_groups:
            kept = [p for p in group["params"] if id(p) not in table]
            if len(kept) < len(group["params"]):
                moved += [p for p in group["params"] if id(p) in table]
                decay, group["params"] = group["weight_decay"], kept
        if moved:
            rate = self.args.table_learning_rate()
            optimizer.add_param_group({"params": moved, "lr": rate, "weight_decay": decay})
            logger.info(
                "Query table: learning rate %g (%d tensor(s)), the rest %g.",
                rate,
                len(moved),
                self.args.learning_rate,
            )
        return optimizer

    # ------------------------------------------------------------------ logging

    def _record(self, components: Mapping[str, Tensor], columns: Mapping[str, Mapping[str, Tensor]]) -> None:
        # Kept as device tensors: no host sync per step, one .item() per logged value.
        for name, value in components.items():
            value = value.detach().float()
            self._component_sums[name] = self._component_sums.get(name, 0) + value
        self._component_calls += 1
        self._sequences_since_log += sum(len(features["input_ids"]) for features in columns.values())

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Add the mean loss components, sparsity and sequences/s since the last log to training logs."""
        if "loss" in logs and self._component_calls:
            for name, total in self._component_sums.items():
                logs[name] = (total / self._component_calls).item()
            now = time.perf_counter()
            if self._last_log_time is not None and now > self._last_log_time:
                logs["train_sequences_per_second"] = round(
                    self._sequences_since_log * max(1, self.args.world_size) / (now - self._last_log_time), 2
                )
            logs["global_batch_size"] = self.args.per_device_train_batch_size * max(1, self.args.world_size)
            if self._repeated_positives:  # rows so far (this process) whose positive repeated another's
                logs["repeated_positives"] = self._repeated_positives
            collapsed = [name for name in _NONZERO_COMPONENTS if logs.get(name) == 0.0]
            if collapsed:
                # relu passes no gradient once every activation is <= 0: training cannot recover from this.
                logger.warning(
                    "The sparse reps collapsed to all zeros (%s = 0 at step %d): the loss can no longer "
                    "improve. Lower query_reg_weight/doc_reg_weight, lengthen reg_warmup_steps or lower the "
                    "learning rate.",
                    ", ".join(collapsed),
                    self.state.global_step,
                )
            if self.memory_plan is not None and self.memory_plan is not self._memory_plan_logged:
                logs.update(self.memory_plan.log_values())  # each plan once, with the first log after it
                self._memory_plan_logged = self.memory_plan
            self._component_sums, self._component_calls, self._sequences_since_log = {}, 0, 0
            self._last_log_time = now
        super().log(logs, start_time)

    # ------------------------------------------------------------------ checkpoints

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """``Trainer.save_model``; under FSDP every rank takes part in gathering the full state dict, and the
        main process writes the standard checkpoint (the Trainer's own FSDP save writes sharded files)."""
        if not self.is_fsdp_enabled:
            super().save_model(output_dir, _internal_call)
            return
        state_dict = self.accelerator.get_state_dict(self.model)  # full tensors on the main process
        self._save(output_dir, state_dict=state_dict)

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """Write a standard masked-LM checkpoint (+ tokenizer, splade_config.json, training args)."""
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if not self.args.should_save:
            return
        try:
            self._write_model(output_dir, state_dict)
        except (OSError, RuntimeError) as exc:  # the checkpoint's folder is marked by _save_checkpoint
            if isinstance(exc, CheckpointWriteError):
                raise
            raise checkpoint_write_error(output_dir, exc, mark_incomplete=False) from exc

    def _write_model(self, output_dir: str, state_dict: dict | None) -> None:
        os.makedirs(output_dir, exist_ok=True)
        encoder = self.accelerator.unwrap_model(self.model, keep_torch_compile=False)
        if self._sparse_encoder:  # sentence-transformers' format, tokenizer included, as its trainer saves
            encoder.save_pretrained(output_dir)
        else:
            encoder.save_pretrained(output_dir, tokenizer=self.processing_class, state_dict=state_dict)
            # Also a sentence-transformers SparseEncoder (truncating at the documents' trained length),
            # where it has an equivalent: not for decoder-only LMs or echo/prefix pooling.
            if sentence_transformers_can_load(encoder):
                write_sentence_transformers_files(
                    output_dir,
                    encoder=encoder,
                    max_seq_length=self.args.document_max_length,
                    card=run_model_card(self, encoder),
                )
        torch.save(self.args, os.path.join(output_dir, "training_args.bin"))
        self._train_data.write(output_dir)

    def _save_checkpoint(self, model: nn.Module, trial: Any) -> None:
        """``Trainer._save_checkpoint``; a failed write (a full disk) names the file and leaves no folder that
        looks like a complete checkpoint (renamed ``checkpoint-N.incomplete``)."""
        try:
            super()._save_checkpoint(model, trial)
        except (OSError, RuntimeError) as exc:
            if isinstance(exc, CheckpointWriteError) or not self.args.should_save:
                raise
            folder = (
                Path(self._get_output_dir(trial=trial)) / f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
            )
            raise checkpoint_write_error(folder, exc, mark_incomplete=True) from exc

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        """Load the weights of one of our (standard masked- or causal-LM) checkpoints into the encoder: the
        backbone and an inference-free model's query table, into the shards under FSDP."""
        encoder = self.accelerator.unwrap_model(model if model is not None else self.model)
        # sentence-transformers' folder, whole; under FSDP into every rank's shards (which check_sharding refuses
        # for a SparseEncoder while its save gathers on the main process alone)
        if self._sparse_encoder:
            loaded = type(encoder)(resume_from_checkpoint, device="cpu", local_files_only=True)
            load_full_state_dict(encoder, loaded.state_dict(), sharded=self.is_fsdp_enabled)
            return
        # The backbone (its own class: a masked LM, or a decoder-only LM's causal-LM class), strict, and an
        # inference-free run's query table; under FSDP full tensors into every rank's shards.
        load_checkpoint_weights(encoder, resume_from_checkpoint, sharded=self.is_fsdp_enabled)

    def _load_best_model(self) -> None:
        best = self.state.best_model_checkpoint
        logger.info("Loading best model from %s (score: %s).", best, self.state.best_metric)
        self._load_from_checkpoint(best)
