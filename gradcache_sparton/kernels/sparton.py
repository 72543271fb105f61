"""Triton kernels of the Sparton SPLADE head: fused forward (max/argmax over S) and sparse backward.

Legend: B batch, S sequence, D hidden, V vocabulary, N non-zeros of Y (at most B·V).

Layout of this file (Liger order): block-size constants with their reasons -> ``@triton.jit`` kernels ->
launchers (validate nothing, allocate, pick blocks and grid, launch). Input validation, autograd and
the CPU path live in ``head.py``; this module is imported only when a CUDA tensor reaches the head (or
by the interpreter tests), so ``import gradcache_sparton`` never imports triton.

Forward: one program per (batch row b, vocabulary tile). It walks the sequence in tiles of ``BLOCK_S``
(only up to the row's last unmasked position); each tile is a tensor-core product
[BLOCK_V, D] @ [D, BLOCK_S] accumulated in fp32, then bias, mask, and a max/argmax over the tile's
positions folded into a running (max, argmax) kept in registers. The running max starts at 0
(equivalent to -inf after relu) and is replaced only on a strictly larger value, so the first sequence
position wins ties (``tl.max`` breaks ties left inside a tile, ``>`` across tiles). NaN ranks above
+inf and the first NaN wins, as in ``Tensor.max(dim)``: the reference's non-finite semantics exactly
(see ``reference.py``). Only the fp32 max [B, V] and int32 argmax [B, V] are written: the [B, S, V]
logits never exist.

Packed forward, for short sequences (SPLADE queries, S <= 64): one program per (group of G batch rows,
vocabulary tile). The G rows' positions, each row padded to S_pad (the next power of two >= S), sit
side by side in the product's N: [BLOCK_V, D] @ [D, G·S_pad], so each E tile loaded serves G rows
instead of one. The epilogue views the fp32 tile as [BLOCK_V, G, S_pad] (a relabelling of registers, no
data movement) and takes each row's max and leftmost argmax over its own segment, with the same
masking, NaN order and clamp at 0 as above; a whole row fits in one tile, so there is no running max.

Backward, from (max, argmax) alone, with coef[b, v] = grad_y[b, v] / (1 + max[b, v]) where max > 0 or max
is NaN, else 0 (d log1p(x)/dx = 1/(1+x); relu passes nothing where max <= 0, and passes NaN):
- grad_E[v] = Σ_b coef[b, v] · H[b, argmax[b, v]], by one of two kernels, chosen on the device by the
  count of non-zeros (``BackwardBlocks.by_column_below``; no sync: both are launched and the other
  returns at once). Sparse Y, by column: the non-zeros are laid out by vocabulary column (a counting
  sort: per-column counts, their cumsum, each non-zero written to its slot in increasing b) and one
  program per column gathers and sums its own entries, D tile by D tile. Dense Y, the b loop: one
  program per (V tile, D tile), looping over b so that all programs read the same H[b] at about the
  same time (it stays in L2), BLOCK_B rows per step (one [BLOCK_B, BLOCK_V] load of (coef, argmax), one
  gather, their sum added to the accumulator: a fixed order); rows with coef = 0 are masked off the
  gather. Each kernel's summation order is fixed, and the same input picks the same kernel:
  deterministic.
- grad_H[b, s] = Σ_{v: argmax[b, v] = s} coef[b, v] · E[v]: the non-zeros are laid out by destination
  row (b·S + s) in CSR form, v increasing within a row, and one program per row gathers and sums its own
  entries, D tile by D tile. No atomics: the sum order is fixed, so the backward is deterministic, and
  rows without entries (masked positions, never an argmax) are written as exact zeros. The layout:
  for S > ``BackwardBlocks.short_s`` (and fp32 inputs), a stable ``torch.sort`` of all B·V keys (the
  sentinel B·S for zeros; int16 keys where B·S < 2^15). For short 16-bit sequences (queries), where Y is
  sparse (the same device-side rule as grad_E's), a stable sort of grad_E's column layout's first
  by_column_below·B·V slots by row (they hold every non-zero, v increasing, so the layout is the same
  entry for entry); where Y is dense that layout is not built, and grad_H runs on the tensor cores
  instead (the dense kernel below, its [S, V] tile of coef at the argmax built in registers). The
  CSR and the tensor-core kernels are both launched, the one not selected returning at once.
- grad_bias[v] = Σ_b coef[b, v] (a [B, V] reduction, done by torch).
- Non-finite inputs: as autograd through the dense reference, grad_E[:, d] is NaN wherever column d of H
  holds a NaN or ±inf (0 · inf in the dense product), grad_H[:, :, d] wherever column d of E does: each
  kernel starts its accumulator from that [D] vector of 0 / NaN (one [D] load per program).
- A gradient the caller does not need (a frozen weight, hidden states that need no grad) is skipped.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl
from torch import Tensor

from gradcache_sparton.kernels.reference import backward_coefficients, non_finite_columns

__all__ = [
    "BackwardBlocks",
    "DenseBackwardBlocks",
    "ForwardBlocks",
    "PackedForwardBlocks",
    "sparton_backward",
    "sparton_forward",
]


# ---------------------------------------------------------------------------------------------------
# Constants
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ForwardBlocks:
    """Tile sizes and launch parameters of the forward kernel."""

    block_s: int  # sequence rows per tensor-core tile (the M of the product)
    block_v: int  # vocabulary columns per program (the N)
    block_d: int  # hidden-dim step of the K loop
    group_b: int  # batch rows scheduled together, so their H[b] and E tiles share L2
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class BackwardBlocks:
    """Tile sizes of the two backward kernels."""

    e_block_b: int  # grad_E, b loop: batch rows gathered per step
    e_block_v: int  # grad_E, b loop: vocabulary rows per program
    e_block_d: int  # grad_E, b loop: hidden columns per program
    e_num_warps: int  # grad_E, b loop
    h_block_n: int  # grad_H: non-zeros gathered per step of a row's CSR segment
    h_block_d: int  # grad_H: hidden columns per step (a program covers all of D)
    h_num_warps: int
    c_block_n: int  # grad_E by column: non-zeros gathered per step of a column's segment
    c_block_d: int  # grad_E by column: hidden columns per step (a program covers all of D)
    c_num_warps: int  # grad_E by column
    # grad_E runs by column where fewer than this fraction of Y's B·V entries are non-zero, else the b
    # loop; decided on the device (no sync). 0: always the b loop; above 1: always by column.
    by_column_below: float
    # S <= short_s: grad_H's layout is built from grad_E's column layout where Y is sparse, and grad_H
    # runs on the tensor cores where it is dense. Longer S: grad_H's layout by a stable sort of all B·V
    # keys, whatever the density. (The default blocks set it to 0 for fp32 inputs.)
    short_s: int


# 16-bit inputs on an H100 (bf16, B=128, S=512, D=768, V=30,522, benchmarks/tune_head.py, 2026-11-22):
# the product is [BLOCK_V, D] @ [D, BLOCK_S]; BLOCK_V=128 (MMA M), BLOCK_S=256 (N), a 64-deep K step,
# 8 warps and 3 stages ran 6.10 ms = 503 TFLOP/s. Measured alternatives (ms): 128x128 8 warps 7.54,
# 4 warps 4 stages 8.21; M=256 x N=128 6.49 (4 stages 6.66); M=256 x N=64 4 warps 8.81; M=128 x N=256
# with 4 stages 6.24; M=256 x N=128 x K=32 with 5 stages 7.09. Wider N means fewer epilogues (max over
# the tile) per product and fewer re-reads of the E tile; 3 stages of (128 + 256) x 64 bf16 = 144 KiB of
# shared memory, within the H100's 227 KiB.
_FWD_GPU_16BIT = ForwardBlocks(block_s=256, block_v=128, block_d=64, group_b=8, num_warps=8, num_stages=3)
# Short sequences (SPLADE queries: ~32 tokens) take the packed-rows kernel (``PackedForwardBlocks``).
# Its forerunner, the one-row kernel with a 32 x 256 tile (one batch row's 32 positions per product
# against a [256, D] tile of E), ran 0.78 ms at B=128, S=32 (8 warps, 3 stages; 32x128 0.84, 32x64 0.96, 64x128
# 0.99, the 256x128 default 2.98) but only 223 TFLOP/s at B=512, S=32 (3.44 ms against the compiled
# head's 2.19, docs/benchmarks.md): each E tile is re-read from L2 once per batch row, an arithmetic
# intensity of ~28 FLOP per byte loaded per K step, too low for the tensor cores.
# fp32 inputs use IEEE fp32 FMA dots (no TF32: the head must match the fp32 reference to 1e-5), so the
# tensor-core tile gains nothing; a smaller tile keeps register pressure of the fp32 operands sane.
_FWD_GPU_FP32 = ForwardBlocks(block_s=64, block_v=64, block_d=32, group_b=8, num_warps=4, num_stages=2)
# Under the interpreter every program is numpy on the CPU: the smallest tiles that tl.dot accepts (16)
# keep the awkward test shapes (S, V, D not multiples of the blocks) spread over several tiles.
_FWD_INTERPRET = ForwardBlocks(block_s=16, block_v=16, block_d=16, group_b=2, num_warps=1, num_stages=1)


@dataclass(frozen=True)
class PackedForwardBlocks:
    """Tile sizes and launch parameters of the packed-rows forward kernel (short sequences)."""

    block_n: int  # G·S_pad: G batch rows' positions side by side (the N of the product), S_pad = 2^k >= S
    block_v: int  # vocabulary rows per program (the M)
    block_d: int  # hidden-dim step of the K loop
    group_n: int  # row groups scheduled together, so their H rows and E tiles share L2
    num_warps: int
    num_stages: int


# Sequences of up to this many positions take the packed kernel (16-bit inputs): queries, the bound
# issue 15 sets. The kernel holds any S whole in one tile (N = max(block_n, S_pad)) and also packs
# rows at S = 128 (G = 2 at block_n 256), where the one-row kernel's 256-wide tile is half padding; the
# bound can move once measured (tune_head.py times packed candidates up to S_pad = 256).
_PACKED_MAX_S = 64
# bf16, B=512, S=32, D=768, V=30,522 on an H100 (benchmarks/tune_head.py --shape 512,32,768,30522
# --dense --bias-mean -2.0, 2026-11-23), ms: N = 128 (G = 4 rows at S = 32) x M = 128 vocabulary rows,
# 64-deep K, 4 warps, 3 stages 1.80 (427 TFLOP/s); 4 stages 2.40; 128 x 256, 8 warps 1.87; 256 x 128,
# 8 warps, 3 stages 1.94 (group 4: 1.95, group 16: 1.94; 4 stages 1.97; K = 32 2.26); 256 x 64
# 2.52; 64 x 128 2.24. The one-row kernel's best short tile (32 x 256) ran 3.19 in the same run.
_FWD_GPU_16BIT_PACKED = PackedForwardBlocks(
    block_n=128, block_v=128, block_d=64, group_n=8, num_warps=4, num_stages=3
)
# Under the interpreter: N = 128 packs 2 to 128 rows of the awkward test shapes (S = 1 .. 64), so
# groups straddle B and hold fully masked rows.
_FWD_PACKED_INTERPRET = PackedForwardBlocks(
    block_n=128, block_v=16, block_d=16, group_n=2, num_warps=1, num_stages=1
)

# The backward kernels are gathers (no tensor cores; the bytes gathered from L2 bound them): small
# programs, many of them in flight, won. Same shape, 61% of Y non-zero (benchmarks/tune_head.py
# --skip-fwd, 2026-11-22), ms for grad_E / grad_H (the latter including its 0.27 ms CSR sort):
# grad_E 16 rows x 128 columns, 2 warps: 0.79 (32x64, 2 warps 0.86; 16x64, 1 warp 0.88; 64x64,
# 4 warps 0.85; 8x128, 1 warp 0.80); grad_H 32 non-zeros x 64 columns, 1 warp: 1.15 (64x64, 1 warp
# 1.16; 64x64, 2 warps 1.52; 32x128, 2 warps 1.54; 128x64, 4 warps 3.11). Both gather ~3.7 GB at that
# density, i.e. ~4.6 TB/s, about the L2's rate, so the block shape matters less from here on.
# Stepping grad_E's b loop e_block_b rows at a time (one [e_block_b, BLOCK_V] load of (coef, argmax),
# one gather) lost everywhere it was timed (tune_head.py, H100, 2026-11-23), ms for the whole backward:
# B=512, S=32, 2.3% of Y > 0: e_block_b 1 3.31 (grad_E 2.20), 2 6.08, 4 6.33-104 (by block shape and
# warps), 8 19.4-58.0, 16 34.1; B=128, S=512, 61%: 1 2.16 (grad_E 0.87), 2 2.90, 4 2.88-28.0, 8
# 6.10-16.5. The b loop's 512 dependent steps of (coef, argmax) loads at B = 512 are its cost where
# Y is sparse; grad_E by column (the non-zeros laid out by vocabulary column, one program per column
# over its own entries) pays for that layout instead. tune_head.py --skip-fwd, H100, 2026-11-25, with
# the layout then a stable torch.sort (0.40-0.43 ms here), whole backward / grad_E (layout included) in
# ms, by column at its best (8 non-zeros x 128 columns, 1 warp; 16 x 128 and
# 32 x 64 within 0.06 ms where Y is sparse) against the b loop at its best:
#   B=512, S=32,  2.3% of Y > 0: 1.86 / 0.75 against 3.31 / 2.20
#   B=128, S=256, 4.4%:          1.05 / 0.38 against 1.29 / 0.62
#   B=512, S=32,  52%:           7.25 / 3.43 against 6.39 / 2.56 (by column 7.73 / 3.90 at 8 x 128)
#   B=128, S=512, 61%:           2.61 / 1.33 against 2.16 / 0.87 (by column 2.71 / 1.43 at 8 x 128)
# and through bench_head.py at B=512, S=32 with ~100% of Y > 0, fwd+bwd 13.62 ms by column against
# 10.55 with the b loop. By column wins where reps are as sparse as a trained SPLADE model's (1-3%) and
# loses where half or more of Y is non-zero (random heads). Its grad_E cost grows ~5.4 ms per unit of
# density at B=512, S=32 (0.75 at 2.3%, 3.43 at 52%) against the b loop's ~0.7 (2.20, 2.56): equal near
# 33%, so below 25% of Y non-zero it runs by column. Both kernels are launched, each returning at once
# unless the device-side count of non-zeros selects it (the column layout's kernels too). With the
# counting layout (below) the whole backward at B=512, S=32, 2.3% took 1.59 ms (grad_E 0.48, grad_H
# 0.79; tune_head.py, H100, 2026-11-25, later).
# short_s = 64 (the packed forward's bound): grad_H's rows from the column layout where Y is sparse, on
# the tensor cores where it is dense. B=512, S=32, tune_head.py --skip-fwd, 2026-11-26, whole backward
# (grad_H alone) in ms, short_s 64 against 0 (every S on the sort of all B·V keys): on an H100, 2.3% of
# Y > 0: 1.20 (0.64) against 1.58 (0.92), the row layout 0.20 against 0.57; 100%: 7.76 (4.59) against
# 8.54 (5.35) with the tensor-core tile before the one committed (grad_H alone 4.39 then, 2.79 now); on
# an H200 with the committed tile, 52%: 5.82 (3.01) against 5.80 (2.97). Longer S keep the sort: there
# the tensor-core grad_H's work, 2·B·S·V·D twice (the bf16 split), grows with S while the gather's
# does not. fp32 inputs keep it too (IEEE FMA products, no tensor cores).
_BWD_GPU = BackwardBlocks(
    e_block_b=1,
    e_block_v=16,
    e_block_d=128,
    e_num_warps=2,
    h_block_n=32,
    h_block_d=64,
    h_num_warps=1,
    c_block_n=8,
    c_block_d=128,
    c_num_warps=1,
    by_column_below=0.25,
    short_s=64,
)
# The CSR layout of grad_E by column is a counting sort in two passes of one kernel, one program per
# COLUMN_BLOCK_V columns walking b COLUMN_BLOCK_B rows at a time with a running count per column in
# registers: the first counts each column's non-zeros, a torch cumsum of the counts gives each column's
# first slot, the second writes each non-zero to its slot. It replaced a stable torch.sort over all B·V
# keys. B = 512, S = 32, V = 30,522, 2.3% of Y > 0 (tune_head.py, H100, 2026-11-25), ms: 32 x 32 0.097
# (128 x 32 0.111, 16 x 64 0.112, 32 x 64 0.127, 64 x 32 0.127, 8 x 32 0.139, 32 x 128 0.183, 16 x 128
# 0.191) against the int16 sort's 0.40. A first version counted with torch, (coef != 0).sum(0): 0.20 ms
# at 32 x 64 (and 0.063 against the sort's 0.15 at B = 128, S = 512, 61%).
_COLUMN_BLOCK_B, _COLUMN_BLOCK_V = 32, 32
# grad_H's layout by destination row stays a stable torch.sort: two counting versions lost to it on the
# same H100 run, ms at B = 512, S = 32 (B = 128, S = 512) against the sort's 0.39 (0.26): running counts
# in memory, per (row, 2,048-column chunk), with a [32, 32] comparison for the ranks within a step and a
# barrier between steps 0.97 (0.32); running counts in registers with a [V_step, S_pad] one-hot and its
# cumsum for the ranks 2.9-3.7 (3.5-4.5). Its keys are int16 while B·S is below this, else int32: the
# sort took 0.43 ms as int16 against 0.80 ms as int32 at B = 512 (tune_head.py, 2026-11-23).
_INT16_KEYS_BELOW = 2**15
# grad_H's row keys from the column layout, entries per program (one elementwise pass over the
# by_column_below·B·V slots; the whole row layout, keys, sort and offsets, took 0.16-0.20 ms at B=512,
# S=32 on an H100 and an H200, not tuned further). Under the interpreter, several programs per test.
_ROW_KEYS_BLOCK, _ROW_KEYS_BLOCK_INTERPRET = 1024, 16
# Under the interpreter: partial tiles in b and v at the tests' shapes.
_COLUMN_BLOCK_B_INTERPRET, _COLUMN_BLOCK_V_INTERPRET = 2, 16
# e_block_b = 2: B = 3 and 5 in the tests end on a partial step; by column, 4 non-zeros per step: the
# tests' columns end on partial steps. The tests pick either kernel through by_column_below.
_BWD_INTERPRET = BackwardBlocks(
    e_block_b=2,
    e_block_v=16,
    e_block_d=16,
    e_num_warps=1,
    h_block_n=16,
    h_block_d=16,
    h_num_warps=1,
    c_block_n=4,
    c_block_d=16,
    c_num_warps=1,
    by_column_below=0.25,
    short_s=64,
)


@dataclass(frozen=True)
class DenseBackwardBlocks:
    """Tile sizes of the dense (tensor-core) backward kernels."""

    e_block_v: int  # grad_E: vocabulary rows per program (the M of [V, S] @ [S, D])
    e_block_k: int  # grad_E: positions per step (the K): whole rows, e_block_k // S_pad of them, if S fits
    e_block_d: int  # grad_E: hidden columns per program (the N)
    e_num_warps: int
    h_block_m: int  # grad_H: positions per program (the M of [S, V] @ [V, D]); whole rows if S fits
    h_block_v: int  # grad_H: vocabulary rows per step (the K)
    h_block_d: int  # grad_H: hidden columns per program (the N)
    h_num_warps: int
    h_num_stages: int


# Dense backward (opt-in, ``sparton_backward(dense=True)``), bf16, B=512, S=32, 52% of Y > 0 (tune_head.py
# --dense, H100, 2026-11-23), ms (grad_E + grad_H): grad_E 128 x 64 (K, 2 rows) x 128, 8 warps and grad_H
# M = 128 (4 rows) x 64 x 128, 4 warps 11.23 (7.06 + 3.88, 137 TFLOP/s over the two products' flops);
# grad_H with 8 warps 11.83; M = 256 x K 32 12.06; K = 32 for grad_E 13.06; 64-wide M for grad_E 12.93-
# 13.21. The sparse backward ran the same inputs in 6.40 and 3.31 at 2.3% of Y > 0, so the dense grad_E
# is not chosen automatically; the dense grad_H is, for short sequences with dense Y (``short_s``).
# Its tile, grad_H alone at the same shape (tune_head.py --skip-fwd, 2026-11-26; density does not
# change it: 2.77-2.86 ms at 2.3%, 52% and 100% of Y > 0 on an H100), ms on an H100 / an H200:
# M = 128 (4 rows) x K 64 x N 256, 8 warps, 3 stages 2.79 / 2.81 (4 stages - / 2.92); 64 x 32 x 256,
# 4 warps - / 3.15; 128 x 32 x 128, 4 warps 3.19 / 3.26; 64 x 64 x 128 3.41 / 3.48; 128 x 32 x 256
# - / 3.71; 128 x 128 x 128, 8 warps 4.22 / -; the tile before, 128 x 64 x 128, 4 warps, 4.37 / 4.43
# (4 stages 4.38, 2 stages 4.67, 8 warps 4.60 on the H100); 128 x 64 x 256 with 4 warps - / 14.9,
# 256 x 32 x 256 - / 25.9 (register spills); 128 x 128 x 256 needs 264 KiB of shared memory.
_DENSE_BWD_GPU = DenseBackwardBlocks(
    e_block_v=128,
    e_block_k=64,
    e_block_d=128,
    e_num_warps=8,
    h_block_m=128,
    h_block_v=64,
    h_block_d=256,
    h_num_warps=8,
    h_num_stages=3,
)
# 64-position products: the tests' S = 21 and 29 pack 2 rows (B = 3 and 5 end on a partial group)
_DENSE_BWD_INTERPRET = DenseBackwardBlocks(
    e_block_v=16,
    e_block_k=64,
    e_block_d=16,
    e_num_warps=1,
    h_block_m=64,
    h_block_v=16,
    h_block_d=16,
    h_num_warps=1,
    h_num_stages=1,
)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


# ---------------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["B", "S"])
def _sparton_fwd_kernel(
    h_ptr,  # [B, S, D] hidden states
    e_ptr,  # [V, D] vocabulary embeddings
    bias_ptr,  # [V] or a dummy when HAS_BIAS is False
    mask_ptr,  # [B, S] uint8 0/1 attention mask
    len_ptr,  # [B] int32: 1 + the last unmasked position of each row (0 for a fully masked row)
    max_ptr,  # [B, V] fp32 out: max_s of the masked logits, clamped at 0
    arg_ptr,  # [B, V] int32 out: first s attaining it (0 where the max is 0)
    B,
    S,
    V,
    D,
    stride_hb,
    stride_hs,
    stride_ev,
    stride_mb,
    HAS_BIAS: tl.constexpr,
    EVEN_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    GROUP_B: tl.constexpr,
):
    # Grouped launch order: consecutive programs walk GROUP_B batch rows first, then the next V tile, so
    # the programs resident at once read a few H[b] and a few E tiles, all of which stay in L2.
    pid = tl.program_id(0)
    num_v_tiles = tl.cdiv(V, BLOCK_V)
    per_group = GROUP_B * num_v_tiles
    first_b = (pid // per_group) * GROUP_B
    group_rows = tl.minimum(B - first_b, GROUP_B)
    b = first_b + (pid % per_group) % group_rows
    v_tile = (pid % per_group) // group_rows

    offs_v = v_tile * BLOCK_V + tl.arange(0, BLOCK_V)  # [BLOCK_V]
    v_ok = offs_v < V
    offs_d = tl.arange(0, BLOCK_D)
    offs_t = tl.arange(0, BLOCK_S)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_v, mask=v_ok, other=0.0).to(tl.float32)
    run_max = tl.zeros([BLOCK_V], dtype=tl.float32)
    run_arg = tl.zeros([BLOCK_V], dtype=tl.int32)
    h_row = h_ptr + b.to(tl.int64) * stride_hb
    e_rows = e_ptr + offs_v.to(tl.int64)[:, None] * stride_ev  # [BLOCK_V, 1] row starts
    # Right padding costs nothing: only the S tiles up to the row's last unmasked position are computed.
    k_tiles = tl.cdiv(D, BLOCK_D)
    n_iters = tl.cdiv(tl.load(len_ptr + b), BLOCK_S) * k_tiles
    acc = tl.zeros([BLOCK_V, BLOCK_S], dtype=tl.float32)
    # One flat loop over (S tile, K step) instead of two nested loops: the software pipeline then runs
    # across S tiles, and the next tile's loads overlap the max/argmax epilogue of the previous one.
    for it in range(0, n_iters):
        kt = it % k_tiles
        s0 = (it // k_tiles) * BLOCK_S
        offs_s = s0 + offs_t
        s_ok = offs_s < S
        dd = kt * BLOCK_D + offs_d
        e_ptrs = e_rows + dd[None, :]  # [BLOCK_V, BLOCK_D]
        h_ptrs = h_row + offs_s[:, None] * stride_hs + dd[None, :]  # [BLOCK_S, BLOCK_D]
        if EVEN_D:
            e = tl.load(e_ptrs, mask=v_ok[:, None], other=0.0)
            h = tl.load(h_ptrs, mask=s_ok[:, None], other=0.0)
        else:
            d_ok = dd < D
            e = tl.load(e_ptrs, mask=v_ok[:, None] & d_ok[None, :], other=0.0)
            h = tl.load(h_ptrs, mask=s_ok[:, None] & d_ok[None, :], other=0.0)
        if UPCAST_DOT:
            e = e.to(tl.float32)
            h = h.to(tl.float32)
        # Logits transposed, [BLOCK_V, BLOCK_D] @ [BLOCK_D, BLOCK_S] -> [BLOCK_V, BLOCK_S], fp32
        # accumulation: the reduction over S then runs along the MMA's N axis, which lives inside a warp
        # (shuffles), not across warps (shared memory) as an M-axis reduction would.
        acc = tl.dot(e, tl.trans(h), acc, input_precision=DOT_PRECISION)
        if kt == k_tiles - 1:
            keep = tl.load(mask_ptr + b * stride_mb + offs_s, mask=s_ok, other=0) != 0
            x = acc
            if HAS_BIAS:
                x = x + bias[:, None]
            x = tl.where(keep[None, :], x, float("-inf"))
            # [BLOCK_V, BLOCK_S] -> [BLOCK_V]: max over this S tile and its first (leftmost) position,
            # in Tensor.max(dim)'s order: NaN above +inf, the first NaN wins. tl.max's own comparisons
            # drop or keep a NaN depending on where it sits, so NaN is read as +inf here ...
            is_nan = x != x
            tile_max, tile_arg = tl.max(
                tl.where(is_nan, float("inf"), x),
                axis=1,
                return_indices=True,
                return_indices_tie_break_left=True,
            )
            if tl.max(tile_max, axis=0) == float("inf"):  # ... and only a tile holding NaN or +inf
                first_nan = tl.min(tl.where(is_nan, offs_t[None, :], BLOCK_S), axis=1)  # pays for this
                has_nan = first_nan < BLOCK_S
                tile_max = tl.where(has_nan, float("nan"), tile_max)
                tile_arg = tl.where(has_nan, first_nan, tile_arg)
            # strict: an earlier tile keeps a tie; the first NaN replaces any number and then stays
            better = (tile_max > run_max) | ((tile_max != tile_max) & (run_max == run_max))
            run_max = tl.where(better, tile_max, run_max)
            run_arg = tl.where(better, s0 + tile_arg, run_arg)
            acc = tl.zeros([BLOCK_V, BLOCK_S], dtype=tl.float32)

    out = b.to(tl.int64) * V + offs_v
    tl.store(max_ptr + out, run_max, mask=v_ok)
    tl.store(arg_ptr + out, run_arg, mask=v_ok)


@triton.jit(do_not_specialize=["B", "S"])
def _sparton_fwd_packed_kernel(
    h_ptr,  # [B, S, D] hidden states
    e_ptr,  # [V, D] vocabulary embeddings
    bias_ptr,  # [V] or a dummy when HAS_BIAS is False
    mask_ptr,  # [B, S] uint8 0/1 attention mask
    max_ptr,  # [B, V] fp32 out: max_s of the masked logits, clamped at 0
    arg_ptr,  # [B, V] int32 out: first s attaining it (0 where the max is 0)
    B,
    S,
    V,
    D,
    stride_hb,
    stride_hs,
    stride_ev,
    stride_mb,
    HAS_BIAS: tl.constexpr,
    EVEN_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    S_PAD: tl.constexpr,  # next power of two >= S: the N columns of one batch row
    ROWS: tl.constexpr,  # G batch rows per program; the product's N is ROWS * S_PAD
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    GROUP_N: tl.constexpr,
):
    # Grouped launch order, as in _sparton_fwd_kernel, over groups of ROWS batch rows.
    pid = tl.program_id(0)
    num_v_tiles = tl.cdiv(V, BLOCK_V)
    num_row_groups = tl.cdiv(B, ROWS)
    per_band = GROUP_N * num_v_tiles
    first_group = (pid // per_band) * GROUP_N
    band_groups = tl.minimum(num_row_groups - first_group, GROUP_N)
    row_group = first_group + (pid % per_band) % band_groups
    v_tile = (pid % per_band) // band_groups

    offs_v = v_tile * BLOCK_V + tl.arange(0, BLOCK_V)  # [BLOCK_V]
    v_ok = offs_v < V
    offs_d = tl.arange(0, BLOCK_D)
    # Column n of the product is position n % S_PAD of batch row first_row + n // S_PAD: [BLOCK_N]
    offs_n = tl.arange(0, ROWS * S_PAD)
    first_row = row_group * ROWS
    rows = first_row + offs_n // S_PAD
    pos = offs_n % S_PAD
    n_ok = (rows < B) & (pos < S)
    e_rows = e_ptr + offs_v.to(tl.int64)[:, None] * stride_ev  # [BLOCK_V, 1] row starts
    h_cols = h_ptr + rows.to(tl.int64)[:, None] * stride_hb + pos[:, None] * stride_hs  # [BLOCK_N, 1]
    acc = tl.zeros([BLOCK_V, ROWS * S_PAD], dtype=tl.float32)
    for k in range(0, tl.cdiv(D, BLOCK_D)):
        dd = k * BLOCK_D + offs_d
        if EVEN_D:
            e = tl.load(e_rows + dd[None, :], mask=v_ok[:, None], other=0.0)
            h = tl.load(h_cols + dd[None, :], mask=n_ok[:, None], other=0.0)
        else:
            d_ok = dd < D
            e = tl.load(e_rows + dd[None, :], mask=v_ok[:, None] & d_ok[None, :], other=0.0)
            h = tl.load(h_cols + dd[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        if UPCAST_DOT:
            e = e.to(tl.float32)
            h = h.to(tl.float32)
        # [BLOCK_V, BLOCK_D] @ [BLOCK_D, G·S_PAD] -> [BLOCK_V, G·S_PAD]: G batch rows share each E tile
        acc = tl.dot(e, tl.trans(h), acc, input_precision=DOT_PRECISION)
    keep = tl.load(mask_ptr + rows * stride_mb + pos, mask=n_ok, other=0) != 0  # padding never wins
    x = acc
    if HAS_BIAS:
        x = x + tl.load(bias_ptr + offs_v, mask=v_ok, other=0.0).to(tl.float32)[:, None]
    x = tl.where(keep[None, :], x, float("-inf"))
    # [BLOCK_V, G·S_PAD] -> [BLOCK_V, G, S_PAD] -> [BLOCK_V, G]: each row's max and first position, in
    # Tensor.max(dim)'s order, as in _sparton_fwd_kernel: NaN read as +inf by tl.max, and only a tile
    # holding NaN or +inf looks for the first NaN. Whole rows in one tile: no running max across tiles.
    is_nan = x != x
    row_max, row_arg = tl.max(
        tl.reshape(tl.where(is_nan, float("inf"), x), [BLOCK_V, ROWS, S_PAD]),
        axis=2,
        return_indices=True,
        return_indices_tie_break_left=True,
    )
    if tl.max(tl.max(row_max, axis=1), axis=0) == float("inf"):
        nan_at = tl.where(is_nan, pos[None, :], S_PAD)  # [BLOCK_V, G·S_PAD]
        first_nan = tl.min(tl.reshape(nan_at, [BLOCK_V, ROWS, S_PAD]), axis=2)  # [BLOCK_V, G]
        has_nan = first_nan < S_PAD
        row_max = tl.where(has_nan, float("nan"), row_max)
        row_arg = tl.where(has_nan, first_nan, row_arg)
    # relu: the max starts at 0 (a max <= 0, -inf for a fully masked row, gives (0, 0)); NaN passes
    live = (row_max > 0) | (row_max != row_max)
    out_rows = first_row + tl.arange(0, ROWS)  # [G]
    out = out_rows.to(tl.int64)[None, :] * V + offs_v[:, None]  # [BLOCK_V, G]
    out_ok = v_ok[:, None] & (out_rows < B)[None, :]
    tl.store(max_ptr + out, tl.where(live, row_max, 0.0), mask=out_ok)
    tl.store(arg_ptr + out, tl.where(live, row_arg, 0).to(tl.int32), mask=out_ok)


@triton.jit(do_not_specialize=["limit", "B"])
def _column_segments_kernel(
    coef_ptr,  # [B, V] fp32
    count_ptr,  # [V] int64: each column's count of non-zeros (written when not WRITE), or its first slot
    order_ptr,  # [B·V] out (WRITE): flat index b·V + v of each non-zero, column by column, b increasing
    live_ptr,  # [] int64: the number of non-zero coef
    limit,  # grad_E runs by column (and needs this layout) only if live < limit
    B,
    V,
    BLOCK_B: tl.constexpr,
    BLOCK_V: tl.constexpr,
    WRITE: tl.constexpr,  # False: count each column's non-zeros; True: write each to its slot
):
    if tl.load(live_ptr) >= limit:
        return
    offs_v = tl.program_id(0) * BLOCK_V + tl.arange(0, BLOCK_V)
    v_ok = offs_v < V
    # [BLOCK_V]: the next free slot per column (WRITE), or the count so far
    running = tl.load(count_ptr + offs_v, mask=v_ok, other=0) if WRITE else tl.zeros([BLOCK_V], tl.int64)
    offs_b = tl.arange(0, BLOCK_B)
    for b0 in range(0, B, BLOCK_B):
        rows = b0 + offs_b
        flat = rows.to(tl.int64)[:, None] * V + offs_v[None, :]  # [BLOCK_B, BLOCK_V]
        coef = tl.load(coef_ptr + flat, mask=(rows < B)[:, None] & v_ok[None, :], other=0.0)
        live = (coef != 0.0).to(tl.int32)  # NaN coefficients are entries too
        if WRITE:
            # an entry's slot: the column's running count plus the entries above it in this step
            slot = running[None, :] + tl.cumsum(live, axis=0) - live
            tl.store(order_ptr + slot, flat.to(order_ptr.dtype.element_ty), mask=live != 0)
        running += tl.sum(live, axis=0)
    if not WRITE:
        tl.store(count_ptr + offs_v, running, mask=v_ok)


@triton.jit(do_not_specialize=["limit", "B"])
def _sparton_bwd_grad_e_kernel(
    h_ptr,  # [B, S, D] hidden states
    coef_ptr,  # [B, V] fp32: grad_y / (1 + max) where max > 0 or NaN, else 0
    arg_ptr,  # [B, V] int32 argmax over S
    poison_ptr,  # [D] fp32: NaN where column d of H holds a non-finite value, else 0
    grad_e_ptr,  # [V, D] out, dtype of E
    live_ptr,  # [] int64: the number of non-zero coef
    limit,  # this kernel runs only if live >= limit (else grad_E goes by column)
    B,
    V,
    D,
    stride_hb,
    stride_hs,
    BLOCK_B: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    if tl.load(live_ptr) < limit:
        return
    pid_v = tl.program_id(0)
    pid_d = tl.program_id(1)
    offs_b = tl.arange(0, BLOCK_B)
    offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    v_ok = offs_v < V
    d_ok = offs_d < D
    poison = tl.load(poison_ptr + offs_d, mask=d_ok, other=0.0)
    acc = tl.zeros([BLOCK_V, BLOCK_D], dtype=tl.float32) + poison[None, :]
    # rows 0..BLOCK_B-1 of [B, V]: [BLOCK_B, BLOCK_V]; advanced by BLOCK_B·V per step (64-bit pointers)
    coef_ptrs = coef_ptr + offs_b.to(tl.int64)[:, None] * V + offs_v[None, :]
    arg_ptrs = arg_ptr + offs_b.to(tl.int64)[:, None] * V + offs_v[None, :]
    # H[b, 0, d] for the step's rows: [BLOCK_B, 1, BLOCK_D]; advanced by BLOCK_B·stride_hb per step
    h_rows = h_ptr + offs_b.to(tl.int64)[:, None, None] * stride_hb + offs_d[None, None, :]
    # b-major: every program reads the same BLOCK_B rows of H in the same step, so the gathers hit L2.
    # BLOCK_B rows per step: one [BLOCK_B, BLOCK_V] load of (coef, argmax) and one gather of all their
    # rows, so the chain of dependent loads (coef, then the gather) is paid B / BLOCK_B times, not B.
    for b0 in range(0, B, BLOCK_B):
        ok = (b0 + offs_b < B)[:, None] & v_ok[None, :]
        coef = tl.load(coef_ptrs, mask=ok, other=0.0)  # [BLOCK_B, BLOCK_V]
        s = tl.load(arg_ptrs, mask=ok, other=0)
        live = coef != 0.0  # zero outputs load nothing (NaN coefficients do)
        # gather H[b, argmax[b, v], d]: [BLOCK_B, BLOCK_V, BLOCK_D]
        h = tl.load(
            h_rows + s.to(tl.int64)[:, :, None] * stride_hs,
            mask=live[:, :, None] & d_ok[None, None, :],
            other=0.0,
        )
        # Summation order, fixed (deterministic): the step's BLOCK_B products are summed by one tl.sum
        # (a reduction tree fixed by the compiled tile), and that partial sum is added to acc.
        acc += tl.sum(coef[:, :, None] * h.to(tl.float32), axis=0)  # -> [BLOCK_V, BLOCK_D]
        coef_ptrs += BLOCK_B * V
        arg_ptrs += BLOCK_B * V
        h_rows += BLOCK_B * stride_hb
    out = offs_v.to(tl.int64)[:, None] * D + offs_d[None, :]
    tl.store(grad_e_ptr + out, acc.to(grad_e_ptr.dtype.element_ty), mask=v_ok[:, None] & d_ok[None, :])


@triton.jit(do_not_specialize=["limit", "S"])
def _row_keys_kernel(
    order_ptr,  # [B·V] flat index b·V + v of each non-zero, column by column (the first live are written)
    arg_ptr,  # [B·V] int32 argmax over S
    keys_ptr,  # [capacity] out: destination row b·S + argmax of each, the sentinel B·S past the live ones
    live_ptr,  # [] int64: the number of non-zero coef
    limit,  # the column layout exists only if live < limit; else every key is the sentinel
    capacity,
    V,
    S,
    sentinel,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = tl.load(live_ptr)
    written = tl.where(live < limit, live, 0)  # the column layout's written slots
    valid = (offs < capacity) & (offs < written)
    flat = tl.load(order_ptr + offs, mask=valid, other=0)
    s = tl.load(arg_ptr + flat, mask=valid, other=0)
    key = tl.where(valid, (flat // V) * S + s, sentinel)
    tl.store(keys_ptr + offs, key.to(keys_ptr.dtype.element_ty), mask=offs < capacity)


@triton.jit(do_not_specialize=["limit"])
def _sparton_bwd_grad_e_by_column_kernel(
    h_ptr,  # [B, S, D] hidden states
    col_ptr,  # [V + 1] int64 offsets into the column layout, one segment per vocabulary column
    idx_ptr,  # [B·V] int32/int64 flat index b·V + v of each non-zero, in column order (N are read)
    coef_ptr,  # [B·V] fp32 coef, read at those indices
    arg_ptr,  # [B·V] int32 argmax over S, read at those indices
    poison_ptr,  # [D] fp32: NaN where column d of H holds a non-finite value, else 0
    grad_e_ptr,  # [V, D] out, dtype of E
    live_ptr,  # [] int64: the number of non-zero coef
    limit,  # this kernel runs only if live < limit (else grad_E goes by the b loop)
    V,
    D,
    stride_hb,
    stride_hs,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    if tl.load(live_ptr) >= limit:
        return
    v = tl.program_id(0)  # destination vocabulary row; one program covers all of D
    start = tl.load(col_ptr + v)
    end = tl.load(col_ptr + v + 1)
    out_row = grad_e_ptr + v.to(tl.int64) * D
    for d0 in range(0, D, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        d_ok = offs_d < D
        acc = tl.load(poison_ptr + offs_d, mask=d_ok, other=0.0)  # [BLOCK_D], 0 or NaN
        for i in range(start, end, BLOCK_N):
            offs_n = i + tl.arange(0, BLOCK_N)
            n_ok = offs_n < end
            # the entries' coef, argmax and H rows: coef and argmax wait only for idx [BLOCK_N]
            idx = tl.load(idx_ptr + offs_n, mask=n_ok, other=0)
            b = (idx // V).to(tl.int64)
            coef = tl.load(coef_ptr + idx, mask=n_ok, other=0.0)
            s = tl.load(arg_ptr + idx, mask=n_ok, other=0)
            h_ptrs = h_ptr + b[:, None] * stride_hb + s.to(tl.int64)[:, None] * stride_hs + offs_d[None, :]
            h = tl.load(h_ptrs, mask=n_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_N, BLOCK_D]
            acc += tl.sum(coef[:, None] * h.to(tl.float32), axis=0)  # -> [BLOCK_D]
        tl.store(out_row + offs_d, acc.to(grad_e_ptr.dtype.element_ty), mask=d_ok)


@triton.jit
def _sparton_bwd_grad_h_kernel(
    e_ptr,  # [V, D] vocabulary embeddings
    row_ptr,  # [B·S + 1] int64 CSR offsets into the row layout, one segment per destination row
    idx_ptr,  # [B·V] int32/int64 flat index b·V + v of each non-zero, in CSR order (N are read)
    coef_ptr,  # [B·V] fp32 coef, read at those indices
    poison_ptr,  # [D] fp32: NaN where column d of E holds a non-finite value, else 0
    grad_h_ptr,  # [B·S, D] out, dtype of H
    live_ptr,  # [] int64: the number of non-zero coef
    limit,  # this kernel runs only if live < limit (else grad_H goes on the tensor cores)
    V,
    D,
    stride_ev,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    if tl.load(live_ptr) >= limit:
        return
    r = tl.program_id(0)  # destination row b·S + s; one program covers all of D
    start = tl.load(row_ptr + r)
    end = tl.load(row_ptr + r + 1)
    out_row = grad_h_ptr + r.to(tl.int64) * D
    for d0 in range(0, D, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        d_ok = offs_d < D
        acc = tl.load(poison_ptr + offs_d, mask=d_ok, other=0.0)  # [BLOCK_D], 0 or NaN
        for i in range(start, end, BLOCK_N):
            offs_n = i + tl.arange(0, BLOCK_N)
            n_ok = offs_n < end
            # the entries' coef and E rows: two loads that both wait only for idx [BLOCK_N]
            idx = tl.load(idx_ptr + offs_n, mask=n_ok, other=0)
            v = idx % V
            coef = tl.load(coef_ptr + idx, mask=n_ok, other=0.0)
            e_ptrs = e_ptr + v.to(tl.int64)[:, None] * stride_ev + offs_d[None, :]  # [BLOCK_N, BLOCK_D]
            e = tl.load(e_ptrs, mask=n_ok[:, None] & d_ok[None, :], other=0.0)
            acc += tl.sum(coef[:, None] * e.to(tl.float32), axis=0)  # [BLOCK_N, BLOCK_D] -> [BLOCK_D]
        tl.store(out_row + offs_d, acc.to(grad_h_ptr.dtype.element_ty), mask=d_ok)


@triton.jit(do_not_specialize=["B", "S"])
def _sparton_bwd_dense_grad_e_kernel(
    h_ptr,  # [B, S, D] hidden states
    coef_ptr,  # [B, V] fp32
    arg_ptr,  # [B, V] int32
    poison_ptr,  # [D] fp32: NaN where column d of H holds a non-finite value, else 0
    grad_e_ptr,  # [V, D] out, dtype of E
    B,
    S,
    V,
    D,
    stride_hb,
    stride_hs,
    SPLIT: tl.constexpr,  # bf16: coef as a hi + lo pair of bf16 values (two exact products)
    UPCAST_DOT: tl.constexpr,  # the interpreter's bf16 tl.dot is wrong: same values in fp32
    ROWS: tl.constexpr,  # batch rows per step; > 1 only where BLOCK_S >= S (whole rows)
    BLOCK_V: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid_v = tl.program_id(0)
    pid_d = tl.program_id(1)
    offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    offs_r = tl.arange(0, ROWS)
    offs_t = tl.arange(0, BLOCK_S)
    # K index k of a step: position k % BLOCK_S of its row k // BLOCK_S: [ROWS·BLOCK_S]
    offs_k = tl.arange(0, ROWS * BLOCK_S)
    k_row = offs_k // BLOCK_S
    k_pos = offs_k % BLOCK_S
    v_ok = offs_v < V
    d_ok = offs_d < D
    acc = tl.zeros([BLOCK_V, BLOCK_D], dtype=tl.float32)
    acc += tl.load(poison_ptr + offs_d, mask=d_ok, other=0.0)[None, :]
    for b0 in range(0, B, ROWS):
        rows = b0 + offs_r  # [ROWS]
        at = rows.to(tl.int64)[None, :] * V + offs_v[:, None]  # [BLOCK_V, ROWS] into [B, V]
        ok = v_ok[:, None] & (rows < B)[None, :]
        coef = tl.load(coef_ptr + at, mask=ok, other=0.0)  # [BLOCK_V, ROWS]
        s_arg = tl.load(arg_ptr + at, mask=ok, other=-1)
        h_rows = h_ptr + (b0 + k_row).to(tl.int64)[:, None] * stride_hb + offs_d[None, :]  # [K, BLOCK_D]
        for s0 in range(0, S, BLOCK_S):
            # [BLOCK_V, ROWS, BLOCK_S] -> [BLOCK_V, K]: coef at each column's argmax position, 0 elsewhere
            # (built, never stored)
            hit = s_arg[:, :, None] == (s0 + offs_t)[None, None, :]
            p = tl.reshape(tl.where(hit, coef[:, :, None], 0.0), [BLOCK_V, ROWS * BLOCK_S])
            h_ok = (b0 + k_row < B) & (s0 + k_pos < S)
            h = tl.load(
                h_rows + (s0 + k_pos)[:, None] * stride_hs, mask=h_ok[:, None] & d_ok[None, :], other=0.0
            )  # [K, BLOCK_D]
            if SPLIT:
                hi = p.to(h.dtype)
                lo = (p - hi.to(tl.float32)).to(h.dtype)
                if UPCAST_DOT:
                    hi, lo, h = hi.to(tl.float32), lo.to(tl.float32), h.to(tl.float32)
                acc = tl.dot(hi, h, acc)  # [BLOCK_V, K] @ [K, BLOCK_D] -> [BLOCK_V, BLOCK_D]
                acc = tl.dot(lo, h, acc)
            else:
                acc = tl.dot(p, h.to(tl.float32), acc, input_precision="ieee")
    out = offs_v.to(tl.int64)[:, None] * D + offs_d[None, :]
    tl.store(grad_e_ptr + out, acc.to(grad_e_ptr.dtype.element_ty), mask=v_ok[:, None] & d_ok[None, :])


@triton.jit(do_not_specialize=["B", "S"])
def _sparton_bwd_dense_grad_h_kernel(
    e_ptr,  # [V, D] vocabulary embeddings
    coef_ptr,  # [B, V] fp32
    arg_ptr,  # [B, V] int32
    poison_ptr,  # [D] fp32: NaN where column d of E holds a non-finite value, else 0
    grad_h_ptr,  # [B, S, D] out, dtype of H
    live_ptr,  # [] int64: the number of non-zero coef
    limit,  # this kernel runs only if live >= limit (else grad_H goes by destination row)
    B,
    S,
    V,
    D,
    stride_ev,
    SPLIT: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    ROWS: tl.constexpr,  # batch rows per program; > 1 only where BLOCK_S >= S (whole rows)
    BLOCK_V: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    if tl.load(live_ptr) < limit:
        return
    pid = tl.program_id(0)  # (group of ROWS batch rows, S tile)
    pid_d = tl.program_id(1)
    num_s_tiles = tl.cdiv(S, BLOCK_S)
    b0 = (pid // num_s_tiles) * ROWS
    s0 = (pid % num_s_tiles) * BLOCK_S
    offs_r = tl.arange(0, ROWS)
    offs_t = tl.arange(0, BLOCK_S)
    # M index m: position s0 + m % BLOCK_S of batch row b0 + m // BLOCK_S: [ROWS·BLOCK_S]
    offs_m = tl.arange(0, ROWS * BLOCK_S)
    m_row = b0 + offs_m // BLOCK_S
    m_pos = s0 + offs_m % BLOCK_S
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    offs_u = tl.arange(0, BLOCK_V)
    d_ok = offs_d < D
    rows = b0 + offs_r  # [ROWS]
    row_at = rows.to(tl.int64)[:, None] * V  # [ROWS, 1] starts of the rows of [B, V]
    acc = tl.zeros([ROWS * BLOCK_S, BLOCK_D], dtype=tl.float32)
    acc += tl.load(poison_ptr + offs_d, mask=d_ok, other=0.0)[None, :]
    for v0 in range(0, V, BLOCK_V):
        offs_v = v0 + offs_u
        v_ok = offs_v < V
        ok = (rows < B)[:, None] & v_ok[None, :]
        coef = tl.load(coef_ptr + row_at + offs_v[None, :], mask=ok, other=0.0)  # [ROWS, BLOCK_V]
        s_arg = tl.load(arg_ptr + row_at + offs_v[None, :], mask=ok, other=-1)
        # [ROWS, BLOCK_S, BLOCK_V] -> [M, BLOCK_V]: the transposed one-hot-times-coef tile of this V tile
        hit = (s0 + offs_t)[None, :, None] == s_arg[:, None, :]
        p = tl.reshape(tl.where(hit, coef[:, None, :], 0.0), [ROWS * BLOCK_S, BLOCK_V])
        e = tl.load(
            e_ptr + offs_v.to(tl.int64)[:, None] * stride_ev + offs_d[None, :],
            mask=v_ok[:, None] & d_ok[None, :],
            other=0.0,
        )  # [BLOCK_V, BLOCK_D]: one tile of E serves ROWS batch rows
        if SPLIT:
            hi = p.to(e.dtype)
            lo = (p - hi.to(tl.float32)).to(e.dtype)
            if UPCAST_DOT:
                hi, lo, e = hi.to(tl.float32), lo.to(tl.float32), e.to(tl.float32)
            acc = tl.dot(hi, e, acc)  # [M, BLOCK_V] @ [BLOCK_V, BLOCK_D] -> [M, BLOCK_D]
            acc = tl.dot(lo, e, acc)
        else:
            acc = tl.dot(p, e.to(tl.float32), acc, input_precision="ieee")
    out = (m_row.to(tl.int64) * S + m_pos)[:, None] * D + offs_d[None, :]
    out_ok = (m_row < B) & (m_pos < S)
    tl.store(grad_h_ptr + out, acc.to(grad_h_ptr.dtype.element_ty), mask=out_ok[:, None] & d_ok[None, :])


# ---------------------------------------------------------------------------------------------------
# Launchers
# ---------------------------------------------------------------------------------------------------

# Index widths (V up to 250,002, D up to 4,096, any B): every offset that can pass 2^31 is int64 in the
# kernels: b·S·D into H (`b.to(tl.int64) * stride_hb`, or a 64-bit pointer advanced by stride_hb),
# v·D into E and grad_E (`offs_v.to(tl.int64)`; 151,936 × 4,096 = 6.2e8 already needs 30 bits), b·V
# into max/argmax/coef (`b.to(tl.int64) * V`, 64-bit pointers advanced by V; B·V passes 2^31 from
# B = 14,125 at V = 151,936) and the CSR offsets (int64: searchsorted, the column counts' cumsum). The
# column layout's flat indices b·V + v are int32 only while B·V < 2^31 (``_order_dtype``), and the
# kernels that read them widen b = idx // V to int64 before any stride. What stays int32 is bounded
# far below: s·D within one row (S·D <= 8,192 × 4,096 = 2^25), b·S + s (the mask, CSR row keys; B·S
# tokens < 2^31 whenever H fits in memory), grid sizes (B·cdiv(V, BLOCK_V), B·S). A test crossing 2^31
# would need tensors of more than 8 GB, so this is reasoned here and exercised at V = 151,936, D = 4,096
# by benchmarks/check_head_gpu.py.


def _default_forward_blocks(dtype: torch.dtype, seq_len: int) -> ForwardBlocks | PackedForwardBlocks:
    """The kernel and tiles for a dtype and S; the interpreter makes the same choice of kernel."""
    interpreting = _interpreting()
    if dtype != torch.float32 and seq_len <= _PACKED_MAX_S:
        return _FWD_PACKED_INTERPRET if interpreting else _FWD_GPU_16BIT_PACKED
    if interpreting:
        return _FWD_INTERPRET
    return _FWD_GPU_FP32 if dtype == torch.float32 else _FWD_GPU_16BIT


def _forward_dot_mode(dtype: torch.dtype) -> dict[str, object]:
    """How the forward kernels call tl.dot: IEEE fp32 for fp32 inputs ("tf32" is ignored for 16-bit)."""
    return {
        "DOT_PRECISION": "ieee" if dtype == torch.float32 else "tf32",
        # Triton 3.9's interpreter multiplies bf16 tl.dot operands wrongly (errors ~1e10); bf16 -> fp32 is
        # exact and the GPU's bf16 MMA forms the same exact products, so upcasting there computes the
        # same function. Never set on a GPU.
        "UPCAST_DOT": _interpreting() and dtype == torch.bfloat16,
    }


def sparton_forward(
    hidden_states: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    attention_mask: Tensor,
    *,
    blocks: ForwardBlocks | PackedForwardBlocks | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Fused forward: (Y [B, V] in the dtype of H, fp32 max [B, V], int32 argmax [B, V]).

    Expects validated inputs (``head.py`` checks them): H [B, S, D] and E [V, D] of one dtype among
    fp16/bf16/fp32 on one device, bias [V] or None, a 0/1 mask [B, S]. Y = log1p(max), computed from the
    fp32 max and rounded once to the output dtype. ``blocks`` picks the kernel: ``ForwardBlocks`` the
    one-row kernel (any S), ``PackedForwardBlocks`` the packed-rows one (short S); by default the
    packed one for 16-bit inputs with S <= 64, the one-row one otherwise.
    """
    B, S, _ = hidden_states.shape
    V = weight.shape[0]
    blocks = blocks or _default_forward_blocks(hidden_states.dtype, S)
    h = hidden_states.contiguous()
    e = weight.contiguous()
    mask = attention_mask.to(torch.uint8).contiguous()
    mx = torch.empty(B, V, device=h.device, dtype=torch.float32)
    arg = torch.empty(B, V, device=h.device, dtype=torch.int32)
    launch = _forward_packed if isinstance(blocks, PackedForwardBlocks) else _forward_one_row
    launch(h, e, bias.contiguous() if bias is not None else None, mask, mx, arg, blocks)
    y = torch.log1p(mx).to(hidden_states.dtype)  # [B, V]; relu already applied (max starts at 0)
    return y, mx, arg


