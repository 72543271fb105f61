"""The data-parallel benchmark at a world size other than 2: its equality phase on 3 CPU ranks (gloo)."""

from __future__ import annotations

import json

import pytest
from rank_launch import launch_ranks


def test_row_splits_cover_the_global_batch_with_unequal_replay_counts() -> None:
    """Every world size's splits sum to 8 x W rows; the gated cases cut mini-batches at the reference's
    boundaries (the mini-batch divides every rank's rows) and still give ranks different replay counts;
    the reported case cuts them elsewhere."""
    from benchmarks import bench_ddp  # here: importing it sets NCCL's environment (multicast off)

    for world in (2, 3, 4, 7):
        splits = bench_ddp.row_splits(world)
        assert all(len(rows) == world and sum(rows) == 8 * world for rows in splits.values())
        cases = bench_ddp.equality_cases(world)
        for rows, mini_batch, gated in cases:
            aligned = all(r % mini_batch == 0 for r in rows)
            assert aligned == gated, (rows, mini_batch, gated)
        unequal_gated = next(rows for rows, mini_batch, gated in cases if gated and len(set(rows)) > 1)
        assert len({-(-r // bench_ddp.ALIGNED_MINI_BATCH) for r in unequal_gated}) > 1


@pytest.mark.slow
def test_three_ranks_match_one_process_on_the_global_batch(tmp_path) -> None:
    """On 3 gloo ranks (equal and unequal row splits) the gradients equal one process's on the global batch,
    and every rank holds the same gradients."""
    out = tmp_path / "ddp.json"
    launch_ranks(
        ["-m", "benchmarks.bench_ddp", "--smoke", "--out", str(out)],
        world_size=3,
        log_dir=tmp_path,
        timeout_s=300,
    )
    report = json.loads(out.read_text())
    assert [row["check"] for row in report["equality"]] == [
        "gradients, 8+8+8 rows, mini-batches of 2",
        "gradients, 10+8+6 rows, mini-batches of 2",
        "gradients, 10+8+6 rows, mini-batches of 3",
    ]
    for row in report["equality"]:
        assert row["ranks_bitwise_equal"], row
        assert row["max_relative_error"] <= (row["rtol"] or 1e-4), row
