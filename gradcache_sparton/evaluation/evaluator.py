"""The retrieval evaluator: encode a BEIR dataset's judged queries and corpus, retrieve, score.

Legend: Q queries, N documents, K top-k.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedTokenizerBase

from gradcache_sparton.data import BeirData
from gradcache_sparton.evaluation.encoding import PAD_TO_MULTIPLE_OF, Encoder, encode_texts, encoder_device
from gradcache_sparton.evaluation.metrics import retrieval_metrics
from gradcache_sparton.evaluation.retrieval import retrieve

__all__ = ["SparseRetrievalEvaluator"]


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
            if value < 1 or value % PAD_TO_MULTIPLE_OF:
                raise ValueError(f"{name} must be a positive multiple of {PAD_TO_MULTIPLE_OF}, got {value}")
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
        device = encoder_device(encoder) if self.device is None else torch.device(self.device)
        _, doc_index = retrieve(q_reps, d_reps, top_k=self.top_k, device=device)  # [Q, K]
        rankings = {
            query_id: [self.doc_ids[i] for i in row]
            for query_id, row in zip(self.query_ids, doc_index.tolist(), strict=True)
        }
        metrics = retrieval_metrics(rankings, self.data.qrels, ndcg_k=10, mrr_k=10, recall_k=self.top_k)
        metrics["query_nonzeros"] = q_reps.nonzeros_per_row().double().mean().item()
        metrics["doc_nonzeros"] = d_reps.nonzeros_per_row().double().mean().item()
        return metrics
