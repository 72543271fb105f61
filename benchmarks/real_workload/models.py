"""The models both providers load: the pretrained SPLADE-tiny, or a base-width random start whose decoder
bias is calibrated to a target density of non-zeros; and what is measured about them."""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from transformers import BertConfig, BertForMaskedLM, PreTrainedTokenizerBase

from benchmarks.harness import free_memory
from benchmarks.real_workload.workloads import COLUMNS, Scale, Workload, take_rows
from gradcache_sparton import SpladeEncoder
from gradcache_sparton.resources import RESOURCES_DIR

__all__ = [
    "build_sparse_encoder",
    "calibrate_decoder_bias",
    "default_model_path",
    "max_logits",
    "nonzeros_per_row",
    "prepare_models",
    "random_model",
    "rep_difference",
    "save_model_dir",
    "sentence_transformers_version",
]

ROOT = Path(__file__).resolve().parents[2]
PACKAGED_MODEL = RESOURCES_DIR / "splade-tiny-msmarco"
SHARED_MODEL = ROOT.parent / "shared" / "models" / "splade-tiny-msmarco"


def default_model_path() -> Path:
    """The shipped SPLADE-tiny if the package has it, else the shared copy."""
    return PACKAGED_MODEL if PACKAGED_MODEL.is_dir() else SHARED_MODEL


def save_model_dir(model: BertForMaskedLM, tokenizer: PreTrainedTokenizerBase, path: Path) -> Path:
    """A directory both providers load: the masked LM and its tokenizer."""
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def max_logits(model: BertForMaskedLM, features: dict[str, Tensor], chunk: int = 8) -> Tensor:
    """[B, V] max over the kept positions of the masked-LM logits (fp32, no grad)."""
    out = []
    with torch.no_grad():
        for start in range(0, features["input_ids"].shape[0], chunk):
            part = {name: value[start : start + chunk] for name, value in features.items()}
            logits = model(**part).logits.float()  # [b, S, V]
            kept = part["attention_mask"].bool()[:, :, None]  # [b, S, 1]
            out.append(logits.masked_fill(~kept, -math.inf).amax(dim=1))  # [b, V]
    return torch.cat(out)


def calibrate_decoder_bias(
    model: BertForMaskedLM, samples: Sequence[dict[str, Tensor]], target_density: float
) -> float:
    """Set the decoder bias (one value) so that a fraction ``target_density`` of rep entries is non-zero.

    A SPLADE rep entry log1p(relu(max_s logit + b)) is non-zero exactly when max_s logit + b > 0, so with
    the bias at 0 the answer is minus the (1 - target) quantile of the max logits over the samples.
    """
    bias = model.get_output_embeddings().bias
    with torch.no_grad():
        bias.zero_()
        maxima = torch.cat([max_logits(model, s).flatten().cpu() for s in samples])  # [rows * V]
        k = max(1, min(maxima.numel(), maxima.numel() - round(target_density * maxima.numel())))
        value = -float(maxima.kthvalue(k).values)
        bias.fill_(value)
    return value


def nonzeros_per_row(encoder: SpladeEncoder, columns: dict[str, dict[str, Tensor]]) -> dict[str, float]:
    """Mean non-zeros per row of each column's reps (eval mode, no grad)."""
    was_training = encoder.training
    encoder.eval()
    with torch.no_grad():
        nnz = {c: float((encoder(**f) > 0).sum(dim=1).float().mean()) for c, f in columns.items()}
    encoder.train(was_training)
    return nnz


def sentence_transformers_version() -> str | None:
    try:
        import sentence_transformers
    except ImportError:
        return None
    return sentence_transformers.__version__


def build_sparse_encoder(path: Path, device: torch.device) -> Any:
    """sentence-transformers' SPLADE model from the same directory: masked LM + max SpladePooling."""
    from sentence_transformers import SparseEncoder
    from sentence_transformers.sparse_encoder.modules import SpladePooling, Transformer

    modules = [Transformer(str(path), transformer_task="fill-mask"), SpladePooling(pooling_strategy="max")]
    return SparseEncoder(modules=modules, device=str(device))


def rep_difference(path: Path, features: dict[str, Tensor], device: torch.device) -> float:
    """Largest |ours - sentence-transformers| rep entry on ``features`` (eval mode, fp32)."""
    ours = SpladeEncoder.from_pretrained(path).to(device).eval()
    theirs = build_sparse_encoder(path, device).eval()
    with torch.no_grad():
        diff = (ours(**features) - theirs(dict(features))["sentence_embedding"]).abs().max()
    return float(diff)


def random_model(scale: Scale, vocab: int, seed: int) -> BertForMaskedLM:
    """The base-width masked LM (a tiny one with ``SMOKE``), random weights from ``seed``."""
    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=vocab,
        hidden_size=scale.base_hidden,
        num_hidden_layers=scale.base_layers,
        num_attention_heads=scale.base_heads,
        intermediate_size=scale.base_ffn,
        max_position_embeddings=512,
    )
    return BertForMaskedLM(config)


def prepare_models(
    args: argparse.Namespace, scale: Scale, tokenizer: PreTrainedTokenizerBase, workloads: list[Workload],
    tmp: Path, device: torch.device,
) -> dict[str, tuple[Path, dict[str, Any]]]:  # fmt: skip
    """Model name -> (directory both providers load, what was measured about it)."""
    samples = [take_rows(w.batches[0], scale.calibration_rows) for w in workloads]
    models: dict[str, tuple[Path, dict[str, Any]]] = {}
    for name in args.models:
        info: dict[str, Any] = {}
        if name == "tiny" and not args.smoke:
            path = args.model_path
            info["source"] = str(path)
        else:
            # base width (or, with --smoke, a tiny stand-in for both): random init, calibrated bias
            model = random_model(scale, len(tokenizer), args.seed).to(device).eval()
            flat = [sample[c] for sample in samples for c in COLUMNS]
            info["decoder_bias"] = calibrate_decoder_bias(model, flat, args.target_density)
            info["source"] = f"random init D{scale.base_hidden} L{scale.base_layers}, calibrated bias"
            path = save_model_dir(model.cpu(), tokenizer, tmp / name)
            del model
        encoder = SpladeEncoder.from_pretrained(path).to(device)
        vocab = encoder.vocab_size
        info["nnz_per_row"] = {
            w.name: nonzeros_per_row(encoder, s) for w, s in zip(workloads, samples, strict=True)
        }
        info["density"] = {
            w: {c: n / vocab for c, n in nnz.items()} for w, nnz in info["nnz_per_row"].items()
        }
        del encoder
        if sentence_transformers_version() is not None and "st" in args.providers:
            info["max_rep_difference_vs_sentence_transformers"] = rep_difference(
                path, samples[0]["positive"], device
            )
        print(f"model {name}: {json.dumps(info)}", flush=True)
        models[name] = (path, info)
        free_memory(device)
    return models
