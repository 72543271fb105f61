"""The cross-validation protocol (:mod:`gradcache_sparton.crossval`): the folds, the recipe's ``train`` flags,
the evaluation of each model and the run (its settings: :mod:`.settings`; each fold's training rows:
:mod:`.rows`)."""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import logging
import platform
import random
import time
from collections.abc import Sequence
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from gradcache_sparton.crossval.earlier import add_to_earlier, check_same_rows, earlier_run, seeds_to_train
from gradcache_sparton.crossval.experiment import recipe_config
from gradcache_sparton.crossval.report import (
    BM25,
    PRIMARY,
    RECIPE,
    TEACHER,
    ZERO_SHOT,
    # Private to crossval, kept as they are: the results file's steps, shared by a run and by merge.py so
    # that a merge of runs writes exactly what one run does.
    _mean,
    _summarise,
    _write,
    round_system,
)
from gradcache_sparton.crossval.rows import (
    TOP_K,
    build_pool,
    fold_rows,
    fold_teacher_rows,
    round_rows,
    teacher_scorer,
)
from gradcache_sparton.crossval.settings import CrossvalSettings, check_recipe_loss
from gradcache_sparton.crossval.teacher import LOSSES_READING_TEACHER, in_batch_teacher_args
from gradcache_sparton.data import BeirData, load_beir
from gradcache_sparton.evaluation.evaluator import SparseRetrievalEvaluator
from gradcache_sparton.evaluation.runs import write_trec_run
from gradcache_sparton.evaluation.significance import per_query_metrics

if TYPE_CHECKING:
    from gradcache_sparton.arguments import CachedSpladeTrainingArguments, ModelArguments

__all__ = ["make_folds", "parse_recipe", "run_crossval"]

logger = logging.getLogger(__name__)

