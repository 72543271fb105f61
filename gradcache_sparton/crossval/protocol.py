"""The cross-validation protocol (:mod:`gradcache_sparton.crossval`): its settings, the folds, the recipe's
``train`` flags, each fold's training rows, the evaluation of each model and the run."""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import logging
import platform
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from gradcache_sparton.crossval.report import (
    BM25,
    PRIMARY,
    RECIPE,
    ZERO_SHOT,
    _mean,
    _summarise,
    _write,
    round_system,
)
from gradcache_sparton.crossval.teacher import (
    DEFAULT_TEACHER_WEIGHT,
    LOSSES_READING_TEACHER,
    TEACHERS,
    ensemble_teacher_scores,
)
from gradcache_sparton.data import BeirData, load_beir, read_corpus, self_supervised_pairs, split_sentences
from gradcache_sparton.evaluation.evaluator import SparseRetrievalEvaluator
from gradcache_sparton.evaluation.runs import write_trec_run
from gradcache_sparton.evaluation.significance import DEFAULT_RESAMPLES, per_query_metrics

if TYPE_CHECKING:
    import datasets

    from gradcache_sparton.arguments import CachedSpladeTrainingArguments, ModelArguments

__all__ = [
    "NEGATIVE_RANKS",
    "ROUND_STARTS",
    "CrossvalSettings",
    "check_recipe_loss",
    "make_folds",
    "parse_recipe",
    "run_crossval",
]

logger = logging.getLogger(__name__)

MEASURES = ("nDCG@10", "RR@10", "R@100")  # the default of per_query_metrics
TOP_K = 100
TEACHER_COLUMN = "teacher_scores"  # the data column the distillation losses read
FOLDS_FILE = "folds.json"
# The rank window (1-based, inclusive) both miners draw negatives from, BM25 in round 1 and the fold model in
# later rounds: ``mine``'s defaults. Ranks 1..9 are skipped to keep unjudged relevant abstracts (false
# negatives) out; 100 is the teacher's normalisation depth (TOP_K), so every negative sits inside it.
NEGATIVE_RANKS = (10, 100)
# Where round r > 1 starts: the same fold's round r-1 model, or the recipe's starting model (docs/experiments.md).
ROUND_STARTS = ("previous", "start")
# train flags the protocol sets itself: the training data and evaluation of each fold.
_OWNED_FLAGS = (
    "train_data",
    "train_beir",
    "train_beir_split",
    "self_supervised_corpus",
    "max_train_samples",
    "eval_beir",
    "eval_beir_split",
    "retrieval_eval_steps",
    "eval_before_training",
    "output_dir",
    "seed",
)


