"""Evaluation: metrics vs hand-computed rankings, chunked retrieval, encoding, evaluator, Trainer callback."""

from __future__ import annotations

import itertools
import json
import math
import random
from pathlib import Path

import pytest
import torch
from torch import Tensor, nn
from transformers import BertForMaskedLM, Trainer, TrainingArguments

from gradcache_sparton.arguments import ModelArguments
from gradcache_sparton.cli import main
from gradcache_sparton.data import QUERY_COLUMN, BeirData, TrainingCollator, load_beir
from gradcache_sparton.evaluation import (
    MAX_SEISMIC_NONZEROS,
    EncodingSettings,
    PruningBudget,
    RetrievalEvalCallback,
    SparseReps,
    SparseRetrievalEvaluator,
    build_seismic_index,
    encode_texts,
    export_corpus,
    ndcg_at_k,
    parse_measures,
    prune_reps,
    recall_at_k,
    reciprocal_rank_at_k,
    retrieval_metrics,
    retrieve,
    retrieve_seismic,
    search_seismic,
    seismic_available,
    write_trec_run,
)
from gradcache_sparton.modeling import SpladeEncoder
from gradcache_sparton.primitives.column_routing import DOCUMENT_COLUMN

# ------------------------------------------------------------------------------------------ encoders


class BagOfWords(nn.Module):
    """rep[b, v] = relu(weight[v]) if token v occurs (unmasked, not special) in row b, else 0: a
    transparent [B, V] encoder whose scores are hand-computable (weight starts at 1: a term-overlap count)."""

    def __init__(self, vocab_size: int, special_ids: list[int]) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(vocab_size))
        self.register_buffer("special", torch.tensor(special_ids))

    def forward(
        self, input_ids: Tensor, attention_mask: Tensor, token_type_ids: Tensor | None = None
    ) -> Tensor:
        keep = attention_mask.bool() & ~torch.isin(input_ids, self.special)  # [B, S]
        values = torch.relu(self.weight)[input_ids] * keep  # [B, S]
        reps = torch.zeros(input_ids.shape[0], self.weight.numel(), device=input_ids.device)
        return reps.scatter_reduce(1, input_ids, values, reduce="amax")  # [B, V]


@pytest.fixture
def bag_of_words(tokenizer) -> BagOfWords:
    return BagOfWords(len(tokenizer), tokenizer.all_special_ids)


# ------------------------------------------------------------------------------------------- metrics


def test_metrics_match_hand_computed_ranking() -> None:
    """nDCG@10 (linear gain, log2 discount, ideal from all judged docs), MRR@10 and Recall@k by hand."""
    ranking = ["a", "b", "c", "d", "e"]
    relevance = {"b": 2, "d": 1, "z": 1, "c": 0, "e": -1}  # z relevant but never retrieved; c, e not relevant
    # DCG = 2/log2(3) + 1/log2(5) = 1.26186 + 0.43068 = 1.69254
    # IDCG = 2/log2(2) + 1/log2(3) + 1/log2(4) = 2 + 0.63093 + 0.5 = 3.13093; nDCG = 0.540586
    assert ndcg_at_k(ranking, relevance, 10) == pytest.approx(1.69254 / 3.13093, abs=1e-5)
    assert ndcg_at_k(ranking, relevance, 10) == pytest.approx(0.540586, abs=1e-6)
    # @2 keeps only "b" at rank 2 and the two best ideal gains: (2/log2(3)) / (2 + 1/log2(3)).
    assert ndcg_at_k(ranking, relevance, 2) == pytest.approx(1.26186 / 2.63093, abs=1e-5)
    assert reciprocal_rank_at_k(ranking, relevance, 10) == 0.5  # first relevant ("b") at rank 2
    assert reciprocal_rank_at_k(ranking, relevance, 1) == 0.0  # not within the top 1
    assert recall_at_k(ranking, relevance, 100) == pytest.approx(2 / 3)  # b and d of {b, d, z}
    assert recall_at_k(ranking, relevance, 3) == pytest.approx(1 / 3)  # only b in the top 3
    perfect = ["b", "d", "z"]
    assert ndcg_at_k(perfect, relevance, 10) == pytest.approx(1.0)
    assert ndcg_at_k(["d", "b", "z"], relevance, 10) == pytest.approx(
        (1 + 2 / math.log2(3) + 0.5) / 3.13093, abs=1e-5
    )
    assert ndcg_at_k(ranking, {"c": 0}, 10) == 0.0 and recall_at_k(ranking, {}, 10) == 0.0


def test_metrics_average_over_queries_with_a_relevant_doc() -> None:
    """The mean is over queries with relevance > 0 only: an all-zero query is left out, not counted as 0."""
    rankings = {"q1": ["a", "b"], "q2": ["b", "a"], "q3": ["a", "b"]}
    qrels = {"q1": {"a": 1}, "q2": {"a": 1}, "q3": {"a": 0, "b": 0}}
    metrics = retrieval_metrics(rankings, qrels, measures=["nDCG@10", "RR@10", "R@1"])
    assert set(metrics) == {"ndcg_at_10", "mrr_at_10", "recall_at_1"}
    assert metrics["mrr_at_10"] == pytest.approx((1 + 1 / 2) / 2)
    assert metrics["ndcg_at_10"] == pytest.approx((1 + 1 / math.log2(3)) / 2)
    assert metrics["recall_at_1"] == pytest.approx(1 / 2)


def test_metric_errors() -> None:
    """Duplicate docs, a judged query without a ranking and qrels without relevant docs are ValueErrors."""
    with pytest.raises(ValueError, match="more than once"):
        ndcg_at_k(["a", "a"], {"a": 1}, 10)
    with pytest.raises(ValueError, match="k must be >= 1"):
        recall_at_k(["a"], {"a": 1}, 0)
    with pytest.raises(ValueError, match=r"no entry for 1 judged queries, e.g. \['q2'\]"):
        retrieval_metrics({"q1": ["a"]}, {"q1": {"a": 1}, "q2": {"a": 1}})
    with pytest.raises(ValueError, match="no query with a relevant document"):
        retrieval_metrics({"q1": ["a"]}, {"q1": {"a": 0}})


def reference_metrics(
    ranking: list[str], relevance: dict[str, int], k_ndcg: int, k_rr: int, k_r: int
) -> list[float]:
    """The hand-written nDCG / RR / recall this package used before ir_measures, as a reference."""
    gains = [relevance.get(doc, 0) for doc in ranking]
    dcg = sum(g / math.log2(rank + 1) for rank, g in enumerate(gains[:k_ndcg], start=1) if g > 0)
    ideal = sorted((r for r in relevance.values() if r > 0), reverse=True)[:k_ndcg]
    idcg = sum(r / math.log2(rank + 1) for rank, r in enumerate(ideal, start=1))
    rr = next((1.0 / rank for rank, g in enumerate(gains[:k_rr], start=1) if g > 0), 0.0)
    relevant = {doc for doc, r in relevance.items() if r > 0}
    return [dcg / idcg, rr, len(relevant.intersection(ranking[:k_r])) / len(relevant)]