MEASURES = ("nDCG@10", "RR@10", "R@100")  # the default of per_query_metrics
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

    parser = HfArgumentParser((ModelArguments, DataArguments, CachedSpladeTrainingArguments))
    parser.add_argument("--config", default=None)
    named = {token[2:].split("=", 1)[0] for token in argv if token.startswith("--")}
    owned = sorted(named & set(_OWNED_FLAGS))
    if owned:
        raise ValueError(
            f"train flags {['--' + n for n in owned]} are set by the protocol for each fold (training data from "
            "the other folds, evaluation on the held-out fold, one output folder and seed per run): leave them out"
        )
    config = recipe_config(argv)
    if config is not None:  # as `train --config` reads it: every key must be a train argument
        known = {
            f.name
            for cls in (ModelArguments, DataArguments, CachedSpladeTrainingArguments)
            for f in fields(cls)
        }
        unknown = sorted(set(config["values"]) - known)
        if unknown:
            raise ValueError(f"--config {config['file']!r} has unknown argument(s) {unknown}")
        parser.set_defaults(**{k: v for k, v in config["values"].items() if k not in _OWNED_FLAGS})
    model_args, _, training_args, _ = parser.parse_args_into_dataclasses(
        args=[*argv, "--output_dir", "unused"], return_remaining_strings=False
    )
    return model_args, training_args


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
    device = "cuda" if torch.cuda.is_available() else "cpu"
    encoding = settings.encoding(tokenizer, device=device, bf16=bf16)
    evaluator = SparseRetrievalEvaluator(data, encoding=encoding, top_k=TOP_K, measures=MEASURES)
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
    teacher_recipe = _teacher_recipe(settings)
    if settings.bm25_reference or settings.bm25_negatives:
        check_bm25_installed("english")
    beir = _judged_queries(load_beir(settings.beir_path, split=settings.split))
    folds = make_folds(list(beir.qrels), folds=settings.folds, seed=settings.fold_seed)
    out = Path(settings.output_dir)
    results: dict[str, Any] = {
        "meta": _run_meta(),
        "settings": {
            **vars(settings),
            "run_folds": settings.folds_to_run(),
            "recipe_flags": list(recipe_flags),
            "recipe_config": recipe_config(recipe_flags),
            "teacher_recipe_config": recipe_config(teacher_recipe[2]) if teacher_recipe else None,
        },
        "model": model_args.model_name_or_path or model_args.config_name,
        "folds": [],
        "systems": {},
    }
    # Before any file is written: a finished run in the folder is this experiment's (its seeds are kept, the
    # new ones added), and no seed to train has models there already.
    earlier = earlier_run(out, results, folds)
    seeds = seeds_to_train(out, settings.seeds, earlier)
    began = time.monotonic()
    tokenizer = build_tokenizer(model_args)
    bf16 = bool(training_args.bf16)
    # The starting model (random-init recipes: the zero-shot row) as a run of all the seeds builds it.
    set_seed(earlier["settings"]["seeds"][0] if earlier is not None else settings.seeds[0])
    # An inference-free start without its own query table takes the IDF of the corpus searched.
    start_encoder = build_encoder(model_args, tokenizer, idf_documents=beir.corpus.values())
    settings.encoding(tokenizer).check_encoder(start_encoder)  # the evaluation lengths: before any file
    teacher, progress = None, not training_args.disable_tqdm
    if settings.teacher == "bm25+model":
        teacher = teacher_scorer(
            settings, start_encoder, tokenizer, list(beir.corpus.values()), bf16, progress
        )
    pool = build_pool(beir, settings, teacher)
    training_rows = [fold_rows(pool, beir, set(held), settings) for held in folds]
    fold_info = [
        {
            "fold": k,
            "queries": len(held),
            **fold.counts,
            "train_file": f"fold{k}/train.jsonl.gz",
            "query_ids": held,
        }
        for k, (held, fold) in enumerate(zip(folds, training_rows, strict=True))
    ]
    if earlier is not None:  # the same rows, by their counts (the query ids were checked above)
        check_same_rows(earlier, fold_info, out)
    out.mkdir(parents=True, exist_ok=True)
    (out / FOLDS_FILE).write_text(
        json.dumps({"fold_seed": settings.fold_seed, "folds": folds}, indent=1) + "\n"
    )
    for info, fold in zip(fold_info, training_rows, strict=True):
        if earlier is None or not (out / info["train_file"]).is_file():  # an earlier run's files are kept
            write_training_file(fold.rows, out / info["train_file"], overwrite=True)
    logger.info(
        "crossval: %d folds of %s built in %.0f s",
        len(folds),
        [len(f) for f in folds],
        time.monotonic() - began,
    )
    results["folds"] = fold_info
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
    trained_systems = ([TEACHER] if teacher_recipe else []) + names
    for name in trained_systems:
        results["systems"][name] = {"seeds": {}}
    if earlier is not None:
        add_to_earlier(results, earlier, out)
    run_folds = settings.folds_to_run()  # all, or --run_folds: the tables cover those folds' queries
    ran = [folds[k] for k in run_folds]
    for seed in seeds:
        per_query: dict[str, dict[str, dict[str, float]]] = {name: {} for name in trained_systems}
        nonzeros: dict[str, list[tuple[int, float, float]]] = {name: [] for name in trained_systems}
        for done, k in enumerate(run_folds, start=1):
            held = folds[k]
            data = BeirData(
                corpus=beir.corpus,
                queries={q: beir.queries[q] for q in held},
                qrels={q: beir.qrels[q] for q in held},
            )
            train_file, round_args, trained = out / fold_info[k]["train_file"], model_args, None
            in_batch: dict[str, str] = {}  # a fold teacher of a --kl_in_batch student: its in-batch teacher
            if (
                teacher_recipe
            ):  # the fold's teacher, trained on the fold's rows; the student's rows scored by it
                t0 = time.monotonic()
                teacher_dir = out / f"seed{seed}" / TEACHER / f"fold{k}"
                teacher_args, teacher_training, _ = teacher_recipe
                teacher_tokenizer = build_tokenizer(teacher_args)
                teacher_file = (
                    train_file if settings.teacher_negatives else out / f"fold{k}" / "train-teacher.jsonl.gz"
                )
                if (
                    not teacher_file.is_file()
                ):  # the fold's pairs without their negatives: a function of the fold
                    write_training_file(
                        _without_negatives(training_rows[k].rows), teacher_file, overwrite=True
                    )
                run_training(
                    teacher_args,
                    _fold_data_args(teacher_file),
                    _fold_training_args(teacher_training, output_dir=str(teacher_dir), seed=seed),
                )
                fold_teacher = build_encoder(
                    _trained_model_args(teacher_args, teacher_dir), teacher_tokenizer
                )
                teacher_bf16 = bool(teacher_training.bf16)
                result = _evaluate_model(fold_teacher, teacher_tokenizer, data, settings, teacher_bf16, None)
                for key, values in result["per_query"].items():
                    per_query[TEACHER].setdefault(key, {}).update(values)
                nonzeros[TEACHER].append((len(held), result["query_nonzeros"], result["doc_nonzeros"]))
                if training_args.kl_in_batch:  # the student's in-batch teacher: this fold's teacher and BM25
                    in_batch = in_batch_teacher_args(
                        str(teacher_dir),
                        bm25_weight=settings.teacher_weight,
                        normalisation=settings.teacher_normalisation,
                    )
                else:
                    rows = fold_teacher_rows(
                        training_rows[k],
                        beir.corpus,
                        settings,
                        fold_teacher,
                        teacher_tokenizer,
                        teacher_bf16,
                        progress,
                    )
                    train_file = write_training_file(
                        rows, out / f"fold{k}" / f"train-seed{seed}-teacher.jsonl.gz", overwrite=True
                    )
                logger.info(
                    "crossval: seed %d fold %d: teacher nDCG@10 %.4f (%.0f s)",
                    seed,
                    k,
                    _mean(result["per_query"][PRIMARY].values()),
                    time.monotonic() - t0,
                )
                del fold_teacher
            for r, name in enumerate(names, start=1):
                t0 = time.monotonic()
                run_dir = _run_dir(out, seed, k, r)
                if r > 1:  # rows and start from the same fold's (and seed's) round r - 1 model, `trained`
                    rows = round_rows(
                        training_rows[k], beir.corpus, settings, trained, tokenizer, bf16, progress
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
                fold_args = _fold_training_args(training_args, output_dir=str(run_dir), seed=seed, **in_batch)
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
            for name in trained_systems:
                counts = nonzeros[name]
                results["systems"][name]["seeds"][str(seed)] = {
                    "per_query": per_query[name],
                    "query_nonzeros": sum(n * q for n, q, _ in counts) / sum(n for n, _, _ in counts),
                    "doc_nonzeros": sum(n * d for n, _, d in counts) / sum(n for n, _, _ in counts),
                    "folds_done": done,
                    "folds_finished": run_folds[:done],
                }
            _summarise(results, ran)
            _write(results, out)
    if not seeds:  # every seed asked for was finished in the folder already
        _summarise(results, ran)
        _write(results, out)
    return results


def _without_negatives(rows: Any) -> Any:
    """Training rows without their ``negative_<j>`` columns (the query and positive pairs)."""
    from gradcache_sparton.data.columns import negative_number

    return rows.remove_columns([name for name in rows.column_names if negative_number(name)])


def _teacher_recipe(settings: CrossvalSettings) -> tuple[Any, Any, list[str]] | None:
    """With ``--teacher fold``: the teacher recipe's model and training arguments and its flags (None
    otherwise); ``ValueError`` for flags ``train`` refuses or the protocol owns, and for a teacher recipe whose
    own loss would need a teacher."""
    import shlex

    if settings.teacher != "fold":
        return None
    try:
        flags = shlex.split(settings.teacher_recipe)
    except ValueError as error:
        raise ValueError(f"teacher_recipe is not a shell-quoted flag list: {error}") from None
    try:
        model_args, training_args = parse_recipe(flags)
    except ValueError as error:
        raise ValueError(f"teacher_recipe: {error}") from None
    if training_args.contrastive in LOSSES_READING_TEACHER:
        raise ValueError(
            f"teacher_recipe trains with contrastive={training_args.contrastive!r}, which needs teacher scores the "
            "teacher's own rows do not have: give the teacher a loss of its own (e.g. the default infonce)"
        )
    return model_args, training_args, flags


def _run_dir(out: Path, seed: int, fold: int, round_: int) -> Path:
    """Where round ``round_`` of ``fold`` trains its model: ``seed<s>/fold<k>`` for round 1 (as runs of one
    round), ``seed<s>/round<r>/fold<k>`` after."""
    return out / f"seed{seed}" / (f"fold{fold}" if round_ == 1 else f"round{round_}/fold{fold}")


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


def _fold_training_args(training_args: Any, *, output_dir: str, seed: int, **changes: Any) -> Any:
    from dataclasses import replace

    return replace(
        training_args, output_dir=output_dir, seed=seed, save_strategy="no", report_to=[], **changes
    )


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
