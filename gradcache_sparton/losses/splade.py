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

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor

from gradcache_sparton.losses.blocked import check_block_size
from gradcache_sparton.losses.columns import ContrastiveColumns, split_columns
from gradcache_sparton.losses.contrastive import (
    AUTO_SCORE_PATH,
    DENSE_SCORES,
    ScorePath,
    Scores,
    check_teacher_scores,
    check_temperature,
    info_nce,
    info_nce_loss,
    kl_div,
    kl_div_loss,
    margin_mse,
    margin_mse_loss,
)
from gradcache_sparton.losses.fused_lse import SCORE_KERNELS, check_score_kernel
from gradcache_sparton.losses.regularizers import REGULARIZER_CORES, REGULARIZERS, get_regularizer
from gradcache_sparton.losses.schedule import (
    WARMUP_SHAPES,
    WarmupSchedule,
    check_step,
    check_warmup,
    check_weight,
)
from gradcache_sparton.losses.sparse import (
    SPARSE_SCORES,
    sparse_expected_flops,
    sparse_flops,
    sparse_l1,
    sparse_mean_nonzeros,
    split_sparse_columns,
    upcast_sparse,
)
from gradcache_sparton.losses.sparsity import unchecked_expected_flops, unchecked_mean_nonzeros
from gradcache_sparton.primitives.option_field import option
from gradcache_sparton.primitives.sparse_reps import SparseReps

__all__ = ["CONTRASTIVE_LOSSES", "IN_BATCH_NORMALISATIONS", "SpladeLoss", "SpladeLossConfig"]

# Names accepted for ``SpladeLossConfig.contrastive``, each the public (checking) loss function.
CONTRASTIVE_LOSSES: dict[str, Callable[..., Tensor]] = {
    "infonce": info_nce_loss,
    "margin_mse": margin_mse_loss,
    "kl_div": kl_div_loss,
}


def _check_no_loss_kwargs(columns: ContrastiveColumns) -> None:
    """InfoNCE takes no loss kwargs: passing one is a ``TypeError`` that names it."""


# Name -> (check of the loss kwargs against checked columns, unchecked core): SpladeLoss checks its
# input once and calls the cores, which the public functions of CONTRASTIVE_LOSSES also call. A core
# takes the columns and the Scores of their layout (dense or sparse).
_CONTRASTIVE_CORES: dict[str, tuple[Callable[..., None], Callable[..., Tensor]]] = {
    "infonce": (_check_no_loss_kwargs, info_nce),
    "margin_mse": (functools.partial(check_teacher_scores, loss="margin_mse_loss"), margin_mse),
    "kl_div": (functools.partial(check_teacher_scores, loss="kl_div_loss"), kl_div),
}

# How an in-batch teacher's scores are put on one scale per query (gradcache_sparton.mining.teacher_scores):
# zscore is not among them (it normalises against the query's top K over a corpus, which no batch searches).
IN_BATCH_NORMALISATIONS = ("minmax", "none")

_SPARSE_REGULARIZER_CORES: dict[str, Callable[..., Tensor]] = {"flops": sparse_flops, "l1": sparse_l1}


class _Layout(NamedTuple):
    """The pieces of the loss for one rep layout (dense [B, V] tensors, or :class:`SparseReps`)."""

    split: Callable[[Mapping[str, Any]], Any]  # reps -> checked (q_reps, pos_reps, neg_reps)
    upcast: Callable[[Any], Any]  # one fp32 copy of a half-precision column
    scores: Scores  # how the contrastive cores score this layout
    regularizers: Mapping[str, Callable[..., Tensor]]  # name -> core over a list of columns
    mean_nonzeros: Callable[..., Tensor]
    expected_flops: Callable[..., Tensor]
    l0_mask: Callable[
        [Any, int], Any
    ]  # (column, threshold) -> the column with rows of <= threshold non-zeros zeroed


def _upcast(reps: Tensor) -> Tensor:
    """fp32 copy of half-precision reps (fp32 and fp64 pass unchanged)."""
    return reps.to(torch.promote_types(reps.dtype, torch.float32))


def _l0_mask(reps: Tensor, threshold: int) -> Tensor:
    """[B, V] reps with every row of at most ``threshold`` non-zeros zeroed (differentiable in the rest)."""
    keep = (reps != 0).sum(dim=1, keepdim=True) > threshold  # [B, 1], no gradient
    return reps * keep


