"""Losses, regularizers, warm-up schedule, SPLADE loss and sparsity statistics (CPU, small shapes).

Each loss is checked against a value worked out by hand on a tiny case and against an independent
fp64 reference (per-query loops, explicit definitions) on random reps, forward and gradient.
"""

from __future__ import annotations

import math

import pytest
import torch
from engine_helpers import assert_matches_reference, leaf_copies, splade_like_reps

from gradcache_sparton.losses import (
    SpladeLoss,
    SpladeLossConfig,
    WarmupSchedule,
    activation_rate,
    dot_scores,
    expected_flops,
    flops_regularizer,
    info_nce_loss,
    kl_div_loss,
    l1_regularizer,
    margin_mse_loss,
    mean_nonzeros,
    nonzeros_per_row,
    paired_scores,
    split_columns,
    warmup_weight,
)

# fp32 losses vs an fp64 reference on the same input values: a handful of fp32 roundings of O(10) sums
# and one log-sum-exp, so ~1e-6 relative; 1e-5 leaves room for summation order but still catches any
# scoring done in bf16 (error ~1e-2 at scores of ~10) or a wrong reduction.
FP32_TOL = {"rtol": 1e-5, "atol": 1e-6}


def _info_nce_reference(reps: dict[str, torch.Tensor], temperature: float) -> torch.Tensor:
    """Per-query loop: -log softmax over all positives and negatives of the batch, at the own positive."""
    cols = list(reps.values())
    q, docs = cols[0], torch.cat(cols[1:])
    losses = []
    for i in range(q.shape[0]):
        s = torch.stack([torch.dot(q[i], d) for d in docs]) / temperature
        losses.append(torch.logsumexp(s, 0) - s[i])
    return torch.stack(losses).mean()


# ----------------------------------------------------------------------------------------------- scores


def test_dot_scores_are_fp32_for_bf16_reps() -> None:
    """dot_scores of bf16 reps is fp32 and equals the fp64 product of the same values (no bf16 rounding)."""
    reps = splade_like_reps(6, 300, 1, seed=0, dtype=torch.bfloat16)
    q, d = reps["query"], reps["positive"]
    scores = dot_scores(q, d)
    assert scores.dtype == torch.float32 and scores.shape == (6, 6)
    torch.testing.assert_close(scores.double(), q.double() @ d.double().T, **FP32_TOL)
    paired = paired_scores(q, d)
    assert paired.dtype == torch.float32
    torch.testing.assert_close(paired.double(), (q.double() * d.double()).sum(1), **FP32_TOL)


# ----------------------------------------------------------------------------------------------- InfoNCE


def test_info_nce_hand_computed() -> None:
    """InfoNCE on a 2-query, 1-negative case equals the value worked out by hand."""
    reps = {
        "query": torch.tensor([[1.0, 0.0], [0.0, 2.0]]),
        "positive": torch.tensor([[2.0, 0.0], [1.0, 1.0]]),
        "negative": torch.tensor([[0.0, 1.0], [1.0, 0.0]]),
    }
    # Scores over documents (pos_0, pos_1, neg_0, neg_1) / 0.5: q_0 -> (4, 2, 0, 2), q_1 -> (0, 4, 4, 0).
    loss_0 = -4 + math.log(math.exp(4) + 2 * math.exp(2) + 1)
    loss_1 = -4 + math.log(2 * math.exp(4) + 2)
    loss = info_nce_loss(reps, temperature=0.5)
    assert loss.shape == () and loss.dtype == torch.float32
    assert loss.item() == pytest.approx((loss_0 + loss_1) / 2, rel=1e-6)


@pytest.mark.parametrize("k", [0, 1, 3])
@pytest.mark.parametrize("temperature", [1.0, 0.05])
def test_info_nce_matches_reference_loss_and_grads(k: int, temperature: float) -> None:
    """InfoNCE with k hard negatives equals a per-query fp64 loop, loss and the gradient of every column."""
    reps = splade_like_reps(5, 64, k, seed=k, dtype=torch.float32)
    ours_in, ref_in = leaf_copies(reps), leaf_copies(reps, torch.float64)
    loss = info_nce_loss(ours_in, temperature=temperature)
    ref = _info_nce_reference(ref_in, temperature)
    # Gradients are O(1/B); the same fp32 rounding argument as the loss applies.
    assert_matches_reference(loss, ref, ours_in, ref_in, **FP32_TOL)


def test_info_nce_scores_bf16_reps_in_fp32() -> None:
    """InfoNCE on bf16 reps equals the fp64 loss of the same values (bf16 scores would be ~1e-2 off)."""
    reps = splade_like_reps(8, 512, 1, seed=3, dtype=torch.bfloat16)
    loss = info_nce_loss(reps)
    assert loss.dtype == torch.float32
    ref = _info_nce_reference({n: r.double() for n, r in reps.items()}, 1.0)
    torch.testing.assert_close(loss.double(), ref, **FP32_TOL)


# ----------------------------------------------------------------------------------------------- MarginMSE


def test_margin_mse_hand_computed() -> None:
    """MarginMSE on a 2-query, 1-negative case equals the value worked out by hand."""
    reps = {
        "query": torch.tensor([[1.0, 0.0], [0.0, 2.0]]),
        "positive": torch.tensor([[2.0, 0.0], [1.0, 1.0]]),
        "negative": torch.tensor([[0.0, 1.0], [1.0, 0.0]]),
    }
    # Student margins: (2 - 0, 2 - 0); teacher margins: (5 - 4, 1 - 2) = (1, -1); MSE = (1 + 9) / 2.
    teacher_scores = torch.tensor([[5.0, 4.0], [1.0, 2.0]])
    assert margin_mse_loss(reps, teacher_scores=teacher_scores).item() == pytest.approx(5.0, rel=1e-6)


