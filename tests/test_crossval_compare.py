"""``gradcache-sparton crossval --compare``: two cross-validations on the same folds compared claim by claim."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gradcache_sparton.cli import main
from gradcache_sparton.crossval import compare_crossval
from gradcache_sparton.evaluation.significance import paired_statistics

FOLDS = [["q0", "q2"], ["q1", "q3"]]
BM25 = [0.4, 0.6, 0.2, 0.8]  # nDCG@10 of q0..q3, the same data in both files


def _system(seeds: dict[str, list[float]]) -> dict:
    """A system entry: seed -> nDCG@10 of q0..q3 (the other metrics equal to it)."""
    return {
        "seeds": {
            seed: {"per_query": {key: {f"q{i}": v for i, v in enumerate(values)} for key in ("ndcg_at_10", "mrr_at_10", "recall_at_100")}}
            for seed, values in seeds.items()
        }
    }  # fmt: skip


def _result(path: Path, *, zero_shot: list[float], recipe: dict[str, list[float]], model: str) -> Path:
    """A crossval.json of 2 folds over 4 claims (what the comparison reads of it)."""
    results = {
        "meta": {"date": "2026-11-28"},
        "settings": {"beir_path": "scifact", "split": "train", "folds": 2, "fold_seed": 0, "seeds": [1, 2],
                     "resamples": 500, "query_max_length": 32, "document_max_length": 256,
                     "recipe_flags": ["--max_steps", "1"]},
        "model": model,
        "folds": [{"fold": k, "queries": len(fold), "query_ids": fold} for k, fold in enumerate(FOLDS)],
        "systems": {"zero-shot": _system({"-": zero_shot}), "bm25": _system({"-": BM25}), "recipe": _system(recipe)},
    }  # fmt: skip
    path.write_text(json.dumps(results))
    return path


def _pair(tmp_path: Path) -> tuple[Path, Path]:
    a = _result(
        tmp_path / "a.json",
        zero_shot=[0.5, 0.5, 0.5, 0.5],
        recipe={"1": [0.6, 0.7, 0.5, 0.9], "2": [0.8, 0.5, 0.7, 0.7]},
        model="idf",
    )
    b = _result(
        tmp_path / "b.json",
        zero_shot=[0.3, 0.4, 0.5, 0.6],
        recipe={"1": [0.5, 0.5, 0.5, 0.5], "2": [0.7, 0.3, 0.6, 0.8]},
        model="splade-tiny-msmarco",
    )
    return a, b


def test_compare_paired_differences_equal_a_hand_computation(tmp_path: Path) -> None:
    """Each claim's recipe score is its seeds' mean; A:recipe - B:recipe is the paired statistic of those
    per-claim differences (mean 0.125), per seed seed against seed; a reference against a recipe pairs the
    recipe's seeds; the table's nDCG@10 is the mean over folds of the seeds' fold means."""
    a, b = _pair(tmp_path)
    result = compare_crossval([a, b], output_dir=tmp_path / "out", names=["idf", "siamese"])
    c = result["comparisons"]
    assert list(c) == [
        "idf:recipe - siamese:recipe",
        "idf:recipe - siamese:zero-shot",
        "idf:zero-shot - siamese:recipe",
        "idf:zero-shot - siamese:zero-shot",
        "idf:recipe - bm25",
        "siamese:recipe - bm25",
    ]
    # A's claim means 0.7 0.6 0.6 0.8, B's 0.6 0.4 0.55 0.65 (claims sorted q0..q3).
    hand = paired_statistics([0.1, 0.2, 0.05, 0.15], resamples=500)
    recipes = c["idf:recipe - siamese:recipe"]
    assert recipes["mean_difference"] == pytest.approx(0.125)
    assert {k: recipes[k] for k in hand} == pytest.approx(hand)
    assert recipes["per_seed"]["1"]["mean_difference"] == pytest.approx((0.1 + 0.2 + 0.0 + 0.4) / 4)
    assert recipes["per_seed"]["2"]["mean_difference"] == pytest.approx((0.1 + 0.2 + 0.1 - 0.1) / 4)
    reference = c["idf:zero-shot - siamese:recipe"]  # 0.5 against B's claim means, then against each B seed
    assert reference["mean_difference"] == pytest.approx(-0.05)
    assert reference["per_seed"]["1"]["mean_difference"] == pytest.approx(0.0)
    assert reference["per_seed"]["2"]["mean_difference"] == pytest.approx(-0.1)
    assert c["idf:recipe - bm25"]["mean_difference"] == pytest.approx(0.675 - 0.5)
    assert result["table"]["idf:recipe"]["ndcg_at_10"] == pytest.approx(
        ((0.55 + 0.75) / 2 + (0.8 + 0.6) / 2) / 2
    )
    assert result["table"]["idf:recipe"]["seeds"] == 2 and set(result["table"]) == {
        "idf:recipe",
        "idf:zero-shot",
        "siamese:recipe",
        "siamese:zero-shot",
        "bm25",
    }


