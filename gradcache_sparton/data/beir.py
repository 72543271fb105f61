"""BEIR folders: ``corpus.jsonl``, ``queries.jsonl`` and ``qrels/<split>.tsv``, read into memory.

``corpus.jsonl`` (``_id``, ``title``, ``text``), ``queries.jsonl`` (``_id``, ``text``) and
``qrels/<split>.tsv`` (query-id, corpus-id, score; one header line). Either jsonl file may be
gzip-compressed (``corpus.jsonl.gz``). :func:`read_corpus` is the one corpus reader (also behind
self-supervised training from a bare corpus); :func:`beir_training_pairs` turns a folder into
training pairs.
"""

from __future__ import annotations

import csv
import gzip
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gradcache_sparton.data.columns import POSITIVE_COLUMN, QUERY_COLUMN

if TYPE_CHECKING:
    import datasets

__all__ = ["BeirData", "CorpusDocument", "beir_training_pairs", "load_beir", "read_corpus"]


@dataclass(frozen=True)
class BeirData:
    """A BEIR dataset in memory, for one qrels split.

    - ``corpus``: doc id -> text, in file order (a doc's index in this order is its index in
      retrieval results and the tie-break key: equal scores rank the earlier doc first). The text is
      ``title + " " + text`` when the title is non-empty (the BEIR convention), else ``text``.
    - ``queries``: query id -> text, only the queries that appear in the split's qrels, in qrels order.
    - ``qrels``: query id -> {doc id: relevance}; relevance > 0 means relevant, larger is better
      (graded nDCG), 0 or less means judged non-relevant.
    """

    corpus: dict[str, str]
    queries: dict[str, str]
    qrels: dict[str, dict[str, int]]


@dataclass(frozen=True)
class CorpusDocument:
    """One row of a BEIR ``corpus.jsonl``: its id, title (``""`` when absent) and text."""

    doc_id: str
    title: str
    text: str

    @property
    def full_text(self) -> str:
        """``title + " " + text`` when the title is non-empty (the BEIR convention), else ``text``."""
        title = self.title.strip()
        return f"{title} {self.text}" if title else self.text


def _open_text(path: Path) -> Any:
    """Open a text file for reading, transparently gunzipping ``*.gz``."""
    if path.suffix == ".gz":
        return gzip.open(path, "rt", encoding="utf-8")
    return path.open("r", encoding="utf-8")


def _find_jsonl(folder: Path, stem: str) -> Path:
    for name in (f"{stem}.jsonl", f"{stem}.jsonl.gz"):
        if (folder / name).is_file():
            return folder / name
    raise ValueError(f"BEIR folder {str(folder)!r} has no {stem}.jsonl (or {stem}.jsonl.gz)")


def _read_jsonl(path: Path, required: Sequence[str]) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, record) of every non-blank line of a jsonl file."""
    with _open_text(path) as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{line_number}: not valid JSON ({exc.msg})") from None
            missing = [key for key in required if key not in record]
            if missing:
                raise ValueError(f"{path}:{line_number}: record has no field(s) {missing}")
            yield line_number, record


def _folder(path: str | Path) -> Path:
    folder = Path(path)
    if not folder.is_dir():
        raise ValueError(f"path must be a BEIR folder, got {str(folder)!r} (not a directory)")
    return folder


def read_corpus(path: str | Path) -> list[CorpusDocument]:
    """The documents of a BEIR folder's ``corpus.jsonl`` (or ``corpus.jsonl.gz``), in file order.

    Raises ``ValueError`` naming the file and line for a malformed line, a missing ``_id``/``text``
    or a duplicate doc id, and for an empty corpus.
    """
    corpus_path = _find_jsonl(_folder(path), "corpus")
    documents: list[CorpusDocument] = []
    seen: set[str] = set()
    for line_number, record in _read_jsonl(corpus_path, ("_id", "text")):
        doc_id = str(record["_id"])
        if doc_id in seen:
            raise ValueError(f"{corpus_path}:{line_number}: duplicate doc id {doc_id!r}")
        seen.add(doc_id)
        documents.append(CorpusDocument(doc_id, record.get("title") or "", record["text"]))
    if not documents:
        raise ValueError(f"{corpus_path} holds no documents")
    return documents


def load_beir(path: str | Path, *, split: str) -> BeirData:
    """Load a BEIR-format folder: ``corpus.jsonl``, ``queries.jsonl`` and ``qrels/<split>.tsv``.

    The qrels file is tab-separated (query-id, corpus-id, score) with one header line. Raises
    ``ValueError`` naming the file and line for a malformed line, a duplicate id, a qrels line naming
    a query or doc that is not in the folder, or an empty corpus or split.
    """
    folder = _folder(path)
    qrels_path = folder / "qrels" / f"{split}.tsv"
    if not qrels_path.is_file():
        found = sorted(p.stem for p in (folder / "qrels").glob("*.tsv"))
        raise ValueError(f"split={split!r}: no {qrels_path} (splits found: {found})")

    corpus = {doc.doc_id: doc.full_text for doc in read_corpus(folder)}
    corpus_path = _find_jsonl(folder, "corpus")

    queries_path = _find_jsonl(folder, "queries")
    all_queries: dict[str, str] = {}
    for _, record in _read_jsonl(queries_path, ("_id", "text")):
        all_queries[str(record["_id"])] = record["text"]

    qrels: dict[str, dict[str, int]] = {}
    with qrels_path.open("r", encoding="utf-8", newline="") as handle:
        rows = csv.reader(handle, delimiter="\t")
        # The BEIR header ("query-id corpus-id score") is the first line; skip it.
        next(rows, None)
        for line_number, row in enumerate(rows, start=2):
            if not row:
                continue
            if len(row) != 3:
                raise ValueError(f"{qrels_path}:{line_number}: expected 3 tab-separated fields, got {row}")
            query_id, doc_id, score = row
            try:
                relevance = int(score)
            except ValueError:
                raise ValueError(f"{qrels_path}:{line_number}: score {score!r} is not an integer") from None
            if query_id not in all_queries:
                raise ValueError(
                    f"{qrels_path}:{line_number}: query id {query_id!r} is not in {queries_path}"
                )
            if doc_id not in corpus:
                raise ValueError(f"{qrels_path}:{line_number}: doc id {doc_id!r} is not in {corpus_path}")
            qrels.setdefault(query_id, {})[doc_id] = relevance
    if not qrels:
        raise ValueError(f"{qrels_path} holds no judgements")
    queries = {query_id: all_queries[query_id] for query_id in qrels}
    return BeirData(corpus=corpus, queries=queries, qrels=qrels)


def beir_training_pairs(beir: BeirData) -> datasets.Dataset:
    """One (query, positive) row per judgement with relevance > 0, in qrels order.

    A query with several relevant docs gives several rows. Columns: ``query``, ``positive``.
    """
    import datasets

    rows = [
        {QUERY_COLUMN: beir.queries[query_id], POSITIVE_COLUMN: beir.corpus[doc_id]}
        for query_id, judged in beir.qrels.items()
        for doc_id, relevance in judged.items()
        if relevance > 0
    ]
    if not rows:
        raise ValueError("beir has no judgement with relevance > 0: no training pairs")
    return datasets.Dataset.from_list(rows)
