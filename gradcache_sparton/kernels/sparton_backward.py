"""Triton backward of the Sparton SPLADE head from (max, argmax) alone: the sparse (gathering) kernels.

Legend: B batch, S sequence, D hidden, V vocabulary, N non-zeros of Y (at most B·V).

Layout (Liger order): ``@triton.jit`` kernels -> launchers -> :func:`sparton_backward`, the entry point.
The tensor-core (dense) kernels are in ``sparton_backward_dense.py``, the tiles in ``sparton_blocks.py``;
autograd and the CPU path in ``sparton_ops.py``. Imported only when a CUDA tensor reaches the head's
backward (or by the interpreter tests).

Backward, from (max, argmax) alone, with coef[b, v] = grad_y[b, v] / (1 + max[b, v]) where max > 0 or max
is NaN, else 0 (d log1p(x)/dx = 1/(1+x); relu passes nothing where max <= 0, and passes NaN); for the
``"log1p_relu"`` activation grad_y / ((1 + max)(1 + log1p(max))) (``backward_coefficients``, from the fp32
max). Only coef depends on the activation: the kernels below read it as they find it.
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
  instead (``sparton_backward_dense.py``, its [S, V] tile of coef at the argmax built in registers). The
  CSR and the tensor-core kernels are both launched, the one not selected returning at once.
- grad_bias[v] = Σ_b coef[b, v] (a [B, V] reduction, done by torch).
- Non-finite inputs: as autograd through the dense reference, grad_E[:, d] is NaN wherever column d of H
  holds a NaN or ±inf (0 · inf in the dense product), grad_H[:, :, d] wherever column d of E does: each
  kernel starts its accumulator from that [D] vector of 0 / NaN (one [D] load per program).
- A gradient the caller does not need (a frozen weight, hidden states that need no grad) is skipped.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from gradcache_sparton.kernels.reference import backward_coefficients, non_finite_columns
from gradcache_sparton.kernels.sparton_backward_dense import grad_e_dense, grad_h_dense, launch_dense_grad_h
from gradcache_sparton.kernels.sparton_blocks import (
    INT16_KEYS_BELOW,
    BackwardBlocks,
    DenseBackwardBlocks,
    column_layout_blocks,
    default_backward_blocks,
    default_dense_backward_blocks,
    row_keys_block,
)

__all__ = [
    "column_segments",
    "row_segments",
    "row_segments_from_columns",
    "sparse_backward",
    "sparton_backward",
]


# ---------------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------------


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


def _order_dtype(B: int, V: int) -> torch.dtype:
    """int32 flat indices b·V + v where they fit (half the bytes written and read), else int64."""
    return torch.int32 if B * V < 2**31 else torch.int64


def column_segments(
    coef: Tensor, live: Tensor, limit: int, block_b: int | None = None, block_v: int | None = None
) -> tuple[Tensor, Tensor]:
    """(order [B·V], offsets [V + 1] int64): the non-zeros of coef [B, V] column by column, b increasing
    within a column (a fixed summation order), as the flat index b·V + v; column v's entries are
    order[offsets[v]:offsets[v + 1]], the rest of order is not written. Skipped on the device (order
    left unwritten) unless live < limit, where grad_E runs by column."""
    B, V = coef.shape
    default_b, default_v = column_layout_blocks()
    block_b, block_v = block_b or default_b, block_v or default_v
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


def row_segments(coef: Tensor, arg: Tensor, S: int) -> tuple[Tensor, Tensor]:
    """(order [B·V] int64, offsets [B·S + 1] int64): the non-zeros of coef [B, V] by destination row
    b·S + argmax[b, v], v increasing within a row (a fixed summation order), as the flat index b·V + v;
    row r's entries are order[offsets[r]:offsets[r + 1]], the zeros after them."""
    B = coef.shape[0]
    # Keyed by destination row, zeros given the sentinel B·S (sorting last); torch.sort's stable radix
    # sort, whose passes scale with the key's width: where B·S < 2^15 (queries: 512 x 32 = 16,384) int16
    # keys take half the passes of int32 ones, over all B·V keys (15.6M at B = 512, V = 30,522).
    key_dtype = torch.int16 if B * S < INT16_KEYS_BELOW else torch.int32
    rows = torch.arange(B, device=coef.device, dtype=key_dtype)[:, None] * S  # [B, 1]
    keys = torch.where(coef != 0, rows + arg.to(key_dtype), B * S).reshape(-1)  # [B·V]
    sorted_keys, order = torch.sort(keys, stable=True)
    bounds = torch.arange(B * S + 1, device=coef.device, dtype=key_dtype)
    return order, torch.searchsorted(sorted_keys, bounds)


