"""The document encoder as an ONNX model, for serving outside Python (onnxruntime, a search engine's runtime).

Legend: B batch, S sequence, D hidden, V vocabulary.

:func:`export_onnx` writes a :class:`~gradcache_sparton.modeling.SpladeEncoder` as one ONNX graph with
inputs ``input_ids`` and ``attention_mask`` ([B, S] int64, both dynamic) and output ``reps`` ([B, V]
float32). The head is its reference computation: the [B, S, V] logits, then max over the sequence of
log1p(relu(logits)) (log1p(log1p(relu(logits))) for the ``"log1p_relu"`` activation) at the pooled positions (attended, not a masked special token, past the prefix), which
is what the fused Sparton head computes without forming the logits. The backbone is the masked-LM's own
graph (torch's ONNX exporter, ``dynamo=True``).

:func:`check_onnx_reps` proves an export against PyTorch on real texts with a bound derived from a float64
evaluation of the same encoder: both fp32 evaluations (PyTorch's and onnxruntime's) approximate the fp64
reps; onnxruntime's may differ from them by its own summation orders, which are of the size of PyTorch's
(the same operations on the same values), so its distance to the fp64 reps must stay within
``4 x`` PyTorch's largest distance plus 8 fp32 ulps of the largest rep: a wrong graph (a dropped mask, a
missing bias) misses that by orders of magnitude.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import PreTrainedTokenizerBase

from gradcache_sparton.evaluation.optional_imports import importable
from gradcache_sparton.kernels.reference import splade_activation

__all__ = ["OnnxCheck", "OnnxDocumentEncoder", "check_onnx_reps", "export_onnx", "onnx_available"]

# Slack over PyTorch's own fp32 error (see the module docstring) and fp32 ulps of the largest rep.
_ERROR_FACTOR = 4.0
_ULPS = 8.0


def onnx_available() -> bool:
    """True when ``onnx``, ``onnxscript`` (torch's exporter) and ``onnxruntime`` can be imported."""
    return importable("onnx", "onnxruntime", "onnxscript")


def _require_onnx() -> None:
    if not onnx_available():
        raise ValueError(
            "the ONNX export needs onnx, onnxscript and onnxruntime: pip install 'gradcache_sparton[onnx]'"
        )


class OnnxDocumentEncoder(nn.Module):
    """A :class:`~gradcache_sparton.modeling.SpladeEncoder` written with exportable operations: ``[B, S]``
    ``input_ids``, ``attention_mask`` -> ``[B, V]`` reps equal to the encoder's (the logits materialised).

    Encoder-only backbones (BERT, DistilBERT, RoBERTa, XLM-R, ModernBERT) without ``echo``: a decoder's
    bidirectional mask and echo's doubled inputs are refused with a ``ValueError``.
    """

    def __init__(self, encoder: nn.Module) -> None:
        super().__init__()
        # What a SpladeEncoder offers (evaluation sits beside modeling, so it does not import it).
        if not all(
            hasattr(encoder, name) for name in ("token_hidden_states", "head", "echo", "prefix_length")
        ):
            raise TypeError(f"encoder must be a SpladeEncoder, got {type(encoder).__name__}")
        if encoder.echo or not type(encoder.model).__name__.endswith("ForMaskedLM"):
            raise ValueError(
                "the ONNX export takes encoder-only backbones without echo (BERT, RoBERTa, XLM-R, "
                f"ModernBERT, ...); got model_type {encoder.config.model_type!r}"
                + (" with echo" if encoder.echo else "")
            )
        self.encoder = encoder
        # torch.isin exports through searchsorted, which ONNX lacks: an equality against each id instead.
        self.special_ids = [int(i) for i in encoder.special_token_ids]

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        pooled = attention_mask != 0  # [B, S]
        for token_id in self.special_ids:
            pooled = pooled & (input_ids != token_id)
        if self.encoder.prefix_length > 0:
            pooled = pooled & (attention_mask.long().cumsum(-1) > self.encoder.prefix_length)
        hidden = self.encoder.token_hidden_states(input_ids, attention_mask)  # [B, S, D]
        head = self.encoder.head
        logits = F.linear(hidden, head.weight, head.bias)  # [B, S, D] @ [D, V] -> [B, S, V]
        # The activation is >= 0, so zeroing an unpooled position removes it from the max, as the head does.
        weights = splade_activation(logits, head.activation_function)  # [B, S, V]
        return (weights * pooled[:, :, None].to(logits.dtype)).amax(dim=1)  # [B, V]


def export_onnx(encoder: nn.Module, path: str | Path, *, opset_version: int = 18) -> Path:
    """Write ``encoder`` (a :class:`~gradcache_sparton.modeling.SpladeEncoder`, on the CPU, in fp32) to
    ``path`` as ONNX: inputs ``input_ids`` and ``attention_mask`` [B, S] int64 with dynamic B and S, output
    ``reps`` [B, V] float32. The file is written under a temporary name and renamed when complete."""
    _require_onnx()
    path = Path(path)
    if path.suffix != ".onnx":
        raise ValueError(f"output_file {str(path)!r} must end in .onnx")
    module = OnnxDocumentEncoder(encoder).to("cpu", torch.float32).eval()
    example = (torch.full((2, 16), 1000, dtype=torch.int64), torch.ones(2, 16, dtype=torch.int64))
    batch, sequence = torch.export.Dim("batch"), torch.export.Dim("sequence")
    partial = path.with_name(path.name + ".partial")
    try:
        with torch.no_grad():
            program = torch.onnx.export(
                module,
                example,
                input_names=["input_ids", "attention_mask"],
                output_names=["reps"],
                dynamic_shapes={
                    "input_ids": {0: batch, 1: sequence},
                    "attention_mask": {0: batch, 1: sequence},
                },
                opset_version=opset_version,
                dynamo=True,
                verbose=False,
            )
        program.save(str(partial))
        partial.replace(path)
    finally:
        partial.unlink(missing_ok=True)
    return path


@dataclass(frozen=True)
class OnnxCheck:
    """onnxruntime's reps against PyTorch's on ``texts``: the largest absolute differences and the bound."""

    texts: int
    max_abs_diff_to_torch: float
    onnx_error: float  # largest |onnxruntime fp32 - PyTorch fp64|
    torch_error: float  # largest |PyTorch fp32 - PyTorch fp64|
    bound: (
        float  # what onnx_error may reach: _ERROR_FACTOR x torch_error + _ULPS fp32 ulps of the largest rep
    )

    @property
    def passed(self) -> bool:
        return self.onnx_error <= self.bound


def check_onnx_reps(
    path: str | Path,
    encoder: nn.Module,
    texts: Sequence[str],
    *,
    tokenizer: PreTrainedTokenizerBase,
    max_length: int,
    batch_size: int = 8,
) -> OnnxCheck:
    """Run the ONNX model at ``path`` with onnxruntime on the CPU over ``texts`` and compare its reps with
    ``encoder``'s (fp32 and fp64, on the CPU): the bound of the module docstring. Memory: the [b, S, V]
    logits of one batch in fp64 (8 x 256 x 30,522: 0.5 GB)."""
    _require_onnx()
    import onnxruntime

    if not texts:
        raise ValueError("texts is empty: nothing to check the export on")
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    fp32 = OnnxDocumentEncoder(encoder).to("cpu", torch.float32).eval()
    fp64 = OnnxDocumentEncoder(_copy(encoder)).to("cpu", torch.float64).eval()
    diff = onnx_error = torch_error = largest = 0.0
    for start in range(0, len(texts), batch_size):
        features = tokenizer(
            list(texts[start : start + batch_size]),
            max_length=max_length,
            truncation=True,
            padding=True,
            return_tensors="pt",
        )
        ids, mask = features["input_ids"], features["attention_mask"]
        (served,) = session.run(None, {"input_ids": ids.numpy(), "attention_mask": mask.numpy()})
        served = torch.from_numpy(served).double()  # [b, V]
        with torch.no_grad():
            ours, exact = fp32(ids, mask).double(), fp64(ids, mask)  # [b, V] each
        diff = max(diff, (served - ours).abs().max().item())
        onnx_error = max(onnx_error, (served - exact).abs().max().item())
        torch_error = max(torch_error, (ours - exact).abs().max().item())
        largest = max(largest, exact.abs().max().item())
    bound = _ERROR_FACTOR * torch_error + _ULPS * torch.finfo(torch.float32).eps * largest
    return OnnxCheck(len(texts), diff, onnx_error, torch_error, bound)


def _copy(module: nn.Module) -> Any:
    import copy

    return copy.deepcopy(module)
