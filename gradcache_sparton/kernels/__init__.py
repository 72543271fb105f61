"""Sparton: the SPLADE head without the [B, S, V] logits (Triton on CUDA, chunked PyTorch on CPU)."""

from gradcache_sparton.kernels.head import SpartonHead, sparton_head
from gradcache_sparton.kernels.reference import (
    sparton_head_reference,
    splade_head_materialized,
    splade_max_pool,
)

__all__ = [
    "SpartonHead",
    "sparton_head",
    "sparton_head_reference",
    "splade_head_materialized",
    "splade_max_pool",
]
