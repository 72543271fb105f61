"""``crossval --run_folds``: a run of some folds, and ``--merge`` combining runs of one seed's different folds
into the result one run of every fold writes (and ``--compare`` over the folds both sides finished)."""

from __future__ import annotations

import copy
import json
import logging
import math
from pathlib import Path

import pytest
from test_crossval import TINY_RECIPE, synthetic_run, write_beir, write_json

from gradcache_sparton.cli.crossval import crossval_command as crossval_main
from gradcache_sparton.crossval import CrossvalSettings, compare_crossval, merge_crossval


def _argv(beir: Path, out: Path, *flags: str) -> list[str]:
    return ["--beir_path", str(beir), "--output_dir", str(out), "--folds", "3", "--seeds", "1", "--no_bm25",
            "--document_max_length", "32", "--resamples", "50", *flags, "--", *TINY_RECIPE]  # fmt: skip


@pytest.mark.parametrize("run_folds", [[3], [-1], [1, 1]])
def test_run_folds_outside_the_folds_or_repeated_fail_before_any_work(tmp_path: Path, run_folds) -> None:
    """A fold index outside 0..folds-1, or one given twice: one ValueError naming --run_folds, nothing written."""
    with pytest.raises(ValueError, match=r"--run_folds must be distinct fold indices in 0\.\.2"):
        CrossvalSettings(beir_path="b", output_dir="o", folds=3, run_folds=run_folds).check()
    flags = ["--run_folds", *map(str, run_folds)]
    with pytest.raises(ValueError, match="--run_folds"):
        crossval_main(_argv(tmp_path / "beir", tmp_path / "cv", *flags))
    assert not (tmp_path / "cv").exists()


def test_runs_of_some_folds_merge_into_the_run_of_all(tmp_path: Path, monkeypatch) -> None:
    """--run_folds 0 1 and --run_folds 2 train only their folds, on the held-out sets of the run of all three
    folds; merged, they give that run's per-query numbers bitwise, its comparisons and its table (mean non-zeros
    to rounding)."""
    import gradcache_sparton.pipeline as pipeline

    trained, real = [], pipeline.run_training

    def run_training(model_args, data_args, training_args):
        trained.append(Path(training_args.output_dir).name)
        return real(model_args, data_args, training_args)

    monkeypatch.setattr(pipeline, "run_training", run_training)
    beir = write_beir(tmp_path / "beir")
    assert crossval_main(_argv(beir, tmp_path / "all")) == 0
    assert crossval_main(_argv(beir, tmp_path / "a", "--run_folds", "1", "0")) == 0
    assert crossval_main(_argv(beir, tmp_path / "b", "--run_folds", "2")) == 0
    assert trained == ["fold0", "fold1", "fold2", "fold0", "fold1", "fold2"]
    full, a, b = (json.loads((tmp_path / d / "crossval.json").read_text()) for d in ("all", "a", "b"))
    assert a["folds"] == full["folds"] == b["folds"]  # dealt from all three folds, as the full run deals them
    assert (a["settings"]["run_folds"], b["settings"]["run_folds"], full["settings"]["run_folds"]) == (
        [0, 1],
        [2],
        [0, 1, 2],
    )
    assert b["systems"]["recipe"]["seeds"]["1"]["folds_finished"] == [2]
    assert b["table"]["recipe"]["ndcg_at_10_per_fold"] == full["table"]["recipe"]["ndcg_at_10_per_fold"][2:]
    assert "this run trained folds [2] of 3 only" in (tmp_path / "b" / "crossval.md").read_text()

    merged = merge_crossval(
        [tmp_path / "a" / "crossval.json", tmp_path / "b" / "crossval.json"], output_dir=tmp_path / "m"
    )
    recipe, expected = merged["systems"]["recipe"]["seeds"]["1"], full["systems"]["recipe"]["seeds"]["1"]
    assert recipe["per_query"] == expected["per_query"] and list(recipe["per_query"]) == list(
        expected["per_query"]
    )
    assert [list(v) for v in recipe["per_query"].values()] == [
        list(v) for v in expected["per_query"].values()
    ]
    assert recipe["folds_finished"] == [0, 1, 2] and recipe["folds_done"] == 3
    for key in ("query_nonzeros", "doc_nonzeros"):  # a weighted mean of two means: the same to rounding
        assert math.isclose(recipe[key], expected[key], rel_tol=1e-12)
    assert merged["comparisons"] == full["comparisons"]
    nonzeros = ("query_nonzeros", "doc_nonzeros")
    for system, row in full["table"].items():
        assert {k: v for k, v in merged["table"][system].items() if k not in nonzeros} == {
            k: v for k, v in row.items() if k not in nonzeros
        }
    assert merged["settings"]["run_folds"] == [0, 1, 2]
    assert [m["seed_folds"] for m in merged["meta"]["merged_from"]] == [{"1": [0, 1]}, {"1": [2]}]


def _fold_run(seeds: dict[int, list[int]], *, old: bool = False) -> dict:
    """synthetic_run's result (2 folds) with each recipe seed's numbers kept for the listed folds only, as a
    --run_folds run (or, ``old``, a run stopped after its first folds, written before run_folds existed)."""
    results = synthetic_run(dict.fromkeys(seeds, 2))
    folds = [entry["query_ids"] for entry in results["folds"]]
    if old:
        del results["settings"]["run_folds"]
    else:
        results["settings"]["run_folds"] = sorted({k for done in seeds.values() for k in done})
    for seed, done in seeds.items():
        run = results["systems"]["recipe"]["seeds"][str(seed)]
        kept = {q for k in done for q in folds[k]}
        run["per_query"] = {
            key: {q: v for q, v in values.items() if q in kept} for key, values in run["per_query"].items()
        }
        run["folds_done"] = len(done)
        if old:
            assert done == list(range(len(done)))
        else:
            run["folds_finished"] = done
    return results


