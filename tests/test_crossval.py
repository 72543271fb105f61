"""The cross-validation protocol (gradcache-sparton crossval) and its paired statistics."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from gradcache_sparton.cli import main
from gradcache_sparton.cli.crossval import crossval_command as crossval_main
from gradcache_sparton.crossval import make_folds, parse_recipe
from gradcache_sparton.crossval.teacher import ensemble_teacher_scores
from gradcache_sparton.evaluation import EncodingSettings
from gradcache_sparton.evaluation.significance import (
    paired_comparison,
    paired_run_comparison,
    paired_statistics,
    per_query_metrics,
)
from gradcache_sparton.mining import SpladeTeacher, zscore_normalise

TOPICS = ["protein", "star", "cell", "gene", "virus", "planet", "enzyme", "neuron"]


def write_beir(folder: Path) -> Path:
    """8 queries, each judging its own topic's document; 16 multi-sentence documents (8 distractors)."""
    (folder / "qrels").mkdir(parents=True)
    docs, queries, qrels = [], [], []
    for i, topic in enumerate(TOPICS):
        text = f"The {topic} is studied here. Many {topic} samples were measured in a lab. Results vary a lot today."
        docs.append({"_id": f"d{i}", "title": topic.title(), "text": text})
        docs.append(
            {
                "_id": f"x{i}",
                "title": "",
                "text": f"Noise number {i} appears. It says little about anything at all.",
            }
        )
        queries.append({"_id": f"q{i}", "text": f"what about the {topic}"})
        qrels.append(f"q{i}\td{i}\t1")
    (folder / "corpus.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (folder / "queries.jsonl").write_text("".join(json.dumps(q) + "\n" for q in queries))
    (folder / "qrels" / "train.tsv").write_text("query-id\tcorpus-id\tscore\n" + "\n".join(qrels) + "\n")
    return folder


TINY_RECIPE = [
    "--hidden_size", "32", "--num_hidden_layers", "1", "--num_attention_heads", "2", "--intermediate_size", "64",
    "--per_device_train_batch_size", "4", "--mini_batch_size", "4", "--query_max_length", "16",
    "--document_max_length", "32", "--max_steps", "1", "--use_cpu", "--disable_tqdm", "True",
]  # fmt: skip


# The shipped pretrained model as the recipe's start (the teacher's model half), one step, on the CPU.
SHIPPED_RECIPE = [
    "--model_name_or_path", "splade-tiny-msmarco", "--per_device_train_batch_size", "4", "--mini_batch_size", "4",
    "--query_max_length", "16", "--document_max_length", "32", "--max_steps", "1", "--use_cpu",
    "--disable_tqdm", "True", "--contrastive", "kl_div",
]  # fmt: skip


def _shipped_model() -> tuple:
    from gradcache_sparton.model_loading import build_encoder, build_tokenizer

    model_args, _ = parse_recipe(SHIPPED_RECIPE)
    tokenizer = build_tokenizer(model_args)
    return build_encoder(model_args, tokenizer), tokenizer


def test_make_folds_partition_and_seed() -> None:
    """Folds partition the ids, differ in size by at most one, and depend on the id set and seed, not order."""
    ids = [f"q{i}" for i in range(23)]
    folds = make_folds(ids, folds=5, seed=3)
    assert sorted(q for f in folds for q in f) == sorted(ids)
    assert max(map(len, folds)) - min(map(len, folds)) <= 1
    assert make_folds(list(reversed(ids)), folds=5, seed=3) == folds
    assert make_folds(ids, folds=5, seed=4) != folds
    with pytest.raises(ValueError, match="folds"):
        make_folds(ids[:3], folds=5, seed=0)


def test_per_query_metrics_mean_is_retrieval_metrics() -> None:
    """Per-query values are exact for known rankings and a missing ranking is an error."""
    qrels = {"a": {"d1": 1}, "b": {"d2": 1, "d3": 0}}
    values = per_query_metrics({"a": ["d1", "d2"], "b": ["d1", "d3"]}, qrels)
    assert values["ndcg_at_10"] == {"a": 1.0, "b": 0.0}
    assert values["mrr_at_10"]["a"] == 1.0 and values["recall_at_100"]["b"] == 0.0
    with pytest.raises(ValueError, match="no entry"):
        per_query_metrics({"a": ["d1"]}, qrels)


def test_paired_statistics_on_known_differences() -> None:
    """Every query up by 0.1: mean, interval 0.1 and p = 1 / (R + 1); no difference: p = 1, interval 0."""
    up = torch.full((40,), 0.1, dtype=torch.float64)
    stats = paired_statistics(up, resamples=999, seed=0)
    assert stats["mean_difference"] == pytest.approx(0.1)
    assert stats["ci95_low"] == pytest.approx(0.1) and stats["ci95_high"] == pytest.approx(0.1)
    assert stats["p_value"] == pytest.approx(1 / 1000) and stats["queries_up"] == 40
    none = paired_statistics(torch.zeros(40, dtype=torch.float64), resamples=999, seed=0)
    assert none["p_value"] == 1.0 and none["ci95_low"] == 0.0 == none["ci95_high"]


def test_paired_statistics_separate_noise_from_a_shift() -> None:
    """Centred noise: interval holds 0 and p is large; the same noise shifted by 3 standard errors: p < 0.01."""
    g = torch.Generator().manual_seed(1)
    noise = torch.randn(100, generator=g, dtype=torch.float64) * 0.2
    noise = noise - noise.mean()
    flat = paired_statistics(noise, resamples=4000, seed=0)
    assert flat["p_value"] > 0.5 and flat["ci95_low"] < 0 < flat["ci95_high"]
    moved = paired_statistics(noise + 3 * noise.std().item() / 10, resamples=4000, seed=0)
    assert moved["p_value"] < 0.01 and moved["ci95_low"] > 0


def test_paired_comparison_averages_seeds_and_checks_queries() -> None:
    """Several scores per query are averaged before differencing; mismatched queries, empty or non-finite
    differences and resamples < 1 are errors."""
    stats = paired_comparison({"a": 0.5, "b": 0.5}, {"a": [0.6, 0.8], "b": [0.5, 0.5]}, resamples=99)
    assert stats["mean_difference"] == pytest.approx(0.1) and stats["candidate_mean"] == pytest.approx(0.6)
    with pytest.raises(ValueError, match="same queries"):
        paired_comparison({"a": 0.5}, {"b": 0.5})
    with pytest.raises(ValueError, match="resamples"):
        paired_statistics([0.1], resamples=0)
    with pytest.raises(ValueError, match="empty"):
        paired_statistics([])
    with pytest.raises(ValueError, match="NaN"):
        paired_statistics([0.1, float("nan")])


def test_paired_run_comparison_scores_runs_per_query() -> None:
    """Two runs: one query moves from rank 2 to rank 1 (nDCG@10 1/log2(3) -> 1), the other stays."""
    qrels = {"a": {"d1": 1}, "b": {"d2": 1}}
    before = {"a": [("d2", 2.0), ("d1", 1.0)], "b": [("d2", 1.0)]}
    after = {"a": [("d1", 2.0), ("d2", 1.0)], "b": [("d2", 1.0)]}
    stats = paired_run_comparison(before, after, qrels, resamples=99)
    gain = (1 - 1 / math.log2(3)) / 2
    assert stats["mean_difference"] == pytest.approx(gain) and stats["queries_up"] == 1
    assert stats["queries_same"] == 1 and stats["baseline_mean"] == pytest.approx((1 / math.log2(3) + 1) / 2)


def test_parse_recipe_refuses_flags_the_protocol_owns() -> None:
    """Training data, evaluation, output folder and seed come from the protocol, not the recipe."""
    with pytest.raises(ValueError, match="--train_data"):
        parse_recipe(["--train_data", "x.jsonl"])
    model_args, training_args = parse_recipe(["--config", "default", "--max_steps", "7"])
    assert model_args.model_name_or_path == "splade-tiny-msmarco" and training_args.max_steps == 7


def test_crossval_cli_end_to_end(tmp_path: Path, capsys) -> None:
    """Two folds x one seed on a tiny folder: every query held out once, training rows never from a held-out
    query, the table and the three comparisons written, with where the numbers came from and each fold's
    held-out query ids."""
    pytest.importorskip("bm25s")
    beir = write_beir(tmp_path / "beir")
    out = tmp_path / "cv"
    argv = ["crossval", "--beir_path", str(beir), "--output_dir", str(out), "--folds", "2", "--seeds", "1",
            "--self_supervised_pairs", "2", "--bm25_negatives", "1", "--document_max_length", "32",
            "--resamples", "50", "--write_runs", "--", *TINY_RECIPE]  # fmt: skip
    assert main(argv) == 0
    report = capsys.readouterr().out
    assert "| recipe - zero-shot |" in report and "| zero-shot - bm25 |" in report
    results = json.loads((out / "crossval.json").read_text())
    folds = json.loads((out / "folds.json").read_text())["folds"]
    assert sorted(q for f in folds for q in f) == sorted(f"q{i}" for i in range(8))
    assert [f["query_ids"] for f in results["folds"]] == folds  # the result file names its folds
    for k, held in enumerate(folds):
        rows = [
            json.loads(line) for line in __import__("gzip").open(out / f"fold{k}" / "train.jsonl.gz", "rt")
        ]
        held_texts = {f"what about the {TOPICS[int(q[1:])]}" for q in held}
        assert not held_texts & {r["query"] for r in rows}
        assert len(rows) == 4 + 2 and all("negative_1" in r for r in rows)
    recipe = results["systems"]["recipe"]["seeds"]["1"]["per_query"]["ndcg_at_10"]
    assert sorted(recipe) == sorted(f"q{i}" for i in range(8))
    assert set(results["comparisons"]) == {"recipe - zero-shot", "recipe - bm25", "zero-shot - bm25"}
    assert {"device", "torch", "transformers", "gradcache_sparton", "date"} <= set(results["meta"])
    assert (out / "crossval.md").read_text() in report
    assert (out / "runs" / "zero-shot.trec").is_file() and (
        out / "runs" / "recipe-seed1-fold1.trec"
    ).is_file()


def test_train_prints_the_paired_gain_on_its_dev_queries(tmp_path: Path, capsys) -> None:
    """`train` with eval_before_training reports the before/after difference with its interval and p-value,
    and the summary's mean difference is after - before."""
    beir = write_beir(tmp_path / "beir")
    out = tmp_path / "run"
    argv = ["train", *TINY_RECIPE, "--train_beir", str(beir), "--eval_beir", str(beir), "--eval_beir_split",
            "train", "--eval_before_training", "True", "--output_dir", str(out)]  # fmt: skip
    assert main(argv) == 0
    stdout = capsys.readouterr().out
    summary = json.loads(stdout[stdout.rindex('{\n  "output_dir"') : stdout.rindex("}") + 1])
    gain = summary["eval_gain_ndcg_at_10_mean_difference"]
    assert gain == pytest.approx(summary["eval_ndcg_at_10"] - summary["eval_before_ndcg_at_10"])
    assert summary["eval_gain_ndcg_at_10_ci95_low"] <= gain <= summary["eval_gain_ndcg_at_10_ci95_high"]
    assert "95% interval" in stdout and f"{summary['eval_gain_ndcg_at_10_queries']:.0f} queries" in stdout


def test_normalise_scores_against_each_querys_top_k() -> None:
    """Candidates become z-scores against their query's own top-K scores (not the candidates'), so a
    two-candidate margin keeps its size; a query whose top K are all equal gives zeros."""
    top = torch.tensor([[3.0, 2.0, 1.0], [3.0, 2.0, 1.0], [5.0, 5.0, 5.0]])
    candidates = torch.tensor([[3.0, 1.0], [3.0, 2.5], [5.0, 1.0]])
    z = zscore_normalise(candidates, top)
    std = (2 / 3) ** 0.5
    expected = torch.tensor([[1 / std, -1 / std], [1 / std, 0.5 / std], [0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(z, expected)
    with pytest.raises(ValueError, match="share R"):
        zscore_normalise(candidates[:2], top)


def test_teacher_mixes_the_two_normalised_systems(tmp_path: Path) -> None:
    """The bm25+model teacher is bm25_weight · z_bm25 + (1 - bm25_weight) · z_model, its model half scores a
    corpus document as the model's own retrieval does, and both systems put a query's topic document above
    noise."""
    pytest.importorskip("bm25s")
    from gradcache_sparton.data import load_beir
    from gradcache_sparton.mining import bm25_scores

    beir = load_beir(write_beir(tmp_path / "beir"), split="train")
    docs = list(beir.corpus.values())
    queries = [beir.queries[f"q{i}"] for i in range(4)]
    candidates = [
        [beir.corpus[f"d{i}"], beir.corpus[f"x{i}"], "The star is not here. A lab."] for i in range(4)
    ]
    encoder, tokenizer = _shipped_model()
    encoding = EncodingSettings(tokenizer, query_max_length=16, document_max_length=32, show_progress=False)
    model = SpladeTeacher(encoder, encoding).scores(queries, candidates, docs, depth=len(docs))
    bm25 = bm25_scores(queries, candidates, docs, depth=len(docs), show_progress=False)
    for scores, top in (model, bm25):
        assert (scores[:, 0] > scores[:, 1]).all()  # topic document above noise
        assert top.shape == (4, len(docs))
    # The model's best corpus score is its score of some corpus document: the candidates' scale is the corpus's.
    assert torch.isclose(model[0].max(dim=1).values, model[1][:, 0]).sum() >= 1
    z_model, z_bm25 = zscore_normalise(*model), zscore_normalise(*bm25)
    common = dict(encoder=encoder, encoding=encoding, depth=len(docs))
    for weight in (0.0, 0.3, 1.0):
        got = ensemble_teacher_scores(queries, candidates, docs, bm25_weight=weight, **common)
        # float32 result of a float64 mix of z-scores (|z| < sqrt(K) = 4): 4 · 2**-24 relative is below 1e-6.
        torch.testing.assert_close(
            got, (weight * z_bm25 + (1 - weight) * z_model).float(), rtol=1e-6, atol=1e-6
        )
    with pytest.raises(ValueError, match="bm25_weight"):
        ensemble_teacher_scores(queries, candidates, docs, bm25_weight=1.5, **common)


def test_crossval_teacher_scores_come_from_the_training_row_alone(tmp_path: Path) -> None:
    """With --teacher bm25+model every fold's training row carries teacher_scores [1+k], no held-out claim's
    text is among the rows, and each row's scores equal the teacher run on that row alone (nothing of
    another row, fold or judgement enters them); kl_div trains on them."""
    pytest.importorskip("bm25s")
    import gzip

    from gradcache_sparton.data import load_beir

    beir = write_beir(tmp_path / "beir")
    out = tmp_path / "cv"
    argv = ["crossval", "--beir_path", str(beir), "--output_dir", str(out), "--folds", "2", "--seeds", "1",
            "--self_supervised_pairs", "2", "--bm25_negatives", "2", "--teacher", "bm25+model",
            "--teacher_weight", "0.7", "--document_max_length", "32", "--resamples", "20", "--no_bm25",
            "--", *SHIPPED_RECIPE]  # fmt: skip
    assert main(argv) == 0
    results = json.loads((out / "crossval.json").read_text())
    assert results["settings"]["teacher"] == "bm25+model" and results["settings"]["teacher_weight"] == 0.7
    docs = list(load_beir(beir, split="train").corpus.values())
    encoder, tokenizer = _shipped_model()
    folds = json.loads((out / "folds.json").read_text())["folds"]
    for k, held in enumerate(folds):
        with gzip.open(out / f"fold{k}" / "train.jsonl.gz", "rt") as lines:
            rows = [json.loads(line) for line in lines]
        held_texts = {f"what about the {TOPICS[int(q[1:])]}" for q in held}
        assert not held_texts & {r["query"] for r in rows} and len(rows) == 4 + 2
        for row in rows:
            alone = ensemble_teacher_scores(
                [row["query"]],
                [[row["positive"], row["negative_1"], row["negative_2"]]],
                docs,
                encoder=encoder,
                # crossval's evaluation lengths
                encoding=EncodingSettings(
                    tokenizer, query_max_length=32, document_max_length=32, show_progress=False
                ),
                bm25_weight=0.7,
            )
            # fp32 encodings differ between batch shapes by summation order only (~1e-6 of scores of O(10)),
            # divided by a top-K std of O(1): far below 1e-4.
            torch.testing.assert_close(torch.tensor([row["teacher_scores"]]), alone, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    ("flags", "recipe", "message"),
    [
        (["--teacher", "bm25+model"], SHIPPED_RECIPE, "needs bm25_negatives >= 1"),
        (
            ["--bm25_negatives", "1", "--teacher", "bm25+model", "--teacher_weight", "1.5"],
            SHIPPED_RECIPE,
            "in \\[0, 1\\]",
        ),
        (["--teacher_weight", "0.3"], TINY_RECIPE, "applies to a teacher only"),
        (["--bm25_negatives", "1", "--teacher", "bm25+model"], TINY_RECIPE, "contrastive='infonce'"),
        (["--bm25_negatives", "1"], SHIPPED_RECIPE, "needs teacher scores"),
    ],
)
def test_crossval_teacher_misuse_fails_before_any_work(tmp_path: Path, flags, recipe, message) -> None:
    """A teacher without negatives, a weight outside [0, 1] or without a teacher, a teacher whose scores the
    recipe's loss would ignore, and a distillation loss without a teacher: one ValueError, nothing written."""
    beir = write_beir(tmp_path / "beir")
    out = tmp_path / "cv"
    with pytest.raises(ValueError, match=message):
        crossval_main(["--beir_path", str(beir), "--output_dir", str(out), *flags, "--", *recipe])
    assert not out.exists()


# ---------------------------------------------------------------------------------------------------
# crossval --merge: seeds run as separate jobs
# ---------------------------------------------------------------------------------------------------

QUERIES = [f"q{i}" for i in range(8)]  # write_beir's judged queries


def _per_query(generator: torch.Generator) -> dict[str, dict[str, float]]:
    return {
        key: {q: torch.rand((), generator=generator, dtype=torch.float64).item() for q in QUERIES}
        for key in ("ndcg_at_10", "mrr_at_10", "recall_at_100")
    }


def synthetic_run(seeds: dict[int, int], *, beir_path: str = "beir") -> dict:
    """A crossval.json as `run_crossval` writes it (2 folds of write_beir's queries), with random per-query
    numbers: the references drawn from fixed streams (equal in every run), each recipe seed from its own
    stream; ``seeds`` maps a recipe seed to its folds done."""
    from gradcache_sparton.crossval import CrossvalSettings
    from gradcache_sparton.crossval.report import _summarise

    folds = make_folds(QUERIES, folds=2, seed=0)
    config = CrossvalSettings(beir_path=beir_path, output_dir=f"out{list(seeds)}", folds=2, resamples=200)
    zero_shot = {"per_query": _per_query(torch.Generator().manual_seed(0)), "query_nonzeros": 40.0}
    results = {
        "meta": {"device": "cpu", "date": "2026-11-26"},
        "settings": {**vars(config), "seeds": list(seeds), "recipe_flags": ["--max_steps", "1"]},
        "model": "splade-tiny-msmarco",
        "folds": [
            {
                "fold": k,
                "queries": len(fold),
                "labelled_pairs": len(QUERIES) - len(fold),
                "self_supervised_pairs": 0,
                "train_file": f"fold{k}/train.jsonl.gz",
                "query_ids": fold,
            }
            for k, fold in enumerate(folds)
        ],
        "systems": {
            "zero-shot": {"seeds": {"-": zero_shot}},
            "bm25": {"seeds": {"-": {"per_query": _per_query(torch.Generator().manual_seed(1))}}},
            "recipe": {"seeds": {}},
        },
    }
    for seed, done in seeds.items():
        per_query = _per_query(torch.Generator().manual_seed(100 + seed))
        kept = {q for fold in folds[:done] for q in fold}
        results["systems"]["recipe"]["seeds"][str(seed)] = {
            "per_query": {
                key: {q: v for q, v in values.items() if q in kept} for key, values in per_query.items()
            },
            "query_nonzeros": 30.0 + seed,
            "doc_nonzeros": 150.0 + seed,
            "folds_done": done,
        }
    _summarise(results, folds)
    return results


def write_json(path: Path, results: dict) -> Path:
    path.write_text(json.dumps(results))
    return path


def test_merge_equals_one_run_with_all_seeds(tmp_path: Path, caplog) -> None:
    """Merging a run of seed 7 (seed 8 unfinished in it) with a run of seed 8 gives the table, comparisons
    (seeds averaged per query, per-seed lines) and markdown of one run of seeds [7, 8]; the unfinished seed
    is left out with a warning and listed in meta."""
    from gradcache_sparton.crossval import format_report, merge_crossval
    from gradcache_sparton.crossval.report import _summarise

    a = write_json(tmp_path / "a.json", synthetic_run({7: 2, 8: 1}))
    b = write_json(tmp_path / "b.json", synthetic_run({8: 2}, beir_path="/elsewhere/beir"))
    merged = merge_crossval([a, b], output_dir=tmp_path / "merged")

    expected = synthetic_run({7: 2, 8: 2})
    expected["systems"]["recipe"]["seeds"]["8"] = json.loads(b.read_text())["systems"]["recipe"]["seeds"]["8"]
    _summarise(expected, [f["query_ids"] for f in expected["folds"]])
    assert merged["settings"]["seeds"] == [7, 8] and merged["settings"]["beir_path"] == "beir"
    assert merged["table"] == expected["table"] and merged["comparisons"] == expected["comparisons"]
    assert list(merged["comparisons"]["recipe - zero-shot"]["per_seed"]) == ["7", "8"]
    assert merged["folds"] == expected["folds"]
    assert (tmp_path / "merged" / "crossval.md").read_text() == format_report(expected)
    assert json.loads((tmp_path / "merged" / "crossval.json").read_text()) == merged
    assert [m["skipped_unfinished_seeds"] for m in merged["meta"]["merged_from"]] == [{"8": 1}, {}]
    assert "seed 8 finished 1 of 2 folds" in caplog.text


def _other_recipe(r: dict) -> None:
    r["settings"]["recipe_flags"] = ["--max_steps", "2"]


def _other_recipe_with_workers(r: dict) -> None:
    r["settings"]["recipe_flags"] = ["--dataloader_num_workers", "4", "--max_steps", "2"]


def _other_folds(r: dict) -> None:
    first, second = r["folds"][0]["query_ids"], r["folds"][1]["query_ids"]
    first[0], second[0] = second[0], first[0]


def _other_reference(r: dict) -> None:
    r["systems"]["bm25"]["seeds"]["-"]["per_query"]["ndcg_at_10"]["q3"] += 1e-6


def _repeated_seed(r: dict) -> None:
    r["systems"]["recipe"]["seeds"] = {"7": r["systems"]["recipe"]["seeds"].pop("8")}


def _unfinished(r: dict) -> None:
    r["systems"]["recipe"]["seeds"]["8"]["folds_done"] = 1


@pytest.mark.parametrize(
    ("first_seeds", "change", "message"),
    [
        ({7: 2}, _other_recipe, r"settings \['recipe_flags'\] differ"),
        ({7: 2}, _other_recipe_with_workers, r"\['--max_steps', '1'\] vs \['--max_steps', '2'\]"),
        ({7: 2}, lambda r: r["settings"].update(resamples=100), r"settings \['resamples'\] differ"),
        ({7: 2}, lambda r: r.update(model="other"), r"settings \['model'\] differ"),
        ({7: 2}, _other_folds, r"folds \[0, 1\] of .*b.json.* differ"),
        ({7: 2}, _other_reference, "bm25's per-query numbers differ"),
        ({7: 2}, _repeated_seed, "recipe seed 7 is in both"),
        ({7: 1}, _unfinished, "no recipe seed finished all 2 folds"),
    ],
)
def test_merge_refuses_another_experiment(tmp_path: Path, first_seeds, change, message) -> None:
    """Runs that differ in a setting, the recipe, the model, the folds or a reference's per-query numbers
    (by 1e-6), that repeat a seed, or with no finished seed: one ValueError naming the problem, nothing
    written."""
    from gradcache_sparton.crossval import merge_crossval

    a = write_json(tmp_path / "a.json", synthetic_run(first_seeds))
    other = synthetic_run({8: 2})
    change(other)
    b = write_json(tmp_path / "b.json", other)
    with pytest.raises(ValueError, match=message):
        merge_crossval([a, b], output_dir=tmp_path / "merged")
    assert not (tmp_path / "merged").exists()


@pytest.mark.parametrize(
    "flags",
    [
        ["--dataloader_num_workers", "4", "--max_steps", "1"],
        [
            "--max_steps",
            "1",
            "--dataloader_num_workers=4",
            "--disable_tqdm",
            "--dataloader_persistent_workers",
            "True",
        ],
    ],
)
def test_merge_accepts_runs_that_differ_only_in_data_loading(tmp_path: Path, flags: list[str]) -> None:
    """Recipe flags that change how batches are loaded, not which (data-loading workers, progress bars), may
    differ between merged runs, in either flag form and with or without a value; each file's own flags are
    kept in meta.merged_from."""
    from gradcache_sparton.crossval import merge_crossval

    a = write_json(tmp_path / "a.json", synthetic_run({7: 2}))
    other = synthetic_run({8: 2})
    other["settings"]["recipe_flags"] = flags
    b = write_json(tmp_path / "b.json", other)
    merged = merge_crossval([a, b], output_dir=tmp_path / "merged")
    assert merged["settings"]["seeds"] == [7, 8]
    assert [m["recipe_flags"] for m in merged["meta"]["merged_from"]] == [["--max_steps", "1"], flags]


def test_merge_rebuilds_the_folds_of_old_files(tmp_path: Path) -> None:
    """A result file without fold query ids merges only with --beir_path, whose rebuilt folds (the protocol's
    query selection and make_folds) equal the recorded ones; a folder giving other fold sizes is refused."""
    from gradcache_sparton.crossval import merge_crossval

    beir = write_beir(tmp_path / "beir")
    old = synthetic_run({7: 2})
    for fold in old["folds"]:
        del fold["query_ids"]
    a = write_json(tmp_path / "a.json", old)
    b = write_json(tmp_path / "b.json", synthetic_run({8: 2}))
    with pytest.raises(ValueError, match="pass --beir_path"):
        merge_crossval([a, b], output_dir=tmp_path / "m0")
    merged = merge_crossval([a, b], output_dir=tmp_path / "m1", beir_path=str(beir))
    assert merged["folds"] == synthetic_run({7: 2})["folds"] and merged["settings"]["beir_path"] == str(beir)
    qrels = beir / "qrels" / "train.tsv"
    qrels.write_text(qrels.read_text().replace("q7\td7\t1\n", "q7\td7\t0\n"))  # q7 no longer judged relevant
    with pytest.raises(ValueError, match=r"rebuilt from --beir_path hold \[4, 3\]"):
        merge_crossval([a, b], output_dir=tmp_path / "m2", beir_path=str(beir))


def test_merge_cli_flags(tmp_path: Path, capsys) -> None:
    """`crossval --merge` prints the report, refuses settings or train flags (they come from the files) and an
    existing crossval.json without --overwrite; --overwrite without --merge is refused."""
    a = write_json(tmp_path / "a.json", synthetic_run({7: 2}))
    b = write_json(tmp_path / "b.json", synthetic_run({8: 2}))
    argv = ["crossval", "--merge", str(a), str(b), "--output_dir", str(tmp_path / "m")]
    assert main(argv) == 0 and "recipe seeds [7, 8]" in capsys.readouterr().out
    assert main(argv) == 2 and "pass --overwrite" in capsys.readouterr().err
    assert main([*argv, "--overwrite"]) == 0
    assert (
        main([*argv, "--overwrite", "--folds", "3"]) == 2
        and "leave out ['--folds']" in capsys.readouterr().err
    )
    assert main([*argv, "--overwrite", "--", "--max_steps", "2"]) == 2
    assert "leave out the train flags" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--overwrite applies to --merge and --compare only"):
        crossval_main(["--beir_path", "x", "--output_dir", str(tmp_path / "run"), "--overwrite"])


# ---------------------------------------------------------------------------------------------------
# crossval --rounds: negatives mined by each fold's previous model
# ---------------------------------------------------------------------------------------------------


def _read_rows(path: Path) -> list[dict]:
    import gzip

    with gzip.open(path, "rt") as lines:
        return [json.loads(line) for line in lines]


def _spy_training(monkeypatch) -> list[tuple[str | None, str]]:
    """Record (model_name_or_path, output_dir) of every training run crossval starts; training still runs."""
    import gradcache_sparton.pipeline as pipeline

    calls, real = [], pipeline.run_training

    def run_training(model_args, data_args, training_args):
        calls.append((model_args.model_name_or_path, training_args.output_dir))
        return real(model_args, data_args, training_args)

    monkeypatch.setattr(pipeline, "run_training", run_training)
    return calls


def test_crossval_rounds_mine_with_each_folds_previous_model(tmp_path: Path, monkeypatch) -> None:
    """rounds=1 trains each fold once, as before; rounds=2 trains it twice, round 1 exactly as a one-round run,
    round 2 from round 1's model of the same fold, on round 1's rows plus one negative that is no known positive
    of the row and sits in that model's own ranks of the window for the row's query."""
    pytest.importorskip("bm25s")
    from gradcache_sparton.arguments import ModelArguments
    from gradcache_sparton.crossval import rows as crossval_rows
    from gradcache_sparton.data import load_beir
    from gradcache_sparton.mining import splade_rankings
    from gradcache_sparton.model_loading import build_encoder, build_tokenizer

    # A window of 4 ranks in a 16-document corpus, the top rank included, and 3 negatives a row: a negative
    # from another ranking would often miss it, and a known positive left in would often be drawn.
    monkeypatch.setattr(crossval_rows, "NEGATIVE_RANKS", (1, 4))
    beir = write_beir(tmp_path / "beir")
    common = ["--beir_path", str(beir), "--folds", "2", "--seeds", "1", "--self_supervised_pairs", "2",
              "--bm25_negatives", "1", "--document_max_length", "32", "--resamples", "20", "--no_bm25"]  # fmt: skip
    calls = _spy_training(monkeypatch)
    one, two = tmp_path / "one", tmp_path / "two"
    assert crossval_main([*common, "--output_dir", str(one), "--", *TINY_RECIPE]) == 0
    assert calls == [(None, str(one / "seed1" / f"fold{k}")) for k in range(2)]
    assert not list(one.glob("fold*/train-seed*"))
    calls.clear()
    flags = ["--rounds", "2", "--model_negatives", "3"]
    assert crossval_main([*common, *flags, "--output_dir", str(two), "--", *TINY_RECIPE]) == 0
    round1, round2 = (str(two / "seed1" / "fold{}"), str(two / "seed1" / "round2" / "fold{}"))
    # per fold: round 1 from the recipe's start (random init), round 2 from that fold's round-1 model
    assert calls == [
        c for k in range(2) for c in ((None, round1.format(k)), (round1.format(k), round2.format(k)))
    ]
    first, second = (json.loads((d / "crossval.json").read_text()) for d in (one, two))
    assert set(first["systems"]) == {"zero-shot", "recipe"}
    assert set(second["systems"]) == {"zero-shot", "recipe-round1", "recipe"}
    assert second["systems"]["recipe-round1"]["seeds"] == first["systems"]["recipe"]["seeds"]
    assert "recipe - recipe-round1" in second["comparisons"] and second["settings"]["rounds"] == 2

    data = load_beir(beir, split="train")
    docs = list(data.corpus.values())
    tokenizer = build_tokenizer(parse_recipe(TINY_RECIPE)[0])
    for k in range(2):
        rows = _read_rows(two / f"fold{k}" / "train.jsonl.gz")
        mined = _read_rows(two / f"fold{k}" / "train-seed1-round2.jsonl.gz")
        assert rows == _read_rows(one / f"fold{k}" / "train.jsonl.gz")
        assert [{c: r[c] for c in ("query", "positive", "negative_1")} for r in mined] == rows
        model_negatives = ("negative_2", "negative_3", "negative_4")  # after the BM25 one
        assert all(set(r) == {"query", "positive", "negative_1", *model_negatives} for r in mined)
        model = ModelArguments(model_name_or_path=str(two / "seed1" / f"fold{k}"))
        encoder = build_encoder(model, tokenizer).eval()
        queries = list(dict.fromkeys(r["query"] for r in mined))  # the miner's queries, in its order
        encoding = EncodingSettings(
            tokenizer, query_max_length=32, document_max_length=32, show_progress=False
        )
        ranking = splade_rankings(encoder, queries, docs, encoding=encoding, depth=4)
        for row in mined:
            top = ranking[queries.index(row["query"])].tolist()
            for column in model_negatives:
                assert row[column] != _known_positive(row["query"], data.corpus)
                assert docs.index(row[column]) in top


def _known_positive(query: str, corpus: dict[str, str]) -> str:
    """write_beir's one judged abstract of a claim, or the one abstract a self-supervised sentence comes from."""
    claim = "what about the "
    if query.startswith(claim):
        return corpus[f"d{TOPICS.index(query.removeprefix(claim))}"]
    (source,) = [text for text in corpus.values() if query in text]
    return source


def test_crossval_round_teacher_is_the_previous_model(tmp_path: Path, monkeypatch) -> None:
    """With --teacher and rounds=2, round 2's rows carry teacher_scores of all their candidates (positive, BM25
    and model negatives) from BM25 and the fold's round-1 model, not the starting model; --round_start start
    trains round 2 from the recipe's starting model."""
    pytest.importorskip("bm25s")
    from gradcache_sparton.arguments import ModelArguments
    from gradcache_sparton.data import load_beir
    from gradcache_sparton.model_loading import build_encoder

    beir = write_beir(tmp_path / "beir")
    out = tmp_path / "cv"
    recipe = [*SHIPPED_RECIPE, "--learning_rate", "1e-3"]  # one step that moves the model's scores clearly
    argv = ["--beir_path", str(beir), "--output_dir", str(out), "--folds", "2", "--seeds", "1",
            "--self_supervised_pairs", "2", "--bm25_negatives", "1", "--teacher", "bm25+model", "--rounds", "2",
            "--model_negatives", "1", "--round_start", "start", "--document_max_length", "32", "--resamples", "20",
            "--no_bm25", "--", *recipe]  # fmt: skip
    calls = _spy_training(monkeypatch)
    assert crossval_main(argv) == 0
    assert [name for name, _ in calls] == ["splade-tiny-msmarco"] * 4
    docs = list(load_beir(beir, split="train").corpus.values())
    start, tokenizer = _shipped_model()
    # crossval's evaluation lengths
    encoding = EncodingSettings(tokenizer, query_max_length=32, document_max_length=32, show_progress=False)
    moved = 0.0
    for k in range(2):
        rows = _read_rows(out / f"fold{k}" / "train-seed1-round2.jsonl.gz")
        previous = build_encoder(
            ModelArguments(model_name_or_path=str(out / "seed1" / f"fold{k}")), tokenizer
        )
        queries = [row["query"] for row in rows]
        candidates = [[row["positive"], row["negative_1"], row["negative_2"]] for row in rows]
        teacher = dict(encoding=encoding, bm25_weight=0.5)
        expected = ensemble_teacher_scores(queries, candidates, docs, encoder=previous.eval(), **teacher)
        # fp32 encodings differ between batch shapes by summation order only (~1e-6 of scores of O(10)),
        # divided by a top-K std of O(1): far below 1e-4.
        got = torch.tensor([row["teacher_scores"] for row in rows])
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
        of_start = ensemble_teacher_scores(queries, candidates, docs, encoder=start.eval(), **teacher)
        moved = max(moved, (got - of_start).abs().max().item())
    assert moved > 0.1  # the starting model's teacher is another one, by far more than the 1e-4 above


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--rounds", "0"], "rounds must be >= 1"),
        (["--model_negatives", "1"], "model_negatives=1 .* need rounds >= 2"),
        (["--rounds", "2", "--model_negatives", "-1"], "model_negatives must be >= 0"),
        (["--round_start", "start"], "round_start applies to rounds >= 2"),
        (["--rounds", "2"], "give model_negatives >= 1"),
        (["--rounds", "2", "--model_negatives", "92"], "ranks 10..100: at most 91"),
        (
            ["--rounds", "2", "--model_negatives", "1", "--document_max_length", "100"],
            "document_max_length must be a positive multiple of 8, got 100",
        ),
    ],
)
def test_crossval_rounds_misuse_fails_before_any_work(tmp_path: Path, flags, message) -> None:
    """Rounds < 1, model negatives without a second round or beyond the rank window or at lengths the miner
    refuses, a round start with one round, and later rounds with nothing new to train on: one ValueError naming
    the flag, nothing written."""
    beir = write_beir(tmp_path / "beir")
    out = tmp_path / "cv"
    with pytest.raises(ValueError, match=message):
        crossval_main(["--beir_path", str(beir), "--output_dir", str(out), *flags, "--", *TINY_RECIPE])
    assert not out.exists()


def _with_rounds(run: dict) -> dict:
    """``run`` as a two-round run: its recipe numbers become round 1's, round 2's are round 1's plus 0.05 (a
    seed-dependent 0.01 more for seed 8), so each seed's round comparison is known."""
    from gradcache_sparton.crossval.report import _summarise

    run["settings"].update(rounds=2, model_negatives=1)
    first = run["systems"].pop("recipe")
    second = json.loads(json.dumps(first))
    for seed, entry in second["seeds"].items():
        for values in entry["per_query"].values():
            for q in values:
                values[q] += 0.05 + (0.01 if seed == "8" else 0.0)
    run["systems"].update({"recipe-round1": first, "recipe": second})
    _summarise(run, [f["query_ids"] for f in run["folds"]])
    return run


def test_merge_of_rounds_pairs_each_seed_with_its_own_round(tmp_path: Path) -> None:
    """Two-round runs merge as one run of their seeds: every earlier round merged per seed with the recipe,
    the round comparison's per-seed line pairs a seed with its own round 1 (+0.05 and +0.06 exactly); a
    one-round file and a two-round file are refused as other experiments."""
    from gradcache_sparton.crossval import merge_crossval

    a = write_json(tmp_path / "a.json", _with_rounds(synthetic_run({7: 2})))
    b = write_json(tmp_path / "b.json", _with_rounds(synthetic_run({8: 2})))
    merged = merge_crossval([a, b], output_dir=tmp_path / "merged")
    expected = _with_rounds(synthetic_run({7: 2, 8: 2}))
    assert merged["systems"] == expected["systems"] and merged["table"] == expected["table"]
    assert merged["comparisons"] == expected["comparisons"]
    per_seed = merged["comparisons"]["recipe - recipe-round1"]["per_seed"]
    assert per_seed["7"]["mean_difference"] == pytest.approx(0.05)
    assert per_seed["8"]["mean_difference"] == pytest.approx(0.06)
    assert per_seed["8"]["ci95_low"] == pytest.approx(0.06) == per_seed["8"]["ci95_high"]
    assert "recipe-round1 |" in (tmp_path / "merged" / "crossval.md").read_text()
    one_round = write_json(tmp_path / "c.json", synthetic_run({9: 2}))
    with pytest.raises(ValueError, match=r"settings \['model_negatives', 'rounds'\] differ"):
        merge_crossval([a, one_round], output_dir=tmp_path / "m2")


def test_merge_reads_a_setting_a_file_lacks_as_its_default(tmp_path: Path) -> None:
    """A file written before rounds existed (no rounds, model_negatives, round_start) ran one round: it merges
    with a file that records rounds=1, but not with one that records rounds=2."""
    from gradcache_sparton.crossval import merge_crossval

    old = synthetic_run({7: 2})
    for key in ("rounds", "model_negatives", "round_start"):
        del old["settings"][key]
    a = write_json(tmp_path / "a.json", old)
    merged = merge_crossval(
        [a, write_json(tmp_path / "b.json", synthetic_run({8: 2}))], output_dir=tmp_path / "m"
    )
    assert merged["settings"]["seeds"] == [7, 8]
    two = write_json(tmp_path / "c.json", _with_rounds(synthetic_run({8: 2})))
    with pytest.raises(ValueError, match="rounds: 1 vs 2"):
        merge_crossval([a, two], output_dir=tmp_path / "m2")


# ---------------------------------------------------------------------------------------------------
# A run into a finished run's folder; the recipe's config file
# ---------------------------------------------------------------------------------------------------


def _crossval_argv(beir: Path, out: Path, *flags: str, recipe: Sequence[str] = TINY_RECIPE) -> list[str]:
    return ["--beir_path", str(beir), "--output_dir", str(out), "--folds", "2", "--no_bm25",
            "--document_max_length", "32", "--resamples", "50", *flags, "--", *recipe]  # fmt: skip


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.slow
def test_crossval_into_a_finished_run_adds_seeds_or_refuses_before_writing(tmp_path: Path) -> None:
    """A run of seed 2 into a finished seed-1 folder keeps seed 1's results and adds seed 2's (as one run of
    both seeds); another fold_seed there, or a seed whose models a stopped run left, is refused before any file
    changes."""
    beir = write_beir(tmp_path / "beir")
    out = tmp_path / "cv"
    assert crossval_main(_crossval_argv(beir, out, "--seeds", "1")) == 0
    first = json.loads((out / "crossval.json").read_text())
    assert crossval_main(_crossval_argv(beir, out, "--seeds", "2")) == 0
    both = json.loads((out / "crossval.json").read_text())
    assert both["settings"]["seeds"] == [1, 2] and both["table"]["recipe"]["seeds"] == 2
    assert both["systems"]["recipe"]["seeds"]["1"] == first["systems"]["recipe"]["seeds"]["1"]
    assert both["systems"]["recipe"]["seeds"]["2"]["folds_done"] == 2
    assert list(both["comparisons"]["recipe - zero-shot"]["per_seed"]) == ["1", "2"]
    before = _files(out)
    with pytest.raises(ValueError, match=r"another experiment: settings \['fold_seed'\] differ"):
        crossval_main(_crossval_argv(beir, out, "--seeds", "3", "--fold_seed", "7"))
    assert _files(out) == before
    (out / "seed4" / "fold0").mkdir(parents=True)  # what a run stopped in its first fold leaves
    (out / "seed4" / "fold0" / "trainer_state.json").write_text("{}")
    before = _files(out)
    with pytest.raises(ValueError, match=r"already holds models of seed 4"):
        crossval_main(_crossval_argv(beir, out, "--seeds", "4"))
    assert _files(out) == before


def _recipe_file(path: Path, text: str) -> list[str]:
    path.write_text(text)
    return ["--config", str(path), *TINY_RECIPE]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("learning_rte: 0.001\n", r"has unknown argument\(s\) \['learning_rte'\]"),
        ("learning_rate: [0.001\n", r"recipe.yaml' line 2: not valid YAML"),
    ],
)
def test_crossval_refuses_a_config_train_refuses_before_any_work(
    tmp_path: Path, text, message, capsys
) -> None:
    """A recipe --config with an unknown key or invalid YAML: the error `train --config` gives, naming the file,
    before any data is read or file written (crossval and train alike)."""
    recipe = _recipe_file(tmp_path / "recipe.yaml", text)
    out = tmp_path / "cv"
    assert main(["crossval", *_crossval_argv(tmp_path / "nowhere", out, recipe=recipe)]) == 2
    crossval_err = capsys.readouterr().err
    assert "Traceback" not in crossval_err and len(re.findall(message, crossval_err)) == 1
    assert main(["train", *recipe, "--output_dir", str(tmp_path / "run")]) == 2
    assert re.search(message, capsys.readouterr().err)
    assert not out.exists()


