"""The queries as tiles over their active columns, as the fused log-sum-exp's kernels read them (:mod:`.fused_lse`,
"Layout"), and the columns most of the tiles hold ("hot", ``TileShape.hot_columns``).

Legend: B queries, V vocabulary, BM the rows of a tile, BK the columns of one product step, T tiles, H hot columns.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from gradcache_sparton.primitives.sparse_reps import SparseReps

__all__ = [
    "HOT_MIN_TILE_FRACTION",
    "QueryTiles",
    "build_query_tiles",
    "entry_values",
    "hot_weights",
    "query_order",
]

# The default of TileShape.hot_min_tile_fraction: a column is hot where at least this fraction of the query tiles
# hold it; its share of the hot product (every query's row, held or not) is then at most twice what it replaces in
# the tiles.
HOT_MIN_TILE_FRACTION = 0.5

# Knuth's multiplicative hash (2^32 / golden ratio): spreads the vocabulary ids over [0, 2^32).
_HASH_MULTIPLIER = 2654435761


def entry_values(weights: Tensor, dtype: torch.dtype) -> Tensor:
    """``weights`` as ``dtype``, an entry of weight 0 as -0.0: the kernels find the entries by their bits (not all
    zero) and write gradients there only; -0.0 adds nothing to a score."""
    values = weights.to(dtype)
    return values.masked_fill(values == 0, -0.0)


class QueryTiles(NamedTuple):
    """The queries as tiles over their active columns (module doc, "Layout")."""

    tile_ptr: Tensor
    """[T + 1] int32: tile t's rows of ``qt`` and ``cols`` are ``tile_ptr[t]:tile_ptr[t + 1]`` (multiples of BK)."""
    cols: Tensor
    """[K_total] int32: the vocabulary id of each row of ``qt`` (V: padding)."""
    qt: Tensor
    """[K_total, BM] (bf16 or fp32): tile t's reps over its columns, transposed; zero where a query has no entry."""
    entry_pos: Tensor
    """[nnz] int64: each query entry's row of ``qt``."""
    entry_lane: Tensor
    """[nnz] int64: each query entry's column of ``qt`` (its row within its tile)."""
    row_idx: Tensor
    """[T · BM] int32: the query at each tile row (B: padding); tiles hold the queries in :func:`query_order`."""
    cold_end: Tensor
    """[T] int32: where each tile's hot columns begin (its other columns first; no hot columns: its end)."""
    hot_ids: Tensor
    """[H] int32: the hot columns' vocabulary ids (V: padding, H a multiple of BM; empty: none); their weights are
    gathered from QT where a backward first takes them (:func:`hot_weights`)."""


def query_order(reps: SparseReps) -> Tensor:
    """[B] int64: the queries sorted by the min-hash of their term sets (the least of one fixed hash of their ids;
    empty rows last), so that queries sharing terms tend to share a tile. One scatter-min and one sort, no sync."""
    hashed = reps.token_ids.long() * _HASH_MULTIPLIER % (1 << 32)  # [nnz]
    key = torch.full((reps.num_rows,), 1 << 32, dtype=torch.int64, device=hashed.device)
    key = key.scatter_reduce(0, reps.row_ids(), hashed, "amin")  # [B]
    return torch.sort(key, stable=True).indices


