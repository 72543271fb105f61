"""Sparse reps through Steps (1) and (2) (``GradCache(sparse_reps=...)``, ``SpladeLoss`` on ``SparseReps``).

The invariant: the sparse path gives the dense path's loss and every parameter gradient, and its
memory holds the non-zeros only. Tolerances: the sparse loss adds the same fp32 terms in another order
(scores summed over the non-zeros by ``index_add`` instead of over V, a blocked log-sum-exp instead
of one cross-entropy), which moves values by a few fp32 ulps. Measured: loss and components <= 3.1e-7
relative; parameter gradients <= 2.7e-6 relative to each parameter's largest gradient (as in
tests/test_engine.py); rep gradients <= 2e-6 of the largest one. rtol 1e-5 for gradients and 1e-6
for losses leave >= 3x room, while a dropped, doubled or misplaced non-zero, block or mini-batch is an
O(1e-2) or larger error (checked by mutation: accumulating a block's gradient with ``=`` instead of
``+=``, or skipping the reorder of length-grouped mini-batches, fails these tests).
"""

from __future__ import annotations

import pytest
import torch
from engine_helpers import assert_grads_close, grads_of, make_columns, make_encoder, small_config

from gradcache_sparton.engine import GradCache
from gradcache_sparton.engine.mini_batch import Rows
from gradcache_sparton.engine.reps import replay_grads
from gradcache_sparton.engine.sparse_grads import SparseRepGrad
from gradcache_sparton.losses import SpladeLoss, SpladeLossConfig
from gradcache_sparton.primitives.sparse_reps import SparseReps

RTOL_GRADS = 1e-5  # see the module docstring
RTOL_LOSS = 1e-6
BATCH = 8


@pytest.fixture
def config(tiny_bert_config):
    return small_config(tiny_bert_config)


def _sparse_encoder(config, bias_shift: float):
    """The tiny encoder with its output bias lowered: reps ~93% (0.0), ~21% (0.2) or ~3% (0.3) non-zero."""
    encoder = make_encoder(config, train=True)
    with torch.no_grad():
        encoder.mlm.cls.predictions.bias -= bias_shift
    return encoder


def _loss(**settings) -> SpladeLoss:
    return SpladeLoss(SpladeLossConfig(query_reg_weight=0.3, doc_reg_weight=0.2, **settings))


@pytest.mark.parametrize(
    ("bias_shift", "mini_batch_size", "mini_batch_tokens", "score_block_size"),
    [(0.0, 4, None, None), (0.2, 3, None, 3), (0.3, 3, 25, None), (0.3, 4, None, 3)],
    ids=["dense-mb4", "21pct-mb3-block3", "3pct-tok25", "3pct-mb4-block3"],
)
def test_sparse_reps_step_matches_dense_step(
    config, bias_shift: float, mini_batch_size: int, mini_batch_tokens, score_block_size
) -> None:
    """GradCache.step with sparse_reps=True and SpladeLoss (InfoNCE with a hard negative, FLOPS) gives the
    dense step's loss and every parameter gradient (dropout on), at several densities, with an all-zero
    row, mini-batches dividing the batch or not, consecutive or length-grouped, one or several score blocks."""
    columns = make_columns(BATCH, 3)
    columns["positive"]["attention_mask"][5] = 0  # an all-zero rep row
    loss_fn = _loss(score_block_size=score_block_size)
    results = []
    for sparse in (False, True):
        encoder = _sparse_encoder(config, bias_shift)
        torch.manual_seed(3)
        engine = GradCache(
            encoder, mini_batch_size=mini_batch_size, mini_batch_tokens=mini_batch_tokens, sparse_reps=sparse
        )
        loss, components = engine.step(columns, loss_fn)
        results.append((loss, components, grads_of(encoder)))
    (dense_loss, dense_parts, dense_grads), (sparse_loss, sparse_parts, sparse_grads) = results
    torch.testing.assert_close(sparse_loss, dense_loss, rtol=RTOL_LOSS, atol=0)
    for name in ("reg_query", "reg_doc", "nnz_query", "nnz_doc", "flops"):
        torch.testing.assert_close(sparse_parts[name], dense_parts[name], rtol=RTOL_LOSS, atol=0, msg=name)
    assert_grads_close(sparse_grads, dense_grads, rtol=RTOL_GRADS)


