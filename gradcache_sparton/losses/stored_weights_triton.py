"""The fused loss's backward products over one document block's stored softmax weights: whole-block products on
the tensor cores, each output element written by a few programs instead of every query tile adding a partial.

Legend: B queries, bd the documents of one document block, BM the query tiles' rows, K_t query tile t's padded
active columns (its rows of QT), H hot columns, P the block's softmax weights ``p`` (d loss / d score) as the query
pass of :mod:`.fused_lse_triton` stores them, every query tile's rows in order (:func:`allocate_stored`): [1,
tiles·BM, bd] fp32, or its PARTS bf16 parts [PARTS, tiles·BM, bd] (``TileShape.store_split``), split once.

Where every tile's weights are stored (a document block that runs without the scan, :mod:`.fused_lse`), two of
the block's gradient sums are plain products over P:

- the hot columns' document gradient (``TileShape.hot_columns``): ``grad_DT[h, n] += Σ_r QH[h, r] · P[r, n]``
  over every query r (:func:`_hot_kernel`), QH [H, tiles·BM] the queries' weights at the H columns most query
  tiles hold;
- the query gradient (``TileShape.query_grad_from_stored``): ``grad_QT[k, r] += Σ_n DT[COLS[k], n] · P[r, n]``
  over the block's documents n for each row k of query tile t (:func:`_query_grad_kernel`): per program a
  [BM, BC] product over the whole block, read-added into grad_QT once (each row is one program's), where the
  query pass would add a partial per BN documents, by atomics where the block has windows.

Products as in :mod:`.fused_lse_triton`: bf16 values exact, the fp32 ``p`` split into PARTS bf16 parts
(:mod:`.split_products_triton`; here, or loaded split), the parts the left operand, from registers; fp32 tiles
``ieee``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from gradcache_sparton.losses.split_products_triton import INTERPRETING, load_parts, nonzero, parts_mul

__all__ = [
    "HOT_ROWS_A_PROGRAM",
    "HOT_TILE",
    "QUERY_GRAD_TILE",
    "HotColumns",
    "HotTile",
    "QueryChunks",
    "QueryGradTile",
    "allocate_stored",
    "launch_hot",
    "launch_query_grad",
    "stored_split",
]

# Stored rows a program of :func:`_hot_kernel` sums over (B 65,536: 8 programs, their sums added by atomics); 0.314
# ms against 0.343 for 4,096 (512 hot columns, one block, one H100: benchmarks/results/session17, call 2).
HOT_ROWS_A_PROGRAM = 8192


class HotTile(NamedTuple):
    """:func:`_hot_kernel`'s tile and launch settings (its rows a step are BM, the stored weights' tile rows)."""

    bh: int
    bn: int
    warps: int
    stages: int


# The fastest of 8 settings for 512 and 924 hot columns (one block of B 65,536, one H100, session17 call 2): 0.314,
# 0.592 ms; BH 64 x BN 128, 4 warps, the weights the right operand: 0.855, 1.533; that at BH 128, 8 warps: 0.423, 0.798.
HOT_TILE = HotTile(bh=256, bn=128, warps=8, stages=3)


class QueryGradTile(NamedTuple):
    """:func:`_query_grad_kernel`'s tile and launch settings: BC rows of a query tile's QT a program, BN documents a
    product step."""

    bc: int
    bn: int
    warps: int
    stages: int


# With the weights stored as bf16 parts (the GPU's TileShape), the fastest of 4 settings (one block of B 65,536 at
# temperature 1.0 with 924 hot columns, one H100, session 20; the block's whole backward, ms): BC 128 x BN 64, 4
# warps, 3 stages 4.59; BC 64 4.77 (4 stages: 4.94); BC 64 x BN 128 5.71. The kernel alone: 1.16 ms at BC 128, 1.40
# at 64. With fp32 stored weights, split again in each chunk, BC 64 was the faster (5.06 against 5.20, session 18).
QUERY_GRAD_TILE = QueryGradTile(bc=128, bn=64, warps=4, stages=3)


def _query_grad_tile(bm: int) -> QueryGradTile:
    """The setting in use: the GPU's, or on the Triton interpreter (CPU tests) small edges, chunks of 2·BM rows (a
    tile's K_t, a multiple of BK = BM there, may end mid-chunk)."""
    return QueryGradTile(bc=2 * bm, bn=bm, warps=4, stages=1) if INTERPRETING.value else QUERY_GRAD_TILE


def allocate_stored(rows: int, docs: int, *, split_parts: int, device: torch.device) -> Tensor:
    """The buffer P of one document block's softmax weights for ``rows`` tile rows: [1, rows, docs] fp32, or with
    ``split_parts`` > 0 its first that many bf16 parts [split_parts, rows, docs] (2·split_parts bytes a weight: 4 as
    fp32 at 2 parts)."""
    if split_parts:
        return torch.empty((split_parts, rows, docs), dtype=torch.bfloat16, device=device)
    return torch.empty((1, rows, docs), dtype=torch.float32, device=device)