def test_compare_pairs_seeds_only_when_both_ran_them(tmp_path: Path) -> None:
    """Recipes of other seeds: the recipe - recipe comparison has no per-seed lines (seed 3 of one recipe is
    no partner of seed 1 of the other); one starting model evaluated in both files is not compared with itself."""
    a, _ = _pair(tmp_path)
    b = _result(
        tmp_path / "b.json",
        zero_shot=[0.5, 0.5, 0.5, 0.5],
        recipe={"3": [0.5, 0.5, 0.5, 0.5], "4": [0.7, 0.3, 0.6, 0.8]},
        model="idf",
    )
    c = compare_crossval([a, b], output_dir=tmp_path / "out")["comparisons"]
    assert "per_seed" not in c["A:recipe - B:recipe"] and "A:zero-shot - B:zero-shot" not in c
    assert list(c["A:recipe - B:zero-shot"]["per_seed"]) == ["1", "2"]


def _other_folds(r: dict) -> None:
    first, second = r["folds"][0]["query_ids"], r["folds"][1]["query_ids"]
    first[0], second[0] = second[0], first[0]


def _other_bm25(r: dict) -> None:
    r["systems"]["bm25"]["seeds"]["-"]["per_query"]["ndcg_at_10"]["q3"] += 1e-6


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (_other_folds, r"folds \[0, 1\] of '.*b\.json' hold other held-out query ids than '.*a\.json'"),
        (
            lambda r: r["settings"].update(fold_seed=1),
            r"'.*b\.json' holds other claims .* \['fold_seed'\] differ",
        ),
        (lambda r: r["settings"].update(split="dev"), r"\['split'\] differ \(split: 'train' vs 'dev'\)"),
        (_other_bm25, r"bm25's per-claim numbers differ between '.*a\.json' and '.*b\.json'"),
    ],
)
def test_compare_refuses_other_claims_naming_the_file(tmp_path: Path, change, message) -> None:
    """Results on other folds, another fold seed or split, or other data (BM25 differs by 1e-6 on one claim):
    one ValueError naming the file and what differs, nothing written."""
    a, b = _pair(tmp_path)
    other = json.loads(b.read_text())
    change(other)
    b.write_text(json.dumps(other))
    with pytest.raises(ValueError, match=message):
        compare_crossval([a, b], output_dir=tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_compare_cli_end_to_end(tmp_path: Path, capsys) -> None:
    """`crossval --compare A B --names ... --output_dir` prints the tables it writes to compare.md beside
    compare.json; a second run needs --overwrite; settings flags and train flags are refused."""
    a, b = _pair(tmp_path)
    out = tmp_path / "cmp"
    argv = ["crossval", "--compare", str(a), str(b), "--names", "idf", "siamese", "--output_dir", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "| idf:recipe - siamese:recipe | +0.1250 |" in printed and "| bm25 | 1 |" in printed
    assert (out / "compare.md").read_text() in printed
    written = json.loads((out / "compare.json").read_text())
    assert written["files"]["idf"]["file"] == str(a) and written["claims"]["folds"] == FOLDS
    assert main(argv) == 2 and "pass --overwrite" in capsys.readouterr().err
    assert main([*argv, "--overwrite"]) == 0
    assert main([*argv, "--overwrite", "--resamples", "9"]) == 2
    assert "leave out ['--resamples']" in capsys.readouterr().err
    assert main([*argv, "--overwrite", "--", "--max_steps", "2"]) == 2
    assert main(["crossval", "--compare", str(a), "--output_dir", str(out)]) == 2
    assert "takes two crossval.json files, got 1" in capsys.readouterr().err
