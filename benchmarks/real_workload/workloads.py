"""Workloads of real text: the shipped SciFact sample's triplets, MS MARCO-like short passages, and each
workload's step batches tokenized once."""

from __future__ import annotations

import gzip
import json
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor
from transformers import PreTrainedTokenizerBase

from gradcache_sparton.resources import RESOURCES_DIR

__all__ = [
    "COLUMNS",
    "FULL",
    "SCIFACT_TRAIN",
    "SMOKE",
    "Scale",
    "Workload",
    "build_workload",
    "passage_window",
    "read_scifact_pairs",
    "scifact_triplets",
    "short_triplets",
    "take_rows",
    "tokenize_rows",
]

COLUMNS = ("query", "positive", "negative_1")
SCIFACT_TRAIN = RESOURCES_DIR / "scifact_sample" / "train.jsonl.gz"
SHORT_PASSAGE_TOKENS = (40, 120)


@dataclass(frozen=True)
class Scale:
    """Every size the benchmark uses; ``FULL`` is issue 15's, ``SMOKE`` a CPU-sized stand-in."""

    query_max_len: int
    doc_max_len: int
    short_tokens: tuple[int, int]
    base_hidden: int
    base_layers: int
    base_heads: int
    base_ffn: int
    calibration_rows: int


FULL = Scale(64, 256, SHORT_PASSAGE_TOKENS, 768, 6, 12, 3072, 32)
SMOKE = Scale(16, 32, (8, 24), 32, 2, 2, 64, 4)


def read_scifact_pairs(path: Path = SCIFACT_TRAIN) -> list[tuple[str, str]]:
    """(query, positive) pairs of the shipped SciFact sample, in file order."""
    with gzip.open(path, "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [(row["query"], row["positive"]) for row in rows]


def scifact_triplets(pairs: Sequence[tuple[str, str]], seed: int) -> list[dict[str, str]]:
    """query -> positive, negative_1 = the positive of another row (a fixed permutation, never its own)."""
    order = list(range(len(pairs)))
    random.Random(seed).shuffle(order)
    triplets = []
    for i, (query, positive) in enumerate(pairs):
        j = order[i]
        while pairs[j][1] == positive:  # rows sharing an abstract: take the next one
            j = (j + 1) % len(pairs)
        triplets.append({"query": query, "positive": positive, "negative_1": pairs[j][1]})
    return triplets


_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z0-9(\[])")


def passage_window(text: str, length: int, tokenizer: PreTrainedTokenizerBase, rng: random.Random) -> str:
    """About ``length`` wordpieces of ``text``, starting at a sentence start chosen by ``rng``."""
    sentences = _SENTENCE_END.split(text)
    starts = list(range(len(sentences)))
    rng.shuffle(starts)
    for start in starts:  # the first start that leaves enough text, else the whole text
        ids = tokenizer(" ".join(sentences[start:]), add_special_tokens=False)["input_ids"]
        if len(ids) >= length:
            return tokenizer.decode(ids[:length])
    return text


def short_triplets(
    triplets: Sequence[dict[str, str]],
    tokenizer: PreTrainedTokenizerBase,
    lengths: tuple[int, int],
    seed: int,
) -> list[dict[str, str]]:
    """MS MARCO-like rows: each passage a window of uniform-random length in ``lengths`` tokens."""
    rng = random.Random(seed)
    return [
        {
            "query": row["query"],
            **{c: passage_window(row[c], rng.randint(*lengths), tokenizer, rng) for c in COLUMNS[1:]},
        }
        for row in triplets
    ]


@dataclass
class Workload:
    """The step batches of one workload (tokenized once, kept on the device) and their mean lengths."""

    name: str
    batches: list[dict[str, dict[str, Tensor]]]
    mean_doc_tokens: float
    mean_query_tokens: float


def tokenize_rows(
    rows: Sequence[dict[str, str]], tokenizer: PreTrainedTokenizerBase, scale: Scale, device: torch.device
) -> dict[str, dict[str, Tensor]]:
    """One step's columns: [B, S_column] features, padded to each column's longest row."""
    columns = {}
    for column in COLUMNS:
        max_length = scale.query_max_len if column == "query" else scale.doc_max_len
        features = tokenizer(
            [row[column] for row in rows],
            padding=True,
            truncation=True,
            max_length=max_length,
            return_tensors="pt",
        )
        columns[column] = {name: value.to(device) for name, value in features.items()}
    return columns


def take_rows(columns: dict[str, dict[str, Tensor]], n: int) -> dict[str, dict[str, Tensor]]:
    """The first ``n`` rows of every column, cut to their own longest row (as a collator pads them)."""
    out = {}
    for column, features in columns.items():
        if features["input_ids"].shape[0] <= n:
            out[column] = features
            continue
        keep = int(features["attention_mask"][:n].sum(dim=1).max())  # right padding: lengths are counts
        out[column] = {name: value[:n, :keep] for name, value in features.items()}
    return out


def build_workload(
    name: str,
    rows: list[dict[str, str]],
    tokenizer: PreTrainedTokenizerBase,
    scale: Scale,
    batch: int,
    n_batches: int,
    device: torch.device,
) -> Workload:
    """``n_batches`` consecutive batches of ``batch`` rows (wrapping around ``rows``)."""
    batches = []
    for i in range(n_batches):
        chosen = [rows[(i * batch + k) % len(rows)] for k in range(batch)]
        batches.append(tokenize_rows(chosen, tokenizer, scale, device))

    def mean_tokens(columns: Sequence[str]) -> float:
        counts = [b[c]["attention_mask"].sum(dim=1).float() for b in batches for c in columns]
        return float(torch.cat(counts).mean())

    return Workload(name, batches, mean_tokens(COLUMNS[1:]), mean_tokens(COLUMNS[:1]))
