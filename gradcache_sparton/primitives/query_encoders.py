"""The names of a model's query encoder, from the ``--query_encoder`` flag to the ``query_encoder`` field of a
model folder's ``splade_config.json`` (docs/inference_free.md, "Words").

A model's query encoder is ``"splade"`` (its document encoder, siamese) or a query table, which makes the
model inference-free: ``"idf"`` (fixed weights), ``"learned_idf"`` (trained weights) or ``"li_lsr"`` (weights
computed from the token embeddings). The names live on the ground floor so that the arguments, which offer
them as choices, and the model, which records them, read one list.
"""

from __future__ import annotations

__all__ = ["INFERENCE_FREE_QUERY_ENCODERS", "QUERY_ENCODERS", "SIAMESE_QUERY_ENCODER"]

#: The query encoder of a siamese model: the document encoder itself.
SIAMESE_QUERY_ENCODER = "splade"
#: The query encoders of an inference-free model: a query table, fixed, trained, or computed from the embeddings.
INFERENCE_FREE_QUERY_ENCODERS = ("idf", "learned_idf", "li_lsr")
#: Every query encoder, siamese first.
QUERY_ENCODERS = (SIAMESE_QUERY_ENCODER, *INFERENCE_FREE_QUERY_ENCODERS)
