"""Retrieval through a seismic inverted index (``pip install pyseismic-lsr``, the ``seismic`` extra).

Legend: Q queries, N documents, K top-k.

:func:`retrieve_seismic` builds a ``seismic.SeismicIndex`` over the document reps (vocabulary ids as
components, :func:`build_seismic_index`) and searches it with the query reps (:func:`search_seismic`).
Its defaults make the index exact — no posting list is pruned (``n_postings`` = N), summaries keep
all their energy (``summary_energy=1``), every query term is used and ``heap_factor=1`` skips only
blocks whose bound is below the current k-th score — so it returns the documents
:func:`~gradcache_sparton.evaluation.retrieve` ranks above zero (seismic never returns a document with
no shared term). Its scores carry its half-precision value rounding (about 1e-3 relative), so two
documents whose scores are that close may swap places. Smaller ``n_postings``, ``summary_energy`` or
``heap_factor`` trade exactness for speed, as in seismic's guidelines.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from gradcache_sparton.evaluation.optional_imports import importable
from gradcache_sparton.primitives.sparse_reps import SparseReps

__all__ = [
    "MAX_SEISMIC_NONZEROS",
    "build_seismic_index",
    "retrieve_seismic",
    "search_seismic",
    "seismic_available",
]

# The most non-zeros per document rep (the mean over the corpus) an index is built for. Trained SPLADE
# reps hold 1-3% of the vocabulary (the shipped model: about 690 of 30,522 per passage); an untrained
# model's hold most of it (27,867 of 30,522 seen), whose build ran past 45 s on 1,583 documents with no end
# in sight (it grows about quadratically with the non-zeros), against 0.2 s for exhaustive search.
MAX_SEISMIC_NONZEROS = 4096

# The name of the document that :func:`_add_documents_one_by_one` adds first: every vocabulary id, in
# order, each with weight 0. Its score is 0 for every query; :func:`search_seismic` never returns it.
_VOCABULARY_DOCUMENT = "vocabulary"


def seismic_available() -> bool:
    """True when the ``seismic`` package (``pyseismic-lsr``) can be imported."""
    return importable("seismic")


def _seismic() -> Any:
    try:
        import seismic
    except ImportError:
        raise ImportError(
            "retrieval through seismic needs pyseismic-lsr: pip install 'gradcache_sparton[seismic]'"
        ) from None
    return seismic


def build_seismic_index(
    d_reps: SparseReps,
    *,
    n_postings: int | None = None,
    centroid_fraction: float = 0.1,
    summary_energy: float = 1.0,
    num_threads: int = 0,
) -> Any:
    """A ``seismic.SeismicIndex`` over the document reps; document i is named ``str(i)``.

    ``n_postings`` defaults to N (no posting list pruned); ``num_threads=0`` lets seismic choose.
    Search it with :func:`search_seismic`, as many times as needed.
    """
    seismic = _seismic()
    if d_reps.num_rows == 0:
        raise ValueError("d_reps has no rows")
    mean_nonzeros = d_reps.nonzeros_per_row().float().mean().item()
    if mean_nonzeros > MAX_SEISMIC_NONZEROS:
        raise ValueError(
            f"seismic: the document reps hold {mean_nonzeros:,.0f} non-zeros on average (at most "
            f"{MAX_SEISMIC_NONZEROS:,} here; trained SPLADE reps hold hundreds): an index of such dense reps "
            "(an untrained or unsparsified model) takes minutes to hours, growing about quadratically with "
            "the non-zeros. Use exhaustive retrieval (--retrieval exhaustive), or prune the documents "
            "first (a budget such as --budgets all:256)."
        )
    dataset = seismic.SeismicDataset()
    if hasattr(dataset, "add_documents_by_id"):  # pyseismic-lsr >= 0.5.4: all documents in one call
        dataset.add_documents_by_id(
            [str(i) for i in range(d_reps.num_rows)],
            d_reps.token_ids.to(torch.int64).numpy(),
            d_reps.weights.numpy().astype(np.float32),
            d_reps.offsets.numpy().astype(np.int64),
        )
    else:
        _add_documents_one_by_one(dataset, d_reps, string_type=seismic.get_seismic_string())
    with _stdout_to_stderr():  # seismic logs its build on the process's stdout, which is for results
        return seismic.SeismicIndex.build_from_dataset(
            dataset,
            n_postings=n_postings or d_reps.num_rows,
            centroid_fraction=centroid_fraction,
            summary_energy=summary_energy,
            max_fraction=1.0,
            num_threads=num_threads,
        )


@contextlib.contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """Point file descriptor 1 at stderr for the block: seismic's Rust code prints its progress there
    directly, around Python's ``sys.stdout``, so only the descriptor can be moved."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def _add_documents_one_by_one(dataset: Any, d_reps: SparseReps, *, string_type: Any) -> None:
    """Add the documents through ``add_document`` one at a time (pyseismic-lsr 0.5.2 and 0.5.3 have
    no batched call), the vocabulary ids as strings, as :func:`search_seismic` writes the queries'.

    A first document, :data:`_VOCABULARY_DOCUMENT`, names every vocabulary id in order with weight 0.
    ``add_document`` takes time in proportion to the dataset so far for each component it has not seen
    before (measured on the development CPU: 5 ms per 250-term document around the 15,000th when the
    ids arrive with the documents, 27 µs when they are all known), and seismic numbers components in
    order of first appearance, so the index is then the one the batched call builds, plus that
    document. A progress bar: a million documents take about half a minute.
    """
    offsets = d_reps.offsets.tolist()
    # One string per vocabulary id, looked up per document: seismic's strings are wide (U100, 400 bytes),
    # so converting all the postings at once would take 400 bytes per non-zero.
    names = np.arange(d_reps.vocab_size).astype(str).astype(string_type)  # [V]
    dataset.add_document(_VOCABULARY_DOCUMENT, names, np.zeros(d_reps.vocab_size, dtype=np.float32))
    token_ids = d_reps.token_ids.to(torch.int64).numpy()  # [nnz]
    weights = d_reps.weights.numpy().astype(np.float32)  # [nnz]
    for i in tqdm(range(d_reps.num_rows), desc="seismic: adding documents", unit="doc", mininterval=5.0):
        start, end = offsets[i], offsets[i + 1]
        dataset.add_document(str(i), names[token_ids[start:end]], weights[start:end])