def test_default_metrics_equal_the_previous_hand_written_values() -> None:
    """On a fixed random run (graded and negative relevance, relevant docs never retrieved, queries
    without a relevant doc), ir_measures' nDCG@10 / RR@10 / R@20 equal the former hand-written ones."""
    rng = random.Random(0)
    docs = [f"d{i}" for i in range(60)]
    rankings, qrels, expected = {}, {}, []
    for q in range(25):
        rankings[f"q{q}"] = rng.sample(docs, 30)
        qrels[f"q{q}"] = {doc: rng.choice([-1, 0, 0, 1, 1, 2, 3]) for doc in rng.sample(docs, 6)}
        if any(r > 0 for r in qrels[f"q{q}"].values()):
            expected.append(reference_metrics(rankings[f"q{q}"], qrels[f"q{q}"], 10, 10, 20))
    assert 5 < len(expected) < 25
    metrics = retrieval_metrics(rankings, qrels, measures=["nDCG@10", "RR@10", "R@20"])
    means = [sum(column) / len(expected) for column in zip(*expected, strict=True)]
    assert list(metrics) == ["ndcg_at_10", "mrr_at_10", "recall_at_20"]
    assert list(metrics.values()) == pytest.approx(means, abs=1e-12)


def test_any_ir_measures_measure() -> None:
    """AP, P@k and parametrised measures are computed by ir_measures under stable keys."""
    rankings = {"q1": ["a", "b", "c", "d"], "q2": ["d", "c", "b", "a"]}
    qrels = {"q1": {"b": 1, "d": 2}, "q2": {"a": 1}}
    metrics = retrieval_metrics(rankings, qrels, measures=["AP", "P@2", "R(rel=2)@10"])
    assert list(metrics) == ["map", "precision_at_2", "recall_rel_2_at_10"]
    assert metrics["map"] == pytest.approx(((1 / 2 + 2 / 4) / 2 + 1 / 4) / 2)
    assert metrics["precision_at_2"] == pytest.approx((1 / 2 + 0) / 2)
    assert metrics["recall_rel_2_at_10"] == pytest.approx((1 + 0) / 2)  # q2 has no doc of relevance >= 2
    with pytest.raises(ValueError, match="name one measure twice"):
        retrieval_metrics(rankings, qrels, measures=["AP", "AP"])


# ------------------------------------------------------------------------------ sparse reps, retrieval


def test_sparse_reps_round_trip() -> None:
    """from_dense / to_dense / select / concat keep every value and row; memory is the non-zeros only."""
    torch.manual_seed(0)
    dense = torch.randn(9, 37).relu() * (torch.rand(9, 37) < 0.3)
    dense[4] = 0  # an all-zero row
    reps = SparseReps.from_dense(dense)
    assert reps.weights.numel() == int((dense != 0).sum())
    assert torch.equal(reps.to_dense(), dense)
    assert torch.equal(reps.to_dense(2, 6), dense[2:6])
    assert reps.nonzeros_per_row().tolist() == (dense != 0).sum(1).tolist()
    order = torch.tensor([8, 4, 0, 3, 3])
    assert torch.equal(reps.select(order).to_dense(), dense[order])
    parts = [
        SparseReps.from_dense(dense[:3]),
        SparseReps.from_dense(dense[3:4]),
        SparseReps.from_dense(dense[4:]),
    ]
    assert torch.equal(SparseReps.concat(parts).to_dense(), dense)


def brute_force_ranking(q: Tensor, d: Tensor, k: int) -> tuple[list[list[float]], list[list[int]]]:
    """Full [Q, N] scores ranked by (score desc, doc index asc) in plain Python."""
    scores = (q.double() @ d.double().T).tolist()
    order = [sorted(range(len(row)), key=lambda j, row=row: (-row[j], j))[:k] for row in scores]
    return [[row[j] for j in idx] for row, idx in zip(scores, order, strict=True)], order


@pytest.mark.parametrize(("query_block", "doc_chunk"), [(1024, 2048), (3, 7), (1, 1), (5, 50)])
def test_retrieve_matches_brute_force_and_breaks_ties_by_index(query_block: int, doc_chunk: int) -> None:
    """Chunked top-k equals the full ranking exactly, ties to the lower doc index, for any block sizes."""
    torch.manual_seed(1)
    # Small integer weights: every dot product is exact in fp32 (so equal scores are truly equal) and
    # with 4 active terms of 6 there are many ties.
    q = torch.randint(0, 3, (11, 6)).float() * (torch.rand(11, 6) < 0.7)
    d = torch.randint(0, 3, (40, 6)).float() * (torch.rand(40, 6) < 0.7)
    for k in (1, 10, 40, 100):  # 100 > N: K = N
        scores, index = retrieve(q, d, top_k=k, query_block=query_block, doc_chunk=doc_chunk)
        expected_scores, expected_index = brute_force_ranking(q, d, k)
        assert index.tolist() == expected_index
        assert scores.tolist() == expected_scores
    assert index.shape == (11, 40)


def test_retrieve_accepts_sparse_reps_and_rejects_mismatch() -> None:
    """SparseReps and dense inputs give the same result; a vocabulary mismatch is a ValueError."""
    torch.manual_seed(2)
    q, d = torch.randn(4, 20).relu(), torch.randn(30, 20).relu()
    dense_result = retrieve(q, d, top_k=5)
    sparse_result = retrieve(SparseReps.from_dense(q), SparseReps.from_dense(d), top_k=5)
    assert torch.equal(dense_result[1], sparse_result[1])
    assert torch.allclose(dense_result[0], sparse_result[0])
    with pytest.raises(ValueError, match="V=20 but d_reps has V=21"):
        retrieve(q, torch.rand(3, 21), top_k=5)
    with pytest.raises(ValueError, match="top_k must be >= 1"):
        retrieve(q, d, top_k=0)


def dense_prune(dense: Tensor, top_k: int | None, threshold: float | None) -> Tensor:
    """Reference: per row, zero the weights <= threshold, then keep the top_k by (weight desc, id asc)."""
    out = dense.clone()
    if threshold is not None:
        out[out <= threshold] = 0
    if top_k is not None:
        for row in out:
            order = sorted(range(row.numel()), key=lambda j, row=row: (-row[j].item(), j))
            row[[j for j in order[top_k:]]] = 0
    return out


