"""Triton kernels of the fused sparse log-sum-exp (:mod:`.fused_lse`): score tiles on chip, never in memory.

Legend: B queries, V vocabulary, bd documents of one document block, BM × BN one score tile (queries ×
documents), BK columns per product step, K_t the padded active columns of query tile t.

Inputs, built by :mod:`.fused_lse` (its module doc has the layout and the exactness argument):

- ``QT`` [K_total, BM]: every query tile's reps over its own active columns, transposed (row k of tile t
  holds the BM queries' weights at vocabulary id ``COLS[k]``); tile t owns rows ``TILE_PTR[t]:TILE_PTR[t+1]``
  (a multiple of BK, padded with id V, whose weights are zero);
- ``DT`` [V + 1, bd]: one document block densified over the whole vocabulary, transposed (row V zero), so
  the BK rows a query tile needs are gathered as contiguous runs of documents.

A score tile is ``sum_k QT[k, :]ᵀ · DT[COLS[k], n-tile]`` over the tile's columns: ``tl.dot`` steps of [BM, BK] @
[BK, BN] -> [BM, BN] with fp32 accumulation (bf16 operands: exact products; fp32 operands:
``input_precision="ieee"``, no TF32). A program takes one query tile against one window of the block's documents
(W windows a block, ``TileShape.doc_window``; W = 1 by default): program p takes window p % W of tile p // W, so a
tile's windows run side by side and share its reads of QT. The forward keeps a running max and sum per query and
window (online log-sum-exp), merged after the last block. In the backward :func:`_scan_kernel` recomputes each
tile, forms ``p = exp(s - lse) · g`` and takes it by its count of non-zero ``p``: none, passed over; few, listed
as (query, document, p) pairs that :func:`_pairs_kernel` adds over the query's entries (fp32 products, atomics);
more, listed as dense. :func:`_dense_kernel` recomputes the listed tiles (or, where the scan is left out, every
tile) and adds on the tensor cores ``p @ DTᵀ`` into the query tile's gradient (rows its windows alone own: a plain
read-add-write for one window, atomics for several) and ``QTᵀ @ p`` into the document block's gradient (shared by
every query tile: atomic adds), in one kernel or one each. In bf16 the fp32 ``p`` is split into PARTS bf16 parts
(8 significant bits each) whose products are exact: 2 parts hold ``p`` to 2^-16, 3 parts exactly. ``ROWS`` [T ·
BM] names each tile row's query (the tiles hold the queries in a sorted order; B marks padding). Offsets into DT
and its gradient are int32 (fewer live registers: (V + 1)·bd < 2^31, :mod:`.fused_lse` checks it), into QT int64
(K_total·BM grows with B). The products over a whole block's stored softmax weights (the hot columns' document
gradient, and with ``TileShape.query_grad_from_stored`` the query gradient) are :mod:`.stored_weights_triton`'s;
the exact bf16 products and the split, :mod:`.split_products_triton`'s.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from gradcache_sparton.losses.split_products_triton import (
    dot,
    load_parts,
    mul_parts,
    nonzero,
    split_parts,
    store_parts,
)
from gradcache_sparton.losses.stored_weights_triton import (
    HotColumns,
    QueryChunks,
    launch_hot,
    launch_query_grad,
    stored_split,
)

__all__ = [
    "ENTRY_BLOCK",
    "PAIR_BLOCK",
    "PAIR_PROGRAMS",
    "QueryEntries",
    "WorkLists",
    "launch_backward",
    "launch_forward",
]

# Pairs a program of :func:`_pairs_kernel` takes, and the query entries it reads at a time for each.
PAIR_BLOCK = 64
ENTRY_BLOCK = 32
# Programs of :func:`_pairs_kernel` at most (each takes every grid-th block of pairs up to the count).
PAIR_PROGRAMS = 1024


@triton.jit
def _program(windows, num_tiles, WINDOWED: tl.constexpr, BY_WINDOW: tl.constexpr):
    """This program's query tile (counted from the launch's first), window and slot in the scan's lists (tile ·
    windows + window). WINDOWED: program p takes window p % windows of tile p // windows (a tile's windows side
    by side), or with BY_WINDOW tile p % num_tiles of window p // num_tiles (one window's tiles side by side);
    else the whole block of tile p."""
    p = tl.program_id(0)
    if WINDOWED and BY_WINDOW:
        t, w = p % num_tiles, p // num_tiles
        slot = t * windows + w
    elif WINDOWED:
        t, w, slot = p // windows, p % windows, p
    else:
        t, w, slot = p, 0, p
    return t, w, slot


@triton.jit
def _query_tile(TILE_PTR, ROWS, t, num_rows, BM: tl.constexpr, BK: tl.constexpr):
    """Query tile t: its rows [k_lo, k_hi) of QT, the offsets r [BM] and kk [BK], its queries ``rows`` [BM]
    (num_rows: padding) and ``row_ok``, which of them are real."""
    r = tl.arange(0, BM)
    rows = tl.load(ROWS + t * BM + r)  # [BM]
    return tl.load(TILE_PTR + t), tl.load(TILE_PTR + t + 1), r, tl.arange(0, BK), rows, rows < num_rows


@triton.jit
def _window(w, window, n_docs, WINDOWED: tl.constexpr):
    """Window w's documents [n_lo, n_hi) of the block (the whole block: 0, n_docs)."""
    if WINDOWED:
        n_lo = w * window
        n_hi = tl.minimum(n_lo + window, n_docs)
    else:
        n_lo, n_hi = 0, n_docs
    return n_lo, n_hi