def test_sparse_reps_keep_only_the_nonzeros(config) -> None:
    """Step (1) with sparse_reps keeps per column exactly nnz ids and nnz weights (and B + 1 offsets), never
    B x V, holding the dense reps' non-zeros in the column's row order (length-grouped mini-batches too);
    Step (2)'s gradient reaches Step (3) as a SparseRepGrad of nnz values."""
    columns = make_columns(BATCH, 3)
    encoder = _sparse_encoder(config, 0.3).eval()  # no dropout: every encode gives the same reps
    for tokens in (None, 25):
        dense_reps, _ = GradCache(encoder, mini_batch_size=3, mini_batch_tokens=tokens).encode(columns)
        engine = GradCache(encoder, mini_batch_size=3, mini_batch_tokens=tokens, sparse_reps=True)
        reps, replay_state = engine.encode(columns)
        for column, dense in dense_reps.items():
            sparse = reps[column]
            nnz = int(dense.ne(0).sum())
            assert isinstance(sparse, SparseReps) and 0 < nnz < dense.numel() // 10
            assert sparse.weights.numel() == sparse.token_ids.numel() == nnz
            assert sparse.offsets.numel() == BATCH + 1
            assert torch.equal(sparse.to_dense(), dense)
        _, rep_grads = engine.rep_gradients(reps, _loss())
        kept = replay_grads(reps, rep_grads, replay_state.mini_batches)
        for column, grad in kept.items():
            assert isinstance(grad, SparseRepGrad) and grad.values.numel() == reps[column].weights.numel()


def test_sparse_reps_step_one_waits_on_no_host_read(config, monkeypatch) -> None:
    """Step (1) with sparse_reps sizes no mini-batch's non-zeros by a host read (``nonzero`` or
    ``bincount``, each a device sync): every mini-batch is made sparse once the next is encoded, at the
    count read by then, and the column holds exactly the dense reps' non-zeros."""
    columns = make_columns(BATCH, 3)
    encoder = _sparse_encoder(config, 0.3).eval()
    dense_reps, _ = GradCache(encoder, mini_batch_size=3).encode(columns)

    def host_read(*args, **kwargs):
        raise AssertionError("Step (1) sized non-zeros by a host read (a device sync)")

    monkeypatch.setattr(torch.Tensor, "nonzero", host_read)
    monkeypatch.setattr(torch, "bincount", host_read)
    reps, _ = GradCache(encoder, mini_batch_size=3, sparse_reps=True).encode(columns)
    for column, dense in dense_reps.items():
        assert torch.equal(reps[column].to_dense(), dense)


def test_from_dense_with_a_known_count_equals_without() -> None:
    """SparseReps.from_dense(reps, nnz=n) (the count known on the host) keeps the same offsets, ids and
    weights as the host-read path, an all-zero row and a NaN (a non-zero) included."""
    reps = _random_sparse(5, 11, 0.3, seed=4)
    reps[2] = 0.0
    reps[3, 7] = float("nan")
    expected = SparseReps.from_dense(reps)
    got = SparseReps.from_dense(reps, nnz=int(reps.ne(0).sum()))
    assert torch.equal(got.offsets, expected.offsets) and torch.equal(got.token_ids, expected.token_ids)
    torch.testing.assert_close(got.weights, expected.weights, rtol=0, atol=0, equal_nan=True)


