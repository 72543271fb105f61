"""One of our checkpoints made a sentence-transformers ``SparseEncoder`` folder too: modules,
``max_seq_length`` as trained, a model card, so ``SparseEncoder(path)`` gives exactly our reps.

A siamese :class:`SpladeEncoder` becomes [fill-mask Transformer, SpladePooling]; an
:class:`InferenceFreeEncoder` becomes sentence-transformers' inference-free layout, one ``Router`` with a
``"query"`` route (a ``SparseStaticEmbedding`` holding the query table) and a ``"document"`` route (the
same two modules), so ``encode_query`` / ``encode_document`` give our query and document reps. The
masked LM stays where our checkpoint has it, in the folder's root, read by both libraries.
"""

from __future__ import annotations

import json
import os

from gradcache_sparton.integrations.sentence_transformers.model_card import model_card
from gradcache_sparton.modeling import InferenceFreeEncoder, SpladeEncoder
from gradcache_sparton.modeling.query_table import QueryTable

__all__ = ["sentence_transformers_can_load", "write_sentence_transformers_files"]

# What sentence-transformers 6 writes for a SPLADE SparseEncoder: the fill-mask Transformer in the
# checkpoint's root (its weights are the masked-LM's own), the pooling's config in a subfolder.
_TRANSFORMER_TYPE = "sentence_transformers.base.modules.transformer.Transformer"
_POOLING_TYPE = "sentence_transformers.sparse_encoder.modules.splade_pooling.SpladePooling"
_MASKED_POOLING_TYPE = (
    "gradcache_sparton.integrations.sentence_transformers_modules.SpecialTokenMaskedSpladePooling"
)
_POOLING_DIR = "1_SpladePooling"
_TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json", "vocab.txt")
# The inference-free layout: a Router at the root, its module folders named as Router.save names them
# (route_index_Class), except the document Transformer, which is the root itself (the masked LM's files).
_ROUTER_TYPE = "sentence_transformers.base.modules.router.Router"
_STATIC_TYPE = "sentence_transformers.sparse_encoder.modules.sparse_static_embedding.SparseStaticEmbedding"
_STATIC_DIR = "query_0_SparseStaticEmbedding"
_ROUTER_POOLING_DIR = "document_1_SpladePooling"


def _write_json(path: str, value: object) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(value, f, indent=2)
        f.write("\n")


def sentence_transformers_can_load(encoder: SpladeEncoder) -> bool:
    """Whether :func:`write_sentence_transformers_files` can describe ``encoder``: a masked LM whose
    positions all pool (special tokens aside); not a decoder-only LM, nor echo or prefix options. For an
    inference-free model, its document encoder's answer."""
    from transformers import MODEL_FOR_MASKED_LM_MAPPING

    # sentence-transformers builds the backbone with AutoModelForMaskedLM from the saved config.
    auto_masked_lm = MODEL_FOR_MASKED_LM_MAPPING.get(type(encoder.config), None) is type(encoder.model)
    return auto_masked_lm and not (encoder.bidirectional or encoder.echo or encoder.prefix_length)


