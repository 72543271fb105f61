"""Rank a corpus for every query, to a fixed depth: BM25 (bm25s) or a sparse encoder's own retrieval.

Legend: Q queries, N corpus documents, K ranking depth, V vocabulary.

Both rankers return [Q, K] int64 corpus indices, best first. Equal scores rank the earlier document
(lower index) first, the rule of :func:`gradcache_sparton.evaluation.retrieve`, so a ranking is a
function of the inputs alone (no dependence on chunk sizes, threads or selection algorithms).
:func:`bm25_scores` gives BM25's scores themselves, of any text (in the corpus or not) under the
corpus's index: what a teacher built from BM25 needs (:mod:`gradcache_sparton.crossval.teacher`).
"""

from __future__ import annotations

import logging
import math
import os
import sys
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor
from tqdm.auto import tqdm

from gradcache_sparton.data import QUERY_COLUMN
from gradcache_sparton.evaluation import EncodingSettings, retrieve
from gradcache_sparton.evaluation.encoding import takes_encoding
from gradcache_sparton.primitives.column_routing import DOCUMENT_COLUMN

__all__ = [
    "BM25_STEMMER",
    "bm25_rankings",
    "bm25_reps",
    "bm25_scores",
    "check_bm25_installed",
    "splade_rankings",
]

logger = logging.getLogger(__name__)

# Snowball English stemming (PyStemmer): on the 809 SciFact training claims it lifts bm25s's nDCG@10
# from 0.667 to 0.696 (docs/mining.md); None tokenises without stemming.
BM25_STEMMER = "english"
# English stop words, bm25s's own list (shipped in the package: nothing to download).
_BM25_STOPWORDS = "en"
# bm25s's defaults (Lucene BM25), named so that bm25_rankings and bm25_scores score alike.
_BM25_K1 = 1.5
_BM25_B = 0.75
_BM25_METHOD = "lucene"
# Queries per block of bm25_scores's corpus scores: a dense [block, N] float64 array (40 MB at N = 5,000).
_SCORE_BLOCK = 1024


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
    bm25s, tokenize = _bm25_tokenizer(stemmer)
    # bm25s's own eight bars (and its DEBUG line) stay off: one bar, the ranking's, covers this phase.
    logger.info("BM25: indexing %d documents.", len(documents))
    retriever = bm25s.BM25(k1=_BM25_K1, b=_BM25_B, method=_BM25_METHOD)
    retriever.index(tokenize(documents), show_progress=False)
    query_tokens = tokenize(queries)
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


def _bm25_tokenizer(stemmer: str | None) -> tuple[Any, Callable[[Sequence[str]], list[list[str]]]]:
    """bm25s and its tokenizer as the rankings use it: texts -> lists of (stemmed) tokens, stop words out."""
    bm25s, stemmer_object = _bm25_pieces(stemmer)

    def tokenize(texts: Sequence[str]) -> list[list[str]]:
        return bm25s.tokenize(
            list(texts),
            stopwords=_BM25_STOPWORDS,
            stemmer=stemmer_object,
            return_ids=False,
            show_progress=False,
        )

    return bm25s, tokenize


def _token_matrix(
    token_lists: list[list[str]], vocab: dict[str, int], value: Callable[[int, int], float]
) -> Any:
    """[n, T] scipy CSR: ``value(tf, length)`` for every vocabulary token of each text, tf its count there
    and length the text's token count (all its tokens); tokens outside ``vocab`` are dropped."""
    from scipy import sparse

    rows, cols, values = [], [], []
    for row, tokens in enumerate(token_lists):
        for token, tf in Counter(t for t in tokens if t in vocab).items():
            rows.append(row)
            cols.append(vocab[token])
            values.append(value(tf, len(tokens)))
    return sparse.csr_matrix((values, (rows, cols)), shape=(len(token_lists), len(vocab)), dtype=np.float64)


def _bm25_weights(
    token_lists: list[list[str]], vocab: dict[str, int], idf: np.ndarray, avg_length: float
) -> Any:
    """[n, T] scipy CSR: the Lucene BM25 weight of every vocabulary token in each text,
    idf · tf / (tf + k1 · (1 - b + b · length / avg_length)) (idf applied per column)."""
    from scipy import sparse

    def saturation(tf: int, length: int) -> float:
        return tf / (tf + _BM25_K1 * (1 - _BM25_B + _BM25_B * length / avg_length))

    return (_token_matrix(token_lists, vocab, saturation) @ sparse.diags(idf)).tocsr()


class _BM25Index:
    """The statistics of bm25s's index over ``documents`` (:func:`bm25_rankings`'s tokenizer and ``stemmer``):
    its vocabulary T (the corpus's tokens), each token's idf, the mean length; texts become [n, T] CSR rows."""

    def __init__(self, documents: Sequence[str], stemmer: str | None) -> None:
        _, self.tokenize = _bm25_tokenizer(stemmer)
        self.doc_tokens = self.tokenize(documents)
        self.vocab: dict[str, int] = {}
        doc_freq: Counter[str] = Counter()
        for tokens in self.doc_tokens:
            for token in dict.fromkeys(tokens):
                self.vocab.setdefault(token, len(self.vocab))
                doc_freq[token] += 1
        n = len(documents)
        self.idf = np.array(
            [math.log(1 + (n - doc_freq[t] + 0.5) / (doc_freq[t] + 0.5)) for t in self.vocab]
        )  # [T]
        # An all-stop-word corpus scores 0 anyway.
        self.avg_length = max(sum(map(len, self.doc_tokens)) / n, 1e-12)

    def counts(self, token_lists: list[list[str]]) -> Any:
        """[n, T] query token counts: bm25s sums a repeated query token once per occurrence and drops tokens
        the corpus never uses."""
        return _token_matrix(token_lists, self.vocab, lambda tf, _: float(tf))

    def weights(self, token_lists: list[list[str]]) -> Any:
        """[n, T] each text's BM25 weights under this index."""
        return _bm25_weights(token_lists, self.vocab, self.idf, self.avg_length)


