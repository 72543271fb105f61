"""Per-query comparison of two encoders on a BEIR dev set: how sure is a gain in nDCG@10?

Both encoders are evaluated on the same judged queries at the same lengths (exhaustive search, top 100);
the script prints and writes, for nDCG@10:

- each encoder's mean, and the mean of the per-query differences (candidate - baseline);
- a 95% paired bootstrap interval of that mean (``--resamples`` resamples of the queries);
- a two-sided paired randomization p-value (the sign of each query's difference flipped at random,
  ``--resamples`` times): the chance of a mean difference at least this large if the two were
  exchangeable;
- how many queries went up, down or stayed

(:func:`gradcache_sparton.evaluation.significance.paired_statistics`; ``gradcache-sparton crossval`` runs the
same statistics over k folds).

With 100 dev claims a single query moving by 1.0 moves the mean by 0.01, so a gain of that size needs
this test before it is called clear. Example (the embedded default run against its untrained start, on
the shipped dev sample at the run's lengths):

    gradcache-sparton train --output_dir runs/default
    python scripts/compare_on_dev.py --baseline splade-tiny-msmarco --candidate runs/default \\
        --document_max_length 128 --out compare.json
"""

from __future__ import annotations

import argparse
import json

import torch
import transformers

from gradcache_sparton.arguments import DataArguments, ModelArguments
from gradcache_sparton.evaluation.metrics import ndcg_at_k
from gradcache_sparton.evaluation.significance import paired_statistics
from gradcache_sparton.pipeline import build_encoder, build_evaluator, build_tokenizer


def per_query_ndcg(model: str, data_args: DataArguments, lengths: dict[str, int]) -> dict[str, float]:
    """Query id -> nDCG@10 of ``model`` (a checkpoint folder or a shipped name), with its own tokenizer."""
    model_args = ModelArguments(model_name_or_path=model)
    tokenizer = build_tokenizer(model_args)
    evaluator = build_evaluator(data_args, tokenizer, **lengths)
    evaluator.encoding.show_progress = False
    (result,) = evaluator.evaluate(build_encoder(model_args, tokenizer).eval())
    qrels = evaluator.data.qrels
    return {q: ndcg_at_k([d for d, _ in hits], qrels[q], 10) for q, hits in result.run.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", required=True, help="checkpoint folder or shipped model name")
    parser.add_argument("--candidate", required=True, help="checkpoint folder or shipped model name")
    parser.add_argument(
        "--eval_beir", default="default", help="BEIR folder ('default': the shipped dev sample)"
    )
    parser.add_argument("--eval_beir_split", default="dev", help="qrels split of --eval_beir")
    parser.add_argument("--query_max_length", type=int, default=32)
    parser.add_argument("--document_max_length", type=int, default=128)
    parser.add_argument("--resamples", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="write the numbers as JSON here")
    args = parser.parse_args()
    if args.resamples < 1:
        parser.error(f"--resamples must be >= 1, got {args.resamples}")
    if args.eval_beir.lower() == "none":
        parser.error("--eval_beir must name a BEIR folder (or 'default'), got 'none'")
    transformers.logging.set_verbosity_error()
    lengths = {"query_max_length": args.query_max_length, "document_max_length": args.document_max_length}
    data_args = DataArguments(eval_beir=args.eval_beir, eval_beir_split=args.eval_beir_split)
    baseline = per_query_ndcg(args.baseline, data_args, lengths)
    candidate = per_query_ndcg(args.candidate, data_args, lengths)
    queries = sorted(baseline)
    before = torch.tensor([baseline[q] for q in queries], dtype=torch.float64)  # [Q]
    after = torch.tensor([candidate[q] for q in queries], dtype=torch.float64)  # [Q]
    differences = after - before
    report = {
        "baseline": args.baseline,
        "candidate": args.candidate,
        **lengths,
        "queries": len(queries),
        "baseline_ndcg_at_10": before.mean().item(),
        "candidate_ndcg_at_10": after.mean().item(),
        **paired_statistics(differences, resamples=args.resamples, seed=args.seed),
    }
    print(json.dumps(report, indent=1))
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