def write_sentence_transformers_files(
    directory: str | os.PathLike,
    *,
    encoder: SpladeEncoder,
    max_seq_length: int,
    card: str | None = None,
) -> None:
    """Make a saved :class:`SpladeEncoder` checkpoint a sentence-transformers ``SparseEncoder`` as well.

    Writes, next to what ``encoder.save_pretrained(directory, tokenizer=...)`` wrote (the masked-LM
    weights, config and tokenizer, which both libraries read as they are): ``modules.json``,
    ``sentence_bert_config.json`` (the fill-mask task and ``max_seq_length``),
    ``config_sentence_transformers.json`` (dot-product similarity), ``1_SpladePooling/config.json``
    (max pooling of log1p(relu(logits)), with the encoder's ``activation_function``: ``"log1p_relu"``
    for log1p(log1p(relu(logits)))) and ``README.md`` (``card``, default :func:`model_card`).
    Needs no sentence-transformers install. ``SparseEncoder(directory)`` then gives the encoder's reps.

    With ``special_token_ids``, whose positions sentence-transformers' own ``SpladePooling`` cannot
    drop, the pooling module is
    :class:`~gradcache_sparton.integrations.sentence_transformers_modules.SpecialTokenMaskedSpladePooling`:
    ``SparseEncoder(directory)`` refuses to import it (a module outside its namespace), and
    ``SparseEncoder(directory, trust_remote_code=True)`` with gradcache_sparton installed loads the
    exact reps. Never the wrong reps.

    For an :class:`InferenceFreeEncoder` the files describe a ``Router`` (module doc): ``router_config.json``,
    ``query_0_SparseStaticEmbedding/`` (the table's weights, special tokens' set to 0, ``frozen`` as the table
    is, and the tokenizer, whose ``model_max_length`` keeps the tokens our collator keeps of a query:
    ``encoder.query_max_length`` less the special tokens it adds) and ``document_1_SpladePooling/``;
    ``SparseEncoder(directory).encode_query`` / ``encode_document`` then give exactly our query and
    document reps (a query whose text spells a special token literally counts it nowhere).

    Args:
        directory: a folder holding ``encoder.save_pretrained(directory, tokenizer=...)``'s output.
        encoder: the encoder saved there (its vocabulary size and options are recorded).
        max_seq_length: the truncation length sentence-transformers applies to every text; pass the
            length the model was trained with (documents').
        card: the README.md text.

    Raises:
        TypeError / ValueError, before anything is written: not a SpladeEncoder, a non-positive
            ``max_seq_length`` or one beyond the backbone's positions, no model or tokenizer in
            ``directory``.
    """
    if not isinstance(encoder, SpladeEncoder):
        raise TypeError(f"encoder must be a SpladeEncoder, got {type(encoder).__name__}")
    if not sentence_transformers_can_load(encoder):
        raise ValueError(
            f"a {type(encoder.model).__name__} encoder with {encoder.extra_repr()} has no sentence-transformers "
            "equivalent (its fill-mask Transformer reads masked LMs with every position pooled)"
        )
    if isinstance(max_seq_length, bool) or not isinstance(max_seq_length, int) or max_seq_length < 1:
        raise ValueError(f"max_seq_length must be a positive int, got {max_seq_length!r}")
    positions = getattr(encoder.config, "max_position_embeddings", None)
    if positions is not None and max_seq_length > positions:
        raise ValueError(
            f"max_seq_length {max_seq_length} exceeds the backbone's max_position_embeddings {positions}"
        )
    directory = os.fspath(directory)
    if not os.path.isfile(os.path.join(directory, "config.json")):
        raise ValueError(
            f"{directory} holds no saved model (config.json): call encoder.save_pretrained first"
        )
    if not any(os.path.isfile(os.path.join(directory, name)) for name in _TOKENIZER_FILES):
        raise ValueError(
            f"{directory} holds no tokenizer, which sentence-transformers loads from the same folder: "
            "save with encoder.save_pretrained(directory, tokenizer=tokenizer)"
        )
    from gradcache_sparton.version import __version__

    special = list(encoder.special_token_ids)
    pooling_type = _MASKED_POOLING_TYPE if special else _POOLING_TYPE
    inference_free = isinstance(encoder, InferenceFreeEncoder)
    if inference_free:
        pooling_dir = _ROUTER_POOLING_DIR
        modules = [{"idx": 0, "name": "0", "path": "", "type": _ROUTER_TYPE}]
        _write_query_route(directory, encoder.query_table, encoder.query_max_length)
        _write_json(
            os.path.join(directory, "router_config.json"),
            {
                "types": {_STATIC_DIR: _STATIC_TYPE, ".": _TRANSFORMER_TYPE, pooling_dir: pooling_type},
                "structure": {"query": [_STATIC_DIR], "document": [".", pooling_dir]},
                "parameters": {"default_route": "document", "allow_empty_key": True, "route_mappings": {}},
            },
        )
    else:
        pooling_dir = _POOLING_DIR
        modules = [
            {"idx": 0, "name": "0", "path": "", "type": _TRANSFORMER_TYPE},
            {"idx": 1, "name": "1", "path": pooling_dir, "type": pooling_type},
        ]
    pooling = {
        "pooling_strategy": encoder.pooling,
        "activation_function": encoder.activation_function,
        "embedding_dimension": encoder.vocab_size,
    }
    if special:
        pooling["special_token_ids"] = special
    _write_json(os.path.join(directory, "modules.json"), modules)
    _write_json(
        os.path.join(directory, "sentence_bert_config.json"),
        {
            "transformer_task": "fill-mask",
            "modality_config": {"text": {"method": "forward", "method_output_name": "logits"}},
            "module_output_name": "token_embeddings",
            "max_seq_length": max_seq_length,
        },
    )
    import torch
    import transformers

    _write_json(
        os.path.join(directory, "config_sentence_transformers.json"),
        {
            "model_type": "SparseEncoder",
            "__version__": {
                "gradcache_sparton": __version__,
                "transformers": transformers.__version__,
                "pytorch": torch.__version__,
            },
            "prompts": {"query": "", "document": ""},
            "default_prompt_name": None,
            "similarity_fn_name": "dot",
        },
    )
    os.makedirs(os.path.join(directory, pooling_dir), exist_ok=True)
    _write_json(os.path.join(directory, pooling_dir, "config.json"), pooling)
    if card is None:
        card = model_card(encoder=encoder, max_seq_length=max_seq_length)
    with open(os.path.join(directory, "README.md"), "w", encoding="utf-8") as f:
        f.write(card)


def _write_query_route(directory: str, table: QueryTable, query_max_length: int | None) -> None:
    """``directory/query_0_SparseStaticEmbedding``: the table as a ``SparseStaticEmbedding`` (weights with
    special tokens' at 0, ``frozen``) and the tokenizer truncating a query where our collator does."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(directory)
    if len(tokenizer) != table.vocab_size:
        raise ValueError(
            f"the tokenizer in {directory} has {len(tokenizer)} tokens but the query table {table.vocab_size}"
        )
    if query_max_length is not None:
        # Our collator keeps query_max_length tokens, special ones included; SparseStaticEmbedding adds none.
        tokenizer.model_max_length = query_max_length - tokenizer.num_special_tokens_to_add(pair=False)
    weight = table.weight.detach().to("cpu", torch.float32).clone()  # [V]
    weight[list(table.special_token_ids)] = 0.0  # never counted here; sentence-transformers cannot mask them
    folder = os.path.join(directory, _STATIC_DIR)
    os.makedirs(folder, exist_ok=True)
    save_file({"weight": weight.contiguous()}, os.path.join(folder, "model.safetensors"))
    _write_json(os.path.join(folder, "config.json"), {"frozen": table.frozen})
    tokenizer.save_pretrained(folder)