@pytest.mark.parametrize(
    ("top_k", "threshold"), [(None, None), (1, None), (3, None), (50, None), (None, 1.0), (2, 0.5)]
)
def test_prune_reps_matches_dense_reference(top_k: int | None, threshold: float | None) -> None:
    """Top-k per rep and a weight threshold keep exactly the entries a dense per-row sort keeps
    (ties at the cut: lower vocabulary id), rows with fewer entries untouched, empty rows kept empty."""
    torch.manual_seed(3)
    # Weights from {1, 2, 3} with ~40% density: many ties at every cut.
    dense = torch.randint(1, 4, (12, 15)).float() * (torch.rand(12, 15) < 0.4)
    dense[5] = 0
    pruned = prune_reps(SparseReps.from_dense(dense), top_k=top_k, threshold=threshold)
    assert torch.equal(pruned.to_dense(), dense_prune(dense, top_k, threshold))
    assert pruned.num_rows == 12


def test_pruning_budgets_parse_name_and_refuse_bad_values() -> None:
    """Q:D[:T] budgets parse to separate query/document top-k and a threshold; bad values are refused."""
    assert PruningBudget.parse("full") == PruningBudget()
    assert PruningBudget.parse("32:128") == PruningBudget(32, 128)
    assert PruningBudget.parse("all:64:0.5") == PruningBudget(None, 64, 0.5)
    assert [PruningBudget(32, 128).name, PruningBudget(None, 64, 0.5).name] == ["q32-d128", "qall-d64-t0.5"]
    for text in ("32", "0:5", "a:b", "1:2:x", "1:2:3:4"):
        with pytest.raises(ValueError, match=r"budget|must be a positive int"):
            PruningBudget.parse(text)
    with pytest.raises(ValueError, match="top_k must be a positive int"):
        prune_reps(SparseReps.from_dense(torch.ones(1, 3)), top_k=0)


def test_trec_run_file_reproduces_the_metrics(tmp_path: Path) -> None:
    """A written TREC run, read back by ir_measures, gives the metrics computed from the run in memory
    (scores here are distinct, so no tool-specific tie-break applies)."""
    import ir_measures

    run = {"q1": [("d3", 2.5), ("d1", 1.25), ("d2", 0.5)], "q2": [("d2", 3.0), ("d1", 0.75)]}
    qrels = {"q1": {"d1": 2, "d2": 1}, "q2": {"d1": 1}}
    path = write_trec_run(tmp_path / "run.trec", run, tag="test")
    assert path.read_text().splitlines()[:2] == ["q1 Q0 d3 1 2.5 test", "q1 Q0 d1 2 1.25 test"]
    measures = parse_measures(["nDCG@10", "RR@10", "AP"])
    from_file = ir_measures.calc_aggregate(measures, qrels, ir_measures.read_trec_run(str(path)))
    in_memory = retrieval_metrics(
        {q: [d for d, _ in hits] for q, hits in run.items()}, qrels, measures=["nDCG@10", "RR@10", "AP"]
    )
    assert list(in_memory.values()) == pytest.approx([from_file[m] for m in measures], abs=1e-12)
    with pytest.raises(ValueError, match="query id 'q 1' is empty or holds whitespace"):
        write_trec_run(tmp_path / "bad.trec", {"q 1": [("d1", 1.0)]}, tag="test")


# ----------------------------------------------------------------------------------------- encoding


def test_encode_texts_keeps_order_and_restores_mode(tokenizer, bag_of_words: BagOfWords) -> None:
    """Row i is text i's rep (whatever the sorting and batching); the module's train mode is restored."""
    texts = ["apple", "banana cherry grape apple", "", "cherry " * 40, "grape banana"]
    bag_of_words.train()
    reps = encode_texts(
        bag_of_words, texts, tokenizer=tokenizer, max_length=16, batch_size=2, show_progress=False
    )
    assert bag_of_words.training
    assert reps.num_rows == len(texts) and reps.vocab_size == len(tokenizer)
    for i, text in enumerate(texts):
        alone = bag_of_words(**tokenizer([text], truncation=True, max_length=16, return_tensors="pt"))
        assert torch.equal(reps.to_dense(i, i + 1), alone.detach()), text
    assert reps.nonzeros_per_row().tolist() == [1, 4, 0, 1, 2]


def test_encode_texts_rejects_bad_input(tokenizer, bag_of_words: BagOfWords) -> None:
    """Empty input, a max_length not a multiple of 8 and a wrong-shaped encoder output fail clearly."""
    with pytest.raises(ValueError, match="texts is empty"):
        encode_texts(bag_of_words, [], tokenizer=tokenizer, max_length=16)
    with pytest.raises(ValueError, match="max_length must be a positive multiple of 8"):
        encode_texts(bag_of_words, ["a"], tokenizer=tokenizer, max_length=30)
    with pytest.raises(ValueError, match=r"encoder must return a \[B, V\] tensor with B=1"):
        encode_texts(
            lambda **f: f["input_ids"][0], ["a"], tokenizer=tokenizer, max_length=16, show_progress=False
        )


def test_encoding_settings_truncate_each_column_to_its_length(tokenizer, bag_of_words: BagOfWords) -> None:
    """EncodingSettings.encode truncates queries to query_max_length and documents to document_max_length,
    device_for says where they are encoded, and it refuses a non-tokenizer, a batch_size < 1 and a length not a multiple of 8 when built."""
    encoding = EncodingSettings(tokenizer, query_max_length=8, document_max_length=16, show_progress=False)
    text = "apple " * 6 + "banana cherry"  # 8 tokens ([CLS], [SEP] included) hold the apples alone
    queries = encoding.encode(bag_of_words, [text], column=QUERY_COLUMN, desc="queries")
    documents = encoding.encode(bag_of_words, [text], column=DOCUMENT_COLUMN, desc="documents")
    assert queries.nonzeros_per_row().tolist() == [1] and documents.nonzeros_per_row().tolist() == [3]
    # device_for: the settings' device where given (a string too), else the encoder's (CPU for a callable)
    assert encoding.device_for(lambda **features: None) == torch.device("cpu")
    assert EncodingSettings(tokenizer, device="meta").device_for(bag_of_words) == torch.device("meta")
    with pytest.raises(TypeError, match="tokenizer must be a PreTrainedTokenizerBase"):
        EncodingSettings("bert-base-uncased")
    with pytest.raises(ValueError, match="batch_size must be >= 1, got 0"):
        EncodingSettings(tokenizer, batch_size=0)
    with pytest.raises(ValueError, match="query_max_length must be a positive multiple of 8, got 12"):
        EncodingSettings(tokenizer, query_max_length=12)


# ---------------------------------------------------------------------------------------- evaluator


