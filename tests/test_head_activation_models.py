"""The head's ``activation_function="log1p_relu"`` (OpenSearch v3's "l0" activation) through the model: saved
in ``splade_config.json`` and loaded back, older folders as before, the ``train`` flag, and the
sentence-transformers bridge both ways (``SpladePooling(activation_function="log1p_relu")``).

Every model is a tiny BERT from a config (no hub). Comparisons with sentence-transformers' own forward are
exact (``rtol=0``) in fp32 as for the relu head (test_sentence_transformers.py), or within 1e-10 in fp64,
where the only difference is summation order; log1p is monotone, so max-then-activation and
activation-then-max pick the same value.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from engine_helpers import save_small_masked_lm
from transformers import BertTokenizer

from gradcache_sparton.modeling import InferenceFreeEncoder, QueryTable, SpladeEncoder

L0 = "log1p_relu"
TEXTS = ["what causes rain", "It is so sunny outside.", "Mitosis is how a cell divides into two cells."]


@pytest.fixture(scope="module")
def backbone_dir(tmp_path_factory) -> Path:
    """A tiny dropout-free BERT masked-LM over the shipped vocabulary's first 3,000 tokens, with a decoder bias."""
    return save_small_masked_lm(tmp_path_factory.mktemp("bert"))


def _batch(path: Path) -> dict[str, torch.Tensor]:
    return dict(BertTokenizer.from_pretrained(path)(TEXTS, padding=True, return_tensors="pt"))


