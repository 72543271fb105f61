"""The fused sparse log-sum-exp (``losses/fused_lse.py``): lse, loss and every gradient against a dense fp64
computation and the blocked path, under the Triton interpreter on CPU (compiled on a GPU).

Legend: B queries, N documents (2B: positives, one hard-negative column), V vocabulary.

Shapes are small but awkward: B = 37 (query tiles of 16: 16 + 16 + 5), V = 53, documents in blocks of 16 (the
module's block bound patched down: 37 = 16 + 16 + 5 per column), an all-zero query row, all-zero documents,
duplicate documents, temperature 0.7, an upstream gradient of both signs. Tile dtypes: fp32 tiles (weights
that are not bf16 values; ieee products) and bf16 tiles (bf16 values), with the backward's softmax weights
split in 2 bf16 parts (the default) or 3 ("bf16-exact").

Tolerance (docs/losses.md, "The fused kernel": the bound): every quantity is compared as
``|got - want| <= TOL · scale`` where ``scale`` is the same quantity computed from absolute values in fp64
(sum of |terms|): fp32 sums of n terms err by at most ``n · 2^-24`` of that (first order), and the largest n
here (a gradient: N = 74 documents, plus a score's <= 53 products, the exp and the split) is < 200, so
TOL = 200 · 2^-24 ≈ 1.2e-5. A missing product, tile, document block or split part (one bf16 part alone: 2^-9
relative) is far outside it.
"""

from __future__ import annotations

import pytest
import torch
from lse_reference import (
    assert_grads_within_bound,
    assert_lse_within_bound,
    lse_reference,
    sparse_leaves,
)

from gradcache_sparton.losses import (
    SpladeLoss,
    SpladeLossConfig,
    fused_lse,
    fused_lse_triton,
    query_tiles,
    stored_weights_triton,
)
from gradcache_sparton.losses.fused_lse import fused_sparse_logsumexp, use_fused_kernel
from gradcache_sparton.primitives.sparse_reps import SparseReps

pytestmark = pytest.mark.kernel

B, V, TEMPERATURE = 37, 53, 0.7
TOL = 200 * 2.0**-24  # see the module docstring
TILE_DTYPES = ["fp32", "bf16", "bf16-exact"]


def _grad_tol(kind: str) -> float:
    """TOL, plus for 2 bf16 parts each softmax weight's own error: within 2^-16 of it (8 + 8 significant bits)."""
    return TOL + (2.0**-16 if kind == "bf16" else 0.0)


def _document_blocks(monkeypatch, rows: int) -> None:
    """The interpreter's setting with documents in blocks of ``rows`` (``TileShape.doc_block_bytes`` for V)."""
    tiles = fused_lse.INTERPRETER_TILES._replace(doc_block_bytes=4 * (V + 1) * rows)
    monkeypatch.setattr(fused_lse, "INTERPRETER_TILES", tiles)


@pytest.fixture(autouse=True)
def small_document_blocks(monkeypatch) -> None:
    """Documents in blocks of 16 rows (several blocks a column, as on the GPU)."""
    _document_blocks(monkeypatch, 16)


def _dense_batch(kind: str, seed: int = 0) -> list[torch.Tensor]:
    """Queries, positives, negatives [B, V] >= 0 (relu'd, ~30% / 60% non-zero) with the awkward rows."""
    generator = torch.Generator().manual_seed(seed)

    def column(density: float) -> torch.Tensor:
        values = torch.rand(B, V, generator=generator) * 2.5
        return values * (torch.rand(B, V, generator=generator) < density)

    columns = [column(0.3), column(0.6), column(0.6)]
    if kind.startswith("bf16"):
        columns = [c.to(torch.bfloat16).float() for c in columns]
    else:  # not bf16 values
        columns = [c + (c != 0) * 1e-3 * torch.rand(B, V, generator=generator) for c in columns]
    q, pos, neg = columns
    q[3] = 0  # an empty query: every score 0, lse = log N
    pos[5] = 0  # empty documents
    neg[0] = 0
    pos[9] = pos[10] = neg[20]  # the same document three times
    return columns


def _tiles(monkeypatch, kind: str) -> None:
    """bf16 tiles wherever the values allow (the GPU's choice), forced here on CPU; 3 split parts for bf16-exact."""
    monkeypatch.setattr(fused_lse, "products_in_bf16", lambda tensors: kind.startswith("bf16"))
    monkeypatch.setattr(fused_lse, "SPLIT_PARTS", 3 if kind == "bf16-exact" else 2)