def _forward_one_row(
    h: Tensor, e: Tensor, bias: Tensor | None, mask: Tensor, mx: Tensor, arg: Tensor, blocks: ForwardBlocks
) -> None:
    """One program per (batch row, V tile), walking the row's S tiles (``_sparton_fwd_kernel``)."""
    B, S, D = h.shape
    V = e.shape[0]
    # [B, S] -> [B]: 1 + last unmasked position (0 if none), so right padding is never computed
    positions = torch.arange(1, S + 1, device=h.device, dtype=torch.int32)
    lengths = (mask * positions).amax(dim=1).to(torch.int32)
    grid = (B * triton.cdiv(V, blocks.block_v),)
    _sparton_fwd_kernel[grid](
        h,
        e,
        bias if bias is not None else mx,  # dummy pointer, never read without bias
        mask,
        lengths,
        mx,
        arg,
        B,
        S,
        V,
        D,
        h.stride(0),
        h.stride(1),
        e.stride(0),
        mask.stride(0),
        HAS_BIAS=bias is not None,
        EVEN_D=D % blocks.block_d == 0,
        **_forward_dot_mode(h.dtype),
        BLOCK_S=blocks.block_s,
        BLOCK_V=blocks.block_v,
        BLOCK_D=blocks.block_d,
        GROUP_B=blocks.group_b,
        num_warps=blocks.num_warps,
        num_stages=blocks.num_stages,
    )


