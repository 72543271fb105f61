"""The ONNX export of the document encoder: onnxruntime's reps equal PyTorch's within the derived bound."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from engine_helpers import make_tiny_bert_config

from gradcache_sparton.evaluation.onnx_export import (
    OnnxDocumentEncoder,
    check_onnx_reps,
    export_onnx,
    onnx_available,
)
from gradcache_sparton.modeling import SpladeEncoder

pytestmark = pytest.mark.skipif(
    not onnx_available(), reason="onnx, onnxscript and onnxruntime (the onnx extra)"
)

TEXTS = [
    "Protein folding in the cell membrane.",
    "a",
    "Tumour growth was slowed by the inhibitor in three of four mouse models studied here.",
    "Vitamin D",
]


@pytest.fixture(scope="module")
def exported(tmp_path_factory, tokenizer) -> tuple[Path, SpladeEncoder]:
    """A tiny random BERT SPLADE encoder (the real vocabulary, CLS and SEP unpooled), exported once."""
    torch.manual_seed(0)
    encoder = SpladeEncoder.from_config(
        make_tiny_bert_config(tokenizer), special_token_ids=(tokenizer.cls_token_id, tokenizer.sep_token_id)
    ).eval()
    path = export_onnx(encoder, tmp_path_factory.mktemp("onnx") / "doc.onnx")
    return path, encoder


def test_exportable_module_equals_the_encoder(exported, tokenizer) -> None:
    """The exportable form (materialised logits, special tokens unpooled) gives the encoder's own reps."""
    _, encoder = exported
    features = tokenizer(TEXTS, padding=True, return_tensors="pt")
    with torch.no_grad():
        want = encoder(features["input_ids"], features["attention_mask"])
        got = OnnxDocumentEncoder(encoder)(features["input_ids"], features["attention_mask"])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)  # fp32: two summation orders of one matmul


def test_onnxruntime_reps_equal_pytorch_within_the_derived_bound(exported, tokenizer) -> None:
    """onnxruntime's reps (other batch sizes and lengths than the export's example, padding) stay within
    the fp64-derived bound, and the bound is tight enough to catch a wrong graph (a dropped mask)."""
    path, encoder = exported
    check = check_onnx_reps(path, encoder, TEXTS, tokenizer=tokenizer, max_length=32, batch_size=3)
    assert check.passed and check.texts == len(TEXTS), check
    assert 0 < check.bound < 1e-3
    unmasked = SpladeEncoder.from_config(encoder.config).eval()  # no special tokens unpooled
    unmasked.load_state_dict(encoder.state_dict())
    wrong = check_onnx_reps(path, unmasked, TEXTS, tokenizer=tokenizer, max_length=32)
    assert not wrong.passed and wrong.onnx_error > 100 * wrong.bound


def test_onnx_export_refuses_what_it_cannot_serve(tmp_path: Path, tiny_bert_config) -> None:
    """A name other than .onnx and a decoder-only backbone are refused before any export work."""
    from transformers import LlamaConfig

    with pytest.raises(ValueError, match=r"must end in \.onnx"):
        export_onnx(SpladeEncoder.from_config(tiny_bert_config), tmp_path / "doc.bin")
    llama = LlamaConfig(
        vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32
    )
    with pytest.raises(ValueError, match="encoder-only backbones"):
        export_onnx(SpladeEncoder.from_config(llama), tmp_path / "doc.onnx")
    assert not list(tmp_path.iterdir())


@pytest.mark.slow
def test_cli_exports_the_shipped_model_and_checks_it(tmp_path: Path, capsys) -> None:
    """`export --format onnx` writes the shipped SPLADE-tiny's document encoder, checked on the shipped
    corpus within the bound; an existing file is refused without --overwrite."""
    from gradcache_sparton.cli import main

    out = tmp_path / "serve" / "splade-tiny.onnx"
    argv = ["export", "--model_name_or_path", "splade-tiny-msmarco", "--format", "onnx"]
    argv += ["--output_file", str(out), "--document_max_length", "64"]
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out)
    assert out.is_file() and summary["checked_documents"] == 32
    assert summary["onnx_error_vs_fp64"] <= summary["bound"]
    assert main(argv) == 2 and "exists" in capsys.readouterr().err