def _reps(encoder: SpladeEncoder, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        return encoder.eval()(**batch)


# ---------------------------------------------------------------------------------------------- the model folder


def test_l0_encoder_saves_and_loads_its_activation(backbone_dir, tmp_path) -> None:
    """An encoder with log1p_relu writes it to splade_config.json and loads back with it and the same reps,
    which are log1p of the relu encoder's on the same weights."""
    batch = _batch(backbone_dir)
    encoder = SpladeEncoder.from_pretrained(backbone_dir, activation_function=L0)
    assert encoder.activation_function == L0 and "activation_function='log1p_relu'" in repr(encoder)
    reps = _reps(encoder, batch)
    relu = _reps(SpladeEncoder.from_pretrained(backbone_dir), batch)
    assert (relu > 0).any()
    torch.testing.assert_close(reps, torch.log1p(relu), rtol=1e-6, atol=0)  # one more log1p, nothing else
    encoder.save_pretrained(tmp_path / "l0")
    config = json.loads((tmp_path / "l0" / "splade_config.json").read_text())
    assert config["activation_function"] == L0
    loaded = SpladeEncoder.from_pretrained(tmp_path / "l0")
    assert loaded.activation_function == L0
    torch.testing.assert_close(_reps(loaded, batch), reps, rtol=0, atol=0)
    overridden = SpladeEncoder.from_pretrained(tmp_path / "l0", activation_function="relu")
    torch.testing.assert_close(_reps(overridden, batch), relu, rtol=0, atol=0)


def test_relu_folders_keep_their_file_and_older_folders_load_as_relu(backbone_dir, tmp_path) -> None:
    """The default activation is not written (pooling, masked ids and the query encoder are), and a
    splade_config.json without the field, as every older folder has, loads with relu."""
    SpladeEncoder.from_pretrained(backbone_dir).save_pretrained(tmp_path / "relu")
    assert set(json.loads((tmp_path / "relu" / "splade_config.json").read_text())) == {
        "pooling",
        "special_token_ids",
        "query_encoder",
    }
    assert SpladeEncoder.from_pretrained(tmp_path / "relu").activation_function == "relu"


@pytest.mark.parametrize("value", ["l0", 1, None])
def test_unknown_activation_in_splade_config_is_one_clear_error(backbone_dir, tmp_path, value) -> None:
    """A splade_config.json naming an unknown activation is a ValueError naming the file, before any weights load."""
    SpladeEncoder.from_pretrained(backbone_dir).save_pretrained(tmp_path / "bad")
    file = tmp_path / "bad" / "splade_config.json"
    file.write_text(json.dumps({"pooling": "max", "special_token_ids": [], "activation_function": value}))
    with pytest.raises(ValueError, match=r"splade_config.json: activation_function must be one of"):
        SpladeEncoder.from_pretrained(tmp_path / "bad")


def test_inference_free_model_keeps_the_activation(backbone_dir, tmp_path) -> None:
    """An inference-free model's document encoder keeps log1p_relu through from_document_encoder,
    document_encoder() and a save/load round trip; its query table is untouched by it."""
    encoder = SpladeEncoder.from_pretrained(backbone_dir, activation_function=L0)
    tokenizer = BertTokenizer.from_pretrained(backbone_dir)
    table = QueryTable(torch.rand(len(tokenizer)) + 0.5, special_token_ids=tokenizer.all_special_ids)
    model = InferenceFreeEncoder.from_document_encoder(encoder, table)
    assert model.activation_function == L0 and model.document_encoder().activation_function == L0
    model.save_pretrained(tmp_path / "if", tokenizer=tokenizer)
    loaded = InferenceFreeEncoder.from_pretrained(tmp_path / "if")
    assert loaded.activation_function == L0
    batch = _batch(backbone_dir)
    with torch.no_grad():
        torch.testing.assert_close(
            loaded.eval()(**batch, column="document"), _reps(encoder, batch), rtol=0, atol=0
        )


def test_onnx_form_of_an_l0_encoder_gives_its_reps(backbone_dir) -> None:
    """The ONNX export's module (materialised logits) applies the encoder's log1p_relu activation: its reps
    equal the fused head's, not the relu head's."""
    from gradcache_sparton.evaluation.onnx_export import OnnxDocumentEncoder

    encoder = SpladeEncoder.from_pretrained(backbone_dir, activation_function=L0).eval()
    batch = _batch(backbone_dir)
    with torch.no_grad():
        got = OnnxDocumentEncoder(encoder)(batch["input_ids"], batch["attention_mask"])
    torch.testing.assert_close(got, _reps(encoder, batch), rtol=0, atol=1e-5)  # fp32: two matmul orders
    assert (torch.expm1(got) - got).abs().max() > 1e-3  # the relu reps (expm1 of these) would not pass


# ---------------------------------------------------------------------------------------------- the train flag


def test_train_flag_reaches_the_model_and_a_bad_value_is_one_error(backbone_dir, tmp_path, capsys) -> None:
    """`train --activation_function log1p_relu` is the ModelArguments field the model is built with; an
    unknown value is one error line naming the flag and its choices (exit 2), before any model is built or
    anything written, and a ValueError naming the field from Python."""
    from gradcache_sparton.arguments import ModelArguments
    from gradcache_sparton.cli import main
    from gradcache_sparton.cli.train import train_parser
    from gradcache_sparton.model_loading import build_encoder, build_tokenizer

    argv = [
        "--model_name_or_path",
        str(backbone_dir),
        "--activation_function",
        L0,
        "--output_dir",
        str(tmp_path),
    ]
    model_args, *_ = train_parser().parse_args_into_dataclasses(args=argv)
    assert model_args.activation_function == L0
    assert build_encoder(model_args, build_tokenizer(model_args)).activation_function == L0
    bad = ["train", "--activation_function", "l0", "--output_dir", str(tmp_path / "run"), "--use_cpu"]
    assert main(bad) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert (
        "argument --activation_function" in err and "invalid choice: 'l0'" in err and "'log1p_relu'" in err
    ), err
    assert not (tmp_path / "run").exists()
    with pytest.raises(ValueError, match=r"activation_function must be one of \['relu', 'log1p_relu'\]"):
        ModelArguments(activation_function="l0")


# ---------------------------------------------------------------------------------------------- sentence-transformers

needs_st = pytest.mark.skipif(
    importlib.util.find_spec("sentence_transformers") is None, reason="needs the sentence-transformers extra"
)


def _l0_sparse_encoder(path: Path, dtype: torch.dtype = torch.float64):
    """sentence-transformers' own l0 model over ``path``: fill-mask Transformer + SpladePooling(max, log1p_relu)."""
    from sentence_transformers import SparseEncoder
    from sentence_transformers.base.modules import Transformer
    from sentence_transformers.sparse_encoder.modules import SpladePooling

    transformer = Transformer(
        str(path), transformer_task="fill-mask", max_seq_length=64, model_kwargs={"local_files_only": True}
    )
    pooling = SpladePooling("max", activation_function=L0)
    return SparseEncoder(modules=[transformer, pooling], device="cpu").to(dtype)


@needs_st
def test_l0_sparse_encoder_converts_with_equal_reps(backbone_dir) -> None:
    """A SparseEncoder with SpladePooling(activation_function="log1p_relu") converts (it was refused) and its
    fused reps equal sentence-transformers' own forward; the engine's view gives the same."""
    import copy

    from gradcache_sparton.integrations.sentence_transformers import as_rep_encoder, use_sparton_head

    reference = _l0_sparse_encoder(backbone_dir)
    model = use_sparton_head(copy.deepcopy(reference))
    batch = reference.preprocess(TEXTS)
    expected = reference(dict(batch))["sentence_embedding"]
    actual = model(dict(batch))["sentence_embedding"]
    assert (expected > 0).any()
    torch.testing.assert_close(actual, expected, rtol=1e-10, atol=1e-10)  # fp64: summation order only
    view = as_rep_encoder(model)(**{k: v for k, v in batch.items() if k in ("input_ids", "attention_mask")})
    torch.testing.assert_close(view, expected, rtol=1e-10, atol=1e-10)


@needs_st
def test_our_l0_checkpoint_is_an_l0_sparse_encoder_with_exactly_our_reps(backbone_dir, tmp_path) -> None:
    """Ours with log1p_relu, exported, is a SparseEncoder whose SpladePooling says log1p_relu, with exactly our
    reps; sentence-transformers' own save of it loads back as ours with that activation and the same reps."""
    from sentence_transformers import SparseEncoder

    from gradcache_sparton.integrations.sentence_transformers import write_sentence_transformers_files

    encoder = SpladeEncoder.from_pretrained(backbone_dir, activation_function=L0).eval()
    tokenizer = BertTokenizer.from_pretrained(backbone_dir)
    path = tmp_path / "ours"
    encoder.save_pretrained(path, tokenizer=tokenizer)
    write_sentence_transformers_files(path, encoder=encoder, max_seq_length=32)
    assert "log1p(log1p(relu(logits)))" in (path / "README.md").read_text()
    loaded = SparseEncoder(str(path), device="cpu", local_files_only=True)
    assert loaded[1].activation_function == L0
    batch = loaded.preprocess(TEXTS)
    ours = _reps(encoder, {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)})
    theirs = loaded(dict(batch))["sentence_embedding"]
    assert (ours > 0).any()
    torch.testing.assert_close(theirs, ours, rtol=0, atol=0)

    native = tmp_path / "native"  # no splade_config.json: the SpladePooling's config names the activation
    _l0_sparse_encoder(backbone_dir, torch.float32).save(str(native))
    assert not (native / "splade_config.json").exists()
    again = SpladeEncoder.from_pretrained(native)
    assert again.activation_function == L0
    torch.testing.assert_close(_reps(again, batch_tensors(batch)), ours, rtol=0, atol=0)