@pytest.mark.parametrize("k", [1, 3])
def test_margin_mse_matches_reference_loss_and_grads(k: int) -> None:
    """MarginMSE with k negatives equals an fp64 per-(query, negative) loop, loss and every gradient."""
    reps = splade_like_reps(4, 48, k, seed=10 + k)
    teacher = torch.randn(4, 1 + k, generator=torch.Generator().manual_seed(1)) * 5
    ours_in, ref_in = leaf_copies(reps), leaf_copies(reps, torch.float64)
    loss = margin_mse_loss(ours_in, teacher_scores=teacher)
    cols = list(ref_in.values())
    terms = [
        (
            torch.dot(cols[0][i], cols[1][i])
            - torch.dot(cols[0][i], cols[2 + j][i])
            - (teacher[i, 0] - teacher[i, 1 + j])
        )
        ** 2
        for i in range(4)
        for j in range(k)
    ]
    ref = torch.stack(terms).mean()
    assert_matches_reference(loss, ref, ours_in, ref_in, **FP32_TOL)


# ----------------------------------------------------------------------------------------------- listwise KL


def _kl_div_reference(
    reps: dict[str, torch.Tensor],
    teacher: torch.Tensor,
    temperature: float,
    teacher_temperature: float,
    in_batch: bool,
) -> torch.Tensor:
    """Per-query loop: F.kl_div of the student's log-softmax at the own candidates vs the teacher's softmax."""
    cols = list(reps.values())
    q, cands = cols[0], cols[1:]
    B = q.shape[0]
    losses = []
    for i in range(B):
        own = torch.stack([torch.dot(q[i], d[i]) for d in cands]) / temperature  # [1+k]
        if in_batch:  # the softmax runs over every document of the batch; the own ones are picked after
            everything = torch.stack([torch.dot(q[i], row) for d in cands for row in d]) / temperature
            log_student = own - torch.logsumexp(everything, 0)
        else:
            log_student = torch.log_softmax(own, 0)
        target = torch.softmax(teacher[i].double() / teacher_temperature, 0)
        losses.append(torch.nn.functional.kl_div(log_student, target, reduction="sum"))
    return torch.stack(losses).mean()


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("in_batch", [False, True])
@pytest.mark.parametrize(("temperature", "teacher_temperature"), [(1.0, 1.0), (2.0, 0.5)])
def test_kl_div_matches_reference_loss_and_grads(
    k: int, in_batch: bool, temperature: float, teacher_temperature: float
) -> None:
    """Listwise KL equals an fp64 per-query F.kl_div(log_softmax(student), softmax(teacher)), loss and grads."""
    reps = splade_like_reps(5, 40, k, seed=30 + k)
    teacher = torch.randn(5, 1 + k, generator=torch.Generator().manual_seed(k)) * 3
    ours_in, ref_in = leaf_copies(reps), leaf_copies(reps, torch.float64)
    loss = kl_div_loss(
        ours_in,
        teacher_scores=teacher,
        temperature=temperature,
        teacher_temperature=teacher_temperature,
        in_batch=in_batch,
    )
    ref = _kl_div_reference(ref_in, teacher, temperature, teacher_temperature, in_batch)
    assert loss.dtype == torch.float32 and ref.item() > 0.01  # a reference that carries signal
    assert_matches_reference(loss, ref, ours_in, ref_in, **FP32_TOL)


def test_kl_div_is_zero_when_student_agrees_and_teacher_gets_no_gradient() -> None:
    """KL is 0 with a zero gradient when the teacher's scores are the student's, and never differentiates them."""
    reps = leaf_copies(splade_like_reps(4, 30, 2, seed=6))
    q = reps["query"].detach()
    teacher = torch.stack([(q * reps[n].detach()).sum(1) for n in list(reps)[1:]], dim=1).requires_grad_(True)
    loss = kl_div_loss(reps, teacher_scores=teacher)
    # KL of a distribution with itself: only the fp32 rounding of the two log-softmaxes remains.
    assert abs(loss.item()) < 1e-6
    loss.backward()
    assert teacher.grad is None
    assert all(float(r.grad.abs().max()) < 1e-6 for r in reps.values())


@pytest.mark.parametrize(
    "settings",
    [
        {"contrastive": "kl_div"},
        {"contrastive": "kl_div", "kl_in_batch": True},
        {"contrastive": "kl_div", "kl_in_batch": True, "score_block_size": 3},
        {"contrastive": "infonce", "score_block_size": 3},
    ],
)
def test_splade_kl_div_and_blocked_scores_are_exact_under_cached_loss(
    tiny_bert_config, settings: dict
) -> None:
    """SpladeLoss (listwise KL; scores in blocks) through CachedLoss equals the uncached loss and every grad."""
    from engine_helpers import assert_grads_close, grads_of, make_columns, make_encoder, small_config

    from gradcache_sparton.engine import CachedLoss

    encoder = make_encoder(small_config(tiny_bert_config))
    columns = make_columns(8, 3)
    teacher = torch.randn(8, 2, generator=torch.Generator().manual_seed(0)) * 5
    loss_kwargs = {"teacher_scores": teacher} if settings["contrastive"] == "kl_div" else {}
    # Random-init reps score ~10-40: temperature 20 keeps the student's softmax neither flat nor saturated.
    config = SpladeLossConfig(temperature=20.0, doc_reg_weight=0.1, **settings)
    loss_fn = SpladeLoss(config)
    ref_loss, _ = loss_fn({name: encoder(**f) for name, f in columns.items()}, **loss_kwargs)
    ref_loss.backward()
    ref_grads = grads_of(encoder)
    encoder.zero_grad()
    loss = CachedLoss(encoder, loss_fn, mini_batch_size=3)(columns, **loss_kwargs)
    loss.backward()
    # As in tests/test_cached_loss.py: mini-batch summation order moves fp32 results by <= 1e-6; a lost,
    # doubled or mis-scaled mini-batch is an O(1) error.
    torch.testing.assert_close(loss.detach(), ref_loss.detach(), rtol=1e-5, atol=0)
    assert_grads_close(grads_of(encoder), ref_grads, rtol=1e-5)


# ----------------------------------------------------------------------------------------------- blocked scores