def _random_sparse(rows: int, width: int, density: float, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    reps = torch.rand(rows, width, generator=generator) * 3
    return reps.masked_fill(torch.rand(rows, width, generator=generator) >= density, 0.0)


@pytest.mark.parametrize(
    "settings",
    [
        {},
        {"score_block_size": 2},
        {"query_regularizer": "l1", "doc_regularizer": "l1"},
        {"contrastive": "margin_mse"},
        {"contrastive": "kl_div", "temperature": 0.5},
        {"contrastive": "kl_div", "kl_in_batch": True, "score_block_size": 3},
    ],
    ids=["infonce", "infonce-block2", "l1", "margin_mse", "kl_div", "kl_in_batch"],
)
@pytest.mark.parametrize("density", [0.0, 0.3, 1.0], ids=["empty", "30pct", "full"])
def test_sparse_splade_loss_matches_dense(settings, density: float) -> None:
    """SpladeLoss on SparseReps equals it on the dense reps (loss and every component) and its gradient
    w.r.t. the weights is the dense rep gradient at the non-zeros, for each contrastive loss and
    regularizer, with all-zero rows and fully dense rows, at densities 0 (only those rows), 30% and 100%."""
    B, V = 7, 13
    reps = {name: _random_sparse(B, V, density, seed) for seed, name in enumerate(("q", "pos", "neg"))}
    reps["q"][1] = 0.0  # an all-zero row
    reps["pos"][2] = 1.5  # a fully dense row
    reps["neg"][4] = 0.0
    reps["pos"][4] = 0.0  # a query whose positive is empty
    teacher = torch.randn(B, 2, generator=torch.Generator().manual_seed(9))
    loss_kwargs = {"teacher_scores": teacher} if "contrastive" in settings else {}
    loss_fn = _loss(**settings)
    dense_leaves = {name: rep.clone().requires_grad_() for name, rep in reps.items()}
    dense_loss, dense_parts = loss_fn(dense_leaves, **loss_kwargs)
    dense_loss.backward()
    sparse = {name: SparseReps.from_dense(rep) for name, rep in reps.items()}
    weights = {name: s.weights.clone().requires_grad_() for name, s in sparse.items()}
    leaves = {name: SparseReps(s.offsets, s.token_ids, weights[name], V) for name, s in sparse.items()}
    sparse_loss, sparse_parts = loss_fn(leaves, **loss_kwargs)
    sparse_loss.backward()
    torch.testing.assert_close(sparse_loss, dense_loss.detach(), rtol=RTOL_LOSS, atol=0)
    for name, value in dense_parts.items():
        torch.testing.assert_close(sparse_parts[name], value, rtol=RTOL_LOSS, atol=0, msg=name)
    largest = max(float(leaf.grad.abs().max()) for leaf in dense_leaves.values())
    assert largest > 0
    for name, leaf in dense_leaves.items():
        nonzero = reps[name].ne(0)
        expected = leaf.grad[nonzero]  # row-major, as the SparseReps entries
        grad = weights[name].grad if weights[name].grad is not None else torch.zeros_like(expected)
        torch.testing.assert_close(grad, expected, rtol=RTOL_GRADS, atol=RTOL_GRADS * largest, msg=name)


def test_sparse_rep_grad_at_sparse_reps_places_the_gradient_by_mini_batch() -> None:
    """A gradient given at the weights of SparseReps gives back, for each mini-batch, the dense gradient
    where the rep is non-zero and 0 elsewhere, for consecutive and length-grouped mini-batches, with an
    all-zero row."""
    reps = _random_sparse(7, 11, 0.3, seed=0)
    reps[2] = 0.0  # an all-zero row
    grad = torch.randn(7, 11, generator=torch.Generator().manual_seed(1))
    sparse = SparseReps.from_dense(reps)
    mini_batches: list[list[Rows]] = [
        [slice(0, 3), slice(3, 6), slice(6, 7)],
        [torch.tensor([4, 0, 6]), torch.tensor([2, 5, 1, 3])],
    ]
    for rows in mini_batches:
        placed = SparseRepGrad.at_sparse_reps(sparse, grad[reps.ne(0)], rows)
        assert placed.values.numel() == int(reps.ne(0).sum())
        for k, mb_rows in enumerate(rows):
            assert torch.equal(placed.mini_batch(k), (grad * reps.ne(0))[mb_rows])


def test_sparse_splade_loss_rounds_half_precision_gradients_once() -> None:
    """On bf16 reps the sparse SpladeLoss upcasts the weights once, as the dense loss upcasts the reps:
    its bf16 gradient at the non-zeros is the dense one to within one bf16 rounding (fp32 gradients
    that differ by a few ulps may round to neighbouring bf16 values)."""
    B, V = 6, 17
    reps = {
        name: _random_sparse(B, V, 0.4, seed).to(torch.bfloat16) for seed, name in enumerate(("q", "pos"))
    }
    loss_fn = _loss()
    dense_leaves = {name: rep.clone().requires_grad_() for name, rep in reps.items()}
    loss_fn(dense_leaves)[0].backward()
    sparse = {name: SparseReps.from_dense(rep, dtype=None) for name, rep in reps.items()}
    weights = {name: s.weights.clone().requires_grad_() for name, s in sparse.items()}
    loss_fn({name: SparseReps(s.offsets, s.token_ids, weights[name], V) for name, s in sparse.items()})[
        0
    ].backward()
    largest = max(float(leaf.grad.abs().max()) for leaf in dense_leaves.values())
    for name, leaf in dense_leaves.items():
        assert weights[name].grad.dtype == torch.bfloat16
        expected = leaf.grad[reps[name].ne(0)].float()
        bf16_ulp = 2.0**-8  # one bf16 rounding, relative
        torch.testing.assert_close(
            weights[name].grad.float(), expected, rtol=bf16_ulp, atol=bf16_ulp * largest, msg=name
        )


def test_sparse_reps_auto_picks_by_density(config) -> None:
    """sparse_reps="auto" keeps a step's reps sparse when the first mini-batch is ~3% non-zero, dense
    ([B, V] tensors) when it is ~93% non-zero."""
    columns = make_columns(BATCH, 2)
    for bias_shift, kind in ((0.3, SparseReps), (0.0, torch.Tensor)):
        engine = GradCache(_sparse_encoder(config, bias_shift), mini_batch_size=4, sparse_reps="auto")
        reps, _ = engine.encode(columns)
        assert all(isinstance(rep, kind) for rep in reps.values()), bias_shift


def test_sparse_reps_bad_settings_raise(config) -> None:
    """A sparse_reps other than false/true/auto, or a loss call mixing dense and sparse columns, is
    refused with an error naming it (CachedLoss takes sparse_reps: tests/test_sparse_reps_training.py)."""
    encoder = make_encoder(config)
    with pytest.raises(ValueError, match="sparse_reps must be one of false, true, auto, got 'yes'"):
        GradCache(encoder, mini_batch_size=2, sparse_reps="yes")
    dense = torch.rand(3, 5)
    with pytest.raises(TypeError, match=r"reps\['positive'\] is a Tensor but other columns are SparseReps"):
        _loss()({"query": SparseReps.from_dense(dense), "positive": dense})
    with pytest.raises(ValueError, match=r"reps\['positive'\] is \[2, 5\]"):
        _loss()({"query": SparseReps.from_dense(dense), "positive": SparseReps.from_dense(dense[:2])})
