"""Self-supervised (query, positive) pairs from a bare corpus: one sentence as the query, the rest as the positive."""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING

from gradcache_sparton.data.columns import POSITIVE_COLUMN, QUERY_COLUMN

if TYPE_CHECKING:
    import datasets

__all__ = ["self_supervised_pairs", "split_sentences"]

# A sentence ends at '.', '!' or '?' (optionally followed by closing quotes/brackets) followed by
# whitespace and then an upper-case letter, a digit or an opening quote/bracket. Deliberately simple
# and deterministic: "e.g. the" does not split (lower case follows), "Fig. 2" does.
_SENTENCE_END = re.compile(r"(?<=[.!?])[\"')\]]*\s+(?=[\"'(\[A-Z0-9])")


def split_sentences(text: str) -> list[str]:
    """Split ``text`` into sentences with one regular expression (no model, fully deterministic).

    A boundary is sentence-ending punctuation (``.``, ``!``, ``?``, optionally followed by closing
    quotes or brackets), then whitespace, then an upper-case letter, a digit or an opening
    quote/bracket. Surrounding whitespace is stripped and empty pieces are dropped.
    """
    pieces: list[str] = []
    start = 0
    for match in _SENTENCE_END.finditer(text):
        pieces.append(text[start : match.end()])
        start = match.end()
    pieces.append(text[start:])
    return [piece.strip() for piece in pieces if piece.strip()]


def self_supervised_pairs(
    texts: Sequence[str],
    *,
    titles: Sequence[str] | None = None,
    pairs_per_document: int = 1,
    min_words: int = 5,
    max_words: int = 48,
    seed: int = 0,
) -> datasets.Dataset:
    """(query, positive) pairs from a bare corpus: a sentence of a document as the query, the rest as
    the positive.

    Rule, per document in order: split the text with :func:`split_sentences`; a sentence is eligible
    as a query if it has between ``min_words`` and ``max_words`` whitespace-separated words
    (inclusive) and the document has at least one other sentence. Up to ``pairs_per_document``
    eligible sentences are drawn without replacement with ``random.Random(seed)`` (one generator
    for the whole call, so the output is a function of the inputs and the seed). The positive is the
    document without the chosen sentence (the other sentences joined by single spaces), prefixed by
    ``title + " "`` when a non-empty title is given. Documents with no eligible sentence give no pair.

    Returns a ``datasets.Dataset`` with columns ``query``, ``positive``.
    """
    import datasets

    if isinstance(texts, str) or not isinstance(texts, Sequence):
        raise TypeError(f"texts must be a sequence of str, got {type(texts).__name__}")
    if titles is not None and len(titles) != len(texts):
        raise ValueError(f"titles must have one entry per text ({len(texts)}), got {len(titles)}")
    if pairs_per_document < 1:
        raise ValueError(f"pairs_per_document must be >= 1, got {pairs_per_document}")
    if not 1 <= min_words <= max_words:
        raise ValueError(
            f"need 1 <= min_words <= max_words, got min_words={min_words}, max_words={max_words}"
        )

    rng = random.Random(seed)
    rows: list[dict[str, str]] = []
    for index, text in enumerate(texts):
        if not isinstance(text, str):
            raise TypeError(f"texts[{index}] must be str, got {type(text).__name__}")
        sentences = split_sentences(text)
        if len(sentences) < 2:
            continue
        eligible = [i for i, s in enumerate(sentences) if min_words <= len(s.split()) <= max_words]
        if not eligible:
            continue
        title = titles[index].strip() if titles is not None and titles[index] else ""
        for chosen in rng.sample(eligible, min(pairs_per_document, len(eligible))):
            rest = " ".join(s for i, s in enumerate(sentences) if i != chosen)
            rows.append(
                {QUERY_COLUMN: sentences[chosen], POSITIVE_COLUMN: f"{title} {rest}" if title else rest}
            )
    if not rows:
        raise ValueError(
            f"no document of the {len(texts)} gave a pair: each needs >= 2 sentences, one with "
            f"{min_words}..{max_words} words"
        )
    return datasets.Dataset.from_list(rows)
