"""Inference-free models and sentence-transformers, both ways: its ``Router`` (a ``SparseStaticEmbedding``
query route, a fill-mask ``Transformer`` + ``SpladePooling`` document route) trained through the fused head
and the GradCache engine, ours saved as that ``Router``, and its ``Router`` loaded as ours.

Every model is a tiny BERT built from a config (no hub). Gradient comparisons run in fp64 as in
tests/test_sentence_transformers.py (the only difference between the two paths is summation order, ~1e-16
relative: 1e-10 leaves margin yet fails on any real difference). Query reps are a scatter of the weights:
exact in any precision. Document reps of a saved model are compared in fp32 bit for bit, as the siamese
export's are (on the CPU the fused head and sentence-transformers' decoder run the same products).
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from transformers import BertForMaskedLM, BertTokenizer

pytest.importorskip("sentence_transformers", reason="needs the sentence-transformers extra")

from engine_helpers import save_small_masked_lm
from sentence_transformers import SparseEncoder
from sentence_transformers.base.modules import Router, Transformer
from sentence_transformers.sparse_encoder.losses import (
    FlopsLoss,
    SparseMultipleNegativesRankingLoss,
    SpladeLoss,
)
from sentence_transformers.sparse_encoder.modules import SparseStaticEmbedding, SpladePooling

from gradcache_sparton.engine import CachedLoss
from gradcache_sparton.integrations.sentence_transformers import (
    as_rep_encoder,
    inference_free_encoder_from,
    is_inference_free_sparse_encoder,
    sentence_transformers_can_load,
    splade_loss_config_from,
    use_sparton_head,
    uses_sparton_head,
    write_sentence_transformers_files,
)
from gradcache_sparton.losses import SpladeLoss as OurSpladeLoss
from gradcache_sparton.modeling import InferenceFreeEncoder, QueryTable, SpladeEncoder
from gradcache_sparton.primitives.column_routing import routes_by_column

TOL = 1e-10  # fp64, see the module docstring

QUERIES = ["what causes rain", "sunny weather today", "who drove to work", "cells divide and divide"]
POSITIVES = [
    "Rain forms when water vapour condenses into droplets heavy enough to fall.",
    "It is so sunny outside.",
    "He took the car to the office this morning.",
    "Mitosis is how a cell divides into two identical cells.",
]
NEGATIVES = ["A recipe for bread.", "Stock markets fell.", "The cat sleeps.", "Volcanoes erupt lava and ash."]


@pytest.fixture(scope="module")
def backbone_dir(tmp_path_factory) -> Path:
    """A tiny dropout-free BERT masked-LM over the shipped vocabulary's first 3,000 tokens, with a decoder bias."""
    return save_small_masked_lm(tmp_path_factory.mktemp("bert"))


def router_model(path: Path, *, frozen: bool, dtype: torch.dtype = torch.float64) -> SparseEncoder:
    """sentence-transformers' inference-free layout over ``path``: random query weights, special tokens' not 0
    (as its default all-ones init): its own queries never hold them, ours must not count them."""
    transformer = Transformer(
        str(path), transformer_task="fill-mask", max_seq_length=64, model_kwargs={"local_files_only": True}
    )
    weight = torch.rand(len(transformer.tokenizer), generator=torch.Generator().manual_seed(3)) * 4 + 0.5
    static = SparseStaticEmbedding(tokenizer=transformer.tokenizer, weight=weight, frozen=frozen)
    router = Router.for_query_document(
        query_modules=[static], document_modules=[transformer, SpladePooling("max")]
    )
    return SparseEncoder(modules=[router], similarity_fn_name="dot", device="cpu").to(dtype)


def tensors(batch: dict) -> dict[str, torch.Tensor]:
    return {key: value for key, value in batch.items() if isinstance(value, torch.Tensor)}


def dense(reps: torch.Tensor) -> torch.Tensor:
    return reps.to_dense() if reps.is_sparse else reps


