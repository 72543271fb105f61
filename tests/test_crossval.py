"""The cross-validation protocol (gradcache-sparton crossval) and its paired statistics."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from gradcache_sparton.cli import main
from gradcache_sparton.crossval import make_folds, parse_recipe
from gradcache_sparton.evaluation.significance import (
    paired_comparison,
    paired_run_comparison,
    paired_statistics,
    per_query_metrics,
)

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
    query, the table and the three comparisons written, with where the numbers came from."""
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