def search_seismic(
    index: Any,
    q_reps: SparseReps,
    *,
    top_k: int = 100,
    heap_factor: float = 1.0,
    query_cut: int | None = None,
) -> list[list[tuple[int, float]]]:
    """Per query, up to ``top_k`` (doc index, score) by score descending, from an index of
    :func:`build_seismic_index`. ``query_cut`` defaults to the longest query rep (every term used)."""
    string_type = _seismic().get_seismic_string()
    if top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    offsets, token_ids, weights = q_reps.offsets.tolist(), q_reps.token_ids.numpy(), q_reps.weights.numpy()
    cut = query_cut or max(q_reps.nonzeros_per_row().tolist(), default=0)
    hits: list[list[tuple[int, float]]] = [[] for _ in range(q_reps.num_rows)]
    # One search per query: pyseismic-lsr 0.5.4's batch_search returned, now and then, wrong documents
    # for every query after the first of a batch (same index, same call, different answers).
    for i in range(q_reps.num_rows):
        start, end = offsets[i], offsets[i + 1]
        if start == end:  # a query with no term retrieves nothing
            continue
        found = index.search(
            str(i),
            token_ids[start:end].astype(str).astype(string_type),
            weights[start:end].astype(np.float32),
            k=min(top_k + 1, index.len),  # one more, in case the vocabulary document is among them
            query_cut=cut,
            heap_factor=heap_factor,
        )
        hits[i] = [
            (int(doc_id), float(score)) for _, score, doc_id in found if doc_id != _VOCABULARY_DOCUMENT
        ][:top_k]
    return hits


def retrieve_seismic(
    q_reps: SparseReps,
    d_reps: SparseReps,
    *,
    top_k: int = 100,
    n_postings: int | None = None,
    centroid_fraction: float = 0.1,
    summary_energy: float = 1.0,
    heap_factor: float = 1.0,
    query_cut: int | None = None,
    num_threads: int = 0,
) -> list[list[tuple[int, float]]]:
    """Per query, up to ``top_k`` (doc index, score) by score descending, from a seismic index:
    :func:`build_seismic_index` then :func:`search_seismic` (see the module docstring for exactness)."""
    _seismic()
    if top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    if q_reps.vocab_size != d_reps.vocab_size:
        raise ValueError(f"q_reps has V={q_reps.vocab_size} but d_reps has V={d_reps.vocab_size}")
    index = build_seismic_index(
        d_reps,
        n_postings=n_postings,
        centroid_fraction=centroid_fraction,
        summary_energy=summary_energy,
        num_threads=num_threads,
    )
    return search_seismic(index, q_reps, top_k=top_k, heap_factor=heap_factor, query_cut=query_cut)