def row_segments_from_columns(
    order: Tensor, arg: Tensor, S: int, live: Tensor, limit: int
) -> tuple[Tensor, Tensor]:
    """``row_segments``' layout (the same entries in the same order) built from the column layout's
    first ``limit`` slots instead of all B·V entries: where live < limit they hold every non-zero, v
    increasing (column order), and a stable sort by destination row keeps v increasing within a row.
    Where live >= limit the column layout was not written: every key is the sentinel (the sort still
    runs, 0.16-0.20 ms at B·V = 15.6M) and every row is left empty."""
    B, V = arg.shape
    capacity = min(limit, B * V)
    key_dtype = torch.int16 if B * S < INT16_KEYS_BELOW else torch.int32
    keys = torch.empty(capacity, device=arg.device, dtype=key_dtype)
    block = row_keys_block()
    grid = (triton.cdiv(capacity, block),)
    _row_keys_kernel[grid](order, arg, keys, live, limit, capacity, V, S, B * S, BLOCK=block)
    sorted_keys, by_row = torch.sort(keys, stable=True)
    bounds = torch.arange(B * S + 1, device=arg.device, dtype=key_dtype)
    return order[:capacity][by_row], torch.searchsorted(sorted_keys, bounds)


def sparse_backward(
    h: Tensor,
    e: Tensor,
    coef: Tensor,
    arg: Tensor,
    needs: tuple[bool, bool],
    blocks: BackwardBlocks,
) -> tuple[Tensor | None, Tensor | None]:
    """(grad_H, grad_E), each None where ``needs`` (H, E) says it is not needed. The count of non-zeros,
    read on the device, picks each one's kernel (``blocks.by_column_below``, ``blocks.short_s``); under
    ``blocks.by_column_min_b`` rows, the dense regime's kernels whatever the count."""
    need_h, need_e = needs
    B, S, _ = h.shape
    V = e.shape[0]
    live = torch.count_nonzero(coef)  # [] int64, read by the kernels on the device
    # the sparse regime where live < limit; clamped so that 0 means never and anything above 1 always
    below = blocks.by_column_below if blocks.by_column_min_b <= B else 0.0
    limit = min(max(int(below * B * V), 0), B * V + 1)
    short = blocks.short_s >= S
    order = col_offsets = None
    if limit > 0 and (need_e or (need_h and short)):
        order, col_offsets = column_segments(coef, live, limit)  # [B·V], [V + 1]
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
        layout, below = row_segments(coef, arg, S), B * V + 1  # whatever the density
    elif limit > 0:
        assert order is not None
        layout, below = row_segments_from_columns(order, arg, S, live, limit), limit
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
        launch_dense_grad_h(e, coef, arg, poison, grad_h, live, limit, default_dense_backward_blocks())
    return grad_h


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
    activation_function: str = "relu",
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """Backward from the saved (max, argmax): (grad_H [B, S, D], grad_E [V, D], fp32 grad_bias [V]).

    ``activation_function``: the forward's; it decides coef (module doc), nothing else.

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
    coef = backward_coefficients(grad_y, max_logits, activation_function).contiguous()  # [B, V] fp32
    grad_bias = coef.sum(dim=0) if need_bias else None  # [B, V] -> [V]
    if dense:
        blocks = blocks or default_dense_backward_blocks()
        assert isinstance(blocks, DenseBackwardBlocks)
        grad_e = grad_e_dense(h, coef, arg, V, e.dtype, blocks) if need_e else None
        grad_h = grad_h_dense(e, coef, arg, S, h.dtype, blocks) if need_h else None
    else:
        blocks = blocks or default_backward_blocks(h.dtype)
        assert isinstance(blocks, BackwardBlocks)
        grad_h, grad_e = sparse_backward(h, e, coef, arg, (need_h, need_e), blocks)
    return grad_h, grad_e, grad_bias
