"""Triton backward of the Sparton SPLADE head on the tensor cores: the dense grad_E and grad_H kernels.

Legend: B batch, S sequence, D hidden, V vocabulary.

Each program builds the tile P[v, s] = coef[b, v] · 1[argmax[b, v] = s] in registers from (coef,
argmax) and multiplies it with tensor cores: grad_E += P @ H[b], grad_H[b] = Σ_V P^T @ E; where S fits,
whole rows share one product (one E tile serves them all). Work is 2·B·S·V·D per gradient whatever the
sparsity of Y. ``sparton_backward(dense=True)`` runs both; the sparse backward (``sparton_backward.py``)
runs grad_H here for short 16-bit sequences where Y is dense (``BackwardBlocks.short_s``). The tiles are
in ``sparton_blocks.py``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from gradcache_sparton.kernels.reference import non_finite_columns
from gradcache_sparton.kernels.sparton_blocks import DenseBackwardBlocks, interpreting

# The sparse backward (sparton_backward.py) launches these too: its tensor-core grad_H, and dense=True.
__all__ = ["grad_e_dense", "grad_h_dense", "launch_dense_grad_h"]


# ---------------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------------


@triton.jit
def _one_hot_dot(p, x, acc, SPLIT: tl.constexpr, UPCAST_DOT: tl.constexpr):
    """acc + p @ x for the fp32 one-hot-times-coef tile p [M, K] and a 16-bit or fp32 tile x [K, N]: bf16
    (SPLIT) as two exact products of p's hi and lo bf16 parts with fp32 sums, else in IEEE fp32."""
    if SPLIT:
        hi = p.to(x.dtype)
        lo = (p - hi.to(tl.float32)).to(x.dtype)
        if UPCAST_DOT:
            hi, lo, x = hi.to(tl.float32), lo.to(tl.float32), x.to(tl.float32)
        acc = tl.dot(hi, x, acc)
        acc = tl.dot(lo, x, acc)
    else:
        acc = tl.dot(p, x.to(tl.float32), acc, input_precision="ieee")
    return acc


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
            acc = _one_hot_dot(
                p, h, acc, SPLIT, UPCAST_DOT
            )  # [BLOCK_V, K] @ [K, BLOCK_D] -> [BLOCK_V, BLOCK_D]
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
        acc = _one_hot_dot(p, e, acc, SPLIT, UPCAST_DOT)  # [M, BLOCK_V] @ [BLOCK_V, BLOCK_D] -> [M, BLOCK_D]
    out = (m_row.to(tl.int64) * S + m_pos)[:, None] * D + offs_d[None, :]
    out_ok = (m_row < B) & (m_pos < S)
    tl.store(grad_h_ptr + out, acc.to(grad_h_ptr.dtype.element_ty), mask=out_ok[:, None] & d_ok[None, :])


# ---------------------------------------------------------------------------------------------------
# Launchers
# ---------------------------------------------------------------------------------------------------


def _product_constants(
    dtype: torch.dtype, rows: int, block_v: int, block_s: int, block_d: int
) -> dict[str, object]:
    """The dense kernels' compile-time constants: their tiles, and how they multiply the fp32
    one-hot-times-coef tile by 16-bit or fp32 operands: bf16 as a hi + lo pair of bf16 tiles (coef to 16
    bits, products exact, fp32 sums); fp32 and fp16 (whose range would flush the lo part of small
    coefficients) in IEEE fp32."""
    split = dtype == torch.bfloat16
    return {
        "SPLIT": split,
        "UPCAST_DOT": interpreting() and split,
        "ROWS": rows,
        "BLOCK_V": block_v,
        "BLOCK_S": block_s,
        "BLOCK_D": block_d,
    }


def _whole_rows(S: int, block: int) -> tuple[int, int]:
    """(rows, BLOCK_S) filling a ``block``-position tile of a dense backward product: whole rows of
    S_pad = the next power of two >= S, ``block // S_pad`` of them, where one fits; else S tiles of one
    row. The products then stay ``block`` wide (tl.dot needs 16 or more) whatever S is."""
    s_pad = triton.next_power_of_2(S)
    return (block // s_pad, s_pad) if s_pad <= block else (1, block)


def grad_e_dense(
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
        **_product_constants(h.dtype, rows, blocks.e_block_v, block_s, blocks.e_block_d),
        num_warps=blocks.e_num_warps,
    )
    return grad_e


def grad_h_dense(
    e: Tensor, coef: Tensor, arg: Tensor, S: int, dtype: torch.dtype, blocks: DenseBackwardBlocks
) -> Tensor:
    """grad_H [B, S, D] = P_b^T @ E per batch row, P_b^T [S, V] built tile by tile from (coef, argmax);
    M = h_block_m positions per program (whole rows stacked where S fits, sharing each E tile)."""
    B = coef.shape[0]
    poison = non_finite_columns(e, dim=0)  # [D]
    grad_h = torch.empty(B, S, e.shape[1], device=e.device, dtype=dtype)
    launch_dense_grad_h(e, coef, arg, poison, grad_h, torch.count_nonzero(coef), 0, blocks)  # runs always
    return grad_h


def launch_dense_grad_h(
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
        **_product_constants(e.dtype, rows, blocks.h_block_v, block_s, blocks.h_block_d),
        num_warps=blocks.h_num_warps,
        num_stages=blocks.h_num_stages,
    )
