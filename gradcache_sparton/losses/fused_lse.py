"""The sparse InfoNCE's log-sum-exp in fused Triton kernels: score tiles built on chip, never a score block in memory.

Legend: B queries, N = (1+k)·B documents, V vocabulary, BM × BN one score tile (queries × documents), BK columns
of one product step, bd the documents of one document block, K_t query tile t's padded active columns.

The same quantity as :func:`~.sparse.sparse_blocked_logsumexp`, ``lse[i] = logsumexp_j (q_i · d_j) / temperature``
over every document of the batch, differentiable in every column's weights, computed as flash-attention and Cut
Cross-Entropy compute theirs: an online log-sum-exp over score tiles that live in registers only.

Layout (built once per forward, kept for the backward):

- queries in tiles of BM rows (:mod:`.query_tiles`), in the order of its ``query_order`` (a min-hash of their
  terms, so that queries sharing terms tend to share a tile; :data:`SORT_QUERIES`); each tile carries its active
  columns (the sorted unique vocabulary ids of its rows' non-zeros, padded with id V up to a multiple of BK) and
  its reps over them, transposed: ``QT``
  [K_total, BM] (bf16 or fp32, see below), K_total = sum_t K_t (linear in the queries' non-zeros). A tile
  of 64 trained SPLADE queries (~50 non-zeros each) has ~1,100 active columns of V = 30,522, so the products
  run over ~4% of V (the blocked path's query blocks of 512 rows run over their union, ~13%);
- documents in blocks of bd rows, each densified once over all V, transposed: ``DT`` [V + 1, bd] (row V
  zero, the padding's), so a query tile's BK columns are BK contiguous runs of documents.

Forward: one program per query tile and window of the block (``TileShape.doc_window``: 256 documents on the GPU,
a tile's windows side by side, or one window's tiles: ``TileShape.window_major``) walks its documents in BN-wide
tiles; a score tile is the sum over the query tile's columns of ``QT[k]ᵀ · DT[id_k]`` (``tl.dot`` steps, fp32
accumulation), scaled by 1/temperature and folded into the tile's running max and sum (one per window, merged after
the last block).
Nothing of size B × N, or bq × bd, is written: the running maxima and sums [W, B] carry over from one document
block to the next.

Backward: the same tiles recomputed (same tiles, same order of products), ``p = exp(s - lse) ·
dL/dlse / temperature`` in fp32. A scan (BN_scan documents wide) takes each tile by the count of its non-zero
``p`` (trained reps at a temperature of 0.05 leave ~0.1% of them non-zero: most underflow to exactly 0):

- none: the tile is dropped, exactly: every product it would add is with a zero;
- at most :data:`SPARSE_TILE_MAX`: its (query, document, p) pairs are listed, and for each pair, over the
  query's entries (id v, weight w), ``grad_q[entry] += p · DT[v, j]`` and ``grad_DT[v, j] += p · w`` where
  document j has an entry at v (fp32 products, atomic adds);
- more (or past the pairs' room, :data:`PAIR_CAPACITY`): listed as dense; the listed tiles are recomputed
  BN_backward documents at a time and added on the tensor cores, per step ``grad_QT[k] += p @ DT[id_k]ᵀ`` (the
  tile's own rows; atomic adds where its windows share them) and ``grad_DT[id_k] += QT[k]ᵀ @ p`` (atomic adds:
  every query tile adds to the document block's gradient), by one kernel or, with ``TileShape.dense_split`` (the
  GPU's default), one kernel each (with ``TileShape.store_weights``, the GPU's default too, the second reads the
  first's ``p`` from memory instead of recomputing the scores, from the second document block on; fp32, or its
  bf16 parts with ``TileShape.store_split``). With
  ``TileShape.hot_columns`` (the GPU's default) and every tile's ``p`` stored (a block without the scan, below),
  the columns that at least ``TileShape.hot_min_tile_fraction`` of the query tiles hold (each tile's last)
  leave the second kernel: their document gradient is one product over every query, ``QHᵀ @ p`` (QH [H, B],
  the queries' weights at those ids; the same split parts, fp32 accumulation), each document entry written by a
  few programs instead of by every query tile. With ``TileShape.query_grad_from_stored`` (the GPU's default) there
  too, the query pass only stores ``p``, and the query gradient is one product a query tile over the whole block,
  ``p @ DT[cols]ᵀ``, read-added into the tile's rows once instead of a partial per BN_backward documents
  (:mod:`.stored_weights_triton`).

Where nearly every tile is dense (raw dot products at temperature 1.0) the scan only costs: a backward whose
first document block listed more than :data:`ROUTES_MAX_DENSE_FRACTION` of its tiles as dense runs its other
blocks without it, every tile straight on the tensor cores. Which way a block went never changes its values
beyond the bound (the same products; sums in another order).

The gradients are gathered at the non-zeros: ``grad_q`` from ``grad_QT`` at each entry's (column, row) plus the
pairs' part, ``grad_d`` from ``grad_DT`` at each document entry. A document's entries outside a query tile's
columns get nothing from that tile, which is exact: their products there are with query zeros.

Exactness (products, sums and the bound against a dense fp64 reference: docs/losses.md, "The fused
kernel"):

- products: when every weight holds a bf16 value (reps made under bf16 autocast; checked once per call as
  the blocked path does) the tiles are bf16 and ``tl.dot`` forms exact products summed in fp32; otherwise
  fp32 tiles with ``input_precision="ieee"`` (no TF32), products rounded once. The backward's fp32 ``p`` is
  split into :data:`SPLIT_PARTS` bf16 parts on the tensor cores, each product of a part exact: 2 parts (the
  default) hold ``p``'s leading 16 significant bits, within 2^-16 of ``p``; 3 parts hold all 24, ``p`` itself;
  by pairs, ``p`` times a weight is one fp32 product, rounded once;
- sums: fp32, in another order than the dense computation (K-steps, then tiles, then document blocks);
- only tiles whose fp32 ``p`` are all exactly 0 are dropped (the products they would add are zeros); atomic
  adds (the document gradient, the pairs' query gradient, with windows the dense tiles' query gradient) make the fp32 order, and so the last bits, vary from
  run to run (the bound covers every order).

Memory: ``QT`` and its fp32 gradient (6·BM bytes per padded column of a tile: linear in the queries'
non-zeros), the int64 row of every entry, one ``DT`` and one fp32 ``grad_DT`` [V + 1, bd] (bd from
``TileShape.doc_block_bytes``: a constant, not a function of B; a column's blocks reuse them, each written and
cleared at its own entries), the running maxima and sums [W, B], the pairs' room (12 bytes a pair,
:data:`PAIR_CAPACITY`: a constant), the pairs' query gradient (4 bytes an entry) and, with
``TileShape.store_weights`` (the GPU's default), the dense tiles' ``p`` of one document block (4·B·bd bytes, as fp32
or as 2 bf16 parts with ``TileShape.store_split``; 6·B·bd with 3 parts; allocated only where the first block listed
a dense tile) and, with ``TileShape.hot_columns``, the queries' weights
at the hot columns (H·B·2 bytes in bf16: 121 MB for 924 columns at B 65,536, gathered where a backward first takes
them). Nothing grows with B².

Sharded across ranks (``shard_across_ranks``): rank r runs its contiguous 1/W of the query tiles; the lse
(rows of other ranks zero) and the gradients are summed with one all-reduce each, as in :mod:`.blocked`.

Which path runs: ``SpladeLossConfig.score_kernel`` ('auto', 'fused' or 'blocked'); 'auto' takes this one
for sparse reps on a GPU from :data:`FUSED_MIN_QUERIES` queries on (:func:`use_fused_kernel`).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor
from torch.autograd.function import FunctionCtx, once_differentiable

from gradcache_sparton.losses.blocked import check_same_on_every_rank, products_in_bf16
from gradcache_sparton.losses.doc_blocks import DocBlocks
from gradcache_sparton.losses.query_tiles import (
    HOT_MIN_TILE_FRACTION,
    QueryTiles,
    build_query_tiles,
    hot_weights,
    query_order,
)
from gradcache_sparton.primitives.sparse_reps import SparseReps

__all__ = [
    "FUSED_MIN_QUERIES",
    "GPU_TILES",
    "INTERPRETER_TILES",
    "PAIR_CAPACITY",
    "ROUTES_MAX_DENSE_FRACTION",
    "SCORE_KERNELS",
    "SORT_QUERIES",
    "SPARSE_TILE_MAX",
    "SPLIT_PARTS",
    "VARIANTS",
    "WINDOW_MAJOR_KERNELS",
    "TileShape",
    "check_score_kernel",
    "fused_by_default",
    "fused_sparse_logsumexp",
    "kernels_run_on",
    "use_fused_kernel",
]

# Values of SpladeLossConfig.score_kernel: the automatic choice, this module's kernels, or the blocked path.
SCORE_KERNELS = ("auto", "fused", "blocked")

# 'auto' takes the fused kernels from this many queries on (sparse fp32-weight reps on a GPU). The curve on one
# H100 at temperature 1.0 (benchmarks/results/session16, call 3; docs/scale.md, "The curve") has the fused loss
# (forward + backward, 'window256_stored') faster than the blocked one at every B it measured: 1.89x at 4,096, 1.65x
# at 8,192, 1.85x at 16,384, 2.10x at 32,768, 2.29x at 65,536, 2.41x at 131,072 (session 14's, 'window256': 1.29x
# at 4,096). Below 4,096 it is unmeasured: the blocked path stays (a few milliseconds there).
FUSED_MIN_QUERIES = 4_096

# bf16 parts the backward splits its fp32 softmax weights into (module doc, "Exactness"): 2 parts hold the
# leading 16 significant bits (each weight within 2^-16 of itself, docs/losses.md's bound); 3 parts hold all 24,
# every gradient product exact, for 2 more tensor-core products a tile. 1 part holds 8 bits (within 2^-9: outside
# the bound the tests hold; the benchmarks use it to measure what the second part costs, never as a setting).
SPLIT_PARTS = 2

# The backward's sparse tiles: a score tile with at most this many non-zero softmax weights p (fp32; the rest
# underflowed to exactly 0, their products add nothing) adds its gradients pair by pair, over the pair's query
# entries (one fp32 product each, atomics), instead of on the tensor cores over the query tile's columns; 0: every
# non-zero tile on the tensor cores. Trained reps at a temperature of 0.05 leave ~0.1% of p non-zero; there 1,024
# and 4,096 measured the same (B 65,536, one H100: benchmarks/results/session9, the first version's settings).
SPARSE_TILE_MAX = 1024
# Pairs the sparse tiles may hold per document block (12 bytes each); a tile past it goes on the tensor cores.
PAIR_CAPACITY = 1 << 22
# The scan costs where it saves nothing: at temperature 1.0 every tile is dense, and a tile the scan takes off the
# tensor cores saves its dense cost. B 65,536 on one H100 (benchmarks/results/session10): the scan-led backward at
# temperature 0.05 (nearly all tiles off the tensor cores) 0.233 s, every tile on the tensor cores 1.37-1.40 s; so
# the scan pays from ~0.83 of the tiles dense down (1 - 0.233 / 1.40). A backward whose first document block
# listed more than this fraction of its tiles as dense runs its other blocks without the scan.
ROUTES_MAX_DENSE_FRACTION = 0.83

# Order the queries into tiles by a min-hash of their terms (``query_tiles.query_order``): queries that share
# terms tend to share a tile, whose active columns (the products' width) are then fewer; copies of a query always share
# one. False: the batch's order.
SORT_QUERIES = True


class TileShape(NamedTuple):
    """Tile edges and launch settings; BM and BK also shape the query tables (:class:`QueryTiles`)."""

    bm: int
    bk: int
    bn_forward: int
    bn_scan: int
    """The backward's scan of the score tiles (their routes)."""
    bn_backward: int
    """The backward's tiles on the tensor cores."""
    warps: int
    stages: int
    dense_split: bool = False
    """The dense tiles' gradients in two kernels, the queries' then the documents' (each recomputes the scores,
    with fewer live registers); False: both in one."""
    doc_block_bytes: int = 128 << 20
    """Bytes of the fp32 document gradient block grad_DT [V + 1, bd] (DT, bf16 or fp32, is at most as large): bd =
    1,024 documents at V = 30,522 (a bf16 DT of 63 MB, its gradient 125 MB), a constant, not a function of B.
    Measured at B 65,536 on one H100 (benchmarks/results/session11, README): bd 1,024 against 4,352 (512 MiB, the
    sparse path's bound) took the backward from 1.213 to 1.121 s at temperature 1.0 and from 0.232 to 0.226 s at
    0.05, the forward unchanged (0.132 / 0.133 s); 512 and 256 were slower at 0.05 (more launches). Likely, not
    profiled: the smaller gradient block keeps more of the atomics' targets in L2."""
    doc_window: int = 0
    """Documents of a block one program takes (a multiple of every BN), 0: the whole block. With W > 1 windows a
    block, a query tile's W programs run side by side (fewer query tiles live at once, so their reads stay in
    L2), the forward keeps W running maxima and sums a query, merged at the end, and the dense tiles' query
    gradient is added by atomics (the tile's windows share its rows)."""
    window_major: tuple[str, ...] = ()
    """The kernels (of :data:`WINDOW_MAJOR_KERNELS`) whose programs run window-major, with windows: one window's
    query tiles side by side (program p: tile p % T of window p // T), so that the reads of DT and the atomics
    into grad_DT stay within one window (bd = 1,024, windows of 256: 16 MB of DT, 31 MB of its gradient, within
    the H100's 50 MB L2) while each query tile is read once a window; the others run tile-major (a tile's
    windows side by side). Without ``dense_split`` the dense gradients are one kernel: name both or neither."""
    store_weights: bool = False
    """With ``dense_split``: the query pass stores each dense tile's fp32 softmax weights p ([tiles·BM, bd], 4·B·bd
    bytes: 256 MiB at B 65,536, linear in B) and the document pass reads them instead of recomputing the scores
    (the same values: one score product a tile fewer). The buffer is allocated after the first document block
    (which recomputes), and only if that block listed a dense tile: none where every tile goes by pairs."""
    hot_columns: int = 0
    """With ``store_weights``: at most this many columns (rounded up to a multiple of ``bm``) that the most query
    tiles hold (at least ``hot_min_tile_fraction`` of them; the most held first) leave the document pass
    wherever every tile's weights are stored (a block without the routes): their document gradient is one product
    over every query, ``QHᵀ @ p`` (``stored_weights_triton._hot_kernel``), in place of each tile's partial sums added
    by atomics; the queries' weights there are kept once more ([H, B] bf16 or fp32). 0: none."""
    query_grad_from_stored: bool = False
    """With ``store_weights``: wherever every tile's weights are stored (a block without the routes), the query pass
    only stores them and the query gradient is one product a query tile over the whole block, ``p @ DT[cols]ᵀ``
    (``stored_weights_triton._query_grad_kernel``), added into its rows once a block in place of a partial sum per
    ``bn_backward`` documents (by atomics, with windows)."""
    bn_store: int = 0
    """With ``query_grad_from_stored``: the documents of a score tile in the pass that only stores the weights (0:
    ``bn_backward``); it holds no gradient, so it can be as wide as the forward."""
    store_split: bool = False
    """With ``store_weights`` and bf16 tiles: the weights are stored as their :data:`SPLIT_PARTS` bf16 parts (4
    bytes a weight at 2 parts, as in fp32), split once where they are computed, in place of fp32 weights that every
    pass reading them splits again (the document pass, the hot columns' product and the query gradient's, once for
    every chunk of a tile's columns); the same parts, the same products."""
    hot_min_tile_fraction: float = HOT_MIN_TILE_FRACTION
    """With ``hot_columns``: a column is hot where at least this fraction of the query tiles hold it. The hot
    product takes every query's row at the column, held or not, so at 0.5 it does at most twice the products it
    takes from the tiles; lower, more columns leave the document pass's atomics for more products."""

    def doc_edge(self) -> int:
        """The documents every score tile's width divides: a window, and a document block, hold whole tiles."""
        return math.lcm(self.bn_forward, self.bn_scan, self.bn_backward, self.bn_store or self.bn_backward)


