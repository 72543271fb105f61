"""crossval --teacher fold: a teacher recipe trained inside each fold, the student distilled from it (and BM25),
the teacher's own fold scores in the report."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
import torch
from test_crossval import SHIPPED_RECIPE, TINY_RECIPE, TOPICS, write_beir

from gradcache_sparton.cli.crossval import crossval_command as crossval_main
from gradcache_sparton.crossval import merge_crossval
from gradcache_sparton.crossval.teacher import ensemble_teacher_scores
from gradcache_sparton.evaluation import EncodingSettings

# The teacher: the shipped model, one InfoNCE step at a rate that moves it (its own loss, no teacher).
TEACHER_RECIPE = " ".join(
    [flag for flag in SHIPPED_RECIPE if flag not in ("--contrastive", "kl_div")] + ["--learning_rate", "1e-3"]
)


def _rows(path: Path) -> list[dict]:
    with gzip.open(path, "rt") as lines:
        return [json.loads(line) for line in lines]


def _argv(beir: Path, out: Path, *flags: str) -> list[str]:
    return ["--beir_path", str(beir), "--output_dir", str(out), "--folds", "2", "--seeds", "1",
            "--self_supervised_pairs", "2", "--bm25_negatives", "2", "--document_max_length", "32",
            "--resamples", "20", *flags]  # fmt: skip


def test_fold_teacher_is_trained_on_the_fold_and_scores_the_students_rows(
    tmp_path: Path, monkeypatch
) -> None:
    """Per fold: the teacher recipe trains first, on that fold's pairs only (no held-out claim), then the student
    trains on those rows with teacher_scores equal to BM25 + that fold's teacher on each row alone (minmax x30
    here); the other fold's teacher gives other scores. The report has the teacher row and recipe - teacher;
    a second run into the folder trains nothing, and a merge keeps the teacher."""
    pytest.importorskip("bm25s")
    import gradcache_sparton.pipeline as pipeline
    from gradcache_sparton.arguments import ModelArguments
    from gradcache_sparton.data import load_beir
    from gradcache_sparton.model_loading import build_encoder, build_tokenizer

    calls, real = [], pipeline.run_training

    def run_training(model_args, data_args, training_args):
        calls.append((training_args.output_dir, data_args.train_data[0], training_args.contrastive))
        return real(model_args, data_args, training_args)

    monkeypatch.setattr(pipeline, "run_training", run_training)
    beir = write_beir(tmp_path / "beir")
    out = tmp_path / "cv"
    flags = ["--teacher", "fold", f"--teacher_recipe={TEACHER_RECIPE}", "--teacher_weight", "0.3",
             "--teacher_normalisation", "minmax"]  # fmt: skip
    argv = [*_argv(beir, out, *flags), "--", *SHIPPED_RECIPE]
    assert crossval_main(argv) == 0
    assert calls == [
        call
        for k in range(2)
        for call in (
            (
                str(out / "seed1" / "teacher" / f"fold{k}"),
                str(out / f"fold{k}" / "train-teacher.jsonl.gz"),
                "infonce",
            ),
            (
                str(out / "seed1" / f"fold{k}"),
                str(out / f"fold{k}" / "train-seed1-teacher.jsonl.gz"),
                "kl_div",
            ),
        )
    ]
    docs = list(load_beir(beir, split="train").corpus.values())
    tokenizer = build_tokenizer(ModelArguments(model_name_or_path="splade-tiny-msmarco"))
    encoding = EncodingSettings(tokenizer, query_max_length=32, document_max_length=32, show_progress=False)
    teachers = [
        build_encoder(
            ModelArguments(model_name_or_path=str(out / "seed1" / "teacher" / f"fold{k}")), tokenizer
        )
        for k in range(2)
    ]
    folds = json.loads((out / "folds.json").read_text())["folds"]
    common = dict(documents=docs, encoding=encoding, bm25_weight=0.3, normalisation="minmax")
    moved = 0.0
    for k, held in enumerate(folds):
        held_texts = {f"what about the {TOPICS[int(q[1:])]}" for q in held}
        taught = _rows(out / f"fold{k}" / "train.jsonl.gz")
        assert not held_texts & {r["query"] for r in taught} and len(taught) == 4 + 2
        # the teacher's rows: the fold's pairs, their negatives dropped (--teacher_negatives not given)
        pairs = [{"query": r["query"], "positive": r["positive"]} for r in taught]
        assert _rows(out / f"fold{k}" / "train-teacher.jsonl.gz") == pairs
        student = _rows(out / f"fold{k}" / "train-seed1-teacher.jsonl.gz")
        assert [{c: r[c] for c in taught[0]} for r in student] == taught
        for row in student:
            candidates = [[row["positive"], row["negative_1"], row["negative_2"]]]
            alone = ensemble_teacher_scores([row["query"]], candidates, encoder=teachers[k].eval(), **common)
            # fp32 encodings differ between batch shapes by summation order only (~1e-6 relative), times
            # minmax's 1 / (max - min) of O(1) and 30: far below 1e-3.
            torch.testing.assert_close(torch.tensor([row["teacher_scores"]]), alone, rtol=1e-3, atol=1e-3)
            other = ensemble_teacher_scores(
                [row["query"]], candidates, encoder=teachers[1 - k].eval(), **common
            )
            moved = max(moved, (alone - other).abs().max().item())
    assert moved > 0.1  # the other fold's teacher is another teacher, by far more than the 1e-3 above

    results = json.loads((out / "crossval.json").read_text())
    assert results["settings"]["teacher_recipe"] == TEACHER_RECIPE
    assert set(results["systems"]["teacher"]["seeds"]) == {"1"}
    teacher_queries = results["systems"]["teacher"]["seeds"]["1"]["per_query"]["ndcg_at_10"]
    assert sorted(teacher_queries) == sorted(f"q{i}" for i in range(8))
    assert {"recipe - teacher", "teacher - bm25", "teacher - zero-shot"} <= set(results["comparisons"])
    assert "per_seed" in results["comparisons"]["recipe - teacher"]
    report = (out / "crossval.md").read_text()
    assert (
        "| teacher | 1 |" in report
        and "| recipe - teacher |" in report
        and "teacher: a model trained" in report
    )

    calls.clear()
    assert crossval_main(argv) == 0 and calls == []  # the finished seed is kept, nothing trained again
    merged = merge_crossval([out / "crossval.json"], output_dir=tmp_path / "merged")
    assert merged["systems"]["teacher"] == results["systems"]["teacher"]
    assert merged["comparisons"]["recipe - teacher"] == results["comparisons"]["recipe - teacher"]


def test_fold_teacher_of_a_kl_in_batch_student_scores_its_batches(tmp_path: Path, monkeypatch) -> None:
    """With --kl_in_batch in the student recipe, the fold's teacher (trained on the fold's pairs only) and BM25
    are the student's in-batch teacher (--in_batch_teacher at the teacher weight, the teacher normalisation),
    built from the student's own training rows: no held-out claim among them, no teacher_scores column written."""
    pytest.importorskip("bm25s")
    import gradcache_sparton.mining as mining
    import gradcache_sparton.pipeline as pipeline

    calls, texts, real, build = [], [], pipeline.run_training, mining.batch_teacher_for_run

    def run_training(model_args, data_args, training_args):
        calls.append((training_args.output_dir, data_args.train_data[0], training_args.in_batch_teacher,
                      training_args.in_batch_teacher_normalisation))  # fmt: skip
        return real(model_args, data_args, training_args)

    def batch_teacher_for_run(args, dataset):
        if args.in_batch_teacher is not None:
            texts.append(set(dataset["query"]))
        return build(args, dataset)

    monkeypatch.setattr(pipeline, "run_training", run_training)
    monkeypatch.setattr(mining, "batch_teacher_for_run", batch_teacher_for_run)
    beir = write_beir(tmp_path / "beir")
    out = tmp_path / "cv"
    flags = ["--teacher", "fold", f"--teacher_recipe={TEACHER_RECIPE}", "--teacher_weight", "0.3",
             "--teacher_normalisation", "minmax"]  # fmt: skip
    recipe = [*SHIPPED_RECIPE, "--kl_in_batch", "True"]
    assert crossval_main([*_argv(beir, out, *flags), "--", *recipe]) == 0
    teacher = [str(out / "seed1" / "teacher" / f"fold{k}") for k in range(2)]
    assert calls == [
        call
        for k in range(2)
        for call in (
            (teacher[k], str(out / f"fold{k}" / "train-teacher.jsonl.gz"), None, "minmax"),
            (str(out / "seed1" / f"fold{k}"), str(out / f"fold{k}" / "train.jsonl.gz"), f"{teacher[k]}:0.7,bm25:0.3",
             "minmax"),
        )
    ]  # fmt: skip
    folds = json.loads((out / "folds.json").read_text())["folds"]
    for k, held in enumerate(folds):
        held_texts = {f"what about the {TOPICS[int(q[1:])]}" for q in held}
        assert texts[k] and not held_texts & texts[k]  # the teacher's texts: the fold's training rows only
        assert "teacher_scores" not in _rows(out / f"fold{k}" / "train.jsonl.gz")[0]
    assert set(json.loads((out / "crossval.json").read_text())["systems"]["teacher"]["seeds"]) == {"1"}


