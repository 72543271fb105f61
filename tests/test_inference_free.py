"""Inference-free models: the query table, the routed model, its file format, and GradCache over it.

Tolerance of the cached-vs-uncached comparisons: fp32, rtol 1e-5 relative to each parameter's largest
gradient, as tests/test_cached_loss.py (mini-batch summation order and trimmed attention move results by
<= 1e-6; a lost, doubled or mis-routed mini-batch is an O(1) error).
"""

from __future__ import annotations

import json

import pytest
import torch
from engine_helpers import assert_grads_close, grads_of, make_columns, small_config
from transformers import BertForMaskedLM

from gradcache_sparton.engine import CachedLoss
from gradcache_sparton.losses import SpladeLoss, SpladeLossConfig
from gradcache_sparton.modeling import (
    QUERY_TABLE_NAME,
    InferenceFreeEncoder,
    QueryTable,
    SpladeEncoder,
    idf_weights,
    load_query_table,
    save_query_table,
    write_token_weights,
)
from gradcache_sparton.primitives.column_routing import call_encoder, routes_by_column

RTOL_FP32 = 1e-5  # see the module docstring
BATCH = 8


def _model(config, *, frozen: bool, seed: int = 0) -> InferenceFreeEncoder:
    torch.manual_seed(seed)
    encoder = SpladeEncoder(BertForMaskedLM(config).eval())
    weight = torch.rand(config.vocab_size, generator=torch.Generator().manual_seed(seed + 1)) + 0.5
    table = QueryTable(weight, special_token_ids=[0], frozen=frozen)
    return InferenceFreeEncoder.from_document_encoder(encoder, table)


def test_query_rep_counts_each_attended_token_once() -> None:
    """A query's rep is its distinct attended non-special tokens' weights: repeats once, padding and specials never."""
    table = QueryTable(torch.arange(10, dtype=torch.float32), special_token_ids=[1])
    input_ids = torch.tensor([[1, 3, 3, 5, 0], [1, 7, 0, 0, 0]])  # 1 special, 0 padding
    attention_mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 0, 0, 0]])
    reps = table(input_ids, attention_mask)
    expected = torch.zeros(2, 10)
    expected[0, 3], expected[0, 5], expected[1, 7] = 3.0, 5.0, 7.0
    torch.testing.assert_close(reps, expected, rtol=0, atol=0)


def test_padding_id_also_in_text_counts() -> None:
    """A token id attended at one position and padded at another counts (no scatter race between the two)."""
    table = QueryTable(torch.ones(5))
    reps = table(torch.tensor([[0, 2, 0, 0]]), torch.tensor([[1, 1, 0, 0]]))
    torch.testing.assert_close(reps, torch.tensor([[1.0, 0.0, 1.0, 0.0, 0.0]]), rtol=0, atol=0)


def test_idf_matches_formula(tokenizer) -> None:
    """IDF is log(1 + (N - df + 0.5) / (df + 0.5)) over documents with a non-special token; specials 0."""
    idf = idf_weights(["cat cat dog", "dog", "", "[SEP]"], tokenizer)
    cat, dog, bird = tokenizer.convert_tokens_to_ids(["cat", "dog", "bird"])
    n = 2  # the empty text and the special-only one are no documents

    def formula(df: int) -> float:
        return float(torch.log1p(torch.tensor((n - df + 0.5) / (df + 0.5), dtype=torch.float64)))

    assert idf[cat].item() == pytest.approx(formula(1), rel=1e-6)
    assert idf[dog].item() == pytest.approx(formula(2), rel=1e-6)
    assert idf[bird].item() == pytest.approx(formula(0), rel=1e-6)
    assert (idf[tokenizer.all_special_ids] == 0).all()