# The kernels a TileShape's ``window_major`` can name: the forward, the backward's scan and its tensor-core passes
# that add the query and the document gradients.
WINDOW_MAJOR_KERNELS = ("forward", "scan", "query_grad", "doc_grad")

# Named GPU settings, the A/B's candidates (benchmarks/bench_loss_kernel.py --variants). tl.dot needs power-of-two
# edges >= 16; BM = 64 is the wgmma row edge. 'split128' (the dense tiles' query and document gradients in two
# kernels, each recomputing the scores 128 documents wide with fewer live registers): the fastest measured at B
# 65,536 on one H100, backward 1.211 s against 'columns'' 1.358 at temperature 1.0 and the same 0.233 s at 0.05
# (benchmarks/results/session11, call 2; two kernels 64 wide: 1.593 s; 8 warps, 2 or 4 stages, BK 32, BM 128, BN 256 or
# both gradients 128 wide in one kernel: slower, same folder). 'columns': both gradients in one kernel, 64 wide,
# document blocks of 4,352 (the setting before, docs/scale.md).
_SPLIT128 = TileShape(
    bm=64, bk=64, bn_forward=128, bn_scan=128, bn_backward=128, warps=4, stages=3, dense_split=True
)
# 'window256_by_window' (every kernel window-major) was slower at every B from 8,192 (1.188 s against 1.067 at 65,536,
# benchmarks/results/session14); the scan 256 wide too was slower at temperature 0.05 (backward 0.304 s against
# 0.208, same folder), so only the forward is 256 wide. Slower and not kept (benchmarks/results/session16): both dense
# gradients in one kernel with windows (backward 1.274 s against 0.869 at B 65,536, temperature 1.0), BK 32, 2 stages,
# and bit masks of the entries in place of DT's and QT's values (backward 1.819 s against 0.866).
_QUERY = _SPLIT128._replace(
    doc_window=256, bn_forward=256, store_weights=True, hot_columns=1024, query_grad_from_stored=True
)
VARIANTS = {
    "split128": _SPLIT128,
    "window256": _SPLIT128._replace(doc_window=256),
    "window256_by_window": _SPLIT128._replace(doc_window=256, window_major=WINDOW_MAJOR_KERNELS),
    "window256_forward256": _SPLIT128._replace(doc_window=256, bn_forward=256),
    "window256_stored": _SPLIT128._replace(doc_window=256, bn_forward=256, store_weights=True),
    **{
        f"window256_stored_hot{hot}": _SPLIT128._replace(
            doc_window=256, bn_forward=256, store_weights=True, hot_columns=hot
        )
        for hot in (512, 1024)
    },
    "window256_stored_hot1024_query": _QUERY,
    "window256_stored_hot1024_query_split": _QUERY._replace(store_split=True),
    "window256_stored_hot1024_query_split_store256": _QUERY._replace(store_split=True, bn_store=256),
    **{
        f"window256_stored_hot{hot}at{round(fraction * 100)}_query_split_store256": _QUERY._replace(
            store_split=True, bn_store=256, hot_columns=hot, hot_min_tile_fraction=fraction
        )
        for hot, fraction in ((1536, 0.35), (2048, 0.25), (3072, 0.25))
    },
    "columns": TileShape(
        bm=64,
        bk=64,
        bn_forward=128,
        bn_scan=128,
        bn_backward=64,
        warps=4,
        stages=3,
        doc_block_bytes=512 << 20,
    ),
}
# The GPU's setting: 'window256_stored_hot2048at25_query_split_store256' (split128's tiles, each query tile's
# programs over windows of 256 documents side by side, the forward a window at a time; where every tile's softmax
# weights are stored, as their bf16 parts, by a pass 256 documents wide, the document-gradient pass reads them, up to
# 2,048 hot columns (held by a quarter of the tiles) take their document gradient in one product over every query
# and the query gradient is one product a chunk of a tile's columns over the block). B 65,536 at temperature 1.0 on
# one H100 (benchmarks/results/session21, call 3): the loss 0.640 s against 0.693 for
# 'window256_stored_hot1024_query_split_store256' (1,536 at 0.35: 0.654; 3,072 at 0.25: 0.648). That one (session
# 21, call 1): 0.695 s against 0.781 for 'window256_stored_hot1024_query' (session 20, call 1: a block's backward
# 4.59 ms against 5.15). 'window256_stored_hot1024_query' (session 18): backward 0.664 s against 0.772 for
# 'window256_stored_hot1024' (forward + backward 0.775 against 0.878). Hot columns (session 17): backward 0.775 s
# against 0.866 for 'window256_stored' (0.800 with 512). 'window256_stored' (session 15): backward 0.868 s against
# 0.952 for 'window256_forward256', the same 0.208 / 0.207 s at 0.05 (every tile by pairs there, nothing stored).
# The forward 256 wide (session 14): 0.106 s against 0.130.
GPU_TILES = VARIANTS["window256_stored_hot2048at25_query_split_store256"]
# Interpreter tiles (CPU tests): the smallest legal edges, so small shapes still span several tiles.
INTERPRETER_TILES = TileShape(bm=16, bk=16, bn_forward=16, bn_scan=16, bn_backward=16, warps=4, stages=1)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def kernels_run_on(device: torch.device) -> bool:
    """Whether the fused kernels can run on ``device``: a CUDA device, or any under the Triton interpreter."""
    return device.type == "cuda" or _interpreting()


