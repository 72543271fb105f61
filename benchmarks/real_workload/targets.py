"""Issue 15's targets, computed within each (model, workload) as ratios between the rows of one run."""

from __future__ import annotations

from benchmarks.real_workload.configs import variant_name

__all__ = ["MEMORY_BUDGETS_GIB", "evaluate_targets"]

MEMORY_BUDGETS_GIB = (4.0, 8.0, None)  # issue 15's budgets; None: unlimited
# Issue 15's thresholds (ratios within one run).
SPEEDUP_MIN, SMALL_BUDGET_MIN, CACHED_VS_UNCACHED_MIN = 2.0, 0.85, 0.72


def _best(rows: list[dict], limit_gib: float | None) -> dict | None:
    fits = [
        r
        for r in rows
        if r["status"] == "ok" and (limit_gib is None or r.get("peak_allocated_gib", 0) <= limit_gib)
    ]
    return max(fits, key=lambda r: r["pairs_per_s"]) if fits else None


def _target(
    group: str, target: str, value: float | None, threshold: str, passed: bool | None, detail: str
) -> dict:
    status = "n/a" if passed is None else ("PASS" if passed else "MISS")
    return {
        "group": group,
        "target": target,
        "value": value,
        "threshold": threshold,
        "status": status,
        "detail": detail,
    }


def _label(row: dict | None) -> str:
    if row is None:
        return "none fits"
    peak = row.get("peak_allocated_gib")
    memory = f", {peak:.1f} GiB" if peak is not None else ""
    return (
        f"{variant_name(row)}{'-mb' + str(row['mini_batch']) if row['mini_batch'] else ''}"
        + (f"-tok{row['tokens']}" if row["tokens"] else "")
        + f" {row['pairs_per_s']:.0f} pairs/s{memory}"
    )


def evaluate_targets(rows: list[dict]) -> list[dict]:
    """Issue 15's targets per (model, workload), as ratios between rows of this run."""
    targets = []
    for group in dict.fromkeys(f"{r['model']}/{r['workload']}" for r in rows):
        mine = [r for r in rows if f"{r['model']}/{r['workload']}" == group]
        ours = [r for r in mine if r["provider"] == "ours"]
        theirs = [r for r in mine if r["provider"] == "st"]
        for limit in MEMORY_BUDGETS_GIB:
            name = f"ours vs sentence-transformers at {'unlimited memory' if limit is None else f'<= {limit:g} GiB'}"
            a, b = _best(ours, limit), _best(theirs, limit)
            if a is None or b is None:
                targets.append(
                    _target(group, name, None, f">= {SPEEDUP_MIN}x", None, f"{_label(a)} vs {_label(b)}")
                )
                continue
            ratio = a["pairs_per_s"] / b["pairs_per_s"]
            targets.append(
                _target(
                    group,
                    name,
                    ratio,
                    f">= {SPEEDUP_MIN}x",
                    ratio >= SPEEDUP_MIN,
                    f"{_label(a)} vs {_label(b)}",
                )
            )
        small, large = _best(ours, MEMORY_BUDGETS_GIB[0]), _best(ours, MEMORY_BUDGETS_GIB[1])
        name = "ours at 4 GiB / ours at 8 GiB"
        if small and large:
            ratio = small["pairs_per_s"] / large["pairs_per_s"]
            targets.append(
                _target(group, name, ratio, f">= {SMALL_BUDGET_MIN}", ratio >= SMALL_BUDGET_MIN, "")
            )
        else:
            targets.append(_target(group, name, None, f">= {SMALL_BUDGET_MIN}", None, "missing rows"))
        cached, uncached = (
            _best(ours, None),
            _best([r for r in mine if r["provider"] == "ours-uncached"], None),
        )
        name = "ours cached / ours uncached"
        if cached and uncached:
            ratio = cached["pairs_per_s"] / uncached["pairs_per_s"]
            detail = (
                f"{_label(cached)} vs uncached b{uncached['batch']} {uncached['pairs_per_s']:.0f} pairs/s"
            )
            targets.append(
                _target(
                    group,
                    name,
                    ratio,
                    f">= {CACHED_VS_UNCACHED_MIN}",
                    ratio >= CACHED_VS_UNCACHED_MIN,
                    detail,
                )
            )
        else:
            targets.append(_target(group, name, None, f">= {CACHED_VS_UNCACHED_MIN}", None, "missing rows"))
    return targets
