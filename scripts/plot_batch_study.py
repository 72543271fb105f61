"""Plot the batch study of docs/experiments.md: nDCG@10 gain over the zero-shot model against the effective
batch, with the 95% paired intervals `gradcache-sparton crossval` reports, at equal steps and at equal epochs,
and BM25's level on the same claims.

Each input is a ``crossval.json`` of one recipe (one effective batch), named on the command line as
``BATCH:FILE``; its "recipe - zero-shot" and "zero-shot - bm25" comparisons give the points and the BM25 line.

    python scripts/plot_batch_study.py --out docs/img/batch_study.png \\
        --equal_steps 32:benchmarks/results/crossval_steps50_b32_h200.json \\
                      256:benchmarks/results/crossval_steps50_b256_h200.json \\
                      2048:benchmarks/results/crossval_steps50_b2048_h200.json \\
        --equal_epochs 256:benchmarks/results/crossval_epochs3_b256_h200.json \\
                       2048:benchmarks/results/crossval_epochs3_b2048_h200.json

Needs matplotlib (not a dependency of the package).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

__all__ = ["gain_points", "main"]

RECIPE = "recipe - zero-shot"
BM25 = "zero-shot - bm25"


def gain_points(specs: list[str]) -> list[tuple[int, float, float, float, int]]:
    """(batch, mean gain, interval low, interval high, seeds) per ``BATCH:FILE``, sorted by batch.

    Raises:
        ValueError: naming the spec that is not ``BATCH:FILE`` or whose file has no recipe comparison.
    """
    points = []
    for spec in specs:
        batch, sep, path = spec.partition(":")
        if not sep or not batch.isdigit():
            raise ValueError(f"expected BATCH:FILE (e.g. 256:crossval.json), got {spec!r}")
        report = json.loads(Path(path).read_text())
        comparison = report.get("comparisons", {}).get(RECIPE)
        if comparison is None:
            raise ValueError(f"{path} has no {RECIPE!r} comparison: the run did not finish its folds")
        seeds = report["table"]["recipe"]["seeds"]
        points.append(
            (
                int(batch),
                comparison["mean_difference"],
                comparison["ci95_low"],
                comparison["ci95_high"],
                seeds,
            )
        )
    return sorted(points)


def _bm25_level(specs: list[str]) -> float:
    """BM25 over the zero-shot model on the same claims (the same in every file of one protocol)."""
    path = specs[0].partition(":")[2]
    return -json.loads(Path(path).read_text())["comparisons"][BM25]["mean_difference"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="PNG file to write")
    parser.add_argument("--equal_steps", nargs="+", required=True, metavar="BATCH:FILE")
    parser.add_argument("--equal_epochs", nargs="*", default=[], metavar="BATCH:FILE")
    args = parser.parse_args()

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    series = (
        ("equal steps (50)", args.equal_steps, "o", -12),
        ("equal epochs (3)", args.equal_epochs, "s", 6),
    )
    ticks: set[int] = set()
    for label, specs, marker, offset in series:
        if not specs:
            continue
        points = gain_points(specs)
        batches = [p[0] for p in points]
        ticks.update(batches)
        means = [p[1] for p in points]
        errors = [[p[1] - p[2] for p in points], [p[3] - p[1] for p in points]]
        ax.errorbar(batches, means, yerr=errors, marker=marker, capsize=4, label=label)
        for batch, mean, _, _, seeds in points:
            ax.annotate(f"{seeds} seed{'s' if seeds > 1 else ''}", (batch, mean), textcoords="offset points",
                        xytext=(6, offset), fontsize=7)  # fmt: skip
    ax.axhline(_bm25_level(args.equal_steps), color="grey", linestyle="--", label="BM25")
    ax.axhline(0.0, color="black", linewidth=0.5)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted(ticks), [f"{batch:,}" for batch in sorted(ticks)])
    ax.set_xlabel("effective batch (pairs per step)")
    ax.set_ylabel("nDCG@10 over zero-shot (95% interval)")
    ax.set_title("SPLADE-tiny on SciFact, 5 folds, 809 held-out claims, full corpus", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