def _tile_shape() -> TileShape:
    """The setting in use, checked: a listed tile of the scan is added in bn_scan / bn_backward parts (none, were
    the backward's tiles wider), a window holds whole tiles of every kernel, and ``window_major`` names known
    kernels, has windows to order and does not split the one dense kernel."""
    shape = INTERPRETER_TILES if _interpreting() else GPU_TILES
    if shape.bn_scan % shape.bn_backward:
        raise ValueError(
            f"TileShape: bn_backward ({shape.bn_backward}) must divide bn_scan ({shape.bn_scan}), got {shape}"
        )
    edge = shape.doc_edge()
    if shape.doc_window < 0 or shape.doc_window % edge:
        raise ValueError(
            f"TileShape: doc_window ({shape.doc_window}) must be 0 or a multiple of {edge}, got {shape}"
        )
    unknown = set(shape.window_major) - set(WINDOW_MAJOR_KERNELS)
    if unknown:
        raise ValueError(
            f"TileShape: window_major names kernels of {list(WINDOW_MAJOR_KERNELS)}, got {sorted(unknown)} in {shape}"
        )
    if shape.window_major and not shape.doc_window:
        raise ValueError(f"TileShape: window_major needs document windows (doc_window > 0), got {shape}")
    if shape.hot_columns < 0 or (shape.hot_columns and not shape.store_weights):
        raise ValueError(
            f"TileShape: hot_columns ({shape.hot_columns}) must be 0, or > 0 with store_weights (their gradient reads "
            f"the stored weights), got {shape}"
        )
    if not 0.0 < shape.hot_min_tile_fraction <= 1.0:
        raise ValueError(
            f"TileShape: hot_min_tile_fraction ({shape.hot_min_tile_fraction}) must be in (0, 1] (the share of the "
            f"query tiles that hold a hot column), got {shape}"
        )
    if shape.query_grad_from_stored and not shape.store_weights:
        raise ValueError(
            f"TileShape: query_grad_from_stored needs store_weights (the query gradient reads them), got {shape}"
        )
    if shape.bn_store < 0 or (shape.bn_store and not shape.query_grad_from_stored):
        raise ValueError(
            f"TileShape: bn_store ({shape.bn_store}) must be 0, or > 0 with query_grad_from_stored (it sizes the pass "
            f"that only stores the weights), got {shape}"
        )
    if shape.store_split and not shape.store_weights:
        raise ValueError(
            f"TileShape: store_split needs store_weights (it is how they are stored), got {shape}"
        )
    if shape.store_weights and not shape.dense_split:
        raise ValueError(
            f"TileShape: store_weights needs dense_split (the document pass reads what the query pass stores), got {shape}"
        )
    if not shape.dense_split and ("query_grad" in shape.window_major) != ("doc_grad" in shape.window_major):
        raise ValueError(
            "TileShape: without dense_split the query and document gradients are one kernel: window_major names "
            f"both or neither, got {shape}"
        )
    return shape


