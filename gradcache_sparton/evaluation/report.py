"""Tables of evaluation results: the mean over datasets and a plain-text table for the terminal."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

__all__ = ["format_table", "mean_metrics"]


def mean_metrics(rows: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """The unweighted mean of each metric over ``rows`` (e.g. one row per dataset); keys must agree."""
    if not rows:
        raise ValueError("rows is empty: nothing to average")
    keys = list(rows[0])
    if any(list(row) != keys for row in rows):
        raise ValueError(f"rows must have the same metrics, got {[list(row) for row in rows]}")
    return {key: sum(row[key] for row in rows) / len(rows) for key in keys}


def format_table(rows: Mapping[str, Mapping[str, float]]) -> str:
    """One line per row label, one column per metric (the metrics of the first row, in its order)."""
    if not rows:
        raise ValueError("rows is empty: nothing to format")
    columns = list(next(iter(rows.values())))
    label_width = max(len("dataset"), *(len(label) for label in rows))
    widths = [max(len(column), 10) for column in columns]
    lines = [
        " ".join(["dataset".ljust(label_width), *(c.rjust(w) for c, w in zip(columns, widths, strict=True))])
    ]
    for label, metrics in rows.items():
        cells = [_cell(metrics.get(column)).rjust(w) for column, w in zip(columns, widths, strict=True)]
        lines.append(" ".join([label.ljust(label_width), *cells]))
    return "\n".join(lines)


def _cell(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.0f}" if abs(value) >= 1000 else f"{value:.4f}"