def stored_split(stored: Tensor) -> bool:
    """Whether the buffer of :func:`allocate_stored` holds the weights' bf16 parts (else fp32 weights)."""
    return stored.dtype == torch.bfloat16


class HotColumns(NamedTuple):
    """The hot columns (``TileShape.hot_columns``), whose document gradient :func:`_hot_kernel` adds."""

    ids: Tensor
    """[H] int32 vocabulary ids (V: padding), H a multiple of BM."""
    weights: Tensor
    """[H, tiles·BM]: the queries' weights at those ids, one column a tile row (the stored softmax weights' rows)."""
    cold_end: Tensor
    """[T] int32: where each query tile's hot columns begin in QT (its other columns come first)."""


class QueryChunks(NamedTuple):
    """The programs of :func:`_query_grad_kernel`: each takes BC consecutive rows of one query tile's QT (the
    tile's last chunk fewer), every row of the launch's tiles once."""

    tile: Tensor
    """[C] int32: the chunk's query tile, counted from the launch's first (its rows of P)."""
    row: Tensor
    """[C] int32: the chunk's first row of QT."""

    @classmethod
    def build(cls, tile_ptr: Tensor, tiles: range, bm: int) -> QueryChunks:
        """The chunks of the query tiles ``tiles`` (``tile_ptr`` [T + 1]: each tile's rows of QT) under the
        setting in use."""
        bc = _query_grad_tile(bm).bc
        ptr = tile_ptr[tiles.start : tiles.stop + 1].long()
        counts = (ptr[1:] - ptr[:-1] + bc - 1) // bc  # [tiles] chunks a tile
        tile = torch.repeat_interleave(torch.arange(len(tiles), device=ptr.device), counts)
        first = torch.cumsum(counts, 0) - counts  # each tile's first chunk
        row = ptr[:-1][tile] + (torch.arange(tile.numel(), device=ptr.device) - first[tile]) * bc
        return cls(tile.to(torch.int32), row.to(torch.int32))


