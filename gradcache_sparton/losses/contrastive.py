"""Contrastive losses over a batch of reps: InfoNCE (in-batch and hard negatives), MarginMSE and listwise KL.

Legend: B batch (queries), V vocabulary, k hard negatives per query.

All follow the loss contract ``loss_fn(reps, **loss_kwargs) -> scalar``: ``reps`` maps column names
to [B, V] tensors in order (queries, positives, then one column per hard negative; see
:func:`~gradcache_sparton.losses.columns.split_columns`). All are pure functions of ``reps`` (no state),
so they run unchanged on an uncached batch or on the full concatenated batch inside the GradCache
engine, where autograd stops at the reps. Scores are dot products in fp32 (:mod:`.scores`).

Each loss is written once, in :func:`info_nce`, :func:`margin_mse` and :func:`kl_div`, over a
:class:`Scores` provider: how a rep layout is scored. :data:`DENSE_SCORES` scores [B, V] tensors (the
public ``*_loss`` functions here); :data:`~gradcache_sparton.losses.sparse.SPARSE_SCORES` scores
:class:`~gradcache_sparton.primitives.sparse_reps.SparseReps` (the engine's ``sparse_reps``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from gradcache_sparton.losses.blocked import (
    AUTO_BLOCK_SIZE,
    blocked_logsumexp,
    check_block_size,
    score_block_size,
)
from gradcache_sparton.losses.columns import ContrastiveColumns, accumulation_dtype, split_columns
from gradcache_sparton.losses.scores import unchecked_dot_scores, unchecked_paired_scores

__all__ = [
    "AUTO_SCORE_PATH",
    "DENSE_SCORES",
    "ScorePath",
    "Scores",
    "check_teacher_scores",
    "check_temperature",
    "info_nce",
    "info_nce_loss",
    "kl_div",
    "kl_div_loss",
    "margin_mse",
    "margin_mse_loss",
]


class Scores(Protocol):
    """How one rep layout is scored: all the contrastive losses need, for dense or sparse reps.

    ``q_reps`` and each document column hold B rows in that layout (checked before); every method
    returns fp32 scores (fp64 for fp64 reps), differentiable in the reps.
    """

    def paired(self, q_reps: Any, d_reps: Any) -> Tensor:
        """Row-wise scores ``s(q_i, d_i)`` of aligned columns -> [B]."""
        ...

    def upcast(self, *reps: Any) -> list[Any]:
        """One copy of each column in their common accumulation dtype (fp32, fp64 if any is fp64), so the
        gradients of a column used by both a log-sum-exp and paired scores are rounded once."""
        ...

    def block_size(self, q_reps: Any, num_columns: int, block_size: int | None, shard: bool) -> int | None:
        """The block edge for the scores of ``q_reps`` against ``num_columns`` document columns, from the
        requested ``block_size`` (None: automatic); None: the whole [B, num_columns·B] score matrix, which
        only dense [B, V] reps build."""
        ...

    def logsumexp(self, q_reps: Any, d_reps: Sequence[Any], *, temperature: float, path: ScorePath) -> Tensor:
        """Each query's log-sum-exp of its scaled scores against every row of ``d_reps`` -> [B], in blocks,
        along ``path`` as :meth:`ScorePath.resolve` decided it (its block edge set)."""
        ...

    def weighted(self, q_reps: Any, d_reps: Sequence[Any], weights: Tensor, *, block_size: int) -> Tensor:
        """``sum_j weights[i, j] · s(q_i, d_j)`` over every document of ``d_reps`` -> [B], differentiable in the
        reps (not in ``weights`` [B, len(d_reps)·B], column c·B + r for row r of ``d_reps[c]``); ``block_size``:
        the rows of one block where the layout works in blocks. Bilinear in (q, d), so it is exact without the
        score matrix: ``q_i · (sum_j weights[i, j] · d_j)``."""
        ...


class ScorePath(NamedTuple):
    """How the in-batch [B, (1+k)·B] scores run, the settings that travel together from the loss's config.

    ``block_size``: the block edge (None: automatic, the whole matrix while it fits, :mod:`.blocked`);
    ``shard_across_ranks``: blocked, 1/W of the queries per rank (:mod:`.blocked`); ``kernel`` ('auto',
    'fused', 'blocked'): whether the fused kernel of :mod:`.fused_lse` may run.
    """

    block_size: int | None = None
    shard_across_ranks: bool = False
    kernel: str = "auto"

    def resolve(self, scores: Scores, q_reps: Any, num_columns: int) -> ScorePath | None:
        """The path of ``q_reps`` against ``num_columns`` document columns scored by ``scores``: the block edge
        decided (:meth:`Scores.block_size`) and the kernel (:func:`_kernel`); None: the whole score matrix."""
        block = scores.block_size(q_reps, num_columns, self.block_size, self.shard_across_ranks)
        kernel = _kernel(self.kernel, self.block_size, block)
        return None if block is None else ScorePath(block, self.shard_across_ranks, kernel)

    def blocked_logsumexp(
        self, logsumexp: Callable[..., Tensor], q_reps: Any, d_reps: Sequence[Any], *, temperature: float
    ) -> Tensor:
        """``logsumexp``, one layout's blocked log-sum-exp (:func:`~.blocked.blocked_logsumexp`,
        :func:`~.sparse.sparse_blocked_logsumexp`), run along this path: its block edge and its sharding."""
        return logsumexp(
            q_reps,
            d_reps,
            temperature=temperature,
            block_size=self.block_size,
            shard_across_ranks=self.shard_across_ranks,
        )


AUTO_SCORE_PATH = ScorePath()
"""The default :class:`ScorePath`: automatic blocks, every rank scoring every query, kernel 'auto'."""


class _DenseScores:
    """:class:`Scores` of dense [B, V] tensors: products in fp32; the whole matrix while it fits 1 GiB."""

    def paired(self, q_reps: Tensor, d_reps: Tensor) -> Tensor:
        return unchecked_paired_scores(q_reps, d_reps)

    def upcast(self, *reps: Tensor) -> list[Tensor]:
        dtype = accumulation_dtype(*reps)
        return [column.to(dtype) for column in reps]

    def block_size(self, q_reps: Tensor, num_columns: int, block_size: int | None, shard: bool) -> int | None:
        B = q_reps.shape[0]
        block = score_block_size(B, num_columns * B, block_size)
        return AUTO_BLOCK_SIZE if shard and block is None else block

    def logsumexp(
        self, q_reps: Tensor, d_reps: Sequence[Tensor], *, temperature: float, path: ScorePath
    ) -> Tensor:
        if path.kernel == "fused":
            raise ValueError(_FUSED_DENSE)
        return path.blocked_logsumexp(blocked_logsumexp, q_reps, d_reps, temperature=temperature)

    def weighted(
        self, q_reps: Tensor, d_reps: Sequence[Tensor], weights: Tensor, *, block_size: int
    ) -> Tensor:
        B = q_reps.shape[0]
        dtype = accumulation_dtype(q_reps, *d_reps)
        with torch.autocast(q_reps.device.type, enabled=False):
            # [B, B] @ [B, V] per column, summed -> [B, V]: each query's teacher-weighted document.
            mixed = sum(weights[:, c * B : (c + 1) * B].to(dtype) @ d.to(dtype) for c, d in enumerate(d_reps))
        return unchecked_paired_scores(q_reps, mixed)  # [B]


DENSE_SCORES: Scores = _DenseScores()
"""The :class:`Scores` of dense [B, V] reps (:mod:`.scores`, :mod:`.blocked`)."""


# Checked columns of one layout, (queries, positives, k hard negatives) of B rows each:
# ContrastiveColumns of [B, V] tensors, or SparseColumns (:mod:`.sparse`).
_Columns = tuple[Any, Any, list[Any]]


def _whole_scores(q_reps: Tensor, d_columns: Sequence[Tensor]) -> Tensor:
    """The whole score matrix of dense reps: (1+k) x ([B, V] @ [V, B] -> [B, B]) -> [B, (1+k)·B].

    Column j·B + r holds the scores against row r of document column j. The documents are never
    concatenated into a [(1+k)·B, V] copy.
    """
    return torch.cat([unchecked_dot_scores(q_reps, d_reps) for d_reps in d_columns], dim=1)


def _kernel(score_kernel: str, block_size: int | None, block: int | None) -> str:
    """The log-sum-exp's kernel setting: ``score_kernel``, but 'auto' with an explicit ``block_size`` is
    'blocked' (a block size is the blocked path's setting; the fused kernel has its own tiles). Raises for
    'fused' where the whole score matrix is built (``block`` None: dense reps below the blocking size)."""
    if score_kernel == "fused" and block is None:
        raise ValueError(_FUSED_DENSE)
    return "blocked" if score_kernel == "auto" and block_size is not None else score_kernel


_FUSED_DENSE = (
    "score_kernel='fused' scores sparse reps only (the engine's sparse_reps); dense [B, V] reps run the "
    "blocked path or the whole score matrix: use score_kernel='auto' or 'blocked'"
)


def check_temperature(temperature: float, *, name: str = "temperature") -> None:
    """Raise unless ``temperature`` is a finite number > 0; ``name`` names the argument."""
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise TypeError(f"{name} must be a positive float, got {type(temperature).__name__}")
    if not (temperature > 0 and math.isfinite(temperature)):
        raise ValueError(f"{name} must be a finite number > 0, got {temperature}")


def info_nce_loss(
    reps: Mapping[str, Tensor], *, temperature: float = 1.0, block_size: int | None = None
) -> Tensor:
    """InfoNCE (multiple-negatives ranking) with in-batch negatives and optional hard negatives.

    Query i is scored against every document of the batch: all B positives and all k·B hard negatives,
    ``scores = q @ [pos; neg_1; ...; neg_k]^T / temperature`` ([B, (1+k)·B]); the loss is the
    cross-entropy with target i (its own positive), averaged over the B queries. Every other query's
    positive and every hard negative of the batch act as negatives for query i.

    ``temperature`` defaults to 1.0, SPLADE's convention: SPLADE scores are raw dot products of
    non-negative, log-saturated term weights (typically 10–40 for relevant pairs), already on a logit
    scale, so they enter the softmax unscaled. Models with cosine scores in [-1, 1] need ~0.05.

    Memory: O((1+k)·B²) for scores, not O(B·V). At peak about three fp32 [B, (1+k)·B] buffers (the
    score blocks and their concatenation, or the saved log-softmax and its gradients): ~12·(1+k)·B²
    bytes, 1.5 GiB at B = 8,192, k = 1, against 1 GiB for one fp32 [8,192, 30,522] column of reps;
    plus fp32 copies of bf16/fp16 reps. The [B, V] @ [V, B] products are taken column by column, so
    the documents are never concatenated into a [(1+k)·B, V] copy, and nothing of size B·B·V exists.
    Beyond 1 GiB of fp32 scores (or with ``block_size``) the scores are computed in blocks and never
    held whole (:mod:`.blocked`): memory O(block²) instead of O(B²), one extra matmul pass, the same
    result up to fp32 summation order.

    Args:
        reps: column name -> [B, V] reps; queries, positives, then k >= 0 hard-negative columns.
        temperature: divides every score; must be > 0.
        block_size: compute the scores in [block_size, block_size] blocks; None (default): blocks of
            :data:`~gradcache_sparton.losses.blocked.AUTO_BLOCK_SIZE` only when the fp32 score matrix
            would exceed :data:`~gradcache_sparton.losses.blocked.DENSE_SCORES_MAX_BYTES`.

    Returns:
        0-d fp32 loss (fp64 for fp64 reps).
    """
    check_temperature(temperature)
    check_block_size(block_size)
    return info_nce(split_columns(reps), DENSE_SCORES, temperature=temperature, path=ScorePath(block_size))


def info_nce(
    columns: _Columns, scores: Scores, *, temperature: float, path: ScorePath = AUTO_SCORE_PATH
) -> Tensor:
    """:func:`info_nce_loss` of checked columns, scored by ``scores`` along ``path``."""
    q_reps, pos_reps, neg_reps = columns
    resolved = path.resolve(scores, q_reps, 1 + len(neg_reps))
    if resolved is not None:
        # -log softmax at the own positive = logsumexp over the batch's documents - the positive's score.
        # Queries and positives feed both terms: one fp32 copy each, so their gradients are rounded once.
        q_reps, pos_reps = scores.upcast(q_reps, pos_reps)
        lse = scores.logsumexp(q_reps, [pos_reps, *neg_reps], temperature=temperature, path=resolved)
        return (lse - scores.paired(q_reps, pos_reps) / temperature).mean()  # [B] -> []
    all_scores = _whole_scores(q_reps, [pos_reps, *neg_reps])  # [B, (1+k)·B]; column j < B is positive j
    # In place: cat's backward needs no saved tensors, so this spares one [B, (1+k)·B] buffer.
    all_scores.div_(temperature)
    targets = torch.arange(q_reps.shape[0], device=all_scores.device)
    return F.cross_entropy(all_scores, targets)


def margin_mse_loss(reps: Mapping[str, Tensor], *, teacher_scores: Tensor) -> Tensor:
    """MarginMSE distillation (Hofstätter et al. 2020): match the teacher's positive-negative margins.

    For query i and each hard negative j, the student margin ``s(q_i, pos_i) - s(q_i, neg_j_i)`` is
    regressed onto the teacher margin ``t[i, 0] - t[i, j]``; the loss is the mean squared error over
    the B·k (query, negative) pairs. No in-batch negatives: each query meets only its own documents.

    Args:
        reps: column name -> [B, V] reps; queries, positives, then k >= 1 hard-negative columns.
        teacher_scores: [B, 1+k] teacher scores, column 0 for the positive and column j for the j-th
            hard-negative column, in the order of ``reps``. Teacher margins m [B, k] convert exactly:
            ``torch.cat([torch.zeros_like(m[:, :1]), -m], dim=1)`` has the margins m. Moved to the
            reps' device, compared in fp32, never differentiated.

    Returns:
        0-d fp32 loss (fp64 for fp64 reps).

    Memory: k + 1 row-wise products [B, V] in fp32; nothing grows with B².
    """
    columns = split_columns(reps)
    check_teacher_scores(columns, teacher_scores=teacher_scores, loss="margin_mse_loss")
    return margin_mse(columns, DENSE_SCORES, teacher_scores=teacher_scores)


def check_teacher_scores(
    columns: ContrastiveColumns, *, teacher_scores: object = None, loss: str, in_batch: bool = False
) -> None:
    """Raise unless ``teacher_scores`` is a floating [B, 1+k] tensor for k >= 1 hard-negative columns or, with
    ``in_batch`` (listwise KL over the batch's documents), [B, (1+k)·B]: the teacher's scores of every
    document of the batch, column j·B + r for row r of document column j (the order of the student's score
    matrix).

    ``loss`` names the distillation loss in the error (both need hard negatives to compare against).
    """
    if teacher_scores is None:
        raise TypeError(
            f"{loss} needs teacher_scores, a [B, 1+k] tensor of teacher scores (the positive, then each hard "
            "negative), in the loss kwargs; in training, a numeric teacher_scores column of the data"
        )
    B, k = columns.q_reps.shape[0], len(columns.neg_reps)
    if k == 0:
        raise ValueError(
            f"{loss} needs at least one hard-negative column after the positives, got only the queries "
            "and positives"
        )
    if not isinstance(teacher_scores, Tensor):
        raise TypeError(f"teacher_scores must be a [B, 1+k] tensor, got {type(teacher_scores).__name__}")
    shapes = [(B, 1 + k), (B, (1 + k) * B)] if in_batch else [(B, 1 + k)]
    if tuple(teacher_scores.shape) not in shapes:
        whole = (
            f" or [B, (1+k)·B] = [{B}, {(1 + k) * B}] (every document of the batch: column j·B + r for row r "
            "of document column j)"
            if in_batch
            else " ([B, (1+k)·B], every document of the batch, only with in_batch / kl_in_batch)"
        )
        raise ValueError(
            f"teacher_scores must have shape [B, 1+k] = [{B}, {1 + k}] (the positive, then {k} hard "
            f"negative(s), for each of the {B} queries){whole}, got {tuple(teacher_scores.shape)}"
        )
    if not teacher_scores.is_floating_point():
        raise TypeError(f"teacher_scores must be a floating tensor, got dtype {teacher_scores.dtype}")


def margin_mse(columns: _Columns, scores: Scores, *, teacher_scores: Tensor) -> Tensor:
    """:func:`margin_mse_loss` of checked columns and teacher scores, scored by ``scores``."""
    q_reps, pos_reps, neg_reps = columns
    pos = scores.paired(q_reps, pos_reps)  # [B]
    negs = torch.stack([scores.paired(q_reps, n) for n in neg_reps], dim=1)  # k x [B] -> [B, k]
    student_margin = pos[:, None] - negs  # [B, k]
    teacher = teacher_scores.detach().to(device=pos.device, dtype=pos.dtype)  # [B, 1+k]
    teacher_margin = teacher[:, :1] - teacher[:, 1:]  # [B, k]
    return F.mse_loss(student_margin, teacher_margin)


def kl_div_loss(
    reps: Mapping[str, Tensor],
    *,
    teacher_scores: Tensor,
    temperature: float = 1.0,
    teacher_temperature: float = 1.0,
    in_batch: bool = False,
    block_size: int | None = None,
) -> Tensor:
    """Listwise KL distillation (as SPLADE-v3 trains): match the teacher's softmax over each query's list.

    For query i with candidates c = (pos_i, neg_1_i, ..., neg_k_i), the loss is
    ``KL(softmax(t_i / teacher_temperature) || softmax(s_i / temperature))`` with ``s_i[j]`` the student
    score of candidate j, averaged over the B queries (the KL divergence itself, teacher entropy
    included: 0 exactly when the two distributions agree; no temperature² factor).

    With ``in_batch=True`` the student's softmax runs over every document of the batch, the
    [B, (1+k)·B] score matrix of :func:`info_nce_loss`. A [B, 1+k] teacher keeps probability 0 on the
    other queries' documents (the KL then also pushes those in-batch negatives down); a [B, (1+k)·B]
    teacher (its scores of every document of the batch, as arXiv 2411.04403 distils) gives the whole row
    its own softmax, and the KL runs over it. Without ``in_batch``, each query meets only its own 1+k
    candidates.

    Args:
        reps: column name -> [B, V] reps; queries, positives, then k >= 1 hard-negative columns.
        teacher_scores: [B, 1+k] teacher scores, column 0 for the positive and column j for the j-th
            hard-negative column, in the order of ``reps`` (as for :func:`margin_mse_loss`); with
            ``in_batch`` also [B, (1+k)·B], column j·B + r the score of row r of document column j (positives
            first). Moved to the reps' device, used in fp32, never differentiated.
        temperature: divides the student scores, > 0 (1.0: SPLADE's raw dot products).
        teacher_temperature: divides the teacher scores, > 0.
        in_batch: also normalise the student over the other queries' documents.
        block_size: with ``in_batch``, the score blocks of :func:`info_nce_loss` (same automatic choice).

    Returns:
        0-d fp32 loss (fp64 for fp64 reps).

    Memory: k + 1 row-wise products [B, V] in fp32 and [B, 1+k] scores; with ``in_batch``, that of
    :func:`info_nce_loss` (~12·(1+k)·B² bytes, or blocks).
    """
    check_temperature(temperature)
    check_temperature(teacher_temperature, name="teacher_temperature")
    if not isinstance(in_batch, bool):
        raise TypeError(f"in_batch must be a bool, got {type(in_batch).__name__}")
    check_block_size(block_size)
    columns = split_columns(reps)
    check_teacher_scores(columns, teacher_scores=teacher_scores, loss="kl_div_loss", in_batch=in_batch)
    return kl_div(
        columns,
        DENSE_SCORES,
        teacher_scores=teacher_scores,
        temperature=temperature,
        teacher_temperature=teacher_temperature,
        in_batch=in_batch,
        path=ScorePath(block_size),
    )


def kl_div(
    columns: _Columns,
    scores: Scores,
    *,
    teacher_scores: Tensor,
    temperature: float,
    teacher_temperature: float,
    in_batch: bool,
    path: ScorePath = AUTO_SCORE_PATH,
) -> Tensor:
    """:func:`kl_div_loss` of checked columns and teacher scores, scored by ``scores`` (with ``in_batch``,
    along ``path``)."""
    q_reps, pos_reps, neg_reps = columns
    d_columns = [pos_reps, *neg_reps]
    B, k = q_reps.shape[0], len(neg_reps)
    whole_teacher = in_batch and teacher_scores.shape[1] != 1 + k  # [B, (1+k)·B]: every document of the batch
    resolved = path.resolve(scores, q_reps, 1 + k) if in_batch else None
    if in_batch and resolved is None:
        all_scores = _whole_scores(q_reps, d_columns)  # [B, (1+k)·B]; query i's candidate j is column j·B + i
        log_student = F.log_softmax(all_scores / temperature, dim=1)  # [B, (1+k)·B]
        if not whole_teacher:
            device = all_scores.device
            own = torch.arange(B, device=device)[:, None] + B * torch.arange(1 + k, device=device)
            log_student = log_student.gather(1, own)  # [B, (1+k)·B] -> [B, 1+k]
    elif in_batch:  # normalised over the batch's documents, in blocks: log p = s / t - lse
        # Every column feeds both terms: one fp32 copy each, so their gradients are rounded once.
        q_reps, *d_columns = scores.upcast(q_reps, *d_columns)
        lse = scores.logsumexp(q_reps, d_columns, temperature=temperature, path=resolved)  # [B]
        if whole_teacher:
            # KL_i = sum_j p_ij log p_ij - sum_j p_ij s_ij / t + lse_i (sum_j p_ij = 1): the middle term is
            # bilinear in the reps (Scores.weighted), so no [B, (1+k)·B] student matrix is held.
            log_teacher = _log_teacher(teacher_scores, teacher_temperature, lse)  # [B, (1+k)·B]
            teacher = log_teacher.exp()
            cross = scores.weighted(q_reps, d_columns, teacher, block_size=resolved.block_size)  # [B]
            return ((teacher * log_teacher).sum(dim=1) - cross / temperature + lse).mean()
        own_scores = torch.stack([scores.paired(q_reps, d_reps) for d_reps in d_columns], dim=1)  # [B, 1+k]
        log_student = own_scores / temperature - lse[:, None]  # [B, 1+k]
    else:
        own_scores = torch.stack([scores.paired(q_reps, d_reps) for d_reps in d_columns], dim=1)  # [B, 1+k]
        log_student = F.log_softmax(own_scores / temperature, dim=1)  # [B, 1+k]
    log_teacher = _log_teacher(teacher_scores, teacher_temperature, log_student)  # as log_student
    # sum_j p_t · (log p_t - log p_s), summed over the list, averaged over the B queries.
    return F.kl_div(log_student, log_teacher, reduction="batchmean", log_target=True)


def _log_teacher(teacher_scores: Tensor, teacher_temperature: float, like: Tensor) -> Tensor:
    """The teacher's log-softmax over each row, on ``like``'s device and in its dtype, never differentiated."""
    teacher = teacher_scores.detach().to(device=like.device, dtype=like.dtype)
    return F.log_softmax(teacher / teacher_temperature, dim=1)
