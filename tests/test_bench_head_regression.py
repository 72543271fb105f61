"""The head regression check's verdicts: a row over the tolerance fails, runs combine by their fastest."""

from __future__ import annotations

import json

import pytest

from benchmarks import head_regression


def _row(fwd: float, fwd_bwd: float, *, check_ok: bool = True) -> dict:
    return {"B": 128, "S": 512, "D": 768, "V": 30522, "density": "sparse", "y_nonzero_frac": 0.3,
            "fwd_ms": fwd, "fwd_bwd_ms": fwd_bwd, "check_ok": check_ok}  # fmt: skip


def test_a_row_past_the_tolerance_fails_and_one_within_passes() -> None:
    """3% slower in either timing, or a failed output check, fails the comparison; 2% slower passes."""
    key = head_regression.row_key(_row(1, 1))
    before = {key: _row(10.0, 20.0)}
    assert head_regression.compare(before, {key: _row(10.2, 20.4)}, 0.03)[1]
    assert not head_regression.compare(before, {key: _row(10.4, 20.0)}, 0.03)[1]
    assert not head_regression.compare(before, {key: _row(10.0, 20.7)}, 0.03)[1]
    assert not head_regression.compare(before, {key: _row(9.0, 18.0, check_ok=False)}, 0.03)[1]


def test_runs_of_one_tree_combine_by_each_rows_fastest(tmp_path) -> None:
    """Each timing of a row is the minimum over the runs given; runs from two devices are refused."""
    files = []
    for i, (fwd, fwd_bwd, device) in enumerate([(10.0, 21.0, "H"), (11.0, 20.0, "H"), (1.0, 1.0, "other")]):
        files.append(tmp_path / f"run{i}.json")
        files[-1].write_text(json.dumps({"meta": {"device": device}, "rows": [_row(fwd, fwd_bwd)]}))
    _, rows = head_regression._fastest(files[:2])
    (row,) = rows.values()
    assert (row["fwd_ms"], row["fwd_bwd_ms"]) == (10.0, 20.0)
    with pytest.raises(ValueError, match="several devices"):
        head_regression._fastest(files)