def bm25_reps(
    queries: Sequence[str],
    texts: Sequence[str],
    documents: Sequence[str],
    *,
    stemmer: str | None = BM25_STEMMER,
) -> tuple[Any, Any]:
    """BM25 as sparse reps in its own vocabulary T (the tokens of ``documents``, the corpus): ``(query_counts
    [Q, T], text_weights [n, T])``, float64 scipy CSR, so that ``query_counts[i] · text_weights[j]`` is the
    BM25 score of ``texts[j]`` for ``queries[i]`` under the corpus's index, what :func:`bm25_scores` gives."""
    if not documents:
        raise ValueError("documents is empty: there is no corpus to index")
    index = _BM25Index(documents, stemmer)
    return index.counts(index.tokenize(queries)), index.weights(index.tokenize(texts))


def bm25_scores(
    queries: Sequence[str],
    candidates: Sequence[Sequence[str]],
    documents: Sequence[str],
    *,
    depth: int,
    stemmer: str | None = BM25_STEMMER,
    show_progress: bool = True,
) -> tuple[Tensor, Tensor]:
    """BM25 scores of each query's own candidate texts, and its ``depth`` best scores over the corpus.

    Legend: C candidates per query.

    Returns ``(candidate_scores [Q, C], top_scores [Q, K])``, float64: query i against
    ``candidates[i][j]``, and query i's K = ``depth`` highest scores over ``documents``, descending.
    Every text is scored under the index :func:`bm25_rankings` builds over ``documents`` (its document
    count, document frequencies and mean length; the same tokenizer and ``stemmer``; Lucene BM25,
    k1 = 1.5, b = 0.75): a candidate that is a corpus document gets the score bm25s gives it, a text outside
    the corpus (a self-supervised positive: an abstract less one sentence) the score it would get in that
    index. Query tokens the corpus never uses count 0, as in bm25s. ``ValueError`` unless every query has
    the same number C >= 1 of candidates and ``depth`` is in [1, N].
    """
    _check_depth(depth, len(queries), len(documents))
    if len(candidates) != len(queries):
        raise ValueError(
            f"candidates must hold one list per query: {len(candidates)} lists, {len(queries)} queries"
        )
    widths = {len(texts) for texts in candidates}
    if len(widths) != 1 or 0 in widths:
        raise ValueError(f"every query needs the same number (>= 1) of candidates, got {sorted(widths)}")
    (width,) = widths
    index = _BM25Index(documents, stemmer)
    num_docs = len(documents)
    doc_weights = index.weights(index.doc_tokens).T.tocsr()  # [T, N]
    counts = index.counts(index.tokenize(queries))  # [Q, T]
    flat = [text for texts in candidates for text in texts]
    candidate_weights = index.weights(index.tokenize(flat))  # [Q·C, T]
    repeated = counts[np.repeat(np.arange(len(queries)), width)]  # [Q·C, T]
    candidate_scores = np.asarray(repeated.multiply(candidate_weights).sum(axis=1)).reshape(
        len(queries), width
    )
    top = np.empty((len(queries), depth), dtype=np.float64)  # [Q, K]
    for start in tqdm(
        range(0, len(queries), _SCORE_BLOCK), desc="BM25 teacher scores", disable=not show_progress
    ):
        block = (counts[start : start + _SCORE_BLOCK] @ doc_weights).toarray()  # [b, T] @ [T, N] -> [b, N]
        best = -np.partition(-block, depth - 1, axis=1)[:, :depth] if depth < num_docs else block
        top[start : start + _SCORE_BLOCK] = -np.sort(-best, axis=1)
    return torch.from_numpy(candidate_scores), torch.from_numpy(top)


@takes_encoding
def splade_rankings(
    encoder: Callable[..., Tensor],
    queries: Sequence[str],
    documents: Sequence[str],
    *,
    encoding: EncodingSettings,
    depth: int,
) -> Tensor:
    """The top ``depth`` documents of every query under the encoder's own retrieval: [Q, K] int64.

    Queries and documents are encoded as ``encoding`` says (``encoder(**features) -> [B, V]``, texts
    truncated to its ``query_max_length`` / ``document_max_length`` tokens, as in training and evaluation)
    and ranked by dot product with :func:`~gradcache_sparton.evaluation.retrieve` (ties: the earlier
    document first). Its ``device`` defaults to the device of the encoder's first parameter (CPU for a
    parameterless callable).
    """
    _check_depth(depth, len(queries), len(documents))
    q_reps = encoding.encode(encoder, queries, column=QUERY_COLUMN, desc="Encoding queries")  # Q [V] reps
    d_reps = encoding.encode(encoder, documents, column=DOCUMENT_COLUMN, desc="Encoding corpus")  # N [V] reps
    device = encoding.device_for(encoder)
    _, doc_index = retrieve(q_reps, d_reps, top_k=depth, device=device)  # [Q, K]
    return doc_index