# The backward's routes for a score tile (fused_lse.SPARSE_TILE_MAX, PAIR_CAPACITY): every non-zero tile on the
# tensor cores; every one by pairs; tiles of more than 50 non-zero weights (all are non-zero at this temperature:
# 16 x 16, 16 x 5 or 5 x 16) on the tensor cores, the 5 x 5 tiles by pairs; by pairs until the room for 100 pairs
# is spent (the tile that crosses it fills its slots below with zeros), then on the tensor cores. The checks read
# the last document block's lists (5 documents: tiles of 80, 80 and 25 weights).
ROUTES = {
    "dense": {"SPARSE_TILE_MAX": 0},
    "pairs": {"SPARSE_TILE_MAX": 10**6},
    "mixed": {"SPARSE_TILE_MAX": 50},
    "overflow": {"SPARSE_TILE_MAX": 10**6, "PAIR_CAPACITY": 100},
}


def _route(monkeypatch, route: str) -> list:
    """Set ``route``'s settings; returns the list that collects each backward's work lists (their last block)."""
    monkeypatch.setattr(
        fused_lse, "ROUTES_MAX_DENSE_FRACTION", 2.0
    )  # never leave the routes: every block checked
    for name, value in ROUTES[route].items():
        monkeypatch.setattr(fused_lse, name, value)
    made = []
    allocate = fused_lse_triton.WorkLists.allocate

    def recorded(*args, **kwargs):
        made.append(allocate(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(fused_lse_triton.WorkLists, "allocate", recorded)
    return made


@pytest.mark.parametrize("route", list(ROUTES))
@pytest.mark.parametrize("sort", [True, False], ids=["sorted", "batch-order"])
@pytest.mark.parametrize("kind", TILE_DTYPES)
def test_fused_lse_and_grads_match_fp64(monkeypatch, kind: str, sort: bool, route: str) -> None:
    """lse [B] and the gradients of the queries, positives and negatives equal dense fp64 within the bound, with
    the queries sorted into tiles by their heaviest terms or in the batch's order, every score tile's gradient
    taken on the tensor cores, by pairs, by either as its non-zeros decide, or by pairs until their room is
    spent; each route is seen taken (the last block's work lists)."""
    _tiles(monkeypatch, kind)
    made = _route(monkeypatch, route)
    monkeypatch.setattr(fused_lse, "SORT_QUERIES", sort)
    columns = _dense_batch(kind)
    upstream = torch.randn(B, generator=torch.Generator().manual_seed(1))  # both signs
    reps = sparse_leaves(columns)
    lse = fused_sparse_logsumexp(reps[0], reps[1:], temperature=TEMPERATURE)
    (lse * upstream).sum().backward()
    want = lse_reference(columns, upstream, temperature=TEMPERATURE)
    assert_lse_within_bound(lse, want, TOL)
    assert_grads_within_bound(reps, want, [_grad_tol(kind)] * 3)
    (work,) = made
    pairs, dense = int(work.pair_count), work.dense_tiles()
    expected = {"dense": (pairs == 0, dense > 0), "pairs": (pairs > 0, dense == 0),
                "mixed": (pairs > 0, dense > 0), "overflow": (pairs > 100, dense > 0)}  # fmt: skip
    assert all(expected[route]), (pairs, dense)


@pytest.mark.parametrize("kind", TILE_DTYPES)
def test_peaked_softmax_drops_zero_tiles(monkeypatch, kind: str) -> None:
    """At temperature 0.01 most softmax weights underflow to exactly 0 (trained reps at 0.05 leave ~0.1% of them
    non-zero): tiles whose weights are all 0 are dropped, and the live ones give the same gradients on the tensor
    cores as by pairs (the same weights p, summed in other orders: within the bound of each other), and dense
    fp64's within the bound widened for the exponent's rounding, which such scores magnify: an error d in
    s/T - lse is a relative error d in p, and d <= (53 + 3) · 2^-24 · max |s/T| (a score's <= 53 products, the
    scaling, the lse and the difference). A dropped live tile loses its products: far outside either."""
    _tiles(monkeypatch, kind)
    _document_blocks(monkeypatch, 48)  # a column a block: 3 x 3 tiles
    columns = _dense_batch(kind)
    columns[2] = (
        columns[2] / 8
    )  # weak negatives (exact in both dtypes): their weights underflow, but the empty query's
    upstream = torch.rand(B, generator=torch.Generator().manual_seed(6)) + 0.5
    want = lse_reference(columns, upstream, temperature=0.01)
    grads, live = {}, {}
    for route in ("dense", "pairs"):
        made = _route(monkeypatch, route)
        reps = sparse_leaves(columns)
        lse = fused_sparse_logsumexp(reps[0], reps[1:], temperature=0.01)
        (lse * upstream).sum().backward()
        grads[route] = reps
        work = made[-1]  # the negatives' block: 3 query tiles x 3 document tiles
        live[route] = int(work.pair_count) if route == "pairs" else work.dense_tiles()
    assert 0 < live["dense"] < 9, live  # some of the 9 tiles dropped, some taken
    assert live["pairs"] > 0
    for dense, pairs, scale in zip(grads["dense"], grads["pairs"], want["scales"], strict=True):
        at = (dense.row_ids(), dense.token_ids.long())
        assert (
            (dense.weights.grad - pairs.weights.grad).abs() <= 2 * _grad_tol(kind) * scale[at] + 1e-12
        ).all()
    exponent = (53 + 3) * 2.0**-24 * float(want["lse"][1].max())  # lse scale: max |s/T| + log N
    assert_grads_within_bound(grads["pairs"], want, [_grad_tol(kind) + exponent] * 3)


def _launches(monkeypatch) -> list[dict]:
    """Set launch_backward to record each call's keyword arguments (a document block's launch) in the list returned."""
    launch, made = fused_lse_triton.launch_backward, []

    def recorded(*args, **kwargs):
        made.append(kwargs)
        launch(*args, **kwargs)

    monkeypatch.setattr(fused_lse_triton, "launch_backward", recorded)
    return made


def _backward_within_bound(kind: str, seed: int) -> None:
    """One forward and backward of the fused lse on ``kind``'s batch (upstream gradient from ``seed``): lse and every
    gradient equal dense fp64's within the bound."""
    columns = _dense_batch(kind)
    upstream = torch.randn(B, generator=torch.Generator().manual_seed(seed))
    reps = sparse_leaves(columns)
    lse = fused_sparse_logsumexp(reps[0], reps[1:], temperature=TEMPERATURE)
    (lse * upstream).sum().backward()
    want = lse_reference(columns, upstream, temperature=TEMPERATURE)
    assert_lse_within_bound(lse, want, TOL)
    assert_grads_within_bound(reps, want, [_grad_tol(kind)] * 3)


def _bf16_within_bound(
    monkeypatch, route: str, *, rows: int, seed: int, **tiles
) -> fused_lse_triton.WorkLists:
    """bf16 tiles with the interpreter's setting changed by ``tiles``, documents in blocks of ``rows``, ``route``'s
    routes: lse and every gradient equal dense fp64's within the bound; with ``store_weights`` the first document
    block recomputes its weights and a later one reads them stored, unless every tile goes by pairs; returns the
    backward's work lists."""
    _tiles(monkeypatch, "bf16")
    monkeypatch.setattr(fused_lse, "INTERPRETER_TILES", fused_lse.INTERPRETER_TILES._replace(**tiles))
    _document_blocks(monkeypatch, rows)
    made = _route(monkeypatch, route)
    launches = _launches(monkeypatch)
    _backward_within_bound("bf16", seed)
    stored = [kwargs["stored"] is not None for kwargs in launches]  # each block's weights stored or not
    if tiles.get("store_weights"):
        assert not stored[0] and any(stored[1:]) == (route != "pairs"), stored
    else:
        assert not any(stored), stored
    (work,) = made
    return work


# How the dense tiles' gradients are added: one kernel or two (dense_split), the second reading the first's softmax
# weights (store_weights).
SPLITS = {"one-dense-kernel": {}, "dense-split": {"dense_split": True},
          "dense-split-stored": {"dense_split": True, "store_weights": True}}  # fmt: skip


@pytest.mark.parametrize("split", list(SPLITS))
@pytest.mark.parametrize("route", ["dense", "mixed"])
def test_scan_wider_than_the_dense_tiles(monkeypatch, route: str, split: str) -> None:
    """The scan's tiles twice the dense kernel's (bn_scan 32, bn_backward 16, as on the GPU: 128 and 64): a listed
    tile is taken in its two halves, the last block's listed tile (5 documents) in one that holds them and one
    past them; with ``dense_split`` the dense tiles' query and document gradients come from two kernels (with
    ``store_weights`` the document pass reads the query pass's softmax weights, a wrong row or document of them
    fails). The gradients equal dense fp64's within the bound and both routes are seen taken."""
    work = _bf16_within_bound(
        monkeypatch, route, rows=32, seed=8, bn_scan=32, **SPLITS[split]
    )  # 32 + 5 a block
    assert work.dense_tiles() > 0 and (int(work.pair_count) > 0) == (route == "mixed")


def test_no_stored_weights_where_every_tile_goes_by_pairs(monkeypatch) -> None:
    """With ``store_weights``, a backward whose first document block lists no dense tile (every tile by pairs, as
    at temperature 0.05) passes stored weights to no block: their buffer (4·B·bd bytes) is never allocated. The
    gradients equal dense fp64's within the bound."""
    work = _bf16_within_bound(
        monkeypatch, "pairs", rows=32, seed=8, bn_scan=32, dense_split=True, store_weights=True
    )
    assert work.dense_tiles() == 0 and int(work.pair_count) > 0


@pytest.mark.parametrize("route", ["dense", "mixed"])
def test_forward_wider_than_the_backward(monkeypatch, route: str) -> None:
    """The forward's tiles twice the scan's and the dense kernels' (bn_forward 32 against 16, as the GPU's 256
    against 128), in windows of 32 (a column of 37 in one block: windows of 32 and 5, the second a part of one
    forward tile): the lse the backward reads comes from the wider forward, and lse and every gradient equal
    dense fp64's within the bound, both routes seen."""
    work = _bf16_within_bound(monkeypatch, route, rows=64, seed=10, bn_forward=32, doc_window=32)
    assert work.dense_count.numel() == 3 * 2  # 3 query tiles x 2 windows
    assert work.dense_tiles() > 0 and (int(work.pair_count) > 0) == (route == "mixed")


@pytest.mark.parametrize(
    "window_major",
    [(), ("query_grad", "doc_grad"), fused_lse.WINDOW_MAJOR_KERNELS],
    ids=["tile-major", "dense-passes-window-major", "all-window-major"],
)
@pytest.mark.parametrize("split", list(SPLITS))
@pytest.mark.parametrize("route", ["dense", "mixed"])
def test_document_windows(monkeypatch, route: str, split: str, window_major: tuple[str, ...]) -> None:
    """A block taken in windows of 16 documents a program (``TileShape.doc_window``; a column of 37 in one block:
    windows of 16, 16 and 5): the forward's per-window maxima and sums merged, the scan's lists per window, the
    dense tiles' query gradient added by each window's program (atomics), each kernel's programs tile-major or
    window-major (``window_major``: each program finds its tile and window, and the scan's list by them, not by
    its program number): lse and every gradient equal dense fp64's within the bound, both routes seen, and the
    work lists sized for 3 programs a query tile; with stored softmax weights each window's are its own."""
    work = _bf16_within_bound(
        monkeypatch, route, rows=48, seed=9, doc_window=16, window_major=window_major, **SPLITS[split]
    )
    assert work.dense_count.numel() == 3 * 3  # 3 query tiles x 3 windows
    assert work.dense_tiles() > 0 and (int(work.pair_count) > 0) == (route == "mixed")


@pytest.mark.parametrize("peaked", [False, True], ids=["flat", "peaked"])
def test_backward_leaves_the_routes_after_a_dense_first_block(monkeypatch, peaked: bool) -> None:
    """A backward whose first document block had more than ROUTES_MAX_DENSE_FRACTION of its score tiles on the
    tensor cores (temperature 0.7: every weight non-zero; SPARSE_TILE_MAX 0) runs its other blocks without the
    routes, one whose softmax is peaked (temperature 0.01, weak negatives) keeps them; the gradients equal dense
    fp64's within the bound either way."""
    _tiles(monkeypatch, "fp32")
    temperature = 0.01 if peaked else TEMPERATURE
    if not peaked:
        monkeypatch.setattr(fused_lse, "SPARSE_TILE_MAX", 0)
    launches = _launches(monkeypatch)
    columns = _dense_batch("fp32")
    if peaked:
        columns[2] = columns[2] / 8
    upstream = torch.rand(B, generator=torch.Generator().manual_seed(7)) + 0.5
    reps = sparse_leaves(columns)
    lse = fused_sparse_logsumexp(reps[0], reps[1:], temperature=temperature)
    (lse * upstream).sum().backward()
    seen = [kwargs["routes"] for kwargs in launches]
    assert seen == [True] * 6 if peaked else seen == [True] + [False] * 5, seen  # 3 blocks a column
    want = lse_reference(columns, upstream, temperature=temperature)
    exponent = (53 + 3) * 2.0**-24 * float(want["lse"][1].max()) if peaked else 0.0  # as in the peaked test
    assert_grads_within_bound(reps, want, [_grad_tol("fp32") + exponent] * 3)


@pytest.mark.parametrize("kind", TILE_DTYPES)
def test_entries_of_weight_zero_get_their_gradient(monkeypatch, kind: str) -> None:
    """An entry stored with weight 0 (a SparseReps may hold some) gets the dense gradient at its position,
    although the kernels find entries by their stored bits (-0.0 for these)."""
    _tiles(monkeypatch, kind)
    reps = []
    for column in _dense_batch(kind):
        r = SparseReps.from_dense(column)
        weights = r.weights.clone()
        weights[::5] = 0.0  # every fifth entry: an explicit zero
        reps.append(SparseReps(r.offsets, r.token_ids, weights.requires_grad_(True), r.vocab_size))
    upstream = torch.randn(B, generator=torch.Generator().manual_seed(4))
    lse = fused_sparse_logsumexp(reps[0], reps[1:], temperature=TEMPERATURE)
    (lse * upstream).sum().backward()
    want = lse_reference([r.to_dense().detach() for r in reps], upstream, temperature=TEMPERATURE)
    for r, grad in zip(
        reps, want["grads"], strict=True
    ):  # the zeros' gradients are not all zero: it can fail
        assert (grad[r.row_ids(), r.token_ids.long()][::5].abs() > 0).any()
    assert_grads_within_bound(reps, want, [_grad_tol(kind)] * 3)


@pytest.mark.parametrize("kind", TILE_DTYPES)
def test_empty_query_scores_log_n(monkeypatch, kind: str) -> None:
    """An all-zero query scores 0 against every document: its lse is log N up to fp32 rounding."""
    _tiles(monkeypatch, kind)
    reps = sparse_leaves(_dense_batch(kind))
    lse = fused_sparse_logsumexp(reps[0], reps[1:], temperature=TEMPERATURE)
    assert float(lse[3].detach()) == pytest.approx(float(torch.log(torch.tensor(2.0 * B))), rel=2**-22)


@pytest.mark.parametrize("kind", TILE_DTYPES)
def test_duplicate_documents_get_equal_gradients(monkeypatch, kind: str) -> None:
    """Three copies of one document (two positives, one negative) get the same gradient, within the bound."""
    _tiles(monkeypatch, kind)
    reps = sparse_leaves(_dense_batch(kind))
    lse = fused_sparse_logsumexp(reps[0], reps[1:], temperature=TEMPERATURE)
    lse.sum().backward()
    pos, neg = reps[1], reps[2]
    copies = [pos.weights.grad[pos.offsets[i] : pos.offsets[i + 1]] for i in (9, 10)]
    copies.append(neg.weights.grad[neg.offsets[20] : neg.offsets[21]])
    for other in copies[1:]:
        assert torch.allclose(other, copies[0], rtol=_grad_tol(kind), atol=0)


@pytest.mark.parametrize("kind", TILE_DTYPES)
@pytest.mark.parametrize("contrastive", ["infonce", "kl_div"])
def test_fused_loss_matches_blocked(monkeypatch, kind: str, contrastive: str) -> None:
    """SpladeLoss with score_kernel='fused' gives the blocked path's loss and every gradient (infonce, in-batch KL)."""
    _tiles(monkeypatch, kind)
    columns = _dense_batch(kind)
    settings = {"contrastive": contrastive, "temperature": TEMPERATURE}
    kwargs = {}
    if contrastive == "kl_div":
        settings["kl_in_batch"] = True
        kwargs["teacher_scores"] = torch.randn(B, 2, generator=torch.Generator().manual_seed(3))
    results = {}
    for kernel in ("fused", "blocked"):
        reps = dict(zip("qpn", sparse_leaves(columns), strict=True))
        loss, _ = SpladeLoss(SpladeLossConfig(score_kernel=kernel, **settings))(reps, **kwargs)
        loss.backward()
        results[kernel] = (loss, [r.weights.grad for r in reps.values()])
    (fused, fused_grads), (blocked, blocked_grads) = results["fused"], results["blocked"]
    # Both are within the bound of the fp64 value; their difference within twice that (scales ~ |values| here:
    # the loss and its gradients are sums of terms of one sign per row, up to the regularizers' small parts).
    assert fused.item() == pytest.approx(blocked.item(), rel=2 * TOL)
    for got, want in zip(fused_grads, blocked_grads, strict=True):
        assert (got - want).abs().max() <= (TOL + _grad_tol(kind)) * want.abs().max()


def test_query_order_groups_equal_term_sets() -> None:
    """query_order is a permutation of the rows that puts queries with the same terms next to each other and
    empty queries last."""
    generator = torch.Generator().manual_seed(5)
    dense = torch.rand(12, 40, generator=generator) * (torch.rand(12, 40, generator=generator) < 0.2)
    dense[7] = dense[2] * 2  # the same terms as row 2, other weights
    dense[4] = 0
    order = query_tiles.query_order(SparseReps.from_dense(dense)).tolist()
    assert sorted(order) == list(range(12))
    assert abs(order.index(7) - order.index(2)) == 1
    assert order[-1] == 4


@pytest.mark.parametrize(("fraction", "hot"), [(0.5, [0]), (0.375, [0, 1]), (0.25, [0, 1, 2])])
def test_hot_columns_are_those_enough_tiles_hold(fraction: float, hot: list[int]) -> None:
    """``TileShape.hot_min_tile_fraction``: of 8 query tiles, column 0 is held by all, 1 by 3 and 2 by 2, the others
    by one; the hot columns are exactly those held by at least the fraction of the tiles, the most held first,
    padded with V to a multiple of BM, and in each tile they come after its other columns."""
    dense = torch.zeros(32, 10)
    dense[0::4, 0] = 1.0  # a row of every tile of 4
    dense[[0, 4, 8], 1] = 2.0  # tiles 0-2
    dense[[12, 16], 2] = 3.0  # tiles 3-4
    dense[torch.arange(1, 28, 4), torch.arange(3, 10)] = 4.0  # columns 3-9, a tile each
    reps = SparseReps.from_dense(dense)
    tiles = query_tiles.build_query_tiles(
        reps, reps.weights, bm=4, bk=4, dtype=torch.float32, hot_columns=8, hot_min_tile_fraction=fraction
    )
    assert tiles.hot_ids.tolist() == hot + [10] * (-len(hot) % 4)
    for t in range(8):
        start, cold_end, end = int(tiles.tile_ptr[t]), int(tiles.cold_end[t]), int(tiles.tile_ptr[t + 1])
        assert not set(tiles.cols[start:cold_end].tolist()) & set(hot)
        assert set(tiles.cols[cold_end:end].tolist()) - {10} <= set(hot)


def test_fused_is_chosen_only_where_asked_or_measured(monkeypatch) -> None:
    """'blocked' never runs the kernel, 'fused' always (raising where it cannot), 'auto' only on a GPU from the
    measured size on."""
    reps = sparse_leaves(_dense_batch("fp32"))
    assert not use_fused_kernel(reps[0], reps[1:], "blocked")
    assert use_fused_kernel(reps[0], reps[1:], "fused")  # the interpreter runs it on CPU
    monkeypatch.setattr(fused_lse, "FUSED_MIN_QUERIES", 1)  # every size: only the device stops it
    assert not use_fused_kernel(reps[0], reps[1:], "auto")  # CPU tensors: never automatically
    fp64 = [SparseReps(r.offsets, r.token_ids, r.weights.detach().double(), r.vocab_size) for r in reps]
    with pytest.raises(ValueError, match="score_kernel='fused' needs fp32"):
        use_fused_kernel(fp64[0], fp64[1:], "fused")
    monkeypatch.setattr(fused_lse, "_interpreting", lambda: False)
    with pytest.raises(ValueError, match="on a CUDA device"):
        use_fused_kernel(reps[0], reps[1:], "fused")


def test_auto_follows_the_measured_query_count(monkeypatch) -> None:
    """'auto' takes the fused kernels from FUSED_MIN_QUERIES queries on (4,096: the H100 curve in docs/scale.md),
    the blocked path below, and follows the constant when it changes (on a GPU: test_fused_lse_gpu.py)."""
    assert fused_lse.FUSED_MIN_QUERIES == 4_096
    assert not fused_lse.fused_by_default(4_095)
    assert fused_lse.fused_by_default(4_096) and fused_lse.fused_by_default(131_072)
    monkeypatch.setattr(fused_lse, "FUSED_MIN_QUERIES", B)
    assert fused_lse.fused_by_default(B) and not fused_lse.fused_by_default(B - 1)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"bn_backward": 32}, r"bn_backward \(32\) must divide bn_scan \(16\)"),
        ({"doc_window": 24}, r"doc_window \(24\) must be 0 or a multiple of 16"),
        ({"doc_window": -16}, r"doc_window \(-16\) must be 0 or a multiple of 16"),
        ({"window_major": ("doc_grad",)}, r"window_major needs document windows \(doc_window > 0\)"),
        (
            {"doc_window": 16, "window_major": ("backward",)},
            r"window_major names kernels of .*\['backward'\]",
        ),
        (
            {"doc_window": 16, "window_major": ("doc_grad",)},
            r"without dense_split the query and document gradients are one kernel: window_major names both",
        ),
        ({"store_weights": True}, r"store_weights needs dense_split"),
        ({"bn_store": 32}, r"bn_store \(32\) must be 0, or > 0 with query_grad_from_stored"),
        ({"store_split": True}, r"store_split needs store_weights"),
        ({"hot_min_tile_fraction": 0.0}, r"hot_min_tile_fraction \(0.0\) must be in \(0, 1\]"),
    ],
)
def test_settings_that_would_lose_tiles_are_refused(monkeypatch, change: dict, match: str) -> None:
    """A setting whose backward tiles are wider than the scan's (each listed tile would be added in no part),
    whose windows cut a tile (its documents past the window's end in no program), that orders windows it does
    not have or kernels that do not exist, stores softmax weights no pass would read (the option would silently do
    nothing) or half of one kernel is a
    ValueError naming the field and what it needs, raised before any kernel runs."""
    monkeypatch.setattr(fused_lse, "INTERPRETER_TILES", fused_lse.INTERPRETER_TILES._replace(**change))
    reps = sparse_leaves(_dense_batch("fp32"))
    with pytest.raises(ValueError, match=match):
        fused_sparse_logsumexp(reps[0], reps[1:], temperature=TEMPERATURE)


