"""Block-size sweep of the Sparton kernels at one shape (the measurements behind the constants in
gradcache_sparton/kernels/sparton_blocks.py; docs/kernels.md, "How the constants were chosen").

Legend: B batch, S sequence, D hidden, V vocabulary.

Times the forward launcher for each candidate ForwardBlocks (one-row kernel) and PackedForwardBlocks
(packed-rows kernel, only where S <= 256), the backward launcher for each candidate BackwardBlocks (and
DenseBackwardBlocks with --dense), and the backward's parts (grad_E alone and grad_H alone; grad_H on
the tensor cores for candidate tiles; the CSR layouts alone: grad_E's by column for candidate tiles
against the stable torch.sort it replaced, grad_H's by the sort of all keys and from the column
layout), and each backward candidate's peak memory above its inputs (whole backward, grad_E, grad_H),
with do_bench medians, bf16 random inputs; the last row ("best") names the fastest of each kind and
the fwd+bwd sums they give.

    export PYTHONPATH=$PWD:$PYTHONPATH
    python benchmarks/tune_head.py --out $OUT/tune.json
    # short queries, packed vs one-row forward, sparse vs dense backward, dense reps (~50% of Y > 0 at
    # S = 32 with bias -2.0) and trained-like sparsity (~2% with bias -3.2):
    python benchmarks/tune_head.py --shape 512,32,768,30522 --dense --bias-mean -2.0 --out $OUT/tune_q_dense.json
    python benchmarks/tune_head.py --shape 512,32,768,30522 --dense --bias-mean -3.2 --out $OUT/tune_q_sparse.json
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

import torch
import triton

from benchmarks.common import run_stamp
from gradcache_sparton.kernels.reference import sparton_head_backward_reference, sparton_head_reference
from gradcache_sparton.kernels.sparton_backward import (
    column_segments,
    row_segments,
    row_segments_from_columns,
    sparse_backward,
    sparton_backward,
)
from gradcache_sparton.kernels.sparton_backward_dense import grad_e_dense, grad_h_dense
from gradcache_sparton.kernels.sparton_blocks import (
    BackwardBlocks,
    DenseBackwardBlocks,
    ForwardBlocks,
    PackedForwardBlocks,
    default_backward_blocks,
    default_dense_backward_blocks,
)
from gradcache_sparton.kernels.sparton_forward import sparton_forward

# ForwardBlocks(block_s, block_v, block_d, group_b, num_warps, num_stages, tma, persistent); the product
# is [block_v, D] @ [D, block_s], so block_v is the MMA's M and block_s its N. The first is the committed
# 16-bit default (TMA loads, persistent grid); then the same tile with pointer loads, and other tiles.
FWD_CANDIDATES = [
    ForwardBlocks(256, 128, 64, 8, 8, 3, True, True),
    ForwardBlocks(256, 128, 64, 8, 8, 3, False, False),
    ForwardBlocks(256, 128, 64, 8, 8, 3, True, False),
    ForwardBlocks(256, 128, 64, 8, 8, 4, True, True),
    ForwardBlocks(256, 128, 64, 8, 8, 4, True, False),
    ForwardBlocks(128, 256, 64, 8, 8, 3, True, False),
    ForwardBlocks(128, 256, 64, 8, 8, 4, True, False),
    ForwardBlocks(128, 128, 64, 8, 8, 4, True, False),
    ForwardBlocks(128, 128, 64, 8, 8, 3, False, False),
    ForwardBlocks(128, 256, 64, 8, 8, 3, False, False),
    # short sequences (queries, S = 32) in the one-row kernel; 32 x 256, 8 warps, 3 stages was the
    # S <= 32 default before the packed kernel
    ForwardBlocks(32, 128, 64, 8, 4, 3, True, False),
    ForwardBlocks(32, 256, 64, 8, 8, 3, True, False),
    ForwardBlocks(64, 128, 64, 8, 4, 3, True, False),
    # PackedForwardBlocks(block_n, block_v, block_d, group_n, num_warps, num_stages, tma): G = block_n //
    # S_pad batch rows per product [block_v, D] @ [D, block_n] (S <= 64; at S = 32, 256 packs 8 rows). The
    # first is the committed default for 16-bit S <= 64.
    PackedForwardBlocks(128, 128, 64, 8, 4, 3, True),
    PackedForwardBlocks(128, 128, 64, 8, 4, 3, False),
    PackedForwardBlocks(128, 128, 64, 8, 4, 4, True),
    PackedForwardBlocks(256, 128, 64, 8, 8, 3, True),
    PackedForwardBlocks(256, 128, 64, 8, 8, 4, True),
    PackedForwardBlocks(128, 256, 64, 8, 8, 3, True),
    PackedForwardBlocks(256, 128, 64, 8, 8, 3, False),
    PackedForwardBlocks(128, 256, 64, 8, 8, 3, False),
]
# BackwardBlocks: the first is the committed default (by the density of Y: below 25% of Y non-zero
# grad_E by column and, at S <= short_s, grad_H's rows from the column layout; above it, at S <= short_s,
# both gradients on the tensor cores, else the gathering b loop and grad_H's rows by a sort of all B·V
# keys; under by_column_min_b rows the dense regime's). The others force one path (by_column_below 0: the
# dense regime's, 2 with by_column_min_b 1: the sparse regime's at any B;
# short_s 0: the longer sequences' kernels at any S) or change one kernel's tiles: grad_E by column
# (c_block_n non-zeros per step, c_block_d wide), the b loop (e_block_b rows per step; 1 was its fastest
# at B=128, S=512 and at B=512, S=32 on an H100, 2026-11-23). The dense regime's grad_H at short S takes
# the first DENSE_BWD_CANDIDATES' tiles; its candidates are timed alone below.
_DEFAULT = default_backward_blocks(torch.bfloat16)  # on a GPU: the committed 16-bit tiles
BWD_CANDIDATES = [
    _DEFAULT,
    replace(_DEFAULT, short_s=0),
    replace(_DEFAULT, by_column_below=0.0),
    replace(_DEFAULT, by_column_below=0.0, short_s=0),
    replace(_DEFAULT, by_column_below=0.0, short_s=0, e_block_v=32, e_block_d=64, h_block_n=64, h_block_d=64, h_num_warps=2),
    replace(_DEFAULT, by_column_below=2.0, by_column_min_b=1),
    replace(_DEFAULT, by_column_below=2.0, by_column_min_b=1, short_s=0),
    replace(_DEFAULT, by_column_below=2.0, by_column_min_b=1, c_block_n=16, c_block_d=128),
    replace(_DEFAULT, by_column_below=2.0, by_column_min_b=1, c_block_n=32, c_block_d=64),
]  # fmt: skip


def _path(blocks: BackwardBlocks) -> str:
    """Which kernels a candidate runs: "by-density" (the default rule) or the forced path."""
    regime = {0.0: "dense", 2.0: "sparse"}.get(blocks.by_column_below, "by-density")
    return regime if blocks.short_s else f"{regime}-long-s"


# DenseBackwardBlocks(e_block_v, e_block_k, e_block_d, e_num_warps, h_block_m, h_block_v, h_block_d,
# h_num_warps, h_num_stages): the tensor-core backward for short sequences with dense reps (--dense, both
# gradients); the first is the committed default. grad_E is [V, K] @ [K, D] (M = e_block_v, K = e_block_k
# positions: whole rows, e_block_k // S_pad of them, where S fits), grad_H [M, V] @ [V, D] (M = h_block_m
# positions, whole rows likewise, K = h_block_v). At S = 32, e_block_k / h_block_m = 32 is one row per
# product (as before rows were packed), 64 two, 128 four. (K = 128 for grad_E, or 4 warps at K = 64 x
# N = 64, spill registers when compiled for sm_90: left out.)
DENSE_BWD_CANDIDATES = [
    default_dense_backward_blocks(),  # on a GPU: the committed tiles
    DenseBackwardBlocks(128, 64, 128, 8, 128, 64, 128, 8, 3),
    DenseBackwardBlocks(128, 32, 128, 8, 32, 64, 128, 4, 3),
    DenseBackwardBlocks(128, 32, 64, 4, 32, 64, 64, 4, 3),
    DenseBackwardBlocks(64, 32, 128, 4, 32, 128, 128, 8, 3),
    DenseBackwardBlocks(256, 32, 64, 8, 64, 64, 128, 8, 3),
    DenseBackwardBlocks(64, 64, 128, 4, 128, 64, 64, 4, 3),
    DenseBackwardBlocks(128, 32, 128, 8, 256, 32, 128, 8, 3),
]
# grad_H on the tensor cores alone (the default backward's dense regime at S <= short_s), tiles over the
# committed default's: (h_block_m, h_block_v, h_block_d, h_num_warps, h_num_stages).
DENSE_GRAD_H_TILES = [
    (128, 64, 256, 8, 3),
    (128, 64, 256, 8, 4),
    (128, 32, 256, 8, 3),
    (128, 32, 256, 8, 4),
    (128, 128, 256, 8, 3),
    (64, 64, 256, 4, 3),
    (64, 32, 256, 4, 3),
    (256, 32, 256, 8, 3),
    (128, 64, 256, 4, 3),
    (128, 32, 128, 4, 3),
    (128, 64, 128, 4, 3),
    (64, 64, 128, 4, 3),
]

# The column layout's tiles (block_b, block_v); the first is the committed default.
COLUMN_LAYOUT_CANDIDATES = [(32, 32), (32, 64), (16, 128), (64, 32), (32, 128), (128, 32), (8, 32), (16, 64)]


def _peak_mib(fn) -> float:
    """MiB allocated by one call of ``fn`` above what was allocated before it (its temporaries and
    outputs): torch.cuda.max_memory_allocated over the call."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**20