def check_score_kernel(value: object, *, name: str = "score_kernel") -> None:
    """Raise unless ``value`` is one of :data:`SCORE_KERNELS`; ``name`` names the argument."""
    if value not in SCORE_KERNELS:
        raise ValueError(f"{name} must be one of {list(SCORE_KERNELS)}, got {value!r}")


def use_fused_kernel(q_reps: SparseReps, d_reps: Sequence[SparseReps], kernel: str) -> bool:
    """Whether the log-sum-exp of these sparse reps runs the fused kernels under ``kernel`` (module doc).

    'auto': on a GPU, fp32 weights (the losses' upcast copies), :func:`fused_by_default` of the query count.
    It depends on the row count, the weights' dtype and their device type only: under ``shard_across_ranks``
    every rank holds the same gathered batch, so every rank makes the same choice (both paths check the row
    count, sizes and sums on every rank before their first collective).
    'fused': always; raises ``ValueError`` where the kernels cannot run (fp64 weights, or a CPU outside
    the Triton interpreter). 'blocked': never.
    """
    if kernel == "blocked":
        return False
    weights = [q_reps.weights, *(d.weights for d in d_reps)]
    runnable = all(w.dtype == torch.float32 for w in weights) and kernels_run_on(q_reps.weights.device)
    if kernel == "fused":
        if not runnable:
            raise ValueError(
                "score_kernel='fused' needs fp32 (or bf16/fp16, upcast) sparse reps on a CUDA device, got "
                f"{q_reps.weights.dtype} on {q_reps.weights.device}; use score_kernel='blocked' or 'auto'"
            )
        return True
    return runnable and q_reps.weights.is_cuda and fused_by_default(q_reps.num_rows)


