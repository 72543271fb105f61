"""``gradcache-sparton crossval [options] -- [train flags]``: the flags, the run, the printed report; and
``gradcache-sparton crossval --merge FILE ... --output_dir OUT``: runs of one experiment combined."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from gradcache_sparton.crossval.merge import merge_crossval
from gradcache_sparton.crossval.protocol import parse_recipe, run_crossval
from gradcache_sparton.crossval.report import format_report
from gradcache_sparton.crossval.settings import NEGATIVE_RANKS, ROUND_STARTS, CrossvalSettings
from gradcache_sparton.crossval.teacher import DEFAULT_TEACHER_WEIGHT, TEACHERS
from gradcache_sparton.evaluation.significance import DEFAULT_RESAMPLES

__all__ = ["build_parser", "main"]

MERGE_FLAGS = ("merge", "output_dir", "beir_path", "overwrite")  # all --merge reads; the rest is the files'


def build_parser() -> argparse.ArgumentParser:
    """The ``gradcache-sparton crossval`` flags; the recipe's ``train`` flags come after ``--``."""
    p = argparse.ArgumentParser(
        prog="gradcache-sparton crossval",
        description="k-fold cross-validation of a training recipe: each fold's queries ranked against the full "
        "corpus by a model trained on the other folds only; zero-shot and BM25 as references; paired "
        "bootstrap intervals and randomization p-values over all held-out queries.",
        usage="gradcache-sparton crossval --beir_path DIR [options] [-- TRAIN FLAGS (as `train` takes them)]\n"
        "       gradcache-sparton crossval --merge FILE [FILE ...] --output_dir DIR [--beir_path DIR] [--overwrite]",
    )
    p.add_argument(
        "--beir_path",
        help="BEIR folder: corpus.jsonl, queries.jsonl, qrels/<split>.tsv (with --merge: optional, rebuilds "
        "the folds of result files that do not record their query ids).",
    )
    p.add_argument("--split", default="train", help="qrels split whose judged queries are cross-validated.")
    p.add_argument(
        "--output_dir", required=True, help="folder for folds, models, crossval.json and crossval.md."
    )
    p.add_argument("--folds", type=int, default=5)
    p.add_argument(
        "--fold_seed", type=int, default=0, help="seed of the query shuffle (and of the pair choice)."
    )
    p.add_argument(
        "--seeds", type=int, nargs="+", default=[42], help="training seeds: each fold trained once per seed."
    )
    p.add_argument(
        "--self_supervised_pairs",
        type=int,
        default=0,
        help="add this many (sentence, rest of the abstract) pairs from documents no training query judges.",
    )
    p.add_argument(
        "--bm25_negatives", type=int, default=0, help="BM25 negatives per training pair (0: none)."
    )
    p.add_argument(
        "--teacher",
        choices=TEACHERS,
        default="none",
        help="distillation teacher written as each training row's teacher_scores (needs --bm25_negatives >= 1 "
        "and a recipe with --contrastive kl_div or margin_mse): 'bm25+model' mixes BM25's and the starting "
        "model's scores of the row's positive and negatives, each z-normalised over the query's top 100.",
    )
    p.add_argument(
        "--teacher_weight",
        type=float,
        default=DEFAULT_TEACHER_WEIGHT,
        help="BM25's share of the bm25+model teacher, in [0, 1] (the starting model gets the rest).",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="train each fold this many times: round r > 1 trains on the fold's rows plus --model_negatives "
        "negatives a pair mined by the same fold's (and seed's) round r-1 model, which never saw the held-out "
        "claims; with --teacher, that model is the teacher's model half. The recipe row is the last round; "
        "earlier rounds are the systems recipe-round<r>, each compared with it. More rounds: harder negatives, "
        "R times the training.",
    )
    p.add_argument(
        "--model_negatives",
        type=int,
        default=0,
        help=f"with --rounds >= 2: negatives a pair from the previous round's model's ranking of the full corpus "
        f"(ranks {NEGATIVE_RANKS[0]}..{NEGATIVE_RANKS[1]}, the pair's known positives skipped), after any BM25 "
        "ones. More: harder contrast, more documents a step.",
    )
    p.add_argument(
        "--round_start",
        choices=ROUND_STARTS,
        default=ROUND_STARTS[0],
        help="where round r > 1 starts: 'previous' continues the round r-1 fold model (the model its negatives "
        "are hard for; R times the steps in all), 'start' retrains the recipe's starting model (the same steps, "
        "only the negatives differ).",
    )
    p.add_argument("--no_bm25", action="store_true", help="skip the BM25 reference (needs no bm25s then).")
    p.add_argument("--query_max_length", type=int, default=32, help="evaluation query tokens.")
    p.add_argument("--document_max_length", type=int, default=256, help="evaluation document tokens.")
    p.add_argument("--eval_batch_size", type=int, default=64)
    p.add_argument(
        "--resamples", type=int, default=DEFAULT_RESAMPLES, help="bootstrap and randomization draws."
    )
    p.add_argument(
        "--write_runs", action="store_true", help="write every model's top 100 as TREC runs in runs/."
    )
    p.add_argument(
        "--merge",
        nargs="+",
        metavar="FILE",
        help="instead of running: combine the crossval.json of runs of one experiment (e.g. one seed each, run "
        "as separate jobs) into the result one run with all their seeds would have written, in --output_dir; "
        "settings come from the files, which must agree (docs/experiments.md).",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="with --merge: replace an existing --output_dir/crossval.json.",
    )
    return p


def main(argv: Sequence[str]) -> int:
    """``gradcache-sparton crossval [options] -- [train flags]``: run and print the markdown report."""
    argv = list(argv)
    split = argv.index("--") if "--" in argv else len(argv)
    parser = build_parser()
    args = parser.parse_args(argv[:split])
    recipe_flags = argv[split + 1 :]
    if args.merge is not None:
        given = [
            f"--{k}" for k, v in vars(args).items() if k not in MERGE_FLAGS and v != parser.get_default(k)
        ]
        if given or split < len(argv):
            raise ValueError(
                f"--merge takes the settings and recipe from the merged files: leave out {given or 'the train flags'}"
            )
        results = merge_crossval(
            args.merge, output_dir=args.output_dir, beir_path=args.beir_path, overwrite=args.overwrite
        )
        print(format_report(results))
        return 0
    if args.beir_path is None:
        parser.error("the following arguments are required: --beir_path (or --merge)")
    if args.overwrite:
        raise ValueError("--overwrite applies to --merge only (a run rewrites its own output_dir's results)")
    settings = CrossvalSettings(
        beir_path=args.beir_path,
        output_dir=args.output_dir,
        split=args.split,
        folds=args.folds,
        fold_seed=args.fold_seed,
        seeds=args.seeds,
        self_supervised_pairs=args.self_supervised_pairs,
        bm25_negatives=args.bm25_negatives,
        teacher=args.teacher,
        teacher_weight=args.teacher_weight,
        rounds=args.rounds,
        model_negatives=args.model_negatives,
        round_start=args.round_start,
        bm25_reference=not args.no_bm25,
        query_max_length=args.query_max_length,
        document_max_length=args.document_max_length,
        eval_batch_size=args.eval_batch_size,
        resamples=args.resamples,
        write_runs=args.write_runs,
    )
    settings.check()  # before the recipe's flags and any data are read
    model_args, training_args = parse_recipe(recipe_flags)
    results = run_crossval(settings, model_args, training_args, recipe_flags=recipe_flags)
    print(format_report(results))
    return 0