@pytest.mark.parametrize(
    ("flags", "recipe", "message"),
    [
        (["--teacher", "fold"], SHIPPED_RECIPE, "give its train flags"),
        (
            [f"--teacher_recipe={TEACHER_RECIPE}"],
            TINY_RECIPE,
            "teacher_recipe applies to --teacher fold only",
        ),
        (
            [
                "--teacher",
                "fold",
                f"--teacher_recipe={TEACHER_RECIPE}",
                "--rounds",
                "2",
                "--model_negatives",
                "1",
            ],
            SHIPPED_RECIPE,
            "rounds=2",
        ),
        (
            ["--teacher", "fold", f"--teacher_recipe={TEACHER_RECIPE}"],
            [*SHIPPED_RECIPE, "--kl_in_batch", "True"],
            "teacher_normalisation must be one of \\('minmax', 'none'\\), got 'zscore'",
        ),
        (
            ["--teacher", "fold", f"--teacher_recipe={TEACHER_RECIPE}", "--teacher_normalisation", "minmax"],
            [*SHIPPED_RECIPE, "--kl_in_batch", "True", "--in_batch_teacher", "bm25"],
            "the recipe names another",
        ),
        (
            ["--teacher", "fold", f"--teacher_recipe={TEACHER_RECIPE} --contrastive kl_div"],
            SHIPPED_RECIPE,
            "teacher_recipe trains with contrastive='kl_div'",
        ),
        (
            ["--teacher", "fold", f"--teacher_recipe={TEACHER_RECIPE} --output_dir x"],
            SHIPPED_RECIPE,
            "teacher_recipe: train flags \\['--output_dir'\\]",
        ),
        (["--teacher", "fold", "--teacher_recipe=--max_steps '1"], SHIPPED_RECIPE, "not a shell-quoted"),
        (
            ["--teacher_normalisation", "minmax"],
            TINY_RECIPE,
            "teacher_normalisation applies to a teacher only",
        ),
        (["--teacher_negatives", "True"], TINY_RECIPE, "teacher_negatives applies to --teacher fold only"),
    ],
)
def test_fold_teacher_misuse_fails_before_any_work(tmp_path: Path, flags, recipe, message) -> None:
    """A fold teacher without its recipe, a recipe without a fold teacher, a fold teacher with rounds, a
    --kl_in_batch student's in-batch teacher normalised by zscore (no corpus search per batch) or named twice (the
    protocol's and the recipe's), a teacher recipe that itself needs a teacher or names a
    flag the protocol owns, an unparsable recipe, a normalisation without a teacher: one ValueError, nothing
    written."""
    beir = write_beir(tmp_path / "beir")
    out = tmp_path / "cv"
    with pytest.raises(ValueError, match=message):
        crossval_main([*_argv(beir, out, *flags), "--", *recipe])
    assert not out.exists()