@triton.jit
def _score_tile(QT, COLS, DT, k_lo, k_hi, stride_dt, n_cols, n_ok, r, kk,
                BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr):  # fmt: skip
    """[BM, BN] fp32 scores (unscaled) of one query tile against documents ``n_cols``."""
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BK):
        k = (k0 + kk).to(tl.int64)  # [BK]
        c = tl.load(COLS + k)  # [BK] vocabulary ids (V: padding, a zero row of DT)
        a = tl.load(QT + k[None, :] * BM + r[:, None])  # [BM, BK]
        b = tl.load(DT + c[:, None] * stride_dt + n_cols[None, :], mask=n_ok[None, :], other=0.0)  # [BK, BN]
        acc = dot(a, b, acc, IEEE)  # [BM, BK] @ [BK, BN] -> [BM, BN]
    return acc


@triton.jit
def _forward_kernel(QT, COLS, TILE_PTR, ROWS, DT, RUN_MAX, RUN_SUM, num_rows, n_docs, stride_dt, inv_t, tile_lo,
                    num_tiles, windows, window, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                    IEEE: tl.constexpr, WINDOWED: tl.constexpr, BY_WINDOW: tl.constexpr):  # fmt: skip
    """One query tile against one window of a document block: update the tile's running max and sum (online lse)
    of that window (row w of RUN_MAX and RUN_SUM [windows, num_rows]). BY_WINDOW: :func:`_program`."""
    t, w, _ = _program(windows, num_tiles, WINDOWED, BY_WINDOW)
    k_lo, k_hi, r, kk, rows, row_ok = _query_tile(TILE_PTR, ROWS, tile_lo + t, num_rows, BM, BK)
    n_lo, n_hi = _window(w, window, n_docs, WINDOWED)
    run_max = tl.load(RUN_MAX + w * num_rows + rows, mask=row_ok, other=0.0)  # [BM]
    run_sum = tl.load(RUN_SUM + w * num_rows + rows, mask=row_ok, other=0.0)  # [BM]
    for n0 in range(n_lo, n_hi, BN):
        n_cols = n0 + tl.arange(0, BN)
        n_ok = n_cols < n_docs
        s = _score_tile(QT, COLS, DT, k_lo, k_hi, stride_dt, n_cols, n_ok, r, kk, BM, BN, BK, IEEE) * inv_t
        s = tl.where(n_ok[None, :], s, float("-inf"))  # [BM, BN]
        new_max = tl.maximum(run_max, tl.max(s, axis=1))  # finite: the tile has a document
        run_sum = run_sum * tl.exp(run_max - new_max) + tl.sum(tl.exp(s - new_max[:, None]), axis=1)
        run_max = new_max
    tl.store(RUN_MAX + w * num_rows + rows, run_max, mask=row_ok)
    tl.store(RUN_SUM + w * num_rows + rows, run_sum, mask=row_ok)


