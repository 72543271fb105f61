"""A run's checkpoint weights back into its model, whether the model is sharded (FSDP2) or whole.

:func:`load_checkpoint_weights` copies the weights of one of our checkpoints (a standard masked- or
causal-LM folder, and an inference-free model's ``query_table.safetensors``) into the model of a resumed
run: the backbone, and an :class:`InferenceFreeEncoder`'s query table (as its folder records it,
:func:`~.query_encoder.load_query_encoder`). Under FSDP2 (``fully_shard``) every parameter of a sharded
module is a ``DTensor``, the query table's included (it sits in the root's unit); the full tensors read
from the files are then split into each rank's shards by ``set_model_state_dict`` (every rank takes part),
otherwise copied by ``load_state_dict``. Both parts take the same copy (:func:`load_full_state_dict`, also
the trainer's for a sentence-transformers ``SparseEncoder``), strict: every tensor of the module must be in
the checkpoint.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from torch import Tensor, nn

from gradcache_sparton.modeling.checkpoint import check_checkpoint_files, load_backbone
from gradcache_sparton.modeling.encoder import SpladeEncoder
from gradcache_sparton.modeling.inference_free import InferenceFreeEncoder
from gradcache_sparton.modeling.query_encoder import load_query_encoder
from gradcache_sparton.modeling.query_table import QUERY_TABLE_NAME, QueryTable

__all__ = ["load_checkpoint_weights", "load_full_state_dict"]


def load_checkpoint_weights(encoder: SpladeEncoder, folder: str | os.PathLike, *, sharded: bool) -> None:
    """Copy the checkpoint ``folder``'s backbone (and query table, for an inference-free ``encoder``) into
    ``encoder``; ``sharded``: its parameters are FSDP2 shards (module doc).

    Every backbone tensor must be in the checkpoint files (:func:`~.checkpoint.check_checkpoint_files`).
    ``ValueError`` naming the folder or its table file, before any weight is copied, when an inference-free
    ``encoder``'s checkpoint has no query table or one of another kind or vocabulary size.
    """
    check_checkpoint_files(folder)
    loaded = load_backbone(type(encoder.model), folder, local_files_only=True)  # a masked or causal LM
    parts: list[tuple[nn.Module, Mapping[str, Tensor]]] = [(encoder.model, loaded.state_dict())]
    if isinstance(encoder, InferenceFreeEncoder):  # the query table beside the backbone's weights
        parts.append((encoder.query_table, _checkpoint_table(folder, encoder.query_table).state_dict()))
    for module, state_dict in parts:
        load_full_state_dict(module, state_dict, sharded=sharded)


def load_full_state_dict(module: nn.Module, state_dict: Mapping[str, Tensor], *, sharded: bool) -> None:
    """Copy the full tensors of ``state_dict`` into ``module``, strict; ``sharded``: its parameters are FSDP2
    shards, split from the full tensors by ``set_model_state_dict`` (every rank takes part)."""
    if sharded:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        options = StateDictOptions(full_state_dict=True, strict=True)
        set_model_state_dict(module, dict(state_dict), options=options)
    else:
        module.load_state_dict(state_dict, strict=True)


def _checkpoint_table(folder: str | os.PathLike, table: QueryTable) -> QueryTable:
    """The checkpoint's query table, as its folder records it, checked against the run's ``table``."""
    query_encoder, saved = load_query_encoder(folder)  # as recorded, checked
    if saved is None:
        raise ValueError(
            f"checkpoint {folder} has no query table (its query encoder is {query_encoder!r}): not this "
            "inference-free run's"
        )
    if saved.vocab_size != table.vocab_size or saved.kind != table.kind:
        raise ValueError(
            f"{Path(folder) / QUERY_TABLE_NAME} holds a {saved.kind} table of {saved.vocab_size} weights but this "
            f"run's query table is a {table.kind} one of {table.vocab_size} (its tokenizer's vocabulary): not this "
            "inference-free run's checkpoint"
        )
    return saved
