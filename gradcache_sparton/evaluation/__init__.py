"""Retrieval evaluation of sparse encoders on BEIR-format data: encode, prune, retrieve, score.

Legend: B batch, S sequence, V vocabulary, Q queries, N documents, C a document chunk, K top-k.

One job per module:

- :class:`SparseReps` (defined in :mod:`gradcache_sparton.primitives.sparse_reps`, shared with the engine and the
  losses, re-exported here): reps kept sparsely (row offsets, vocabulary ids, weights).
- :mod:`.encoding`: :func:`encode_texts` runs ``encoder(**features) -> [B, V]`` over texts in
  batches (no autograd, optional autocast, a tqdm bar): memory grows with the non-zeros, never N × V;
  :class:`EncodingSettings`, how queries and documents are encoded (tokenizer, max lengths, batch, device).
- :mod:`.pruning`: :func:`prune_reps` and :class:`PruningBudget`: top-k per rep (query and document
  budgets apart) and a weight threshold.
- :mod:`.retrieval`: :func:`retrieve` scores by sparse dot product, queries densified a block at a
  time, documents a chunk at a time, ``[Qb, V] @ [V, C] -> [Qb, C]`` merged into a running top-k;
  nothing of size Q × N × V (nor Q × N) is ever built. Ties rank the earlier doc first.
- :mod:`.metrics`: any ``ir_measures`` measure (default nDCG@10, RR@10, R@100), averaged over the
  queries with at least one relevant document.
- :mod:`.seismic_index`: :func:`retrieve_seismic`, retrieval through a seismic inverted index
  (:func:`build_seismic_index` once, :func:`search_seismic` many times).
- :mod:`.export`: :func:`export_corpus` streams encoded corpora to seismic's and Anserini's formats.
- :mod:`.onnx_export`: :func:`export_onnx`, the document encoder as an ONNX model, and
  :func:`check_onnx_reps`, its reps checked against PyTorch's.
- :mod:`.optional_imports`: whether an optional dependency (onnx, seismic) imports.
- :mod:`.runs`: runs (query id -> ranked (doc id, score)) and TREC run files.
- :mod:`.evaluator`: :class:`SparseRetrievalEvaluator`, the pipeline on a BEIR dataset.
- :mod:`.report`: the mean over datasets and a plain-text table of results.
- :mod:`.significance`: per-query metrics and paired statistics of two systems on the same queries (mean
  difference, 95% bootstrap interval, randomization p-value).
- :mod:`.callback`: :class:`RetrievalEvalCallback` runs the evaluator from a ``transformers.Trainer``
  and logs through ``trainer.log``. It loads on first use of its name: ``transformers``' trainer
  utilities import torch's compiler stack (and triton) when peft is installed, which a plain
  ``import gradcache_sparton`` must not pay for.
"""

import importlib
from typing import TYPE_CHECKING, Any

from gradcache_sparton.evaluation.encoding import EncodingSettings, encode_texts
from gradcache_sparton.evaluation.evaluator import RETRIEVALS, EvaluationResult, SparseRetrievalEvaluator
from gradcache_sparton.evaluation.export import EXPORT_FORMATS, check_scale, export_corpus, write_vectors
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
from gradcache_sparton.evaluation.seismic_index import (
    MAX_SEISMIC_NONZEROS,
    build_seismic_index,
    retrieve_seismic,
    search_seismic,
    seismic_available,
)
from gradcache_sparton.primitives.sparse_reps import SparseReps

if TYPE_CHECKING:
    from gradcache_sparton.evaluation.callback import RetrievalEvalCallback

__all__ = [
    "DEFAULT_MEASURES",
    "EXPORT_FORMATS",
    "MAX_SEISMIC_NONZEROS",
    "RETRIEVALS",
    "EncodingSettings",
    "EvaluationResult",
    "PruningBudget",
    "RetrievalEvalCallback",
    "Run",
    "SparseReps",
    "SparseRetrievalEvaluator",
    "build_seismic_index",
    "check_scale",
    "check_trec_ids",
    "encode_texts",
    "export_corpus",
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
    "retrieve_seismic",
    "search_seismic",
    "seismic_available",
    "write_trec_run",
    "write_vectors",
]


def __getattr__(name: str) -> Any:
    if name == "RetrievalEvalCallback":
        return importlib.import_module("gradcache_sparton.evaluation.callback").RetrievalEvalCallback
    raise AttributeError(f"module 'gradcache_sparton.evaluation' has no attribute {name!r}")
