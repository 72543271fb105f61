"""The GradCache engine alone, on a CPU: a toy encoder, any loss over its reps, exact gradients.

GradCache needs nothing SPLADE-specific: an ``encoder(**features) -> [B, V]`` and a
``loss_fn(reps) -> scalar``. Here the encoder is a bag of embeddings and the loss is InfoNCE over
in-batch negatives. ``GradCache.step`` encodes 4 rows at a time, yet the gradients equal those of
the plain full-batch backward.

    python examples/engine_on_cpu.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gradcache_sparton import GradCache


class BagEncoder(nn.Module):
    """Token ids [B, S] -> mean of their embeddings, projected: [B, D]."""

    def __init__(self, vocab: int = 100, dim: int = 16) -> None:
        super().__init__()
        self.embed = nn.EmbeddingBag(vocab, dim, mode="mean")
        self.proj = nn.Linear(dim, dim)

    def forward(self, input_ids: Tensor) -> Tensor:
        return self.proj(self.embed(input_ids))  # [B, S] -> [B, D]


def info_nce(reps: dict[str, Tensor]) -> Tensor:
    """Each query's positive among every positive of the batch."""
    scores = reps["query"] @ reps["positive"].T  # [B, B]
    return F.cross_entropy(scores, torch.arange(scores.shape[0]))


def main() -> None:
    torch.manual_seed(0)
    encoder = BagEncoder()
    columns = {  # 16 (query, positive) pairs of random token ids
        "query": {"input_ids": torch.randint(0, 100, (16, 5))},
        "positive": {"input_ids": torch.randint(0, 100, (16, 12))},
    }

    # Plain training: the whole batch's graph at once.
    loss = info_nce({name: encoder(**features) for name, features in columns.items()})
    loss.backward()
    plain = {name: p.grad.clone() for name, p in encoder.named_parameters()}
    encoder.zero_grad()

    # GradCache: 4 rows of activations at a time, the same loss and gradients.
    output = GradCache(encoder, mini_batch_size=4).step(columns, info_nce)
    print(f"loss: plain {loss.item():.6f}, cached {output.loss.item():.6f}")
    for name, p in encoder.named_parameters():
        error = (p.grad - plain[name]).abs().max().item()
        print(f"{name:12s} max |cached - plain| gradient = {error:.2e}")
        assert torch.allclose(p.grad, plain[name], atol=1e-5), name


if __name__ == "__main__":
    main()
