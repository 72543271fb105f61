"""``GradCache(cuda_graphs=True)``: mini-batches replayed as CUDA graphs give the eager engine's results.

The invariants are the engine's (tests/test_engine.py): a graphed cached step leaves the loss and every
parameter gradient of one uncached step (fp32, rtol 1e-5: see that module's docstring for the bound),
draws the dropout masks an eager per-mini-batch reference draws, and Step (3) reproduces Step (1) bit
for bit (``check_replay``). Graph-specific: the second step replays recorded graphs (the path a
recording-only test would miss), ``.grad`` accumulates onto what was there and stays None where no
gradient flows, and a refused configuration fails before any encoding. The GPU tests run where CUDA is
(the H100 runs are in docs/benchmarks.md); the argument checks run everywhere.
"""

from __future__ import annotations

import pytest
import torch
from engine_helpers import (
    assert_grads_close,
    contrastive_flops_loss,
    enable_checkpointing,
    grads_of,
    make_columns,
    make_encoder,
    per_mini_batch_loss,
    small_config,
    uncached_loss,
)

from gradcache_sparton.engine import CachedLoss, GradCache, GradCacheConfig
from gradcache_sparton.engine.cuda_graphs import _reentrant_checkpoint_in
from gradcache_sparton.engine.settings import encoder_facts, resolve_settings

RTOL_FP32 = 1e-5  # as tests/test_engine.py
BATCH = 8
PAD = 8  # mini_batch_length_multiple: the columns (7-13 tokens) come in two lengths


@pytest.fixture
def config(tiny_bert_config):
    return small_config(tiny_bert_config)


def _cuda(columns):
    return {name: {k: v.cuda() for k, v in features.items()} for name, features in columns.items()}


def _uncached_grads(encoder, columns):
    loss, _ = uncached_loss(encoder, columns, contrastive_flops_loss)
    loss.backward()
    grads = grads_of(encoder)
    encoder.zero_grad(set_to_none=True)
    return loss.detach(), grads


@pytest.mark.gpu
@pytest.mark.parametrize("mini_batch_size", [4, 3])
def test_graphed_steps_match_uncached(config, mini_batch_size: int) -> None:
    """Two graphed steps (the first records, the second replays) each give the uncached loss and gradients,
    mini-batches dividing the batch and not."""
    encoder = make_encoder(config).cuda()
    engine = GradCache(
        encoder, mini_batch_size=mini_batch_size, mini_batch_length_multiple=PAD, cuda_graphs=True
    )
    for seed in (0, 1):
        columns = _cuda(make_columns(BATCH, 3, seed=seed))
        ref_loss, ref_grads = _uncached_grads(encoder, columns)
        recorded = engine._run.graphs.graph_count

        loss, _ = engine.step(columns, contrastive_flops_loss)

        torch.testing.assert_close(loss, ref_loss, rtol=RTOL_FP32, atol=0)
        assert_grads_close(grads_of(encoder), ref_grads, rtol=RTOL_FP32)
        encoder.zero_grad(set_to_none=True)
        if seed == 1:  # same shapes as the first step: replayed, nothing recorded
            assert engine._run.graphs.graph_count == recorded > 0


@pytest.mark.gpu
def test_graphed_dropout_matches_per_mini_batch_reference(tiny_bert_config) -> None:
    """With dropout, a graphed step (recording, then replaying) gives the gradients of the eager
    per-mini-batch reference from the same seed (cut to the same rounded lengths), and leaves the CUDA
    generator where it leaves it."""
    encoder = make_encoder(small_config(tiny_bert_config, dropout=0.1), train=True).cuda()
    engine = GradCache(encoder, mini_batch_size=3, mini_batch_length_multiple=PAD, cuda_graphs=True)
    for seed in (0, 1):
        columns = _cuda(make_columns(BATCH, 3, seed=seed))
        torch.cuda.manual_seed(99)
        ref_loss, _ = per_mini_batch_loss(
            encoder, columns, contrastive_flops_loss, 3, mini_batch_length_multiple=PAD
        )
        ref_loss.backward()
        ref_loss = ref_loss.detach()  # a live eager graph would hold accumulators on the default stream
        ref_grads, ref_rng = grads_of(encoder), torch.cuda.get_rng_state()
        encoder.zero_grad(set_to_none=True)

        torch.cuda.manual_seed(99)
        loss, _ = engine.step(columns, contrastive_flops_loss)

        torch.testing.assert_close(loss, ref_loss, rtol=RTOL_FP32, atol=0)
        assert_grads_close(grads_of(encoder), ref_grads, rtol=RTOL_FP32)
        assert torch.equal(torch.cuda.get_rng_state(), ref_rng)
        encoder.zero_grad(set_to_none=True)


