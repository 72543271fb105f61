"""Retrieval evaluation of sparse encoders on BEIR-format data: encode, prune, retrieve, score.

Legend: B batch, S sequence, V vocabulary, Q queries, N documents, C a document chunk, K top-k.

One job per module:

- :mod:`.sparse_reps`: :class:`SparseReps`, reps kept sparsely (row offsets, vocabulary ids, weights).
- :mod:`.encoding`: :func:`encode_texts` runs ``encoder(**features) -> [B, V]`` over texts in
  batches (no autograd, optional autocast, a tqdm bar): memory grows with the non-zeros, never N × V.
- :mod:`.pruning`: :func:`prune_reps` and :class:`PruningBudget`: top-k per rep (query and document
  budgets apart) and a weight threshold.
- :mod:`.retrieval`: :func:`retrieve` scores by sparse dot product, queries densified a block at a
  time, documents a chunk at a time, ``[Qb, V] @ [V, C] -> [Qb, C]`` merged into a running top-k;
  nothing of size Q × N × V (nor Q × N) is ever built. Ties rank the earlier doc first.
- :mod:`.metrics`: any ``ir_measures`` measure (default nDCG@10, RR@10, R@100), averaged over the
  queries with at least one relevant document.
- :mod:`.runs`: runs (query id -> ranked (doc id, score)) and TREC run files.
- :mod:`.evaluator`: :class:`SparseRetrievalEvaluator`, the pipeline on a BEIR dataset.
- :mod:`.report`: the mean over datasets and a plain-text table of results.
- :mod:`.callback`: :class:`RetrievalEvalCallback` runs the evaluator from a ``transformers.Trainer``
  and logs through ``trainer.log``.
"""

from gradcache_sparton.evaluation.callback import RetrievalEvalCallback
from gradcache_sparton.evaluation.encoding import encode_texts
from gradcache_sparton.evaluation.evaluator import EvaluationResult, SparseRetrievalEvaluator
from gradcache_sparton.evaluation.metrics import (
    DEFAULT_MEASURES,
    measure_key,
    ndcg_at_k,
    parse_measures,
    recall_at_k,
    reciprocal_rank_at_k,
    retrieval_metrics,
)
from gradcache_sparton.evaluation.pruning import PruningBudget, prune_reps
from gradcache_sparton.evaluation.report import format_table, mean_metrics
from gradcache_sparton.evaluation.retrieval import retrieve
from gradcache_sparton.evaluation.runs import Run, check_trec_ids, write_trec_run
from gradcache_sparton.evaluation.sparse_reps import SparseReps

__all__ = [
    "DEFAULT_MEASURES",
    "EvaluationResult",
    "PruningBudget",
    "RetrievalEvalCallback",
    "Run",
    "SparseReps",
    "SparseRetrievalEvaluator",
    "check_trec_ids",
    "encode_texts",
    "format_table",
    "mean_metrics",
    "measure_key",
    "ndcg_at_k",
    "parse_measures",
    "prune_reps",
    "recall_at_k",
    "reciprocal_rank_at_k",
    "retrieval_metrics",
    "retrieve",
    "write_trec_run",
]
