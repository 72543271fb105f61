"""Retrieval through a seismic inverted index (``pip install pyseismic-lsr``, the ``seismic`` extra).

Legend: Q queries, N documents, K top-k.

:func:`retrieve_seismic` builds a ``seismic.SeismicIndex`` over the document reps (vocabulary ids as
components) and searches it with the query reps. Its defaults make the index exact — no posting list
is pruned (``n_postings`` = N), summaries keep all their energy (``summary_energy=1``), every query
term is used and ``heap_factor=1`` skips only blocks whose bound is below the current k-th score — so
the ranking equals :func:`~gradcache_sparton.evaluation.retrieve` on documents that share a term
with the query (seismic never returns a document with no shared term; its scores carry its own
rounding, about 1e-3 relative). Smaller ``n_postings``, ``summary_energy`` or ``heap_factor`` trade
exactness for speed, as in seismic's guidelines.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from gradcache_sparton.evaluation.sparse_reps import SparseReps

__all__ = ["retrieve_seismic", "seismic_available"]


def seismic_available() -> bool:
    """True when the ``seismic`` package (``pyseismic-lsr``) can be imported."""
    try:
        import seismic  # noqa: F401
    except ImportError:
        return False
    return True


def _seismic() -> Any:
    try:
        import seismic
    except ImportError:
        raise ImportError(
            "retrieval through seismic needs pyseismic-lsr: pip install 'gradcache_sparton[seismic]'"
        ) from None
    return seismic


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
    """Per query, up to ``top_k`` (doc index, score) by score descending, from a seismic index.

    ``n_postings`` defaults to N, ``query_cut`` to the longest query rep (see the module docstring
    for exactness). ``num_threads=0`` lets seismic choose.
    """
    seismic = _seismic()
    if top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    if q_reps.vocab_size != d_reps.vocab_size:
        raise ValueError(f"q_reps has V={q_reps.vocab_size} but d_reps has V={d_reps.vocab_size}")
    num_docs = d_reps.num_rows
    dataset = seismic.SeismicDataset()
    dataset.add_documents_by_id(
        [str(i) for i in range(num_docs)],
        d_reps.token_ids.to(torch.int64).numpy(),
        d_reps.weights.numpy().astype(np.float32),
        d_reps.offsets.numpy().astype(np.int64),
    )
    index = seismic.SeismicIndex.build_from_dataset(
        dataset,
        n_postings=n_postings or num_docs,
        centroid_fraction=centroid_fraction,
        summary_energy=summary_energy,
        max_fraction=1.0,
        num_threads=num_threads,
    )
    string_type = seismic.get_seismic_string()
    offsets, token_ids, weights = q_reps.offsets.tolist(), q_reps.token_ids.numpy(), q_reps.weights.numpy()
    # A query with no term retrieves nothing; seismic is asked only about the others.
    asked = [i for i in range(q_reps.num_rows) if offsets[i + 1] > offsets[i]]
    hits: list[list[tuple[int, float]]] = [[] for _ in range(q_reps.num_rows)]
    if not asked:
        return hits
    results = index.batch_search(
        np.array([str(i) for i in asked], dtype=string_type),
        [token_ids[offsets[i] : offsets[i + 1]].astype(str).astype(string_type) for i in asked],
        [weights[offsets[i] : offsets[i + 1]].astype(np.float32) for i in asked],
        k=min(top_k, num_docs),
        query_cut=query_cut or int(q_reps.nonzeros_per_row().max()),
        heap_factor=heap_factor,
        num_threads=num_threads,
    )
    for i, found in zip(asked, results, strict=True):
        hits[i] = [(int(doc_id), float(score)) for _, score, doc_id in found]
    return hits