def write_fruit_beir(folder: Path) -> Path:
    """4 docs, 3 queries: rankings under the bag-of-words encoder are computable by hand."""
    folder.mkdir(parents=True, exist_ok=True)
    docs = {"d1": "apple banana", "d2": "cherry", "d3": "apple", "d4": "banana cherry"}
    (folder / "corpus.jsonl").write_text(
        "".join(json.dumps({"_id": k, "title": "", "text": v}) + "\n" for k, v in docs.items())
    )
    queries = {"q1": "apple", "q2": "cherry", "q3": "grape"}
    (folder / "queries.jsonl").write_text(
        "".join(json.dumps({"_id": k, "text": v}) + "\n" for k, v in queries.items())
    )
    (folder / "qrels").mkdir(exist_ok=True)
    (folder / "qrels" / "test.tsv").write_text(
        "query-id\tcorpus-id\tscore\nq1\td3\t1\nq1\td1\t2\nq2\td1\t1\nq3\td2\t0\n"
    )
    return folder


def test_evaluator_matches_hand_computed_metrics(tmp_path: Path, tokenizer, bag_of_words: BagOfWords) -> None:
    """End to end on a hand-built BEIR folder: term-overlap scores, ties by corpus order, documents that
    share no term with the query (score 0) never retrieved, known metrics."""
    data = load_beir(write_fruit_beir(tmp_path / "fruit"), split="test")
    evaluator = SparseRetrievalEvaluator(
        data, encoding=EncodingSettings(tokenizer, show_progress=False), top_k=10
    )
    metrics = evaluator(bag_of_words)
    # q1 "apple": d1 and d3 score 1 (tie -> d1 first by corpus order), d2, d4 score 0 -> [d1, d3]:
    #   nDCG = (2/1 + 1/log2 3) / (2/1 + 1/log2 3) = 1, RR = 1, recall = 1.
    # q2 "cherry": d2, d4 score 1; its relevant d1 scores 0, so it is not retrieved -> [d2, d4]: nDCG 0,
    #   RR 0, recall 0 (ranking it by corpus order would have given 0.5, 1/3 and 1).
    # q3 has no relevant doc: left out.
    assert evaluator.search(*evaluator.encode(bag_of_words), device="cpu")["q2"] == [("d2", 1.0), ("d4", 1.0)]
    assert metrics == pytest.approx(
        {
            "ndcg_at_10": 0.5,
            "mrr_at_10": 0.5,
            "recall_at_10": 0.5,
            "query_nonzeros": 1.0,
            "doc_nonzeros": 1.5,
            "postings": 6.0,  # 2 + 1 + 1 + 2 terms
        }
    )


def test_evaluator_runs_tiny_splade_on_shipped_dev_subset(tokenizer, tiny_bert_mlm: BertForMaskedLM) -> None:
    """A random tiny SPLADE on a slice of the shipped dev set: valid metrics, repeatable, bf16 autocast."""
    from gradcache_sparton.data import default_dev_beir_path

    dev = load_beir(default_dev_beir_path(), split="dev")
    query_ids = list(dev.qrels)[:4]
    relevant = {d for q in query_ids for d in dev.qrels[q]}
    doc_ids = [d for d in dev.corpus if d in relevant][:8] + [d for d in dev.corpus if d not in relevant][:12]
    doc_ids = [d for d in dev.corpus if d in set(doc_ids)]
    subset = BeirData(
        corpus={d: dev.corpus[d] for d in doc_ids},
        queries={q: dev.queries[q] for q in query_ids},
        qrels={q: {d: r for d, r in dev.qrels[q].items() if d in set(doc_ids)} for q in query_ids},
    )
    encoder = SpladeEncoder(tiny_bert_mlm)  # the CPU path: the chunked reference head
    encoding = EncodingSettings(tokenizer, document_max_length=64, batch_size=8, show_progress=False)
    first = SparseRetrievalEvaluator(subset, encoding=encoding)(encoder)
    assert first == SparseRetrievalEvaluator(subset, encoding=encoding)(encoder)
    assert set(first) == {
        "ndcg_at_10",
        "mrr_at_10",
        "recall_at_100",
        "query_nonzeros",
        "doc_nonzeros",
        "postings",
    }
    assert all(0.0 <= first[k] <= 1.0 for k in ("ndcg_at_10", "mrr_at_10", "recall_at_100"))
    assert first["recall_at_100"] == 1.0  # 20 docs < 100: everything is retrieved
    assert 0 < first["query_nonzeros"] <= len(tokenizer) and 0 < first["doc_nonzeros"] <= len(tokenizer)
    encoding.autocast_dtype = torch.bfloat16
    bf16 = SparseRetrievalEvaluator(subset, encoding=encoding)(encoder)
    assert set(bf16) == set(first)


def test_evaluator_rejects_bad_settings(tmp_path: Path, tokenizer) -> None:
    """top_k < 10, max lengths not multiples of 8 and a non-BeirData raise before any encoding."""
    data = load_beir(write_fruit_beir(tmp_path / "fruit"), split="test")
    encoding = EncodingSettings(tokenizer)
    with pytest.raises(ValueError, match="top_k must be >= 10"):
        SparseRetrievalEvaluator(data, encoding=encoding, top_k=5)
    with pytest.raises(ValueError, match=r"top_k must be >= 1000 \(the largest cutoff"):
        SparseRetrievalEvaluator(data, encoding=encoding, measures=["nDCG@10", "R@1000"])
    with pytest.raises(ValueError, match=r"measure 'Foo@10' is not an ir_measures measure"):
        SparseRetrievalEvaluator(data, encoding=encoding, measures=["Foo@10"])
    with pytest.raises(ValueError, match="document_max_length must be a positive multiple of 8"):
        EncodingSettings(tokenizer, document_max_length=100)
    with pytest.raises(TypeError, match="data must be a BeirData"):
        SparseRetrievalEvaluator({"corpus": {}}, encoding=encoding)


# ------------------------------------------------------------------------------ `evaluate` command


@pytest.fixture
def tiny_checkpoint(tmp_path: Path, tiny_bert_config) -> Path:
    """A saved random tiny SPLADE checkpoint (no tokenizer files: `evaluate` uses the shipped one)."""
    torch.manual_seed(0)
    folder = tmp_path / "checkpoint"
    SpladeEncoder.from_config(tiny_bert_config).save_pretrained(folder)
    return folder


def evaluate_argv(checkpoint: Path, beir: Path, *extra: str) -> list[str]:
    return [
        "evaluate", "--model_name_or_path", str(checkpoint), "--beir_path", str(beir), "--split", "test",
        "--query_max_length", "16", "--document_max_length", "16", "--device", "cpu", *extra,
    ]  # fmt: skip