def test_fused_refuses_dense_reps() -> None:
    """score_kernel='fused' with dense [B, V] reps is a ValueError naming the setting, not a silent blocked run."""
    columns = _dense_batch("fp32")
    with pytest.raises(ValueError, match="score_kernel='fused' scores sparse reps only"):
        SpladeLoss(SpladeLossConfig(score_kernel="fused"))(dict(zip("qpn", columns, strict=True)))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"score_kernel": "triton"}, "score_kernel must be one of"),
        ({"score_kernel": "fused", "contrastive": "margin_mse"}, "score_kernel applies to"),
        ({"score_kernel": "fused", "score_block_size": 64}, "score_block_size sets the blocked path"),
    ],
)
def test_score_kernel_config_is_checked(kwargs: dict, match: str) -> None:
    """A bad score_kernel, or one that cannot apply, raises a ValueError naming it before any work."""
    with pytest.raises(ValueError, match=match):
        SpladeLossConfig(**kwargs)


def _every_tile_stored(monkeypatch, kind: str, seed: int, rows: int = 16, **shape) -> list[dict]:
    """The dense gradients in two passes with stored softmax weights and the interpreter's setting changed by
    ``shape``, every score tile on the tensor cores, documents in blocks of ``rows`` (16: 3 a column; the first
    recomputes and leaves the routes, the later ones store every tile's weights); lse and every gradient equal dense
    fp64's within the bound. Returns each document block's launch_backward keyword arguments."""
    _tiles(monkeypatch, kind)
    _document_blocks(monkeypatch, rows)
    tiles = fused_lse.INTERPRETER_TILES._replace(dense_split=True, store_weights=True, **shape)
    monkeypatch.setattr(fused_lse, "INTERPRETER_TILES", tiles)
    monkeypatch.setattr(fused_lse, "SPARSE_TILE_MAX", 0)
    launches = _launches(monkeypatch)
    _backward_within_bound(kind, seed)
    return launches


