"""Listwise KL over the batch's documents with a teacher of every document: teacher_scores [B, (1+k)·B].

The invariant: ``kl_div`` with ``in_batch=True`` and a whole teacher matrix is
``mean_i KL(softmax(t_i / T_t) || softmax(s_i / T))`` over each query's full row of (1+k)·B documents, on
every path (the whole score matrix, score blocks, sparse reps) and through the GradCache engine. Tolerances:
fp32 against an fp64 reference on the same values, as tests/test_losses.py (a handful of fp32 roundings of
O(10) sums, ~1e-6 relative; 1e-5 catches a wrong column order, a missing term or bf16 scoring, O(1e-2)).
"""

from __future__ import annotations

import pytest
import torch
from engine_helpers import assert_matches_reference, leaf_copies, splade_like_reps

from gradcache_sparton.losses import SpladeLoss, SpladeLossConfig, kl_div_loss
from gradcache_sparton.primitives.sparse_reps import SparseReps

FP32_TOL = {"rtol": 1e-5, "atol": 1e-6}


def _reference(reps, teacher, temperature: float, teacher_temperature: float) -> torch.Tensor:
    """Per query: F.kl_div of the student's log-softmax over all (1+k)·B documents of the batch (column
    c·B + r = row r of document column c) against the teacher's softmax over the same row."""
    q, *columns = reps.values()
    documents = torch.cat(columns)  # [(1+k)·B, V], in the column order of the score matrix
    losses = []
    for i in range(q.shape[0]):
        log_student = torch.log_softmax(torch.stack([torch.dot(q[i], d) for d in documents]) / temperature, 0)
        target = torch.softmax(teacher[i].double() / teacher_temperature, 0)
        losses.append(torch.nn.functional.kl_div(log_student, target, reduction="sum"))
    return torch.stack(losses).mean()


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("block_size", [None, 2, 5], ids=["whole", "block2", "block5"])
@pytest.mark.parametrize(("temperature", "teacher_temperature"), [(1.0, 1.0), (2.0, 0.5)])
def test_kl_with_a_whole_teacher_matrix_matches_reference(
    k, block_size, temperature, teacher_temperature
) -> None:
    """KL over each query's full row of the batch's documents equals an fp64 per-query reference (loss and
    every rep gradient), on the whole score matrix and in score blocks."""
    B = 5
    reps = splade_like_reps(B, 40, k, seed=10 + k)
    teacher = torch.randn(B, (1 + k) * B, generator=torch.Generator().manual_seed(k)) * 3
    ours_in, ref_in = leaf_copies(reps), leaf_copies(reps, torch.float64)
    loss = kl_div_loss(
        ours_in,
        teacher_scores=teacher,
        temperature=temperature,
        teacher_temperature=teacher_temperature,
        in_batch=True,
        block_size=block_size,
    )
    ref = _reference(ref_in, teacher, temperature, teacher_temperature)
    assert loss.dtype == torch.float32 and ref.item() > 0.01  # a reference that carries signal
    assert_matches_reference(loss, ref, ours_in, ref_in, **FP32_TOL)


def test_own_candidate_teacher_keeps_its_meaning() -> None:
    """A [B, 1+k] teacher with in_batch still gives the batch's other documents probability 0: it equals the
    whole-matrix teacher with those entries at -inf (a softmax weight of exactly 0)."""
    B, k = 4, 2
    reps = splade_like_reps(B, 30, k, seed=3)
    own = torch.randn(B, 1 + k, generator=torch.Generator().manual_seed(1))
    whole = torch.full((B, (1 + k) * B), -torch.inf)
    for c in range(1 + k):
        whole[torch.arange(B), c * B + torch.arange(B)] = own[:, c]
    a = kl_div_loss(leaf_copies(reps), teacher_scores=own, in_batch=True)
    # The reference's softmax of a row with -inf entries is 0 there; its KL terms there are 0 too.
    ref = _reference(leaf_copies(reps, torch.float64), whole, 1.0, 1.0)
    torch.testing.assert_close(a.double(), ref, **FP32_TOL)


