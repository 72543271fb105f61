"""Does the shipped dev sample predict full-corpus quality? nDCG@10 of full-corpus runs, on the full corpus
and restricted to the sample's corpus, for the sample's dev claims.

A document's rep does not depend on the other documents, so a system's ranking of a corpus sample is its
full-corpus ranking with the documents outside the sample left out (ties aside). Given TREC runs of the
full corpus (``gradcache-sparton crossval --write_runs`` writes them: ``runs/zero-shot.trec``,
``runs/recipe-seed<s>-fold<k>.trec``, each claim ranked by the model of the fold that held it out), this
prints per run the mean nDCG@10 over the dev claims on the full corpus and on the sample, and per
candidate run the paired difference against ``--baseline`` on both, with the 95% bootstrap interval::

    python scripts/check_dev_sample_agreement.py --full_qrels ../shared/data/scifact/qrels/train.tsv \\
        --baseline cv/runs/zero-shot.trec --runs "cv/runs/recipe-seed42-fold*.trec" [--sample DIR]

A run that lists fewer than 10 sample documents in its top 100 for some claim is reported (its sample
ranking is then cut short, which can only lower its nDCG@10 there).
"""

from __future__ import annotations

import argparse
import glob
import json
from collections.abc import Iterable
from pathlib import Path

from gradcache_sparton.data import default_dev_beir_path, load_beir
from gradcache_sparton.evaluation.significance import paired_comparison, per_query_metrics


def read_trec(paths: Iterable[str]) -> dict[str, list[str]]:
    """query id -> doc ids by rank, from one or several TREC run files (a query in two files: ValueError)."""
    rankings: dict[str, list[tuple[int, str]]] = {}
    seen: dict[str, str] = {}
    for path in paths:
        for line in Path(path).read_text(encoding="utf-8").splitlines():
            query_id, _, doc_id, rank, *_ = line.split()
            if seen.setdefault(query_id, path) != path:
                raise ValueError(f"query {query_id!r} is in {seen[query_id]} and {path}")
            rankings.setdefault(query_id, []).append((int(rank), doc_id))
    return {q: [d for _, d in sorted(hits)] for q, hits in rankings.items()}


def ndcg(rankings: dict[str, list[str]], qrels: dict[str, dict[str, int]], keep: set[str] | None) -> dict:
    """Per-claim nDCG@10 of ``rankings`` (restricted to ``keep`` when given) over the claims of ``qrels``."""
    cut = rankings if keep is None else {q: [d for d in r if d in keep] for q, r in rankings.items()}
    return per_query_metrics({q: cut[q] for q in qrels}, qrels, measures=["nDCG@10"])["ndcg_at_10"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--sample", default=str(default_dev_beir_path()), help="the dev BEIR folder (split dev)"
    )
    parser.add_argument("--baseline", required=True, help="TREC run file(s) (glob) of the baseline")
    parser.add_argument("--runs", nargs="+", required=True, help="NAME=GLOB or GLOB of candidate TREC runs")
    parser.add_argument("--resamples", type=int, default=10_000)
    parser.add_argument("--out", help="write the numbers as JSON here")
    args = parser.parse_args()
    sample = load_beir(args.sample, split="dev")
    keep = set(sample.corpus)
    qrels = sample.qrels
    systems = {"baseline": read_trec(sorted(glob.glob(args.baseline)))}
    for spec in args.runs:
        name, _, pattern = spec.rpartition("=")
        systems[name or pattern] = read_trec(sorted(glob.glob(pattern)))
    report: dict = {"sample": args.sample, "sample_docs": len(keep), "claims": len(qrels), "systems": {}}
    scores = {}
    for name, rankings in systems.items():
        missing = [q for q in qrels if q not in rankings]
        if missing:
            raise ValueError(f"run {name!r} has no ranking for {len(missing)} dev claims, e.g. {missing[:3]}")
        short = sum(1 for q in qrels if sum(d in keep for d in rankings[q]) < 10)
        scores[name] = {"full": ndcg(rankings, qrels, None), "sample": ndcg(rankings, qrels, keep)}
        report["systems"][name] = {where: sum(v.values()) / len(v) for where, v in scores[name].items()} | {
            "claims_with_under_10_sample_docs_in_top100": short
        }
    for name in systems:
        if name == "baseline":
            continue
        report["systems"][name]["vs_baseline"] = {
            where: paired_comparison(scores["baseline"][where], scores[name][where], resamples=args.resamples)
            for where in ("full", "sample")
        }
    print(json.dumps(report, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