def test_routes_by_column(tiny_bert_config) -> None:
    """The query column goes to the table, any other to SPLADE; no column is a clear error."""
    model = _model(small_config(tiny_bert_config), frozen=True)
    assert routes_by_column(model) and not routes_by_column(model.document_encoder())
    features = make_columns(2, 1)["query"]
    torch.testing.assert_close(call_encoder(model, "query", features), model.query_table(**features))
    torch.testing.assert_close(
        call_encoder(model, "positive", features), model.document_encoder()(**features)
    )
    with pytest.raises(ValueError, match="column='query'"):
        model(**features)


def test_save_and_load_round_trip(tmp_path, tiny_bert_config, tokenizer) -> None:
    """A saved inference-free model loads back with the same reps on both sides; the table file is documented."""
    config = tiny_bert_config
    model = _model(config, frozen=False)
    model.save_pretrained(tmp_path, tokenizer=tokenizer)
    assert (tmp_path / QUERY_TABLE_NAME).is_file() and (tmp_path / "model.safetensors").is_file()
    loaded = InferenceFreeEncoder.from_pretrained(tmp_path)
    assert not loaded.query_table.frozen and loaded.query_table.special_token_ids == (0,)
    features = {k: v for k, v in make_columns(2, 1, vocab_size=config.vocab_size)["query"].items()}
    for column in ("query", "document"):
        torch.testing.assert_close(loaded(**features, column=column), model(**features, column=column))
    # The siamese loader reads the same folder as its document encoder.
    siamese = SpladeEncoder.from_pretrained(tmp_path)
    torch.testing.assert_close(siamese(**features), model(**features, column="document"))


def test_token_weights_json_maps_every_token(tmp_path, tokenizer) -> None:
    """idf.json maps every token string to its weight, exactly, in id order (sentence-transformers' format)."""
    weight = torch.rand(len(tokenizer))
    path = write_token_weights(QueryTable(weight), tokenizer, tmp_path / "idf.json")
    mapping = json.loads(path.read_text(encoding="utf-8"))
    assert list(mapping) == tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    assert torch.equal(torch.tensor(list(mapping.values()), dtype=torch.float32), weight)


def test_bad_table_file_is_named(tmp_path) -> None:
    """A table file with another tensor or a 2-D weight is refused, naming the file."""
    from safetensors.torch import save_file

    save_file({"weight": torch.ones(2, 3)}, str(tmp_path / QUERY_TABLE_NAME))
    with pytest.raises(ValueError, match=QUERY_TABLE_NAME):
        load_query_table(tmp_path)
    save_query_table(QueryTable(torch.ones(4), frozen=False), tmp_path)
    assert not load_query_table(tmp_path).frozen and load_query_table(tmp_path, frozen=True).frozen


@pytest.mark.parametrize("frozen", [True, False], ids=["frozen", "learned"])
@pytest.mark.parametrize("mini_batch_size", [1, 3, BATCH])
@pytest.mark.parametrize("contrastive", ["infonce", "margin_mse"])
def test_cached_matches_uncached_inference_free(
    tiny_bert_config, frozen: bool, mini_batch_size: int, contrastive: str
) -> None:
    """Cached = uncached for table queries and SPLADE documents: the loss and every gradient, the table's included."""
    model = _model(small_config(tiny_bert_config), frozen=frozen)
    columns = make_columns(BATCH, 3)
    loss_kwargs = {}
    if contrastive == "margin_mse":
        loss_kwargs["teacher_scores"] = torch.randn(BATCH, 2, generator=torch.Generator().manual_seed(3))
    loss_fn = SpladeLoss(SpladeLossConfig(contrastive=contrastive, query_reg_weight=0.0, doc_reg_weight=0.1))

    reference, _ = loss_fn({c: model(**f, column=c) for c, f in columns.items()}, **loss_kwargs)
    reference.backward()
    ref_grads = grads_of(model)
    model.zero_grad()

    loss = CachedLoss(model, loss_fn, mini_batch_size=mini_batch_size)(columns, **loss_kwargs)
    loss.backward()
    torch.testing.assert_close(loss.detach(), reference.detach(), rtol=RTOL_FP32, atol=0)
    grads = grads_of(model)
    assert_grads_close(grads, ref_grads, rtol=RTOL_FP32)
    table_grad = model.query_table.weight.grad
    assert (
        table_grad is None
    ) == frozen  # frozen: never replayed; learned: a gradient at the queries' tokens
    if not frozen:
        assert float(table_grad.abs().max()) > 0