def _sparse_l0_mask(reps: SparseReps, threshold: int) -> SparseReps:
    """:func:`_l0_mask` of sparse reps: the masked rows' weights zeroed in place of removing them (for the
    regularizer only, which sums weights: the zeros add nothing)."""
    counts = reps.nonzeros_per_row()  # [N]
    keep = torch.repeat_interleave(counts > threshold, counts, output_size=reps.weights.numel())  # [nnz]
    return SparseReps(reps.offsets, reps.token_ids, reps.weights * keep, reps.vocab_size)


_DENSE = _Layout(
    split_columns,
    _upcast,
    DENSE_SCORES,
    REGULARIZER_CORES,
    unchecked_mean_nonzeros,
    unchecked_expected_flops,
    _l0_mask,
)
_SPARSE = _Layout(
    split_sparse_columns,
    upcast_sparse,
    SPARSE_SCORES,
    _SPARSE_REGULARIZER_CORES,
    sparse_mean_nonzeros,
    sparse_expected_flops,
    _sparse_l0_mask,
)


@dataclass
class SpladeLossConfig:
    """Configuration of :class:`SpladeLoss`: one set of names, also the training arguments' loss flags.

    :class:`~gradcache_sparton.arguments.CachedSpladeTrainingArguments` inherits these fields (same
    names, defaults and help, usable with ``transformers.HfArgumentParser``), and ``__post_init__`` is
    the one place they are checked: each invalid field raises a ``ValueError`` or ``TypeError`` naming it.

    The default regularizer weights suit InfoNCE at SPLADE's scale; MarginMSE values are orders of
    magnitude larger than InfoNCE's, so distillation needs its own (larger) weights.
    """

    query_reg_weight: float = option(
        5e-4, "Final weight of the query regularizer, >= 0. Larger: sparser queries, lower recall."
    )
    doc_reg_weight: float = option(
        3e-4, "Final weight of the document regularizer, >= 0. Larger: smaller index, faster search."
    )
    contrastive: str = option(
        "infonce",
        "Ranking loss: 'infonce' (in-batch + hard negatives), or a distillation loss that needs "
        "teacher_scores [B, 1+k] (a teacher_scores data column): 'margin_mse' (margins) or 'kl_div' "
        "(listwise KL between the teacher's and the student's softmax over each query's candidates, "
        "as SPLADE-v3).",
        choices=sorted(CONTRASTIVE_LOSSES),
    )
    query_regularizer: str = option(
        "flops", "Query sparsity regularizer: 'flops' (SPLADE) or 'l1'.", choices=sorted(REGULARIZERS)
    )
    doc_regularizer: str = option(
        "flops", "Document sparsity regularizer: 'flops' (SPLADE) or 'l1'.", choices=sorted(REGULARIZERS)
    )
    doc_reg_l0_threshold: int | None = option(
        None,
        "doc_regularizer 'flops' only: documents with at most this many non-zeros add nothing to the "
        "FLOPS sum (still counted in its mean), so only denser ones are pushed sparser: FLOPS with l0 masking "
        "(arXiv 2504.14839; sentence-transformers' FlopsLoss(threshold)), for inference-free models. None: "
        "every document.",
    )
    temperature: float = option(
        1.0,
        "Student temperature of infonce and kl_div, > 0. 1.0 is SPLADE's: raw dot products are "
        "already logit-scaled. Must stay 1.0 with margin_mse.",
    )
    reg_warmup_steps: int = option(
        0,
        "Optimizer steps over which the regularizer weights rise from 0 to their final values "
        "(SPLADE: 50,000). 0: full weights from the start, which can collapse a fresh head to all zeros.",
    )
    reg_warmup_shape: str = option(
        "quadratic",
        "Regularizer warm-up ramp: 'quadratic' (SPLADE) or 'linear'.",
        choices=sorted(WARMUP_SHAPES),
    )

    teacher_temperature: float = option(
        1.0, "kl_div only: divides the teacher scores before their softmax, > 0."
    )
    kl_in_batch: bool = option(
        False,
        "kl_div only: the student's softmax also covers the other queries' documents (in-batch "
        "negatives, teacher probability 0 but by in_batch_teacher). Costs InfoNCE's [B, (1+k)·B] scores.",
    )
    in_batch_teacher: str | None = option(
        None,
        "kl_div with kl_in_batch: TEACHER[:WEIGHT],... scoring every document of each batch (a model "
        "folder or bm25; docs/distillation.md).",
    )
    in_batch_teacher_normalisation: str = option(
        IN_BATCH_NORMALISATIONS[0],
        "in_batch_teacher per query: 'minmax' (x30) or 'none'.",
        choices=list(IN_BATCH_NORMALISATIONS),
    )
    score_block_size: int | None = option(
        None,
        "infonce and kl_div with kl_in_batch: compute the [B, (1+k)·B] scores in blocks of this "
        "many queries x documents (memory O(block²), not O(B²); one extra matmul pass; equal up to fp32 "
        "summation order). Default: blocks of 4,096 only when the fp32 scores would exceed 1 GiB.",
    )

    shard_scores_across_ranks: bool = option(
        False,
        "infonce and kl_div with kl_in_batch, under data parallelism whose loss sees the batch "
        "gathered from every rank (the cached trainer's): each of the W ranks scores 1/W of the queries, "
        "in blocks, and the ranks' results are summed (one all-reduce of B floats forward, one per column "
        "of the rep gradients' size backward): W times less score work per rank, the same loss and "
        "gradients up to fp32 summation order. Every rank must call the loss with the same reps.",
    )

    score_kernel: str = option(
        "auto",
        "infonce and kl_div with kl_in_batch, on sparse reps (the engine's sparse_reps): how the [B, (1+k)·B] "
        "scores' log-sum-exp runs. 'fused': Triton kernels that keep each score tile on chip (GPU; fp32 "
        "accumulation, within a documented bound of fp64); 'blocked': score blocks in memory "
        "(score_block_size); 'auto': fused on a GPU from losses.fused_lse.FUSED_MIN_QUERIES (4,096) queries on, "
        "where it was measured faster (docs/scale.md), else blocked; blocked whenever score_block_size is set. "
        "Dense reps always run blocked; 'fused' in a training run needs sparse_reps true and a GPU.",
        choices=list(SCORE_KERNELS),
    )

    def __post_init__(self) -> None:
        check_weight(self.query_reg_weight, name="query_reg_weight")
        check_weight(self.doc_reg_weight, name="doc_reg_weight")
        if self.contrastive not in CONTRASTIVE_LOSSES:
            raise ValueError(
                f"contrastive must be one of {sorted(CONTRASTIVE_LOSSES)}, got {self.contrastive!r}"
            )
        get_regularizer(self.query_regularizer, argument="query_regularizer")
        get_regularizer(self.doc_regularizer, argument="doc_regularizer")
        if self.doc_reg_l0_threshold is not None:
            threshold = self.doc_reg_l0_threshold
            if isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 0:
                raise ValueError(f"doc_reg_l0_threshold must be an int >= 0 or None, got {threshold!r}")
            if self.doc_regularizer != "flops":
                raise ValueError(
                    f"doc_reg_l0_threshold applies to doc_regularizer='flops' only, got {self.doc_regularizer!r}"
                )
        check_temperature(self.temperature)
        if self.contrastive == "margin_mse" and self.temperature != 1.0:
            raise ValueError(
                f"temperature applies to contrastive='infonce' or 'kl_div' only, got "
                f"temperature={self.temperature} with contrastive={self.contrastive!r}"
            )
        check_temperature(self.teacher_temperature, name="teacher_temperature")
        if not isinstance(self.kl_in_batch, bool):
            raise TypeError(f"kl_in_batch must be a bool, got {type(self.kl_in_batch).__name__}")
        if self.contrastive != "kl_div" and (self.teacher_temperature != 1.0 or self.kl_in_batch):
            raise ValueError(
                f"teacher_temperature and kl_in_batch apply to contrastive='kl_div' only, got "
                f"teacher_temperature={self.teacher_temperature}, kl_in_batch={self.kl_in_batch} with "
                f"contrastive={self.contrastive!r}"
            )
        self._check_in_batch_teacher()
        check_block_size(self.score_block_size, name="score_block_size")
        if not isinstance(self.shard_scores_across_ranks, bool):
            raise TypeError(
                f"shard_scores_across_ranks must be a bool, got {type(self.shard_scores_across_ranks).__name__}"
            )
        scores_whole_batch = self.contrastive == "infonce" or (
            self.contrastive == "kl_div" and self.kl_in_batch
        )
        if self.shard_scores_across_ranks and not scores_whole_batch:
            raise ValueError(
                "shard_scores_across_ranks applies to contrastive='infonce' or 'kl_div' with kl_in_batch only "
                f"(the losses with a [B, (1+k)·B] score matrix), got contrastive={self.contrastive!r}, "
                f"kl_in_batch={self.kl_in_batch}"
            )
        if self.score_block_size is not None and not scores_whole_batch:
            raise ValueError(
                f"score_block_size applies to contrastive='infonce' or 'kl_div' with kl_in_batch only (the "
                f"losses with a [B, (1+k)·B] score matrix), got score_block_size={self.score_block_size} with "
                f"contrastive={self.contrastive!r}, kl_in_batch={self.kl_in_batch}"
            )
        check_score_kernel(self.score_kernel)
        if self.score_kernel != "auto" and not scores_whole_batch:
            raise ValueError(
                f"score_kernel applies to contrastive='infonce' or 'kl_div' with kl_in_batch only, got "
                f"score_kernel={self.score_kernel!r} with contrastive={self.contrastive!r}, "
                f"kl_in_batch={self.kl_in_batch}"
            )
        if self.score_kernel == "fused" and self.score_block_size is not None:
            raise ValueError(
                f"score_block_size sets the blocked path's blocks, got score_block_size={self.score_block_size} "
                "with score_kernel='fused' (its tiles are its own): drop one of them"
            )
        check_warmup(
            self.reg_warmup_steps,
            self.reg_warmup_shape,
            steps_name="reg_warmup_steps",
            shape_name="reg_warmup_shape",
        )

    def _check_in_batch_teacher(self) -> None:
        teacher, normalisation = self.in_batch_teacher, self.in_batch_teacher_normalisation
        if teacher is not None and (not isinstance(teacher, str) or not teacher.strip()):
            raise ValueError(f"in_batch_teacher must be TEACHER[:WEIGHT],... or None, got {teacher!r}")
        if teacher is not None and not (self.contrastive == "kl_div" and self.kl_in_batch):
            raise ValueError(
                "in_batch_teacher scores every document of the batch for the student's in-batch softmax: it "
                f"needs contrastive='kl_div' with kl_in_batch, got contrastive={self.contrastive!r}, "
                f"kl_in_batch={self.kl_in_batch}"
            )
        if normalisation not in IN_BATCH_NORMALISATIONS:
            raise ValueError(
                f"in_batch_teacher_normalisation must be one of {IN_BATCH_NORMALISATIONS}, got {normalisation!r}"
                " (zscore normalises against the query's top K over a corpus, which a batch does not search)"
            )
        if teacher is None and normalisation != IN_BATCH_NORMALISATIONS[0]:
            raise ValueError(
                f"in_batch_teacher_normalisation applies to an in_batch_teacher only, got {normalisation!r} without one"
            )


