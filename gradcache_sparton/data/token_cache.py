"""Every training text tokenized once, before training: the collator then only pads.

Tokenizing a batch is the collator's cost (about 1.2 s for 512 SciFact triplets on one CPU thread, the
abstracts being tokenized whole before truncation). Dataloader workers hide it within an epoch, but each
epoch's first batch waits for it: on a training set of a few thousand rows, whose epochs last a few steps,
that wait is a large share of the run. Tokenized up front (the fast tokenizer's threads, in the main
process, before any worker starts), each distinct text is tokenized once for the whole run.

What is kept per text is its token ids (int32, truncated to its column's max length, no padding). The
attention mask of an unpadded single sequence is all ones, and its token type ids are rebuilt as zeros,
which is what the tokenizer gives a single sequence where it gives them at all: :meth:`TokenCache.build`
checks this on every text and builds no cache where it does not hold (the collator then tokenizes).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence

import numpy as np
import torch
from torch import Tensor
from transformers import PreTrainedTokenizerBase

from gradcache_sparton.data.columns import NEGATIVES_COLUMN, QUERY_COLUMN

__all__ = ["TOKEN_CACHE_MAX_TEXTS", "TokenCache", "training_texts"]

logger = logging.getLogger(__name__)

TOKEN_CACHE_MAX_TEXTS = 300_000
"""Texts at most (each row's queries and documents, repeats included): at 256 tokens, at most about 300 MB of
ids. Past it an epoch is hundreds of steps long, and its first batch's wait a small share of it."""
_CHUNK = 4_096  # texts per tokenizer call: its threads have work, the Python lists stay small


def training_texts(dataset: object, text_columns: Sequence[str]) -> dict[bool, list[str]] | None:
    """A training dataset's texts by kind (True: queries, False: documents) from its ``text_columns``
    (:func:`~.columns.text_columns_of`); None for a dataset without a length (streamed), or with more
    texts than :data:`TOKEN_CACHE_MAX_TEXTS` (counted from its first row, nothing else read then)."""
    if not hasattr(dataset, "__len__") or len(dataset) == 0:
        return None
    first = dataset[0]
    per_row = sum(len(first[name]) if name == NEGATIVES_COLUMN else 1 for name in text_columns)
    if len(dataset) * per_row > TOKEN_CACHE_MAX_TEXTS:
        return None
    texts: dict[bool, list[str]] = {True: [], False: []}
    for name in text_columns:
        values = list(dataset[name])  # a datasets.Dataset column (a list of rows' values)
        if name == NEGATIVES_COLUMN:
            values = [text for listed in values for text in listed]
        texts[name == QUERY_COLUMN].extend(values)
    return texts


class TokenCache:
    """The token ids of each distinct query text and document text, each at its column's max length.

    Build it with :meth:`build`; :meth:`features` returns a column's padded features, equal to what the
    tokenizer returns for the same texts with the same padding, or None when a text is not in the cache.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        ids: Mapping[bool, Mapping[str, np.ndarray]],
        token_type_ids: bool,
    ) -> None:
        self._pad_id = tokenizer.pad_token_id
        self._left = tokenizer.padding_side == "left"
        self._ids = ids  # is_query -> text -> int32 ids
        self._token_type_ids = token_type_ids

    @classmethod
    def build(
        cls,
        tokenizer: PreTrainedTokenizerBase,
        texts: Mapping[bool, Iterable[str]],
        max_lengths: Mapping[bool, int],
    ) -> TokenCache | None:
        """Tokenize the distinct texts of ``texts`` (is_query -> texts) at ``max_lengths[is_query]``; None
        (with the reason logged) where the tokenizer has no pad token, or a text's attention mask or token
        type ids are not those of a single sequence. How many texts is the caller's to bound
        (:func:`training_texts`)."""
        distinct = {is_query: list(dict.fromkeys(values)) for is_query, values in texts.items()}
        if tokenizer.pad_token_id is None:
            return None  # the tokenizer's own padding raises the clear error
        ids: dict[bool, dict[str, np.ndarray]] = {}
        token_type_ids = False
        for is_query, values in distinct.items():
            ids[is_query] = {}
            for start in range(0, len(values), _CHUNK):
                chunk = values[start : start + _CHUNK]
                encoded = tokenizer(chunk, truncation=True, max_length=max_lengths[is_query])
                types = encoded.get("token_type_ids")  # absent for most decoder tokenizers
                token_type_ids = token_type_ids or types is not None
                for i, text in enumerate(chunk):
                    if not all(encoded["attention_mask"][i]) or (types is not None and any(types[i])):
                        logger.info(
                            "Training texts are tokenized per batch: the tokenizer gives %r a mask or token "
                            "types other than a single sequence's",
                            text[:80],
                        )
                        return None
                    ids[is_query][text] = np.asarray(encoded["input_ids"][i], dtype=np.int32)
        logger.info(
            "Tokenized %d distinct training texts once, before training", sum(map(len, distinct.values()))
        )
        return cls(tokenizer, ids, token_type_ids)

    @classmethod
    def for_dataset(
        cls,
        tokenizer: PreTrainedTokenizerBase,
        dataset: object,
        text_columns: Sequence[str] | None,
        *,
        query_max_length: int,
        document_max_length: int,
    ) -> TokenCache | None:
        """:meth:`build` over a training dataset's texts (:func:`training_texts`); None where it has none."""
        texts = None if text_columns is None else training_texts(dataset, text_columns)
        if texts is None:
            return None
        return cls.build(tokenizer, texts, {True: query_max_length, False: document_max_length})

    def features(
        self, texts: Sequence[str], *, is_query: bool, length: int | None, multiple: int | None
    ) -> dict[str, Tensor] | None:
        """``texts``' features padded to ``length`` (None: the longest, rounded up to ``multiple``): input_ids,
        token_type_ids (where the tokenizer gives them) and attention_mask, each [B, S] int64; None when a text
        was not tokenized up front."""
        table = self._ids.get(is_query, {})
        try:
            rows = [table[text] for text in texts]
        except KeyError:
            return None
        lengths = np.fromiter((len(row) for row in rows), dtype=np.int64, count=len(rows))
        width = length if length is not None else int(lengths.max())
        if length is None and multiple is not None:
            width = -(-width // multiple) * multiple
        input_ids = np.full((len(rows), width), self._pad_id, dtype=np.int64)
        mask = np.zeros((len(rows), width), dtype=np.int64)
        for i, row in enumerate(rows):
            at = slice(width - len(row), width) if self._left else slice(0, len(row))
            input_ids[i, at] = row
            mask[i, at] = 1
        features = {"input_ids": torch.from_numpy(input_ids)}
        if self._token_type_ids:
            features["token_type_ids"] = torch.zeros_like(features["input_ids"])
        features["attention_mask"] = torch.from_numpy(mask)
        return features
