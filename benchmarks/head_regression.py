"""Head regression check: Sparton's forward and forward+backward at every shape of a standard set, against
a recorded baseline (or another tree measured in the same call), failing where one is over 3% slower.

Legend: B batch, S sequence, D hidden, V vocabulary.

The standard set (bf16, all-ones bool mask, as the encoder passes it): documents (B 32 / 128 at S 256, B 64 / 128 at S 512), queries
(B 128 / 512 at S 32, B 512 at S 64), at D 768 and V 30,522, and one LLM shape (B 16, S 512, D 2,048,
V 128,256); each at two densities of Y set by the random bias's mean: ``sparse`` (-3.2, a few percent of
Y > 0, as a trained SPLADE model's reps) and ``dense`` (-2.9, about half, as a random-init head's). Each
row records the measured fraction. Times are ``triton.testing.do_bench`` medians (CUDA events, warm-up),
the public ``sparton_head`` with gradients for H, E and bias, the same inputs for every tree (seeded).

Usage, on the GPU machine from the repository root:

    export PYTHONPATH=$PWD:$PYTHONPATH
    python benchmarks/head_regression.py --out $OUT/head.json                      # measure this tree
    python benchmarks/head_regression.py --out $OUT/head.json \\
        --baseline benchmarks/results/head_baseline.json                          # and check it

A kernel change is compared with the commit before it in one call: measure each tree in its own process,
alternating (A B A B), then compare the fastest of each tree's runs, row by row:

    git archive HEAD~1 gradcache_sparton | tar -x -C /tmp/before   # (on the GPU machine: carry a copy)
    for i in 1 2; do
      PYTHONPATH=/tmp/before python benchmarks/head_regression.py --out $OUT/before_$i.json
      PYTHONPATH=$PWD python benchmarks/head_regression.py --out $OUT/after_$i.json
    done
    python benchmarks/head_regression.py --compare $OUT/before_1.json $OUT/before_2.json \\
        --to $OUT/after_1.json $OUT/after_2.json

A baseline is only compared on the device it was recorded on (its ``meta.device``); elsewhere the check
says so and passes nothing. Exit status 1 when a row is over ``--tolerance`` (3%) slower or a check of
Sparton's output against the chunked reference fails.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

TOLERANCE = 0.03  # the bar: no shape more than 3% slower than the recorded baseline
SHAPES = (  # (B, S, D, V)
    (32, 256, 768, 30522),
    (128, 256, 768, 30522),
    (64, 512, 768, 30522),
    (128, 512, 768, 30522),
    (128, 32, 768, 30522),
    (512, 32, 768, 30522),
    (512, 64, 768, 30522),
    (16, 512, 2048, 128256),
)
BIAS_MEANS = {"sparse": -3.2, "dense": -2.9}


def row_key(row: dict) -> str:
    return f"B{row['B']} S{row['S']} D{row['D']} V{row['V']} {row['density']}"


def measure(shape: tuple[int, int, int, int], density: str) -> dict:
    """One row: Sparton's forward and forward+backward medians (ms) at this shape and density."""
    import triton

    from gradcache_sparton.kernels import sparton_head, sparton_head_reference

    B, S, D, V = shape
    generator = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(B, S, D, device="cuda", generator=generator).to(torch.bfloat16)
    e = (torch.randn(V, D, device="cuda", generator=generator) / D**0.5).to(torch.bfloat16)
    bias = BIAS_MEANS[density] + 0.1 * torch.randn(V, device="cuda", generator=generator)
    bias = bias.to(torch.bfloat16)
    # bool, as SpladeEncoder passes it: an integer mask costs the head a 0/1 value check, a device sync per
    # call, which would time the host's launch latency after each sync instead of the kernels' work
    mask = torch.ones(B, S, device="cuda", dtype=torch.bool)
    grad_y = torch.randn(B, V, device="cuda", generator=generator).to(torch.bfloat16)
    with torch.no_grad():
        y = sparton_head(h, e, bias, mask).float()
        # The reference takes fp32 products; Sparton accumulates bf16 products in fp32: equal to fp32
        # rounding of D-term sums, far inside one bf16 ulp of Y (2^-8 relative) that the check allows.
        want = sparton_head_reference(h, e, bias, mask).float()
    row = {"B": B, "S": S, "D": D, "V": V, "density": density}
    row["y_nonzero_frac"] = float((y > 0).float().mean())
    row["check_ok"] = bool(torch.allclose(y, want, rtol=2.0**-7, atol=1e-3))
    del y, want
    params = [t.detach().requires_grad_() for t in (h, e, bias)]

    def forward() -> None:
        with torch.no_grad():
            sparton_head(h, e, bias, mask)

    def forward_backward() -> None:
        y = sparton_head(*params, mask)
        torch.autograd.backward(y, grad_y, inputs=params)
        for p in params:
            p.grad = None

    forward_backward()  # compilation outside the timings
    row["fwd_ms"] = triton.testing.do_bench(forward, warmup=50, rep=300, return_mode="median")
    row["fwd_bwd_ms"] = triton.testing.do_bench(forward_backward, warmup=50, rep=300, return_mode="median")
    print(f"{row_key(row)}: fwd {row['fwd_ms']:.3f} ms, fwd+bwd {row['fwd_bwd_ms']:.3f} ms, "
          f"{row['y_nonzero_frac']:.1%} of Y > 0, check {'ok' if row['check_ok'] else 'FAILED'}", flush=True)  # fmt: skip
    torch.cuda.empty_cache()
    return row