@pytest.mark.parametrize("k", [0, 2])
@pytest.mark.parametrize("block_size", [1, 3, 4, 7, 10, 16])
def test_blocked_info_nce_matches_dense_loss_and_grads(k: int, block_size: int) -> None:
    """InfoNCE over score blocks (uneven splits included) equals the dense InfoNCE, loss and every gradient."""
    reps = splade_like_reps(10, 48, k, seed=40 + k)
    dense_in, blocked_in = leaf_copies(reps), leaf_copies(reps)
    dense = info_nce_loss(dense_in, temperature=0.5)  # 10 x 10·(1+k) fp32 scores: the dense path
    blocked = info_nce_loss(blocked_in, temperature=0.5, block_size=block_size)
    # Same terms, another fp32 summation order: the FP32 tolerance applies.
    torch.testing.assert_close(blocked, dense, **FP32_TOL)
    dense.backward()
    blocked.backward()
    for name in reps:
        torch.testing.assert_close(blocked_in[name].grad, dense_in[name].grad, **FP32_TOL)


def test_bf16_parts_sum_exactly_to_their_fp32_value() -> None:
    """Three bf16 parts (8 + 8 + 8 significant bits) hold any normal fp32 value exactly: their fp32 sum
    gives back every bit, across magnitudes from 1e-30 to 1e30 and both signs."""
    from gradcache_sparton.losses.blocked import _bf16_parts

    generator = torch.Generator().manual_seed(50)
    x = torch.randn(4096, generator=generator) * 10.0 ** torch.randint(-30, 30, (4096,), generator=generator)
    hi, mid, lo = _bf16_parts(x)
    assert hi.dtype == mid.dtype == lo.dtype == torch.bfloat16
    assert torch.equal((hi.float() + mid.float()) + lo.float(), x)
    assert not torch.equal(hi.float(), x)  # the test needs values with more than 8 significant bits


@pytest.mark.parametrize(
    ("m", "k", "transposed"),
    [(4, 96, False), (96, 4, False), (96, 4, True), (33, 33, True)],
    ids=["rows-stacked", "k-concatenated", "k-concatenated-view", "square-transposed"],
)
def test_split_weights_product_equals_fp64(m: int, k: int, transposed: bool) -> None:
    """The backward's product of fp32 weights, split into three bf16 parts, with a bf16 block (one GEMM over
    3k, or over 3m rows then summed; weights given as the transpose of [3, k, m] parts as grad_d's are)
    equals the fp64 product of the same values within the fp32 summation bound: each output sums at most
    3k + 2 fp32 terms, so it errs by at most (3k + 2) · 2**-24 · sum |terms|. A lost or doubled part is
    an error of 2**-8 relative, far above it."""
    from gradcache_sparton.losses.blocked import _bf16_parts, _mm_fp32_left

    generator = torch.Generator().manual_seed(53)
    shape = (k, m) if transposed else (m, k)
    weights = torch.rand(shape, generator=generator) * 10.0 ** torch.randint(
        -3, 3, shape, generator=generator
    )
    block = torch.randn(k, 24, generator=generator).to(torch.bfloat16)
    parts = _bf16_parts(weights)
    if transposed:
        weights, parts = weights.T, parts.mT
    got = _mm_fp32_left(parts, block)
    assert got.dtype == torch.float32 and got.shape == (m, 24)
    expected = weights.double() @ block.double()
    bound = (3 * k + 2) * 2**-24 * (weights.double().abs() @ block.double().abs())
    assert ((got.double() - expected).abs() <= bound).all()
    assert not torch.equal(parts[0].double() @ block.double(), expected)  # the lower parts matter here