@triton.jit
def _hot_kernel(QH, stride_qh, P, stride_part, stride_p, HOT_IDS, DT, GDT, stride_dt, num_hot, num_rows_p,
                rows_a_program, n_docs, h_tiles, n_tiles, BH: tl.constexpr, BN: tl.constexpr, BR: tl.constexpr,
                IEEE: tl.constexpr, PARTS: tl.constexpr, SPLIT: tl.constexpr):  # fmt: skip
    """The hot columns' document gradient from the stored softmax weights, on the tensor cores: program p adds ``P[r,
    n]ᵀ @ QH[h, r]ᵀ`` ([BN, BH]; the split weights the left operand, from registers) over its rows r of [tiles·BM]
    (``rows_a_program`` of them, every query tile's stored rows in order) for BN documents n and BH hot columns h
    (of ``num_hot``), then adds it into GDT at the documents' entries (atomics: the programs of the other rows add
    there too). The h tiles vary fastest: the programs that read the same rows of P run side by side."""
    pid = tl.program_id(0)
    h = (pid % h_tiles) * BH + tl.arange(0, BH)  # [BH] rows of QH and HOT_IDS
    h_ok = h < num_hot
    n_cols = (pid // h_tiles % n_tiles) * BN + tl.arange(0, BN)
    n_ok = n_cols < n_docs
    r_lo = pid // (h_tiles * n_tiles) * rows_a_program
    r_hi = tl.minimum(r_lo + rows_a_program, num_rows_p)
    rr = tl.arange(0, BR)
    acc = tl.zeros((BN, BH), dtype=tl.float32)
    for r0 in range(r_lo, r_hi, BR):
        r = (r0 + rr).to(tl.int64)
        qh = tl.load(
            QH + h[None, :].to(tl.int64) * stride_qh + r[:, None], mask=h_ok[None, :], other=0.0
        )  # [BR, BH]
        pt1, pt2, pt3 = load_parts(
            P + r[None, :] * stride_p + n_cols[:, None], stride_part, n_ok[:, None], IEEE, PARTS, SPLIT
        )  # [BN, BR] each
        acc = parts_mul(pt1, pt2, pt3, qh, acc, IEEE, PARTS)  # [BN, BR] @ [BR, BH] -> [BN, BH]
    ids = tl.load(HOT_IDS + h, mask=h_ok, other=0)  # [BH] vocabulary ids (V: padding, DT's zero row)
    to = ids[None, :] * stride_dt + n_cols[:, None]  # [BN, BH] int32
    ok = n_ok[:, None] & h_ok[None, :]
    entry = nonzero(tl.load(DT + to, mask=ok, other=0.0), IEEE) & ok
    tl.atomic_add(GDT + to, acc, mask=entry, sem="relaxed")


@triton.jit
def _query_grad_kernel(P, stride_part, stride_p, DT, stride_dt, COLS, QT, GQT, TILE_PTR, CHUNK_TILE, CHUNK_ROW, n_docs,
                       tile_lo, BM: tl.constexpr, BC: tl.constexpr, BN: tl.constexpr, IEEE: tl.constexpr,
                       PARTS: tl.constexpr, SPLIT: tl.constexpr):  # fmt: skip
    """The query gradient of one chunk of a query tile's columns from the stored softmax weights, on the tensor cores:
    program c takes rows k of QT from CHUNK_ROW[c] (BC of them, the tile's last chunk fewer) of query tile t =
    CHUNK_TILE[c], adds ``P[t's rows, n] @ DT[COLS[k], n]ᵀ`` ([BM, BC]) over the block's documents n, BN at a time,
    and adds the sum into GQT at the queries' entries once (the rows are this program's alone: no atomics)."""
    c = tl.program_id(0)
    t = tl.load(CHUNK_TILE + c)
    k_hi = tl.load(TILE_PTR + tile_lo + t + 1)
    k = tl.load(CHUNK_ROW + c).to(tl.int64) + tl.arange(0, BC)  # [BC] rows of QT
    k_ok = k < k_hi
    cols = tl.load(COLS + k, mask=k_ok, other=0)  # [BC] vocabulary ids
    r = tl.arange(0, BM)
    p_rows = P + (t * BM + r).to(tl.int64) * stride_p  # [BM]: the tile's rows of P
    acc = tl.zeros((BM, BC), dtype=tl.float32)
    for n0 in range(0, n_docs, BN):
        n = n0 + tl.arange(0, BN)
        n_ok = n < n_docs
        p1, p2, p3 = load_parts(
            p_rows[:, None] + n[None, :], stride_part, n_ok[None, :], IEEE, PARTS, SPLIT
        )  # [BM, BN] each
        d = tl.load(
            DT + cols[None, :] * stride_dt + n[:, None], mask=k_ok[None, :] & n_ok[:, None], other=0.0
        )  # [BN, BC]
        acc = parts_mul(p1, p2, p3, d, acc, IEEE, PARTS)  # [BM, BN] @ [BN, BC] -> [BM, BC]
    to = k[None, :] * BM + r[:, None]  # [BM, BC]: QT's and GQT's [BC, BM] rows, transposed
    entry = nonzero(tl.load(QT + to, mask=k_ok[None, :], other=0.0), IEEE) & k_ok[None, :]  # queries' entries
    tl.store(GQT + to, tl.load(GQT + to, mask=entry, other=0.0) + acc, mask=entry)


def launch_hot(
    hot: HotColumns, stored: Tensor, dt: Tensor, grad_dt: Tensor, *, num_rows_p: int, n_docs: int, bm: int,
    ieee: bool, parts: int,
) -> None:  # fmt: skip
    """The hot columns' document gradient of ``num_rows_p`` stored rows into ``grad_dt`` (:func:`_hot_kernel`)."""
    setting = HotTile(bh=bm, bn=bm, warps=4, stages=1) if INTERPRETING.value else HOT_TILE  # CPU tests: small
    num_hot = hot.ids.numel()
    h_tiles, n_tiles = triton.cdiv(num_hot, setting.bh), triton.cdiv(n_docs, setting.bn)
    rows_a_program = triton.cdiv(min(HOT_ROWS_A_PROGRAM, num_rows_p), bm) * bm
    _hot_kernel[(h_tiles * n_tiles * triton.cdiv(num_rows_p, rows_a_program),)](
        hot.weights, hot.weights.stride(0), stored, stored.stride(0), stored.stride(1), hot.ids, dt, grad_dt,
        dt.stride(0), num_hot, num_rows_p, rows_a_program, n_docs, h_tiles, n_tiles, BH=setting.bh, BN=setting.bn,
        BR=bm, IEEE=ieee, PARTS=parts, SPLIT=stored_split(stored), num_warps=setting.warps,
        num_stages=setting.stages,
    )  # fmt: skip


def launch_query_grad(
    chunks: QueryChunks, stored: Tensor, dt: Tensor, qt: Tensor, cols: Tensor, tile_ptr: Tensor, grad_qt: Tensor,
    *, n_docs: int, tile_lo: int, bm: int, parts: int,
) -> None:  # fmt: skip
    """The query gradient of the chunks' query tiles against ``dt``'s ``n_docs`` documents from their stored weights
    into ``grad_qt`` [K_total, BM] (:func:`_query_grad_kernel`); ``tile_lo`` the first tile of ``stored``'s rows."""
    setting = _query_grad_tile(bm)
    if chunks.tile.numel() == 0:
        return
    _query_grad_kernel[(chunks.tile.numel(),)](
        stored, stored.stride(0), stored.stride(1), dt, dt.stride(0), cols, qt, grad_qt, tile_ptr, chunks.tile,
        chunks.row, n_docs, tile_lo, BM=bm, BC=setting.bc, BN=setting.bn, IEEE=qt.dtype == torch.float32,
        PARTS=parts, SPLIT=stored_split(stored), num_warps=setting.warps, num_stages=setting.stages,
    )  # fmt: skip