@pytest.mark.parametrize("frozen", [True, False], ids=["frozen", "learned"])
def test_converted_router_gives_sentence_transformers_reps(backbone_dir, frozen: bool) -> None:
    """After use_sparton_head a Router's query and document reps equal its own; the decoder never runs for documents."""
    reference = router_model(backbone_dir, frozen=frozen)
    model = use_sparton_head(copy.deepcopy(reference))
    assert is_inference_free_sparse_encoder(model) and uses_sparton_head(model)
    assert [type(m) for m in model.children()] == [Router]
    calls = []
    model[0].sub_modules["document"][0].auto_model.get_output_embeddings().register_forward_hook(
        lambda *args: calls.append(1)
    )
    for task, texts in (("query", QUERIES), ("document", POSITIVES)):
        batch = reference.preprocess(texts, task=task)
        expected = reference(dict(batch))["sentence_embedding"]
        actual = model(dict(batch))["sentence_embedding"]
        assert (expected > 0).any()
        tolerance = 0 if task == "query" else TOL
        torch.testing.assert_close(actual, expected, rtol=tolerance, atol=tolerance)
    assert calls == []
    torch.testing.assert_close(
        dense(model.encode_document(POSITIVES, convert_to_tensor=True)),
        dense(reference.encode_document(POSITIVES, convert_to_tensor=True)),
        rtol=TOL,
        atol=TOL,
    )
    torch.testing.assert_close(
        dense(model.encode_query(QUERIES, convert_to_tensor=True)),
        dense(reference.encode_query(QUERIES, convert_to_tensor=True)),
        rtol=0,
        atol=0,
    )


@pytest.mark.parametrize("frozen", [True, False], ids=["frozen", "learned"])
@pytest.mark.parametrize("threshold", [None, 40], ids=["flops", "flops_l0"])
def test_cached_loss_matches_sentence_transformers_on_a_router(backbone_dir, frozen: bool, threshold) -> None:
    """CachedLoss over the converted Router with the mapped loss: loss and every gradient (query weights
    included, or none when frozen) equal sentence-transformers' SpladeLoss without a query regularizer."""
    reference = router_model(backbone_dir, frozen=frozen).train()
    model = use_sparton_head(copy.deepcopy(reference))

    def st_loss(on: SparseEncoder) -> SpladeLoss:
        return SpladeLoss(
            on,
            loss=SparseMultipleNegativesRankingLoss(on, scale=0.5),
            document_regularizer_weight=3e-3,
            document_regularizer=FlopsLoss(on, threshold=threshold),
            query_regularizer_weight=None,
        )

    st_columns = [reference.preprocess(QUERIES, task="query")]
    st_columns += [reference.preprocess(texts, task="document") for texts in (POSITIVES, NEGATIVES)]
    expected = sum(st_loss(reference)([dict(c) for c in st_columns], labels=None).values())
    expected.backward()

    config = splade_loss_config_from(st_loss(model))
    assert config.query_reg_weight == 0.0 and config.doc_reg_l0_threshold == threshold
    encoder = as_rep_encoder(model)
    assert routes_by_column(encoder) and encoder.trains_column("query") is not frozen
    # Our collator's tokenization: queries with [CLS]/[SEP], which the query route must not count.
    names = ("query", "positive", "negative_1")
    ours = {
        name: tensors(reference.preprocess(texts, task="document"))
        for name, texts in zip(names, (QUERIES, POSITIVES, NEGATIVES), strict=True)
    }
    actual = CachedLoss(encoder, OurSpladeLoss(config), mini_batch_size=3)(ours)
    actual.backward()

    torch.testing.assert_close(actual, expected, rtol=TOL, atol=TOL)
    expected_grads = {n: p.grad for n, p in reference.named_parameters() if p.grad is not None}
    actual_grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    static = "0.sub_modules.query.0.weight"
    assert expected_grads.keys() == actual_grads.keys() and (static in expected_grads) is not frozen
    for name, grad in expected_grads.items():
        torch.testing.assert_close(actual_grads[name], grad, rtol=1e-8, atol=TOL, msg=name)