def build_query_tiles(
    reps: SparseReps,
    weights: Tensor,
    *,
    bm: int,
    bk: int,
    dtype: torch.dtype,
    order: Tensor | None = None,
    hot_columns: int = 0,
    hot_min_tile_fraction: float = HOT_MIN_TILE_FRACTION,
) -> QueryTiles:
    """:class:`QueryTiles` of ``reps`` with ``weights``, the queries in ``order`` ([B] positions -> rows; None: as
    they are), with up to ``hot_columns`` hot columns (``TileShape.hot_columns``), those held by at least
    ``hot_min_tile_fraction`` of the tiles: one sort of the entries' (tile, id) keys (a second with hot columns:
    each tile's last); two syncs (the unique keys' count, the total rows; a third with hot columns, their count)."""
    vocab, device, num_rows = reps.vocab_size, weights.device, reps.num_rows
    num_tiles = -(-num_rows // bm)
    row_idx = torch.full((num_tiles * bm,), num_rows, dtype=torch.int32, device=device)
    rows = reps.row_ids()  # [nnz]
    if order is None:
        row_idx[:num_rows] = torch.arange(num_rows, dtype=torch.int32, device=device)
        at = rows
    else:
        row_idx[:num_rows] = order.to(torch.int32)
        position = torch.empty_like(order)
        position[order] = torch.arange(num_rows, device=device)
        at = position[rows]  # [nnz]: each entry's position in the tiles
    tile = at // bm
    keys, inverse = torch.unique(tile * vocab + reps.token_ids.long(), sorted=True, return_inverse=True)
    key_tile, key_ids = keys // vocab, keys % vocab  # [U_all]: unique (tile, id) pairs, by tile, then id
    hot_ids, is_hot = _hot_columns(key_ids, num_tiles, vocab, hot_columns, hot_min_tile_fraction, bm)
    key_hot = is_hot[key_ids]
    if hot_ids.numel():  # each tile's hot columns last: the keys sorted by (tile, hot, id)
        resort = torch.sort(key_tile * 2 + key_hot, stable=True).indices
        rank = torch.empty_like(resort)
        rank[resort] = torch.arange(resort.numel(), device=device)
        key_tile, key_ids, key_hot, inverse = (
            key_tile[resort],
            key_ids[resort],
            key_hot[resort],
            rank[inverse],
        )
    counts = torch.bincount(key_tile, minlength=num_tiles)  # [T]
    padded = (counts + bk - 1) // bk * bk
    tile_ptr = torch.zeros(num_tiles + 1, dtype=torch.int64, device=device)
    tile_ptr[1:] = torch.cumsum(padded, 0)
    first = torch.zeros_like(tile_ptr)
    first[1:] = torch.cumsum(counts, 0)
    pos = tile_ptr[key_tile] + torch.arange(key_tile.numel(), device=device) - first[key_tile]  # [U_all]
    total = max(int(tile_ptr[-1]), bk)  # at least one step's rows: no empty tensor reaches a kernel
    cols = torch.full((total,), vocab, dtype=torch.int32, device=device)
    cols[pos] = key_ids.to(torch.int32)
    entry_pos, entry_lane = pos[inverse], at % bm
    qt = torch.zeros((total, bm), dtype=dtype, device=device)
    qt[entry_pos, entry_lane] = entry_values(weights, dtype)
    cold_end = tile_ptr[:-1] + counts - torch.bincount(key_tile[key_hot], minlength=num_tiles)
    return QueryTiles(
        tile_ptr.to(torch.int32), cols, qt, entry_pos, entry_lane, row_idx, cold_end.to(torch.int32), hot_ids
    )


def hot_weights(tiles: QueryTiles, own: range, vocab: int) -> Tensor:
    """[H, len(own)·BM]: the rows of the query tiles ``own`` (in order, as the stored softmax weights hold them) at
    the hot columns (``tiles.hot_ids``), from QT's hot rows (each tile's last). Two syncs (the tiles' first rows)."""
    num_hot, bm = tiles.hot_ids.numel(), tiles.qt.shape[1]
    device = tiles.qt.device
    hot_row = torch.full((vocab + 1,), -1, dtype=torch.int64, device=device)
    hot_row[tiles.hot_ids.long()] = torch.arange(num_hot, device=device)
    hot_row[vocab:] = -1  # padding ids (a slice: filled on the device, no sync)
    first, end = int(tiles.tile_ptr[own.start]), int(tiles.tile_ptr[own.stop])
    k = torch.arange(first, end, device=device)  # the own tiles' rows of QT
    row = hot_row[tiles.cols[k].long()]
    k, row = k[row >= 0], row[row >= 0]
    tile = torch.searchsorted(tiles.tile_ptr, k.to(torch.int32), right=True) - 1 - own.start
    out = torch.zeros((num_hot, len(own), bm), dtype=tiles.qt.dtype, device=device)
    out[row, tile] = tiles.qt[k]
    return out.view(num_hot, len(own) * bm)


def _hot_columns(
    key_ids: Tensor, num_tiles: int, vocab: int, limit: int, min_fraction: float, edge: int
) -> tuple[Tensor, Tensor]:
    """The hot columns (``TileShape.hot_columns``) of tiles whose unique (tile, id) keys have the ids ``key_ids``: up
    to ``limit`` ids that at least ``min_fraction`` of the ``num_tiles`` tiles hold, the most held first, padded
    with V to a multiple of ``edge`` -> ([H] int32 ids, [V] bool: which ids are hot). One sync."""
    device = key_ids.device
    is_hot = torch.zeros(vocab, dtype=torch.bool, device=device)
    if limit <= 0:
        return torch.empty(0, dtype=torch.int32, device=device), is_hot
    tiles_holding = torch.bincount(key_ids, minlength=vocab)  # [V]
    held, ids = torch.topk(tiles_holding, min(limit, vocab))
    ids = ids[held >= max(1.0, min_fraction * num_tiles)]
    is_hot.index_fill_(0, ids, True)  # a Python True at tensor indices would sync (torch's index_put_)
    padded = torch.full((-(-ids.numel() // edge) * edge,), vocab, dtype=torch.int32, device=device)
    padded[: ids.numel()] = ids.to(torch.int32)
    return padded, is_hot
