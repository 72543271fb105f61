"""Build the shipped SciFact sample (``gradcache_sparton/resources/scifact_sample/``) from BEIR SciFact.

    python scripts/build_scifact_sample.py [--source ../shared/data/scifact] [--output DIR]

Deterministic: the same source files give byte-identical output (one seeded ``random.Random``,
gzip with mtime 0 and no file name). What it writes:

- ``dev/``: a small BEIR folder. ``NUM_DEV_QUERIES`` labelled training claims are held out as dev
  queries (``queries.jsonl``, ``qrels/dev.tsv``); its ``corpus.jsonl.gz`` holds every abstract
  relevant to them plus ``NUM_DISTRACTORS`` other abstracts drawn at random, in source order.
- ``train.jsonl.gz``: (query, positive) rows, shuffled:
  * every (claim, relevant abstract) judgement of the other labelled claims, the abstract as
    ``title + " " + text`` (the BEIR convention), except those whose abstract is relevant to a dev
    claim (SciFact has several claims per abstract: keeping them would let training see dev answers);
  * self-supervised pairs (:func:`gradcache_sparton.data.self_supervised_pairs`, one per abstract)
    from ``NUM_SELF_SUPERVISED_DOCS`` abstracts drawn from those *not* relevant to a dev claim.
  No abstract relevant to a dev claim appears anywhere in the training rows.
- ``manifest.json``: seed, counts and the SHA-256 of the source files.

SciFact (Wadden et al. 2020, AllenAI) is CC BY-NC 2.0: see ``gradcache_sparton/resources/NOTICE.md``.
"""

from __future__ import annotations

import argparse
import csv
import gzip
import hashlib
import json
import random
from collections.abc import Iterable
from pathlib import Path

from gradcache_sparton.data import POSITIVE_COLUMN, QUERY_COLUMN, self_supervised_pairs

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_SOURCE = ROOT.parent / "shared" / "data" / "scifact"
DEFAULT_OUTPUT = ROOT / "gradcache_sparton" / "resources" / "scifact_sample"

SEED = 0
# 100 of the 809 labelled claims: enough for nDCG@10 differences of a few points to be visible,
# while leaving ~700 labelled claims for training.
NUM_DEV_QUERIES = 100
# Distractors make retrieval non-trivial (about 10 per relevant doc) while the gzip'd corpus
# stays well under 1 MB.
NUM_DISTRACTORS = 1000
# With the ~800 labelled pairs this gives a few thousand rows (~2 MB gzip'd).
NUM_SELF_SUPERVISED_DOCS = 2500


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _read_jsonl(path: Path) -> list[dict]:
    with path.open(encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def _write_bytes(path: Path, data: bytes, *, compress: bool) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as handle:
        if compress:
            # mtime=0 and an empty file name keep the gzip header (and so the file) reproducible.
            with gzip.GzipFile(filename="", mode="wb", fileobj=handle, mtime=0, compresslevel=9) as gz:
                gz.write(data)
        else:
            handle.write(data)


def _jsonl(records: Iterable[dict]) -> bytes:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode("utf-8")


def _doc_text(doc: dict) -> str:
    title = doc.get("title", "").strip()
    return f"{title} {doc['text']}" if title else doc["text"]


def build(source: Path, output: Path) -> dict:
    """Write the sample from the BEIR SciFact folder ``source`` into ``output``; return the manifest."""
    corpus = _read_jsonl(source / "corpus.jsonl")
    queries = _read_jsonl(source / "queries.jsonl")
    docs_by_id = {doc["_id"]: doc for doc in corpus}
    queries_by_id = {query["_id"]: query for query in queries}
    with (source / "qrels" / "train.tsv").open(encoding="utf-8", newline="") as handle:
        rows = list(csv.reader(handle, delimiter="\t"))[1:]  # skip the header line
    qrels: dict[str, dict[str, int]] = {}
    for query_id, doc_id, score in rows:
        qrels.setdefault(query_id, {})[doc_id] = int(score)

    rng = random.Random(SEED)
    labelled = [q for q in qrels if any(r > 0 for r in qrels[q].values())]  # qrels order
    dev_set = set(rng.sample(labelled, NUM_DEV_QUERIES))
    dev_queries = [q for q in labelled if q in dev_set]
    dev_relevant = {d for q in dev_queries for d, r in qrels[q].items() if r > 0}
    others = [doc["_id"] for doc in corpus if doc["_id"] not in dev_relevant]
    distractors = set(rng.sample(others, NUM_DISTRACTORS))
    dev_corpus = [doc for doc in corpus if doc["_id"] in dev_relevant or doc["_id"] in distractors]

    dev = output / "dev"
    _write_bytes(dev / "corpus.jsonl.gz", _jsonl(dev_corpus), compress=True)
    _write_bytes(dev / "queries.jsonl", _jsonl(queries_by_id[q] for q in dev_queries), compress=False)
    qrels_lines = ["query-id\tcorpus-id\tscore\n"] + [
        f"{q}\t{d}\t{r}\n" for q in dev_queries for d, r in qrels[q].items()
    ]
    _write_bytes(dev / "qrels" / "dev.tsv", "".join(qrels_lines).encode("utf-8"), compress=False)

    labelled_pairs = [
        (q, d)
        for q in labelled
        if q not in dev_set
        for d, r in qrels[q].items()
        if r > 0 and d not in dev_relevant
    ]
    train_rows = [
        {QUERY_COLUMN: queries_by_id[q]["text"], POSITIVE_COLUMN: _doc_text(docs_by_id[d])}
        for q, d in labelled_pairs
    ]
    ss_ids = rng.sample(others, NUM_SELF_SUPERVISED_DOCS)
    position = {doc["_id"]: i for i, doc in enumerate(corpus)}
    ss_ids.sort(key=position.__getitem__)  # source order, independent of the sampling order
    pairs = self_supervised_pairs(
        [docs_by_id[d]["text"] for d in ss_ids], titles=[docs_by_id[d]["title"] for d in ss_ids], seed=SEED
    )
    train_rows.extend(pairs.to_list())
    rng.shuffle(train_rows)
    _write_bytes(output / "train.jsonl.gz", _jsonl(train_rows), compress=True)

    manifest = {
        "source": "BEIR SciFact (train side): corpus.jsonl, queries.jsonl, qrels/train.tsv",
        "source_sha256": {
            name: _sha256(source / name) for name in ("corpus.jsonl", "queries.jsonl", "qrels/train.tsv")
        },
        "seed": SEED,
        "dev_queries": len(dev_queries),
        "dev_qrels": len(qrels_lines) - 1,
        "dev_relevant_docs": len(dev_relevant),
        "dev_corpus_docs": len(dev_corpus),
        "train_labelled_pairs": len(labelled_pairs),
        "train_labelled_claims": len({q for q, _ in labelled_pairs}),
        "train_self_supervised_pairs": len(pairs),
        "train_rows": len(train_rows),
    }
    _write_bytes(output / "manifest.json", (json.dumps(manifest, indent=2) + "\n").encode(), compress=False)
    return manifest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", type=Path, default=DEFAULT_SOURCE, help="BEIR SciFact folder")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="where to write the sample")
    args = parser.parse_args()
    print(json.dumps(build(args.source, args.output), indent=2))


if __name__ == "__main__":
    main()