def batch_tensors(batch: dict) -> dict[str, torch.Tensor]:
    return {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}


@needs_st
def test_l0_router_loads_as_our_inference_free_encoder(backbone_dir) -> None:
    """inference_free_encoder_from over a Router whose document route pools with log1p_relu keeps the
    activation: its document reps equal encode_document's."""
    from sentence_transformers import SparseEncoder
    from sentence_transformers.base.modules import Router, Transformer
    from sentence_transformers.sparse_encoder.modules import SparseStaticEmbedding, SpladePooling

    from gradcache_sparton.integrations.sentence_transformers import inference_free_encoder_from

    transformer = Transformer(
        str(backbone_dir),
        transformer_task="fill-mask",
        max_seq_length=64,
        model_kwargs={"local_files_only": True},
    )
    static = SparseStaticEmbedding(
        tokenizer=transformer.tokenizer, weight=torch.rand(3000) + 0.5, frozen=True
    )
    router = Router.for_query_document(
        query_modules=[static], document_modules=[transformer, SpladePooling("max", activation_function=L0)]
    )
    st_model = SparseEncoder(modules=[router], similarity_fn_name="dot", device="cpu").eval()
    ours = inference_free_encoder_from(st_model)
    assert ours.activation_function == L0
    theirs = st_model.encode_document(TEXTS, convert_to_tensor=True)
    theirs = theirs.to_dense() if theirs.is_sparse else theirs
    batch = dict(st_model.tokenizer(TEXTS, padding=True, return_tensors="pt"))
    with torch.no_grad():
        torch.testing.assert_close(ours.eval()(**batch, column="document"), theirs, rtol=0, atol=0)
