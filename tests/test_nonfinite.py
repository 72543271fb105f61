"""A NaN in one token's hidden state stops a cached step on the fused head's Triton path.

Legend: B batch, S sequence, V vocabulary.

The engine refuses a non-finite loss before Step (3), so nothing reaches the weights, provided the head
lets the NaN reach the reps. These tests run the SPLADE encoder with its head on the Triton kernels
(compiled on a GPU, through the interpreter on CPU, where the head would otherwise take the PyTorch
reference) and check that the step raises the engine's ``FloatingPointError`` with every parameter and
``.grad`` bitwise as before.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import BertConfig

from gradcache_sparton.engine import CachedLoss, GradCache
from gradcache_sparton.kernels import sparton_ops
from gradcache_sparton.modeling import SpladeEncoder

pytestmark = pytest.mark.kernel


def _contrastive_loss(reps: dict[str, Tensor]) -> Tensor:
    """In-batch InfoNCE over dot products of query and positive reps."""
    scores = reps["query"] @ reps["positive"].T  # [B, V] @ [V, B] -> [B, B]
    return F.cross_entropy(scores, torch.arange(scores.shape[0], device=scores.device))


def _columns(device: torch.device) -> dict[str, dict[str, Tensor]]:
    """Two columns of 4 rows over a 40-token vocabulary, with padded tails."""
    g = torch.Generator().manual_seed(0)
    columns = {}
    for name, S in (("query", 7), ("positive", 11)):
        ids = torch.randint(1, 40, (4, S), generator=g)
        mask = torch.ones(4, S, dtype=torch.long)
        mask[1, S - 3 :] = 0
        mask[3, S - 2 :] = 0
        columns[name] = {"input_ids": ids.to(device), "attention_mask": mask.to(device)}
    return columns


def _snapshot(model: nn.Module) -> dict[str, tuple[Tensor, Tensor | None]]:
    return {
        name: (p.detach().clone(), None if p.grad is None else p.grad.clone())
        for name, p in model.named_parameters()
    }


def _plant_nan_once(*, call: int, row: int, position: int):
    """Forward hook for a transformer layer: NaN in one token's output hidden state, in its ``call``-th
    forward only (one mini-batch of one column)."""
    calls = 0

    def hook(module: nn.Module, args: object, output: Tensor | tuple[Tensor, ...]):
        nonlocal calls
        calls += 1
        if calls - 1 != call:
            return output
        hidden = (output[0] if isinstance(output, tuple) else output).clone()  # [B, S, D]
        hidden[row, position] = float("nan")
        return (hidden, *output[1:]) if isinstance(output, tuple) else hidden

    return hook


@pytest.mark.parametrize("api", ["GradCache.step", "CachedLoss"])
def test_nan_hidden_state_stops_cached_step_on_triton_path(kernel_device, monkeypatch, api) -> None:
    """A NaN in one unmasked token's hidden state reaches the reps through the Triton head, and the cached
    step raises FloatingPointError before Step (3): weights and accumulated .grad stay bitwise as they were."""
    monkeypatch.setattr(sparton_ops, "_use_triton", lambda hidden_states: True)
    config = BertConfig(
        vocab_size=40,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=16,
    )
    torch.manual_seed(0)
    encoder = SpladeEncoder.from_config(config).to(kernel_device).train()
    columns = _columns(kernel_device)
    engine = GradCache(encoder, mini_batch_size=2)
    cached = CachedLoss(encoder, _contrastive_loss, mini_batch_size=2)
    for p in encoder.parameters():  # gradients accumulated by earlier micro-batches
        p.grad = torch.randn_like(p)
    before = _snapshot(encoder)

    last_layer = encoder.model.bert.encoder.layer[-1]
    # Through the head alone: the NaN reaches exactly that row's reps (the old kernel dropped it).
    handle = last_layer.register_forward_hook(_plant_nan_once(call=0, row=0, position=4))
    with torch.no_grad():
        reps = encoder(**{name: t[2:] for name, t in columns["query"].items()})  # [2, V]
    handle.remove()
    assert reps[0].isnan().all() and reps[1].isfinite().all()
    # The cached step: Step (1)'s second query mini-batch (rows 2-3), row 2, position 4 (unmasked).
    handle = last_layer.register_forward_hook(_plant_nan_once(call=1, row=0, position=4))
    try:
        with pytest.raises(FloatingPointError, match="non-finite"):
            if api == "GradCache.step":
                engine.step(columns, _contrastive_loss)
            else:
                cached(columns).backward()
    finally:
        handle.remove()
    for name, (weight, grad) in _snapshot(encoder).items():
        assert torch.equal(weight, before[name][0]), name
        assert torch.equal(grad, before[name][1]), name
