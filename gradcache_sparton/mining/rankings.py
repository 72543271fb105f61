"""Rank a corpus for every query, to a fixed depth: BM25 (bm25s) or a sparse encoder's own retrieval.

Legend: Q queries, N corpus documents, K ranking depth, V vocabulary.

Both rankers return [Q, K] int64 corpus indices, best first. Equal scores rank the earlier document
(lower index) first, the rule of :func:`gradcache_sparton.evaluation.retrieve`, so a ranking is a
function of the inputs alone (no dependence on chunk sizes, threads or selection algorithms).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerBase

from gradcache_sparton.evaluation import encode_texts, retrieve

__all__ = ["BM25_STEMMER", "bm25_rankings", "check_bm25_installed", "splade_rankings"]

logger = logging.getLogger(__name__)

# Snowball English stemming (PyStemmer): on the 809 SciFact training claims it lifts bm25s's nDCG@10
# from 0.667 to 0.696 (docs/mining.md); None tokenises without stemming.
BM25_STEMMER = "english"
# English stop words, bm25s's own list (shipped in the package: nothing to download).
_BM25_STOPWORDS = "en"


def check_bm25_installed(stemmer: str | None) -> None:
    """Raise ``ImportError`` (how to install) unless bm25s, and PyStemmer for a stemmer, import; raise
    ``ValueError`` for a stemmer name PyStemmer does not know. Cheap: call it before any heavy work."""
    _bm25_pieces(stemmer)


def _bm25_pieces(stemmer: str | None) -> tuple[Any, Callable[[str], str] | None]:
    """The bm25s module and the stemmer object (None without stemming)."""
    if "jax" not in sys.modules:
        # bm25s runs a JAX op at import where JAX is installed; on a GPU machine JAX then takes 75% of the
        # first GPU's memory for the life of the process (the training or encoding beside it runs out of
        # memory). BM25's top-k is CPU work: keep JAX there unless the user chose its platform.
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    try:
        import bm25s
    except ImportError as exc:
        raise ImportError(
            "BM25 mining needs bm25s: pip install 'gradcache_sparton[mining]' (or pip install bm25s)"
        ) from exc
    logging.getLogger("bm25s").setLevel(logging.WARNING)  # bm25s sets DEBUG on its logger at import
    if stemmer is None:
        return bm25s, None
    try:
        import Stemmer
    except ImportError as exc:
        raise ImportError(
            f"bm25_stemmer={stemmer!r} needs PyStemmer: pip install 'gradcache_sparton[mining]' "
            "(or pip install PyStemmer), or mine without stemming (bm25_stemmer=None, CLI: none)"
        ) from exc
    if stemmer not in Stemmer.algorithms():
        raise ValueError(f"bm25_stemmer must be one of {Stemmer.algorithms()} or None, got {stemmer!r}")
    return bm25s, Stemmer.Stemmer(stemmer)


def _check_depth(depth: int, num_queries: int, num_docs: int) -> None:
    if num_queries == 0:
        raise ValueError("queries is empty: nothing to rank")
    if num_docs == 0:
        raise ValueError("documents is empty: there is no corpus to rank")
    if isinstance(depth, bool) or not isinstance(depth, int) or not 1 <= depth <= num_docs:
        raise ValueError(f"depth must be an int in [1, {num_docs}] (the corpus size), got {depth!r}")


def _top_depth(scores: np.ndarray, depth: int) -> np.ndarray:
    """Indices of the ``depth`` best scores of one query, best first, ties by lower index: [K]."""
    num_docs = scores.shape[0]
    if depth < num_docs:
        # Every index scoring at least the depth-th best score: a superset of the top depth, in
        # ascending index order, so a stable sort on the score ranks equal scores by index.
        threshold = np.partition(scores, num_docs - depth)[num_docs - depth]
        candidates = np.flatnonzero(scores >= threshold)
    else:
        candidates = np.arange(num_docs)
    order = np.argsort(-scores[candidates], kind="stable")[:depth]
    return candidates[order]


def bm25_rankings(
    queries: Sequence[str],
    documents: Sequence[str],
    *,
    depth: int,
    stemmer: str | None = BM25_STEMMER,
    show_progress: bool = True,
) -> Tensor:
    """The top ``depth`` documents of every query under BM25: [Q, K] int64 corpus indices, best first.

    Scoring is bm25s's (Lucene BM25, k1 = 1.5, b = 0.75). Texts are tokenised by bm25s's own
    tokenizer: lower-cased, words of 2+ word characters, its English stop-word list removed, then
    Snowball-stemmed with ``stemmer`` (a PyStemmer algorithm name; None: no stemming). A query with
    no indexed token scores 0 everywhere and gets the first ``depth`` documents in corpus order.
    Ties rank the earlier document first.
    """
    _check_depth(depth, len(queries), len(documents))
    bm25s, stemmer_object = _bm25_pieces(stemmer)
    tokenize = dict(stopwords=_BM25_STOPWORDS, stemmer=stemmer_object, return_ids=False)
    # bm25s's own eight bars (and its DEBUG line) stay off: one bar, the ranking's, covers this phase.
    logger.info("BM25: indexing %d documents.", len(documents))
    doc_tokens = bm25s.tokenize(list(documents), show_progress=False, **tokenize)
    retriever = bm25s.BM25()
    retriever.index(doc_tokens, show_progress=False)
    query_tokens = bm25s.tokenize(list(queries), show_progress=False, **tokenize)
    rankings = np.empty((len(queries), depth), dtype=np.int64)  # [Q, K]
    for row, tokens in enumerate(tqdm(query_tokens, desc="BM25 ranking", disable=not show_progress)):
        known = retriever.get_tokens_ids(tokens)
        scores = (
            retriever.get_scores_from_ids(known)
            if known
            else np.zeros(len(documents), dtype=np.float32)  # [N]
        )
        rankings[row] = _top_depth(scores, depth)
    return torch.from_numpy(rankings)


def splade_rankings(
    encoder: Callable[..., Tensor],
    queries: Sequence[str],
    documents: Sequence[str],
    *,
    tokenizer: PreTrainedTokenizerBase,
    depth: int,
    query_max_length: int = 32,
    document_max_length: int = 256,
    batch_size: int = 64,
    device: torch.device | str | None = None,
    show_progress: bool = True,
) -> Tensor:
    """The top ``depth`` documents of every query under the encoder's own retrieval: [Q, K] int64.

    Queries and documents are encoded with :func:`~gradcache_sparton.evaluation.encode_texts`
    (``encoder(**features) -> [B, V]``, texts truncated to ``query_max_length`` /
    ``document_max_length`` tokens, as in training and evaluation) and ranked by dot product with
    :func:`~gradcache_sparton.evaluation.retrieve` (ties: the earlier document first). ``device``
    defaults to the device of the encoder's first parameter (CPU for a parameterless callable).
    """
    _check_depth(depth, len(queries), len(documents))
    for name, value in (("query_max_length", query_max_length), ("document_max_length", document_max_length)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1 or value % 8:
            raise ValueError(f"{name} must be a positive multiple of 8 (as in training), got {value!r}")
    if device is None and isinstance(encoder, nn.Module):
        device = next(encoder.parameters(), torch.empty(0)).device
    common = dict(tokenizer=tokenizer, batch_size=batch_size, device=device, show_progress=show_progress)
    q_reps = encode_texts(
        encoder, queries, max_length=query_max_length, desc="Encoding queries", **common
    )  # Q sparse [V] reps
    d_reps = encode_texts(
        encoder, documents, max_length=document_max_length, desc="Encoding corpus", **common
    )  # N sparse [V] reps
    _, doc_index = retrieve(q_reps, d_reps, top_k=depth, device=device)  # [Q, K]
    return doc_index
