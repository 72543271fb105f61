"""A ``transformers.Trainer`` callback that runs a retrieval evaluator and logs through ``trainer.log``."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from gradcache_sparton.evaluation.encoding import Encoder

__all__ = ["RetrievalEvalCallback"]


class RetrievalEvalCallback(TrainerCallback):
    """Run a :class:`SparseRetrievalEvaluator` during ``transformers.Trainer`` training and log its
    metrics through ``trainer.log`` (so every reporting integration and ``state.log_history`` see them).

    When it runs:
    - ``eval_steps=N``: at the end of every N-th optimizer step (``state.global_step % N == 0``),
      independent of the Trainer's own evaluation;
    - ``eval_steps=None``: whenever the Trainer evaluates (``on_evaluate``, i.e. its
      ``eval_strategy``); the metrics are also added to the Trainer's metrics dict, so
      ``metric_for_best_model="ndcg_at_10"`` works.

    Keys are prefixed with ``metric_key_prefix + "_"`` (``eval_ndcg_at_10``, ...). The encoder is the
    Trainer's model (``model(**features) -> [B, V]``); it is put in eval mode for the evaluation and
    restored. Under multi-process training every process evaluates (the same metrics everywhere, no
    collective to wait on); the Trainer's loggers report from the main process only.

    ``trainer`` is the Trainer to log through: ``trainer.add_callback(RetrievalEvalCallback(evaluator,
    trainer=trainer, eval_steps=500))``.
    """

    def __init__(
        self,
        evaluator: Callable[[Encoder], Mapping[str, float]],
        *,
        trainer: Any,
        eval_steps: int | None = None,
        metric_key_prefix: str = "eval",
    ) -> None:
        if not callable(evaluator):
            raise TypeError(
                f"evaluator must be callable (encoder -> metrics), got {type(evaluator).__name__}"
            )
        if not callable(getattr(trainer, "log", None)):
            raise TypeError(
                f"trainer must have a log(dict) method (a transformers.Trainer), got {type(trainer).__name__}"
            )
        if eval_steps is not None and (
            isinstance(eval_steps, bool) or not isinstance(eval_steps, int) or eval_steps < 1
        ):
            raise ValueError(f"eval_steps must be a positive int or None, got {eval_steps!r}")
        self.evaluator = evaluator
        self.trainer = trainer
        self.eval_steps = eval_steps
        self.metric_key_prefix = metric_key_prefix

    def _evaluate_and_log(self, model: Encoder) -> dict[str, float]:
        metrics = {
            f"{self.metric_key_prefix}_{name}": float(value) for name, value in self.evaluator(model).items()
        }
        self.trainer.log(dict(metrics))  # a copy: Trainer.log adds "epoch" to the dict it gets
        return metrics

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self.eval_steps is not None and state.global_step % self.eval_steps == 0:
            self._evaluate_and_log(kwargs["model"])

    def on_evaluate(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self.eval_steps is None:
            metrics = self._evaluate_and_log(kwargs["model"])
            if kwargs.get("metrics") is not None:
                kwargs["metrics"].update(metrics)
