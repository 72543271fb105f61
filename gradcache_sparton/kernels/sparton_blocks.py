"""Tile sizes of the Sparton kernels: the block dataclasses, the defaults per device and dtype, and the
choice of defaults for a launch.

Each constant says in one line why it has its value; how each was measured (the candidates timed, on
which device, with which command) is in docs/kernels.md, "How the constants were chosen". Pure Python:
importing this module does not import triton.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch

# The launchers' interface (sparton_forward, sparton_backward, sparton_backward_dense): the block classes,
# the default tiles for a launch, and whether the Triton interpreter runs them.
__all__ = [
    "INT16_KEYS_BELOW",
    "BackwardBlocks",
    "DenseBackwardBlocks",
    "ForwardBlocks",
    "PackedForwardBlocks",
    "column_layout_blocks",
    "default_backward_blocks",
    "default_dense_backward_blocks",
    "default_forward_blocks",
    "interpreting",
    "row_keys_block",
    "two_pass_forward",
]


@dataclass(frozen=True)
class ForwardBlocks:
    """Tile sizes and launch parameters of the forward kernel."""

    block_s: int  # sequence rows per tensor-core tile (the M of the product)
    block_v: int  # vocabulary columns per program (the N)
    block_d: int  # hidden-dim step of the K loop
    group_b: int  # batch rows scheduled together, so their H[b] and E tiles share L2
    num_warps: int
    num_stages: int
    tma: bool  # 16-bit inputs on sm90+: H and E tiles by tensor descriptors where the inputs allow
    persistent: bool  # with TMA loads: one program per SM, looping over (batch row, V tile) pairs


@dataclass(frozen=True)
class PackedForwardBlocks:
    """Tile sizes and launch parameters of the packed-rows forward kernel (short sequences)."""

    block_n: int  # G·S_pad: G batch rows' positions side by side (the N of the product), S_pad = 2^k >= S
    block_v: int  # vocabulary rows per program (the M)
    block_d: int  # hidden-dim step of the K loop
    group_n: int  # row groups scheduled together, so their H rows and E tiles share L2
    num_warps: int
    num_stages: int
    tma: bool  # 16-bit inputs on sm90+: H and E tiles by tensor descriptors where the inputs allow


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
    # Fewer batch rows than this: the b loop whatever the density (its B dependent steps are few, and the
    # column layout's launches cost more than they save).
    by_column_min_b: int
    # S <= short_s: grad_H's layout is built from grad_E's column layout where Y is sparse, and grad_H
    # runs on the tensor cores where it is dense. Longer S: grad_H's layout by a stable sort of all B·V
    # keys, whatever the density. (The default blocks set it to 0 for fp32 inputs.)
    short_s: int


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


# 16-bit, one row per program: the fastest tile timed on an H100 (wide N: fewer epilogues and E re-reads) and
# again with TMA loads on an H200; TMA loads and a persistent grid: 1.18-1.21x faster than pointer loads.
_FWD_GPU_16BIT = ForwardBlocks(
    block_s=256, block_v=128, block_d=64, group_b=8, num_warps=8, num_stages=3, tma=True, persistent=True
)
# fp32: IEEE FMA dots (no TF32) gain nothing from a tensor-core tile; a smaller one eases register pressure.
_FWD_GPU_FP32 = ForwardBlocks(
    block_s=64, block_v=64, block_d=32, group_b=8, num_warps=4, num_stages=2, tma=False, persistent=False
)
# Interpreter: the smallest tiles tl.dot accepts (16), so the tests' awkward shapes span several tiles; the
# GPU's load mode and grid (16-bit inputs: TMA, persistent).
_FWD_INTERPRET = ForwardBlocks(
    block_s=16, block_v=16, block_d=16, group_b=2, num_warps=1, num_stages=1, tma=True, persistent=True
)
# One-row forward in two launches (the plain max, then a NaN-aware redo only where the inputs' bound fails)
# from this many multiply-adds B·S·V·D on; one NaN-aware launch below. H200, bf16, head_regression A/B against
# the one-launch kernel (2026-11-26, three calls): 2-9% faster forward at 7.7e11 and above (B 128 S 256,
# B 64 / 128 S 512, B 16 S 512 D 2,048 V 128,256); at 1.9e11 (B 32 S 256) the bound's reductions and the
# second launch cost as much as they save. The packed kernel (S <= 64) stays one launch (1.3-1.5x slower
# in two at S 32).
_TWO_PASS_MIN_MACS = 2**39

# 16-bit sequences up to this length (queries, issue 15's bound) take the packed-rows kernel.
_PACKED_MAX_S = 64
# Packed rows, 16-bit: N = 128 (4 rows at S = 32) x M = 128, the fastest tile timed on an H100 and, with TMA
# loads (1.21-1.24x faster than pointer loads), on an H200.
_FWD_GPU_16BIT_PACKED = PackedForwardBlocks(
    block_n=128, block_v=128, block_d=64, group_n=8, num_warps=4, num_stages=3, tma=True
)
# Interpreter: N = 128 packs 2 to 128 rows of the tests' shapes (S = 1 .. 64): groups straddle B, masked rows.
_FWD_PACKED_INTERPRET = PackedForwardBlocks(
    block_n=128, block_v=16, block_d=16, group_n=2, num_warps=1, num_stages=1, tma=True
)


# Gathers bound by L2 bytes: small programs won on an H100; by column below 25% of Y non-zero, short_s = 64.
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
    by_column_min_b=64,
    short_s=64,
)
# grad_E's column layout (a two-pass counting sort): rows x columns per program, the fastest timed on an H100.
_COLUMN_BLOCK_B, _COLUMN_BLOCK_V = 32, 32
# grad_H's row-sort keys are int16 below this B·S (half the radix sort's passes of int32 keys), else int32.
INT16_KEYS_BELOW = 2**15
# grad_H's row keys from the column layout, entries per program (not tuned); several programs per test.
_ROW_KEYS_BLOCK, _ROW_KEYS_BLOCK_INTERPRET = 1024, 16
# Interpreter: partial tiles in b and v at the tests' shapes.
_COLUMN_BLOCK_B_INTERPRET, _COLUMN_BLOCK_V_INTERPRET = 2, 16
# Interpreter: B = 3 and 5 end on a partial b step, columns on partial by-column steps (either kernel forced).
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
    by_column_min_b=1,  # the tests' B are 1-8: both regimes reachable
    short_s=64,
)


# Tensor-core backward: the fastest tiles timed on an H100 and an H200 (grad_H's runs for short dense Y).
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
# Interpreter: 64-position products, so the tests' S = 21 and 29 pack 2 rows (B = 3 and 5: a partial group).
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


def interpreting() -> bool:
    """Whether the kernels run under the Triton interpreter (TRITON_INTERPRET=1): the tests' small tiles."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def default_forward_blocks(dtype: torch.dtype, seq_len: int) -> ForwardBlocks | PackedForwardBlocks:
    """The kernel and tiles for a dtype and S; the interpreter makes the same choice of kernel."""
    interpreter = interpreting()
    if dtype != torch.float32 and seq_len <= _PACKED_MAX_S:
        return _FWD_PACKED_INTERPRET if interpreter else _FWD_GPU_16BIT_PACKED
    if interpreter:
        return _FWD_INTERPRET
    return _FWD_GPU_FP32 if dtype == torch.float32 else _FWD_GPU_16BIT


