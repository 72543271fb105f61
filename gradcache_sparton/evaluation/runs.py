"""Retrieval runs (query id -> ranked (doc id, score) list) and TREC run files.

A TREC run file has one line per retrieved document: ``query_id Q0 doc_id rank score tag`` (rank
from 1). Ranks follow the evaluator's order (equal scores: the earlier corpus doc first); a tool that
re-sorts by score may order equal scores differently.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

__all__ = ["Run", "check_trec_ids", "write_trec_run"]

# query id -> [(doc id, score)], best first.
Run = dict[str, list[tuple[str, float]]]


def check_trec_ids(ids: Iterable[str], *, name: str) -> None:
    """``ValueError`` naming ``name`` if an id is empty or holds whitespace (a TREC run is space-separated)."""
    bad = next((i for i in ids if not i or any(c.isspace() for c in i)), None)
    if bad is not None:
        raise ValueError(f"{name} id {bad!r} is empty or holds whitespace: it cannot go into a TREC run file")


def write_trec_run(path: str | Path, run: Mapping[str, Sequence[tuple[str, float]]], *, tag: str) -> Path:
    """Write ``run`` as a TREC run file at ``path`` (its folder must exist); returns the path."""
    if not tag or any(c.isspace() for c in tag):
        raise ValueError(f"tag must be a non-empty string without whitespace, got {tag!r}")
    check_trec_ids(run, name="query")
    check_trec_ids((doc_id for hits in run.values() for doc_id, _ in hits), name="doc")
    path = Path(path)
    with path.open("w", encoding="utf-8") as handle:
        for query_id, hits in run.items():
            for rank, (doc_id, score) in enumerate(hits, start=1):
                handle.write(f"{query_id} Q0 {doc_id} {rank} {score:.8g} {tag}\n")
    return path
