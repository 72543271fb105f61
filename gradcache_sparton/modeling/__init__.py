"""The SPLADE encoder over a transformers backbone, and its checkpoint format.

- :mod:`~gradcache_sparton.modeling.encoder`: :class:`SpladeEncoder`, ``encoder(**features) -> [B, V]``
  reps through the fused head, never forming the [B, S, V] logits;
- :mod:`~gradcache_sparton.modeling.backbones`: the families it knows (each one's LM transform),
  :func:`register_masked_lm` for another, their position tables;
- :mod:`~gradcache_sparton.modeling.llm`: decoder-only LMs encoded as masked LMs (bidirectional
  attention, echo inputs, BOS/EOS kept out of the pool);
- :mod:`~gradcache_sparton.modeling.checkpoint`: ``splade_config.json`` and the checks made before any
  weights load;
- :mod:`~gradcache_sparton.modeling.query_table`: :class:`QueryTable`, the query encoder of an inference-free
  model (a weight per token, e.g. the corpus's IDF), its file ``query_table.safetensors`` and ``idf.json``;
- :mod:`~gradcache_sparton.modeling.li_lsr`: :class:`LiLsrTable`, a query table computed from the token
  embeddings by D + 1 trained numbers (Li-LSR), started from a given table (:func:`li_lsr_table_from`);
- :mod:`~gradcache_sparton.modeling.query_encoder`: :func:`load_query_encoder`, what encodes a saved model's
  queries (``splade_config.json``'s ``query_encoder``, checked against the folder's files);
- :mod:`~gradcache_sparton.modeling.inference_free`: :class:`InferenceFreeEncoder`, the table for queries
  and the SPLADE encoder for documents in one module, routed by column;
- :mod:`~gradcache_sparton.modeling.resume`: :func:`load_checkpoint_weights`, a checkpoint's backbone and query
  table back into a resumed run's model, sharded (FSDP2) or whole (:func:`load_full_state_dict`, the copy).
"""

from gradcache_sparton.modeling.backbones import (
    check_max_length,
    position_limit,
    register_masked_lm,
    supported_masked_lm_classes,
)
from gradcache_sparton.modeling.checkpoint import (
    QUERY_ENCODER_FIELD,
    SPLADE_CONFIG_NAME,
    TRAINING_OPTIONS,
    check_checkpoint_files,
    load_backbone,
    read_json_file,
    read_splade_config,
)
from gradcache_sparton.modeling.encoder import SpladeEncoder
from gradcache_sparton.modeling.inference_free import InferenceFreeEncoder
from gradcache_sparton.modeling.li_lsr import LiLsrTable, li_lsr_table_from
from gradcache_sparton.modeling.llm import default_special_token_ids
from gradcache_sparton.modeling.query_encoder import load_query_encoder
from gradcache_sparton.modeling.query_table import (
    QUERY_TABLE_NAME,
    TOKEN_WEIGHTS_NAME,
    QueryTable,
    has_query_table,
    idf_weights,
    load_query_table,
    query_table_parameters,
    save_query_table,
    write_token_weights,
)
from gradcache_sparton.modeling.resume import load_checkpoint_weights, load_full_state_dict

__all__ = [
    "QUERY_ENCODER_FIELD",
    "QUERY_TABLE_NAME",
    "SPLADE_CONFIG_NAME",
    "TOKEN_WEIGHTS_NAME",
    "TRAINING_OPTIONS",
    "InferenceFreeEncoder",
    "LiLsrTable",
    "QueryTable",
    "SpladeEncoder",
    "check_checkpoint_files",
    "check_max_length",
    "default_special_token_ids",
    "has_query_table",
    "idf_weights",
    "li_lsr_table_from",
    "load_backbone",
    "load_checkpoint_weights",
    "load_full_state_dict",
    "load_query_encoder",
    "load_query_table",
    "position_limit",
    "query_table_parameters",
    "read_json_file",
    "read_splade_config",
    "register_masked_lm",
    "save_query_table",
    "supported_masked_lm_classes",
    "write_token_weights",
]
