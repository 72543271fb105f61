"""The drop-in cached loss in one's own training loop (no Trainer).

Uncached, a step reads ``loss = loss_fn({c: model(**f) for c, f in columns.items()}); loss.backward()``.
With ``CachedLoss`` it reads ``loss = cached(columns); loss.backward()``: the same loss and gradients
over the whole batch, at the activation memory of ``mini_batch_size`` rows. Everything else (optimizer,
autocast, gradient clipping, scheduler, logging) stays the user's.

    python examples/own_training_loop.py            # a few steps of a tiny model on the shipped pairs
"""

from __future__ import annotations

import contextlib
import itertools

import torch
from torch.utils.data import DataLoader
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

BATCH, MINI_BATCH, STEPS = 16, 4, 3


def main() -> None:
    torch.manual_seed(0)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tokenizer = AutoTokenizer.from_pretrained(default_tokenizer_path())
    config = BertConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=128,
    )
    model = SpladeEncoder.from_config(config).to(device).train()
    # A sparse start (~1% non-zeros): with its bias at 0 a random head's reps are all dense.
    torch.nn.init.constant_(model.model.get_output_embeddings().bias, -0.5)

    rows = load_training_data(default_train_data_path())  # query, positive (a datasets.Dataset)
    loader = DataLoader(
        rows, batch_size=BATCH, shuffle=True, collate_fn=TrainingCollator(tokenizer, document_max_length=64)
    )
    loss_fn = SpladeLoss(SpladeLossConfig(query_reg_weight=5e-4, doc_reg_weight=3e-4, reg_warmup_steps=STEPS))
    cached = CachedLoss(model, loss_fn, mini_batch_size=MINI_BATCH)
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-4)
    autocast = (
        torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()
    )

    for step, batch in enumerate(itertools.islice(loader, STEPS)):
        columns = {
            name: {k: v.to(device) for k, v in features.items()}
            for name, features in batch["columns"].items()
        }
        with autocast:
            # was: loss, parts = loss_fn({name: model(**features) for name, features in columns.items()}, step=step)
            loss, parts = cached(columns, step=step, return_components=True)
        loss.backward()  # re-encodes each mini-batch, RNG and autocast replayed, and fills .grad
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        print(f"step {step}: loss {loss.item():.4f}, query non-zeros {parts['nnz_query'].item():.0f}")


if __name__ == "__main__":
    main()