def _best(rows: list[dict]) -> dict:
    """The fastest correct candidate of each kind, and fwd + bwd with the best forward."""
    best = {}
    for row in rows:
        if "ms" in row and "blocks" in row and row.get("ok", False):
            key = f"{row['kind']}_{row['kernel']}" if "kernel" in row else row["kind"]
            if key not in best or row["ms"] < best[key]["ms"]:
                best[key] = {"ms": row["ms"], "blocks": row["blocks"]}
    fwd = min((v["ms"] for k, v in best.items() if k.startswith("fwd")), default=None)
    sums = {f"fwd+{k}_ms": fwd + v["ms"] for k, v in best.items() if fwd is not None and k.startswith("bwd")}
    return {"kind": "best", **best, **sums}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="128,512,768,30522", help="B,S,D,V")
    parser.add_argument("--skip-fwd", action="store_true")
    parser.add_argument("--bias-mean", type=float, default=-2.9, help="shifts the density of Y")
    parser.add_argument("--dense", action="store_true", help="also time the dense (tensor-core) backward")
    parser.add_argument("--out")
    args = parser.parse_args()
    B, S, D, V = map(int, args.shape.split(","))
    torch.manual_seed(0)
    h = torch.randn(B, S, D, device="cuda", dtype=torch.bfloat16)
    e = (torch.randn(V, D, device="cuda") / D**0.5).to(torch.bfloat16)
    # bias around -2.9 puts the median max over 512 positions of N(0, 1) logits at 0: about half of Y > 0
    bias = (args.bias_mean + 0.1 * torch.randn(V, device="cuda")).to(torch.bfloat16)
    mask = torch.ones(B, S, device="cuda", dtype=torch.long)
    g = torch.randn(B, V, device="cuda", dtype=torch.bfloat16)
    flop = 2 * B * S * D * V
    bench = lambda fn: triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    rows = []
    # every candidate is checked against the PyTorch reference (forward) and the PyTorch backward from
    # the same (max, argmax), not against another kernel
    ref = sparton_head_reference(h, e, bias, mask, return_argmax=True)
    # the packed kernel holds whole rows in one tile: timed up to S_pad = 256 (the default: S <= 64)
    packs = triton.next_power_of_2(S) <= 256
    fwd_candidates = [b for b in FWD_CANDIDATES if packs or not isinstance(b, PackedForwardBlocks)]
    for blk in [] if args.skip_fwd else fwd_candidates:
        kernel = "packed" if isinstance(blk, PackedForwardBlocks) else "one-row"
        try:
            out = sparton_forward(h, e, bias, mask, blocks=blk)
            same = torch.equal(out[1], ref[1]) or torch.allclose(out[1], ref[1], rtol=1e-5, atol=1e-4)
            # where the max is > 0 (elsewhere the kernel writes 0); near-ties may differ (~1e-6)
            arg_agree = ((out[2].long() == ref[2]) | (ref[1] <= 0)).float().mean().item()
            ms = bench(lambda blk=blk: sparton_forward(h, e, bias, mask, blocks=blk))
            row = {"kind": "fwd", "kernel": kernel, "blocks": blk.__dict__, "ms": ms}
            rows.append({**row, "tflops": flop / ms / 1e9, "ok": same, "arg_agree": arg_agree})
        except Exception as exc:  # a config that does not compile (shared memory) is reported, not fatal
            rows.append({"kind": "fwd", "kernel": kernel, "blocks": blk.__dict__, "error": repr(exc)[:200]})
        print(rows[-1], flush=True)
    _, mx, arg = sparton_forward(h, e, bias, mask)
    rows.append({"kind": "nonzero_frac", "value": (mx > 0).float().mean().item()})
    print(rows[-1])
    want = sparton_head_backward_reference(g, h, e, mx, arg)
    coef = torch.where(mx > 0, g.float() / (1.0 + mx), 0.0)
    arg32 = arg.to(torch.int32)
    for blk in BWD_CANDIDATES:
        try:
            got = sparton_backward(g, h, e, mx, arg, blocks=blk)
            pairs = zip(got, want, strict=True)
            same = all(torch.allclose(a.float(), b.float(), rtol=1e-2, atol=1e-3) for a, b in pairs)
            ms = bench(lambda blk=blk: sparton_backward(g, h, e, mx, arg, blocks=blk))
            # each gradient alone: its share of the count of non-zeros and of the column layout included
            grad_e_only = lambda blk=blk: sparse_backward(h, e, coef, arg32, (False, True), blk)
            grad_h_only = lambda blk=blk: sparse_backward(h, e, coef, arg32, (True, False), blk)
            row = {
                "kind": "bwd",
                "kernel": _path(blk),
                "blocks": blk.__dict__,
                "ms": ms,
                "grad_e_ms": bench(grad_e_only),
                "grad_h_ms": bench(grad_h_only),
                "peak_mib": _peak_mib(lambda blk=blk: sparton_backward(g, h, e, mx, arg, blocks=blk)),
                "grad_e_peak_mib": _peak_mib(grad_e_only),
                "grad_h_peak_mib": _peak_mib(grad_h_only),
            }
            rows.append({**row, "ok": same})
        except Exception as exc:
            rows.append({"kind": "bwd", "blocks": blk.__dict__, "error": repr(exc)[:200]})
        print(rows[-1], flush=True)
    for blk in DENSE_BWD_CANDIDATES if args.dense else []:
        try:
            got = sparton_backward(g, h, e, mx, arg, dense=True, blocks=blk)
            pairs = zip(got, want, strict=True)
            same = all(torch.allclose(a.float(), b.float(), rtol=1e-2, atol=1e-3) for a, b in pairs)
            ms = bench(lambda blk=blk: sparton_backward(g, h, e, mx, arg, dense=True, blocks=blk))
            ms_e = bench(lambda blk=blk: grad_e_dense(h, coef, arg32, V, e.dtype, blk))
            ms_h = bench(lambda blk=blk: grad_h_dense(e, coef, arg32, S, h.dtype, blk))
            row = {
                "kind": "bwd_dense",
                "blocks": blk.__dict__,
                "ms": ms,
                "grad_e_ms": ms_e,
                "grad_h_ms": ms_h,
            }
            rows.append({**row, "tflops": 2 * flop / ms / 1e9, "ok": same})
        except Exception as exc:
            rows.append({"kind": "bwd_dense", "blocks": blk.__dict__, "error": repr(exc)[:200]})
        print(rows[-1], flush=True)
    for m_rows, k_vocab, n_hidden, warps, stages in DENSE_GRAD_H_TILES:
        tiles = dict(
            h_block_m=m_rows, h_block_v=k_vocab, h_block_d=n_hidden, h_num_warps=warps, h_num_stages=stages
        )
        blk = replace(DENSE_BWD_CANDIDATES[0], **tiles)
        try:
            got = grad_h_dense(e, coef, arg32, S, h.dtype, blk)
            same = torch.allclose(got.float(), want[0].float(), rtol=1e-2, atol=1e-3)
            ms = bench(lambda blk=blk: grad_h_dense(e, coef, arg32, S, h.dtype, blk))
            rows.append(
                {
                    "kind": "grad_h_dense",
                    "blocks": blk.__dict__,
                    "ms": ms,
                    "tflops": 2 * flop / ms / 1e9,
                    "ok": same,
                }
            )
        except Exception as exc:
            rows.append({"kind": "grad_h_dense", "blocks": blk.__dict__, "error": repr(exc)[:200]})
        print(rows[-1], flush=True)
    # The CSR layouts alone: grad_E's by column (a counting sort) for candidate tiles, checked equal to
    # the stable argsort of its keys, against that sort's time (int16 keys where they fit, as it ran
    # before); grad_H's by row (itself a stable torch.sort).
    live = torch.count_nonzero(coef)
    n = int(live)
    key_dtype = torch.int16 if V < 2**15 else torch.int32
    keys = torch.where(coef != 0, torch.arange(V, device="cuda")[None, :], V).to(key_dtype).reshape(-1)
    sorted_keys, want = torch.sort(keys, stable=True)
    offsets = torch.searchsorted(sorted_keys, torch.arange(V + 1, device="cuda", dtype=key_dtype))
    rows.append({"kind": "layout_column_torch_sort", "ms": bench(lambda: torch.sort(keys, stable=True))})
    print(rows[-1])
    for tiles in COLUMN_LAYOUT_CANDIDATES:
        order, got = column_segments(coef, live, B * V + 1, *tiles)
        same = torch.equal(order[:n].long(), want[:n]) and torch.equal(got, offsets)
        ms = bench(lambda tiles=tiles: column_segments(coef, live, B * V + 1, *tiles))
        rows.append({"kind": "layout_column", "blocks": list(tiles), "ms": ms, "ok": same})
        print(rows[-1], flush=True)
    rows.append({"kind": "layout_row_torch_sort", "ms": bench(lambda: row_segments(coef, arg32, S))})
    print(rows[-1])
    # grad_H's rows from the column layout (short S, sparse regime): its first limit slots sorted by row
    limit = min(int(_DEFAULT.by_column_below * B * V), B * V + 1)
    order, _ = column_segments(coef, live, limit)
    got_rows = row_segments_from_columns(order, arg32, S, live, limit)
    want_rows = row_segments(coef, arg32, S)
    same = torch.equal(got_rows[0][:n].long(), want_rows[0][:n]) and torch.equal(got_rows[1], want_rows[1])
    ms = bench(lambda: row_segments_from_columns(order, arg32, S, live, limit))
    rows.append({"kind": "layout_row_from_columns", "ms": ms, "ok": same or n >= limit})
    print(rows[-1])
    rows.append(_best(rows))
    print(rows[-1])
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"shape": [B, S, D, V], **run_stamp(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