def test_merge_refuses_recipes_whose_config_content_differs(tmp_path: Path) -> None:
    """Runs given the same --config path whose content changed in between (learning rate 1e-4, then 0.5) are
    refused, naming the file and the differing key; the same content at another path merges."""
    from gradcache_sparton.crossval import merge_crossval
    from gradcache_sparton.crossval.experiment import recipe_config

    path = tmp_path / "recipe.yaml"
    runs = []
    for seed, text in ((7, "learning_rate: 1.0e-4\n"), (8, "learning_rate: 0.5\n")):
        run = synthetic_run({seed: 2})
        run["settings"]["recipe_flags"] = _recipe_file(path, text)
        run["settings"]["recipe_config"] = recipe_config(run["settings"]["recipe_flags"])
        runs.append(write_json(tmp_path / f"{seed}.json", run))
    assert json.loads(runs[0].read_text())["settings"]["recipe_config"]["values"] == {"learning_rate": 1e-4}
    with pytest.raises(
        ValueError,
        match=r"recipe.yaml' \(sha256 \w+\) differ in \['learning_rate'\] \(learning_rate: 0.0001 vs 0.5\)",
    ):
        merge_crossval(runs, output_dir=tmp_path / "merged")
    assert not (tmp_path / "merged").exists()
    other = json.loads(runs[1].read_text())
    other["settings"]["recipe_config"]["values"]["learning_rate"] = 1e-4  # a comment's edit: same content
    merged = merge_crossval([runs[0], write_json(runs[1], other)], output_dir=tmp_path / "merged")
    assert merged["settings"]["recipe_config"]["values"] == {"learning_rate": 1e-4}