def _write_beir(folder) -> object:
    """A BEIR folder of 8 topics: each query judges its own topic's document; 8 distractors."""
    topics = ["protein", "star", "cell", "gene", "virus", "planet", "enzyme", "neuron"]
    (folder / "qrels").mkdir(parents=True)
    docs = [
        {"_id": f"d{i}", "title": t, "text": f"the {t} was measured in a lab"} for i, t in enumerate(topics)
    ]
    docs += [{"_id": f"x{i}", "title": "", "text": f"noise number {i} says little"} for i in range(8)]
    queries = [{"_id": f"q{i}", "text": f"what about the {t} {t}"} for i, t in enumerate(topics)]
    (folder / "corpus.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (folder / "queries.jsonl").write_text("".join(json.dumps(q) + "\n" for q in queries))
    qrels = "".join(f"q{i}\td{i}\t1\n" for i in range(len(topics)))
    (folder / "qrels" / "train.tsv").write_text("query-id\tcorpus-id\tscore\n" + qrels)
    return folder


def test_cli_idf_train_evaluate_mine_export(tmp_path, tiny_bert_config, tokenizer, capsys) -> None:
    """`idf` makes an inference-free model; `train --query_encoder learned_idf` trains its table and saves both
    sides; `evaluate`, `mine` and `export` take it (queries by the table, the table exported as idf.json)."""
    from gradcache_sparton.cli import main

    beir = _write_beir(tmp_path / "beir")
    torch.manual_seed(0)
    SpladeEncoder.from_config(tiny_bert_config).save_pretrained(tmp_path / "doc", tokenizer=tokenizer)
    start = tmp_path / "start"
    assert main(["idf", "--model_name_or_path", str(tmp_path / "doc"), "--beir_path", str(beir),
                 "--output_dir", str(start)]) == 0  # fmt: skip
    assert json.loads(capsys.readouterr().out)["documents"] == 16
    table = load_query_table(start)
    assert table.frozen and table.weight[tokenizer.convert_tokens_to_ids("protein")] > 0
    assert (start / "idf.json").is_file()
    assert main(["idf", "--model_name_or_path", str(tmp_path / "doc"), "--beir_path", str(beir),
                 "--output_dir", str(start)]) == 2  # fmt: skip
    assert "already has a query_table.safetensors" in capsys.readouterr().err

    run = tmp_path / "run"
    argv = ["train", "--model_name_or_path", str(start), "--query_encoder", "learned_idf", "--train_beir",
            str(beir), "--per_device_train_batch_size", "4", "--mini_batch_size", "2", "--query_max_length", "16",
            "--document_max_length", "16", "--max_steps", "1", "--learning_rate", "0.1", "--use_cpu",
            "--disable_tqdm", "True", "--output_dir", str(run)]  # fmt: skip
    assert main(argv) == 0
    capsys.readouterr()
    trained = load_query_table(run)
    assert not trained.frozen and not torch.equal(trained.weight, table.weight)  # learned: moved
    noise = tokenizer.convert_tokens_to_ids("noise")  # in no query: its weight stays
    assert trained.weight[noise] == table.weight[noise]

    argv = ["evaluate", "--model_name_or_path", str(run), "--beir_path", str(beir), "--split", "train",
            "--query_max_length", "16", "--document_max_length", "16", "--device", "cpu"]  # fmt: skip
    assert main(argv) == 0
    metrics = json.loads(capsys.readouterr().out)
    queries = [json.loads(line)["text"] for line in (beir / "queries.jsonl").read_text().splitlines()]
    distinct = [len(set(tokenizer(text, add_special_tokens=False)["input_ids"])) for text in queries]
    assert metrics["query_nonzeros"] == pytest.approx(sum(distinct) / len(distinct))  # each token once
    mined = tmp_path / "mined.jsonl"
    argv = ["mine", "--beir_path", str(beir), "--method", "splade", "--model_name_or_path", str(run),
            "--device", "cpu", "--output_file", str(mined), "--num_negatives", "1"]  # fmt: skip
    assert main(argv) == 0 and mined.is_file()
    capsys.readouterr()
    out = tmp_path / "export" / "corpus.jsonl"
    argv = ["export", "--model_name_or_path", str(run), "--beir_path", str(beir), "--output_file", str(out),
            "--device", "cpu"]  # fmt: skip
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out)
    weights = json.loads((tmp_path / "export" / "corpus.idf.json").read_text())
    assert summary["query_weights_file"].endswith("corpus.idf.json") and len(weights) == len(tokenizer)
    assert weights["protein"] == pytest.approx(
        trained.weight[tokenizer.convert_tokens_to_ids("protein")].item()
    )


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_doc_l0_threshold_masks_sparse_documents(sparse: bool) -> None:
    """With doc_reg_l0_threshold t, documents of <= t non-zeros add nothing to FLOPS, still counted in its mean."""
    from gradcache_sparton.primitives.sparse_reps import SparseReps

    q = torch.rand(2, 6)
    docs = torch.tensor(
        [[1.0, 2.0, 0, 0, 0, 0], [0, 0, 3.0, 0, 0, 0], [0, 1.0, 1.0, 1.0, 0, 0], [2.0, 0, 0, 0, 0, 5]]
    )
    pos, neg = docs[:2].clone().requires_grad_(), docs[2:].clone().requires_grad_()
    config = SpladeLossConfig(query_reg_weight=0.0, doc_reg_weight=1.0, doc_reg_l0_threshold=1)
    reps = {"query": q, "positive": pos, "negative_1": neg}
    if sparse:
        reps = {name: SparseReps.from_dense(value, dtype=None) for name, value in reps.items()}
    _, components = SpladeLoss(config)(reps)
    kept = docs * torch.tensor([[1.0], [0.0], [1.0], [1.0]])  # row 1 has one non-zero: masked
    expected = (kept.sum(0) / 4).square().sum()
    torch.testing.assert_close(components["reg_doc"], expected)
    with pytest.raises(ValueError, match="doc_reg_l0_threshold"):
        SpladeLossConfig(doc_regularizer="l1", doc_reg_l0_threshold=1)


