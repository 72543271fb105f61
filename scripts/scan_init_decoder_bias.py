"""Retrieval quality of a random-init SPLADE encoder before any training, per decoder-bias start value.

The measurement behind the ``init_decoder_bias`` default (docs/training.md):

    python scripts/scan_init_decoder_bias.py --biases 0 -0.5 -0.6 -0.7 -0.8 -1.0
"""

from __future__ import annotations

import argparse

import torch

from gradcache_sparton.arguments import DataArguments, ModelArguments
from gradcache_sparton.pipeline import build_encoder, build_evaluator, build_tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--biases", type=float, nargs="+", default=[0.0, -0.5, -0.6, -0.7, -0.8, -1.0])
    parser.add_argument("--config_name", default="bert-tiny")
    parser.add_argument("--seed", type=int, default=42)
    args = parser.parse_args()
    tokenizer = build_tokenizer(ModelArguments())
    evaluator = build_evaluator(DataArguments(), tokenizer, query_max_length=32, document_max_length=64)
    evaluator.encoding.show_progress = False
    print("| init_decoder_bias | nDCG@10 | MRR@10 | Recall@100 | query non-zeros | doc non-zeros |")
    print("|---|---|---|---|---|---|")
    for bias in args.biases:
        torch.manual_seed(args.seed)
        encoder = build_encoder(
            ModelArguments(config_name=args.config_name, init_decoder_bias=bias), tokenizer
        )
        m = evaluator(encoder.eval())
        print(
            f"| {bias} | {m['ndcg_at_10']:.3f} | {m['mrr_at_10']:.3f} | {m['recall_at_100']:.3f} | "
            f"{m['query_nonzeros']:,.0f} | {m['doc_nonzeros']:,.0f} |"
        )


if __name__ == "__main__":
    main()