@pytest.mark.parametrize("windows", [0, 16], ids=["whole-block", "windows"])
@pytest.mark.parametrize("kind", ["fp32", "bf16"])
def test_hot_columns_leave_the_document_pass(monkeypatch, kind: str, windows: int) -> None:
    """Hot columns (``TileShape.hot_columns`` 16 of V = 53: here every column is held by every tile, the 16 most
    held taken) with stored weights: each block after the first (which recomputes and leaves the routes, every
    tile dense) adds the hot columns' document gradient in one product over every query (``_hot_kernel``, in
    programs of 16 rows: several partial sums a tile), the document pass the other columns alone; lse and every
    gradient equal dense fp64's within the bound (a hot column added twice, or not at all, is far outside it)."""
    monkeypatch.setattr(stored_weights_triton, "HOT_ROWS_A_PROGRAM", 16)
    launches = _every_tile_stored(monkeypatch, kind, 11, hot_columns=16, doc_window=windows)
    hot = [kwargs["hot"] for kwargs in launches]
    assert hot[0] is None and all(h is not None for h in hot[1:]), hot  # 3 blocks a column
    assert hot[1].ids.numel() == 16 and bool((hot[1].ids < V).all())


@pytest.mark.parametrize("hot", [0, 16], ids=["cold", "hot"])
@pytest.mark.parametrize("windows", [0, 16], ids=["whole-block", "windows"])
@pytest.mark.parametrize("kind", ["fp32", "bf16"])
def test_query_gradient_from_stored_weights(monkeypatch, kind: str, windows: int, hot: int) -> None:
    """``TileShape.query_grad_from_stored``: each block after the first (which recomputes and leaves the routes, every
    tile dense) adds the query gradient from the stored weights, one product over the block a chunk of a tile's
    columns (``_query_grad_kernel``, chunks of 32 rows: a tile's last ends mid-chunk), the query pass only storing
    them; with and without hot columns, lse and every gradient equal dense fp64's within the bound (a query gradient
    added twice or not at all, or a chunk's rows past its tile's, are far outside it)."""
    launches = _every_tile_stored(
        monkeypatch, kind, 12, hot_columns=hot, doc_window=windows, query_grad_from_stored=True
    )
    chunks = [kwargs["query_chunks"] for kwargs in launches]
    assert chunks[0] is None and all(c is not None for c in chunks[1:]), chunks  # 3 blocks a column
    assert chunks[1].tile.numel() > -(-B // 16), chunks[1]  # several chunks a tile


@pytest.mark.parametrize(("rows", "windows"), [(16, 0), (64, 32)], ids=["whole-block", "windows"])
@pytest.mark.parametrize("kind", TILE_DTYPES)
def test_weights_stored_as_split_parts_by_a_wider_pass(
    monkeypatch, kind: str, rows: int, windows: int
) -> None:
    """``TileShape.store_split`` and ``bn_store``: where every tile's weights are stored, the pass that only stores
    them takes score tiles 32 documents wide (the others 16; a block of 37 documents ends mid-tile) and, for bf16
    tiles, stores their 2 or 3 bf16 parts (fp32 tiles: fp32 weights), which the document pass, the hot columns'
    product and the query gradient read as stored; lse and every gradient equal dense fp64's within the bound (a
    part left out, 2^-9 of a weight, a part read from another's place, or a tile's masked documents written are
    far outside it)."""
    launches = _every_tile_stored(monkeypatch, kind, 13, rows=rows, hot_columns=16, doc_window=windows,
                                  query_grad_from_stored=True, store_split=True, bn_store=32)  # fmt: skip
    stored = [kwargs["stored"] for kwargs in launches]
    assert stored[0] is None and len(stored) > 1, stored  # later blocks store
    parts, dtype = {
        "fp32": (1, torch.float32),
        "bf16": (2, torch.bfloat16),
        "bf16-exact": (3, torch.bfloat16),
    }[kind]
    assert all(s.shape[0] == parts and s.dtype == dtype for s in stored[1:]), [s.shape for s in stored[1:]]
    assert all(kwargs["bn_store"] == 32 for kwargs in launches)


def test_query_chunks_cover_each_tile_row_once() -> None:
    """``QueryChunks.build``: the chunks of a rank's query tiles (here tiles 1 and 2 of 3) start at each tile's first
    row and every BC rows after it, none past its end, so every row of those tiles is in exactly one chunk and no
    other tile's row is in any."""
    bc = stored_weights_triton._query_grad_tile(16).bc
    tile_ptr = torch.tensor([0, 48, 48 + bc, 48 + 3 * bc + 16], dtype=torch.int32)
    chunks = stored_weights_triton.QueryChunks.build(tile_ptr, range(1, 3), 16)
    assert chunks.tile.tolist() == [0, 1, 1, 1]  # counted from the first of the rank's tiles
    assert chunks.row.tolist() == [48, 48 + bc, 48 + 2 * bc, 48 + 3 * bc]  # the last of 16 rows only
    covered = torch.cat(
        [
            torch.arange(r, min(r + bc, int(tile_ptr[t + 2])))
            for t, r in zip(chunks.tile.tolist(), chunks.row.tolist(), strict=True)
        ]
    )
    assert torch.equal(covered, torch.arange(48, int(tile_ptr[-1])))