@triton.jit
def _weights(QT, COLS, DT, lse, g, k_lo, k_hi, stride_dt, inv_t, n_cols, n_ok, r, kk, row_ok,
             BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr):  # fmt: skip
    """[BM, BN] fp32 ``p = exp(s - lse) · g``, d loss / d (q · d) of one score tile (padding: 0)."""
    s = _score_tile(QT, COLS, DT, k_lo, k_hi, stride_dt, n_cols, n_ok, r, kk, BM, BN, BK, IEEE) * inv_t
    p = tl.exp(s - lse[:, None]) * g[:, None]
    return tl.where(n_ok[None, :] & row_ok[:, None], p, 0.0)


@triton.jit
def _scan_kernel(QT, COLS, TILE_PTR, ROWS, DT, LSE, G, PAIR_ROW, PAIR_DOC, PAIR_P, PAIR_COUNT, DENSE, DENSE_COUNT,
                 num_rows, n_docs, stride_dt, inv_t, tile_lo, num_tiles, windows, window, capacity, sparse_max,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr,
                 WINDOWED: tl.constexpr, BY_WINDOW: tl.constexpr):  # fmt: skip
    """One query tile against one window of a document block: recompute each score tile and its softmax weights
    ``p``; a tile with at most ``sparse_max`` non-zero weights writes them as (query, document, p) pairs
    (PAIR_*, for :func:`_pairs_kernel`), one with more (or past the pairs' ``capacity``) goes on the query
    tile's list of dense document tiles in its window (DENSE, DENSE_COUNT, for :func:`_dense_kernel`); a tile
    of zeros adds nothing and is passed over."""
    t, w, slot = _program(windows, 0, WINDOWED, False)
    k_lo, k_hi, r, kk, rows, row_ok = _query_tile(TILE_PTR, ROWS, tile_lo + t, num_rows, BM, BK)
    n_lo, n_hi = _window(w, window, n_docs, WINDOWED)
    lse = tl.load(LSE + rows, mask=row_ok, other=0.0)  # [BM]
    g = tl.load(G + rows, mask=row_ok, other=0.0)  # [BM]: d loss / d lse, over the temperature
    listed = DENSE + slot * tl.cdiv(window, BN)
    num_dense = tl.full((), 0, tl.int32)  # a tensor: it changes in the loop
    for n0 in range(n_lo, n_hi, BN):
        n_cols = n0 + tl.arange(0, BN)
        n_ok = n_cols < n_docs
        p = _weights(QT, COLS, DT, lse, g, k_lo, k_hi, stride_dt, inv_t, n_cols, n_ok, r, kk, row_ok,
                     BM, BN, BK, IEEE)  # fmt: skip
        live = (p != 0.0).to(tl.int32)  # NaN counts as live
        row_count = tl.sum(live, axis=1)  # [BM]
        count = tl.sum(row_count, axis=0)
        fits = count < 0  # False
        if (count > 0) & (count <= sparse_max):
            base = tl.atomic_add(PAIR_COUNT, count, sem="relaxed")
            fits = base + count <= capacity
            # each live weight's slot: row-major order within the tile, after base
            at = base + (tl.cumsum(row_count, axis=0) - row_count)[:, None] + tl.cumsum(live, axis=1) - 1
            # a tile past the capacity fills its slots below it with zeros
            keep = (live != 0) & (at < capacity)
            tl.store(PAIR_ROW + at, rows[:, None] + tl.zeros((BM, BN), dtype=tl.int32), mask=keep)
            tl.store(PAIR_DOC + at, n_cols[None, :] + tl.zeros((BM, BN), dtype=tl.int32), mask=keep)
            tl.store(PAIR_P + at, tl.where(fits, p, 0.0), mask=keep)
        if (count > 0) & (fits == 0):
            tl.store(listed + num_dense, n0)
            num_dense += 1
    tl.store(DENSE_COUNT + slot, num_dense)


