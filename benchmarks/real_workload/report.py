"""A run's outputs: ``real_workload.json`` (rewritten after every row), ``real_workload.md``, the tables
printed, and ``real_workload.png`` (pairs/s against peak memory); merging several runs into one."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import headless_pyplot, run_stamp
from benchmarks.harness import GiB
from benchmarks.real_workload.configs import variant_name
from benchmarks.real_workload.models import sentence_transformers_version
from benchmarks.real_workload.targets import evaluate_targets

__all__ = [
    "finish",
    "markdown",
    "merge",
    "metadata",
    "plot",
    "plot_style",
    "record",
    "show",
    "write_outputs",
]


def _cell(x: object, fmt: str = "{:.2f}") -> str:
    if x is None:
        return "-"
    return fmt.format(x) if isinstance(x, float) else str(x)


TABLE_HEAD = [
    "model",
    "workload",
    "provider",
    "mb",
    "tokens",
    "B",
    "status",
    "step s",
    "pairs/s",
    "peak GiB",
    "busy",
    "syncs",
    "nnz q/d",
]
TARGET_HEAD = ["model/workload", "target", "value", "threshold", "status", "detail"]


def table_rows(rows: list[dict]) -> list[list[str]]:
    out = []
    for r in rows:
        nnz = r.get("nnz_per_row")
        out.append([
            r["model"], r["workload"], variant_name(r), _cell(r["mini_batch"]), _cell(r["tokens"]), str(r["batch"]),
            r["status"], _cell(r.get("step_s_median"), "{:.3f}"),
            _cell(r.get("pairs_per_s"), "{:.0f}"), _cell(r.get("peak_allocated_gib")), _cell(r.get("busy_fraction")),
            _cell(r.get("syncs_per_step"), "{}"),
            f"{nnz['query']:.0f}/{nnz['positive']:.0f}" if nnz else "-",
        ])  # fmt: skip
    return out


def target_rows(targets: list[dict]) -> list[list[str]]:
    return [
        [t["group"], t["target"], _cell(t["value"], "{:.3g}"), t["threshold"], t["status"], t["detail"]]
        for t in targets
    ]


def markdown(meta: dict, rows: list[dict], targets: list[dict]) -> str:
    def md(head: list[str], body: list[list[str]]) -> str:
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        return "\n".join(lines + ["| " + " | ".join(b) + " |" for b in body])

    stamp = ", ".join(
        f"{k} {meta.get(k)}"
        for k in ("device", "torch", "triton", "transformers", "sentence_transformers", "date")
    )
    calibration = "\n".join(f"- {k}: {json.dumps(v)}" for k, v in meta.get("models", {}).items())
    return (
        f"Real-workload benchmark ({stamp}; `{meta.get('command')}`)\n\nModels:\n{calibration}\n\n"
        + md(TABLE_HEAD, table_rows(rows))
        + "\n\nTargets\n\n"
        + md(TARGET_HEAD, target_rows(targets))
        + "\n"
    )


def show(head: list[str], body: list[list[str]]) -> None:
    widths = [max(len(x) for x in col) for col in zip(head, *body, strict=True)]
    for line in [head, *body]:
        print("  ".join(x.ljust(w) for x, w in zip(line, widths, strict=True)))
    sys.stdout.flush()


# One color per provider with its options; sentence-transformers' in warm colors, ours in cool ones.
VARIANT_COLORS = {
    "ours": "tab:blue", "ours+reuse": "tab:green", "ours+ckpt": "tab:cyan", "ours+reuse+ckpt": "tab:olive",
    "ours+compile": "tab:purple", "ours+ckpt+compile": "tab:pink", "ours+sparse": "navy",
    "ours+reuse+sparse": "darkgreen", "ours+sparse+ckpt": "teal", "ours+reuse+sparse+ckpt": "yellowgreen",
    "ours+sparse+compile": "slateblue", "ours+sparse+ckpt+compile": "magenta", "ours-uncached": "tab:gray",
    "ours-uncached+compile": "black", "st": "tab:red", "st+ckpt": "tab:orange", "st+compile": "tab:brown",
    "st+ckpt+compile": "gold",
}  # fmt: skip


def plot_style(family: str) -> tuple[str, str]:
    """(matplotlib format, color) of a plot series: circles for rows per mini-batch, squares for tokens,
    diamonds for uncached; solid lines for ours, dashed for sentence-transformers."""
    variant, _, kind = family.rpartition("-") if family.endswith(("-mb", "-tok")) else (family, "", "")
    marker = {"mb": "o", "tok": "s"}.get(kind, "D")
    line = "" if marker == "D" else "--" if variant.startswith("st") else "-"
    return marker + line, VARIANT_COLORS.get(variant, "tab:gray")


def plot(rows: list[dict], path: Path) -> str:
    """pairs/s against peak memory, one panel per (model, workload), one series per provider and budget kind."""
    plt = headless_pyplot()
    if plt is None:
        return "matplotlib is not installed: no plot (pip install matplotlib)"
    done = [r for r in rows if r["status"] == "ok" and "peak_allocated_gib" in r]
    if not done:
        return "no rows with peak memory (CPU run or nothing finished): no plot"
    groups = list(dict.fromkeys((r["model"], r["workload"]) for r in done))
    fig, axes = plt.subplots(1, len(groups), figsize=(5.5 * len(groups), 4.5), squeeze=False)
    for ax, (model, workload) in zip(axes[0], groups, strict=True):
        for family in sorted({r["family"] for r in done}):
            style, color = plot_style(family)
            series = sorted(
                (
                    r
                    for r in done
                    if (r["model"], r["workload"]) == (model, workload) and r["family"] == family
                ),
                key=lambda r: r["peak_allocated_gib"],
            )
            if not series:
                continue
            xs = [r["peak_allocated_gib"] for r in series]
            ax.plot(xs, [r["pairs_per_s"] for r in series], style, color=color, label=family)
            for r in series:
                ax.annotate(str(r["mini_batch"] or r["tokens"] or r["batch"]), (r["peak_allocated_gib"], r["pairs_per_s"]),
                            fontsize=7, textcoords="offset points", xytext=(3, 3))  # fmt: skip
        ax.set_title(f"{model} / {workload}")
        ax.set_xlabel("peak allocated GiB")
        ax.set_ylabel("pairs/s")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"plot: {path}"


def metadata(device: torch.device, args: argparse.Namespace) -> dict[str, Any]:
    """The run stamp (device, versions, date) and this run's command and settings."""
    meta: dict[str, Any] = {
        **run_stamp(device),
        "sentence_transformers": sentence_transformers_version(),
        "command": " ".join(sys.argv),
        "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
        "dtype": "bfloat16 autocast" if device.type == "cuda" else "float32",
        "args": vars(args),
    }
    if device.type == "cuda":
        meta["gpu_memory_gib"] = torch.cuda.get_device_properties(device).total_memory / GiB
    return meta


