"""Li-LSR query tables (weight = log1p(relu(E · w + b))): the weights and their gradients against a hand
computation, GradCache over them, the file round trip, the start fitted to a table, and the CLI.

Tolerances: the hand computations are fp64 against the module run in fp64 (one product and one log1p
apart: 1e-12); cached against uncached in fp32 at rtol 1e-5 of each parameter's largest gradient, as
tests/test_inference_free.py (summation order moves results by <= 1e-6; a lost or doubled mini-batch
is an O(1) error).
"""

from __future__ import annotations

import json

import pytest
import torch
from engine_helpers import SMALL_VOCAB, assert_grads_close, grads_of, make_columns, small_config
from transformers import BertForMaskedLM

from gradcache_sparton.engine import CachedLoss
from gradcache_sparton.losses import SpladeLoss, SpladeLossConfig
from gradcache_sparton.modeling import (
    QUERY_TABLE_NAME,
    InferenceFreeEncoder,
    LiLsrTable,
    QueryTable,
    SpladeEncoder,
    li_lsr_table_from,
    load_query_table,
    save_query_table,
)

RTOL_FP32 = 1e-5  # see the module docstring
TOL_FP64 = 1e-12  # see the module docstring
BATCH = 8


def _table(vocab: int = SMALL_VOCAB, hidden: int = 6, *, dtype=torch.float32, seed: int = 0) -> LiLsrTable:
    generator = torch.Generator().manual_seed(seed)
    embedding = torch.randn(vocab, hidden, generator=generator, dtype=torch.float64)
    projection = torch.randn(hidden, generator=generator, dtype=torch.float64)
    # b = 0.5: some tokens below zero (relu off), most above
    return LiLsrTable(embedding, projection, 0.5, special_token_ids=[0, 2]).to(dtype)


def _model(config, *, seed: int = 0) -> InferenceFreeEncoder:
    torch.manual_seed(seed)
    encoder = SpladeEncoder(BertForMaskedLM(config).eval())
    return InferenceFreeEncoder.from_document_encoder(encoder, _table(config.vocab_size, seed=seed + 1))


