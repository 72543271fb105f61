"""Benchmark of the SPLADE head: plain PyTorch (eager, torch.compile), the chunked reference and Sparton.

Legend: B batch, S sequence, D hidden, V vocabulary.

Providers, timed in one process on one GPU:
  eager     the head as usually written (gradcache_sparton.kernels.splade_head_materialized):
            logits = F.linear(H, E, bias) materialised as [B, S, V], masked, log1p(relu(.)), max over S;
  compile   the same function under torch.compile (inductor fuses the epilogue; logits still exist);
  reference gradcache_sparton.kernels.sparton_head_reference (vocabulary-chunked, fp32 matmuls);
  sparton   gradcache_sparton.kernels.SpartonHead (fused Triton forward, sparse backward);
  sparton-dense  the same forward with the dense backward (sparton_backward(dense=True): one-hot
            tiles through tensor cores, meant for short sequences with dense reps); only on request;
  cublas    a bf16 8192^3 torch.matmul: the tensor-core rate the forward's FLOPs are compared with.

For every shape: Sparton's output is checked against eager before any timing (same Y to one bf16 ulp),
then forward and forward+backward (gradients for H, E and bias) are timed with triton.testing.do_bench
(CUDA events, warm-up, median), and the peak memory above the inputs is read from
torch.cuda.max_memory_allocated. A provider that runs out of memory is reported as "OOM".
Inputs are random with an all-ones bool mask (as the encoder passes it); the bias mean (--bias-mean) sets how much of Y is positive:
about half by default, unlike a trained SPLADE model's >99% zeros, so the sparse backward does far more
work here than in training. Each row records the measured fraction.

Run on the GPU machine from the repository root (prints a table, writes JSON):

    export PYTHONPATH=$PWD:$PYTHONPATH
    python benchmarks/bench_head.py --out $OUT/head.json                 # standard shape only
    python benchmarks/bench_head.py --sweep batch,seq,vocab --out $OUT/head_sweeps.json
    # short sequences, with the dense backward, dense reps and trained-like sparsity (~2% of Y > 0):
    python benchmarks/bench_head.py --no-standard --sweep short \\
        --providers eager,compile,sparton,sparton-dense --bias-mean -2.0 --out $OUT/head_short_dense.json
    python benchmarks/bench_head.py --no-standard --sweep short \\
        --providers eager,compile,sparton,sparton-dense --bias-mean -3.2 --out $OUT/head_short_sparse.json
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from collections.abc import Callable

import torch
import triton
from torch import Tensor

from benchmarks.common import run_stamp
from gradcache_sparton.kernels import sparton_head, sparton_head_reference, splade_head_materialized
from gradcache_sparton.kernels.sparton_backward import sparton_backward
from gradcache_sparton.kernels.sparton_forward import sparton_forward

STANDARD = (128, 512, 768, 30522)  # (B, S, D, V): BERT-base vocabulary, a 512-token batch of 128
SWEEPS = {
    "batch": [(b, 512, 768, 30522) for b in (32, 64, 256, 512)],
    "seq": [(128, s, 768, 30522) for s in (1024, 2048, 4096, 8192)],
    "vocab": [(64, 512, 768, v) for v in (50265, 128256, 250002)],  # RoBERTa, Llama-3, XLM-R
    "short": [(512, 32, 768, 30522), (128, 32, 768, 30522), (512, 64, 768, 30522)],  # queries (issue 15)
}
PROVIDERS = ("eager", "compile", "reference", "sparton")
EXTRA_PROVIDERS = ("sparton-dense",)  # only when named in --providers


head_compiled = torch.compile(splade_head_materialized, dynamic=False)


class _DenseBackwardHead(torch.autograd.Function):
    """Sparton's forward with the dense (tensor-core, one-hot tile) backward: provider "sparton-dense"."""

    @staticmethod
    def forward(ctx, h: Tensor, e: Tensor, bias: Tensor, mask: Tensor) -> Tensor:
        y, mx, arg = sparton_forward(h, e, bias, mask)
        ctx.save_for_backward(h, e, mx, arg)
        ctx.bias_dtype = bias.dtype
        return y

    @staticmethod
    def backward(ctx, grad_y: Tensor) -> tuple[Tensor, Tensor, Tensor, None]:
        h, e, mx, arg = ctx.saved_tensors
        grad_h, grad_e, grad_bias = sparton_backward(grad_y, h, e, mx, arg, dense=True)
        return grad_h, grad_e, grad_bias.to(ctx.bias_dtype), None