def test_evaluate_output_file_into_missing_folder(tmp_path: Path, tiny_checkpoint: Path, capsys) -> None:
    """`evaluate --output_file` into a folder that does not exist creates it and writes the metrics that
    it prints (before, the whole evaluation ran and then crashed without printing them)."""
    output = tmp_path / "new" / "deeper" / "metrics.json"
    beir = write_fruit_beir(tmp_path / "fruit")
    assert main(evaluate_argv(tiny_checkpoint, beir, "--output_file", str(output))) == 0
    printed = json.loads(capsys.readouterr().out)
    assert json.loads(output.read_text()) == printed and "ndcg_at_10" in printed


def test_evaluate_refuses_unwritable_output_before_any_work(tmp_path: Path, capsys) -> None:
    """An --output_file whose folder cannot be created (a file is in the way) or that is a directory is
    one clear error before any work: the model path given does not even exist, and is never read."""
    (tmp_path / "a_file").write_text("x")
    for output in (tmp_path / "a_file" / "metrics.json", tmp_path):
        argv = evaluate_argv(tmp_path / "no_model", tmp_path / "no_beir", "--output_file", str(output))
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "--output_file" in err and "Traceback" not in err and "model" not in err


def test_evaluate_at_budgets_reports_metrics_and_index_size(
    tmp_path: Path, tokenizer, bag_of_words: BagOfWords
) -> None:
    """One encoding, several budgets: the full budget equals a plain call; a top-1 document budget keeps
    one posting per document and ranks by the kept term only (hand-computed)."""
    data = load_beir(write_fruit_beir(tmp_path / "fruit"), split="test")
    evaluator = SparseRetrievalEvaluator(
        data, encoding=EncodingSettings(tokenizer, show_progress=False), top_k=10
    )
    with torch.no_grad():
        bag_of_words.weight[tokenizer.convert_tokens_to_ids("banana")] = 2.0
    full, top1 = evaluator.evaluate(bag_of_words, budgets=[PruningBudget(), PruningBudget(doc_top_k=1)])
    assert full.metrics == evaluator(bag_of_words) and full.budget.name == "full"
    assert top1.metrics["postings"] == 4.0 and top1.metrics["doc_nonzeros"] == 1.0
    assert full.metrics["postings"] == 6.0
    # Top-1 per doc: d1 "apple banana" and d4 "banana cherry" keep "banana" (weight 2), d2 "cherry",
    # d3 "apple". q1 "apple" -> [d3] (d1 now scores 0 and is not retrieved): DCG = 1 over IDCG =
    # 2 + 1/log2 3, RR 1. q2 "cherry" -> [d2]: its relevant d1 scores 0: nDCG 0, RR 0.
    assert [d for d, _ in top1.run["q1"]] == ["d3"]
    assert [d for d, _ in top1.run["q2"]] == ["d2"]
    ndcg_q1 = 1 / (2 + 1 / math.log2(3))
    assert top1.metrics["ndcg_at_10"] == pytest.approx(ndcg_q1 / 2)
    assert top1.metrics["mrr_at_10"] == pytest.approx(1 / 2)
    assert (full.metrics["ndcg_at_10"], full.metrics["mrr_at_10"]) == pytest.approx((0.5, 0.5))


def test_evaluate_several_folders_budgets_and_runs(tmp_path: Path, tiny_checkpoint: Path, capsys) -> None:
    """`evaluate` on two BEIR folders at two budgets: one row per (dataset, budget), the mean per budget,
    a table on stderr, the JSON on stdout and in --output_file, and one TREC run per row beside it."""
    first = write_fruit_beir(tmp_path / "fruit")
    second = write_fruit_beir(tmp_path / "more" / "veg")
    output = tmp_path / "out" / "metrics.json"
    argv = evaluate_argv(tiny_checkpoint, first, "--output_file", str(output), "--measures", "nDCG@10", "AP")
    argv[argv.index("--beir_path") + 1 : argv.index("--beir_path") + 2] = [str(first), str(second)]
    assert main([*argv, "--budgets", "full", "8:8", "--top_k", "10"]) == 0
    captured = capsys.readouterr()
    table = json.loads(captured.out)
    rows = ["fruit full", "fruit q8-d8", "veg full", "veg q8-d8", "mean full", "mean q8-d8"]
    assert list(table) == rows and json.loads(output.read_text()) == table
    assert list(table["fruit full"]) == ["ndcg_at_10", "map", "query_nonzeros", "doc_nonzeros", "postings"]
    assert table["fruit full"] == table["veg full"]  # the same data twice
    assert table["mean q8-d8"] == pytest.approx(table["fruit q8-d8"])
    assert table["fruit q8-d8"]["doc_nonzeros"] <= 8 < table["fruit full"]["doc_nonzeros"]
    assert "fruit q8-d8" in captured.err and "postings" in captured.err
    runs = sorted(p.name for p in output.parent.glob("*.trec"))
    assert runs == [f"metrics.{d}.{b}.trec" for d in ("fruit", "veg") for b in ("full", "q8-d8")]
    assert (
        len((output.parent / "metrics.fruit.full.trec").read_text().splitlines()) == 2 * 4
    )  # 2 queries x 4 docs


def test_evaluate_refuses_bad_measures_budgets_and_missing_cuda(
    tmp_path: Path, tiny_checkpoint: Path, capsys, monkeypatch
) -> None:
    """An unknown measure or a cutoff below 1, --top_k below 1, a malformed or repeated budget, --device
    cuda without CUDA and (with an
    --output_file for the runs) an id that cannot go into a TREC run are one clear line each, before
    the model is built (building it fails the test here)."""

    def no_model(*args: object, **kwargs: object) -> None:
        raise AssertionError("the model was built before the arguments were checked")

    monkeypatch.setattr("gradcache_sparton.pipeline.build_encoder", no_model)
    beir = write_fruit_beir(tmp_path / "fruit")
    spaced = write_fruit_beir(tmp_path / "spaced")
    (spaced / "corpus.jsonl").write_text((spaced / "corpus.jsonl").read_text().replace('"d4"', '"d 4"'))
    (spaced / "qrels" / "test.tsv").write_text("q1\td1\t1\n")
    for extra, message in (
        (["--measures", "Foo@10"], "is not an ir_measures measure"),
        (["--measures", "nDCG@0"], "its cutoff must be an integer >= 1"),  # pytrec_eval aborted on it
        (["--top_k", "-3"], "--top_k must be an int >= 1"),  # not a measure the user did not write
        (["--budgets", "32"], "must be 'full' or Q:D"),
        (["--budgets", "full", "full"], "budgets must be distinct"),
        (["--device", "cuda"], "CUDA is not available"),
        (
            ["--output_file", str(tmp_path / "m.json"), "--beir_path", str(spaced)],
            "cannot go into a TREC run",
        ),
    ):
        if extra[0] == "--device" and torch.cuda.is_available():
            continue
        argv = evaluate_argv(tiny_checkpoint, beir, *extra)
        if extra[0] == "--device":
            argv = argv[: argv.index("--device")] + argv[argv.index("--device") + 2 :] + extra
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, err