def test_router_layouts_without_a_counterpart_are_refused(backbone_dir) -> None:
    """Other routes, route mappings, a siamese model into InferenceFreeEncoder, use_document_regularizer_only: one clear error."""
    model = router_model(backbone_dir, frozen=True)
    transformer, pooling = model[0].sub_modules["document"]
    static = model[0].sub_modules["query"][0]
    mapped = Router(
        {"query": [static], "document": [transformer, pooling]}, route_mappings={("query", None): "query"}
    )
    with pytest.raises(ValueError, match="route_mappings"):
        use_sparton_head(SparseEncoder(modules=[mapped], device="cpu"))
    both_splade = Router.for_query_document(
        query_modules=[transformer, pooling], document_modules=[transformer, pooling]
    )
    with pytest.raises(ValueError, match="SparseStaticEmbedding"):
        use_sparton_head(SparseEncoder(modules=[both_splade], device="cpu"))
    with pytest.raises(ValueError, match="siamese"):
        inference_free_encoder_from(SparseEncoder(modules=[transformer, pooling], device="cpu"))
    everything = SpladeLoss(
        model,
        loss=SparseMultipleNegativesRankingLoss(model),
        document_regularizer_weight=1e-3,
        use_document_regularizer_only=True,
    )
    with pytest.raises(ValueError, match="query_regularizer_weight=None"):
        splade_loss_config_from(everything)


def our_inference_free(path: Path) -> InferenceFreeEncoder:
    """An InferenceFreeEncoder over ``path``'s backbone (fp32, eval): random table weights, special tokens' not 0."""
    tokenizer = BertTokenizer.from_pretrained(path)
    encoder = SpladeEncoder(BertForMaskedLM.from_pretrained(path).eval())
    weight = torch.rand(len(tokenizer), generator=torch.Generator().manual_seed(5)) + 0.5
    table = QueryTable(weight, special_token_ids=tokenizer.all_special_ids, frozen=False)
    model = InferenceFreeEncoder.from_document_encoder(encoder, table)
    model.query_max_length, model.document_max_length = 6, 32
    return model


def test_our_inference_free_checkpoint_loads_in_sentence_transformers(backbone_dir, tmp_path) -> None:
    """Saved with its sentence-transformers files, ours is a Router whose encode_query / encode_document give
    exactly our reps (queries truncated where our collator truncates them), and still loads as ours."""
    ours = our_inference_free(backbone_dir)
    tokenizer = BertTokenizer.from_pretrained(backbone_dir)
    path = tmp_path / "inference-free"
    ours.save_pretrained(path, tokenizer=tokenizer)
    assert sentence_transformers_can_load(ours)
    write_sentence_transformers_files(path, encoder=ours, max_seq_length=32)

    loaded = SparseEncoder(str(path), device="cpu", local_files_only=True)
    assert [type(m) for m in loaded.children()] == [Router]
    static = loaded[0].sub_modules["query"][0]
    assert type(static) is SparseStaticEmbedding and not static.frozen
    assert "encode_query" in (path / "README.md").read_text()
    long_query = "what causes rain and snow and hail in the mountains"
    queries = [*QUERIES, "rain [SEP] snow", long_query]  # a special token spelled out counts nowhere
    # Ours: the collator's tokenization (special tokens, query_max_length 6); theirs: their own (none, 4).
    batch = tokenizer(queries, padding=True, truncation=True, max_length=6, return_tensors="pt")
    assert int(batch["attention_mask"][-1].sum()) == 6  # the long query is truncated
    expected = ours(**batch, column="query")
    assert (expected[:, tokenizer.cls_token_id] == 0).all() and (expected > 0).any()
    torch.testing.assert_close(
        dense(loaded.encode_query(queries, convert_to_tensor=True)), expected, rtol=0, atol=0
    )
    batch = tokenizer(POSITIVES, padding=True, truncation=True, max_length=32, return_tensors="pt")
    with torch.no_grad():
        expected = ours(**batch, column="document")
    theirs = dense(loaded.encode_document(POSITIVES, convert_to_tensor=True))
    assert (expected > 0).any()
    torch.testing.assert_close(theirs, expected, rtol=0, atol=0)

    again = InferenceFreeEncoder.from_pretrained(path)
    torch.testing.assert_close(again.query_table.weight, ours.query_table.weight, rtol=0, atol=0)