def _provider(name: str) -> Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]:
    return {
        "eager": splade_head_materialized,
        "compile": head_compiled,
        "reference": sparton_head_reference,
        "sparton": sparton_head,
        "sparton-dense": _DenseBackwardHead.apply,
    }[name]


def _time(fn: Callable[[], object]) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def _measure(name: str, h: Tensor, e: Tensor, bias: Tensor, mask: Tensor, g: Tensor) -> dict:
    f = _provider(name)
    params = [t.detach().requires_grad_() for t in (h, e, bias)]

    def fwd() -> Tensor:
        with torch.no_grad():
            return f(h, e, bias, mask)

    def fwd_bwd() -> None:
        y = f(*params, mask)
        torch.autograd.backward(y, g, inputs=params)
        for p in params:
            p.grad = None

    out: dict = {}
    try:
        fwd_bwd()  # warm-up / compilation outside the memory and time measurements
        torch.cuda.synchronize()
        out["fwd_ms"] = _time(fwd)
        out["fwd_bwd_ms"] = _time(fwd_bwd)
        for key, fn in (("fwd_peak_mib", fwd), ("fwd_bwd_peak_mib", fwd_bwd)):
            gc.collect()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            fn()
            torch.cuda.synchronize()
            out[key] = (torch.cuda.max_memory_allocated() - base) / 2**20
    except Exception as exc:  # OOM, also when inductor hits it while compiling (BackendCompilerFailed)
        if not isinstance(exc, torch.OutOfMemoryError) and "out of memory" not in str(exc):
            raise
        out = {"fwd_ms": "OOM", "fwd_bwd_ms": "OOM", "fwd_peak_mib": "OOM", "fwd_bwd_peak_mib": "OOM"}
    finally:
        for p in params:
            p.grad = None
        gc.collect()
        torch.cuda.empty_cache()
    return out


def cublas_tflops() -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = _time(lambda: a @ b)
    return 2 * 8192**3 / ms / 1e9


def bench_shape(B: int, S: int, D: int, V: int, providers: list[str], bias_mean: float) -> dict:
    torch.manual_seed(0)
    torch._dynamo.reset()  # one fresh compile per shape (no silent eager fallback past the recompile limit)
    dev = "cuda"
    h = torch.randn(B, S, D, device=dev, dtype=torch.bfloat16)
    e = (torch.randn(V, D, device=dev) / D**0.5).to(torch.bfloat16)
    bias = (bias_mean + 0.1 * torch.randn(V, device=dev)).to(torch.bfloat16)
    mask = torch.ones(B, S, device=dev, dtype=torch.bool)  # as the encoder passes it: no 0/1 check, no sync
    g = torch.randn(B, V, device=dev, dtype=torch.bfloat16)
    row: dict = {"B": B, "S": S, "D": D, "V": V, "dtype": "bfloat16", "gflop_fwd": 2 * B * S * D * V / 1e9}
    # Correctness first: Sparton against the eager head (eager rounds logits to bf16 before the max, so
    # it sits up to one bf16 ulp of the logit away from Sparton's fp32 max; compare at 2 ulps).
    try:
        with torch.no_grad():
            want = splade_head_materialized(h, e, bias, mask).float()
            got = sparton_head(h, e, bias, mask).float()
        row["check_max_abs_diff_vs_eager"] = (got - want).abs().max().item()
        row["y_nonzero_frac"] = (got > 0).float().mean().item()
        row["check_ok"] = bool(torch.allclose(got, want, rtol=2 * 2.0**-7, atol=1e-2))
        del want, got
    except torch.OutOfMemoryError:
        row["check_max_abs_diff_vs_eager"] = "eager OOM"
        with torch.no_grad():
            want = sparton_head_reference(h, e, bias, mask).float()
            got = sparton_head(h, e, bias, mask).float()
        row["check_ok"] = bool(torch.allclose(got, want, rtol=2.0**-7, atol=1e-4))
        row["y_nonzero_frac"] = (got > 0).float().mean().item()
        del want, got
    torch.cuda.empty_cache()
    for name in providers:
        row[name] = _measure(name, h, e, bias, mask, g)
        print(f"  {B=} {S=} {V=} {name}: {row[name]}", flush=True)
    return row


