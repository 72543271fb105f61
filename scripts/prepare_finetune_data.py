"""Data for the SciFact fine-tuning experiment (scripts/finetune_experiment.py), built on a CPU with bm25s.

Reads the SciFact BEIR train side (``--scifact``, default ``../shared/data/scifact``: 5,183 abstracts,
809 claims, 919 judgements) and writes into ``--out`` (default ``.exp_data``):

- ``dev/``: a BEIR folder (``corpus.jsonl.gz`` = the full corpus, ``queries.jsonl``, ``qrels/dev.tsv``) for
  the held-out claims: a seeded ``--dev_fraction`` (20%) of the claim ids, with all their judgements;
- ``labelled.jsonl.gz`` / ``labelled_bm25.jsonl.gz``: one (claim, relevant abstract) pair per judgement of
  the other claims, without and with ``--num_negatives`` BM25 negatives (``negative_1..k``);
- ``selfsup.jsonl.gz`` / ``selfsup_bm25.jsonl.gz``: self-supervised (sentence, rest of the abstract) pairs
  (``self_supervised_pairs``, one per abstract), without and with BM25 negatives, from every abstract
  that is judged for no claim at all (train or dev): no dev-relevant text is trained on, and no pair's
  query sentence sits inside a labelled pair's positive (an in-batch collision that grows with the batch);
- ``bm25_dev.json``: bm25s's nDCG@10 / MRR@10 / Recall@100 on the dev folder (same BM25 as the mining);
- ``manifest.json``: the settings and counts.

Negatives: :func:`~gradcache_sparton.mining.mine_hard_negatives` (bm25s, English stemming, ranks
``--rank_start..--rank_end`` = 10..100, random ``k`` of the window, known positives skipped by id: a
claim's judged abstracts, a self-supervised pair's source abstract). Everything is a function of the
inputs and ``--seed``. Needs the ``mining`` extra (bm25s, PyStemmer) and ``datasets``::

    python scripts/prepare_finetune_data.py                      # -> .exp_data (about 12 MB)
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import sys
from pathlib import Path

from gradcache_sparton.data import BeirData, load_beir, read_corpus, self_supervised_pairs, split_sentences
from gradcache_sparton.evaluation import retrieval_metrics
from gradcache_sparton.mining import (
    POSITIVE_ID_COLUMN,
    QUERY_ID_COLUMN,
    beir_mining_pairs,
    bm25_rankings,
    check_bm25_installed,
    mine_hard_negatives,
    write_training_file,
)

DEFAULT_SCIFACT = Path(__file__).resolve().parents[2] / "shared" / "data" / "scifact"
DEV_SPLIT = "dev"


def split_queries(query_ids: list[str], *, dev_fraction: float, seed: int) -> tuple[list[str], list[str]]:
    """(train ids, dev ids): a seeded shuffle of the sorted ids, the first round(fraction x Q) are dev."""
    if not 0 < dev_fraction < 1:
        raise ValueError(f"dev_fraction must be in (0, 1), got {dev_fraction}")
    ids = sorted(query_ids)
    random.Random(seed).shuffle(ids)
    num_dev = round(dev_fraction * len(ids))
    if not 0 < num_dev < len(ids):
        raise ValueError(f"dev_fraction={dev_fraction} of {len(ids)} queries leaves one side empty")
    dev = set(ids[:num_dev])
    return [q for q in query_ids if q not in dev], [q for q in query_ids if q in dev]


def subset(beir: BeirData, query_ids: list[str]) -> BeirData:
    """The same corpus with only ``query_ids`` and their judgements."""
    return BeirData(
        corpus=beir.corpus,
        queries={q: beir.queries[q] for q in query_ids},
        qrels={q: beir.qrels[q] for q in query_ids},
    )


def write_beir_folder(folder: Path, *, scifact: Path, dev: BeirData) -> None:
    """``corpus.jsonl.gz`` (every document, title and text apart), ``queries.jsonl``, ``qrels/dev.tsv``."""
    (folder / "qrels").mkdir(parents=True, exist_ok=True)
    with gzip.GzipFile(folder / "corpus.jsonl.gz", "wb", mtime=0) as handle:
        for doc in read_corpus(scifact):
            record = {"_id": doc.doc_id, "title": doc.title, "text": doc.text}
            handle.write((json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8"))
    with (folder / "queries.jsonl").open("w", encoding="utf-8") as handle:
        for query_id, text in dev.queries.items():
            handle.write(json.dumps({"_id": query_id, "text": text}, ensure_ascii=False) + "\n")
    with (folder / "qrels" / f"{DEV_SPLIT}.tsv").open("w", encoding="utf-8") as handle:
        handle.write("query-id\tcorpus-id\tscore\n")
        for query_id, judged in dev.qrels.items():
            for doc_id, relevance in judged.items():
                handle.write(f"{query_id}\t{doc_id}\t{relevance}\n")


def corpus_pairs(scifact: Path, *, exclude: set[str], seed: int) -> tuple[object, dict[str, int]]:
    """Self-supervised pairs (with ``query_id`` / ``positive_id``: the source abstract) from every abstract
    not in ``exclude``; a pair whose query sentence occurs in two abstracts of the whole corpus
    (boilerplate) is dropped."""
    every = read_corpus(scifact)
    docs = [doc for doc in every if doc.doc_id not in exclude]
    source: dict[str, str | None] = {}  # sentence -> the one abstract holding it (None: several)
    for doc in every:
        for sentence in split_sentences(doc.text):
            source[sentence] = doc.doc_id if source.get(sentence, doc.doc_id) == doc.doc_id else None
    pairs = self_supervised_pairs(
        [doc.text for doc in docs], titles=[doc.title for doc in docs], pairs_per_document=1, seed=seed
    )
    doc_ids = [source.get(query) for query in pairs["query"]]
    keep = [row for row, doc_id in enumerate(doc_ids) if doc_id is not None]
    pairs = pairs.select(keep)
    pairs = pairs.add_column(QUERY_ID_COLUMN, [f"selfsup-{row}" for row in range(len(pairs))])
    pairs = pairs.add_column(POSITIVE_ID_COLUMN, [doc_ids[row] for row in keep])
    stats = {
        "source_abstracts": len(docs),
        "pairs": len(pairs),
        "dropped_ambiguous": len(doc_ids) - len(keep),
    }
    return pairs, stats


def bm25_dev_metrics(dev: BeirData) -> dict[str, float]:
    """bm25s (the mining's BM25, English stemming) on the dev folder: nDCG@10, MRR@10, Recall@100."""
    doc_ids = list(dev.corpus)
    rankings = bm25_rankings(
        list(dev.queries.values()), list(dev.corpus.values()), depth=100, show_progress=False
    )  # [Q, 100]
    ranked = {q: [doc_ids[i] for i in row] for q, row in zip(dev.queries, rankings.tolist(), strict=True)}
    return retrieval_metrics(ranked, dev.qrels)


def mine_and_write(
    pairs: object, *, corpus: dict[str, str], stem: str, out: Path, args: argparse.Namespace
) -> int:
    """Write ``<stem>.jsonl.gz`` (query, positive) and ``<stem>_bm25.jsonl.gz`` (with negatives); rows."""
    mined = mine_hard_negatives(
        pairs,
        corpus=corpus,
        num_negatives=args.num_negatives,
        rank_start=args.rank_start,
        rank_end=args.rank_end,
        seed=args.seed,
        show_progress=False,
    )
    write_training_file(mined.select_columns(["query", "positive"]), out / f"{stem}.jsonl.gz", overwrite=True)
    write_training_file(mined, out / f"{stem}_bm25.jsonl.gz", overwrite=True)
    return len(mined)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scifact", type=Path, default=DEFAULT_SCIFACT, help="SciFact BEIR folder (train split)")
    p.add_argument("--out", type=Path, default=Path(".exp_data"), help="output folder")
    p.add_argument("--dev_fraction", type=float, default=0.2, help="share of the claims held out as dev")
    p.add_argument("--num_negatives", type=int, default=2, help="BM25 negatives per pair (k)")
    p.add_argument("--rank_start", type=int, default=10)
    p.add_argument("--rank_end", type=int, default=100)
    p.add_argument("--seed", type=int, default=42)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    check_bm25_installed("english")
    beir = load_beir(args.scifact, split="train")
    train_ids, dev_ids = split_queries(list(beir.qrels), dev_fraction=args.dev_fraction, seed=args.seed)
    train, dev = subset(beir, train_ids), subset(beir, dev_ids)
    args.out.mkdir(parents=True, exist_ok=True)
    write_beir_folder(args.out / "dev", scifact=args.scifact, dev=dev)

    judged = {doc for judgements in beir.qrels.values() for doc in judgements}
    labelled_rows = mine_and_write(
        beir_mining_pairs(train), corpus=beir.corpus, stem="labelled", out=args.out, args=args
    )
    selfsup, selfsup_stats = corpus_pairs(args.scifact, exclude=judged, seed=args.seed)
    selfsup_rows = mine_and_write(selfsup, corpus=beir.corpus, stem="selfsup", out=args.out, args=args)

    bm25 = bm25_dev_metrics(load_beir(args.out / "dev", split=DEV_SPLIT))
    (args.out / "bm25_dev.json").write_text(json.dumps(bm25, indent=1) + "\n")
    manifest = {
        "source": str(args.scifact),
        "settings": {k: v for k, v in vars(args).items() if k not in ("scifact", "out")},
        "corpus_documents": len(beir.corpus),
        "train_queries": len(train_ids),
        "dev_queries": len(dev_ids),
        "dev_judgements": sum(len(j) for j in dev.qrels.values()),
        "labelled_pairs": labelled_rows,
        "selfsup": selfsup_stats | {"pairs": selfsup_rows},
        "judged_abstracts_excluded_from_selfsup": len(judged),
        "bm25_dev": bm25,
    }
    (args.out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    print(json.dumps(manifest, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
