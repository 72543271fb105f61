"""Real SciFact text for the benchmarks: query/abstract pairs, token ids, sparse reps and teacher rows.

Legend: B rows drawn, S tokens, V vocabulary, nnz non-zeros.

Queries are the claims (each paired with an abstract its qrels judge relevant, every split of the folder)
and the sentences of every abstract (each paired with its own abstract); documents are the abstracts
(``title + " " + text``). Batches are drawn from them with replacement, so any B can be built from the
5,183 abstracts and ~50,000 queries of SciFact; the draws' distinct-row counts say how much repeats.
The teacher benchmarks' rows are queries each with its positive and random abstracts (``teacher_rows``;
``training_rows`` as a training file's columns).
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from gradcache_sparton.data.beir import load_beir
from gradcache_sparton.data.shipped import beir_folder
from gradcache_sparton.primitives.sparse_reps import SparseReps

__all__ = [
    "TextPairs",
    "draw_rows",
    "encode_sparse",
    "read_pairs",
    "teacher_rows",
    "tokenize",
    "training_rows",
]

# A sentence ends at . ! or ? followed by space and a capital, digit or bracket (abbreviations rarely do).
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z0-9(\[])")


@dataclass(frozen=True)
class TextPairs:
    """Query texts, document texts and each query's positive (an index into ``documents``)."""

    queries: list[str]
    documents: list[str]
    positive: list[int]


def read_pairs(beir_dir: str | Path) -> TextPairs:
    """The pairs of a BEIR folder (``"default"``: the shipped SciFact dev sample): claims with a relevant
    abstract (every ``qrels/*.tsv`` split), then every abstract sentence of at least 4 words with its abstract."""
    folder = Path(beir_folder(beir_dir))
    splits = sorted(path.stem for path in (folder / "qrels").glob("*.tsv"))
    data = [load_beir(folder, split=split) for split in splits]
    doc_ids = list(data[0].corpus)
    documents = [data[0].corpus[doc_id] for doc_id in doc_ids]
    index = {doc_id: i for i, doc_id in enumerate(doc_ids)}
    queries, positive = [], []
    for split in data:
        for query_id, judged in split.qrels.items():
            relevant = [doc_id for doc_id, relevance in judged.items() if relevance > 0]
            if relevant:
                queries.append(split.queries[query_id])
                positive.append(index[relevant[0]])
    for i, text in enumerate(documents):
        for sentence in _SENTENCE_END.split(text):
            if len(sentence.split()) >= 4:
                queries.append(sentence)
                positive.append(i)
    return TextPairs(queries, documents, positive)


def teacher_rows(beir_dir: str | Path, rows: int, negatives: int) -> tuple[list[str], list[list[str]]]:
    """``rows`` SciFact queries (seeded draw, repeated when fewer) and each one's candidates: its positive, then
    ``negatives`` abstracts drawn at random."""
    pairs = read_pairs(beir_dir)
    rng = random.Random(0)
    order = rng.sample(range(len(pairs.queries)), min(rows, len(pairs.queries)))
    while len(order) < rows:  # fewer queries than rows: repeat them (each row is scored independently)
        order += order[: rows - len(order)]
    queries = [pairs.queries[i] for i in order]
    candidates = []
    for i in order:
        others = [d for d in rng.sample(range(len(pairs.documents)), negatives + 1) if d != pairs.positive[i]]
        candidates.append([pairs.documents[j] for j in [pairs.positive[i], *others[:negatives]]])
    return queries, candidates


def training_rows(beir_dir: str | Path, rows: int, negatives: int) -> list[dict[str, str]]:
    """The rows of :func:`teacher_rows` as training data: ``{"query", "positive", "negative_1", ...,
    "negative_k"}`` texts, the columns a training file (and an in-batch teacher) reads."""
    queries, candidates = teacher_rows(beir_dir, rows, negatives)
    columns = ["positive", *(f"negative_{j + 1}" for j in range(negatives))]
    return [
        {"query": query, **dict(zip(columns, texts, strict=True))}
        for query, texts in zip(queries, candidates, strict=True)
    ]


def tokenize(texts: list[str], tokenizer, max_length: int, device: torch.device) -> dict[str, Tensor]:
    """[n, S] ``input_ids`` and ``attention_mask`` of ``texts``, truncated to ``max_length``, padded to the longest."""
    features = tokenizer(texts, padding=True, truncation=True, max_length=max_length, return_tensors="pt")
    return {name: features[name].to(device) for name in ("input_ids", "attention_mask")}


@torch.no_grad()
def encode_sparse(encoder, features: dict[str, Tensor], batch: int) -> SparseReps:
    """The encoder's reps of every row of ``features`` ([n, S]), ``batch`` rows at a time, as sparse reps
    (fp32 weights; bf16 values under bf16 autocast on a GPU, as the engine's Step (1) makes them)."""
    device = features["input_ids"].device
    parts = []
    for start in range(0, features["input_ids"].shape[0], batch):
        chunk = {name: value[start : start + batch] for name, value in features.items()}
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda"):
            reps = encoder(**chunk)  # [b, V]
        parts.append(SparseReps.from_dense(reps.float()))
    return SparseReps.concat(parts)


def draw_rows(reps: SparseReps, rows: Tensor) -> SparseReps:
    """Rows ``rows`` ([B] int64, repeats allowed) of ``reps``, in that order: a new CSR of their entries."""
    rows = rows.to(reps.offsets.device)
    counts = reps.nonzeros_per_row()[rows]  # [B]
    offsets = torch.zeros(rows.numel() + 1, dtype=torch.int64, device=rows.device)
    offsets[1:] = torch.cumsum(counts, 0)
    total = int(offsets[-1])
    # entry k of new row i is old entry reps.offsets[rows[i]] + (k - offsets[i])
    shift = torch.repeat_interleave(reps.offsets[rows] - offsets[:-1], counts, output_size=total)  # [nnz]
    entries = torch.arange(total, device=rows.device) + shift
    return SparseReps(offsets, reps.token_ids[entries], reps.weights[entries], reps.vocab_size)