def _fmt(x: object) -> str:
    return f"{x:.2f}" if isinstance(x, float) else str(x)


def print_table(rows: list[dict], providers: list[str], tc_tflops: float) -> None:
    print(f"\ncuBLAS bf16 8192^3: {tc_tflops:.0f} TFLOP/s")
    head = ["B", "S", "V", "provider", "fwd ms", "fwd+bwd ms", "fwd MiB", "fwd+bwd MiB", "fwd TFLOP/s"]
    print(" | ".join(head))
    for r in rows:
        for name in providers:
            m = r[name]
            tf = r["gflop_fwd"] / m["fwd_ms"] if isinstance(m["fwd_ms"], float) else "-"
            cells = [r["B"], r["S"], r["V"], name, m["fwd_ms"], m["fwd_bwd_ms"], m["fwd_peak_mib"]]
            cells += [m["fwd_bwd_peak_mib"], tf]
            print(" | ".join(_fmt(c) for c in cells))
        s = r.get("sparton", {})
        for base in ("compile", "eager"):
            b = r.get(base, {})
            if isinstance(s.get("fwd_bwd_ms"), float) and isinstance(b.get("fwd_bwd_ms"), float):
                print(
                    f"  sparton vs {base}: fwd {b['fwd_ms'] / s['fwd_ms']:.1f}x, "
                    f"fwd+bwd {b['fwd_bwd_ms'] / s['fwd_bwd_ms']:.1f}x"
                )
        if isinstance(s.get("fwd_ms"), float):
            print(f"  sparton forward = {r['gflop_fwd'] / s['fwd_ms'] / tc_tflops:.0%} of the cuBLAS rate")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--sweep", default="", help="comma list among batch, seq, vocab, short (default: none)"
    )
    parser.add_argument("--no-standard", action="store_true", help="skip the standard shape")
    parser.add_argument("--shape", action="append", default=[], help="extra B,S,D,V shape (repeatable)")
    parser.add_argument("--providers", default=",".join(PROVIDERS), help="comma list of providers")
    parser.add_argument(
        "--bias-mean",
        type=float,
        default=-2.9,
        help="mean of the random bias; logits are ~N(0, 1), and -2.9 puts the median max over 512 "
        "positions at 0, so about half of Y is positive (0 gives a nearly dense Y, the backward's worst case)",
    )
    parser.add_argument("--out", help="write rows and metadata as JSON here")
    args = parser.parse_args()
    providers = [p for p in args.providers.split(",") if p]
    shapes = [] if args.no_standard else [STANDARD]
    for name in filter(None, args.sweep.split(",")):
        shapes += SWEEPS[name]
    shapes += [tuple(map(int, x.split(","))) for x in args.shape]
    tc = cublas_tflops()
    rows = []
    meta = {
        **run_stamp(),
        "cublas_bf16_8192_tflops": tc,
        "command": " ".join(sys.argv),
    }
    for B, S, D, V in shapes:
        rows.append(bench_shape(B, S, D, V, providers, args.bias_mean))
        if args.out:  # rewritten after every shape, so a run cut short still leaves its rows
            with open(args.out, "w") as f:
                json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print_table(rows, providers, tc)
    return 0 if all(r["check_ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