def _fastest(files: Sequence[Path]) -> tuple[dict, dict[str, dict]]:
    """Each row's fastest forward and forward+backward over several runs of one tree (one device)."""
    reports = [json.loads(Path(f).read_text()) for f in files]
    devices = {report["meta"]["device"] for report in reports}
    if len(devices) != 1:
        raise ValueError(f"runs from several devices cannot be combined: {sorted(devices)}")
    rows: dict[str, dict] = {}
    for report in reports:
        for row in report["rows"]:
            best = rows.setdefault(row_key(row), dict(row))
            for key in ("fwd_ms", "fwd_bwd_ms"):
                best[key] = min(best[key], row[key])
            best["check_ok"] = best["check_ok"] and row["check_ok"]
    return reports[0]["meta"], rows


def compare(before: dict[str, dict], after: dict[str, dict], tolerance: float) -> tuple[list[str], bool]:
    """A table line per shared row (after / before per timing) and whether no timing is over tolerance."""
    lines = ["| shape | fwd before -> after (ms) | fwd+bwd before -> after (ms) | Y > 0 | verdict |"]
    lines.append("|---|---|---|---|---|")
    passed = True
    for key, old in before.items():
        new = after.get(key)
        if new is None:
            continue
        ratios = [new[t] / old[t] for t in ("fwd_ms", "fwd_bwd_ms")]
        ok = all(r <= 1 + tolerance for r in ratios) and new["check_ok"]
        passed = passed and ok
        lines.append(
            f"| {key} | {old['fwd_ms']:.3f} -> {new['fwd_ms']:.3f} ({ratios[0]:.3f}x) | {old['fwd_bwd_ms']:.3f}"
            f" -> {new['fwd_bwd_ms']:.3f} ({ratios[1]:.3f}x) | {new['y_nonzero_frac']:.1%} | "
            f"{'ok' if ok else 'SLOWER' if new['check_ok'] else 'CHECK FAILED'} |"
        )
    return lines, passed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="measure this tree's head at the standard set; JSON here")
    parser.add_argument("--baseline", type=Path, help="a recorded run to check this one against")
    parser.add_argument(
        "--compare", type=Path, nargs="+", help="runs of the tree before (fastest of each row)"
    )
    parser.add_argument("--to", type=Path, nargs="+", help="with --compare: runs of the tree after")
    parser.add_argument("--tolerance", type=float, default=TOLERANCE, help="allowed slowdown (0.03: 3%%)")
    args = parser.parse_args()
    if args.compare:
        if not args.to:
            parser.error("--compare needs --to")
        meta, before = _fastest(args.compare)
        meta_after, after = _fastest(args.to)
        if meta["device"] != meta_after["device"]:
            parser.error(f"--compare ran on {meta['device']}, --to on {meta_after['device']}")
        lines, passed = compare(before, after, args.tolerance)
        print("\n".join(lines) + f"\n{meta['device']}: {'PASS' if passed else 'FAIL'}")
        return 0 if passed else 1
    if args.out is None:
        parser.error("give --out (measure) or --compare ... --to ...")
    from benchmarks.common import run_stamp

    meta = {**run_stamp(), "command": " ".join(sys.argv)}
    rows = [measure(shape, density) for shape in SHAPES for density in BIAS_MEANS]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    passed = all(row["check_ok"] for row in rows)
    if args.baseline:
        recorded = json.loads(args.baseline.read_text())
        if recorded["meta"]["device"] != meta["device"]:
            print(
                f"baseline recorded on {recorded['meta']['device']}, this is {meta['device']}: not compared"
            )
        else:
            _, before = _fastest([args.baseline])
            lines, within = compare(before, {row_key(r): r for r in rows}, args.tolerance)
            print("\n".join(lines))
            passed = passed and within
    print("PASS" if passed else "FAIL")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