def test_data_parallel_learned_table_matches_one_process(tmp_path) -> None:
    """Under DDP on 2 ranks the learned table's gradient is synchronised like the encoder's: every rank holds
    the single process's gradients on the global batch (the last replayed mini-batch is a document one)."""
    import inference_free_ranks as ranks
    from rank_launch import launch_ranks

    launch_ranks(
        [ranks.__file__, str(tmp_path)], world_size=ranks.WORLD_SIZE, log_dir=tmp_path, timeout_s=150
    )
    model = ranks.learned_model()
    reference = CachedLoss(model, ranks.loss(), mini_batch_size=ranks.MINI_BATCH)(ranks.global_batch())
    reference.backward()
    expected = grads_of(model)
    for rank in range(ranks.WORLD_SIZE):
        saved = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        torch.testing.assert_close(saved["loss"], reference.detach(), rtol=RTOL_FP32, atol=0)
        assert_grads_close(saved["grads"], expected, rtol=RTOL_FP32)


def test_not_written_as_a_siamese_sentence_transformers_model(tiny_bert_config) -> None:
    """An inference-free model's sentence-transformers files describe its Router (queries by the table), never
    a siamese SparseEncoder, whose queries they would encode with SPLADE (tests/test_inference_free_st.py
    loads them)."""
    from gradcache_sparton.integrations.sentence_transformers import sentence_transformers_can_load

    model = _model(small_config(tiny_bert_config), frozen=True)
    assert sentence_transformers_can_load(model.document_encoder()) and sentence_transformers_can_load(model)