@pytest.mark.gpu
def test_graphed_cached_loss_accumulates_and_leaves_unused_grads_none(config) -> None:
    """Through CachedLoss (the replay inside loss.backward()), gradients add onto an earlier micro-step's,
    a parameter whose .grad was None gets the step's gradient, and one that gets no gradient keeps None."""
    encoder = make_encoder(config).cuda()
    encoder.unused = torch.nn.Parameter(torch.ones(3, device="cuda"))  # takes no part in the forward
    columns = _cuda(make_columns(BATCH, 3))
    uncached_loss(encoder, _cuda(make_columns(4, 2, seed=7)), contrastive_flops_loss)[0].backward()
    next(encoder.parameters()).grad = None  # as after an earlier micro-step, one parameter's .grad None
    earlier = {name: None if p.grad is None else p.grad.clone() for name, p in encoder.named_parameters()}
    ref_loss, _ = uncached_loss(encoder, columns, contrastive_flops_loss)
    ref_loss.backward()
    ref_grads = grads_of(encoder)
    for name, p in encoder.named_parameters():
        p.grad = None if earlier[name] is None else earlier[name].clone()

    cached = CachedLoss(
        encoder, contrastive_flops_loss, mini_batch_size=3, mini_batch_length_multiple=PAD, cuda_graphs=True
    )
    cached(columns).backward()

    assert_grads_close(grads_of(encoder), ref_grads, rtol=RTOL_FP32)
    assert encoder.unused.grad is None


@pytest.mark.gpu
def test_graphed_replay_of_changed_parameters_is_refused_and_grads_restored(config) -> None:
    """Parameters changed between Step (1) and Step (3): the graphed replay's reps differ from Step (1)'s,
    check_replay raises, and .grad is put back as it was (None)."""
    encoder = make_encoder(config).cuda()
    engine = GradCache(encoder, mini_batch_size=4, mini_batch_length_multiple=PAD, cuda_graphs=True)
    columns = _cuda(make_columns(BATCH, 3))
    engine.step(columns, contrastive_flops_loss)  # records every graph
    encoder.zero_grad(set_to_none=True)

    reps, replay_state = engine.encode(columns)
    _, rep_grads = engine.rep_gradients(reps, contrastive_flops_loss)
    with torch.no_grad():
        encoder.mlm.bert.embeddings.word_embeddings.weight.mul_(1.5)
    with pytest.raises(RuntimeError, match="did not reproduce Step"):
        engine.replay(replay_state, rep_grads)
    assert all(p.grad is None for p in encoder.parameters())


@pytest.mark.gpu
def test_graphed_bf16_autocast_step_equals_eager(config) -> None:
    """Under bf16 autocast the graphed step gives the eager cached step's loss and gradients: the graphs
    cast the weights themselves (autocast's cache off while recording), and Step (3) reproduces Step (1)."""
    columns = _cuda(make_columns(BATCH, 3))
    results = []
    for graphs in (False, True):
        encoder = make_encoder(config).cuda()
        engine = GradCache(encoder, mini_batch_size=4, mini_batch_length_multiple=PAD, cuda_graphs=graphs)
        for _ in range(2):  # with graphs: record, then replay
            encoder.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss, _ = engine.step(columns, contrastive_flops_loss)
        results.append((loss, grads_of(encoder)))
    (eager_loss, eager_grads), (graphed_loss, graphed_grads) = results
    torch.testing.assert_close(graphed_loss, eager_loss, rtol=RTOL_FP32, atol=0)
    assert_grads_close(graphed_grads, eager_grads, rtol=RTOL_FP32)


