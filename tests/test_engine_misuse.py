"""Engine misuse named with the column and the cause, before any work: token ids outside the vocabulary,
columns on different devices, inference mode, and ways of differentiating the cached loss that Step (3)
cannot serve (``torch.autograd.grad``, ``backward(inputs=...)``, ``create_graph=True``)."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import (
    assert_grads_unchanged,
    contrastive_flops_loss,
    make_columns,
    make_encoder,
    saved_grads,
    small_config,
)
from torch import nn

from gradcache_sparton.engine import CachedLoss, GradCache

BATCH = 4


@pytest.fixture
def encoder(tiny_bert_config) -> nn.Module:
    return make_encoder(small_config(tiny_bert_config))


def _forward_calls(encoder: nn.Module) -> list[int]:
    calls: list[int] = []
    encoder.register_forward_hook(lambda *args: calls.append(1))
    return calls


@pytest.mark.parametrize("bad_id", [500, 10_000, -1], ids=["vocab", "far", "negative"])
@pytest.mark.parametrize("api", ["CachedLoss", "GradCache.step"])
def test_token_ids_outside_the_vocabulary_are_refused_naming_the_column(
    encoder, bad_id: int, api: str
) -> None:
    """An input id outside the encoder's input embeddings (500 rows) is one ValueError naming the column and
    the vocabulary, before any encoding; the ids at the edges (0 and 499) pass."""
    columns = make_columns(BATCH, 2)
    columns["positive"]["input_ids"][1, 0] = bad_id
    calls, before = _forward_calls(encoder), saved_grads(encoder)
    with pytest.raises(
        ValueError, match=r"column 'positive' has input_ids from .* has 500 entries, ids 0 to 499"
    ):
        if api == "CachedLoss":
            CachedLoss(encoder, contrastive_flops_loss, mini_batch_size=2)(columns).backward()
        else:
            GradCache(encoder, mini_batch_size=2).step(columns, contrastive_flops_loss)
    assert not calls
    assert_grads_unchanged(encoder, before)
    columns["positive"]["input_ids"][1, 0] = 499
    columns["positive"]["input_ids"][1, 1] = 0
    GradCache(encoder, mini_batch_size=2).step(columns, contrastive_flops_loss)


def test_columns_on_different_devices_are_refused_naming_them(encoder) -> None:
    """Columns on different devices, or one column's features split across devices: one ValueError naming
    the columns (features) and their devices, before any encoding."""
    calls = _forward_calls(encoder)
    columns = make_columns(BATCH, 2)
    columns["positive"] = {name: value.to("meta") for name, value in columns["positive"].items()}
    with pytest.raises(ValueError, match=r"different devices \('query' on cpu, 'positive' on meta\)"):
        CachedLoss(encoder, contrastive_flops_loss, mini_batch_size=2)(columns)
    columns = make_columns(BATCH, 2)
    columns["query"]["attention_mask"] = columns["query"]["attention_mask"].to("meta")
    with pytest.raises(
        ValueError, match=r"features of column 'query' are on different devices: .*'attention_mask': 'meta'"
    ):
        GradCache(encoder, mini_batch_size=2).step(columns, contrastive_flops_loss)
    assert not calls


def test_step_one_failure_names_the_column_and_the_devices(encoder) -> None:
    """An encoder failing in Step (1) because its parameters are elsewhere than the inputs: the error keeps
    torch's message and gains a note naming the column, its rows and both devices."""
    encoder = encoder.to("meta")
    with pytest.raises(Exception) as caught:  # torch's own error for the device mismatch, whatever its type
        GradCache(encoder, mini_batch_size=2).step(make_columns(BATCH, 2), contrastive_flops_loss)
    notes = "\n".join(getattr(caught.value, "__notes__", []))
    assert "GradCache Step (1) failed encoding column 'query' (rows 0:2)" in notes, notes
    assert "inputs are on cpu, the encoder's parameters on meta" in notes, notes


def test_inference_mode_evaluates_and_its_backward_is_refused(encoder) -> None:
    """Under torch.inference_mode() the cached loss is an evaluation (the no_grad loss exactly); its
    backward, a step under inference_mode, and inference-mode batches used for training are refused with
    the cause, nothing accumulated."""
    columns = make_columns(BATCH, 2)
    cached = CachedLoss(encoder, contrastive_flops_loss, mini_batch_size=3)
    with torch.no_grad():
        expected = cached(columns)
    with torch.inference_mode():
        loss = cached(columns)
    assert torch.equal(loss, expected)
    before = saved_grads(encoder)
    with pytest.raises(
        RuntimeError, match=r"computed with autograd off \(under torch.no_grad\(\) or torch.inference_mode"
    ):
        loss.backward()
    with (
        torch.inference_mode(),
        pytest.raises(RuntimeError, match=r"called under torch.inference_mode.*need autograd"),
    ):
        GradCache(encoder, mini_batch_size=3).step(columns, contrastive_flops_loss)
    with torch.inference_mode():
        inference_columns = make_columns(BATCH, 2)
    for run in (
        lambda: cached(inference_columns),
        lambda: GradCache(encoder, mini_batch_size=3).step(inference_columns, contrastive_flops_loss),
    ):
        with pytest.raises(
            ValueError, match=r"'input_ids' of column 'query' was created under torch.inference_mode"
        ):
            run()
    assert_grads_unchanged(encoder, before)


def test_differentiating_the_cached_loss_other_than_by_backward_is_refused(encoder) -> None:
    """torch.autograd.grad(loss, params), backward(inputs=...) and backward(create_graph=True) on the cached
    loss: one RuntimeError saying why and what to call, nothing accumulated; the loss is otherwise a plain
    tensor (arithmetic gives torch.Tensor) whose backward fills .grad."""
    columns = make_columns(BATCH, 2)
    params = [p for p in encoder.parameters() if p.requires_grad]
    before = saved_grads(encoder)
    loss = CachedLoss(encoder, contrastive_flops_loss, mini_batch_size=3)(columns)
    with pytest.raises(
        RuntimeError, match=r"torch.autograd.grad cannot differentiate a CachedLoss.*loss.backward\(\)"
    ):
        torch.autograd.grad(loss, params)
    with pytest.raises(RuntimeError, match=r"backward\(inputs=...\) is not supported"):
        loss.backward(inputs=params[:1])
    with pytest.raises(RuntimeError, match=r"create_graph=True\) is not supported"):
        torch.autograd.backward(loss, create_graph=True)
    assert_grads_unchanged(encoder, before)
    assert type(loss * 2) is torch.Tensor and type(loss.detach()) is torch.Tensor
    assert repr(loss).startswith("tensor(")
    (loss * 0.5).backward()
    assert all(p.grad is not None for p in params)
