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

from gradcache_sparton.crossval.report import BM25, PRIMARY, RECIPE, ZERO_SHOT, _mean, _summarise, _write
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

__all__ = ["CrossvalSettings", "check_recipe_loss", "make_folds", "parse_recipe", "run_crossval"]

logger = logging.getLogger(__name__)

MEASURES = ("nDCG@10", "RR@10", "R@100")  # the default of per_query_metrics
TOP_K = 100
TEACHER_COLUMN = "teacher_scores"  # the data column the distillation losses read
FOLDS_FILE = "folds.json"
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
        for name in ("self_supervised_pairs", "bm25_negatives"):
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
    query id, self-supervised rows their source document id."""

    labelled: datasets.Dataset
    labelled_query_ids: list[str]
    selfsup: datasets.Dataset | None
    selfsup_doc_ids: list[str]


def _build_pool(beir: BeirData, settings: CrossvalSettings, teacher: Callable[[Any], list] | None) -> _Pool:
    """Labelled pairs of every judged query and (if asked) one self-supervised pair per corpus document
    whose query sentence occurs in no other document; BM25 negatives mined once for all of them (a row's
    negatives depend only on its own query and known positives, not on the folds), then ``teacher``'s
    scores of each row as its ``teacher_scores`` column (a function of the row alone, likewise)."""
    from gradcache_sparton.mining import beir_mining_pairs, mine_hard_negatives

    labelled = beir_mining_pairs(beir)
    labelled_query_ids = list(labelled["query_id"])
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
    return _Pool(labelled, labelled_query_ids, selfsup, selfsup_doc_ids)


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


def _fold_rows(
    pool: _Pool, beir: BeirData, held_out: set[str], settings: CrossvalSettings
) -> tuple[Any, dict]:
    """The training rows of the fold holding out ``held_out``: every labelled pair of the other queries, plus
    a seeded choice of ``self_supervised_pairs`` from documents no training query judges."""
    import datasets

    rows = [i for i, q in enumerate(pool.labelled_query_ids) if q not in held_out]
    parts = [pool.labelled.select(rows)]
    counts = {"labelled_pairs": len(rows), "self_supervised_pairs": 0}
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
    return datasets.concatenate_datasets(parts) if len(parts) > 1 else parts[0], counts


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
    teacher = None
    if settings.teacher != "none":
        progress = not training_args.disable_tqdm
        teacher = _teacher(settings, start_encoder, tokenizer, list(beir.corpus.values()), bf16, progress)
    pool = _build_pool(beir, settings, teacher)
    fold_info = []
    for k, held in enumerate(folds):
        rows, counts = _fold_rows(pool, beir, set(held), settings)
        path = write_training_file(rows, out / f"fold{k}" / "train.jsonl.gz", overwrite=True)
        fold_info.append(
            {
                "fold": k,
                "queries": len(held),
                **counts,
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
    results["systems"][RECIPE] = {"seeds": {}}
    for seed in settings.seeds:
        per_query: dict[str, dict[str, float]] = {}
        nonzeros = []
        for k, held in enumerate(folds):
            run_dir = out / f"seed{seed}" / f"fold{k}"
            fold_args = _fold_training_args(training_args, output_dir=str(run_dir), seed=seed)
            data_args = _fold_data_args(out / fold_info[k]["train_file"])
            t0 = time.monotonic()
            run_training(model_args, data_args, fold_args)
            trained = build_encoder(_trained_model_args(model_args, run_dir), tokenizer)
            data = BeirData(
                corpus=beir.corpus,
                queries={q: beir.queries[q] for q in held},
                qrels={q: beir.qrels[q] for q in held},
            )
            run_file = runs and runs / f"{RECIPE}-seed{seed}-fold{k}.trec"
            fold_result = _evaluate_model(trained, tokenizer, data, settings, bf16, run_file)
            for key, values in fold_result["per_query"].items():
                per_query.setdefault(key, {}).update(values)
            nonzeros.append((len(held), fold_result["query_nonzeros"], fold_result["doc_nonzeros"]))
            logger.info(
                "crossval: seed %d fold %d: nDCG@10 %.4f (%.0f s)",
                seed,
                k,
                _mean(fold_result["per_query"][PRIMARY].values()),
                time.monotonic() - t0,
            )
            results["systems"][RECIPE]["seeds"][str(seed)] = {
                "per_query": per_query,
                "query_nonzeros": sum(n * q for n, q, _ in nonzeros) / sum(n for n, _, _ in nonzeros),
                "doc_nonzeros": sum(n * d for n, _, d in nonzeros) / sum(n for n, _, _ in nonzeros),
                "folds_done": k + 1,
            }
            _summarise(results, folds)
            _write(results, out)
    return results


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
