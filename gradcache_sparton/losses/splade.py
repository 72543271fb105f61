"""The SPLADE training loss: a contrastive loss plus warmed-up sparsity regularizers on queries and docs.

Legend: B batch, V vocabulary, k hard negatives per query.

    loss = contrastive(reps) + w_q(step) · R_q(queries) + w_d(step) · R_d([positives; negatives])

The query regularizer sees the query column, the document regularizer every document column (positives
and hard negatives) as one batch, as SPLADE does. FLOPS is batch-coupled, so both must see the full
batch: an uncached step passes it directly, the GradCache engine passes the concatenated reps of all
mini-batches.

The current step (for the weight warm-up) reaches the loss in one of two ways; neither keeps anything
but an int between calls, so two forwards before one backward cannot clobber each other:
- ``loss(reps, step=global_step, **loss_kwargs)``: stateless, for callers that control the call;
- ``loss.set_step(global_step)`` once per optimizer step, e.g. from a trainer callback; used whenever
  ``step`` is not passed. The weights actually used are returned in the components, so a forgotten
  ``set_step`` shows in the logs as a weight stuck at its step-0 value.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
from torch import Tensor

from gradcache_sparton.losses.columns import split_columns
from gradcache_sparton.losses.contrastive import _check_temperature, info_nce_loss, margin_mse_loss
from gradcache_sparton.losses.regularizers import get_regularizer
from gradcache_sparton.losses.schedule import WARMUP_SHAPES, WarmupSchedule, _check_step
from gradcache_sparton.sparsity import expected_flops, mean_nonzeros

__all__ = ["CONTRASTIVE_LOSSES", "SpladeLoss", "SpladeLossConfig"]

# Names accepted for ``SpladeLossConfig.contrastive``.
CONTRASTIVE_LOSSES: dict[str, Callable[..., Tensor]] = {
    "infonce": info_nce_loss,
    "margin_mse": margin_mse_loss,
}


def _check_weight(value: float, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float, got {type(value).__name__}")
    if not (value >= 0 and math.isfinite(value)):
        raise ValueError(f"{name} must be a finite number >= 0, got {value}")


@dataclass
class SpladeLossConfig:
    """Configuration of :class:`SpladeLoss` (usable with ``transformers.HfArgumentParser``).

    The regularizer weights have no default: the right scale depends on the contrastive loss (MarginMSE
    values are orders of magnitude larger than InfoNCE's) and on the target sparsity.
    """

    query_weight: float = field(
        metadata={
            "help": "Final weight of the query regularizer, >= 0. Larger: sparser queries, lower recall."
        }
    )
    doc_weight: float = field(
        metadata={
            "help": "Final weight of the document regularizer, >= 0. Larger: smaller index, faster search."
        }
    )
    contrastive: str = field(
        default="infonce",
        metadata={
            "help": "Ranking loss: 'infonce' (in-batch + hard negatives) or 'margin_mse' (distillation; "
            "needs teacher_scores [B, 1+k] in the loss kwargs)."
        },
    )
    query_regularizer: str = field(
        default="flops", metadata={"help": "Query regularizer: 'flops' (SPLADE) or 'l1'."}
    )
    doc_regularizer: str = field(default="flops", metadata={"help": "Document regularizer: 'flops' or 'l1'."})
    temperature: float = field(
        default=1.0,
        metadata={
            "help": "InfoNCE temperature, > 0. 1.0 is SPLADE's: raw dot products are already logit-scaled. "
            "Must stay 1.0 with margin_mse."
        },
    )
    warmup_steps: int = field(
        default=0,
        metadata={
            "help": "Steps over which the regularizer weights rise from 0 to their final values (SPLADE: "
            "50,000). 0: full weights from the start, which can collapse a fresh head to all zeros."
        },
    )
    warmup_shape: str = field(
        default="quadratic", metadata={"help": "Warm-up ramp: 'quadratic' (SPLADE) or 'linear'."}
    )

    def __post_init__(self) -> None:
        _check_weight(self.query_weight, "query_weight")
        _check_weight(self.doc_weight, "doc_weight")
        if self.contrastive not in CONTRASTIVE_LOSSES:
            raise ValueError(
                f"contrastive must be one of {sorted(CONTRASTIVE_LOSSES)}, got {self.contrastive!r}"
            )
        get_regularizer(self.query_regularizer, argument="query_regularizer")
        get_regularizer(self.doc_regularizer, argument="doc_regularizer")
        _check_temperature(self.temperature)
        if self.contrastive != "infonce" and self.temperature != 1.0:
            raise ValueError(
                f"temperature applies to contrastive='infonce' only, got temperature={self.temperature} "
                f"with contrastive={self.contrastive!r}"
            )
        if isinstance(self.warmup_steps, bool) or not isinstance(self.warmup_steps, int):
            raise TypeError(f"warmup_steps must be an int, got {type(self.warmup_steps).__name__}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.warmup_shape not in WARMUP_SHAPES:
            raise ValueError(
                f"warmup_shape must be one of {sorted(WARMUP_SHAPES)}, got {self.warmup_shape!r}"
            )


class SpladeLoss:
    """SPLADE loss over a reps mapping: contrastive + warmed-up query and document regularizers.

    Follows the loss contract: ``loss(reps, *, step=None, **loss_kwargs) -> (loss, components)``, where
    ``reps`` maps column names to [B, V] tensors (queries, positives, then hard-negative columns) and
    ``loss_kwargs`` go to the contrastive loss (``teacher_scores`` for MarginMSE). ``components`` holds
    detached 0-d fp32 tensors for logging:

    - ``contrastive``: the ranking loss;
    - ``reg_query``, ``reg_doc``: the unweighted regularizer values;
    - ``reg_weight_query``, ``reg_weight_doc``: the warmed-up weights used at this step;
    - ``nnz_query``, ``nnz_doc``: mean non-zeros per query rep and per document rep;
    - ``flops``: expected multiply-adds per (query, document) score, ``sum_v p_q(v) · p_d(v)``.

    Memory: that of the contrastive loss (InfoNCE: ~12·(1+k)·B² bytes for scores), the regularizers
    add O(V).
    """

    def __init__(self, config: SpladeLossConfig) -> None:
        if not isinstance(config, SpladeLossConfig):
            raise TypeError(f"config must be a SpladeLossConfig, got {type(config).__name__}")
        self.config = config
        self._contrastive = CONTRASTIVE_LOSSES[config.contrastive]
        self._contrastive_kwargs = (
            {"temperature": config.temperature} if config.contrastive == "infonce" else {}
        )
        self._query_regularizer = get_regularizer(config.query_regularizer, argument="query_regularizer")
        self._doc_regularizer = get_regularizer(config.doc_regularizer, argument="doc_regularizer")
        self._query_schedule = WarmupSchedule(
            final_weight=config.query_weight, warmup_steps=config.warmup_steps, shape=config.warmup_shape
        )
        self._doc_schedule = WarmupSchedule(
            final_weight=config.doc_weight, warmup_steps=config.warmup_steps, shape=config.warmup_shape
        )
        self._step = 0

    @property
    def step(self) -> int:
        """The step used when a call passes no ``step`` (set by :meth:`set_step`, initially 0)."""
        return self._step

    def set_step(self, step: int) -> None:
        """Set the step (optimizer steps taken, >= 0) for calls that pass no ``step``."""
        _check_step(step)
        self._step = step

    def weights(self, step: int | None = None) -> tuple[float, float]:
        """(query weight, document weight) at ``step`` (default: :attr:`step`)."""
        step = self._step if step is None else step
        _check_step(step)
        return self._query_schedule(step), self._doc_schedule(step)

    def __call__(
        self, reps: Mapping[str, Tensor], *, step: int | None = None, **loss_kwargs: Tensor
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """The total loss (0-d, differentiable in ``reps``) and its detached components (class doc)."""
        split_columns(reps)  # validate before any work
        query_weight, doc_weight = self.weights(step)
        # Upcast half-precision reps once: scoring needs fp32 copies anyway, and sharing them lets the
        # contrastive and regularizer gradients accumulate in one fp32 buffer per column, cast back once
        # (separately, the bf16 regularizer gradients cost another [B, V] per column at peak).
        reps = {
            name: column.to(torch.promote_types(column.dtype, torch.float32)) for name, column in reps.items()
        }
        q_reps, pos_reps, neg_reps = split_columns(reps)
        d_reps = [pos_reps, *neg_reps]
        contrastive = self._contrastive(reps, **self._contrastive_kwargs, **loss_kwargs)
        reg_query = self._query_regularizer(q_reps)
        reg_doc = self._doc_regularizer(d_reps)
        loss = contrastive + query_weight * reg_query + doc_weight * reg_doc
        device = contrastive.device
        components = {
            "contrastive": contrastive,
            "reg_query": reg_query,
            "reg_doc": reg_doc,
            "reg_weight_query": torch.tensor(query_weight, device=device),
            "reg_weight_doc": torch.tensor(doc_weight, device=device),
            "nnz_query": mean_nonzeros(q_reps),
            "nnz_doc": mean_nonzeros(d_reps),
            "flops": expected_flops(q_reps, d_reps),
        }
        return loss, {name: value.detach().to(torch.float32) for name, value in components.items()}

    def __repr__(self) -> str:
        c = self.config
        contrastive = (
            f"{c.contrastive}(temperature={c.temperature})" if c.contrastive == "infonce" else c.contrastive
        )
        return (
            f"SpladeLoss(contrastive={contrastive}, "
            f"query={c.query_weight} * {c.query_regularizer}, doc={c.doc_weight} * {c.doc_regularizer}, "
            f"warmup={c.warmup_shape} over {c.warmup_steps} steps, step={self._step})"
        )
