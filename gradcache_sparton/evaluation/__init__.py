"""Retrieval evaluation of sparse encoders on BEIR-format data: encode, retrieve, score.

Legend: B batch, S sequence, V vocabulary, Q queries, N documents, C a document chunk, K top-k.

One job per module:

- :mod:`.sparse_reps`: :class:`SparseReps`, reps kept sparsely (row offsets, vocabulary ids, weights).
- :mod:`.encoding`: :func:`encode_texts` runs ``encoder(**features) -> [B, V]`` over texts in
  batches (no autograd, optional autocast, a tqdm bar): memory grows with the non-zeros, never N × V.
- :mod:`.retrieval`: :func:`retrieve` scores by sparse dot product, queries densified a block at a
  time, documents a chunk at a time, ``[Qb, V] @ [V, C] -> [Qb, C]`` merged into a running top-k;
  nothing of size Q × N × V (nor Q × N) is ever built. Ties rank the earlier doc first.
- :mod:`.metrics`: nDCG@10, MRR@10 and Recall@100, averaged over the queries with at least one
  relevant document.
- :mod:`.evaluator`: :class:`SparseRetrievalEvaluator`, the pipeline on a BEIR dataset.
- :mod:`.callback`: :class:`RetrievalEvalCallback` runs the evaluator from a ``transformers.Trainer``
  and logs through ``trainer.log``.
"""

from gradcache_sparton.evaluation.callback import RetrievalEvalCallback
from gradcache_sparton.evaluation.encoding import encode_texts
from gradcache_sparton.evaluation.evaluator import SparseRetrievalEvaluator
from gradcache_sparton.evaluation.metrics import (
    ndcg_at_k,
    recall_at_k,
    reciprocal_rank_at_k,
    retrieval_metrics,
)
from gradcache_sparton.evaluation.retrieval import retrieve
from gradcache_sparton.evaluation.sparse_reps import SparseReps

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
