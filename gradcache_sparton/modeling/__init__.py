"""The SPLADE encoder over a transformers backbone, and its checkpoint format.

- :mod:`~gradcache_sparton.modeling.encoder`: :class:`SpladeEncoder`, ``encoder(**features) -> [B, V]``
  reps through the fused head, never forming the [B, S, V] logits;
- :mod:`~gradcache_sparton.modeling.backbones`: the families it knows (each one's LM transform),
  :func:`register_masked_lm` for another, their position tables;
- :mod:`~gradcache_sparton.modeling.llm`: decoder-only LMs encoded as masked LMs (bidirectional
  attention, echo inputs, BOS/EOS kept out of the pool);
- :mod:`~gradcache_sparton.modeling.checkpoint`: ``splade_config.json`` and the checks made before any
  weights load.
"""

from gradcache_sparton.modeling.backbones import (
    check_max_length,
    position_limit,
    register_masked_lm,
    supported_masked_lm_classes,
)
from gradcache_sparton.modeling.checkpoint import (
    SPLADE_CONFIG_NAME,
    TRAINING_OPTIONS,
    check_checkpoint_files,
    load_backbone,
    read_json_file,
    read_splade_config,
)
from gradcache_sparton.modeling.encoder import SpladeEncoder
from gradcache_sparton.modeling.llm import default_special_token_ids

__all__ = [
    "SPLADE_CONFIG_NAME",
    "TRAINING_OPTIONS",
    "SpladeEncoder",
    "check_checkpoint_files",
    "check_max_length",
    "default_special_token_ids",
    "load_backbone",
    "position_limit",
    "read_json_file",
    "read_splade_config",
    "register_masked_lm",
    "supported_masked_lm_classes",
]