def _blocked_lse_and_grads(
    columns: list[torch.Tensor], *, sparse: bool, block_size: int, temperature: float
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The blocked log-sum-exp of ``columns`` (queries first) as dense reps or, with ``sparse``, as
    ``SparseReps`` whose weights are the leaves; backward through a weighted sum (row weights 0.5..1.5).
    Returns (lse, the gradient of every column's leaf)."""
    from gradcache_sparton.losses.blocked import blocked_logsumexp
    from gradcache_sparton.losses.sparse import sparse_blocked_logsumexp
    from gradcache_sparton.primitives.sparse_reps import SparseReps

    if sparse:
        layouts = [SparseReps.from_dense(column, dtype=column.dtype) for column in columns]
        leaves = [layout.weights.clone().requires_grad_() for layout in layouts]
        q, *d = (
            SparseReps(x.offsets, x.token_ids, w, x.vocab_size) for x, w in zip(layouts, leaves, strict=True)
        )
        lse = sparse_blocked_logsumexp(q, d, temperature=temperature, block_size=block_size)
    else:
        leaves = [column.clone().requires_grad_() for column in columns]
        lse = blocked_logsumexp(leaves[0], leaves[1:], temperature=temperature, block_size=block_size)
    row_weights = torch.linspace(0.5, 1.5, lse.numel(), dtype=lse.dtype, device=lse.device)
    (lse * row_weights).sum().backward()
    return lse.detach(), [leaf.grad for leaf in leaves]


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_blocked_scores_as_bf16_products_equal_the_fp32_products(
    monkeypatch: pytest.MonkeyPatch, sparse: bool
) -> None:
    """With every rep a bf16 value (autocast reps, upcast), the blocked log-sum-exp multiplies its blocks
    in bf16 with fp32 output (the GPU's tensor-core path, here forced on the CPU) and splits the backward's
    fp32 softmax weights into three exact bf16 parts: loss and every gradient equal the fp32 block products
    up to fp32 summation order. Reps with any value that is not a bf16 value keep the fp32 products."""
    import gradcache_sparton.losses.blocked as blocked_module

    reps = {
        name: rep.to(torch.bfloat16).float() for name, rep in splade_like_reps(10, 48, 1, seed=51).items()
    }
    block_dtypes: list[torch.dtype] = []
    block_of = blocked_module._blocked_lse_forward

    def recording(*args):
        block_dtypes.append(args[-1])
        return block_of(*args)

    monkeypatch.setattr(blocked_module, "_blocked_lse_forward", recording)

    def lse_and_grads(columns: dict[str, torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        return _blocked_lse_and_grads(list(columns.values()), sparse=sparse, block_size=3, temperature=0.5)

    fp32_lse, fp32_grads = lse_and_grads(reps)
    monkeypatch.setattr(blocked_module, "_BF16_PRODUCT_DEVICES", frozenset({"cpu"}))
    monkeypatch.setattr(blocked_module, "_CHECK_CHUNK", 7)  # the value check runs over many chunks
    bf16_lse, bf16_grads = lse_and_grads(reps)
    assert block_dtypes == [torch.float32, torch.bfloat16]
    torch.testing.assert_close(bf16_lse, fp32_lse, **FP32_TOL)
    for got, expected in zip(bf16_grads, fp32_grads, strict=True):
        torch.testing.assert_close(got, expected, **FP32_TOL)
    reps["negative_1"][-1, -1] = 1.0 + 2.0**-12  # one value between two bf16 values, in the last chunk
    lse_and_grads(reps)
    assert block_dtypes[-1] == torch.float32


@pytest.mark.gpu
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_blocked_scores_on_the_tensor_cores_equal_fp64(sparse: bool) -> None:
    """On a GPU, bf16-valued reps take the tensor-core product path (``torch.mm(..., out_dtype=fp32)``,
    three bf16 parts for the backward's weights) and the blocked log-sum-exp and its gradients equal an
    fp64 computation of the same values. Bound: each score sums V = 512 exact products in fp32, so it errs
    by at most e = 512 · 2**-24 · max score (all terms >= 0); lse then by e, each softmax weight by a
    factor within exp(±2e), and each gradient entry, a sum of at most 600 positive terms, by 2e plus
    600 · 2**-24 relative. A wrong product, block or row is an O(1) error."""
    from gradcache_sparton.losses.blocked import products_in_bf16

    reps = {n: r.to(torch.bfloat16).float() for n, r in splade_like_reps(300, 512, 1, seed=52).items()}
    assert products_in_bf16([r.cuda() for r in reps.values()])

    def lse_and_grads(device: str, dtype: torch.dtype) -> tuple[torch.Tensor, list[torch.Tensor]]:
        columns = [rep.to(device, dtype) for rep in reps.values()]
        lse, grads = _blocked_lse_and_grads(columns, sparse=sparse, block_size=128, temperature=1.0)
        return lse.cpu().double(), [grad.cpu().double() for grad in grads]

    gpu_lse, gpu_grads = lse_and_grads("cuda", torch.float32)
    ref_lse, ref_grads = lse_and_grads("cpu", torch.float64)
    q, *docs = (rep.double() for rep in reps.values())
    e = 512 * 2**-24 * max((q @ d.T).max().item() for d in docs)
    torch.testing.assert_close(gpu_lse, ref_lse, rtol=0, atol=e)
    for got, expected in zip(gpu_grads, ref_grads, strict=True):
        rtol = math.expm1(2 * e) + 600 * 2**-24
        torch.testing.assert_close(got, expected, rtol=rtol, atol=rtol * expected.abs().max().item())


def test_blocked_info_nce_bf16_reps() -> None:
    """Blocked InfoNCE on bf16 reps scores in fp32 and returns the fp32 gradient rounded once to bf16."""
    reps = splade_like_reps(9, 64, 1, seed=44, dtype=torch.bfloat16)
    blocked_in, full_in = leaf_copies(reps), leaf_copies(reps, torch.float32)
    blocked = info_nce_loss(blocked_in, block_size=4)
    full = info_nce_loss(full_in)  # dense, on fp32 copies of the same values
    assert blocked.dtype == torch.float32
    torch.testing.assert_close(blocked, full, **FP32_TOL)
    blocked.backward()
    full.backward()
    for name in reps:
        assert blocked_in[name].grad.dtype == torch.bfloat16
        # fp32 gradients equal up to summation order, each rounded once to bf16: at most one bf16 ulp apart.
        expected = full_in[name].grad.to(torch.bfloat16)
        torch.testing.assert_close(blocked_in[name].grad, expected, rtol=2**-8, atol=1e-6)


@pytest.mark.parametrize("block_size", [None, 3])
def test_scores_stay_fp32_under_a_callers_autocast(block_size: int | None) -> None:
    """Inside a bf16 autocast region InfoNCE (dense and blocked) still scores in fp32: loss and gradients."""
    reps = splade_like_reps(7, 64, 1, seed=12)
    plain_in, autocast_in = leaf_copies(reps), leaf_copies(reps)
    plain = info_nce_loss(plain_in, block_size=block_size)
    plain.backward()
    with torch.autocast("cpu", dtype=torch.bfloat16):  # bf16 products would be ~1e-2 off at these scores
        loss = info_nce_loss(autocast_in, block_size=block_size)
    loss.backward()  # outside the region, as PyTorch's autocast guidance has it
    torch.testing.assert_close(loss, plain, **FP32_TOL)
    for name in reps:
        torch.testing.assert_close(autocast_in[name].grad, plain_in[name].grad, **FP32_TOL)


@pytest.mark.parametrize("block_size", [2, 5])
def test_blocked_in_batch_kl_div_matches_dense(block_size: int) -> None:
    """Listwise KL with in-batch negatives over score blocks equals its dense form, loss and every gradient."""
    reps = splade_like_reps(6, 40, 2, seed=50)
    teacher = torch.randn(6, 3, generator=torch.Generator().manual_seed(2)) * 3
    dense_in, blocked_in = leaf_copies(reps), leaf_copies(reps)
    dense = kl_div_loss(dense_in, teacher_scores=teacher, in_batch=True, temperature=2.0)
    blocked = kl_div_loss(
        blocked_in, teacher_scores=teacher, in_batch=True, temperature=2.0, block_size=block_size
    )
    torch.testing.assert_close(blocked, dense, **FP32_TOL)
    dense.backward()
    blocked.backward()
    for name in reps:
        torch.testing.assert_close(blocked_in[name].grad, dense_in[name].grad, **FP32_TOL)


def _record_block_sizes(monkeypatch: pytest.MonkeyPatch, module: object, name: str) -> list[int]:
    """Wrap ``module.name`` (a blocked log-sum-exp) so each call appends its ``block_size`` to the list returned."""
    used: list[int] = []
    blocked = getattr(module, name)

    def recording(*args, block_size: int, **kwargs):
        used.append(block_size)
        return blocked(*args, block_size=block_size, **kwargs)

    monkeypatch.setattr(module, name, recording)
    return used


def test_scores_are_blocked_automatically_beyond_the_memory_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """Dense below DENSE_SCORES_MAX_BYTES of fp32 scores, blocks of AUTO_BLOCK_SIZE above; SpladeLoss follows."""
    import gradcache_sparton.losses.blocked as blocked_module
    import gradcache_sparton.losses.contrastive as contrastive_module

    assert blocked_module.score_block_size(8192, 2 * 8192, None) is None  # 512 MiB of fp32 scores
    assert blocked_module.score_block_size(16384, 2 * 16384, None) == blocked_module.AUTO_BLOCK_SIZE  # 2 GiB
    assert blocked_module.score_block_size(4, 8, 3) == 3  # an explicit block size always blocks
    used = _record_block_sizes(monkeypatch, contrastive_module, "blocked_logsumexp")
    reps = splade_like_reps(6, 30, 1, seed=9)
    loss_fn = SpladeLoss(SpladeLossConfig())
    dense, _ = loss_fn(reps)
    assert used == []
    monkeypatch.setattr(blocked_module, "DENSE_SCORES_MAX_BYTES", 4 * 6 * 12 - 1)  # one byte short of dense
    monkeypatch.setattr(blocked_module, "AUTO_BLOCK_SIZE", 4)
    blocked, _ = loss_fn(reps)
    assert used == [4]
    torch.testing.assert_close(blocked, dense, **FP32_TOL)
    assert SpladeLoss(SpladeLossConfig(score_block_size=5))(reps)[0] is not None and used == [4, 5]


def test_sparse_score_blocks_bound_their_bytes_at_large_vocabularies(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sparse path's automatic block keeps each densified fp32 [block, V] buffer within
    SPARSE_BLOCK_MAX_BYTES (AUTO_BLOCK_SIZE rows at BERT's V, 536 at XLM-R's 250,002 where 4,096 rows
    would take 3.8 GiB each), and the sparse InfoNCE uses it when no block size is given."""
    import gradcache_sparton.losses.sparse as sparse_module
    from gradcache_sparton.evaluation import SparseReps
    from gradcache_sparton.losses.contrastive import info_nce

    assert sparse_module.sparse_block_size(30522) == sparse_module.AUTO_BLOCK_SIZE == 4096
    assert sparse_module.sparse_block_size(250_002) == 536
    for vocab in (30522, 128_256, 250_002, 10**9):
        rows = sparse_module.sparse_block_size(vocab)
        assert rows >= 1 and (rows == 1 or 4 * rows * vocab <= sparse_module.SPARSE_BLOCK_MAX_BYTES)
    used = _record_block_sizes(monkeypatch, sparse_module, "sparse_blocked_logsumexp")
    monkeypatch.setattr(sparse_module, "SPARSE_BLOCK_MAX_BYTES", 4 * 30 * 3)  # 3 rows of V = 30
    reps = {name: SparseReps.from_dense(rep) for name, rep in splade_like_reps(6, 30, 1, seed=9).items()}
    columns = sparse_module.split_sparse_columns(reps)
    info_nce(columns, sparse_module.SPARSE_SCORES, temperature=1.0)
    assert used == [3]


# ----------------------------------------------------------------------------------------------- regularizers


def test_regularizers_hand_computed() -> None:
    """FLOPS and L1 on a 2x2 case equal the values worked out by hand."""
    reps = torch.tensor([[1.0, 0.0], [0.0, 2.0]])
    assert flops_regularizer(reps).item() == pytest.approx(0.5**2 + 1.0**2)  # column means (0.5, 1)
    assert l1_regularizer(reps).item() == pytest.approx((1 + 2) / 2)
    assert l1_regularizer(-reps).item() == pytest.approx((1 + 2) / 2)  # |.|, not the plain sum


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_regularizer_grads_match_autograd_of_definitions(dtype: torch.dtype) -> None:
    """FLOPS and L1 (over several columns) match autograd of their fp64 definitions and the closed forms."""
    g = torch.Generator().manual_seed(7)
    columns = [torch.randn(n, 40, generator=g).to(dtype) for n in (3, 5)]
    cat64 = torch.cat(columns).double()
    N = cat64.shape[0]
    for ours_fn, definition, closed_form in (
        (flops_regularizer, lambda x: (x.sum(0) / N).pow(2).sum(), lambda x: 2 * x.mean(0, keepdim=True) / N),
        (l1_regularizer, lambda x: x.abs().sum() / N, lambda x: torch.sign(x) / N),
    ):
        ours_in = [c.detach().clone().requires_grad_(True) for c in columns]
        ref_in = cat64.detach().clone().requires_grad_(True)
        value = ours_fn(ours_in)
        ref = definition(ref_in)
        assert value.dtype == torch.float32
        # Inputs are identical (bf16 values upcast exactly), reduction in fp32: the FP32 tolerance holds.
        torch.testing.assert_close(value.double(), ref, **FP32_TOL)
        value.backward()
        ref.backward()
        grad = torch.cat([c.grad for c in ours_in]).double()
        # bf16 gradients are rounded to bf16 (8 mantissa bits): relative error up to 2**-8.
        tol = FP32_TOL if dtype == torch.float32 else {"rtol": 2**-8, "atol": 1e-6}
        torch.testing.assert_close(grad, ref_in.grad, **tol)
        torch.testing.assert_close(grad, closed_form(cat64).expand_as(cat64), **tol)


# ----------------------------------------------------------------------------------------------- schedule


def test_warmup_schedule_values() -> None:
    """Quadratic and linear warm-up give final·min(1, t/T)^p at chosen steps; T = 0 gives the full weight."""
    quadratic = WarmupSchedule(final_weight=2.0, warmup_steps=100, shape="quadratic")
    assert [quadratic(t) for t in (0, 10, 50, 100, 250)] == pytest.approx([0.0, 0.02, 0.5, 2.0, 2.0])
    linear = WarmupSchedule(final_weight=2.0, warmup_steps=100, shape="linear")
    assert [linear(t) for t in (0, 10, 50, 100, 250)] == pytest.approx([0.0, 0.2, 1.0, 2.0, 2.0])
    assert WarmupSchedule(final_weight=3e-4)(0) == 3e-4
    assert warmup_weight(30, final_weight=1.0, warmup_steps=60) == pytest.approx(0.25)


# ----------------------------------------------------------------------------------------------- SPLADE loss


def test_splade_loss_combines_components() -> None:
    """SpladeLoss = InfoNCE + w_q·FLOPS(queries) + w_d·FLOPS(all docs), with detached components."""
    reps = splade_like_reps(6, 80, 2, seed=21)
    loss_fn = SpladeLoss(
        SpladeLossConfig(query_reg_weight=0.3, doc_reg_weight=0.1, reg_warmup_steps=10, temperature=0.5)
    )
    ours_in, ref_in = leaf_copies(reps), leaf_copies(reps)
    loss, comps = loss_fn(ours_in, step=5)
    docs = torch.cat([ref_in["positive"], ref_in["negative_1"], ref_in["negative_2"]])
    w_q, w_d = 0.3 * 0.25, 0.1 * 0.25  # quadratic warm-up at step 5 of 10
    ref = (
        info_nce_loss(ref_in, temperature=0.5)
        + w_q * flops_regularizer(ref_in["query"])
        + w_d * flops_regularizer(docs)
    )
    torch.testing.assert_close(loss, ref, **FP32_TOL)
    loss.backward()
    ref.backward()
    for name in reps:
        torch.testing.assert_close(ours_in[name].grad, ref_in[name].grad, **FP32_TOL)
    assert set(comps) == {
        "contrastive",
        "reg_query",
        "reg_doc",
        "reg_weight_query",
        "reg_weight_doc",
        "nnz_query",
        "nnz_doc",
        "flops",
    }
    assert all(not v.requires_grad and v.shape == () and v.dtype == torch.float32 for v in comps.values())
    assert comps["reg_weight_query"].item() == pytest.approx(w_q)
    assert comps["reg_weight_doc"].item() == pytest.approx(w_d)
    torch.testing.assert_close(comps["reg_doc"], flops_regularizer(docs).detach(), **FP32_TOL)
    assert comps["nnz_doc"].item() == pytest.approx((docs != 0).sum().item() / 18)
    assert "infonce(temperature=0.5)" in repr(loss_fn) and "0.3 * flops" in repr(loss_fn)


def test_splade_loss_bf16_reps_match_fp32() -> None:
    """SpladeLoss on bf16 reps equals it on fp32 copies of the same values; gradients come back in bf16."""
    reps = splade_like_reps(5, 60, 1, seed=8, dtype=torch.bfloat16)
    loss_fn = SpladeLoss(SpladeLossConfig(query_reg_weight=0.5, doc_reg_weight=0.5))
    half_in, full_in = leaf_copies(reps), leaf_copies(reps, torch.float32)
    half_loss, _ = loss_fn(half_in)
    full_loss, _ = loss_fn(full_in)
    assert half_loss.dtype == torch.float32
    torch.testing.assert_close(half_loss, full_loss, rtol=0, atol=0)  # identical fp32 computation
    half_loss.backward()
    full_loss.backward()
    for name in reps:
        assert half_in[name].grad.dtype == torch.bfloat16
        # The fp32 gradient rounded once to bf16: exactly what the bf16 leaf must receive.
        torch.testing.assert_close(half_in[name].grad, full_in[name].grad.to(torch.bfloat16), rtol=0, atol=0)


def test_splade_loss_step_kwarg_and_set_step() -> None:
    """The step kwarg wins over set_step; set_step persists; calls keep no other state."""
    reps = splade_like_reps(3, 20, 1, seed=2)
    loss_fn = SpladeLoss(
        SpladeLossConfig(
            query_reg_weight=1.0, doc_reg_weight=2.0, reg_warmup_steps=4, reg_warmup_shape="linear"
        )
    )
    assert loss_fn(reps)[1]["reg_weight_doc"].item() == 0.0  # step 0: regularizers off
    loss_fn.set_step(2)
    first = loss_fn(reps)
    assert first[1]["reg_weight_doc"].item() == pytest.approx(1.0)
    assert loss_fn(reps, step=4)[1]["reg_weight_query"].item() == pytest.approx(1.0)
    assert loss_fn.step == 2 and loss_fn.weights() == pytest.approx((0.5, 1.0))
    torch.testing.assert_close(loss_fn(reps)[0], first[0], rtol=0, atol=0)


def test_splade_loss_margin_mse_with_l1() -> None:
    """SpladeLoss with MarginMSE and L1 forwards teacher_scores and adds the weighted L1 terms."""
    reps = splade_like_reps(4, 30, 2, seed=5)
    teacher = torch.randn(4, 3, generator=torch.Generator().manual_seed(0))
    config = SpladeLossConfig(
        query_reg_weight=0.5,
        doc_reg_weight=0.25,
        contrastive="margin_mse",
        query_regularizer="l1",
        doc_regularizer="l1",
    )
    loss, comps = SpladeLoss(config)(reps, teacher_scores=teacher)
    docs = torch.cat([reps["positive"], reps["negative_1"], reps["negative_2"]])
    ref = (
        margin_mse_loss(reps, teacher_scores=teacher)
        + 0.5 * l1_regularizer(reps["query"])
        + 0.25 * l1_regularizer(docs)
    )
    torch.testing.assert_close(loss, ref, **FP32_TOL)
    torch.testing.assert_close(comps["reg_query"], l1_regularizer(reps["query"]), **FP32_TOL)


def test_splade_loss_is_exact_under_grad_cache() -> None:
    """Loss on cached mini-batch reps + replayed backward equals the full-batch loss and gradient."""
    g = torch.Generator().manual_seed(4)
    weight = torch.randn(12, 50, generator=g, requires_grad=True)  # a one-layer "encoder": relu(x @ W)
    inputs = {name: torch.randn(8, 12, generator=g) for name in ("query", "positive", "negative")}
    loss_fn = SpladeLoss(SpladeLossConfig(query_reg_weight=0.2, doc_reg_weight=0.4))
    # Uncached: one graph through the whole batch.
    full_loss, _ = loss_fn({n: torch.relu(x @ weight) for n, x in inputs.items()})
    (full_grad,) = torch.autograd.grad(full_loss, weight)
    # Cached, mini-batches of 3 (uneven): (1) embed without graph, (2) loss on the full reps -> rep grads,
    # (3) re-embed each mini-batch and backprop its slice of the cached rep gradient.
    with torch.no_grad():
        reps = {n: torch.cat([torch.relu(c @ weight) for c in x.split(3)]) for n, x in inputs.items()}
    reps = {n: r.requires_grad_(True) for n, r in reps.items()}
    cached_loss, _ = loss_fn(reps)
    rep_grads = torch.autograd.grad(cached_loss, list(reps.values()))
    for x, rep_grad in zip(inputs.values(), rep_grads, strict=True):
        for chunk, grad_chunk in zip(x.split(3), rep_grad.split(3), strict=True):
            torch.relu(chunk @ weight).backward(grad_chunk)
    torch.testing.assert_close(cached_loss, full_loss, **FP32_TOL)
    torch.testing.assert_close(weight.grad, full_grad, **FP32_TOL)


# ----------------------------------------------------------------------------------------------- sparsity


def test_sparsity_statistics_hand_computed() -> None:
    """Non-zeros per row, activation rates and expected FLOPS equal hand values, with no autograd graph."""
    q = torch.tensor([[1.0, 0.0, 0.0], [1.0, 3.0, 0.0]], requires_grad=True)
    d = [torch.tensor([[0.0, 1.0, 1.0]]), torch.tensor([[2.0, 0.0, 0.0]])]
    assert nonzeros_per_row(q).tolist() == [1, 2]
    assert mean_nonzeros(q).item() == pytest.approx(1.5)
    assert mean_nonzeros(d).item() == pytest.approx(1.5)
    torch.testing.assert_close(activation_rate(q), torch.tensor([1.0, 0.5, 0.0]))
    flops = expected_flops(q, d)  # p_q = (1, .5, 0), p_d = (.5, .5, .5)
    assert flops.item() == pytest.approx(0.75) and not flops.requires_grad


# ----------------------------------------------------------------------------------------------- bad input


def test_ragged_hard_negatives_are_rejected() -> None:
    """A negatives column with a different row count, a list of negatives or stacked [B, k, V] is an error."""
    reps = splade_like_reps(4, 10, 2, seed=0)
    with pytest.raises(ValueError, match=r"negative_2.*3 rows.*same\s+number of hard negatives"):
        split_columns({**reps, "negative_2": reps["negative_2"][:3]})
    with pytest.raises(TypeError, match=r"negative_1.*list"):
        info_nce_loss({**reps, "negative_1": [reps["negative_1"][0], reps["negative_1"][1:]]})
    with pytest.raises(ValueError, match=r"\[B, k, V\] as k columns"):
        info_nce_loss(
            {"query": reps["query"], "positive": reps["positive"], "negatives": torch.zeros(4, 2, 10)}
        )
    with pytest.raises(ValueError, match=r"positives.*5 rows"):
        info_nce_loss({"query": reps["query"], "positive": torch.zeros(5, 10)})


@pytest.mark.parametrize(
    ("teacher_scores", "match"),
    [
        (torch.zeros(4, 2), r"\[4, 3\].*got \(4, 2\)"),
        (torch.zeros(4), r"\[4, 3\].*got \(4,\)"),
        (torch.zeros(3, 3), r"\[4, 3\].*got \(3, 3\)"),
    ],
)
@pytest.mark.parametrize("loss_fn", [margin_mse_loss, kl_div_loss])
def test_distillation_rejects_wrong_teacher_shape(loss_fn, teacher_scores: torch.Tensor, match: str) -> None:
    """teacher_scores not of shape [B, 1+k] is a ValueError that states the expected shape."""
    with pytest.raises(ValueError, match=match):
        loss_fn(splade_like_reps(4, 10, 2, seed=0), teacher_scores=teacher_scores)


def test_bad_reps_are_rejected() -> None:
    """Non-2-D, integer, mismatched-V or single-column reps raise errors naming the column."""
    reps = splade_like_reps(4, 10, 0, seed=0)
    with pytest.raises(TypeError, match=r"reps\['positive'\].*floating"):
        info_nce_loss({**reps, "positive": torch.ones(4, 10, dtype=torch.long)})
    with pytest.raises(ValueError, match=r"reps\['positive'\].*vocabulary size 9"):
        info_nce_loss({**reps, "positive": torch.zeros(4, 9)})
    with pytest.raises(ValueError, match="at least two columns"):
        info_nce_loss({"query": reps["query"]})
    with pytest.raises(ValueError, match="at least one hard-negative column"):
        margin_mse_loss(reps, teacher_scores=torch.zeros(4, 1))
    with pytest.raises(ValueError, match="kl_div_loss needs at least one hard-negative column"):
        kl_div_loss(reps, teacher_scores=torch.zeros(4, 1))
    with pytest.raises(ValueError, match="2-D"):
        flops_regularizer(torch.zeros(10))


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"temperature": 0.0}, ValueError, "temperature"),
        ({"query_reg_weight": -1.0}, ValueError, "query_reg_weight"),
        ({"doc_reg_weight": float("nan")}, ValueError, "doc_reg_weight"),
        ({"reg_warmup_steps": -1}, ValueError, "reg_warmup_steps"),
        ({"reg_warmup_steps": 1.5}, TypeError, "reg_warmup_steps"),
        ({"reg_warmup_shape": "cosine"}, ValueError, "reg_warmup_shape"),
        ({"query_regularizer": "l2"}, ValueError, "query_regularizer"),
        ({"doc_regularizer": "L1"}, ValueError, "doc_regularizer"),
        ({"contrastive": "triplet"}, ValueError, "contrastive"),
        ({"contrastive": "margin_mse", "temperature": 0.05}, ValueError, "temperature"),
        ({"contrastive": "kl_div", "teacher_temperature": -1.0}, ValueError, "teacher_temperature"),
        ({"contrastive": "margin_mse", "teacher_temperature": 2.0}, ValueError, "teacher_temperature"),
        ({"kl_in_batch": True}, ValueError, "kl_in_batch"),
        ({"contrastive": "kl_div", "kl_in_batch": 1}, TypeError, "kl_in_batch"),
        ({"score_block_size": 0}, ValueError, "score_block_size"),
        ({"contrastive": "kl_div", "score_block_size": 4}, ValueError, "score_block_size"),
        ({"shard_scores_across_ranks": 1}, TypeError, "shard_scores_across_ranks"),
        (
            {"contrastive": "margin_mse", "shard_scores_across_ranks": True},
            ValueError,
            "shard_scores_across_ranks",
        ),
    ],
)
def test_splade_config_rejects_bad_values(kwargs: dict, error: type, match: str) -> None:
    """Each invalid SpladeLossConfig field raises an error naming that field."""
    with pytest.raises(error, match=match):
        SpladeLossConfig(**{"query_reg_weight": 0.1, "doc_reg_weight": 0.1, **kwargs})


def test_bad_steps_and_loss_kwargs_are_rejected() -> None:
    """Negative steps, bad schedule arguments and kwargs the contrastive loss does not take raise errors."""
    loss_fn = SpladeLoss(SpladeLossConfig(query_reg_weight=0.1, doc_reg_weight=0.1))
    reps = splade_like_reps(2, 5, 1, seed=0)
    with pytest.raises(ValueError, match="step"):
        loss_fn.set_step(-1)
    with pytest.raises(TypeError, match="step"):
        loss_fn(reps, step=1.0)
    with pytest.raises(TypeError, match="teacher_scores"):
        loss_fn(reps, teacher_scores=torch.zeros(2, 2))
    with pytest.raises(TypeError, match=r"kl_div_loss needs teacher_scores.*teacher_scores column"):
        SpladeLoss(SpladeLossConfig(contrastive="kl_div"))(reps)
    with pytest.raises(ValueError, match="final_weight"):
        WarmupSchedule(final_weight=-0.1)
    with pytest.raises(ValueError, match="temperature"):
        info_nce_loss(reps, temperature=-1.0)


# ----------------------------------------------------------------------------------------------- one set of names


def test_training_arguments_take_the_loss_config_fields(tmp_path) -> None:
    """The training arguments have exactly SpladeLossConfig's fields (names, defaults, help), as CLI flags."""
    import dataclasses

    from transformers import HfArgumentParser

    from gradcache_sparton.arguments import CachedSpladeTrainingArguments

    loss_fields = {f.name: f for f in dataclasses.fields(SpladeLossConfig)}
    arg_fields = {f.name: f for f in dataclasses.fields(CachedSpladeTrainingArguments)}
    for name, f in loss_fields.items():
        assert (
            arg_fields[name].default == f.default and arg_fields[name].metadata["help"] == f.metadata["help"]
        )
    help_text = HfArgumentParser(CachedSpladeTrainingArguments).format_help()
    assert all(f"--{name}" in help_text for name in loss_fields)
    args = CachedSpladeTrainingArguments(output_dir=str(tmp_path), query_reg_weight=0.01, reg_warmup_steps=3)
    assert args.splade_loss_config() == SpladeLossConfig(query_reg_weight=0.01, reg_warmup_steps=3)
    assert args.warmup_steps == 0  # the learning-rate warm-up stays TrainingArguments' own field
    with pytest.raises(ValueError, match="reg_warmup_shape"):
        CachedSpladeTrainingArguments(output_dir=str(tmp_path), reg_warmup_shape="cosine")


# ----------------------------------------------------------------------------------------------- checked once


def test_splade_loss_checks_each_column_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """One SpladeLoss call validates each rep column exactly once (the inner losses trust their input)."""
    import gradcache_sparton.losses.columns as columns_module

    calls: list[str] = []
    check = columns_module.check_reps

    def counting_check(reps: object, *, name: str) -> torch.Tensor:
        calls.append(name)
        return check(reps, name=name)

    monkeypatch.setattr(columns_module, "check_reps", counting_check)
    reps = splade_like_reps(3, 16, 2, seed=0)
    SpladeLoss(SpladeLossConfig(query_regularizer="l1"))(reps)
    assert sorted(calls) == sorted(f"reps[{name!r}]" for name in reps)
    calls.clear()
    SpladeLoss(SpladeLossConfig(contrastive="margin_mse"))(reps, teacher_scores=torch.zeros(3, 3))
    assert len(calls) == len(reps)


@pytest.mark.parametrize(
    "call",
    [
        lambda bad, good: dot_scores(bad, good),
        lambda bad, good: paired_scores(good, bad),
        lambda bad, good: flops_regularizer([good, bad]),
        lambda bad, good: l1_regularizer(bad),
        lambda bad, good: mean_nonzeros([good, bad]),
        lambda bad, good: activation_rate(bad),
        lambda bad, good: nonzeros_per_row(bad),
        lambda bad, good: expected_flops(good, bad),
    ],
)
def test_public_functions_still_check_their_input(call) -> None:
    """Each public function called directly rejects a 1-D tensor with a ValueError saying 2-D [B, V]."""
    with pytest.raises(ValueError, match=r"2-D \[B, V\]"):
        call(torch.zeros(5), torch.zeros(2, 5))