def default_backward_blocks(dtype: torch.dtype) -> BackwardBlocks:
    """The default tiles; fp32 inputs take the longer sequences' kernels whatever S (grad_H's tensor-core
    kernel multiplies fp32 in IEEE FMA, slower than the gather), the interpreter making the same choice."""
    blocks = _BWD_INTERPRET if interpreting() else _BWD_GPU
    return replace(blocks, short_s=0) if dtype == torch.float32 else blocks


def default_dense_backward_blocks() -> DenseBackwardBlocks:
    """The tensor-core backward's default tiles (the interpreter's small ones under TRITON_INTERPRET=1)."""
    return _DENSE_BWD_INTERPRET if interpreting() else _DENSE_BWD_GPU


def column_layout_blocks() -> tuple[int, int]:
    """(rows, columns) per program of grad_E's column layout."""
    if interpreting():
        return _COLUMN_BLOCK_B_INTERPRET, _COLUMN_BLOCK_V_INTERPRET
    return _COLUMN_BLOCK_B, _COLUMN_BLOCK_V


def row_keys_block() -> int:
    """Entries per program of grad_H's row keys built from the column layout."""
    return _ROW_KEYS_BLOCK_INTERPRET if interpreting() else _ROW_KEYS_BLOCK


def two_pass_forward(B: int, S: int, D: int, V: int) -> bool:
    """Whether the one-row forward runs as two launches (see ``_TWO_PASS_MIN_MACS``)."""
    return B * S * D * V >= _TWO_PASS_MIN_MACS