@dataclass
class CrossvalSettings:
    """What ``run_crossval`` does besides the recipe itself (see the module docstring)."""

    beir_path: str
    output_dir: str
    split: str = "train"
    folds: int = 5
    fold_seed: int = 0
    seeds: list[int] = field(default_factory=lambda: [42])
    self_supervised_pairs: int = 0
    bm25_negatives: int = 0
    teacher: str = "none"
    teacher_weight: float = DEFAULT_TEACHER_WEIGHT
    rounds: int = 1
    model_negatives: int = 0
    round_start: str = "previous"
    bm25_reference: bool = True
    query_max_length: int = 32
    document_max_length: int = 256
    eval_batch_size: int = 64
    resamples: int = DEFAULT_RESAMPLES
    write_runs: bool = False

    def check(self) -> None:
        """``ValueError`` naming the first bad setting."""
        if self.folds < 2:
            raise ValueError(f"folds must be >= 2, got {self.folds}")
        if not self.seeds or len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"seeds must be distinct and at least one, got {self.seeds}")
        for name in ("self_supervised_pairs", "bm25_negatives", "model_negatives"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("query_max_length", "document_max_length", "eval_batch_size", "resamples"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.teacher not in TEACHERS:
            raise ValueError(f"teacher must be one of {TEACHERS}, got {self.teacher!r}")
        if self.teacher != "none" and self.bm25_negatives < 1:
            raise ValueError(
                f"teacher={self.teacher!r} scores each training pair's positive against its negatives: it needs "
                f"bm25_negatives >= 1, got {self.bm25_negatives}"
            )
        if not 0.0 <= self.teacher_weight <= 1.0:
            raise ValueError(f"teacher_weight (BM25's share) must be in [0, 1], got {self.teacher_weight!r}")
        if self.teacher == "none" and self.teacher_weight != DEFAULT_TEACHER_WEIGHT:
            raise ValueError(
                f"teacher_weight applies to a teacher only, got teacher_weight={self.teacher_weight} with "
                "teacher='none'"
            )
        self._check_rounds()

    def _check_rounds(self) -> None:
        if self.rounds < 1:
            raise ValueError(f"rounds must be >= 1, got {self.rounds}")
        if self.model_negatives and self.rounds < 2:
            raise ValueError(
                f"model_negatives={self.model_negatives} are mined by a fold's previous round's model: they need "
                f"rounds >= 2, got rounds={self.rounds}"
            )
        if self.round_start not in ROUND_STARTS:
            raise ValueError(f"round_start must be one of {ROUND_STARTS}, got {self.round_start!r}")
        if self.rounds == 1 and self.round_start != ROUND_STARTS[0]:
            raise ValueError(
                f"round_start applies to rounds >= 2, got round_start={self.round_start!r} with rounds=1"
            )
        if self.rounds > 1 and not self.model_negatives and self.teacher == "none":
            raise ValueError(
                f"rounds={self.rounds} without model_negatives or a teacher trains every round on round 1's rows: "
                "give model_negatives >= 1 (or a teacher, which round r > 1 takes from the round r-1 model)"
            )
        if self.model_negatives:
            window = NEGATIVE_RANKS[1] - NEGATIVE_RANKS[0] + 1
            if self.model_negatives > window:
                raise ValueError(
                    f"model_negatives={self.model_negatives} are drawn from the fold model's ranks "
                    f"{NEGATIVE_RANKS[0]}..{NEGATIVE_RANKS[1]}: at most {window}"
                )
            for name in ("query_max_length", "document_max_length"):
                if getattr(self, name) % 8:
                    raise ValueError(
                        f"model_negatives rank the corpus at the evaluation lengths, which the miner needs as "
                        f"multiples of 8 (as in training): got {name}={getattr(self, name)}"
                    )


def check_recipe_loss(settings: CrossvalSettings, training_args: CachedSpladeTrainingArguments) -> None:
    """``ValueError`` unless the recipe's loss and the teacher go together: a teacher's scores are read
    only by ``--contrastive kl_div`` or ``margin_mse`` (any other loss would train as if there were no
    teacher, so the run would measure something else than asked), and those two need a teacher."""
    contrastive = training_args.contrastive
    if settings.teacher != "none" and contrastive not in LOSSES_READING_TEACHER:
        raise ValueError(
            f"teacher={settings.teacher!r} writes teacher_scores that only the losses {LOSSES_READING_TEACHER} "
            f"read, but the recipe trains with contrastive={contrastive!r}: add `--contrastive kl_div` to the "
            "train flags (after --), or drop --teacher"
        )
    if settings.teacher == "none" and contrastive in LOSSES_READING_TEACHER:
        raise ValueError(
            f"the recipe trains with contrastive={contrastive!r}, which needs teacher scores: pass "
            f"--teacher {TEACHERS[1]} (with --bm25_negatives >= 1)"
        )


def make_folds(query_ids: Sequence[str], *, folds: int, seed: int) -> list[list[str]]:
    """The ids dealt into ``folds`` folds after a seeded shuffle of the sorted ids (a function of the id
    set and the seed, not of their order); each fold sorted. ``ValueError`` if a fold would be empty."""
    if folds < 2 or folds > len(query_ids):
        raise ValueError(f"folds must be in [2, {len(query_ids)}] (the number of queries), got {folds}")
    if len(set(query_ids)) != len(query_ids):
        raise ValueError("query_ids holds an id twice")
    ids = sorted(query_ids)
    random.Random(seed).shuffle(ids)
    return [sorted(ids[k::folds]) for k in range(folds)]


def _judged_queries(beir: BeirData) -> BeirData:
    """The queries the protocol cross-validates: those with at least one positive judgement, in the
    qrels file's order, with their judgements (the corpus unchanged)."""
    qrels = {q: rel for q, rel in beir.qrels.items() if any(r > 0 for r in rel.values())}
    return BeirData(corpus=beir.corpus, queries={q: beir.queries[q] for q in qrels}, qrels=qrels)


# ---------------------------------------------------------------------------------------------------
# The recipe: train flags
# ---------------------------------------------------------------------------------------------------


def parse_recipe(argv: Sequence[str]) -> tuple[ModelArguments, CachedSpladeTrainingArguments]:
    """The model and training arguments of ``train`` flags (``--config FILE|default`` first, then the flags,
    as ``gradcache-sparton train`` reads them; without ``--config`` the dataclass defaults). Flags naming
    training data, evaluation, ``output_dir`` or ``seed`` are ``ValueError``: the protocol sets them."""
    from transformers import HfArgumentParser

    from gradcache_sparton.arguments import CachedSpladeTrainingArguments, DataArguments, ModelArguments
    from gradcache_sparton.resources import default_train_config_path

    parser = HfArgumentParser((ModelArguments, DataArguments, CachedSpladeTrainingArguments))
    parser.add_argument("--config", default=None)
    pre, _ = parser.parse_known_args(list(argv))
    named = {token[2:].split("=", 1)[0] for token in argv if token.startswith("--")}
    owned = sorted(named & set(_OWNED_FLAGS))
    if owned:
        raise ValueError(
            f"train flags {['--' + n for n in owned]} are set by the protocol for each fold (training data from "
            "the other folds, evaluation on the held-out fold, one output folder and seed per run): leave them out"
        )
    if pre.config is not None:
        path = default_train_config_path() if pre.config == "default" else Path(pre.config)
        config = _read_config(path)
        config = {k: v for k, v in config.items() if k not in _OWNED_FLAGS}
        parser.set_defaults(**config)
    model_args, _, training_args, _ = parser.parse_args_into_dataclasses(
        args=[*argv, "--output_dir", "unused"], return_remaining_strings=False
    )
    return model_args, training_args


def _read_config(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ValueError(f"--config {str(path)!r} does not exist (give a .yaml/.json file or 'default')")
    text = path.read_text(encoding="utf-8")
    if path.suffix.lower() == ".json":
        values = json.loads(text)
    else:
        import yaml

        values = yaml.safe_load(text) or {}
    if not isinstance(values, dict):
        raise ValueError(f"--config {str(path)!r} must hold a mapping of argument names to values")
    return values


# ---------------------------------------------------------------------------------------------------
# Training rows of a fold
# ---------------------------------------------------------------------------------------------------


@dataclass
class _Pool:
    """Every candidate training row once, with what decides its fold: rows of labelled pairs carry their
    query id, self-supervised rows their source document id; and each labelled row's positive id (what
    model negatives must skip, with the source documents)."""

    labelled: datasets.Dataset
    labelled_query_ids: list[str]
    labelled_positive_ids: list[str]
    selfsup: datasets.Dataset | None
    selfsup_doc_ids: list[str]


def _build_pool(beir: BeirData, settings: CrossvalSettings, teacher: Callable[[Any], list] | None) -> _Pool:
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
    return _Pool(labelled, labelled_query_ids, labelled_positive_ids, selfsup, selfsup_doc_ids)


def _teacher(
    settings: CrossvalSettings,
    encoder: Any,
    tokenizer: Any,
    corpus: Sequence[str],
    bf16: bool,
    progress: bool,
) -> Callable[[Any], list[list[float]]]:
    """Training rows -> their ``bm25+model`` teacher scores [C] each (:mod:`.teacher`): the starting model
    on the GPU when there is one (bf16 autocast with the recipe's ``--bf16``), at the evaluation lengths,
    normalised over each query's top ``TOP_K``, the window the negatives come from."""
    from gradcache_sparton.data import POSITIVE_COLUMN, QUERY_COLUMN
    from gradcache_sparton.data.columns import negative_number

    device = "cuda" if torch.cuda.is_available() else "cpu"
    encoder.to(device)

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
            tokenizer=tokenizer,
            bm25_weight=settings.teacher_weight,
            depth=TOP_K,
            query_max_length=settings.query_max_length,
            document_max_length=settings.document_max_length,
            batch_size=settings.eval_batch_size,
            device=device,
            autocast_dtype=torch.bfloat16 if device == "cuda" and bf16 else None,
            show_progress=progress,
        ).tolist()

    return scores


@dataclass
class _FoldRows:
    """A fold's training rows and, row for row, the ids model negatives group and skip them by: a labelled
    row's claim id and judged document id, a self-supervised row's own id and its source document id."""

    rows: datasets.Dataset
    counts: dict[str, int]
    query_ids: list[str]
    positive_ids: list[str]


def _fold_rows(pool: _Pool, beir: BeirData, held_out: set[str], settings: CrossvalSettings) -> _FoldRows:
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
    return _FoldRows(joined, counts, query_ids, positive_ids)


def _with_model_negatives(
    fold: _FoldRows, corpus: dict[str, str], settings: CrossvalSettings, encoder: Any, tokenizer: Any
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
        tokenizer=tokenizer,
        query_max_length=settings.query_max_length,
        document_max_length=settings.document_max_length,
        batch_size=settings.eval_batch_size,
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


# ---------------------------------------------------------------------------------------------------
# Evaluation
# ---------------------------------------------------------------------------------------------------


def _evaluate_model(
    encoder: Any,
    tokenizer: Any,
    data: BeirData,
    settings: CrossvalSettings,
    bf16: bool,
    run_file: Path | None,
) -> dict:
    """Per-query metrics and mean non-zeros of ``encoder`` ranking the whole corpus for ``data``'s queries
    (the top 100 written to ``run_file`` as a TREC run when given)."""
    evaluator = SparseRetrievalEvaluator(
        data,
        tokenizer=tokenizer,
        query_max_length=settings.query_max_length,
        document_max_length=settings.document_max_length,
        batch_size=settings.eval_batch_size,
        top_k=TOP_K,
        measures=MEASURES,
        show_progress=False,
    )
    device = "cuda" if torch.cuda.is_available() else "cpu"
    evaluator.autocast_dtype = torch.bfloat16 if device == "cuda" and bf16 else None
    encoder.to(device).eval()
    (result,) = evaluator.evaluate(encoder)
    rankings = {q: [d for d, _ in hits] for q, hits in result.run.items()}
    if run_file is not None:
        write_trec_run(run_file, result.run, tag=run_file.stem)
    return {
        "per_query": per_query_metrics(rankings, data.qrels),
        "query_nonzeros": result.metrics["query_nonzeros"],
        "doc_nonzeros": result.metrics["doc_nonzeros"],
    }


def _bm25(beir: BeirData) -> dict:
    from gradcache_sparton.mining import bm25_rankings

    doc_ids = list(beir.corpus)
    depth = min(TOP_K, len(doc_ids))
    top = bm25_rankings(
        list(beir.queries.values()), list(beir.corpus.values()), depth=depth, show_progress=False
    )
    rankings = {q: [doc_ids[i] for i in row] for q, row in zip(beir.queries, top.tolist(), strict=True)}
    return {"per_query": per_query_metrics(rankings, beir.qrels)}


# ---------------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------------


def run_crossval(
    settings: CrossvalSettings,
    model_args: ModelArguments,
    training_args: CachedSpladeTrainingArguments,
    *,
    recipe_flags: Sequence[str] = (),
) -> dict[str, Any]:
    """Run the protocol (module docstring) and return what ``crossval.json`` holds."""
    from transformers import set_seed

    from gradcache_sparton.data.output import write_training_file
    from gradcache_sparton.mining import check_bm25_installed
    from gradcache_sparton.model_loading import build_encoder, build_tokenizer
    from gradcache_sparton.pipeline import run_training

    settings.check()
    check_recipe_loss(settings, training_args)
    if settings.bm25_reference or settings.bm25_negatives:
        check_bm25_installed("english")
    beir = _judged_queries(load_beir(settings.beir_path, split=settings.split))
    folds = make_folds(list(beir.qrels), folds=settings.folds, seed=settings.fold_seed)
    out = Path(settings.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / FOLDS_FILE).write_text(
        json.dumps({"fold_seed": settings.fold_seed, "folds": folds}, indent=1) + "\n"
    )
    began = time.monotonic()
    tokenizer = build_tokenizer(model_args)
    bf16 = bool(training_args.bf16)
    set_seed(settings.seeds[0])
    start_encoder = build_encoder(model_args, tokenizer)
    teacher, progress = None, not training_args.disable_tqdm
    if settings.teacher != "none":
        teacher = _teacher(settings, start_encoder, tokenizer, list(beir.corpus.values()), bf16, progress)
    pool = _build_pool(beir, settings, teacher)
    fold_info, fold_rows = [], []
    for k, held in enumerate(folds):
        fold = _fold_rows(pool, beir, set(held), settings)
        path = write_training_file(fold.rows, out / f"fold{k}" / "train.jsonl.gz", overwrite=True)
        fold_rows.append(fold)
        fold_info.append(
            {
                "fold": k,
                "queries": len(held),
                **fold.counts,
                "train_file": str(path.relative_to(out)),
                "query_ids": held,
            }
        )
    logger.info(
        "crossval: %d folds of %s built in %.0f s",
        len(folds),
        [len(f) for f in folds],
        time.monotonic() - began,
    )

    results: dict[str, Any] = {
        "meta": _run_meta(),
        "settings": {**vars(settings), "recipe_flags": list(recipe_flags)},
        "model": model_args.model_name_or_path or model_args.config_name,
        "folds": fold_info,
        "systems": {},
    }
    runs = out / "runs" if settings.write_runs else None
    if runs is not None:
        runs.mkdir(exist_ok=True)
    start = _evaluate_model(
        start_encoder,
        tokenizer,
        beir,
        settings,
        bf16,
        runs and runs / f"{ZERO_SHOT}.trec",
    )
    results["systems"][ZERO_SHOT] = {"seeds": {"-": start}}
    if settings.bm25_reference:
        results["systems"][BM25] = {"seeds": {"-": _bm25(beir)}}
    # Round r's models form system names[r - 1]: the last round is the recipe, earlier ones recipe-round<r>.
    names = [round_system(r) for r in range(1, settings.rounds)] + [RECIPE]
    for name in names:
        results["systems"][name] = {"seeds": {}}
    for seed in settings.seeds:
        per_query: dict[str, dict[str, dict[str, float]]] = {name: {} for name in names}
        nonzeros: dict[str, list[tuple[int, float, float]]] = {name: [] for name in names}
        for k, held in enumerate(folds):
            data = BeirData(
                corpus=beir.corpus,
                queries={q: beir.queries[q] for q in held},
                qrels={q: beir.qrels[q] for q in held},
            )
            train_file, round_args, trained = out / fold_info[k]["train_file"], model_args, None
            for r, name in enumerate(names, start=1):
                t0 = time.monotonic()
                run_dir = _run_dir(out, seed, k, r)
                if r > 1:  # rows and start from the same fold's (and seed's) round r - 1 model, `trained`
                    rows = _round_rows(
                        fold_rows[k], beir.corpus, settings, trained, tokenizer, bf16, progress
                    )
                    train_file = write_training_file(
                        rows, out / f"fold{k}" / f"train-seed{seed}-round{r}.jsonl.gz", overwrite=True
                    )
                    logger.info(
                        "crossval: seed %d fold %d round %d: %d rows, %d model negatives each, mined by round "
                        "%d's model (%.0f s)",
                        seed,
                        k,
                        r,
                        len(rows),
                        settings.model_negatives,
                        r - 1,
                        time.monotonic() - t0,
                    )
                    if settings.round_start == "previous":
                        round_args = _continued_model_args(model_args, _run_dir(out, seed, k, r - 1))
                fold_args = _fold_training_args(training_args, output_dir=str(run_dir), seed=seed)
                run_training(round_args, _fold_data_args(train_file), fold_args)
                trained = build_encoder(_trained_model_args(model_args, run_dir), tokenizer)
                run_file = runs and runs / f"{name}-seed{seed}-fold{k}.trec"
                fold_result = _evaluate_model(trained, tokenizer, data, settings, bf16, run_file)
                for key, values in fold_result["per_query"].items():
                    per_query[name].setdefault(key, {}).update(values)
                nonzeros[name].append((len(held), fold_result["query_nonzeros"], fold_result["doc_nonzeros"]))
                logger.info(
                    "crossval: seed %d fold %d%s: nDCG@10 %.4f (%.0f s)",
                    seed,
                    k,
                    f" round {r} of {settings.rounds}" if settings.rounds > 1 else "",
                    _mean(fold_result["per_query"][PRIMARY].values()),
                    time.monotonic() - t0,
                )
            for name in names:
                counts = nonzeros[name]
                results["systems"][name]["seeds"][str(seed)] = {
                    "per_query": per_query[name],
                    "query_nonzeros": sum(n * q for n, q, _ in counts) / sum(n for n, _, _ in counts),
                    "doc_nonzeros": sum(n * d for n, _, d in counts) / sum(n for n, _, _ in counts),
                    "folds_done": k + 1,
                }
            _summarise(results, folds)
            _write(results, out)
    return results


def _run_dir(out: Path, seed: int, fold: int, round_: int) -> Path:
    """Where round ``round_`` of ``fold`` trains its model: ``seed<s>/fold<k>`` for round 1 (as runs of one
    round), ``seed<s>/round<r>/fold<k>`` after."""
    return out / f"seed{seed}" / (f"fold{fold}" if round_ == 1 else f"round{round_}/fold{fold}")


def _round_rows(
    fold: _FoldRows,
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
        teacher = _teacher(settings, previous, tokenizer, list(corpus.values()), bf16, progress)
        rows = rows.add_column(TEACHER_COLUMN, teacher(rows))
    return rows


def _continued_model_args(model_args: Any, previous_dir: Path) -> Any:
    """The recipe's model arguments starting from the checkpoint in ``previous_dir`` instead: a checkpoint
    keeps the shape it was saved with, so the random-init settings (shape, decoder bias) are dropped."""
    from dataclasses import replace

    random_init = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
    return replace(
        model_args,
        model_name_or_path=str(previous_dir),
        init_decoder_bias=None,
        **dict.fromkeys(random_init),
    )


def _fold_training_args(training_args: Any, *, output_dir: str, seed: int) -> Any:
    from dataclasses import replace

    return replace(training_args, output_dir=output_dir, seed=seed, save_strategy="no", report_to=[])


def _fold_data_args(train_file: Path) -> Any:
    from gradcache_sparton.arguments import DataArguments

    return DataArguments(train_data=[str(train_file)], eval_beir="none")


def _trained_model_args(model_args: Any, run_dir: Path) -> Any:
    from gradcache_sparton.arguments import ModelArguments

    return ModelArguments(model_name_or_path=str(run_dir))


def _run_meta() -> dict[str, str]:
    """Where the numbers came from (``crossval.json`` is a raw result): device, versions, UTC date."""
    from gradcache_sparton.version import __version__

    on_cuda = torch.cuda.is_available()
    return {
        "device": torch.cuda.get_device_name() if on_cuda else (platform.processor() or "cpu"),
        "torch": torch.__version__,
        "transformers": importlib.metadata.version("transformers"),
        "gradcache_sparton": __version__,
        "date": datetime.datetime.now(datetime.timezone.utc).date().isoformat(),
    }
