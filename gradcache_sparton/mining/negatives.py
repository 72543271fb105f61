"""Pick k hard negatives per (query, positive) pair from a ranking of the corpus, skipping known positives.

Legend: Q distinct queries, N corpus documents, K ranking depth.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from torch import Tensor
from tqdm.auto import tqdm

from gradcache_sparton.data import NEGATIVE_PREFIX, POSITIVE_COLUMN, QUERY_COLUMN
from gradcache_sparton.evaluation import EncodingSettings
from gradcache_sparton.evaluation.encoding import takes_encoding
from gradcache_sparton.mining.pairs import POSITIVE_ID_COLUMN, QUERY_ID_COLUMN, check_mining_pairs
from gradcache_sparton.mining.rankings import (
    BM25_STEMMER,
    bm25_rankings,
    check_bm25_installed,
    splade_rankings,
)

if TYPE_CHECKING:
    import datasets

__all__ = ["METHODS", "SAMPLINGS", "check_mining_settings", "mine_hard_negatives"]

logger = logging.getLogger(__name__)

METHODS = ("bm25", "splade")
SAMPLINGS = ("random", "top")
# How much of a query text an error message quotes.
_QUOTE_CHARS = 80


def check_mining_settings(
    *, num_negatives: int, rank_start: int, rank_end: int, sampling: str, method: str
) -> None:
    """Raise ``ValueError`` naming the argument unless k >= 1, 1 <= rank_start, the window
    ``rank_start..rank_end`` holds at least k ranks, and sampling / method are known names."""
    for name, value in (("num_negatives", num_negatives), ("rank_start", rank_start), ("rank_end", rank_end)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if rank_end - rank_start + 1 < num_negatives:
        raise ValueError(
            f"the rank window {rank_start}..{rank_end} holds {max(rank_end - rank_start + 1, 0)} ranks, fewer "
            f"than num_negatives={num_negatives}: need rank_end >= rank_start + num_negatives - 1"
        )
    if sampling not in SAMPLINGS:
        raise ValueError(f"sampling must be one of {SAMPLINGS}, got {sampling!r}")
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")


@dataclass(frozen=True)
class _Queries:
    """The pairs grouped by query: row -> group, and per group its text and known positives."""

    row_group: list[int]
    texts: list[str]
    positive_ids: list[set[str]]
    positive_texts: list[set[str]]


def _column(pairs: datasets.Dataset, name: str) -> list | None:
    """A column as a Python list (None when the pairs have no such column). Slicing converts the whole
    Arrow column at once (and honours select/shuffle); iterating ``pairs[name]`` goes row by row."""
    return pairs.select_columns([name])[:][name] if name in pairs.column_names else None


def _group_by_query(pairs: datasets.Dataset) -> _Queries:
    queries, positives = _column(pairs, QUERY_COLUMN), _column(pairs, POSITIVE_COLUMN)
    query_ids, positive_ids = _column(pairs, QUERY_ID_COLUMN), _column(pairs, POSITIVE_ID_COLUMN)
    group_of: dict[str, int] = {}
    grouped = _Queries(row_group=[], texts=[], positive_ids=[], positive_texts=[])
    for row, (query, positive) in enumerate(zip(queries, positives, strict=True)):
        key = str(query_ids[row]) if query_ids is not None else query
        group = group_of.setdefault(key, len(group_of))
        if group == len(grouped.texts):
            grouped.texts.append(query)
            grouped.positive_ids.append(set())
            grouped.positive_texts.append(set())
        elif grouped.texts[group] != query:
            raise ValueError(
                f"row {row}: query_id {key!r} has the text {query[:_QUOTE_CHARS]!r} but an earlier row gives "
                f"it {grouped.texts[group][:_QUOTE_CHARS]!r}; one id must mean one query"
            )
        grouped.row_group.append(group)
        grouped.positive_texts[group].add(positive)
        if positive_ids is not None:
            grouped.positive_ids[group].add(str(positive_ids[row]))
    return grouped


def _corpus_lists(
    corpus: Mapping[str, str] | None, positives: list[str]
) -> tuple[list[str] | None, list[str]]:
    """(doc ids or None, doc texts): the given corpus, or the distinct positives in first-seen order."""
    if corpus is None:
        return None, list(dict.fromkeys(positives))
    if not isinstance(corpus, Mapping):
        raise TypeError(f"corpus must be a mapping of doc id -> text (or None), got {type(corpus).__name__}")
    if not corpus:
        raise ValueError("corpus is empty: there are no documents to mine negatives from")
    bad = next((doc_id for doc_id, text in corpus.items() if not isinstance(text, str)), None)
    if bad is not None:
        raise ValueError(f"corpus[{bad!r}] must be a str, got {type(corpus[bad]).__name__}")
    return [str(doc_id) for doc_id in corpus], list(corpus.values())


def _eligible_negatives(
    ranking: list[int],
    *,
    rank_start: int,
    doc_ids: list[str] | None,
    doc_texts: list[str],
    positive_ids: set[str],
    positive_texts: set[str],
) -> list[int]:
    """Corpus indices at ranks rank_start.. of ``ranking`` (1-based), in rank order, that are not a known
    positive (by id, or by exact text) and not a repeat of an earlier candidate's text."""
    eligible, seen = [], set()
    for doc in ranking[rank_start - 1 :]:
        text = doc_texts[doc]
        if text in positive_texts or text in seen or (doc_ids is not None and doc_ids[doc] in positive_ids):
            continue
        seen.add(text)
        eligible.append(doc)
    return eligible


