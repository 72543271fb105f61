"""The sparse-cache benchmark script: what it runs and how it reads issue 18's targets from its rows."""

from __future__ import annotations

from benchmarks import bench_sparse_cache as bench


def test_plan_skips_the_dense_cache_beyond_its_limit() -> None:
    """Per V in the given order, growing B, dense before sparse; no dense row past --dense_max_batch, and
    the large-V batches at V >= 100,000."""
    args = bench.parse_args(["--output_dir", "x", "--vocabs", "250002,30522", "--batches", "8,16,32",
                             "--batches_v250k", "4", "--dense_max_batch", "16"])  # fmt: skip
    assert bench.plan(args) == [
        (250002, "dense", 4), (250002, "sparse", 4),
        (30522, "dense", 8), (30522, "sparse", 8), (30522, "dense", 16), (30522, "sparse", 16),
        (30522, "sparse", 32),
    ]  # fmt: skip


def test_targets_read_from_rows() -> None:
    """The throughput ratio is sparse over dense at 8,192; the V = 250,002 target reads the sparse row's
    peak; the 262,144 target passes only with a sparse row at least that large."""
    rows = [
        {"vocab": 30522, "cache": "dense", "batch": 8192, "status": "ok", "pairs_per_s": 800.0},
        {"vocab": 30522, "cache": "sparse", "batch": 8192, "status": "ok", "pairs_per_s": 780.0,
         "peak_allocated_gib": 9.0},
        {"vocab": 30522, "cache": "sparse", "batch": 65536, "status": "ok", "pairs_per_s": 700.0,
         "peak_allocated_gib": 30.0},
        {"vocab": 250002, "cache": "sparse", "batch": 4096, "status": "ok", "pairs_per_s": 300.0,
         "peak_allocated_gib": 17.5},
        {"vocab": 250002, "cache": "dense", "batch": 4096, "status": "OOM"},
    ]  # fmt: skip
    huge, large_vocab, throughput = bench.evaluate_targets(rows)
    assert huge["passed"] is False and "65,536" in huge["measured"]
    assert large_vocab["passed"] is False and "17.50" in large_vocab["measured"]
    assert throughput["passed"] is True and "0.975" in throughput["measured"]
    assert bench.evaluate_targets(rows[:1])[2]["passed"] is None