def write_outputs(out: Path, meta: dict, rows: list[dict]) -> list[dict]:
    targets = evaluate_targets(rows)
    out.mkdir(parents=True, exist_ok=True)
    (out / "real_workload.json").write_text(
        json.dumps({"meta": meta, "rows": rows, "targets": targets}, indent=1, default=str)
    )
    (out / "real_workload.md").write_text(markdown(meta, rows, targets))
    return targets


def finish(out: Path, meta: dict, rows: list[dict]) -> int:
    """Final outputs, tables and plot; exit status 1 when a configuration failed other than by OOM."""
    targets = write_outputs(out, meta, rows)
    show(TABLE_HEAD, table_rows(rows))
    print()
    show(TARGET_HEAD, target_rows(targets))
    print(plot(rows, out / "real_workload.png"), flush=True)
    return 1 if any(r["status"].startswith("error") for r in rows) else 0


def merge(paths: Sequence[Path], out: Path) -> int:
    """The rows of several runs (e.g. one device call per model or workload) in one table and plot."""
    payloads = [json.loads(Path(p).read_text()) for p in paths]
    devices = {p["meta"]["device"] for p in payloads}
    if len(devices) > 1:
        print(f"warning: merging runs from different devices {sorted(devices)}: ratios mix them", flush=True)
    meta = {**payloads[0]["meta"], "command": " ".join(sys.argv), "merged_from": [str(p) for p in paths]}
    meta["models"] = {k: v for p in payloads for k, v in p["meta"].get("models", {}).items()}
    return finish(out, meta, [row for p in payloads for row in p["rows"]])


def record(rows: list[dict], row: dict, out: Path, meta: dict, start: float) -> None:
    """Record one row, print it and rewrite the outputs (a run cut short keeps its rows)."""
    rows.append(row)
    shown = ", ".join(
        f"{k} {row[k]:.{p}f}" for k, p in (("pairs_per_s", 0), ("peak_allocated_gib", 2), ("busy_fraction", 2))
        if isinstance(row.get(k), float)
    )  # fmt: skip
    print(f"[{time.monotonic() - start:5.0f} s] {row['name']}: {row['status']} {shown}", flush=True)
    for site, count in list(row.get("sync_sites", {}).items())[:8]:
        print(f"    {count:6d} syncs at {site}", flush=True)
    write_outputs(out, meta, rows)
