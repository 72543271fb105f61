"""The SciFact fine-tuning experiment script runs end to end on a tiny prepared folder (CPU, --smoke)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from script_helpers import import_script

from gradcache_sparton.data import (
    default_dev_beir_path,
    default_train_data_path,
    load_beir,
    load_training_data,
    split_sentences,
)
from gradcache_sparton.mining import write_training_file


def _write_prepared_folder(folder: Path) -> None:
    """What prepare_finetune_data.py writes, at toy size, from the shipped SciFact sample."""
    dev = load_beir(default_dev_beir_path(), split="dev")
    qrels = dict(list(dev.qrels.items())[:2])
    judged = {doc for judgements in qrels.values() for doc in judgements}
    docs = [*judged, *[doc for doc in dev.corpus if doc not in judged][:6]]
    (folder / "dev" / "qrels").mkdir(parents=True)
    with gzip.open(folder / "dev" / "corpus.jsonl.gz", "wt", encoding="utf-8") as handle:
        for doc in docs:
            handle.write(json.dumps({"_id": doc, "title": "", "text": dev.corpus[doc]}) + "\n")
    (folder / "dev" / "queries.jsonl").write_text(
        "".join(json.dumps({"_id": q, "text": dev.queries[q]}) + "\n" for q in qrels)
    )
    (folder / "dev" / "qrels" / "dev.tsv").write_text(
        "query-id\tcorpus-id\tscore\n"
        + "".join(f"{q}\t{d}\t{r}\n" for q, judgements in qrels.items() for d, r in judgements.items())
    )
    rows = load_training_data(default_train_data_path()).select(range(8))
    negatives = rows.select(range(4, 8))["positive"]
    for name, part in (("labelled", rows.select(range(2))), ("selfsup", rows.select(range(2, 4)))):
        write_training_file(part, folder / f"{name}.jsonl.gz")
        with_negatives = part.add_column("negative_1", negatives[:2]).add_column("negative_2", negatives[2:])
        write_training_file(with_negatives, folder / f"{name}_bm25.jsonl.gz")


def test_plan_equal_epochs_then_equal_steps_without_running_the_reference_twice() -> None:
    """At the real sizes (4,096 pairs, 3 epochs, reference batch 1,024): equal epochs give N / B x 3 steps,
    equal steps give batch 1,024's 12 at every batch, and batch 1,024's run is planned once, for both."""
    experiment = import_script("scripts", "finetune_experiment")
    args = experiment.parse_args(["--output_dir", "unused"])
    configs = experiment.plan(4096, args)
    assert [(c.name, c.steps) for c in configs] == [
        *[(f"{neg}-b{b}-{'epochs=steps' if b == 1024 else 'epochs'}", 4096 // b * 3)
          for neg in ("none", "bm25") for b in (32, 256, 1024, 4096)],
        *[(f"{neg}-b{b}-steps", 12) for neg in ("none", "bm25") for b in (32, 256, 4096)],
    ]  # fmt: skip
    assert [round(experiment.learning_rate(b, args), 7) for b in (32, 256, 1024, 4096)] == [
        5e-5, 1.414e-4, 2e-4, 2e-4
    ]  # fmt: skip


def _write_call(folder: Path, runs: list[tuple[str, float, bool]], skipped: list[str]) -> Path:
    """A results.json as one call writes it (meta command: the folder's name): zero-shot, then each
    (name, nDCG@10, stopped by the time budget) of ``runs``."""
    metrics = {"mrr_at_10": 0.5, "recall_at_100": 0.9, "query_nonzeros": 40.0, "doc_nonzeros": 200.0}
    rows = [{"name": "zero-shot", "negatives": "-", "batch_size": None, "schedule": "-", "ndcg_at_10": 0.6}]
    for name, ndcg, stopped in runs:
        negatives, batch, schedule = name.split("-")
        rows.append(
            {"name": name, "negatives": negatives, "batch_size": int(batch[1:]), "schedule": schedule,
             "steps": 1, "planned_steps": 2 if stopped else 1, "stopped_by_time_budget": stopped,
             "ndcg_at_10": ndcg}
        )  # fmt: skip
    meta = {"device": "GPU", "torch": "2", "transformers": "5", "date": "2026-11-23", "command": folder.name}
    folder.mkdir()
    (folder / "results.json").write_text(
        json.dumps(
            {"meta": meta, "pairs": {"pairs": 4096}, "dev": {"queries": 2}, "bm25": None,
             "planned": [run[0] for run in runs] + skipped, "skipped": skipped,
             "rows": [{**metrics, "steps": 0, **row} for row in rows]}
        )
    )  # fmt: skip
    return folder


def test_merge_keeps_a_complete_run_over_one_the_time_budget_stopped_in_either_order(tmp_path: Path) -> None:
    """Invariant of --report: a run named in two calls' results is the complete one when the other was
    stopped by the time budget, whatever the folder order (between two complete runs, the later folder's);
    each run appears once, runs a later call ran leave ``skipped``, and ``calls`` keeps every call's meta."""
    experiment = import_script("scripts", "finetune_experiment")
    old = _write_call(
        tmp_path / "old",
        [("bm25-b32-epochs", 0.72, False), ("none-b32-epochs", 0.70, True)],
        ["none-b256-epochs"],
    )
    new = _write_call(
        tmp_path / "new", [("none-b32-epochs", 0.71, False), ("none-b256-epochs", 0.73, False)], []
    )
    cut = _write_call(tmp_path / "cut", [("none-b32-epochs", 0.69, True)], ["none-b256-epochs"])
    for folders in ([old, new], [new, old], [old, new, cut]):
        merged = experiment.merge(folders)
        names = ["zero-shot", "none-b32-epochs", "none-b256-epochs", "bm25-b32-epochs"]
        assert [row["name"] for row in merged["rows"]] == names
        assert merged["rows"][1]["ndcg_at_10"] == 0.71 and not merged["rows"][1]["stopped_by_time_budget"]
        assert merged["skipped"] == []
        assert [call["command"] for call in merged["calls"]] == [folder.name for folder in folders]
    redone = _write_call(tmp_path / "redone", [("bm25-b32-epochs", 0.74, False)], [])
    assert experiment.merge([old, redone])["rows"][-1]["ndcg_at_10"] == 0.74
    assert "3 calls" in experiment.table(experiment.merge([old, new, cut]))


@pytest.mark.slow
def test_smoke_run_writes_every_planned_row_with_its_metrics(tmp_path: Path) -> None:
    """--smoke with BM25 negatives trains the planned run (batch 4: its equal-epochs run is the equal-steps
    reference) and results.json holds zero-shot plus that row with every metric; the table names both.
    One training step only: the CPU reference head is slow on a shared 2-core machine."""
    experiment = import_script("scripts", "finetune_experiment")
    _write_prepared_folder(tmp_path / "data")
    out = tmp_path / "out"
    argv = ["--smoke", "--data_dir", str(tmp_path / "data"), "--output_dir", str(out), "--negatives", "bm25",
            "--batch_sizes", "4"]  # fmt: skip
    assert experiment.main(argv) == 0
    results = json.loads((out / "results.json").read_text())
    names = [row["name"] for row in results["rows"]]
    assert names == ["zero-shot", "bm25-b4-epochs=steps"]
    assert results["planned"] == names[1:] and results["skipped"] == []
    assert results["pairs"] == {"pairs": 4, "labelled": 2, "selfsup": 2}
    for row in results["rows"]:
        for key in experiment.METRICS:
            assert isinstance(row[key], float), (row["name"], key)
        assert 0.0 <= row["ndcg_at_10"] <= 1.0 and row["query_nonzeros"] > 0
    trained = results["rows"][1]
    assert trained["steps"] == trained["planned_steps"] == 1 and not trained["stopped_by_time_budget"]
    assert trained["log_history"] and trained["train_loss"] > 0
    table = (out / "results.md").read_text()
    assert all(f"| {name} |" in table for name in names)


def test_bad_arguments_and_missing_data_are_refused_before_any_work(tmp_path: Path) -> None:
    """A batch that does not divide the pair multiple, an unknown negatives name and a data folder without
    the prepared files each raise one ValueError naming the argument."""
    experiment = import_script("scripts", "finetune_experiment")
    with pytest.raises(ValueError, match="--batch_sizes"):
        experiment.parse_args(["--output_dir", str(tmp_path), "--batch_sizes", "3"])
    with pytest.raises(ValueError, match="--negatives"):
        experiment.parse_args(["--output_dir", str(tmp_path), "--negatives", "splade"])
    with pytest.raises(ValueError, match="--data_dir"):
        experiment.check_data_dir(tmp_path)


def test_prepared_data_holds_out_the_dev_claims_and_their_abstracts(tmp_path: Path) -> None:
    """prepare_finetune_data.py on a small BEIR folder: dev and training claims are disjoint and cover
    every claim, the dev folder keeps the whole corpus, no self-supervised pair comes from a judged
    abstract, every mined row has k negatives none of which is its positive, and BM25 dev metrics exist."""
    pytest.importorskip("bm25s")
    pytest.importorskip("Stemmer")
    prepare = import_script("scripts", "prepare_finetune_data")
    source = load_beir(default_dev_beir_path(), split="dev")
    judged = {doc for judgements in source.qrels.values() for doc in judgements}
    docs = [*judged, *[doc for doc in source.corpus if doc not in judged][:80]]
    scifact = tmp_path / "scifact"
    (scifact / "qrels").mkdir(parents=True)
    (scifact / "corpus.jsonl").write_text(
        "".join(json.dumps({"_id": d, "title": "", "text": source.corpus[d]}) + "\n" for d in docs)
    )
    (scifact / "queries.jsonl").write_text(
        "".join(json.dumps({"_id": q, "text": t}) + "\n" for q, t in source.queries.items())
    )
    (scifact / "qrels" / "train.tsv").write_text(
        "".join(f"{q}\t{d}\t{r}\n" for q, judgements in source.qrels.items() for d, r in judgements.items())
    )
    out = tmp_path / "prepared"
    assert prepare.main(["--scifact", str(scifact), "--out", str(out), "--rank_end", "60"]) == 0

    dev = load_beir(out / "dev", split="dev")
    assert list(dev.corpus) == docs  # the full corpus, in order
    assert len(dev.queries) == round(0.2 * len(source.queries))
    labelled = load_training_data(out / "labelled_bm25.jsonl.gz")
    train_claims = set(labelled["query"])
    assert not train_claims & set(dev.queries.values())
    assert len(train_claims) + len(dev.queries) == len(source.queries)
    selfsup = load_training_data(out / "selfsup_bm25.jsonl.gz")
    judged_sentences = {s for doc in judged for s in split_sentences(source.corpus[doc])}
    assert len(selfsup) > 0 and not set(selfsup["query"]) & judged_sentences
    for rows in (labelled, selfsup):
        for row in rows:
            assert row["negative_1"] != row["positive"] != row["negative_2"] != row["negative_1"]
    assert load_training_data(out / "labelled.jsonl.gz")["query"] == labelled["query"]
    assert set(json.loads((out / "bm25_dev.json").read_text())) == {
        "ndcg_at_10",
        "mrr_at_10",
        "recall_at_100",
    }
