"""gradcache_sparton: exact very-large-batch SPLADE training.

Two pieces, combined:
- a GradCache engine (embed mini-batches without a graph, compute the loss on the full batch of
  reps, cache the rep gradients, re-embed with RNG/autocast replayed and backprop), and
- Sparton, a fused Triton SPLADE head that never materialises the [B, S, V] logits.

Triton is imported lazily: ``import gradcache_sparton`` works on machines without a GPU.
"""

from gradcache_sparton.kernels import SpartonHead, sparton_head, sparton_head_reference
from gradcache_sparton.resources import default_tokenizer_path

__version__ = "0.1.0"

__all__ = [
    "SpartonHead",
    "__version__",
    "default_tokenizer_path",
    "sparton_head",
    "sparton_head_reference",
]
