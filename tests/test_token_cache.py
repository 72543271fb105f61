"""The training texts tokenized once (data/token_cache.py): the collator's batches from the cache are the
tokenizer's own, and the cache is built only where it can be (size, lengths, single-sequence features)."""

from __future__ import annotations

import datasets
import pytest
import torch

from gradcache_sparton.data import TrainingCollator
from gradcache_sparton.data import token_cache as token_cache_module
from gradcache_sparton.data.token_cache import TokenCache

ROWS = [
    {
        "query": "what is a gene",
        "positive": "A gene is a unit of heredity " * 9,
        "negative_1": "Cells divide.",
    },
    {"query": "a long claim about proteins " * 4, "positive": "Proteins fold.", "negative_1": "Short."},
    {"query": "q", "positive": "word " * 70, "negative_1": "RNA is transcribed from DNA in the nucleus."},
]
COLUMNS = ["query", "positive", "negative_1"]


def _cache(tokenizer, rows=ROWS) -> TokenCache | None:
    return TokenCache.for_dataset(
        tokenizer, datasets.Dataset.from_list(rows), COLUMNS, query_max_length=16, document_max_length=64
    )


@pytest.mark.parametrize("padding_side", ["right", "left"])
@pytest.mark.parametrize("pad_to_max_length", [False, True])
def test_cached_batches_equal_the_tokenizers(tokenizer, padding_side, pad_to_max_length) -> None:
    """Every column's features from the cache (keys, order, dtype, values) equal the tokenizer's at the same
    padding: to the longest row rounded to a multiple of 8 or to the max lengths, on either padding side;
    truncated texts included."""
    tokenizer.padding_side = padding_side
    try:
        cache = _cache(tokenizer)
        assert cache is not None
        settings = {"query_max_length": 16, "document_max_length": 64, "pad_to_max_length": pad_to_max_length}
        plain = TrainingCollator(tokenizer, **settings)(ROWS)["columns"]
        cached = TrainingCollator(tokenizer, token_cache=cache, **settings)(ROWS)["columns"]
    finally:
        tokenizer.padding_side = "right"
    assert list(cached) == list(plain)
    for column, features in plain.items():
        assert list(cached[column]) == list(features), column
        for key, tensor in features.items():
            assert cached[column][key].dtype == tensor.dtype and torch.equal(cached[column][key], tensor)


def test_tokenizer_without_token_type_ids(tokenizer, monkeypatch) -> None:
    """A tokenizer that gives no token type ids (most decoder tokenizers) builds a cache whose features have none
    either, equal to the tokenizer's own."""
    monkeypatch.setattr(tokenizer, "model_input_names", ["input_ids", "attention_mask"])
    cache = _cache(tokenizer)
    assert cache is not None
    settings = {"query_max_length": 16, "document_max_length": 64}
    plain = TrainingCollator(tokenizer, **settings)(ROWS)["columns"]
    cached = TrainingCollator(tokenizer, token_cache=cache, **settings)(ROWS)["columns"]
    for column, features in plain.items():
        assert list(features) == ["input_ids", "attention_mask"] == list(cached[column]), column
        for key, tensor in features.items():
            assert torch.equal(cached[column][key], tensor), (column, key)


def test_texts_outside_the_cache_are_tokenized(tokenizer) -> None:
    """A batch with a text the cache does not hold (an evaluation set's) gets the tokenizer's features, not an error."""
    cache = _cache(tokenizer)
    other = [{**ROWS[0], "query": "a query that was never seen"}, ROWS[1]]
    assert cache.features([other[0]["query"]], is_query=True, length=None, multiple=8) is None
    plain = TrainingCollator(tokenizer, query_max_length=16, document_max_length=64)(other)["columns"]
    cached = TrainingCollator(tokenizer, query_max_length=16, document_max_length=64, token_cache=cache)(
        other
    )
    for column, features in plain.items():
        for key, tensor in features.items():
            assert torch.equal(cached["columns"][column][key], tensor), (column, key)


def test_queries_and_documents_are_kept_apart(tokenizer) -> None:
    """A text that is both a query and a document is kept at each of the two max lengths."""
    text = "shared text " * 20
    cache = _cache(tokenizer, [{"query": text, "positive": text, "negative_1": "n"}])
    query = cache.features([text], is_query=True, length=None, multiple=None)
    document = cache.features([text], is_query=False, length=None, multiple=None)
    assert query["input_ids"].shape[1] == 16 and document["input_ids"].shape[1] == 42


def test_no_cache_past_its_size_or_for_a_streamed_dataset(tokenizer, monkeypatch) -> None:
    """More texts than TOKEN_CACHE_MAX_TEXTS (counted from rows, before reading them), or a dataset without a
    length, build no cache: the collator tokenizes per batch."""
    monkeypatch.setattr(token_cache_module, "TOKEN_CACHE_MAX_TEXTS", len(ROWS) * len(COLUMNS) - 1)
    assert _cache(tokenizer) is None
    monkeypatch.undo()
    streamed = datasets.Dataset.from_list(ROWS).to_iterable_dataset()
    assert (
        TokenCache.for_dataset(tokenizer, streamed, COLUMNS, query_max_length=16, document_max_length=64)
        is None
    )


def test_negatives_list_column_is_cached(tokenizer, monkeypatch) -> None:
    """A ``negatives`` list column's texts are documents of the cache like negative_i columns', and each of
    them counts toward the cache's size."""
    rows = [{"query": r["query"], "positive": r["positive"], "negatives": [r["negative_1"]]} for r in ROWS]
    cache = TokenCache.for_dataset(
        tokenizer, datasets.Dataset.from_list(rows), ["query", "positive", "negatives"],
        query_max_length=16, document_max_length=64,
    )  # fmt: skip
    assert cache.features([ROWS[2]["negative_1"]], is_query=False, length=None, multiple=8) is not None
    rows = [{**row, "negatives": row["negatives"] * 2} for row in rows]  # 3 rows of 4 texts: 12
    dataset = datasets.Dataset.from_list(rows)
    monkeypatch.setattr(
        token_cache_module, "TOKEN_CACHE_MAX_TEXTS", 11
    )  # the list's texts count, not 1 column
    columns = ["query", "positive", "negatives"]
    assert (
        TokenCache.for_dataset(tokenizer, dataset, columns, query_max_length=16, document_max_length=64)
        is None
    )