def test_weight_and_gradients_match_hand_computation() -> None:
    """weight = log1p(relu(E w + b)) with specials 0; dL/dw and dL/db equal the chain rule written out."""
    table = _table(vocab=12, dtype=torch.float64)
    e, w, b = table.embedding, table.projection.detach(), table.bias.detach()
    z = e @ w + b  # [V]
    expected = torch.log1p(torch.relu(z))
    expected[[0, 2]] = 0
    assert (z < 0).any() and (z > 0).any()
    torch.testing.assert_close(table.weight, expected, rtol=TOL_FP64, atol=TOL_FP64)

    input_ids = torch.tensor([[0, 3, 5, 5, 7, 1], [2, 4, 11, 9, 1, 1]])
    attention_mask = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0]])
    coefficients = torch.randn(2, 12, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    (table(input_ids, attention_mask).double() * coefficients).sum().backward()
    present = torch.zeros(2, 12, dtype=torch.float64)
    present[0, [3, 5, 7]] = 1
    present[1, [4, 11, 9]] = 1
    d_weight = (present * coefficients).sum(0)  # [V]: dL/dweight, specials and padding never count
    d_z = d_weight * (z > 0) / (1 + torch.relu(z))  # d log1p(relu z) / dz
    d_z[[0, 2]] = 0
    torch.testing.assert_close(table.projection.grad, e.T @ d_z, rtol=TOL_FP64, atol=TOL_FP64)
    torch.testing.assert_close(table.bias.grad, d_z.sum().reshape(1), rtol=TOL_FP64, atol=TOL_FP64)


@pytest.mark.parametrize("mini_batch_size", [1, 3, BATCH])
def test_cached_matches_uncached_li_lsr(tiny_bert_config, mini_batch_size: int) -> None:
    """Cached = uncached with Li-LSR queries: the loss and every gradient, w and b included."""
    model = _model(small_config(tiny_bert_config))
    columns = make_columns(BATCH, 3)
    loss_fn = SpladeLoss(SpladeLossConfig(query_reg_weight=0.0, doc_reg_weight=0.1))
    reference, _ = loss_fn({c: model(**f, column=c) for c, f in columns.items()})
    reference.backward()
    expected = grads_of(model)
    model.zero_grad()
    loss = CachedLoss(model, loss_fn, mini_batch_size=mini_batch_size)(columns)
    loss.backward()
    torch.testing.assert_close(loss.detach(), reference.detach(), rtol=RTOL_FP32, atol=0)
    assert_grads_close(grads_of(model), expected, rtol=RTOL_FP32)
    for name in ("query_table.projection", "query_table.bias"):
        assert float(expected[name].abs().max()) > 0, name


@pytest.mark.parametrize("gathered", [False, True], ids=["module", "state_dict"])
def test_save_and_load_round_trip(tmp_path, tiny_bert_config, tokenizer, gathered: bool) -> None:
    """A saved Li-LSR model loads whole (E, w, b, specials, trained) with the same reps on both sides."""
    model = _model(tiny_bert_config)
    state_dict = model.state_dict() if gathered else None
    model.save_pretrained(tmp_path, tokenizer=tokenizer, state_dict=state_dict)
    loaded = InferenceFreeEncoder.from_pretrained(tmp_path)
    table = loaded.query_table
    assert isinstance(table, LiLsrTable) and not table.frozen and table.special_token_ids == (0, 2)
    for name, tensor in model.query_table.state_dict().items():
        assert torch.equal(table.state_dict()[name], tensor), name
    features = make_columns(2, 1, vocab_size=tiny_bert_config.vocab_size)["query"]
    for column in ("query", "document"):
        torch.testing.assert_close(loaded(**features, column=column), model(**features, column=column))
    assert load_query_table(tmp_path, frozen=True).frozen


def test_bad_li_lsr_file_is_named(tmp_path) -> None:
    """A Li-LSR file missing a tensor, or a file of an unknown kind, is refused naming the file."""
    from safetensors.torch import save_file

    tensors, metadata = _table().file_contents()
    del tensors["bias"]
    save_file(tensors, str(tmp_path / QUERY_TABLE_NAME), metadata)
    with pytest.raises(ValueError, match=f"{QUERY_TABLE_NAME}.*bias"):
        load_query_table(tmp_path)
    save_file({"weight": torch.ones(4)}, str(tmp_path / QUERY_TABLE_NAME), {"kind": "bm42"})
    with pytest.raises(ValueError, match=f"{QUERY_TABLE_NAME}.*'bm42'"):
        load_query_table(tmp_path)
    save_query_table(QueryTable(torch.ones(4)), tmp_path)  # a static table's file names no kind
    assert type(load_query_table(tmp_path)) is QueryTable


def test_fit_recovers_a_representable_table() -> None:
    """A table that is exactly log1p(E w + b) > 0 is fitted back (RMSE ~0, correlation 1); specials stay 0."""
    generator = torch.Generator().manual_seed(0)
    embedding = torch.randn(200, 8, generator=generator)
    weight = torch.log1p(torch.relu(embedding @ torch.randn(8, generator=generator) * 0.3 + 3.0))
    weight[0] = 0.0
    target = QueryTable(weight, special_token_ids=[0])
    fitted, record = li_lsr_table_from(target, embedding)
    assert (
        record["fit_tokens"] == 198
    )  # all but the special token and the largest weight (df = 0 by convention)
    assert record["fit_rmse"] < 1e-4 and record["fit_correlation"] > 0.9999
    torch.testing.assert_close(fitted.weight, weight, rtol=0, atol=1e-3)
    assert fitted.special_token_ids == (0,) and not fitted.frozen
    with pytest.raises(ValueError, match="embedding matrix"):
        li_lsr_table_from(target, embedding[:10])


def test_cli_train_li_lsr_and_export(tmp_path, tiny_bert_config, tokenizer, capsys) -> None:
    """`train --query_encoder li_lsr` from an IDF model fits the table, trains w and b (a token of no query moves
    too), saves it; `export` writes the table it induces as idf.json."""
    from test_inference_free import _write_beir

    from gradcache_sparton.cli import main

    beir = _write_beir(tmp_path / "beir")
    torch.manual_seed(0)
    SpladeEncoder.from_config(tiny_bert_config).save_pretrained(tmp_path / "doc", tokenizer=tokenizer)
    start = tmp_path / "start"
    assert main(["idf", "--model_name_or_path", str(tmp_path / "doc"), "--beir_path", str(beir),
                 "--output_dir", str(start)]) == 0  # fmt: skip
    run = tmp_path / "run"
    argv = ["train", "--model_name_or_path", str(start), "--query_encoder", "li_lsr", "--train_beir",
            str(beir), "--per_device_train_batch_size", "4", "--mini_batch_size", "2", "--query_max_length", "16",
            "--document_max_length", "16", "--max_steps", "1", "--learning_rate", "0.01", "--use_cpu",
            "--disable_tqdm", "True", "--output_dir", str(run)]  # fmt: skip
    assert main(argv) == 0
    capsys.readouterr()
    fitted, _ = li_lsr_table_from(
        load_query_table(start), SpladeEncoder.from_pretrained(start).model.get_input_embeddings().weight
    )
    trained = load_query_table(run)
    assert isinstance(trained, LiLsrTable) and not torch.equal(trained.projection, fitted.projection)
    noise = tokenizer.convert_tokens_to_ids("noise")  # in no query: moves all the same
    assert trained.weight[noise] != fitted.weight[noise]
    out = tmp_path / "export" / "corpus.jsonl"
    argv = ["export", "--model_name_or_path", str(run), "--beir_path", str(beir), "--output_file", str(out),
            "--device", "cpu"]  # fmt: skip
    assert main(argv) == 0
    weights = json.loads((tmp_path / "export" / "corpus.idf.json").read_text())
    induced = trained.weight.detach()
    assert len(weights) == len(tokenizer)
    assert weights["protein"] == pytest.approx(induced[tokenizer.convert_tokens_to_ids("protein")].item())