@pytest.mark.gpu
def test_graphed_step_with_a_live_eager_graph_matches_uncached(config) -> None:
    """An eager loss backpropagated and still referenced holds the parameters' gradient accumulators on
    the default stream, which a capture cannot wait on (recording through the parameters' own
    accumulators failed so): the graphs record over fresh leaves instead, and the step is exact."""
    encoder = make_encoder(config).cuda()
    columns = _cuda(make_columns(BATCH, 3))
    kept = uncached_loss(
        encoder, columns, contrastive_flops_loss
    )  # loss and components: graph alive to the end
    kept[0].backward()  # the accumulators have run on the default stream
    ref_loss, ref_grads = kept[0].detach(), grads_of(encoder)
    encoder.zero_grad(set_to_none=True)

    loss, _ = GradCache(encoder, mini_batch_size=4, mini_batch_length_multiple=PAD, cuda_graphs=True).step(
        columns, contrastive_flops_loss
    )

    torch.testing.assert_close(loss, ref_loss, rtol=RTOL_FP32, atol=0)
    assert_grads_close(grads_of(encoder), ref_grads, rtol=RTOL_FP32)
    assert kept[0].grad_fn is not None


@pytest.mark.gpu
def test_graphed_checkpointing_matches_per_mini_batch_reference(tiny_bert_config) -> None:
    """With dropout and non-reentrant activation checkpointing (its recomputation, RNG state included, is
    recorded in the Step (3) graph), a graphed step (recording, then replaying) gives the gradients of the
    eager per-mini-batch reference without checkpointing, from the same seed."""
    encoder = make_encoder(small_config(tiny_bert_config, dropout=0.1), train=True).cuda()
    references = []
    for seed in (0, 1):
        columns = _cuda(make_columns(BATCH, 3, seed=seed))
        torch.cuda.manual_seed(99)
        ref_loss, _ = per_mini_batch_loss(
            encoder, columns, contrastive_flops_loss, 3, mini_batch_length_multiple=PAD
        )
        ref_loss.backward()
        references.append((columns, ref_loss.detach(), grads_of(encoder)))
        encoder.zero_grad(set_to_none=True)
    enable_checkpointing(encoder.mlm, use_reentrant=False)
    engine = GradCache(encoder, mini_batch_size=3, mini_batch_length_multiple=PAD, cuda_graphs=True)
    for columns, ref_loss, ref_grads in references:
        torch.cuda.manual_seed(99)
        loss, _ = engine.step(columns, contrastive_flops_loss)

        torch.testing.assert_close(loss, ref_loss, rtol=RTOL_FP32, atol=0)
        assert_grads_close(grads_of(encoder), ref_grads, rtol=RTOL_FP32)
        encoder.zero_grad(set_to_none=True)
    assert engine._run.graphs.graph_count > 0


@pytest.mark.gpu
def test_graphed_reentrant_checkpointing_is_refused_and_grads_restored(config) -> None:
    """Reentrant checkpointing (which a capture cannot hold) is refused when the first Step (3) graph is
    recorded, naming use_reentrant=False, and .grad is put back as it was (None)."""
    encoder = make_encoder(config, train=True).cuda()  # transformers checkpoints in training mode only
    enable_checkpointing(encoder.mlm, use_reentrant=True)
    engine = GradCache(encoder, mini_batch_size=4, mini_batch_length_multiple=PAD, cuda_graphs=True)
    with pytest.raises(ValueError, match=r"reentrant activation checkpointing.*use_reentrant=False"):
        engine.step(_cuda(make_columns(BATCH, 3)), contrastive_flops_loss)
    assert all(p.grad is None for p in encoder.parameters())


