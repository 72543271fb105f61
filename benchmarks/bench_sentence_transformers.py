"""sentence-transformers' CachedSpladeLoss against the same SparseEncoder through our bridge, one GPU.

Legend: B batch (triplets), S sequence, D hidden, V vocabulary.

One random-init SPLADE ``SparseEncoder`` (BERT-base width: D = 768, 12 heads, FFN 3,072, ``--layers``
layers; V = 30,522 or, with ``--vocab 250002``, XLM-R's size) built from a config in a temporary
folder (no hub). Data: synthetic triplets of random ids (query 32 tokens, positive and negative
``--doc-len``), no padding. The decoder bias (``--decoder-bias``, -1.9) makes the reps about as sparse
as a trained SPLADE model's: on the CPU with 2 layers at S = 256, -1.8 left 8.0% / 1.6% of the
document / query terms non-zero and -2.0 2.7% / 0.4% (each run records its own, ``density``). At -0.5
they are ~94% dense, every score is in the thousands and the softmax is saturated, so bf16 rounding
alone flips whole rows of the loss and no two implementations' gradients can be compared. Two
providers, the same weights and batch, bf16 autocast:

  st        sentence-transformers' own ``CachedSpladeLoss(SparseMultipleNegativesRankingLoss)``:
            its fill-mask module forms the [mb, S, V] logits, ``SpladePooling`` max-pools them;
  bridge    ``use_sparton_head`` on a copy of the model, then our ``CachedLoss`` over
            ``as_rep_encoder(model)`` with ``SpladeLoss(splade_loss_config_from(st_loss))``.

Each provider runs one warm-up step, then ``--steps`` timed steps (loss, backward; no optimizer step,
so every step sees the same weights): the row reports the median step time, sequences per second
(3 B per step) and peak memory over the timed steps.

Gradients: after the timing, both losses run once more in fp32 (autocast off, IEEE matmuls in both)
on the first ``--check-batch`` (64) triplets, in mini-batches of ``--check-mini-batch`` (24: not a
divisor), from the same weights. ``fp32_max_grad_diff_over_max_grad`` is the largest difference of a
bridge gradient from sentence-transformers', over the largest gradient; only summation order differs
(ours accumulates the head in fp32 tiles, theirs in cuBLAS), so expect ~1e-5 and never the O(1) of a
wrong gradient. The bf16 steps' difference (``bf16_max_grad_diff_over_max_grad``) is reported too: ST
rounds the [B, S, V] logits to bf16 before the max, which moves near-equal maxima to other positions
(each such move is a whole gradient row elsewhere), so it is larger: 0.14-0.15 on the H100.

    python -m benchmarks.bench_sentence_transformers --batch 1024 --mini-batch 64 --out st_bridge.json
    python -m benchmarks.bench_sentence_transformers --batch 1024 --mini-batch 32 --vocab 250002
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import tempfile
import time

import torch
from sentence_transformers import SparseEncoder
from sentence_transformers.base.modules import Transformer
from sentence_transformers.sparse_encoder.losses import CachedSpladeLoss, SparseMultipleNegativesRankingLoss
from sentence_transformers.sparse_encoder.modules import SpladePooling
from transformers import AutoTokenizer, BertConfig, BertForMaskedLM

from benchmarks.common import run_stamp
from gradcache_sparton import CachedLoss, SpladeLoss, default_tokenizer_path
from gradcache_sparton.integrations.sentence_transformers import (
    as_rep_encoder,
    splade_loss_config_from,
    use_sparton_head,
)


def build_model(vocab: int, layers: int, device: torch.device, decoder_bias: float = -1.9) -> SparseEncoder:
    """A random-init BERT-base-width SparseEncoder, dropout off, all decoder biases ``decoder_bias``."""
    # Dropout off: the two providers draw dropout masks in different orders, so with it on their
    # gradients would differ by the masks, not by the head.
    config = BertConfig(
        vocab_size=vocab,
        num_hidden_layers=layers,
        max_position_embeddings=512,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    torch.manual_seed(0)
    mlm = BertForMaskedLM(config)
    with torch.no_grad():
        mlm.cls.predictions.bias.fill_(decoder_bias)
    folder = tempfile.mkdtemp(prefix="bench_st_")
    mlm.save_pretrained(folder)
    AutoTokenizer.from_pretrained(default_tokenizer_path()).save_pretrained(folder)  # ids are synthetic
    transformer = Transformer(folder, transformer_task="fill-mask", model_kwargs={"local_files_only": True})
    return SparseEncoder(modules=[transformer, SpladePooling("max")], device=str(device))


def triplets(batch: int, doc_len: int, vocab: int, device: torch.device) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator(device=device).manual_seed(1)
    columns = []
    for length in (32, doc_len, doc_len):
        ids = torch.randint(1000, vocab, (batch, length), device=device, generator=g)  # [B, S]
        columns.append(
            {
                "input_ids": ids,
                "attention_mask": torch.ones_like(ids),
                "token_type_ids": torch.zeros_like(ids),
            }
        )
    return columns


def timed(step, steps: int, device: torch.device) -> tuple[float, float]:
    """Median seconds of ``steps`` calls after one warm-up, and the peak GiB over the timed calls."""
    step()
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times), torch.cuda.max_memory_allocated(device) / 2**30


def grad_difference(theirs_model: SparseEncoder, ours_model: SparseEncoder) -> float:
    """The largest difference of a gradient of ``ours_model`` from ``theirs_model``'s, over the largest
    gradient: some gradients are zero in exact arithmetic (attention key biases) and only rounding noise,
    which a per-tensor ratio would blow up."""
    theirs = {name: p.grad for name, p in theirs_model.named_parameters() if p.grad is not None}
    scale = max(grad.abs().max().item() for grad in theirs.values())
    worst = max(
        (p.grad - theirs[name]).abs().max().item()
        for name, p in ours_model.named_parameters()
        if name in theirs
    )
    return worst / scale


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=1024, help="triplets per step (effective batch)")
    parser.add_argument("--mini-batch", type=int, default=64, help="mini_batch_size of both cached losses")
    parser.add_argument("--vocab", type=int, default=30522, help="V (250002: XLM-R's size)")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--doc-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--decoder-bias", type=float, default=-1.9, help="sets the reps' density")
    parser.add_argument("--check-batch", type=int, default=64, help="triplets of the fp32 gradient check")
    parser.add_argument("--check-mini-batch", type=int, default=24)
    parser.add_argument("--out", help="write rows and metadata as JSON here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 1
    device = torch.device("cuda")
    st_model = build_model(args.vocab, args.layers, device, args.decoder_bias).train()
    bridge_model = use_sparton_head(copy.deepcopy(st_model))
    columns = triplets(args.batch, args.doc_len, args.vocab, device)
    st_loss = CachedSpladeLoss(
        st_model,
        loss=SparseMultipleNegativesRankingLoss(st_model),
        document_regularizer_weight=3e-4,
        query_regularizer_weight=5e-4,
        mini_batch_size=args.mini_batch,
    )
    our_loss = CachedLoss(
        as_rep_encoder(bridge_model),
        SpladeLoss(splade_loss_config_from(st_loss)),
        mini_batch_size=args.mini_batch,
    )
    named = dict(zip(("query", "positive", "negative_1"), columns, strict=True))

    def st_step() -> None:
        st_model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = sum(st_loss([dict(c) for c in columns], labels=None).values())
        loss.backward()

    def bridge_step() -> None:
        bridge_model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = our_loss(named)
        loss.backward()

    rows = []
    for name, step, model in (("st", st_step, st_model), ("bridge", bridge_step, bridge_model)):
        try:
            seconds, peak = timed(step, args.steps, device)
            rows.append(
                {
                    "provider": name,
                    "step_ms": seconds * 1e3,
                    "seq_per_s": 3 * args.batch / seconds,
                    "peak_gib": peak,
                }
            )
        except torch.OutOfMemoryError:
            rows.append({"provider": name, "oom": True})
            model.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
    if all("oom" not in row for row in rows):  # both ran: the last step's gradients are comparable
        rows[-1]["bf16_max_grad_diff_over_max_grad"] = grad_difference(st_model, bridge_model)
    check = [{k: v[: args.check_batch] for k, v in column.items()} for column in columns]
    for model in (st_model, bridge_model):
        model.zero_grad(set_to_none=True)
    sum(
        CachedSpladeLoss(
            st_model,
            loss=SparseMultipleNegativesRankingLoss(st_model),
            document_regularizer_weight=3e-4,
            query_regularizer_weight=5e-4,
            mini_batch_size=args.check_mini_batch,
        )([dict(c) for c in check], labels=None).values()
    ).backward()
    encoder = as_rep_encoder(bridge_model)
    CachedLoss(encoder, SpladeLoss(splade_loss_config_from(st_loss)), mini_batch_size=args.check_mini_batch)(
        dict(zip(("query", "positive", "negative_1"), check, strict=True))
    ).backward()
    with torch.no_grad():
        density = {
            name: (encoder(**check[i]) > 0).float().mean().item()
            for i, name in ((0, "query"), (1, "document"))
        }
    rows[-1].update(fp32_max_grad_diff_over_max_grad=grad_difference(st_model, bridge_model), density=density)
    meta = {
        **run_stamp(device),
        "sentence_transformers": __import__("sentence_transformers").__version__,
        **vars(args),
    }
    for row in rows:
        print(json.dumps(row))
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
