"""Each fold's training rows (:mod:`gradcache_sparton.crossval`): every candidate row once (labelled pairs,
self-supervised pairs, BM25 negatives, teacher scores), a fold's choice of them, and a later round's rows with
negatives mined by the fold's previous model."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from gradcache_sparton.crossval.settings import NEGATIVE_RANKS
from gradcache_sparton.crossval.teacher import ensemble_teacher_scores
from gradcache_sparton.data import BeirData, read_corpus, self_supervised_pairs, split_sentences
from gradcache_sparton.mining.teacher_job import TEACHER_COLUMN

if TYPE_CHECKING:
    import datasets

    from gradcache_sparton.crossval.settings import CrossvalSettings

__all__ = [
    "TEACHER_COLUMN",
    "TOP_K",
    "FoldRows",
    "Pool",
    "build_pool",
    "fold_rows",
    "fold_teacher_rows",
    "round_rows",
    "teacher_scorer",
]

TOP_K = 100  # the evaluation's depth, and the window the teacher normalises over


@dataclass
class Pool:
    """Every candidate training row once, with what decides its fold: rows of labelled pairs carry their
    query id, self-supervised rows their source document id; and each labelled row's positive id (what
    model negatives must skip, with the source documents)."""

    labelled: datasets.Dataset
    labelled_query_ids: list[str]
    labelled_positive_ids: list[str]
    selfsup: datasets.Dataset | None
    selfsup_doc_ids: list[str]


def build_pool(beir: BeirData, settings: CrossvalSettings, teacher: Callable[[Any], list] | None) -> Pool:
    """Labelled pairs of every judged query and (if asked) one self-supervised pair per corpus document
    whose query sentence occurs in no other document; BM25 negatives mined once for all of them (a row's
    negatives depend only on its own query and known positives, not on the folds), then ``teacher``'s
    scores of each row as its ``teacher_scores`` column (a function of the row alone, likewise)."""
    from gradcache_sparton.mining import beir_mining_pairs, mine_hard_negatives

    labelled = beir_mining_pairs(beir)
    labelled_query_ids, labelled_positive_ids = list(labelled["query_id"]), list(labelled["positive_id"])
    selfsup, selfsup_doc_ids = None, []
    if settings.self_supervised_pairs:
        documents = read_corpus(settings.beir_path)
        owner: dict[str, str | None] = {}  # sentence -> the one document holding it (None: several)
        for doc in documents:
            for sentence in split_sentences(doc.text):
                owner[sentence] = doc.doc_id if owner.get(sentence, doc.doc_id) == doc.doc_id else None
        pairs = self_supervised_pairs(
            [doc.text for doc in documents], titles=[doc.title for doc in documents], seed=settings.fold_seed
        )
        sources = [owner.get(query) for query in pairs["query"]]
        keep = [row for row, doc_id in enumerate(sources) if doc_id is not None]
        selfsup = pairs.select(keep)
        selfsup_doc_ids = [sources[row] for row in keep]
        selfsup = selfsup.add_column("query_id", [f"selfsup-{row}" for row in range(len(selfsup))])
        selfsup = selfsup.add_column("positive_id", selfsup_doc_ids)
    if settings.bm25_negatives:
        mine = {
            "corpus": beir.corpus,
            "num_negatives": settings.bm25_negatives,
            "rank_start": NEGATIVE_RANKS[0],
            "rank_end": NEGATIVE_RANKS[1],
            "seed": settings.fold_seed,
            "show_progress": False,
        }
        labelled = mine_hard_negatives(labelled, **mine)
        selfsup = mine_hard_negatives(selfsup, **mine) if selfsup is not None else None
    text_columns = [c for c in labelled.column_names if c not in ("query_id", "positive_id")]
    labelled = labelled.select_columns(text_columns)
    selfsup = selfsup.select_columns(text_columns) if selfsup is not None else None
    if teacher is not None:  # one call: the corpus is indexed and encoded once
        import datasets

        parts = [labelled] if selfsup is None else [labelled, selfsup]
        scores = teacher(datasets.concatenate_datasets(parts))
        labelled = labelled.add_column(TEACHER_COLUMN, scores[: len(labelled)])
        selfsup = selfsup.add_column(TEACHER_COLUMN, scores[len(labelled) :]) if selfsup is not None else None
    return Pool(labelled, labelled_query_ids, labelled_positive_ids, selfsup, selfsup_doc_ids)


def teacher_scorer(
    settings: CrossvalSettings,
    encoder: Any,
    tokenizer: Any,
    corpus: Sequence[str],
    bf16: bool,
    progress: bool,
) -> Callable[[Any], list[list[float]]]:
    """Training rows -> their teacher scores [C] each (:mod:`.teacher`): BM25 and ``encoder`` (the starting
    model, a round r > 1's previous model, or a fold's teacher) on the GPU when there is one (bf16 autocast
    with ``bf16``), at the evaluation lengths, normalised as ``teacher_normalisation`` says (zscore: over each
    query's top ``TOP_K``, the window the negatives come from)."""
    from gradcache_sparton.data import POSITIVE_COLUMN, QUERY_COLUMN
    from gradcache_sparton.data.columns import negative_number

    device = "cuda" if torch.cuda.is_available() else "cpu"
    encoder.to(device)
    encoding = settings.encoding(tokenizer, device=device, bf16=bf16, show_progress=progress)

    def scores(rows: Any) -> list[list[float]]:
        columns = rows[:]
        negatives = sorted((c for c in columns if negative_number(c)), key=negative_number)
        candidates = [
            list(texts) for texts in zip(*(columns[c] for c in [POSITIVE_COLUMN, *negatives]), strict=True)
        ]
        return ensemble_teacher_scores(
            columns[QUERY_COLUMN],
            candidates,
            corpus,
            encoder=encoder,
            encoding=encoding,
            bm25_weight=settings.teacher_weight,
            depth=TOP_K,
            normalisation=settings.teacher_normalisation,
        ).tolist()

    return scores


@dataclass
class FoldRows:
    """A fold's training rows and, row for row, the ids model negatives group and skip them by: a labelled
    row's claim id and judged document id, a self-supervised row's own id and its source document id."""

    rows: datasets.Dataset
    counts: dict[str, int]
    query_ids: list[str]
    positive_ids: list[str]


def fold_rows(pool: Pool, beir: BeirData, held_out: set[str], settings: CrossvalSettings) -> FoldRows:
    """The training rows of the fold holding out ``held_out``: every labelled pair of the other queries, plus
    a seeded choice of ``self_supervised_pairs`` from documents no training query judges."""
    import datasets

    rows = [i for i, q in enumerate(pool.labelled_query_ids) if q not in held_out]
    parts = [pool.labelled.select(rows)]
    counts = {"labelled_pairs": len(rows), "self_supervised_pairs": 0}
    query_ids = [pool.labelled_query_ids[i] for i in rows]
    positive_ids = [pool.labelled_positive_ids[i] for i in rows]
    if pool.selfsup is not None:
        judged = {d for q, rel in beir.qrels.items() if q not in held_out for d, r in rel.items() if r > 0}
        eligible = [i for i, d in enumerate(pool.selfsup_doc_ids) if d not in judged]
        if len(eligible) < settings.self_supervised_pairs:
            raise ValueError(
                f"self_supervised_pairs={settings.self_supervised_pairs} but only {len(eligible)} corpus "
                "documents give one that no training query judges"
            )
        chosen = sorted(random.Random(settings.fold_seed).sample(eligible, settings.self_supervised_pairs))
        parts.append(pool.selfsup.select(chosen))
        counts["self_supervised_pairs"] = len(chosen)
        query_ids += [f"selfsup-{i}" for i in chosen]
        positive_ids += [pool.selfsup_doc_ids[i] for i in chosen]
    joined = datasets.concatenate_datasets(parts) if len(parts) > 1 else parts[0]
    return FoldRows(joined, counts, query_ids, positive_ids)


def _with_model_negatives(
    fold: FoldRows, corpus: dict[str, str], settings: CrossvalSettings, encoder: Any, tokenizer: Any
) -> datasets.Dataset:
    """The fold's rows with ``model_negatives`` more negative columns after its BM25 ones (and without
    teacher scores, which belong to the candidates they were computed for): ``encoder`` (a fold model that
    never saw the held-out claims) ranks the full corpus for each row's query at the evaluation lengths and
    :func:`~gradcache_sparton.mining.mine_hard_negatives` (``method="splade"``, as ``mine`` does) draws them
    from ranks ``NEGATIVE_RANKS`` less the row's known positives: every judged abstract of a labelled row's
    claim, a self-supervised row's source abstract. A model negative may repeat one of the row's BM25
    negatives (the two miners draw independently)."""
    from gradcache_sparton.data import NEGATIVE_PREFIX, POSITIVE_COLUMN, QUERY_COLUMN
    from gradcache_sparton.data.columns import negative_number
    from gradcache_sparton.mining import POSITIVE_ID_COLUMN, QUERY_ID_COLUMN, mine_hard_negatives

    pairs = fold.rows.select_columns([QUERY_COLUMN, POSITIVE_COLUMN])
    pairs = pairs.add_column(QUERY_ID_COLUMN, fold.query_ids).add_column(
        POSITIVE_ID_COLUMN, fold.positive_ids
    )
    mined = mine_hard_negatives(
        pairs,
        corpus=corpus,
        method="splade",
        num_negatives=settings.model_negatives,
        rank_start=NEGATIVE_RANKS[0],
        rank_end=NEGATIVE_RANKS[1],
        seed=settings.fold_seed,
        encoder=encoder,
        encoding=settings.encoding(tokenizer),
        show_progress=False,
    )
    rows = fold.rows
    if TEACHER_COLUMN in rows.column_names:
        rows = rows.remove_columns([TEACHER_COLUMN])
    have = sum(1 for name in rows.column_names if negative_number(name))
    columns = mined[:]
    for i in range(1, settings.model_negatives + 1):
        rows = rows.add_column(f"{NEGATIVE_PREFIX}{have + i}", columns[f"{NEGATIVE_PREFIX}{i}"])
    return rows


def fold_teacher_rows(
    fold: FoldRows,
    corpus: dict[str, str],
    settings: CrossvalSettings,
    teacher: Any,
    tokenizer: Any,
    bf16: bool,
    progress: bool,
) -> datasets.Dataset:
    """The fold's rows with ``teacher_scores`` from BM25 and ``teacher``, the model the teacher recipe trained on
    these rows (:func:`teacher_scorer`): a function of each row's texts, the corpus and that model alone."""
    scores = teacher_scorer(settings, teacher, tokenizer, list(corpus.values()), bf16, progress)
    return fold.rows.add_column(TEACHER_COLUMN, scores(fold.rows))


def round_rows(
    fold: FoldRows,
    corpus: dict[str, str],
    settings: CrossvalSettings,
    previous: Any,
    tokenizer: Any,
    bf16: bool,
    progress: bool,
) -> datasets.Dataset:
    """The training rows of a round r > 1 of ``fold``: its round-1 rows, with ``model_negatives`` more
    negatives mined by ``previous`` (the fold's round r - 1 model; :func:`_with_model_negatives`) and, with a
    teacher, ``teacher_scores`` of the new candidates from BM25 and ``previous`` (the "model" of ``bm25+model``
    in round r > 1)."""
    rows = fold.rows
    if settings.model_negatives:
        rows = _with_model_negatives(fold, corpus, settings, previous, tokenizer)
    if settings.teacher != "none":
        if TEACHER_COLUMN in rows.column_names:
            rows = rows.remove_columns([TEACHER_COLUMN])
        teacher = teacher_scorer(settings, previous, tokenizer, list(corpus.values()), bf16, progress)
        rows = rows.add_column(TEACHER_COLUMN, teacher(rows))
    return rows
