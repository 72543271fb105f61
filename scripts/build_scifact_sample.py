"""Build the shipped SciFact sample (``gradcache_sparton/resources/scifact_sample/``) from BEIR SciFact.

    python scripts/build_scifact_sample.py [--source ../shared/data/scifact] [--output DIR] \
        [--pool_rankings rankings.json]

Deterministic: the same source files give byte-identical output (one seeded ``random.Random``,
gzip with mtime 0 and no file name; the pool below is a function of the source and the shipped model,
encoded in fp32 on the CPU). Needs bm25s (the ``mining`` extra). What it writes:

- ``dev/``: a small BEIR folder. ``NUM_DEV_QUERIES`` labelled training claims are held out as dev
  queries (``queries.jsonl``, ``qrels/dev.tsv``); its ``corpus.jsonl.gz`` is a *pooled* sample of the
  full corpus, in source order: every abstract relevant to a dev claim plus, for every dev claim, the
  top ``POOL_DEPTHS`` abstracts of the full 5,183-abstract corpus under the shipped SPLADE-tiny (20; 32 /
  128 tokens) and under BM25 (3; bm25s, the mining's). The documents that outrank a relevant one in the full
  corpus are the ones that matter to nDCG@10, and pooling keeps them: nDCG@10 on the sample tracks the
  full corpus (docs/experiments.md shows how closely), where 1,000 random distractors (the earlier
  sample) made every model look 0.14 nDCG@10 better than on the full corpus. Ranking the full corpus with the
  model takes a few CPU minutes; ``--pool_rankings FILE`` (default ``scripts/scifact_sample_pool.json``,
  committed) holds those rankings: read if the file exists, computed and written if not.
- ``train.jsonl.gz``: (query, positive) rows, shuffled:
  * every (claim, relevant abstract) judgement of the other labelled claims, the abstract as
    ``title + " " + text`` (the BEIR convention), except those whose abstract is relevant to a dev
    claim (SciFact has several claims per abstract: keeping them would let training see dev answers),
    and one row per repeated (claim text, abstract) pair (a few claims recur under other ids);
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
# The pooling rankings of the shipped sample (top 20 of each ranker per dev claim), kept so that a rebuild
# takes seconds; delete it (or give another --pool_rankings path) to rank the full corpus again.
DEFAULT_POOL_RANKINGS = Path(__file__).resolve().parent / "scifact_sample_pool.json"

SEED = 0
# 100 of the 809 labelled claims: enough for nDCG@10 differences of a few points to be visible,
# while leaving ~700 labelled claims for training.
NUM_DEV_QUERIES = 100
# Abstracts pooled per dev claim from each ranker of the full corpus: the shipped SPLADE-tiny (deep enough
# that fine-tuned models of it score on the pool as on the full corpus, docs/experiments.md) and BM25 (a
# few lexical competitors besides).
POOL_DEPTHS = {"splade": 20, "bm25": 3}
POOL_MODEL = "splade-tiny-msmarco"
POOL_LENGTHS = {"query_max_length": 32, "document_max_length": 128}
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


def pool_rankings(source: Path, dev_queries: list[str], *, depth: int) -> dict[str, dict[str, list[str]]]:
    """ranker ("bm25", "splade") -> dev claim id -> its top ``depth`` abstract ids in the full corpus."""
    import torch

    from gradcache_sparton.arguments import ModelArguments
    from gradcache_sparton.data import BeirData, load_beir
    from gradcache_sparton.evaluation import EncodingSettings, SparseRetrievalEvaluator
    from gradcache_sparton.mining import bm25_rankings
    from gradcache_sparton.pipeline import build_encoder, build_tokenizer

    beir = load_beir(source, split="train")
    dev = BeirData(
        corpus=beir.corpus,
        queries={q: beir.queries[q] for q in dev_queries},
        qrels={q: beir.qrels[q] for q in dev_queries},
    )
    doc_ids = list(beir.corpus)
    top = bm25_rankings(
        list(dev.queries.values()), list(dev.corpus.values()), depth=depth, show_progress=False
    )
    rankings = {
        "bm25": {q: [doc_ids[i] for i in row] for q, row in zip(dev.queries, top.tolist(), strict=True)}
    }
    model_args = ModelArguments(model_name_or_path=POOL_MODEL)
    tokenizer = build_tokenizer(model_args)
    encoder = build_encoder(model_args, tokenizer).eval()
    encoding = EncodingSettings(tokenizer, device="cpu", **POOL_LENGTHS)
    evaluator = SparseRetrievalEvaluator(dev, encoding=encoding, top_k=max(depth, 100))
    with torch.inference_mode():
        (result,) = evaluator.evaluate(encoder)
    rankings["splade"] = {q: [d for d, _ in hits[:depth]] for q, hits in result.run.items()}
    return rankings


def build(source: Path, output: Path, *, rankings_file: Path | None = None) -> dict:
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
    if rankings_file is not None and rankings_file.is_file():
        rankings = json.loads(rankings_file.read_text(encoding="utf-8"))
    else:
        rankings = pool_rankings(source, dev_queries, depth=max(POOL_DEPTHS.values()))
        if rankings_file is not None:
            rankings_file.write_text(json.dumps(rankings) + "\n", encoding="utf-8")
    pooled = {
        d for name, depth in POOL_DEPTHS.items() for q in dev_queries for d in rankings[name][q][:depth]
    }
    dev_corpus = [doc for doc in corpus if doc["_id"] in dev_relevant or doc["_id"] in pooled]

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
    # SciFact repeats a few claims under other ids with the same abstract: one row per (claim text, abstract),
    # else the copies meet in a batch as each other's in-batch false negatives.
    train_rows, seen = [], set()
    for q, d in labelled_pairs:
        key = (queries_by_id[q]["text"], _doc_text(docs_by_id[d]))
        if key not in seen:
            seen.add(key)
            train_rows.append({QUERY_COLUMN: key[0], POSITIVE_COLUMN: key[1]})
    repeats = len(labelled_pairs) - len(train_rows)
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
        "dev_corpus_pool": f"relevant + top {POOL_DEPTHS['splade']} of {POOL_MODEL} "
        f"({POOL_LENGTHS['query_max_length']}/{POOL_LENGTHS['document_max_length']} tokens, fp32 CPU) and top "
        f"{POOL_DEPTHS['bm25']} of BM25 (bm25s) per dev claim in the full corpus",
        "train_labelled_pairs": len(labelled_pairs) - repeats,
        "train_labelled_repeats_dropped": repeats,
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
    parser.add_argument(
        "--pool_rankings",
        type=Path,
        default=DEFAULT_POOL_RANKINGS,
        help="the pooling rankings (JSON): read if the file exists, else computed (minutes) and written there",
    )
    args = parser.parse_args()
    print(json.dumps(build(args.source, args.output, rankings_file=args.pool_rankings), indent=2))


if __name__ == "__main__":
    main()
