"""What encodes a saved model's queries: recorded in its folder, checked against the folder's files.

A model folder records its query encoder in ``splade_config.json``'s ``query_encoder`` field
(:attr:`SpladeEncoder.query_encoder`, written by ``save_pretrained`` and by ``gradcache-sparton idf``):
``"splade"`` (siamese: the document encoder encodes the queries too) or a query table's name, ``"idf"``
(fixed), ``"learned_idf"`` (trained) or ``"li_lsr"`` (:mod:`.li_lsr`), whose table is the folder's
``query_table.safetensors``. A folder written before the field existed has the query encoder its files hold:
its table's (``li_lsr`` by the file's ``kind``, else ``idf`` or ``learned_idf`` by its ``frozen``), else
``"splade"``. A record its files contradict is an error naming both, never resolved by guessing.
"""

from __future__ import annotations

import os
from pathlib import Path

from gradcache_sparton.modeling.checkpoint import QUERY_ENCODER_FIELD, SPLADE_CONFIG_NAME, read_splade_config
from gradcache_sparton.modeling.query_table import (
    QUERY_TABLE_NAME,
    QueryTable,
    has_query_table,
    load_query_table,
)
from gradcache_sparton.primitives.query_encoders import SIAMESE_QUERY_ENCODER

__all__ = ["load_query_encoder"]


def load_query_encoder(folder: str | os.PathLike) -> tuple[str, QueryTable | None]:
    """The query encoder of the local model folder ``folder`` (module doc) and its query table as saved (None
    for ``"splade"``).

    ``ValueError`` naming the files and both facts when the recorded query encoder contradicts them: a table
    encoder recorded without a ``query_table.safetensors``, a table file beside a recorded ``"splade"``, or a
    table of another kind or ``frozen`` than the record says.
    """
    folder = Path(folder)
    table = load_query_table(folder) if has_query_table(folder) else None
    held = SIAMESE_QUERY_ENCODER if table is None else table.query_encoder
    recorded = read_splade_config(str(folder)).get(QUERY_ENCODER_FIELD)
    if recorded is None or recorded == held:  # no record (a folder from before it): what the files hold
        return held, table
    config, table_file = folder / SPLADE_CONFIG_NAME, folder / QUERY_TABLE_NAME
    if table is None:
        raise ValueError(
            f"{config} records {QUERY_ENCODER_FIELD} {recorded!r} (an inference-free model) but {table_file} does "
            f"not exist: restore the query table, or record {QUERY_ENCODER_FIELD} {SIAMESE_QUERY_ENCODER!r} to "
            "load the folder as a siamese model"
        )
    holds = f"holds a {held!r} query table (kind {table.kind!r}, frozen {table.frozen})"
    if recorded == SIAMESE_QUERY_ENCODER:
        raise ValueError(
            f"{table_file} {holds} but {config} records {QUERY_ENCODER_FIELD} {recorded!r} (siamese, no table): "
            f"remove the table file (a siamese model saved over an inference-free one?), or record {held!r}"
        )
    raise ValueError(
        f"{config} records {QUERY_ENCODER_FIELD} {recorded!r} but {table_file} {holds}: record {held!r}, or "
        "replace the table file"
    )