@takes_encoding
def mine_hard_negatives(
    pairs: datasets.Dataset,
    *,
    corpus: Mapping[str, str] | None = None,
    method: Literal["bm25", "splade"] = "bm25",
    num_negatives: int = 2,
    rank_start: int = 10,
    rank_end: int = 100,
    sampling: Literal["random", "top"] = "random",
    seed: int = 0,
    encoder: Callable[..., Tensor] | None = None,
    encoding: EncodingSettings | None = None,
    bm25_stemmer: str | None = BM25_STEMMER,
    show_progress: bool = True,
) -> datasets.Dataset:
    """Add ``num_negatives`` (k) hard negatives to every (query, positive) pair.

    1. Rows are grouped by query (``query_id`` when the column exists, else the query text). A group's
       *known positives* are the ``positive`` texts (and ``positive_id`` ids) of all its rows.
    2. Every distinct query ranks the corpus to depth min(rank_end, N): ``method="bm25"`` with
       :func:`~gradcache_sparton.mining.bm25_rankings` (``bm25_stemmer``), ``method="splade"`` with the
       ``encoder``'s own retrieval, :func:`~gradcache_sparton.mining.splade_rankings` (needs
       ``encoding``, how texts are encoded: its tokenizer, max lengths, batch size, device and progress bars;
       ``show_progress`` is for this function's own). Ties rank the earlier corpus document first.
    3. A row's candidates are the documents at ranks ``rank_start..rank_end`` (1-based, inclusive,
       counted in the full ranking, known positives included), less every known positive of its
       query (matched by id when the pairs have ``positive_id``, and always by exact text: one text can
       sit under two ids) and less repeats of a text already a candidate. Skipping the top ranks
       keeps unjudged relevant documents (false negatives) out. ``sampling="top"`` takes the k best
       candidates; ``"random"`` draws k with ``random.Random(seed)`` (one generator for the call, rows
       in order), so the result is a function of the inputs and the seed. Either way the k are kept
       in rank order: ``negative_1`` is the best ranked.

    ``corpus`` maps doc id -> text (e.g. ``load_beir(...).corpus``); None mines among the distinct
    positives of ``pairs`` (matched by text). Returns a Dataset with columns ``query``, ``positive``,
    ``negative_1..k`` in the rows' order: what ``load_training_data`` / ``train`` read (write it with
    :func:`~gradcache_sparton.mining.write_training_file`).

    Raises ``ValueError`` before ranking for bad settings (k < 1, a window of fewer than k ranks, an
    unknown method or sampling), bad pairs (:func:`~gradcache_sparton.mining.check_mining_pairs`), an
    empty corpus, a window that starts past the corpus or holds fewer than k of its documents, and
    ``method``/``encoder`` mismatches; after ranking if some query has fewer than k candidates in its
    window (too many known positives or repeated texts): widen the window or lower k.
    """
    check_mining_settings(
        num_negatives=num_negatives,
        rank_start=rank_start,
        rank_end=rank_end,
        sampling=sampling,
        method=method,
    )
    if method == "bm25":
        if encoder is not None:
            raise ValueError("method='bm25' takes no encoder: pass method='splade' to mine with the encoder")
        check_bm25_installed(bm25_stemmer)
    elif encoder is None or encoding is None:
        raise ValueError(
            "method='splade' needs an encoder and its encoding settings (its tokenizer, max lengths)"
        )
    import datasets

    check_mining_pairs(pairs)
    queries = _group_by_query(pairs)
    positives = _column(pairs, POSITIVE_COLUMN)
    doc_ids, doc_texts = _corpus_lists(corpus, positives)
    num_docs = len(doc_texts)
    if min(rank_end, num_docs) - rank_start + 1 < num_negatives:
        raise ValueError(
            f"the corpus has {num_docs} documents: ranks {rank_start}..{rank_end} hold fewer than "
            f"num_negatives={num_negatives} of them; lower rank_start or num_negatives"
        )
    if corpus is not None:
        id_set, text_set = set(doc_ids or ()), set(doc_texts)
        positive_ids = _column(pairs, POSITIVE_ID_COLUMN)
        unmatched = sum(
            1
            for row, text in enumerate(positives)
            if text not in text_set and (positive_ids is None or str(positive_ids[row]) not in id_set)
        )
        if unmatched:
            logger.warning(
                "%d of %d positives are not in the corpus (neither by id nor by exact text): if the corpus "
                "holds them under another text they cannot be skipped and may be mined as negatives",
                unmatched,
                len(positives),
            )

    depth = min(rank_end, num_docs)
    if method == "bm25":
        rankings = bm25_rankings(
            queries.texts, doc_texts, depth=depth, stemmer=bm25_stemmer, show_progress=show_progress
        )  # [Q, K]
    else:
        rankings = splade_rankings(
            encoder, queries.texts, doc_texts, encoding=encoding, depth=depth
        )  # [Q, K]

    eligible = [
        _eligible_negatives(
            ranking,
            rank_start=rank_start,
            doc_ids=doc_ids,
            doc_texts=doc_texts,
            positive_ids=queries.positive_ids[group],
            positive_texts=queries.positive_texts[group],
        )
        for group, ranking in enumerate(rankings.tolist())
    ]
    short = [group for group, candidates in enumerate(eligible) if len(candidates) < num_negatives]
    if short:
        group = short[0]
        raise ValueError(
            f"{len(short)} of {len(eligible)} queries have fewer than num_negatives={num_negatives} candidates "
            f"in ranks {rank_start}..{rank_end} once known positives and repeated texts are skipped, e.g. "
            f"query {queries.texts[group][:_QUOTE_CHARS]!r} with {len(eligible[group])}: widen the window "
            "(rank_end) or lower num_negatives"
        )

    rng = random.Random(seed)
    columns: dict[str, list[str]] = {f"{NEGATIVE_PREFIX}{i + 1}": [] for i in range(num_negatives)}
    for group in tqdm(queries.row_group, desc="Picking negatives", disable=not show_progress):
        candidates = eligible[group]
        if sampling == "top":
            chosen = candidates[:num_negatives]
        else:
            chosen = [candidates[i] for i in sorted(rng.sample(range(len(candidates)), num_negatives))]
        for i, doc in enumerate(chosen):
            columns[f"{NEGATIVE_PREFIX}{i + 1}"].append(doc_texts[doc])
    logger.info(
        "mined %d negatives for each of %d pairs (%d queries, %d documents, %s, ranks %d..%d, %s)",
        num_negatives,
        len(pairs),
        len(queries.texts),
        num_docs,
        method,
        rank_start,
        rank_end,
        sampling,
    )
    return datasets.Dataset.from_dict(
        {QUERY_COLUMN: _column(pairs, QUERY_COLUMN), POSITIVE_COLUMN: positives, **columns}
    )