@pytest.mark.parametrize("block_size", [None, 3])
def test_sparse_reps_with_a_whole_teacher_match_dense(block_size) -> None:
    """SpladeLoss (kl_div, kl_in_batch) on SparseReps with a [B, (1+k)·B] teacher equals it on the dense reps:
    the loss, and the weights' gradients are the dense rep gradients at the non-zeros (an all-zero row too)."""
    B, V, k = 7, 13, 2
    reps = splade_like_reps(B, V, k, seed=5)
    reps["query"][1] = 0.0
    reps["negative_2"][4] = 0.0
    teacher = torch.randn(B, (1 + k) * B, generator=torch.Generator().manual_seed(9)) * 4
    settings = {"contrastive": "kl_div", "kl_in_batch": True, "score_block_size": block_size}
    loss_fn = SpladeLoss(SpladeLossConfig(query_reg_weight=0.3, doc_reg_weight=0.2, **settings))
    dense_in = leaf_copies(reps)
    dense_loss, _ = loss_fn(dense_in, teacher_scores=teacher)
    dense_loss.backward()
    sparse = {n: SparseReps.from_dense(r) for n, r in reps.items()}
    weights = {n: s.weights.clone().requires_grad_() for n, s in sparse.items()}
    leaves = {n: SparseReps(s.offsets, s.token_ids, weights[n], V) for n, s in sparse.items()}
    sparse_loss, _ = loss_fn(leaves, teacher_scores=teacher)
    sparse_loss.backward()
    # Summation order only (index_add over the non-zeros, blocks): as tests/test_sparse_reps.py, 1e-6 / 1e-5.
    torch.testing.assert_close(sparse_loss, dense_loss.detach(), rtol=1e-6, atol=0)
    largest = max(float(leaf.grad.abs().max()) for leaf in dense_in.values())
    for n, leaf in dense_in.items():
        expected = leaf.grad[reps[n].ne(0)]
        torch.testing.assert_close(weights[n].grad, expected, rtol=1e-5, atol=1e-5 * largest, msg=n)


@pytest.mark.parametrize("mini_batch_size", [1, 3, 8])
@pytest.mark.parametrize("score_block_size", [None, 3])
def test_whole_teacher_is_exact_under_cached_loss(
    tiny_bert_config, mini_batch_size, score_block_size
) -> None:
    """SpladeLoss (kl_div, kl_in_batch) with a [B, (1+k)·B] teacher through CachedLoss equals the uncached
    loss and every parameter gradient, at several mini-batch sizes, on the whole matrix and in blocks."""
    from engine_helpers import assert_grads_close, grads_of, make_columns, make_encoder, small_config

    from gradcache_sparton.engine import CachedLoss

    encoder = make_encoder(small_config(tiny_bert_config))
    columns = make_columns(8, 3)  # query, positive, one negative: 16 documents a query
    teacher = torch.randn(8, 16, generator=torch.Generator().manual_seed(0)) * 5
    config = SpladeLossConfig(
        temperature=20.0,
        doc_reg_weight=0.1,
        contrastive="kl_div",
        kl_in_batch=True,
        score_block_size=score_block_size,
    )
    loss_fn = SpladeLoss(config)
    ref_loss, _ = loss_fn({name: encoder(**f) for name, f in columns.items()}, teacher_scores=teacher)
    ref_loss.backward()
    ref_grads = grads_of(encoder)
    encoder.zero_grad()
    loss = CachedLoss(encoder, loss_fn, mini_batch_size=mini_batch_size)(columns, teacher_scores=teacher)
    loss.backward()
    # As tests/test_cached_loss.py: mini-batch summation order moves fp32 results by <= 1e-6.
    torch.testing.assert_close(loss.detach(), ref_loss.detach(), rtol=1e-5, atol=0)
    assert_grads_close(grads_of(encoder), ref_grads, rtol=1e-5)


@pytest.mark.parametrize(
    ("in_batch", "shape", "match"),
    [
        (True, (4, 7), r"\[B, 1\+k\] = \[4, 3\].*or \[B, \(1\+k\)·B\] = \[4, 12\]"),
        (False, (4, 12), r"\[B, 1\+k\] = \[4, 3\].*only with in_batch"),
    ],
)
def test_teacher_shape_error_names_both_shapes(in_batch, shape, match) -> None:
    """A teacher of neither shape is one ValueError naming [B, 1+k] and [B, (1+k)·B]; the whole matrix
    without in_batch is refused (the student's softmax would not cover those documents)."""
    reps = leaf_copies(splade_like_reps(4, 10, 2, seed=1))
    with pytest.raises(ValueError, match=match):
        kl_div_loss(reps, teacher_scores=torch.zeros(shape), in_batch=in_batch)