def test_merge_of_an_old_stopped_file_with_a_run_of_its_missing_fold(tmp_path: Path) -> None:
    """A file written before run_folds existed, stopped after fold 0 (folds_done 1, no folds_finished), merged
    with a --run_folds 1 run of the same seed: exactly the result one run of both folds writes."""
    a = write_json(tmp_path / "a.json", _fold_run({7: [0]}, old=True))
    assert "run_folds" not in json.loads(a.read_text())["settings"]
    b = write_json(tmp_path / "b.json", _fold_run({7: [1]}))
    merged = merge_crossval([a, b], output_dir=tmp_path / "m")
    expected = synthetic_run({7: 2})
    assert merged["systems"]["recipe"] == {
        "seeds": {"7": {**expected["systems"]["recipe"]["seeds"]["7"], "folds_finished": [0, 1]}}
    }
    assert merged["table"] == expected["table"] and merged["comparisons"] == expected["comparisons"]


def test_merge_refuses_a_fold_of_a_seed_in_two_files(tmp_path: Path) -> None:
    """Fold 1 of seed 7 in two inputs: one ValueError naming the fold, the seed and both files."""
    a = write_json(tmp_path / "a.json", _fold_run({7: [0, 1]}))
    a_runs = json.loads(a.read_text())
    a_runs["systems"]["recipe"]["seeds"]["7"] = _fold_run({7: [1]})["systems"]["recipe"]["seeds"]["7"]
    write_json(a, a_runs)
    b = write_json(tmp_path / "b.json", _fold_run({7: [1]}))
    with pytest.raises(ValueError, match=r"fold 1 of recipe seed 7 is in both '.*a\.json' and '.*b\.json'"):
        merge_crossval([a, b], output_dir=tmp_path / "m")
    assert not (tmp_path / "m").exists()


def test_merge_lists_a_seed_whose_folds_stay_uncovered(tmp_path: Path, caplog) -> None:
    """Seed 8 with fold 1 in no input: left out with a warning and listed unfinished; seed 7, whose two runs
    cover both folds, is merged."""
    a = write_json(tmp_path / "a.json", _fold_run({7: [0], 8: [0]}))
    b = write_json(tmp_path / "b.json", _fold_run({7: [1]}))
    with caplog.at_level(logging.WARNING):
        merged = merge_crossval([a, b], output_dir=tmp_path / "m")
    assert merged["settings"]["seeds"] == [7]
    assert [m["skipped_unfinished_seeds"] for m in merged["meta"]["merged_from"]] == [{"8": 1}, {}]
    assert "recipe seed 8 finished 1 of 2 folds ([0]), all its runs together [0]: left out" in caplog.text


def test_compare_runs_over_the_folds_both_finished(tmp_path: Path) -> None:
    """Two runs stopped after fold 0 compare on fold 0's claims, each system's numbers over those claims only."""
    a = write_json(tmp_path / "a.json", _fold_run({7: [0]}, old=True))
    other = _fold_run({8: [0, 1]})
    other["model"] = "another-model"
    b = write_json(tmp_path / "b.json", other)
    comparison = compare_crossval([a, b], output_dir=tmp_path / "c")
    fold0 = json.loads(a.read_text())["folds"][0]["query_ids"]
    assert comparison["claims"]["folds_compared"] == [0]
    assert comparison["table"]["B:recipe"]["ndcg_at_10_per_fold"] == [
        sum(other["systems"]["recipe"]["seeds"]["8"]["per_query"]["ndcg_at_10"][q] for q in fold0)
        / len(fold0)
    ]
    assert comparison["comparisons"]["A:recipe - bm25"]["queries_up"] + comparison["comparisons"][
        "A:recipe - bm25"
    ]["queries_down"] + comparison["comparisons"]["A:recipe - bm25"]["queries_same"] == len(fold0)
    assert "only the claims of folds [0]" in (tmp_path / "c" / "compare.md").read_text()
    unfinished = copy.deepcopy(other)
    unfinished["systems"]["recipe"]["seeds"] = _fold_run({8: [1]})["systems"]["recipe"]["seeds"]
    with pytest.raises(ValueError, match="no fold is finished by every recipe seed of both"):
        compare_crossval([a, write_json(tmp_path / "u.json", unfinished)], output_dir=tmp_path / "c2")


def test_merge_of_two_stopped_seeds_with_one_run_of_the_fold_both_lack(tmp_path: Path) -> None:
    """Seeds 7 and 8 stopped after fold 0 in two files, and one --run_folds 1 run of both seeds: the result of
    one run of both seeds and both folds."""
    a = write_json(tmp_path / "a.json", _fold_run({7: [0]}, old=True))
    b = write_json(tmp_path / "b.json", _fold_run({8: [0]}, old=True))
    c = write_json(tmp_path / "c.json", _fold_run({7: [1], 8: [1]}))
    merged = merge_crossval([a, b, c], output_dir=tmp_path / "m")
    expected = synthetic_run({7: 2, 8: 2})
    assert merged["settings"]["seeds"] == [7, 8]
    assert merged["table"] == expected["table"] and merged["comparisons"] == expected["comparisons"]
    assert [m["seed_folds"] for m in merged["meta"]["merged_from"]] == [
        {"7": [0]},
        {"8": [0]},
        {"7": [1], "8": [1]},
    ]
