"""A SPLADE encoder end to end: one cached training step on real pairs, then encode and read top terms.

The encoder is the pretrained SPLADE-tiny shipped with the package when present (its reps are sparse
and meaningful), else a tiny random one (the terms are then noise). The step trains on 16 SciFact
(query, positive) pairs of the shipped sample with in-batch negatives, 4 rows encoded at a time.

    python examples/train_and_encode.py
"""

from __future__ import annotations

import itertools

import torch
from transformers import AutoTokenizer, BertConfig

from gradcache_sparton import (
    CachedLoss,
    SpladeEncoder,
    SpladeLoss,
    SpladeLossConfig,
    TrainingCollator,
    default_tokenizer_path,
    load_training_data,
)
from gradcache_sparton.data import default_train_data_path
from gradcache_sparton.resources import RESOURCES_DIR

PRETRAINED = RESOURCES_DIR / "splade-tiny-msmarco"


def main() -> None:
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(default_tokenizer_path())
    if PRETRAINED.is_dir():
        encoder = SpladeEncoder.from_pretrained(PRETRAINED)
    else:
        config = BertConfig(
            vocab_size=len(tokenizer),
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=128,
        )
        encoder = SpladeEncoder.from_config(config)
    encoder.train()

    # One training step: 16 pairs, the loss over all of them, activations of 4 rows at a time.
    rows = [dict(row) for row in itertools.islice(load_training_data(default_train_data_path()), 16)]
    batch = TrainingCollator(tokenizer, document_max_length=128)(rows)
    loss_fn = SpladeLoss(SpladeLossConfig(query_reg_weight=5e-4, doc_reg_weight=3e-4))
    optimizer = torch.optim.AdamW(encoder.parameters(), lr=2e-5)
    loss, components = CachedLoss(encoder, loss_fn, mini_batch_size=4)(
        batch["columns"], return_components=True
    )
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    print(f"loss {loss.item():.4f}, non-zeros per query rep {components['nnz_query'].item():.0f}")

    # Encode a query and read its strongest terms.
    encoder.eval()
    features = tokenizer(["what causes cancer in mice"], return_tensors="pt")
    with torch.no_grad():
        rep = encoder(**features)[0]  # [V]
    weights, ids = rep.topk(10)
    terms = tokenizer.convert_ids_to_tokens(ids.tolist())
    print(
        f"{int((rep > 0).sum())} non-zero terms; top: "
        + ", ".join(f"{t} {w:.2f}" for t, w in zip(terms, weights.tolist(), strict=True))
    )


if __name__ == "__main__":
    main()