def _forward_packed(
    h: Tensor,
    e: Tensor,
    bias: Tensor | None,
    mask: Tensor,
    mx: Tensor,
    arg: Tensor,
    blocks: PackedForwardBlocks,
) -> None:
    """One program per (G batch rows, V tile), G = block_n // S_pad (``_sparton_fwd_packed_kernel``).

    S_pad is a compile-time constant, so each power of two up to S_pad recompiles once (7 variants up
    to S = 64); B and S themselves do not.
    """
    B, S, D = h.shape
    V = e.shape[0]
    s_pad = triton.next_power_of_2(S)
    rows = max(1, blocks.block_n // s_pad)
    grid = (triton.cdiv(B, rows) * triton.cdiv(V, blocks.block_v),)
    _sparton_fwd_packed_kernel[grid](
        h,
        e,
        bias if bias is not None else mx,  # dummy pointer, never read without bias
        mask,
        mx,
        arg,
        B,
        S,
        V,
        D,
        h.stride(0),
        h.stride(1),
        e.stride(0),
        mask.stride(0),
        HAS_BIAS=bias is not None,
        EVEN_D=D % blocks.block_d == 0,
        **_forward_dot_mode(h.dtype),
        S_PAD=s_pad,
        ROWS=rows,
        BLOCK_V=blocks.block_v,
        BLOCK_D=blocks.block_d,
        GROUP_N=blocks.group_n,
        num_warps=blocks.num_warps,
        num_stages=blocks.num_stages,
    )


def _order_dtype(B: int, V: int) -> torch.dtype:
    """int32 flat indices b·V + v where they fit (half the bytes written and read), else int64."""
    return torch.int32 if B * V < 2**31 else torch.int64


def _column_segments(
    coef: Tensor, live: Tensor, limit: int, block_b: int | None = None, block_v: int | None = None
) -> tuple[Tensor, Tensor]:
    """(order [B·V], offsets [V + 1] int64): the non-zeros of coef [B, V] column by column, b increasing
    within a column (a fixed summation order), as the flat index b·V + v; column v's entries are
    order[offsets[v]:offsets[v + 1]], the rest of order is not written. Skipped on the device (order
    left unwritten) unless live < limit, where grad_E runs by column."""
    B, V = coef.shape
    interpreting = _interpreting()
    block_b = block_b or (_COLUMN_BLOCK_B_INTERPRET if interpreting else _COLUMN_BLOCK_B)
    block_v = block_v or (_COLUMN_BLOCK_V_INTERPRET if interpreting else _COLUMN_BLOCK_V)
    grid = (triton.cdiv(V, block_v),)
    launch = dict(BLOCK_B=block_b, BLOCK_V=block_v)
    order = torch.empty(B * V, device=coef.device, dtype=_order_dtype(B, V))
    # Counted by the kernel's first pass: 0.13 ms for the whole layout at B = 512, S = 32 (32 x 64 tiles)
    # against 0.20 with torch's (coef != 0).sum(0) for the counts.
    counts = torch.zeros(V, device=coef.device, dtype=torch.int64)  # stays 0 where the kernel returns
    _column_segments_kernel[grid](coef, counts, order, live, limit, B, V, **launch, WRITE=False)
    offsets = torch.zeros(V + 1, device=coef.device, dtype=torch.int64)
    torch.cumsum(counts, dim=0, out=offsets[1:])
    starts = offsets[:-1].clone()  # [V]: the write pass advances these
    _column_segments_kernel[grid](coef, starts, order, live, limit, B, V, **launch, WRITE=True)
    return order, offsets


def _row_segments(coef: Tensor, arg: Tensor, S: int) -> tuple[Tensor, Tensor]:
    """(order [B·V] int64, offsets [B·S + 1] int64): the non-zeros of coef [B, V] by destination row
    b·S + argmax[b, v], v increasing within a row (a fixed summation order), as the flat index b·V + v;
    row r's entries are order[offsets[r]:offsets[r + 1]], the zeros after them."""
    B = coef.shape[0]
    # Keyed by destination row, zeros given the sentinel B·S (sorting last); torch.sort's stable radix
    # sort, whose passes scale with the key's width: where B·S < 2^15 (queries: 512 x 32 = 16,384) int16
    # keys take half the passes of int32 ones, over all B·V keys (15.6M at B = 512, V = 30,522).
    key_dtype = torch.int16 if B * S < _INT16_KEYS_BELOW else torch.int32
    rows = torch.arange(B, device=coef.device, dtype=key_dtype)[:, None] * S  # [B, 1]
    keys = torch.where(coef != 0, rows + arg.to(key_dtype), B * S).reshape(-1)  # [B·V]
    sorted_keys, order = torch.sort(keys, stable=True)
    bounds = torch.arange(B * S + 1, device=coef.device, dtype=key_dtype)
    return order, torch.searchsorted(sorted_keys, bounds)


def _default_backward_blocks(dtype: torch.dtype) -> BackwardBlocks:
    """The default tiles; fp32 inputs take the longer sequences' kernels whatever S (grad_H's tensor-core
    kernel multiplies fp32 in IEEE FMA, slower than the gather), the interpreter making the same choice."""
    blocks = _BWD_INTERPRET if _interpreting() else _BWD_GPU
    return replace(blocks, short_s=0) if dtype == torch.float32 else blocks


def _row_segments_from_columns(
    order: Tensor, arg: Tensor, S: int, live: Tensor, limit: int
) -> tuple[Tensor, Tensor]:
    """``_row_segments``' layout (the same entries in the same order) built from the column layout's
    first ``limit`` slots instead of all B·V entries: where live < limit they hold every non-zero, v
    increasing (column order), and a stable sort by destination row keeps v increasing within a row.
    Where live >= limit the column layout was not written: every key is the sentinel (the sort still
    runs, 0.16-0.20 ms at B·V = 15.6M) and every row is left empty."""
    B, V = arg.shape
    capacity = min(limit, B * V)
    key_dtype = torch.int16 if B * S < _INT16_KEYS_BELOW else torch.int32
    keys = torch.empty(capacity, device=arg.device, dtype=key_dtype)
    block = _ROW_KEYS_BLOCK_INTERPRET if _interpreting() else _ROW_KEYS_BLOCK
    grid = (triton.cdiv(capacity, block),)
    _row_keys_kernel[grid](order, arg, keys, live, limit, capacity, V, S, B * S, BLOCK=block)
    sorted_keys, by_row = torch.sort(keys, stable=True)
    bounds = torch.arange(B * S + 1, device=arg.device, dtype=key_dtype)
    return order[:capacity][by_row], torch.searchsorted(sorted_keys, bounds)


def _sparse_backward(
    h: Tensor,
    e: Tensor,
    coef: Tensor,
    arg: Tensor,
    needs: tuple[bool, bool],
    blocks: BackwardBlocks,
) -> tuple[Tensor | None, Tensor | None]:
    """(grad_H, grad_E), each None where ``needs`` (H, E) says it is not needed. The count of non-zeros,
    read on the device, picks each one's kernel (``blocks.by_column_below``, ``blocks.short_s``)."""
    need_h, need_e = needs
    B, S, _ = h.shape
    V = e.shape[0]
    live = torch.count_nonzero(coef)  # [] int64, read by the kernels on the device
    # the sparse regime where live < limit; clamped so that 0 means never and anything above 1 always
    limit = min(max(int(blocks.by_column_below * B * V), 0), B * V + 1)
    short = blocks.short_s >= S
    order = col_offsets = None
    if limit > 0 and (need_e or (need_h and short)):
        order, col_offsets = _column_segments(coef, live, limit)  # [B·V], [V + 1]
    grad_e = _grad_e(h, coef, arg, live, limit, order, col_offsets, e.dtype, blocks) if need_e else None
    grad_h = _grad_h(e, coef, arg, S, live, limit, order, short, h.dtype, blocks) if need_h else None
    return grad_h, grad_e


def _grad_e(
    h: Tensor,
    coef: Tensor,
    arg: Tensor,
    live: Tensor,
    limit: int,
    order: Tensor | None,
    col_offsets: Tensor | None,
    dtype: torch.dtype,
    blocks: BackwardBlocks,
) -> Tensor:
    """grad_E [V, D] = Σ_b coef[b, v] · H[b, argmax[b, v]]: by column where live < limit (the column
    layout given), else by the b loop; NaN in H's non-finite columns."""
    B, _, D = h.shape
    V = coef.shape[1]
    poison = non_finite_columns(h, dim=(0, 1))  # [D]
    grad_e = torch.empty(V, D, device=h.device, dtype=dtype)  # every entry written by the kernel that runs
    if limit > 0:
        assert order is not None and col_offsets is not None
        _sparton_bwd_grad_e_by_column_kernel[(V,)](
            h,
            col_offsets,
            order,
            coef,
            arg,
            poison,
            grad_e,
            live,
            limit,
            V,
            D,
            h.stride(0),
            h.stride(1),
            BLOCK_D=blocks.c_block_d,
            BLOCK_N=blocks.c_block_n,
            num_warps=blocks.c_num_warps,
        )
    if limit <= B * V:
        grid = (triton.cdiv(V, blocks.e_block_v), triton.cdiv(D, blocks.e_block_d))
        _sparton_bwd_grad_e_kernel[grid](
            h,
            coef,
            arg,
            poison,
            grad_e,
            live,
            limit,
            B,
            V,
            D,
            h.stride(0),
            h.stride(1),
            BLOCK_B=blocks.e_block_b,
            BLOCK_V=blocks.e_block_v,
            BLOCK_D=blocks.e_block_d,
            num_warps=blocks.e_num_warps,
        )
    return grad_e


def _grad_h(
    e: Tensor,
    coef: Tensor,
    arg: Tensor,
    S: int,
    live: Tensor,
    limit: int,
    order: Tensor | None,
    short: bool,
    dtype: torch.dtype,
    blocks: BackwardBlocks,
) -> Tensor:
    """grad_H [B, S, D] = Σ_{v: argmax[b, v] = s} coef[b, v] · E[v], NaN in E's non-finite columns: by
    destination row (CSR, no atomics). ``short`` (S <= ``blocks.short_s``): where live < limit
    the rows are built from the column layout ``order``, and where live >= limit the tensor-core kernel
    runs instead; else the rows come from a stable sort of all B·V keys, at any density."""
    B, V = coef.shape
    D = e.shape[1]
    poison = non_finite_columns(e, dim=0)  # [D]
    grad_h = torch.empty(B, S, D, device=e.device, dtype=dtype)  # every row written (zeros if no entry)
    # (rows [B·V], offsets [B·S + 1]) and the bound under which the CSR kernel runs
    if not short:
        layout, below = _row_segments(coef, arg, S), B * V + 1  # whatever the density
    elif limit > 0:
        assert order is not None
        layout, below = _row_segments_from_columns(order, arg, S, live, limit), limit
    else:
        layout, below = None, 0  # no column layout: the tensor cores only
    if layout is not None:
        rows, row_offsets = layout
        # The kernel reads v and coef through the layout itself, for the N non-zeros only.
        _sparton_bwd_grad_h_kernel[(B * S,)](
            e,
            row_offsets,
            rows,
            coef,
            poison,
            grad_h,
            live,
            below,
            V,
            D,
            e.stride(0),
            BLOCK_D=blocks.h_block_d,
            BLOCK_N=blocks.h_block_n,
            num_warps=blocks.h_num_warps,
        )
    if short and limit <= B * V:
        dense = _DENSE_BWD_INTERPRET if _interpreting() else _DENSE_BWD_GPU
        _launch_dense_grad_h(e, coef, arg, poison, grad_h, live, limit, dense)
    return grad_h


def _dot_mode(dtype: torch.dtype) -> dict[str, object]:
    """How the dense kernels multiply the fp32 one-hot-times-coef tile by 16-bit or fp32 operands:
    bf16 as a hi + lo pair of bf16 tiles (coef to 16 bits, products exact, fp32 sums); fp32 and fp16
    (whose range would flush the lo part of small coefficients) in IEEE fp32."""
    split = dtype == torch.bfloat16
    return {"SPLIT": split, "UPCAST_DOT": _interpreting() and split}


def _whole_rows(S: int, block: int) -> tuple[int, int]:
    """(rows, BLOCK_S) filling a ``block``-position tile of a dense backward product: whole rows of
    S_pad = the next power of two >= S, ``block // S_pad`` of them, where one fits; else S tiles of one
    row. The products then stay ``block`` wide (tl.dot needs 16 or more) whatever S is."""
    s_pad = triton.next_power_of_2(S)
    return (block // s_pad, s_pad) if s_pad <= block else (1, block)


def _grad_e_dense(
    h: Tensor, coef: Tensor, arg: Tensor, V: int, dtype: torch.dtype, blocks: DenseBackwardBlocks
) -> Tensor:
    """grad_E [V, D] = Σ_b P_b @ H[b], P_b [V, S] = coef[b, v] at (v, argmax[b, v]): tensor-core products,
    K = e_block_k positions per step (whole rows side by side where S fits)."""
    B, S, D = h.shape
    poison = non_finite_columns(h, dim=(0, 1))  # [D]
    grad_e = torch.empty(V, D, device=h.device, dtype=dtype)
    rows, block_s = _whole_rows(S, blocks.e_block_k)
    grid = (triton.cdiv(V, blocks.e_block_v), triton.cdiv(D, blocks.e_block_d))
    _sparton_bwd_dense_grad_e_kernel[grid](
        h,
        coef,
        arg,
        poison,
        grad_e,
        B,
        S,
        V,
        D,
        h.stride(0),
        h.stride(1),
        **_dot_mode(h.dtype),
        ROWS=rows,
        BLOCK_V=blocks.e_block_v,
        BLOCK_S=block_s,
        BLOCK_D=blocks.e_block_d,
        num_warps=blocks.e_num_warps,
    )
    return grad_e


def _grad_h_dense(
    e: Tensor, coef: Tensor, arg: Tensor, S: int, dtype: torch.dtype, blocks: DenseBackwardBlocks
) -> Tensor:
    """grad_H [B, S, D] = P_b^T @ E per batch row, P_b^T [S, V] built tile by tile from (coef, argmax);
    M = h_block_m positions per program (whole rows stacked where S fits, sharing each E tile)."""
    B = coef.shape[0]
    poison = non_finite_columns(e, dim=0)  # [D]
    grad_h = torch.empty(B, S, e.shape[1], device=e.device, dtype=dtype)
    _launch_dense_grad_h(e, coef, arg, poison, grad_h, torch.count_nonzero(coef), 0, blocks)  # runs always
    return grad_h


def _launch_dense_grad_h(
    e: Tensor,
    coef: Tensor,
    arg: Tensor,
    poison: Tensor,
    grad_h: Tensor,
    live: Tensor,
    limit: int,
    blocks: DenseBackwardBlocks,
) -> None:
    """``_sparton_bwd_dense_grad_h_kernel`` into grad_h [B, S, D] where live >= limit (decided on the
    device)."""
    B, S, D = grad_h.shape
    V = coef.shape[1]
    rows, block_s = _whole_rows(S, blocks.h_block_m)
    grid = (triton.cdiv(B, rows) * triton.cdiv(S, block_s), triton.cdiv(D, blocks.h_block_d))
    _sparton_bwd_dense_grad_h_kernel[grid](
        e,
        coef,
        arg,
        poison,
        grad_h,
        live,
        limit,
        B,
        S,
        V,
        D,
        e.stride(0),
        **_dot_mode(e.dtype),
        ROWS=rows,
        BLOCK_V=blocks.h_block_v,
        BLOCK_S=block_s,
        BLOCK_D=blocks.h_block_d,
        num_warps=blocks.h_num_warps,
        num_stages=blocks.h_num_stages,
    )


def sparton_backward(
    grad_y: Tensor,
    hidden_states: Tensor,
    weight: Tensor,
    max_logits: Tensor,
    argmax: Tensor,
    *,
    needs_input_grad: tuple[bool, bool, bool] = (True, True, True),
    dense: bool = False,
    blocks: BackwardBlocks | DenseBackwardBlocks | None = None,
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """Backward from the saved (max, argmax): (grad_H [B, S, D], grad_E [V, D], fp32 grad_bias [V]).

    Sparse (default): work and traffic proportional to the non-zeros of Y, except that for short
    16-bit sequences with dense Y (``BackwardBlocks.short_s``, chosen on the device) grad_H takes the
    tensor-core kernel below. ``dense``: the [V, S] tile of coef-at-the-argmax is built on the fly
    from (coef, argmax) and multiplied with tensor cores (grad_E = P @ H, grad_H = P^T @ E per batch
    row): work proportional to B·S·V·D whatever the sparsity; where S fits, several whole rows share
    one product (one E tile serves them all); its grad_E lost to the gathering b loop at every
    density measured, so this mode is opt-in.
    Both: gradients of masked positions and of outputs equal to 0 are exactly 0, deterministic (no
    atomics), and non-finite values propagate as autograd through :func:`sparton_head_reference`
    propagates them (see its docstring). ``needs_input_grad`` (H, E, bias): a gradient not needed is
    neither computed nor allocated (None).
    """
    need_h, need_e, need_bias = needs_input_grad
    h, e = hidden_states.contiguous(), weight.contiguous()
    S = h.shape[1]
    V = e.shape[0]
    arg = argmax.to(torch.int32).contiguous()
    coef = backward_coefficients(grad_y, max_logits).contiguous()  # [B, V] fp32
    grad_bias = coef.sum(dim=0) if need_bias else None  # [B, V] -> [V]
    if dense:
        blocks = blocks or (_DENSE_BWD_INTERPRET if _interpreting() else _DENSE_BWD_GPU)
        assert isinstance(blocks, DenseBackwardBlocks)
        grad_e = _grad_e_dense(h, coef, arg, V, e.dtype, blocks) if need_e else None
        grad_h = _grad_h_dense(e, coef, arg, S, h.dtype, blocks) if need_h else None
    else:
        blocks = blocks or _default_backward_blocks(h.dtype)
        assert isinstance(blocks, BackwardBlocks)
        grad_h, grad_e = _sparse_backward(h, e, coef, arg, (need_h, need_e), blocks)
    return grad_h, grad_e, grad_bias