@triton.jit
def _dense_kernel(QT, COLS, TILE_PTR, ROWS, DT, LSE, G, GQT, GDT, DENSE, DENSE_COUNT, P, COLD_END, stride_part,
                  stride_p, num_rows, n_docs, stride_dt, inv_t, tile_lo, num_tiles, windows, window, BM: tl.constexpr,
                  BN: tl.constexpr, BK: tl.constexpr, SPAN: tl.constexpr, IEEE: tl.constexpr, PARTS: tl.constexpr,
                  NEED_Q: tl.constexpr, NEED_D: tl.constexpr, STORE: tl.constexpr, LOAD: tl.constexpr,
                  SPLIT: tl.constexpr, LISTED: tl.constexpr, WINDOWED: tl.constexpr, BY_WINDOW: tl.constexpr,
                  HOT: tl.constexpr):  # fmt: skip
    """One query tile's score tiles in one window on the tensor cores, BN documents at a time: recompute each and add
    its gradients (:func:`_column_grads`; the query tile's rows of GQT by atomics where the block has windows).
    LISTED: the dense tiles of :func:`_scan_kernel`'s list (SPAN documents each); else every tile of the window.
    BY_WINDOW: the programs run one window's query tiles side by side (:func:`_program`). STORE: write each tile's
    softmax weights into P (this tile's BM rows of [tiles·BM, bd]: fp32, or with SPLIT their PARTS bf16 parts,
    ``stride_part`` apart); LOAD: read them from there, not recomputed.
    HOT (the document gradient alone): the tile's columns from COLD_END on (the hot columns, whose gradient
    :mod:`.stored_weights_triton` adds) add nothing here. Neither NEED_Q nor NEED_D: STORE alone."""
    t, w, slot = _program(windows, num_tiles, WINDOWED, BY_WINDOW)
    p_rows = P + (t * BM + tl.arange(0, BM)).to(tl.int64) * stride_p  # [BM]: this tile's rows of P
    k_lo, k_hi, r, kk, rows, row_ok = _query_tile(TILE_PTR, ROWS, tile_lo + t, num_rows, BM, BK)
    k_end = k_hi  # the columns this pass adds over: [k_lo, k_end)
    if HOT:
        k_end = tl.load(COLD_END + tile_lo + t)
    n_lo, n_hi = _window(w, window, n_docs, WINDOWED)
    lse = tl.load(LSE + rows, mask=row_ok, other=0.0)  # [BM]
    g = tl.load(G + rows, mask=row_ok, other=0.0)  # [BM]
    if LISTED:  # the scan's list of this tile and window (the scan's program `slot`)
        listed = DENSE + slot * tl.cdiv(window, SPAN)
        for i in range(0, tl.load(DENSE_COUNT + slot) * (SPAN // BN)):
            # a listed tile's first document (a multiple of SPAN), then its BN-wide parts
            n0 = tl.multiple_of(tl.load(listed + i // (SPAN // BN)), SPAN) + (i % (SPAN // BN)) * BN
            _dense_tile(tl.multiple_of(n0, BN), QT, COLS, DT, GQT, GDT, p_rows, stride_part, lse, g, k_lo, k_hi,
                        k_end, n_docs, stride_dt, inv_t, r, kk, row_ok, BM, BN, BK, IEEE, PARTS, NEED_Q, NEED_D, STORE,
                        LOAD, SPLIT, WINDOWED, HOT)  # fmt: skip
    else:
        for n0 in range(n_lo, n_hi, BN):
            _dense_tile(n0, QT, COLS, DT, GQT, GDT, p_rows, stride_part, lse, g, k_lo, k_hi, k_end, n_docs,
                        stride_dt, inv_t, r, kk, row_ok, BM, BN, BK, IEEE, PARTS, NEED_Q, NEED_D, STORE, LOAD, SPLIT,
                        WINDOWED, HOT)  # fmt: skip


@triton.jit
def _dense_tile(n0, QT, COLS, DT, GQT, GDT, p_rows, stride_part, lse, g, k_lo, k_hi, k_end, n_docs, stride_dt, inv_t,
                r, kk, row_ok, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr,
                PARTS: tl.constexpr, NEED_Q: tl.constexpr, NEED_D: tl.constexpr, STORE: tl.constexpr,
                LOAD: tl.constexpr, SPLIT: tl.constexpr, WINDOWED: tl.constexpr, HOT: tl.constexpr):  # fmt: skip
    """The score tile of documents n0 + [0, BN) recomputed over the columns [k_lo, k_hi) (LOAD: read from
    ``p_rows``, STORE: written there; SPLIT: as bf16 parts), its gradients added over [k_lo, k_end)
    (:func:`_column_grads`)."""
    n_cols = n0 + tl.arange(0, BN)
    n_ok = n_cols < n_docs
    at = p_rows[:, None] + n_cols[None, :]  # [BM, BN]
    if LOAD:  # the document pass alone (NEED_D): the parts as stored
        p1, p2, p3 = load_parts(at, stride_part, n_ok[None, :], IEEE, PARTS, SPLIT)
        p = p1  # unused: no query gradient here
    else:
        p = _weights(QT, COLS, DT, lse, g, k_lo, k_hi, stride_dt, inv_t, n_cols, n_ok, r, kk, row_ok,
                     BM, BN, BK, IEEE)  # fmt: skip
        if STORE:
            store_parts(at, p, stride_part, n_ok[None, :], IEEE, PARTS, SPLIT)
        p1, p2, p3 = split_parts(p, IEEE)
    if NEED_Q or NEED_D:  # else the weights stored alone (their query gradient: stored_weights_triton)
        _column_grads(p, p1, p2, p3, QT, COLS, DT, GQT, GDT, k_lo, k_end, stride_dt, n_cols, n_ok, r, kk,
                      BM, BN, BK, IEEE, PARTS, NEED_Q, NEED_D, WINDOWED, HOT)  # fmt: skip


@triton.jit
def _pairs_kernel(PAIR_ROW, PAIR_DOC, PAIR_P, PAIR_COUNT, Q_OFF, Q_IDS, Q_W, DT, GQ, GDT, stride_dt, capacity,
                  P: tl.constexpr, E: tl.constexpr, IEEE: tl.constexpr, NEED_Q: tl.constexpr,
                  NEED_D: tl.constexpr):  # fmt: skip
    """The pairs (query i, document j, p) of :func:`_scan_kernel`, P at a time, each program every grid-th P:
    over query i's entries (id v, weight w), add ``p · DT[v, j]`` into GQ at the entry and ``p · w`` into
    GDT[v, j] (atomics), where document j has an entry at v (elsewhere both products are with a zero)."""
    total = tl.minimum(tl.load(PAIR_COUNT), capacity)
    for start in range(tl.program_id(0) * P, total, tl.num_programs(0) * P):
        idx = start + tl.arange(0, P)
        ok = idx < total
        i = tl.load(PAIR_ROW + idx, mask=ok, other=0)
        j = tl.load(PAIR_DOC + idx, mask=ok, other=0)
        p = tl.load(PAIR_P + idx, mask=ok, other=0.0)
        ok = ok & (p != 0.0)  # the zeros of a tile past the capacity
        lo = tl.load(Q_OFF + i, mask=ok, other=0)  # [P] int64
        hi = tl.load(Q_OFF + i + 1, mask=ok, other=0)
        for e0 in range(0, tl.max(hi - lo, axis=0), E):
            e = lo[:, None] + e0 + tl.arange(0, E)[None, :]  # [P, E]: entries of each pair's query
            valid = ok[:, None] & (e < hi[:, None])
            v = tl.load(Q_IDS + e, mask=valid, other=0)
            to = v * stride_dt + j[:, None]  # [P, E] int32: DT[v, j]
            d = tl.load(DT + to, mask=valid, other=0.0)
            entry = valid & nonzero(d, IEEE)  # the document's entries
            if NEED_Q:
                tl.atomic_add(GQ + e, p[:, None] * d.to(tl.float32), mask=entry, sem="relaxed")
            if NEED_D:
                w = tl.load(Q_W + e, mask=entry, other=0.0)
                tl.atomic_add(GDT + to, p[:, None] * w, mask=entry, sem="relaxed")


@triton.jit
def _column_grads(p, p1, p2, p3, QT, COLS, DT, GQT, GDT, k_lo, k_end, stride_dt, n_cols, n_ok, r, kk,
                  BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr, PARTS: tl.constexpr,
                  NEED_Q: tl.constexpr, NEED_D: tl.constexpr, WINDOWED: tl.constexpr, HOT: tl.constexpr):  # fmt: skip
    """Add one score tile's gradients over the query tile's columns [k_lo, k_end), on the tensor cores: ``p @ DTᵀ``
    into the tile's rows of GQT (NEED_Q; atomics where WINDOWED: the tile's other windows add there too) and ``QTᵀ
    @ p`` into GDT (NEED_D, atomics; ``p1``-``p3`` its bf16 parts, :func:`split_parts`). HOT: ``k_end`` is not a
    multiple of BK (the cold columns' end): the rows of the last step past it add nothing."""
    if NEED_Q:
        pt1, pt2, pt3 = split_parts(tl.trans(p), IEEE)  # [BN, BM] each, split once for every step below
    for k0 in range(k_lo, k_end, BK):
        k = (k0 + kk).to(tl.int64)
        c = tl.load(COLS + k)  # [BK]
        b = tl.load(DT + c[:, None] * stride_dt + n_cols[None, :], mask=n_ok[None, :], other=0.0)  # [BK, BN]
        at = tl.load(QT + k[:, None] * BM + r[None, :])  # [BK, BM]: QT's rows as stored
        if NEED_Q:
            # [BK, BN] @ [BN, BM] -> [BK, BM]; this tile's rows of GQT, this program's alone unless WINDOWED
            gq = mul_parts(b, pt1, pt2, pt3, tl.zeros((BK, BM), dtype=tl.float32), PARTS, IEEE)
            to = GQT + k[:, None] * BM + r[None, :]
            entry = nonzero(at, IEEE)  # the queries' entries
            if WINDOWED:
                tl.atomic_add(to, gq, mask=entry, sem="relaxed")
            else:
                tl.store(to, tl.load(to, mask=entry, other=0.0) + gq, mask=entry)
        if NEED_D:
            # [BK, BM] @ [BM, BN] -> [BK, BN]; every query tile adds here: atomics, at the documents' entries
            gd = mul_parts(at, p1, p2, p3, tl.zeros((BK, BN), dtype=tl.float32), PARTS, IEEE)
            entry = nonzero(b, IEEE) & n_ok[None, :]  # padding ids read DT's zero row: no entry
            if HOT:
                entry = entry & (k < k_end)[:, None]
            tl.atomic_add(GDT + c[:, None] * stride_dt + n_cols[None, :], gd, mask=entry, sem="relaxed")


def launch_forward(
    qt: Tensor, cols: Tensor, tile_ptr: Tensor, row_idx: Tensor, dt: Tensor, run_max: Tensor, run_sum: Tensor,
    *, num_rows: int, n_docs: int, inv_t: float, tiles: range, window: int, bm: int, bk: int, bn: int, warps: int,
    stages: int, window_major: bool = False,
) -> None:  # fmt: skip
    """Update ``run_max``/``run_sum`` [windows, B] of the query tiles ``tiles`` against the ``n_docs`` columns of
    ``dt``, ``window`` documents a program (a multiple of ``bn``): row w holds window w's (online lse). With
    ``window_major`` (and windows) the programs run one window's query tiles side by side, else a tile's windows."""
    windows = -(-n_docs // window)
    if len(tiles) == 0:
        return
    if run_max.dim() != 2 or run_max.shape[1] != num_rows or run_max.shape[0] < windows:
        raise ValueError(f"run_max must be [>= {windows}, {num_rows}], got {list(run_max.shape)}")
    _forward_kernel[(len(tiles) * windows,)](
        qt, cols, tile_ptr, row_idx, dt, run_max, run_sum, num_rows, n_docs, dt.stride(0), inv_t, tiles.start,
        len(tiles), windows, window, BM=bm, BN=bn, BK=bk, IEEE=qt.dtype == torch.float32, WINDOWED=windows > 1,
        BY_WINDOW=window_major, num_warps=warps, num_stages=stages,
    )  # fmt: skip


class WorkLists(NamedTuple):
    """The backward's work lists for one document block, written by :func:`_scan_kernel`: the sparse tiles' (query,
    document, p) pairs, for :func:`_pairs_kernel`, and each query tile's dense document tiles, for
    :func:`_dense_kernel`. Allocated once a backward."""

    pair_rows: Tensor
    """[capacity] int32: each pair's query (its row of the batch)."""
    pair_docs: Tensor
    """[capacity] int32: each pair's document (its column of DT)."""
    pair_weights: Tensor
    """[capacity] fp32: each pair's softmax weight p (non-zero; 0: a slot of a tile past the capacity)."""
    pair_count: Tensor
    """[1] int32: pairs reserved (the slots below ``capacity`` are filled)."""
    dense: Tensor
    """[programs · doc tiles] int32: each program's dense document tiles (the first document of each)."""
    dense_count: Tensor
    """[programs] int32: how many of them (0 until a scan writes them)."""

    @classmethod
    def allocate(cls, capacity: int, programs: int, doc_tiles: int, device: torch.device) -> WorkLists:
        """Room for ``capacity`` pairs and ``doc_tiles`` dense document tiles for each of ``programs`` (a query
        tile's window of a document block)."""
        ints = functools.partial(torch.empty, dtype=torch.int32, device=device)
        counts = torch.zeros(max(programs, 1), dtype=torch.int32, device=device)
        return cls(ints(capacity), ints(capacity), torch.empty(capacity, device=device), ints(1),
                   ints(max(programs * doc_tiles, 1)), counts)  # fmt: skip

    def dense_tiles(self) -> int:
        """The score tiles the last scan listed as dense (one device read)."""
        return int(self.dense_count.sum())

    def pairs(self) -> int:
        """The pairs the last scan wrote (one device read; none past the capacity)."""
        return min(int(self.pair_count), self.pair_rows.numel())


class QueryEntries(NamedTuple):
    """The queries' entries as the pairs read them (compressed rows) and their gradient from the pairs."""

    offsets: Tensor
    """[B + 1] int64."""
    ids: Tensor
    """[nnz] int32 vocabulary ids."""
    weights: Tensor
    """[nnz] fp32: the weights the tiles hold."""
    grad: Tensor | None
    """[nnz] fp32 the pairs add into (None: not needed)."""


def launch_backward(
    qt: Tensor, cols: Tensor, tile_ptr: Tensor, row_idx: Tensor, dt: Tensor, lse: Tensor, g: Tensor,
    grad_qt: Tensor | None, grad_dt: Tensor | None, queries: QueryEntries, work: WorkLists,
    *, num_rows: int, n_docs: int, inv_t: float, tiles: range, window: int, bm: int, bk: int, bn: int, bn_scan: int,
    warps: int, stages: int, parts: int, sparse_max: int, routes: bool = True, dense_split: bool = False,
    window_major: tuple[str, ...] = (), stored: Tensor | None = None, hot: HotColumns | None = None,
    query_chunks: QueryChunks | None = None, bn_store: int = 0,
) -> None:  # fmt: skip
    """Add the gradients of the query tiles ``tiles`` against ``dt``'s documents into ``grad_qt`` [K_total, BM]
    (dense tiles, over the tiles' columns), ``queries.grad`` [nnz] (sparse tiles) and ``grad_dt`` [V + 1, bd]
    (fp32; None: not needed), ``window`` documents a program (a multiple of ``bn_scan``). With ``routes``, the
    score tiles are scanned ``bn_scan`` documents wide first: one with at most ``sparse_max`` non-zero softmax
    weights goes by pairs, one of zeros is passed over, the rest on the tensor cores ``bn`` documents at a time;
    without, every tile goes on the tensor cores (no scan). With ``dense_split`` the tensor cores' query and
    document gradients are added by two kernels, one each. The kernels ``window_major`` names ("scan",
    "query_grad", "doc_grad": ``fused_lse.WINDOW_MAJOR_KERNELS``; the one dense kernel without ``dense_split`` if it
    names both) run, with windows, one window's query tiles side by side, so that their reads of ``dt`` and atomics
    into ``grad_dt`` stay within one window. ``stored`` ([parts, len(tiles)·bm, >= n_docs],
    ``stored_weights_triton.allocate_stored``; with ``dense_split`` and both gradients): the query pass writes the
    dense tiles' softmax weights there, the document pass reads them. ``hot`` and ``query_chunks`` (with ``stored``
    and without ``routes``: every tile's weights stored): the document pass leaves the hot columns to
    ``stored_weights_triton.launch_hot``; the query pass only stores the weights, ``bn_store`` documents a score
    tile (0: ``bn``), and ``stored_weights_triton.launch_query_grad`` adds the query gradient from them over these
    chunks."""
    windows = -(-n_docs // window)
    if len(tiles) == 0 or (grad_qt is None and grad_dt is None):
        return
    if work.dense_count.numel() < len(tiles) * windows:
        raise ValueError(f"work lists for {work.dense_count.numel()} programs, {len(tiles) * windows} needed")
    ieee, need_q, need_d = qt.dtype == torch.float32, grad_qt is not None, grad_dt is not None
    grad_qt = qt if grad_qt is None else grad_qt  # placeholders where not needed (never written)
    grad_dt = dt if grad_dt is None else grad_dt
    if routes:
        work.pair_count.zero_()
        capacity = work.pair_rows.numel()
        _scan_kernel[(len(tiles) * windows,)](
            qt, cols, tile_ptr, row_idx, dt, lse, g, work.pair_rows, work.pair_docs, work.pair_weights, work.pair_count,
            work.dense, work.dense_count, num_rows, n_docs, dt.stride(0), inv_t, tiles.start, len(tiles), windows,
            window, capacity, sparse_max, BM=bm, BN=bn_scan, BK=bk, IEEE=ieee, WINDOWED=windows > 1,
            BY_WINDOW="scan" in window_major, num_warps=warps, num_stages=stages,
        )  # fmt: skip
        _pairs_kernel[(min(triton.cdiv(capacity, PAIR_BLOCK), PAIR_PROGRAMS),)](
            work.pair_rows, work.pair_docs, work.pair_weights, work.pair_count, queries.offsets, queries.ids,
            queries.weights, dt,
            queries.weights if queries.grad is None else queries.grad, grad_dt, dt.stride(0), capacity,
            P=PAIR_BLOCK, E=ENTRY_BLOCK, IEEE=ieee, NEED_Q=need_q, NEED_D=need_d,
        )  # fmt: skip
    split = dense_split and need_q and need_d
    if stored is not None and (
        not split or stored.dim() != 3 or stored.shape[1] != len(tiles) * bm or stored.shape[2] < n_docs
    ):
        raise ValueError(
            f"stored must be [parts, {len(tiles) * bm}, >= {n_docs}] with dense_split and both gradients, got "
            f"{list(stored.shape)}, dense_split={dense_split}, query and document gradients {need_q}, {need_d}"
        )
    keep = stored is not None
    for name, given in (("hot columns", hot is not None), ("query_chunks", query_chunks is not None)):
        if given and (not keep or routes):
            raise ValueError(
                f"{name} need stored weights without routes (every tile's stored), got stored {keep}, routes {routes}"
            )
    if hot is not None and hot.weights.shape[1] != len(tiles) * bm:
        raise ValueError(
            f"hot columns' weights must be [H, {len(tiles) * bm}], got {list(hot.weights.shape)}"
        )
    split_stored = keep and stored_split(stored)
    stored = qt[None] if stored is None else stored  # a placeholder where not kept (never read or written)
    cold_end = tile_ptr if hot is None else hot.cold_end  # a placeholder where no hot columns (never read)
    # (kernel name, query gradient, document gradient, store the weights, load them, documents a tile);
    # from_stored: the query pass only stores them, its gradient is launch_query_grad's
    from_stored = query_chunks is not None
    bn_query = bn_store if from_stored and bn_store else bn
    passes = (
        [
            ("query_grad", need_q and not from_stored, False, keep, False, bn_query),
            ("doc_grad", False, need_d, False, keep, bn),
        ]
        if split
        else [("query_grad", need_q, need_d, False, False, bn)]
    )
    for name, pass_q, pass_d, store, load, bn_pass in passes:
        named = [name] if split else ["query_grad", "doc_grad"]
        _dense_kernel[(len(tiles) * windows,)](
            qt, cols, tile_ptr, row_idx, dt, lse, g, grad_qt, grad_dt, work.dense, work.dense_count, stored,
            cold_end, stored.stride(0), stored.stride(1), num_rows, n_docs, dt.stride(0), inv_t, tiles.start,
            len(tiles), windows, window, BM=bm, BN=bn_pass, BK=bk, SPAN=bn_scan, IEEE=ieee, PARTS=parts, NEED_Q=pass_q,
            NEED_D=pass_d, STORE=store, LOAD=load, SPLIT=split_stored, LISTED=routes, WINDOWED=windows > 1,
            BY_WINDOW=all(n in window_major for n in named), HOT=hot is not None and load, num_warps=warps,
            num_stages=stages,
        )  # fmt: skip
    if hot is not None:  # with stored weights: both gradients needed
        launch_hot(
            hot, stored, dt, grad_dt, num_rows_p=len(tiles) * bm, n_docs=n_docs, bm=bm, ieee=ieee, parts=parts
        )
    if query_chunks is not None:
        launch_query_grad(
            query_chunks, stored, dt, qt, cols, tile_ptr, grad_qt, n_docs=n_docs, tile_lo=tiles.start, bm=bm,
            parts=parts,
        )  # fmt: skip