def fused_by_default(num_rows: int) -> bool:
    """Whether 'auto' takes the fused kernels for ``num_rows`` queries (where they can run on a GPU): from
    :data:`FUSED_MIN_QUERIES` on, the sizes where they were measured faster."""
    return num_rows >= FUSED_MIN_QUERIES


def _document_rows(vocab: int, shape: TileShape) -> int:
    """bd: documents per block, a multiple of every BN, with grad_DT within ``shape.doc_block_bytes``; (V + 1)·bd
    below 2^31, the kernels' int32 offsets into DT and grad_DT."""
    edge = shape.doc_edge()
    bd = max(edge, shape.doc_block_bytes // (4 * (vocab + 1)) // edge * edge)
    if (vocab + 1) * bd >= 2**31:
        raise ValueError(
            f"TileShape.doc_block_bytes gives {bd} documents a block over V = {vocab}: (V + 1)·bd >= 2^31"
        )
    return bd


def _window(shape: TileShape, bd: int) -> int:
    """Documents a program takes of a block of ``bd`` (``TileShape.doc_window``; the whole block at 0)."""
    return shape.doc_window if 0 < shape.doc_window < bd else bd


def _rank_tiles(num_tiles: int, shard: bool) -> tuple[range, bool]:
    """This rank's query tiles (contiguous, 1/W of them; all unsharded) and whether results are summed."""
    if not (shard and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return range(num_tiles), False
    rank, world = dist.get_rank(), dist.get_world_size()
    return range(num_tiles * rank // world, num_tiles * (rank + 1) // world), True


def fused_sparse_logsumexp(
    q_reps: SparseReps,
    d_reps: Sequence[SparseReps],
    *,
    temperature: float,
    shard_across_ranks: bool = False,
) -> Tensor:
    """Each query's log-sum-exp of its scaled scores against every document -> [B] fp32 (module doc).

    Differentiable in ``q_reps.weights`` and every ``d_reps[c].weights`` (fp32). Unchecked: columns of one V on
    one device, ``temperature > 0``; :func:`use_fused_kernel` says where it runs.
    """
    layouts = (q_reps, *d_reps)
    return _FusedLogSumExp.apply(
        layouts, temperature, shard_across_ranks, q_reps.weights, *(d.weights for d in d_reps)
    )


class _Saved(NamedTuple):
    """What the backward reuses: the forward's tables, tiles, document blocks and settings."""

    tiles: QueryTiles
    rows: range
    summed: bool
    bd: int
    shape: TileShape
    parts: int
    sparse_max: int


class _FusedLogSumExp(torch.autograd.Function):
    """Row log-sum-exp of the scaled scores, forward and backward in the kernels of :mod:`.fused_lse_triton`."""

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        layouts: tuple[SparseReps, ...],
        temperature: float,
        shard: bool,
        q: Tensor,
        *d: Tensor,
    ) -> Tensor:
        from gradcache_sparton.losses.fused_lse_triton import launch_forward

        shape = _tile_shape()
        q_layout, d_layouts = layouts[0], layouts[1:]
        dtype = torch.bfloat16 if products_in_bf16([q, *d]) else torch.float32
        order = query_order(q_layout) if SORT_QUERIES else None
        tiles = build_query_tiles(
            q_layout,
            q,
            bm=shape.bm,
            bk=shape.bk,
            dtype=dtype,
            order=order,
            hot_columns=shape.hot_columns,
            hot_min_tile_fraction=shape.hot_min_tile_fraction,
        )
        own, summed = _rank_tiles(tiles.tile_ptr.numel() - 1, shard)
        if summed:
            check_same_on_every_rank([q, *d], num_rows=q_layout.num_rows)
        num_rows = q_layout.num_rows
        bd = _document_rows(q_layout.vocab_size, shape)
        window = _window(shape, bd)
        # each window's running max and sum [windows, B], merged after the last block
        run_max = torch.full((-(-bd // window), num_rows), -torch.inf, dtype=torch.float32, device=q.device)
        run_sum = torch.zeros_like(run_max)
        for layout, weights in zip(d_layouts, d, strict=True):
            for block in DocBlocks(layout, bd).blocks(weights, dtype):
                launch_forward(
                    tiles.qt, tiles.cols, tiles.tile_ptr, tiles.row_idx, block.dt, run_max, run_sum,
                    num_rows=num_rows, n_docs=block.n, inv_t=1.0 / temperature, tiles=own, window=window, bm=shape.bm,
                    bk=shape.bk, bn=shape.bn_forward, warps=shape.warps, stages=shape.stages,
                    window_major="forward" in shape.window_major,
                )  # fmt: skip
        rows = tiles.row_idx[own.start * shape.bm : own.stop * shape.bm].long()
        rows = rows[rows < num_rows]  # this rank's queries
        top = run_max[:, rows].amax(0)  # finite: window 0 of the first block holds a document
        lse = torch.zeros(num_rows, dtype=torch.float32, device=q.device)  # [B]; other ranks' rows stay zero
        lse[rows] = top + torch.log((run_sum[:, rows] * torch.exp(run_max[:, rows] - top)).sum(0))
        if summed:
            dist.all_reduce(lse)
        ctx.save_for_backward(q, lse, *d)
        ctx.layouts, ctx.temperature, ctx.dtype = layouts, temperature, dtype
        ctx.plan = _Saved(tiles, own, summed, bd, shape, SPLIT_PARTS, SPARSE_TILE_MAX)
        return lse

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad_lse: Tensor) -> tuple[Tensor | None, ...]:
        from gradcache_sparton.losses.fused_lse_triton import QueryEntries, WorkLists, launch_backward
        from gradcache_sparton.losses.stored_weights_triton import HotColumns, QueryChunks, allocate_stored

        q, lse, *d = ctx.saved_tensors
        saved: _Saved = ctx.plan
        tiles, shape = saved.tiles, saved.shape
        q_layout, d_layouts = ctx.layouts[0], ctx.layouts[1:]
        num_rows, inv_t = q_layout.num_rows, 1.0 / ctx.temperature
        g = (grad_lse.to(torch.float32) * inv_t).contiguous()  # [B]
        needs_q, needs_d = ctx.needs_input_grad[3], ctx.needs_input_grad[4:]
        grad_qt = torch.zeros(tiles.qt.shape, dtype=torch.float32, device=q.device) if needs_q else None
        queries = QueryEntries(
            q_layout.offsets, q_layout.token_ids, q, torch.zeros_like(q) if needs_q else None
        )
        capacity = min(PAIR_CAPACITY, len(saved.rows) * shape.bm * saved.bd)  # at most every score of a block
        window = _window(shape, saved.bd)
        programs = len(saved.rows) * -(-saved.bd // window)
        work = WorkLists.allocate(capacity, programs, window // shape.bn_scan, q.device)
        stored = None  # the query pass's softmax weights for the document pass (TileShape.store_weights)
        hot = None  # the hot columns (TileShape.hot_columns), where the stored weights hold every tile's
        chunks = None  # the query gradient's programs (TileShape.query_grad_from_stored), there too
        grad_d: list[Tensor | None] = []
        routes = None  # decided after the first document block: see ROUTES_MAX_DENSE_FRACTION
        for layout, weights, needs in zip(d_layouts, d, needs_d, strict=True):
            grad = torch.zeros_like(weights, dtype=torch.float32) if needs else None
            if grad_qt is None and grad is None:
                grad_d.append(None)
                continue
            for block in DocBlocks(layout, saved.bd).blocks(weights, ctx.dtype, grads=needs):
                launch_backward(
                    tiles.qt, tiles.cols, tiles.tile_ptr, tiles.row_idx, block.dt, lse, g, grad_qt, block.grad_dt,
                    queries, work, num_rows=num_rows, n_docs=block.n, inv_t=inv_t, tiles=saved.rows, window=window,
                    bm=shape.bm, bk=shape.bk, bn=shape.bn_backward, bn_scan=shape.bn_scan, warps=shape.warps,
                    stages=shape.stages, parts=saved.parts, sparse_max=saved.sparse_max, routes=routes is not False,
                    dense_split=shape.dense_split, window_major=shape.window_major, stored=stored if needs else None,
                    hot=hot if needs else None, query_chunks=chunks if needs else None, bn_store=shape.bn_store,
                )  # fmt: skip
                if routes is None:  # one device read: the first block's tiles on the tensor cores
                    score_tiles, dense = len(saved.rows) * -(-block.n // shape.bn_scan), work.dense_tiles()
                    routes = dense < ROUTES_MAX_DENSE_FRACTION * score_tiles
                    if shape.store_weights and dense and needs_q and any(needs_d):  # for the later blocks
                        stored = allocate_stored(
                            len(saved.rows) * shape.bm, saved.bd, device=q.device,
                            split_parts=saved.parts if shape.store_split and ctx.dtype == torch.bfloat16 else 0,
                        )  # fmt: skip
                        if not routes and tiles.hot_ids.numel():
                            weights_h = hot_weights(tiles, saved.rows, q_layout.vocab_size)
                            hot = HotColumns(tiles.hot_ids, weights_h, tiles.cold_end)
                        if not routes and shape.query_grad_from_stored:
                            chunks = QueryChunks.build(tiles.tile_ptr, saved.rows, shape.bm)
                if grad is not None and block.grad_dt is not None:
                    grad[block.lo : block.hi] = block.grad_dt[block.entries]
            grad_d.append(grad)
        grad_q = (
            None if grad_qt is None else grad_qt[tiles.entry_pos, tiles.entry_lane] + queries.grad
        )  # [nnz_q]
        if saved.summed:
            for grad in (grad_q, *grad_d):
                if grad is not None:
                    dist.all_reduce(grad)
        grads = [grad_q, *grad_d]
        cast = [None if g_ is None else g_.to(t.dtype) for g_, t in zip(grads, (q, *d), strict=True)]
        return None, None, None, *cast  # layouts, temperature, shard, q, *d
