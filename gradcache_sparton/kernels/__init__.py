"""Sparton: the SPLADE head without the [B, S, V] logits (Triton on CUDA, chunked PyTorch on CPU)."""

from gradcache_sparton.kernels.reference import (
    DEFAULT_HEAD_ACTIVATION,
    HEAD_ACTIVATIONS,
    check_head_activation,
    sparton_head_reference,
    splade_head_materialized,
    splade_max_pool,
)
from gradcache_sparton.kernels.sparton_module import SpartonHead
from gradcache_sparton.kernels.sparton_ops import sparton_head

__all__ = [
    "DEFAULT_HEAD_ACTIVATION",
    "HEAD_ACTIVATIONS",
    "SpartonHead",
    "check_head_activation",
    "sparton_head",
    "sparton_head_reference",
    "splade_head_materialized",
    "splade_max_pool",
]