@pytest.mark.parametrize("use_reentrant", [None, False, True], ids=["none", "non-reentrant", "reentrant"])
def test_reentrant_checkpoint_is_found_in_the_graph(config, use_reentrant: bool | None) -> None:
    """The refusal's detection: a reentrant checkpoint's node is found in the encoder's autograd graph,
    and neither a non-reentrant one nor an encoder without checkpointing is mistaken for it."""
    encoder = make_encoder(config, train=True)  # transformers checkpoints in training mode only
    if use_reentrant is not None:
        enable_checkpointing(encoder.mlm, use_reentrant=use_reentrant)
    features = make_columns(BATCH, 3)["query"]
    assert _reentrant_checkpoint_in(encoder(**features)) is bool(use_reentrant)


@pytest.mark.gpu
def test_graphed_compiled_encoder_matches_eager_compiled(config) -> None:
    """A torch.compile'd encoder (as the Trainer's torch_compile wraps it) replayed as graphs gives the
    loss and gradients of the same compiled encoder run eagerly, over a recording and a replaying step
    (check_replay off for both: compiled graph-less and graph-recording programs may round apart)."""
    results = []
    for graphs in (False, True):
        torch._dynamo.reset()
        encoder = make_encoder(config).cuda()
        compiled = torch.compile(encoder)
        engine = GradCache(
            compiled,
            mini_batch_size=3,
            mini_batch_length_multiple=PAD,
            cuda_graphs=graphs,
            check_replay=False,
        )
        steps = []
        for seed in (0, 1):
            loss, _ = engine.step(_cuda(make_columns(BATCH, 3, seed=seed)), contrastive_flops_loss)
            steps.append((loss, grads_of(encoder)))
            encoder.zero_grad(set_to_none=True)
        results.append(steps)
    for (eager_loss, eager_grads), (graphed_loss, graphed_grads) in zip(*results, strict=True):
        torch.testing.assert_close(graphed_loss, eager_loss, rtol=RTOL_FP32, atol=0)
        assert_grads_close(graphed_grads, eager_grads, rtol=RTOL_FP32)


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"mini_batch_tokens": 64}, "mini_batch_tokens"),
        ({"reuse_argmax": True}, "reuse_argmax"),
        ({"gather_across_ranks": True}, "data parallelism"),
    ],
)
def test_refused_cuda_graph_settings_raise(config, monkeypatch, options, match: str) -> None:
    """Each setting cuda_graphs cannot honour is refused when the engine is built, naming what it needs."""
    monkeypatch.setattr(
        "gradcache_sparton.engine.gradcache.data_parallel_world_size", lambda gather: 2 if gather else 1
    )
    with pytest.raises(ValueError, match=f"cuda_graphs=True needs.*{match}"):
        GradCache(make_encoder(config), mini_batch_size=4, cuda_graphs=True, **options)
    with pytest.raises(TypeError, match="cuda_graphs must be a bool"):
        GradCache(make_encoder(config), mini_batch_size=4, cuda_graphs="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"nn\.Module encoder"):
        GradCache(lambda **features: features, mini_batch_size=4, cuda_graphs=True)


def test_cuda_graphs_round_lengths_to_32_unless_told_otherwise(config) -> None:
    """cuda_graphs without mini_batch_length_multiple rounds lengths to multiples of 32 (a graph per shape
    needs few shapes); a given multiple is kept."""
    facts = encoder_facts(make_encoder(config))
    assert resolve_settings(GradCacheConfig(cuda_graphs=True), facts).mini_batch_length_multiple == 32
    graphed = GradCacheConfig(cuda_graphs=True, mini_batch_length_multiple=8)
    assert resolve_settings(graphed, facts).mini_batch_length_multiple == 8
    assert resolve_settings(GradCacheConfig(), facts).mini_batch_length_multiple is None


def test_cuda_graphs_on_cpu_inputs_raise_before_encoding(config) -> None:
    """An encoder and columns off CUDA are refused at the step, before anything is encoded."""
    encoder = make_encoder(config)
    engine = GradCache(encoder, mini_batch_size=4, mini_batch_length_multiple=PAD, cuda_graphs=True)
    calls = []
    encoder.register_forward_pre_hook(lambda module, args: calls.append(1))
    with pytest.raises(ValueError, match="cuda_graphs=True needs the encoder's parameters and every column"):
        engine.step(make_columns(BATCH, 3), contrastive_flops_loss)
    assert not calls