class SpladeLoss:
    """SPLADE loss over a reps mapping: contrastive + warmed-up query and document regularizers.

    Follows the loss contract: ``loss(reps, *, step=None, **loss_kwargs) -> (loss, components)``, where
    ``reps`` maps column names to [B, V] tensors (queries, positives, then hard-negative columns) and
    ``loss_kwargs`` go to the contrastive loss (``teacher_scores`` for MarginMSE and listwise KL).
    ``components`` holds detached 0-d fp32 tensors for logging:

    - ``contrastive``: the ranking loss;
    - ``reg_query``, ``reg_doc``: the unweighted regularizer values;
    - ``reg_weight_query``, ``reg_weight_doc``: the warmed-up weights used at this step;
    - ``nnz_query``, ``nnz_doc``: mean non-zeros per query rep and per document rep;
    - ``flops``: expected multiply-adds per (query, document) score, ``sum_v p_q(v) · p_d(v)``.

    Memory: that of the contrastive loss (InfoNCE: ~12·(1+k)·B² bytes for scores while they fit 1 GiB,
    a few score blocks beyond, see ``score_block_size``); the regularizers add O(V).

    Sparse reps: ``reps`` may map every column to a
    :class:`~gradcache_sparton.primitives.sparse_reps.SparseReps` instead (what the GradCache engine's
    ``sparse_reps`` passes); the same loss and components are then computed on the non-zeros, with
    gradients w.r.t. each column's ``weights`` (:mod:`.sparse`): memory O(nnz) plus a few [block, V]
    buffers (``score_block_size``; by default 4,096 rows, fewer at large V: each buffer within
    512 MiB, :func:`~.sparse.sparse_block_size`), the scores always in blocks.
    """

    def __init__(self, config: SpladeLossConfig) -> None:
        if not isinstance(config, SpladeLossConfig):
            raise TypeError(f"config must be a SpladeLossConfig, got {type(config).__name__}")
        self.config = config
        check, self._contrastive = _CONTRASTIVE_CORES[config.contrastive]
        # Listwise KL over the batch's documents also takes a teacher of every document ([B, (1+k)·B]).
        in_batch = config.contrastive == "kl_div" and config.kl_in_batch
        self._check_loss_kwargs = functools.partial(check, in_batch=True) if in_batch else check
        self._contrastive_kwargs = _contrastive_settings(config)
        self._query_schedule = WarmupSchedule(
            final_weight=config.query_reg_weight,
            warmup_steps=config.reg_warmup_steps,
            shape=config.reg_warmup_shape,
        )
        self._doc_schedule = WarmupSchedule(
            final_weight=config.doc_reg_weight,
            warmup_steps=config.reg_warmup_steps,
            shape=config.reg_warmup_shape,
        )
        self._step = 0

    @property
    def step(self) -> int:
        """The step used when a call passes no ``step`` (set by :meth:`set_step`, initially 0)."""
        return self._step

    def set_step(self, step: int) -> None:
        """Set the step (optimizer steps taken, >= 0) for calls that pass no ``step``."""
        check_step(step)
        self._step = step

    def weights(self, step: int | None = None) -> tuple[float, float]:
        """(query weight, document weight) at ``step`` (default: :attr:`step`)."""
        step = self._step if step is None else step
        check_step(step)
        return self._query_schedule(step), self._doc_schedule(step)

    def __call__(
        self, reps: Mapping[str, Tensor], *, step: int | None = None, **loss_kwargs: Tensor
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """The total loss (0-d, differentiable in ``reps``) and its detached components (class doc).

        The one check of this step's input: the columns and ``loss_kwargs`` are validated here, before
        any work; the contrastive loss, the regularizers and the statistics then trust them.
        """
        sparse = isinstance(reps, Mapping) and any(isinstance(column, SparseReps) for column in reps.values())
        layout = _SPARSE if sparse else _DENSE
        columns = layout.split(reps)
        self._check_loss_kwargs(columns, **loss_kwargs)
        query_weight, doc_weight = self.weights(step)
        # Upcast half-precision reps once: scoring needs fp32 copies anyway, and sharing them lets the
        # contrastive and regularizer gradients accumulate in one fp32 buffer per column, cast back once
        # (separately, the bf16 regularizer gradients cost another [B, V] per column at peak).
        q_reps, pos_reps = layout.upcast(columns.q_reps), layout.upcast(columns.pos_reps)
        neg_reps = [layout.upcast(column) for column in columns.neg_reps]
        columns = type(columns)(q_reps, pos_reps, neg_reps)
        d_reps = [pos_reps, *neg_reps]
        contrastive = self._contrastive(columns, layout.scores, **self._contrastive_kwargs, **loss_kwargs)
        reg_query = layout.regularizers[self.config.query_regularizer]([q_reps])
        threshold = self.config.doc_reg_l0_threshold
        reg_d_reps = d_reps if threshold is None else [layout.l0_mask(column, threshold) for column in d_reps]
        reg_doc = layout.regularizers[self.config.doc_regularizer](reg_d_reps)
        loss = contrastive + query_weight * reg_query + doc_weight * reg_doc
        device = contrastive.device
        components = {
            "contrastive": contrastive,
            "reg_query": reg_query,
            "reg_doc": reg_doc,
            # Filled on the device: torch.tensor(x, device=cuda) copies from the host, a device sync.
            "reg_weight_query": torch.full((), query_weight, device=device),
            "reg_weight_doc": torch.full((), doc_weight, device=device),
            "nnz_query": layout.mean_nonzeros([q_reps]),
            "nnz_doc": layout.mean_nonzeros(d_reps),
            "flops": layout.expected_flops([q_reps], d_reps),
        }
        return loss, {name: value.detach().to(torch.float32) for name, value in components.items()}

    def __repr__(self) -> str:
        c = self.config
        settings = ", ".join(f"{k}={v}" for k, v in self._contrastive_kwargs.items() if v is not None)
        contrastive = f"{c.contrastive}({settings})"
        return (
            f"SpladeLoss(contrastive={contrastive}, "
            f"query={c.query_reg_weight} * {c.query_regularizer}, "
            f"doc={c.doc_reg_weight} * {c.doc_regularizer}, "
            f"warmup={c.reg_warmup_shape} over {c.reg_warmup_steps} steps, step={self._step})"
        )


def _contrastive_settings(config: SpladeLossConfig) -> dict[str, Any]:
    """The config's keyword arguments of its contrastive loss (the loss kwargs add per-batch tensors)."""
    path = ScorePath(config.score_block_size, config.shard_scores_across_ranks, config.score_kernel)
    scoring = (
        {"path": path} if path != AUTO_SCORE_PATH else {}
    )  # the default: left to the cores, out of the repr
    if config.contrastive == "infonce":
        return {"temperature": config.temperature, **scoring}
    if config.contrastive == "kl_div":
        return {
            "temperature": config.temperature,
            "teacher_temperature": config.teacher_temperature,
            "in_batch": config.kl_in_batch,
            **scoring,
        }
    return {}
