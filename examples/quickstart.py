"""Smallest end-to-end use of the SPLADE head: a random-init BERT masked-LM, the shipped tokenizer,
and sparse reps of a query and a document through ``SpartonHead`` tied to the model's decoder.

    python examples/quickstart.py
"""

from __future__ import annotations

import torch
from transformers import AutoTokenizer, BertConfig, BertForMaskedLM

from gradcache_sparton import SpartonHead, default_tokenizer_path


def main() -> None:
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(default_tokenizer_path())
    config = BertConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=128,
    )
    model = BertForMaskedLM(config).eval()
    head = SpartonHead.from_decoder(model.cls.predictions.decoder)  # shares the [V, D] decoder weight

    texts = ["what protein folds fastest?", "Small proteins can fold in microseconds."]
    batch = tokenizer(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = model.bert(**batch).last_hidden_state  # [B, S, D]
        hidden = model.cls.predictions.transform(hidden)  # the LM transform before the decoder
        reps = head(hidden, batch["attention_mask"])  # [B, V]
    q, d = reps
    print(f"reps {tuple(reps.shape)}, non-zeros per rep: {(reps > 0).sum(dim=1).tolist()}")
    print(f"score(query, doc) = {torch.dot(q, d).item():.4f}")


if __name__ == "__main__":
    main()