# ------------------------------------------------------------------------------ export, seismic index

needs_seismic = pytest.mark.skipif(
    not seismic_available(), reason="pyseismic-lsr (the seismic extra) is not installed"
)


def random_sparse(rows: int, vocab: int, per_row: int, seed: int) -> Tensor:
    """[rows, vocab] with per_row continuous positive weights per row: no two scores tie."""
    generator = torch.Generator().manual_seed(seed)
    dense = torch.zeros(rows, vocab)
    for row in dense:
        row[torch.randperm(vocab, generator=generator)[:per_row]] = (
            torch.rand(per_row, generator=generator) + 0.05
        )
    return dense


@needs_seismic
@pytest.mark.parametrize("seed", [4, 10, 22])
def test_seismic_index_agrees_with_exhaustive_search(seed: int) -> None:
    """With the exact defaults, the seismic index returns, for every query of the batch (not only the
    first), the top 20 documents of exhaustive search, each with its exact score up to seismic's value
    rounding, in an order that differs only between scores equal within that rounding.

    Seismic stores values in half precision (relative error 2**-11 each); a score of at most 6
    positive products then errs by less than ~1.5e-3 relative, bounded here by 5e-3 per score, so 1e-2
    between two scores: documents that close may swap places, also across the 20th rank."""
    q, d = random_sparse(12, 40, 5, seed=seed), random_sparse(300, 40, 6, seed=seed + 1)
    exact = q @ d.T
    # Three calls: pyseismic-lsr's batch_search went wrong on some calls only.
    found = [
        hits
        for _ in range(3)
        for hits in retrieve_seismic(
            SparseReps.from_dense(q), SparseReps.from_dense(d), top_k=20, num_threads=1
        )
    ]
    for row, hits in zip([*range(12)] * 3, found, strict=True):
        ranked = exact[row].sort(descending=True)
        kth = ranked.values[19].item()  # every row has > 20 documents sharing a term
        assert kth > 0 and len(hits) == 20
        clear = {
            i for i, s in zip(ranked.indices.tolist(), ranked.values.tolist(), strict=True) if s > kth * 1.01
        }
        assert clear <= {i for i, _ in hits}
        true_scores = [exact[row, i].item() for i, _ in hits]
        assert min(true_scores) >= kth * (1 - 1e-2)
        assert [s for _, s in hits] == pytest.approx(true_scores, rel=5e-3)
        for before, after in itertools.pairwise(true_scores):
            assert after <= before * (1 + 1e-2)


@needs_seismic
def test_seismic_build_keeps_stdout_for_results_and_refuses_dense_reps(capfd: pytest.CaptureFixture) -> None:
    """seismic's build log goes to stderr (stdout holds only results, e.g. evaluate's JSON); reps denser
    than MAX_SEISMIC_NONZEROS per document are refused before any build, naming the alternatives."""
    d_reps = SparseReps.from_dense(random_sparse(30, 40, 6, seed=3))
    build_seismic_index(d_reps, num_threads=1)
    captured = capfd.readouterr()
    assert captured.out == "" and "Building the index" in captured.err
    dense = torch.zeros(2, MAX_SEISMIC_NONZEROS + 8)
    dense[:, : MAX_SEISMIC_NONZEROS + 1] = 1.0
    with pytest.raises(ValueError, match=r"non-zeros on average.*--retrieval exhaustive"):
        build_seismic_index(SparseReps.from_dense(dense), num_threads=1)


@needs_seismic
def test_one_seismic_index_answers_several_searches() -> None:
    """An index built once answers repeated searches with retrieve_seismic's hits, and a query without
    terms retrieves nothing."""
    q, d = random_sparse(5, 40, 5, seed=30), random_sparse(200, 40, 6, seed=31)
    q[2] = 0
    q_reps, d_reps = SparseReps.from_dense(q), SparseReps.from_dense(d)
    index = build_seismic_index(d_reps, num_threads=1)
    first = search_seismic(index, q_reps, top_k=10)
    assert first == search_seismic(index, q_reps, top_k=10) == retrieve_seismic(q_reps, d_reps, top_k=10)
    assert first[2] == [] and all(len(hits) == 10 for i, hits in enumerate(first) if i != 2)


@needs_seismic
def test_seismic_index_from_one_document_at_a_time_equals_the_batched_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """pyseismic-lsr before 0.5.4 has no ``add_documents_by_id``: the index then built through
    ``add_document`` (string components, after the zero-weight vocabulary document) answers every query
    with the batched index's hits and scores, also with an empty document, a query whose terms only it
    lacks, a query with fewer matching documents than top_k and one that matches none; the vocabulary
    document is never among the hits."""
    q, d = random_sparse(8, 40, 5, seed=40), random_sparse(120, 40, 6, seed=41)
    d[7] = 0
    d[:, 38:] = 0
    d[[3, 50, 90], 38] = torch.tensor([0.5, 0.7, 0.9])  # term 38: in three documents; term 39: in none
    q[6], q[7] = 0, 0
    q[6, 38], q[7, 39] = 1.0, 1.0
    q_reps, d_reps = SparseReps.from_dense(q), SparseReps.from_dense(d)
    batched = search_seismic(build_seismic_index(d_reps, num_threads=1), q_reps, top_k=15)
    import seismic

    calls = []
    real_dataset = seismic.SeismicDataset

    class OldDataset:  # 0.5.2's surface: add_document only
        def __init__(self) -> None:
            self.wrapped = real_dataset()

        def add_document(self, *args: object) -> None:
            calls.append(args[0])
            self.wrapped.add_document(*args)

    real_build = seismic.SeismicIndex.build_from_dataset
    monkeypatch.setattr(seismic, "SeismicDataset", OldDataset)
    monkeypatch.setattr(
        seismic.SeismicIndex, "build_from_dataset", lambda dataset, **kw: real_build(dataset.wrapped, **kw)
    )
    one_by_one = search_seismic(build_seismic_index(d_reps, num_threads=1), q_reps, top_k=15)
    assert calls == ["vocabulary"] + [str(i) for i in range(120)]
    assert all(len(hits) == 15 for hits in batched[:6])
    assert [i for i, _ in batched[6]] == [90, 50, 3] and batched[7] == []
    # The vocabulary document numbers the components as the batched call does: same sums, same scores.
    assert one_by_one == batched