def test_sentence_transformers_router_loads_as_our_inference_free_encoder(backbone_dir, tmp_path) -> None:
    """inference_free_encoder_from(Router model) gives its encode_query / encode_document reps; saved in our
    format and loaded back, the same; the table is as frozen as the SparseStaticEmbedding."""
    st_model = router_model(backbone_dir, frozen=True, dtype=torch.float32).eval()
    ours = inference_free_encoder_from(st_model)
    assert ours.query_table.frozen and ours.document_max_length == 64
    tokenizer = st_model.tokenizer
    query_batch = tokenizer(QUERIES, padding=True, return_tensors="pt")
    doc_batch = tokenizer(POSITIVES, padding=True, return_tensors="pt")
    theirs_q = dense(st_model.encode_query(QUERIES, convert_to_tensor=True))
    theirs_d = dense(st_model.encode_document(POSITIVES, convert_to_tensor=True))
    with torch.no_grad():
        torch.testing.assert_close(ours(**query_batch, column="query"), theirs_q, rtol=0, atol=0)
        torch.testing.assert_close(ours(**doc_batch, column="document"), theirs_d, rtol=0, atol=0)
        ours.save_pretrained(tmp_path / "ours", tokenizer=tokenizer)
        loaded = InferenceFreeEncoder.from_pretrained(tmp_path / "ours")
        torch.testing.assert_close(loaded(**query_batch, column="query"), theirs_q, rtol=0, atol=0)
        torch.testing.assert_close(loaded(**doc_batch, column="document"), theirs_d, rtol=0, atol=0)
    assert loaded.query_table.frozen


@pytest.mark.slow
def test_trainer_trains_a_router_and_saves_its_format(backbone_dir, tmp_path) -> None:
    """CachedSpladeTrainer trains an inference-free Router (learned query weights move, at the query table's
    learning rate; no query regularizer) and saves a Router that sentence-transformers loads with equal reps."""
    from datasets import Dataset

    from gradcache_sparton.arguments import CachedSpladeTrainingArguments
    from gradcache_sparton.trainer import CachedSpladeTrainer

    model = router_model(backbone_dir, frozen=False, dtype=torch.float32)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    rows = Dataset.from_dict({"anchor": QUERIES, "positive": POSITIVES, "negative": NEGATIVES})
    args = CachedSpladeTrainingArguments(
        output_dir=str(tmp_path / "run"),
        per_device_train_batch_size=4,
        mini_batch_size=2,
        max_steps=2,
        learning_rate=1e-2,
        query_reg_weight=1e-3,
        doc_reg_weight=1e-3,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        query_max_length=16,
        document_max_length=32,
    )
    trainer = CachedSpladeTrainer(model, args, train_dataset=rows, processing_class=model.tokenizer)
    assert trainer.loss.config.query_reg_weight == 0.0
    static = model[0].sub_modules["query"][0].weight
    groups = [(g["lr"], [id(p) for p in g["params"]]) for g in trainer.create_optimizer().param_groups]
    assert [lr for lr, ids in groups if id(static) in ids] == [args.table_learning_rate()] != [1e-2]
    trainer.train()
    moved = {name for name, p in model.named_parameters() if not torch.equal(before[name], p)}
    assert "0.sub_modules.query.0.weight" in moved and len(moved) > 10
    trainer.save_model(str(tmp_path / "final"))
    loaded = SparseEncoder(str(tmp_path / "final"), device="cpu", local_files_only=True)
    model.eval()
    for task, texts in (("query", QUERIES), ("document", POSITIVES)):
        batch = model.preprocess(texts, task=task)
        torch.testing.assert_close(
            loaded(dict(batch))["sentence_embedding"],
            model(dict(batch))["sentence_embedding"],
            rtol=0,
            atol=0,
        )


def test_idf_command_output_loads_in_sentence_transformers(backbone_dir, tmp_path) -> None:
    """`idf` writes the inference-free Router files too: SparseEncoder(folder).encode_query is the IDF table's rep."""
    from gradcache_sparton.pipeline import run_idf

    siamese = SpladeEncoder(BertForMaskedLM.from_pretrained(backbone_dir))
    siamese.save_pretrained(tmp_path / "doc", tokenizer=BertTokenizer.from_pretrained(backbone_dir))
    run_idf(str(tmp_path / "doc"), output_dir=tmp_path / "idf")
    ours = InferenceFreeEncoder.from_pretrained(tmp_path / "idf")
    loaded = SparseEncoder(str(tmp_path / "idf"), device="cpu", local_files_only=True)
    assert [type(m) for m in loaded.children()] == [Router] and loaded[0].sub_modules["query"][0].frozen
    batch = loaded.tokenizer(QUERIES, padding=True, return_tensors="pt")
    expected = ours(**batch, column="query")
    assert (expected > 0).any()
    torch.testing.assert_close(
        dense(loaded.encode_query(QUERIES, convert_to_tensor=True)), expected, rtol=0, atol=0
    )
