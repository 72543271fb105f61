"""Retrieval evaluation of sparse encoders on BEIR-format data: encode, retrieve, score.

Legend: B batch, S sequence, V vocabulary, Q queries, N documents, C a document chunk, K top-k.

Pipeline (:class:`SparseRetrievalEvaluator`):
1. :func:`encode_texts` runs ``encoder(**features) -> [B, V]`` over the queries and the corpus in
   batches (no autograd, optional autocast, a tqdm bar) and keeps each rep sparsely as
   :class:`SparseReps` (row offsets, vocabulary ids, weights): memory grows with the non-zeros,
   never with N × V.
2. :func:`retrieve` scores by sparse dot product. Queries are densified a block at a time, documents
   a chunk at a time; ``[Qb, V] @ [V, C] -> [Qb, C]`` is merged into a running top-k. Nothing of
   size Q × N × V (nor Q × N) is ever built.
3. :func:`retrieval_metrics`: nDCG@10, MRR@10 and Recall@100, averaged over the queries with at
   least one relevant document, plus the average number of non-zeros per query and doc rep.

Ties: documents with equal scores are ranked by their index in the corpus (file order), earlier
first. The running top-k is merged with a *stable* sort over candidates laid out in index order, so
the result does not depend on the chunk size or the device.

:class:`RetrievalEvalCallback` runs the evaluator from a ``transformers.Trainer`` and logs through
``trainer.log``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm
from transformers import (
    PreTrainedTokenizerBase,
    TrainerCallback,
    TrainerControl,
    TrainerState,
    TrainingArguments,
)

from gradcache_sparton.data import BeirData

__all__ = [
    "RetrievalEvalCallback",
    "SparseReps",
    "SparseRetrievalEvaluator",
    "encode_texts",
    "ndcg_at_k",
    "recall_at_k",
    "reciprocal_rank_at_k",
    "retrieval_metrics",
    "retrieve",
]

Encoder = Callable[..., Tensor]

# Defaults for the retrieval blocks. A [1,024, V] fp32 query block and a [2,048, V] fp32 document chunk
# are 125 MB and 250 MB at V = 30,522: small next to a training run's memory, large enough that the
# matmul runs at full speed on a GPU.
_QUERY_BLOCK = 1024
_DOC_CHUNK = 2048
# Pad like the training collator: shapes that are multiples of 8 suit tensor cores.
_PAD_TO_MULTIPLE_OF = 8


# ---------------------------------------------------------------------------------------------------
# Sparse reps
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SparseReps:
    """N sparse reps over a vocabulary of V, in compressed-row layout (like CSR), on one device.

    - ``offsets`` [N + 1] int64: row i's entries are ``[offsets[i], offsets[i + 1])``,
    - ``token_ids`` [nnz] int32 vocabulary ids, ascending within a row (int32: V < 2**31, and the
      ids are most of the memory next to the weights),
    - ``weights`` [nnz] float32, all non-zero.

    Our own three tensors rather than ``torch.sparse_csr_tensor``: CSR is still beta in torch (it warns
    on construction), and retrieval only needs row slices densified into a chunk.
    """

    offsets: Tensor
    token_ids: Tensor
    weights: Tensor
    vocab_size: int

    @property
    def num_rows(self) -> int:
        return self.offsets.numel() - 1

    def nonzeros_per_row(self) -> Tensor:
        """[N] int64 number of non-zero entries of each rep."""
        return self.offsets[1:] - self.offsets[:-1]

    def to_dense(
        self, start: int = 0, end: int | None = None, *, device: torch.device | None = None
    ) -> Tensor:
        """Rows ``start:end`` as a dense float32 [end - start, V] tensor on ``device``."""
        end = self.num_rows if end is None else end
        lo, hi = int(self.offsets[start]), int(self.offsets[end])
        device = self.weights.device if device is None else device
        counts = (self.offsets[start + 1 : end + 1] - self.offsets[start:end]).to(device)
        rows = torch.repeat_interleave(torch.arange(end - start, device=device), counts)  # [nnz_slice]
        dense = torch.zeros(end - start, self.vocab_size, dtype=torch.float32, device=device)
        dense[rows, self.token_ids[lo:hi].to(device, torch.int64)] = self.weights[lo:hi].to(device)
        return dense

    @staticmethod
    def from_dense(reps: Tensor) -> SparseReps:
        """Keep the non-zeros of a dense [N, V] tensor (on its device, as float32)."""
        if reps.dim() != 2:
            raise ValueError(f"reps must be 2-D [N, V], got shape {tuple(reps.shape)}")
        rows, token_ids = reps.nonzero(as_tuple=True)  # row-major order: rows ascending, ids ascending
        counts = torch.bincount(rows, minlength=reps.shape[0])
        offsets = torch.zeros(reps.shape[0] + 1, dtype=torch.int64, device=reps.device)
        offsets[1:] = torch.cumsum(counts, 0)
        weights = reps[rows, token_ids].float()
        return SparseReps(offsets, token_ids.to(torch.int32), weights, reps.shape[1])

    @staticmethod
    def concat(parts: Sequence[SparseReps]) -> SparseReps:
        """Stack the rows of several :class:`SparseReps` (same V, same device) in order."""
        if not parts:
            raise ValueError("parts is empty")
        vocab_size = parts[0].vocab_size
        if any(p.vocab_size != vocab_size for p in parts):
            raise ValueError(f"all parts must have one vocabulary size, got {[p.vocab_size for p in parts]}")
        offsets, shift = [parts[0].offsets[:1]], 0
        for part in parts:
            offsets.append(part.offsets[1:] + shift)
            shift += int(part.offsets[-1])
        return SparseReps(
            torch.cat(offsets),
            torch.cat([p.token_ids for p in parts]),
            torch.cat([p.weights for p in parts]),
            vocab_size,
        )

    def to(self, device: torch.device | str) -> SparseReps:
        """The same reps on ``device``."""
        return SparseReps(
            self.offsets.to(device), self.token_ids.to(device), self.weights.to(device), self.vocab_size
        )

    def select(self, order: Tensor) -> SparseReps:
        """The rows in the given order ([M] int64 row indices)."""
        order = order.to(self.offsets.device)
        counts = self.nonzeros_per_row()[order]
        starts = self.offsets[:-1][order]
        offsets = torch.zeros(order.numel() + 1, dtype=torch.int64, device=order.device)
        offsets[1:] = torch.cumsum(counts, 0)
        # Position of every selected entry in the source: its row's start + its rank within the row.
        within = torch.arange(int(offsets[-1]), device=order.device) - torch.repeat_interleave(
            offsets[:-1], counts
        )
        source = torch.repeat_interleave(starts, counts) + within
        return SparseReps(offsets, self.token_ids[source], self.weights[source], self.vocab_size)


# ---------------------------------------------------------------------------------------------------
# Encoding
# ---------------------------------------------------------------------------------------------------


def _encoder_device(encoder: Encoder) -> torch.device:
    if isinstance(encoder, nn.Module):
        for parameter in encoder.parameters():
            return parameter.device
    return torch.device("cpu")


def encode_texts(
    encoder: Encoder,
    texts: Sequence[str],
    *,
    tokenizer: PreTrainedTokenizerBase,
    max_length: int,
    batch_size: int = 64,
    device: torch.device | str | None = None,
    autocast_dtype: torch.dtype | None = None,
    show_progress: bool = True,
    desc: str = "Encoding",
) -> SparseReps:
    """Encode ``texts`` with ``encoder(**features) -> [B, V]`` and keep the reps sparsely, on CPU.

    Texts are tokenised like the training collator (``truncation=True`` to ``max_length``,
    ``padding=True``, ``pad_to_multiple_of=8``) in batches of ``batch_size``, longest first (less
    padding), under ``torch.no_grad()`` and, if ``autocast_dtype`` is given, ``torch.autocast``.
    ``device`` defaults to the device of the encoder's first parameter (CPU for a parameterless
    callable). An ``nn.Module`` encoder is put in eval mode for the call and restored afterwards.
    The result is in the order of ``texts``; peak memory is one dense [batch_size, V] batch on the
    device plus the non-zeros on CPU.
    """
    if isinstance(texts, str) or not isinstance(texts, Sequence):
        raise TypeError(f"texts must be a sequence of str, got {type(texts).__name__}")
    if len(texts) == 0:
        raise ValueError("texts is empty: nothing to encode")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if max_length < 1 or max_length % _PAD_TO_MULTIPLE_OF:
        raise ValueError(
            f"max_length must be a positive multiple of {_PAD_TO_MULTIPLE_OF} (tokenizers cannot truncate to "
            f"it and pad to a multiple of {_PAD_TO_MULTIPLE_OF}), got {max_length}"
        )
    device = _encoder_device(encoder) if device is None else torch.device(device)
    # Longest first: batches of similar lengths pad less, and the first batch shows the peak memory.
    order = sorted(range(len(texts)), key=lambda i: len(texts[i]), reverse=True)
    autocast = (
        torch.autocast(device.type, dtype=autocast_dtype) if autocast_dtype is not None else nullcontext()
    )
    was_training = encoder.training if isinstance(encoder, nn.Module) else False
    if isinstance(encoder, nn.Module):
        encoder.eval()
    parts: list[SparseReps] = []
    try:
        with torch.no_grad(), autocast:
            for start in tqdm(range(0, len(texts), batch_size), desc=desc, disable=not show_progress):
                batch = [texts[i] for i in order[start : start + batch_size]]
                features = tokenizer(
                    batch,
                    padding=True,
                    truncation=True,
                    max_length=max_length,
                    pad_to_multiple_of=_PAD_TO_MULTIPLE_OF,
                    return_tensors="pt",
                )
                reps = encoder(**{name: tensor.to(device) for name, tensor in features.items()})  # [B, V]
                if not isinstance(reps, Tensor) or reps.dim() != 2 or reps.shape[0] != len(batch):
                    shape = tuple(reps.shape) if isinstance(reps, Tensor) else type(reps).__name__
                    raise ValueError(f"encoder must return a [B, V] tensor with B={len(batch)}, got {shape}")
                parts.append(SparseReps.from_dense(reps).to(torch.device("cpu")))
    finally:
        if isinstance(encoder, nn.Module):
            encoder.train(was_training)
    # Back from length order to the caller's order: row order[j] of the result is row j of `stacked`.
    inverse = torch.empty(len(texts), dtype=torch.int64)
    inverse[torch.tensor(order)] = torch.arange(len(texts))
    return SparseReps.concat(parts).select(inverse)


# ---------------------------------------------------------------------------------------------------
# Retrieval
# ---------------------------------------------------------------------------------------------------


def retrieve(
    q_reps: SparseReps | Tensor,
    d_reps: SparseReps | Tensor,
    *,
    top_k: int = 100,
    device: torch.device | str | None = None,
    query_block: int = _QUERY_BLOCK,
    doc_chunk: int = _DOC_CHUNK,
) -> tuple[Tensor, Tensor]:
    """Top-k documents of every query by dot product: ``(scores [Q, K], doc_indices [Q, K])`` on CPU.

    K = min(top_k, N). Each row is sorted by score descending; equal scores keep the lower doc index
    first (a stable sort over candidates in index order), whatever the chunk sizes. Reps may be
    :class:`SparseReps` or dense [Q, V] / [N, V] tensors. Scores are computed in float32 on
    ``device`` (default: the query reps' device).

    Memory on ``device``: a dense [query_block, V] query block, a dense [doc_chunk, V] doc chunk,
    their [query_block, doc_chunk] scores and the [Q, K + doc_chunk] candidates of the merge: never
    anything of size Q × N × V or Q × N.
    """
    q_reps = SparseReps.from_dense(q_reps) if isinstance(q_reps, Tensor) else q_reps
    d_reps = SparseReps.from_dense(d_reps) if isinstance(d_reps, Tensor) else d_reps
    for name, reps in (("q_reps", q_reps), ("d_reps", d_reps)):
        if not isinstance(reps, SparseReps):
            raise TypeError(f"{name} must be SparseReps or a dense [*, V] tensor, got {type(reps).__name__}")
        if reps.num_rows == 0:
            raise ValueError(f"{name} has no rows")
    if q_reps.vocab_size != d_reps.vocab_size:
        raise ValueError(f"q_reps has V={q_reps.vocab_size} but d_reps has V={d_reps.vocab_size}")
    for name, value in (("top_k", top_k), ("query_block", query_block), ("doc_chunk", doc_chunk)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    device = q_reps.weights.device if device is None else torch.device(device)
    num_queries, num_docs = q_reps.num_rows, d_reps.num_rows
    k = min(top_k, num_docs)
    best_scores = torch.empty(num_queries, 0, device=device)  # [Q, <=K], sorted: score desc, index asc
    best_index = torch.empty(num_queries, 0, dtype=torch.int64, device=device)
    # Densify the queries once when they fit in one block, else one block per doc chunk.
    single_block = q_reps.to_dense(device=device) if num_queries <= query_block else None  # [Q, V]
    for d_start in range(0, num_docs, doc_chunk):
        d_end = min(d_start + doc_chunk, num_docs)
        docs = d_reps.to_dense(d_start, d_end, device=device)  # [C, V]
        new_scores, new_index = [], []
        for q_start in range(0, num_queries, query_block):
            q_end = min(q_start + query_block, num_queries)
            queries = (
                single_block if single_block is not None else q_reps.to_dense(q_start, q_end, device=device)
            )
            scores = queries @ docs.T  # [Qb, V] @ [V, C] -> [Qb, C]
            # Candidates in index order: the kept top-k (all indices < d_start, equal scores already
            # index-ascending) then this chunk (ascending). A stable descending sort keeps that order
            # among equal scores, so ties rank the lower doc index first.
            cand_scores = torch.cat([best_scores[q_start:q_end], scores], dim=1)  # [Qb, K + C]
            chunk_index = torch.arange(d_start, d_end, device=device).expand(q_end - q_start, -1)
            cand_index = torch.cat([best_index[q_start:q_end], chunk_index], dim=1)
            sorted_scores, position = torch.sort(cand_scores, dim=1, descending=True, stable=True)
            new_scores.append(sorted_scores[:, :k])
            new_index.append(cand_index.gather(1, position[:, :k]))
        best_scores, best_index = torch.cat(new_scores), torch.cat(new_index)
    return best_scores.cpu(), best_index.cpu()


# ---------------------------------------------------------------------------------------------------
# Metrics
# ---------------------------------------------------------------------------------------------------


def _check_ranking(ranking: Sequence[str], k: int) -> None:
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if len(set(ranking[:k])) != len(ranking[:k]):
        raise ValueError("ranking lists a document more than once")


def ndcg_at_k(ranking: Sequence[str], relevance: Mapping[str, int], k: int) -> float:
    """nDCG@k of one ranked list with graded relevance (the trec_eval / BEIR definition).

    DCG = sum over ranks i = 1..k of rel_i / log2(i + 1), with linear gain rel_i (relevance <= 0 or
    unjudged counts 0). The ideal DCG sorts *all* judged relevances > 0 of the query (retrieved or
    not) in descending order and takes the first k. 0.0 when the query has no relevant document.
    """
    _check_ranking(ranking, k)
    dcg = sum(
        relevance.get(doc, 0) / math.log2(rank + 1)
        for rank, doc in enumerate(ranking[:k], start=1)
        if relevance.get(doc, 0) > 0
    )
    ideal = sorted((r for r in relevance.values() if r > 0), reverse=True)[:k]
    idcg = sum(r / math.log2(rank + 1) for rank, r in enumerate(ideal, start=1))
    return dcg / idcg if idcg > 0 else 0.0


def reciprocal_rank_at_k(ranking: Sequence[str], relevance: Mapping[str, int], k: int) -> float:
    """1 / rank of the first document with relevance > 0 within the top k; 0.0 if there is none."""
    _check_ranking(ranking, k)
    for rank, doc in enumerate(ranking[:k], start=1):
        if relevance.get(doc, 0) > 0:
            return 1.0 / rank
    return 0.0


def recall_at_k(ranking: Sequence[str], relevance: Mapping[str, int], k: int) -> float:
    """Fraction of the query's documents with relevance > 0 that appear in the top k; 0.0 if none."""
    _check_ranking(ranking, k)
    relevant = {doc for doc, r in relevance.items() if r > 0}
    if not relevant:
        return 0.0
    return len(relevant.intersection(ranking[:k])) / len(relevant)


def retrieval_metrics(
    rankings: Mapping[str, Sequence[str]],
    qrels: Mapping[str, Mapping[str, int]],
    *,
    ndcg_k: int = 10,
    mrr_k: int = 10,
    recall_k: int = 100,
) -> dict[str, float]:
    """Mean nDCG@ndcg_k, MRR@mrr_k and Recall@recall_k over the queries of ``qrels`` that have at
    least one document with relevance > 0 (queries without one are left out, as in BEIR).

    ``rankings`` maps each such query id to its ranked doc ids, best first (ties must already be
    broken; :func:`retrieve` ranks equal scores by doc index). A query missing from ``rankings`` is a
    ``ValueError``. Keys: ``ndcg_at_{ndcg_k}``, ``mrr_at_{mrr_k}``, ``recall_at_{recall_k}``.
    """
    evaluated = [query_id for query_id, judged in qrels.items() if any(r > 0 for r in judged.values())]
    if not evaluated:
        raise ValueError("qrels has no query with a relevant document (relevance > 0)")
    missing = [query_id for query_id in evaluated if query_id not in rankings]
    if missing:
        raise ValueError(f"rankings has no entry for {len(missing)} judged queries, e.g. {missing[:3]}")
    totals = {f"ndcg_at_{ndcg_k}": 0.0, f"mrr_at_{mrr_k}": 0.0, f"recall_at_{recall_k}": 0.0}
    for query_id in evaluated:
        ranking, relevance = rankings[query_id], qrels[query_id]
        totals[f"ndcg_at_{ndcg_k}"] += ndcg_at_k(ranking, relevance, ndcg_k)
        totals[f"mrr_at_{mrr_k}"] += reciprocal_rank_at_k(ranking, relevance, mrr_k)
        totals[f"recall_at_{recall_k}"] += recall_at_k(ranking, relevance, recall_k)
    return {name: total / len(evaluated) for name, total in totals.items()}


# ---------------------------------------------------------------------------------------------------
# Evaluator and Trainer callback
# ---------------------------------------------------------------------------------------------------


class SparseRetrievalEvaluator:
    """Evaluate a sparse encoder on a BEIR dataset: ``evaluator(encoder) -> dict[str, float]``.

    Each call encodes the judged queries (those with a relevant doc) and the whole corpus with
    :func:`encode_texts`, retrieves the top ``top_k`` docs per query with :func:`retrieve` and returns

    - ``ndcg_at_10``, ``mrr_at_10``, ``recall_at_{top_k}`` (:func:`retrieval_metrics`), and
    - ``query_nonzeros``, ``doc_nonzeros``: average number of non-zero entries per query / doc rep.

    Texts are truncated to ``query_max_length`` / ``document_max_length`` tokens, as in training.
    """

    def __init__(
        self,
        data: BeirData,
        *,
        tokenizer: PreTrainedTokenizerBase,
        query_max_length: int = 32,
        document_max_length: int = 256,
        batch_size: int = 64,
        top_k: int = 100,
        device: torch.device | str | None = None,
        autocast_dtype: torch.dtype | None = None,
        show_progress: bool = True,
    ) -> None:
        if not isinstance(data, BeirData):
            raise TypeError(f"data must be a BeirData (see load_beir), got {type(data).__name__}")
        if not isinstance(tokenizer, PreTrainedTokenizerBase):
            raise TypeError(f"tokenizer must be a PreTrainedTokenizerBase, got {type(tokenizer).__name__}")
        if top_k < 10:
            raise ValueError(f"top_k must be >= 10 (nDCG@10 and MRR@10 need the top 10), got {top_k}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        for name, value in (
            ("query_max_length", query_max_length),
            ("document_max_length", document_max_length),
        ):
            if value < 1 or value % _PAD_TO_MULTIPLE_OF:
                raise ValueError(f"{name} must be a positive multiple of {_PAD_TO_MULTIPLE_OF}, got {value}")
        self.data = data
        self.tokenizer = tokenizer
        self.query_max_length = query_max_length
        self.document_max_length = document_max_length
        self.batch_size = batch_size
        self.top_k = top_k
        self.device = device
        self.autocast_dtype = autocast_dtype
        self.show_progress = show_progress
        self.query_ids = [q for q, judged in data.qrels.items() if any(r > 0 for r in judged.values())]
        if not self.query_ids:
            raise ValueError("data.qrels has no query with a relevant document (relevance > 0)")
        self.doc_ids = list(data.corpus)

    def __call__(self, encoder: Encoder) -> dict[str, float]:
        common = {
            "tokenizer": self.tokenizer,
            "batch_size": self.batch_size,
            "device": self.device,
            "autocast_dtype": self.autocast_dtype,
            "show_progress": self.show_progress,
        }
        q_reps = encode_texts(
            encoder,
            [self.data.queries[q] for q in self.query_ids],
            max_length=self.query_max_length,
            desc="Encoding queries",
            **common,
        )
        d_reps = encode_texts(
            encoder,
            [self.data.corpus[d] for d in self.doc_ids],
            max_length=self.document_max_length,
            desc="Encoding corpus",
            **common,
        )
        device = _encoder_device(encoder) if self.device is None else torch.device(self.device)
        _, doc_index = retrieve(q_reps, d_reps, top_k=self.top_k, device=device)  # [Q, K]
        rankings = {
            query_id: [self.doc_ids[i] for i in row]
            for query_id, row in zip(self.query_ids, doc_index.tolist(), strict=True)
        }
        metrics = retrieval_metrics(rankings, self.data.qrels, ndcg_k=10, mrr_k=10, recall_k=self.top_k)
        metrics["query_nonzeros"] = q_reps.nonzeros_per_row().double().mean().item()
        metrics["doc_nonzeros"] = d_reps.nonzeros_per_row().double().mean().item()
        return metrics


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