@needs_seismic
def test_evaluator_through_seismic_equals_exhaustive(
    tmp_path: Path, tokenizer, bag_of_words: BagOfWords
) -> None:
    """The evaluator's seismic path gives the exhaustive path's metrics on a folder without ties."""
    data = load_beir(write_fruit_beir(tmp_path / "fruit"), split="test")
    with torch.no_grad():  # distinct term weights: apple 1, banana 2, cherry 3 -> no tied documents
        for weight, token in enumerate(("apple", "banana", "cherry"), start=1):
            bag_of_words.weight[tokenizer.convert_tokens_to_ids(token)] = float(weight)
    data = BeirData(corpus=data.corpus, queries={"q1": "apple banana"}, qrels={"q1": data.qrels["q1"]})
    kwargs = {"encoding": EncodingSettings(tokenizer, show_progress=False), "top_k": 10}
    exhaustive = SparseRetrievalEvaluator(data, **kwargs)(bag_of_words)
    seismic = SparseRetrievalEvaluator(data, retrieval="seismic", **kwargs)(bag_of_words)
    assert seismic == pytest.approx(exhaustive, rel=1e-6)
    # The same documents in the same order: d2 shares no term with the query, and neither path returns it.
    runs = [
        SparseRetrievalEvaluator(data, retrieval=retrieval, **kwargs).search(
            *SparseRetrievalEvaluator(data, **kwargs).encode(bag_of_words), device="cpu"
        )
        for retrieval in ("exhaustive", "seismic")
    ]
    assert [[doc for doc, _ in hits] for hits in runs[0].values()] == [["d1", "d4", "d3"]]
    assert [[doc for doc, _ in hits] for hits in runs[1].values()] == [["d1", "d4", "d3"]]
    with pytest.raises(ValueError, match="retrieval must be one of"):
        SparseRetrievalEvaluator(data, retrieval="faiss", **kwargs)


def test_export_corpus_streams_both_formats(tmp_path: Path, tokenizer, bag_of_words: BagOfWords) -> None:
    """Exported lines hold each document's rep by term: float weights for seismic, round(w * scale)
    integers (zeros left out) for Anserini; chunking does not change the file; an encoder failing
    midway leaves no file under the final name."""
    docs = [
        ("d1", "apple banana"),
        ("d2", "cherry"),
        ("d3", "apple"),
        ("d4", "banana cherry"),
        ("d5", "grape"),
    ]
    with torch.no_grad():
        bag_of_words.weight[tokenizer.convert_tokens_to_ids("banana")] = 0.004  # quantizes to 0 at scale 100
        bag_of_words.weight[tokenizer.convert_tokens_to_ids("cherry")] = 1.236
    common = {"encoding": EncodingSettings(tokenizer, document_max_length=16, show_progress=False)}
    seismic_path = tmp_path / "corpus.seismic.jsonl"
    assert (
        export_corpus(bag_of_words, docs, seismic_path, export_format="seismic", chunk_size=2, **common) == 5
    )
    lines = [json.loads(line) for line in seismic_path.read_text().splitlines()]
    assert lines[0] == {"id": "d1", "content": "", "vector": {"apple": 1.0, "banana": pytest.approx(0.004)}}
    assert lines[3]["vector"] == {"banana": pytest.approx(0.004), "cherry": pytest.approx(1.236)}
    anserini_path = tmp_path / "corpus.anserini.jsonl"
    export_corpus(
        bag_of_words, iter(docs), anserini_path, export_format="anserini", chunk_size=100, total=5, **common
    )
    lines = [json.loads(line) for line in anserini_path.read_text().splitlines()]
    assert [line["vector"] for line in lines] == [
        {"apple": 100},
        {"cherry": 124},
        {"apple": 100},
        {"cherry": 124},
        {"grape": 100},
    ]
    assert lines[0]["id"] == "d1" and lines[0]["contents"] == ""
    again = tmp_path / "again.jsonl"
    export_corpus(bag_of_words, docs, again, export_format="seismic", chunk_size=100, **common)
    assert again.read_text() == seismic_path.read_text()

    def failing(**features: Tensor) -> Tensor:
        if features["input_ids"].shape[0] < 2:
            raise RuntimeError("device lost")
        return bag_of_words(**features)

    with pytest.raises(RuntimeError, match="device lost"):
        export_corpus(failing, docs, tmp_path / "lost.jsonl", export_format="seismic", chunk_size=2, **common)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("lost")) == []
    with pytest.raises(ValueError, match="export_format must be one of"):
        export_corpus(bag_of_words, docs, tmp_path / "x.jsonl", export_format="trec", **common)


@needs_seismic
def test_seismic_reads_the_exported_corpus(tmp_path: Path, tokenizer, bag_of_words: BagOfWords) -> None:
    """seismic's own builder reads the exported file: every document and every weight arrive."""
    from seismic import SeismicIndex

    docs = [("d1", "apple banana"), ("d2", "cherry"), ("d3", "apple grape")]
    path = tmp_path / "corpus.jsonl"
    export_corpus(
        bag_of_words,
        docs,
        path,
        encoding=EncodingSettings(tokenizer, document_max_length=16, show_progress=False),
        export_format="seismic",
    )
    index = SeismicIndex.build(str(path), n_postings=10, num_threads=1)
    assert (index.len, index.nnz) == (3, 5)


# ----------------------------------------------------------------------------------- Trainer callback


class ContrastiveTrainer(Trainer):
    """The smallest Trainer that trains on TrainingCollator batches: in-batch InfoNCE over reps."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        reps = {name: model(**features) for name, features in inputs["columns"].items()}
        scores = reps["query"] @ reps["positive"].T  # [B, V] @ [V, B] -> [B, B]
        loss = nn.functional.cross_entropy(scores, torch.arange(scores.shape[0]))
        return (loss, {"scores": scores}) if return_outputs else loss

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        # Trainer's default would call model(**batch); a batch here is {"columns", "loss_kwargs"}.
        with torch.no_grad():
            return self.compute_loss(model, self._prepare_inputs(inputs)).detach(), None, None


def make_trainer(tmp_path: Path, tokenizer, model: nn.Module, **args) -> ContrastiveTrainer:
    import datasets

    rows = [
        {"query": f"fruit {w}", "positive": f"a {w} tree"} for w in ["apple", "banana", "cherry", "grape"] * 4
    ]
    training_args = TrainingArguments(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=4,
        per_device_eval_batch_size=4,
        learning_rate=0.1,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
        dataloader_drop_last=True,
        remove_unused_columns=False,  # the collator needs every column; the model takes tokenizer features
        **args,
    )
    dataset = datasets.Dataset.from_list(rows)
    return ContrastiveTrainer(
        model=model,
        args=training_args,
        train_dataset=dataset,
        eval_dataset=dataset,
        data_collator=TrainingCollator(tokenizer, query_max_length=16, document_max_length=16),
    )


def test_callback_logs_every_n_steps_through_trainer(
    tmp_path: Path, tokenizer, bag_of_words: BagOfWords
) -> None:
    """eval_steps=2 over 4 steps: eval_* retrieval metrics land in the trainer's log history at 2 and 4."""
    data = load_beir(write_fruit_beir(tmp_path / "fruit"), split="test")
    trainer = make_trainer(tmp_path, tokenizer, bag_of_words, max_steps=4, logging_steps=100)
    evaluator = SparseRetrievalEvaluator(
        data, encoding=EncodingSettings(tokenizer, show_progress=False), top_k=10
    )
    trainer.add_callback(RetrievalEvalCallback(evaluator, trainer=trainer, eval_steps=2))
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "eval_ndcg_at_10" in entry]
    assert [entry["step"] for entry in logged] == [2, 4]
    assert set(logged[0]) >= {"eval_ndcg_at_10", "eval_mrr_at_10", "eval_recall_at_10", "eval_doc_nonzeros"}
    assert bag_of_words.training  # the callback's evaluation restored train mode


