"""Sparton: the SPLADE head without the [B, S, V] logits (Triton on CUDA, chunked PyTorch on CPU)."""

from gradcache_sparton.kernels.reference import (
    sparton_head_reference,
    splade_head_materialized,
    splade_max_pool,
)
from gradcache_sparton.kernels.sparton_module import SpartonHead
from gradcache_sparton.kernels.sparton_ops import sparton_head

__all__ = [
    "SpartonHead",
    "sparton_head",
    "sparton_head_reference",
    "splade_head_materialized",
    "splade_max_pool",
]
