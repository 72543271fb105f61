"""BEIR folders: ``corpus.jsonl``, ``queries.jsonl`` and ``qrels/<split>.tsv``, read into memory.

``corpus.jsonl`` (``_id``, ``title``, ``text``), ``queries.jsonl`` (``_id``, ``text``) and
``qrels/<split>.tsv`` (query-id, corpus-id, score; an optional header line). Either jsonl file may be
gzip-compressed (``corpus.jsonl.gz``). :func:`read_corpus` is the one corpus reader (also behind
self-supervised training from a bare corpus); :func:`beir_training_pairs` turns a folder into
training pairs.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gradcache_sparton.data.columns import POSITIVE_COLUMN, QUERY_COLUMN
from gradcache_sparton.data.files import open_text

if TYPE_CHECKING:
    import datasets

__all__ = [
    "BeirData",
    "CorpusDocument",
    "beir_training_pairs",
    "iter_corpus",
    "load_beir",
    "read_corpus",
    "relevant_judgements",
]


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


def _find_jsonl(folder: Path, stem: str) -> Path:
    for name in (f"{stem}.jsonl", f"{stem}.jsonl.gz"):
        if (folder / name).is_file():
            return folder / name
    raise ValueError(f"BEIR folder {str(folder)!r} has no {stem}.jsonl (or {stem}.jsonl.gz)")


def _read_jsonl(path: Path, *, text_fields: Sequence[str]) -> Iterator[tuple[int, str, dict[str, Any]]]:
    """(line number, ``_id`` as str, record) of every non-blank line of a BEIR jsonl file.

    Every record needs an ``_id`` (a string or an integer) and a string ``text``; the other
    ``text_fields`` must be strings where present. Ids must be unique. Errors name the file and line.
    """
    first_line: dict[str, int] = {}
    with open_text(path) as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            where = f"{path}:{line_number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{where}: not valid JSON ({exc.msg})") from None
            if not isinstance(record, dict):
                raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
            missing = [key for key in ("_id", "text") if key not in record]
            if missing:
                raise ValueError(f"{where}: record has no field(s) {missing}")
            raw_id = record["_id"]
            if isinstance(raw_id, bool) or not isinstance(raw_id, (str, int)):
                raise ValueError(f"{where}: _id must be a string or an integer, got {raw_id!r}")
            for name in text_fields:
                if name in record and not isinstance(record[name], str):
                    raise ValueError(
                        f'{where}: {name!r} must be a string ("" when empty), got {record[name]!r:.40}'
                    )
            record_id = str(raw_id)
            if record_id in first_line:
                raise ValueError(
                    f"{where}: duplicate _id {record_id!r} (first at line {first_line[record_id]})"
                )
            first_line[record_id] = line_number
            yield line_number, record_id, record


def _folder(path: str | Path) -> Path:
    folder = Path(path)
    if not folder.is_dir():
        raise ValueError(f"path must be a BEIR folder, got {str(folder)!r} (not a directory)")
    return folder


def iter_corpus(path: str | Path) -> Iterator[CorpusDocument]:
    """The documents of a BEIR folder's ``corpus.jsonl`` (or ``corpus.jsonl.gz``), in file order, read one
    line at a time (memory: the ids seen so far, for the duplicate check), checked as in :func:`read_corpus`."""
    corpus_path = _find_jsonl(_folder(path), "corpus")
    for _, doc_id, record in _read_jsonl(corpus_path, text_fields=("title", "text")):
        yield CorpusDocument(doc_id, record.get("title", ""), record["text"])


def read_corpus(path: str | Path) -> list[CorpusDocument]:
    """The documents of a BEIR folder's ``corpus.jsonl`` (or ``corpus.jsonl.gz``), in file order.

    Raises ``ValueError`` naming the file and line for a malformed line, a missing ``_id``/``text``,
    a ``text`` or ``title`` that is not a string (null, a number), or a duplicate doc id, and for an
    empty corpus.
    """
    documents = list(iter_corpus(path))
    if not documents:
        raise ValueError(f"{_find_jsonl(_folder(path), 'corpus')} holds no documents")
    return documents


def _parses_as(text: str, kind: type[int] | type[float]) -> bool:
    """Whether ``kind(text)`` reads ``text`` (an integer or a number of a qrels line)."""
    try:
        kind(text)
    except ValueError:
        return False
    return True


def _read_qrels(
    qrels_path: Path, *, queries: Mapping[str, str], corpus: Mapping[str, str]
) -> dict[str, dict[str, int]]:
    """query id -> {doc id: relevance} of a tab-separated qrels file (query-id, corpus-id, score).

    The first line is a header when its score field is not a number (BEIR's ``query-id corpus-id
    score``); otherwise it is a judgement like every other line, so a graded score (``2.5``) on the
    first line is checked as a judgement, never dropped as a header.
    """
    qrels: dict[str, dict[str, int]] = {}
    first_line: dict[tuple[str, str], int] = {}
    with qrels_path.open("r", encoding="utf-8", newline="") as handle:
        rows = [(n, row) for n, row in enumerate(csv.reader(handle, delimiter="\t"), start=1) if row]
    if rows and len(rows[0][1]) == 3 and not _parses_as(rows[0][1][2], float):
        rows = rows[1:]  # the header: its score field names the column
    for line_number, row in rows:
        where = f"{qrels_path}:{line_number}"
        if len(row) != 3:
            raise ValueError(f"{where}: expected 3 tab-separated fields, got {row}")
        query_id, doc_id, score = row
        if not _parses_as(score, int):
            raise ValueError(
                f"{where}: score {score!r} is not an integer (relevance grades are integers: 0, 1, 2, ...)"
            )
        if query_id not in queries:
            raise ValueError(f"{where}: query id {query_id!r} is not in the folder's queries")
        if doc_id not in corpus:
            raise ValueError(f"{where}: doc id {doc_id!r} is not in the folder's corpus")
        if (query_id, doc_id) in first_line:
            raise ValueError(
                f"{where}: duplicate judgement of ({query_id!r}, {doc_id!r}) "
                f"(first at line {first_line[query_id, doc_id]})"
            )
        first_line[query_id, doc_id] = line_number
        qrels.setdefault(query_id, {})[doc_id] = int(score)
    if not qrels:
        raise ValueError(f"{qrels_path} holds no judgements")
    return qrels


def load_beir(path: str | Path, *, split: str) -> BeirData:
    """Load a BEIR-format folder: ``corpus.jsonl``, ``queries.jsonl`` and ``qrels/<split>.tsv``.

    The qrels file is tab-separated (query-id, corpus-id, score), with or without a header line (told
    apart by its content: a header's score field is not a number). Raises ``ValueError`` naming the
    file and line for a malformed line, a duplicate id or judgement, a text that is not a string, a
    qrels line naming a query or doc that is not in the folder, or an empty corpus or split.
    """
    folder = _folder(path)
    qrels_path = folder / "qrels" / f"{split}.tsv"
    if not qrels_path.is_file():
        found = sorted(p.stem for p in (folder / "qrels").glob("*.tsv"))
        raise ValueError(f"split={split!r}: no {qrels_path} (splits found: {found})")
    corpus = {doc.doc_id: doc.full_text for doc in read_corpus(folder)}
    all_queries = {
        query_id: record["text"]
        for _, query_id, record in _read_jsonl(_find_jsonl(folder, "queries"), text_fields=("text",))
    }
    qrels = _read_qrels(qrels_path, queries=all_queries, corpus=corpus)
    queries = {query_id: all_queries[query_id] for query_id in qrels}
    return BeirData(corpus=corpus, queries=queries, qrels=qrels)


def relevant_judgements(beir: BeirData) -> list[tuple[str, str]]:
    """(query id, document id) of every judgement with relevance > 0, in qrels order."""
    return [
        (query_id, doc_id)
        for query_id, judged in beir.qrels.items()
        for doc_id, relevance in judged.items()
        if relevance > 0
    ]


def beir_training_pairs(beir: BeirData) -> datasets.Dataset:
    """One (query, positive) row per judgement with relevance > 0, in qrels order.

    A query with several relevant docs gives several rows. Columns: ``query``, ``positive``.
    """
    import datasets

    rows = [
        {QUERY_COLUMN: beir.queries[query_id], POSITIVE_COLUMN: beir.corpus[doc_id]}
        for query_id, doc_id in relevant_judgements(beir)
    ]
    if not rows:
        raise ValueError("beir has no judgement with relevance > 0: no training pairs")
    return datasets.Dataset.from_list(rows)