def test_callback_on_evaluate_adds_metrics(tmp_path: Path, tokenizer, bag_of_words: BagOfWords) -> None:
    """eval_steps=None: trainer.evaluate() returns (and logs) the retrieval metrics next to its own."""
    data = load_beir(write_fruit_beir(tmp_path / "fruit"), split="test")
    trainer = make_trainer(tmp_path, tokenizer, bag_of_words)
    evaluator = SparseRetrievalEvaluator(
        data, encoding=EncodingSettings(tokenizer, show_progress=False), top_k=10
    )
    trainer.add_callback(RetrievalEvalCallback(evaluator, trainer=trainer))
    metrics = trainer.evaluate()
    assert "eval_loss" in metrics
    # Untrained bag of words: the hand-computed value (test_evaluator_matches_hand_computed_metrics).
    assert metrics["eval_ndcg_at_10"] == pytest.approx(0.5)
    assert any(entry.get("eval_mrr_at_10") == pytest.approx(0.5) for entry in trainer.state.log_history)


def test_callback_rejects_bad_arguments(tokenizer) -> None:
    """A non-callable evaluator, an object without log() and a non-positive eval_steps are refused."""
    with pytest.raises(TypeError, match="evaluator must be callable"):
        RetrievalEvalCallback(None, trainer=None)
    with pytest.raises(TypeError, match="trainer must have a log"):
        RetrievalEvalCallback(lambda encoder: {}, trainer=object())
    with pytest.raises(ValueError, match="eval_steps must be a positive int"):
        RetrievalEvalCallback(lambda encoder: {}, trainer=Trainer.__new__(Trainer), eval_steps=0)


def test_cli_export_writes_every_document_and_refuses_bad_input_first(
    tmp_path: Path, capsys, monkeypatch
) -> None:
    """`gradcache-sparton export` encodes every corpus document with the checkpoint at its training length
    (the shipped SPLADE-tiny's reps, as `encode_texts` gives them) into a new folder; an existing file
    (without --overwrite), a bad --scale (0, inf), a name other than .jsonl/.json or a missing corpus is one
    error line (exit 2) before any model is loaded; a scale that rounds a document's every weight to 0 stops
    the export with nothing written."""
    import gradcache_sparton.model_loading as model_loading
    import gradcache_sparton.pipeline as pipeline

    beir = write_fruit_beir(tmp_path / "fruit")
    out = tmp_path / "new" / "fruit.anserini.jsonl"
    argv = ["export", "--model_name_or_path", "splade-tiny-msmarco", "--beir_path", str(beir)]
    assert main([*argv, "--output_file", str(out), "--format", "anserini", "--device", "cpu"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["documents"] == 4 and summary["format"] == "anserini"
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [line["id"] for line in lines] == ["d1", "d2", "d3", "d4"]
    encoder = SpladeEncoder.from_pretrained(
        model_loading.resolve_model_location("splade-tiny-msmarco")
    ).eval()
    tokenizer = model_loading.build_tokenizer(ModelArguments(model_name_or_path="splade-tiny-msmarco"))
    reps = encode_texts(
        encoder, ["apple banana"], tokenizer=tokenizer, max_length=summary["document_max_length"]
    )
    terms = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    expected = {
        terms[v]: round(w * 100) for v, w in zip(reps.token_ids.tolist(), reps.weights.tolist(), strict=True)
    }
    assert lines[0]["vector"] == {t: q for t, q in expected.items() if q > 0}

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the input was checked")

    monkeypatch.setattr(pipeline, "build_encoder", no_model)
    for extra, message in (
        (["--output_file", str(out)], "exists"),
        (["--output_file", str(tmp_path / "x.jsonl"), "--scale", "0"], "scale"),
        (["--output_file", str(tmp_path / "x.jsonl"), "--scale", "inf"], "scale must be a finite number"),
        (["--output_file", str(tmp_path / "x.jsonl.gz")], "must end in one of"),  # written uncompressed
    ):
        assert main([*argv, *extra]) == 2
        assert message in capsys.readouterr().err
    monkeypatch.undo()
    tiny = tmp_path / "tiny.anserini.jsonl"
    assert main([*argv, "--output_file", str(tiny), "--format", "anserini", "--scale", "1e-6"]) == 2
    assert "rounds to impact 0" in capsys.readouterr().err and not tiny.exists()  # nothing exported empty
    missing = ["export", "--model_name_or_path", "splade-tiny-msmarco", "--beir_path", str(tmp_path / "none")]
    assert main([*missing, "--output_file", str(tmp_path / "y.jsonl")]) == 2
    assert "gradcache-sparton export: error:" in capsys.readouterr().err


def test_evaluate_refuses_an_existing_output_file_or_run_without_overwrite(
    tmp_path: Path, tiny_checkpoint: Path, capsys
) -> None:
    """An existing --output_file (e.g. a checkpoint's config.json) or TREC run beside it is left as it was
    unless --overwrite: one clear error before any work; with --overwrite both are replaced."""
    beir = write_fruit_beir(tmp_path / "fruit")
    config = tiny_checkpoint / "config.json"
    before = config.read_text()
    assert main(evaluate_argv(tiny_checkpoint, beir, "--output_file", str(config))) == 2
    assert "exists: pass --overwrite" in capsys.readouterr().err and config.read_text() == before
    output = tmp_path / "metrics.json"
    run = tmp_path / "metrics.fruit.full.trec"
    run.write_text("kept\n")
    assert main(evaluate_argv(tiny_checkpoint, beir, "--output_file", str(output))) == 2
    assert str(run) in capsys.readouterr().err and run.read_text() == "kept\n" and not output.exists()
    assert main(evaluate_argv(tiny_checkpoint, beir, "--output_file", str(output), "--overwrite")) == 0
    assert (
        json.loads(output.read_text()) == json.loads(capsys.readouterr().out) and run.read_text() != "kept\n"
    )
