"""Teacher scores (gradcache-sparton teacher): each teacher kind against a hand computation, the per-query
normalisations, the weighted ensemble, the atomic write and the refusals before any model work."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
import torch

from gradcache_sparton.cli import main
from gradcache_sparton.mining import (
    BM25Teacher,
    Teacher,
    TeacherInput,
    bm25_scores,
    ensemble_scores,
    load_teacher,
    minmax_normalise,
    normalise_scores,
    run_teacher_scores,
    teacher_kind,
)

ROWS = [
    {
        "query": "what about the protein",
        "positive": "The protein is studied here. Many protein samples.",
        "negative_1": "Noise about stars in the night.",
        "negative_2": "A cell divides quickly.",
    },
    {
        "query": "which star shines",
        "positive": "The star is bright tonight.",
        "negative_1": "The protein folds slowly.",
        "negative_2": "Noise number two says nothing.",
    },
    {
        "query": "cell division",
        "positive": "A cell divides quickly.",
        "negative_1": "The star is bright tonight.",
        "negative_2": "Planets orbit a star.",
    },
]
QUERIES = [row["query"] for row in ROWS]
CANDIDATES = [[row["positive"], row["negative_1"], row["negative_2"]] for row in ROWS]
DOCUMENTS = list(dict.fromkeys(t for texts in CANDIDATES for t in texts))
# fp32 on the CPU; batched against one-text-at-a-time encodings: summation order only (~1e-6 relative of
# scores of O(1..100)).
TOL = {"rtol": 1e-4, "atol": 1e-4}


def _write_rows(path: Path, rows: list[dict] = ROWS) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _read(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as lines:
        return [json.loads(line) for line in lines]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """Tiny random BERT teachers saved as a SentenceTransformer (mean pooling), a SparseEncoder (MLM + SPLADE
    max pooling) and a CrossEncoder (one label), with the shipped tokenizer; no hub."""
    from sentence_transformers import CrossEncoder, SentenceTransformer, SparseEncoder
    from sentence_transformers.sentence_transformer.modules import Pooling, Transformer
    from sentence_transformers.sparse_encoder.modules import SpladePooling
    from transformers import (
        AutoTokenizer,
        BertConfig,
        BertForMaskedLM,
        BertForSequenceClassification,
        BertModel,
    )

    from gradcache_sparton.resources import default_tokenizer_path

    root = tmp_path_factory.mktemp("teachers")
    tokenizer = AutoTokenizer.from_pretrained(default_tokenizer_path())
    torch.manual_seed(0)
    shape = dict(
        vocab_size=len(tokenizer),
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
    )
    for name, model in (
        ("bert", BertModel(BertConfig(**shape))),
        ("mlm", BertForMaskedLM(BertConfig(**shape))),
        ("cls", BertForSequenceClassification(BertConfig(**shape, num_labels=1))),
    ):
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    SentenceTransformer(modules=[Transformer(str(root / "bert")), Pooling(32, "mean")]).save(
        str(root / "dense")
    )
    SparseEncoder(
        modules=[Transformer(str(root / "mlm"), transformer_task="fill-mask"), SpladePooling("max")]
    ).save(str(root / "sparse"))
    CrossEncoder(str(root / "cls")).save(str(root / "cross"))
    return {"dense": root / "dense", "sparse": root / "sparse", "cross": root / "cross", "cls": root / "cls"}


def _tokens(folder: Path, *texts: str) -> dict:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)(*texts, return_tensors="pt", truncation=True)


def _score_each(function) -> torch.Tensor:
    return torch.tensor(
        [[function(q, d) for d in texts] for q, texts in zip(QUERIES, CANDIDATES, strict=True)]
    )


def test_teacher_kind_is_told_by_the_folders_files(models, tmp_path: Path) -> None:
    """bm25, our checkpoint, each sentence-transformers type and a plain classifier folder are told apart by
    their files; a folder of none of them is a ValueError naming --teacher."""
    assert teacher_kind("bm25") == "bm25"
    assert teacher_kind("splade-tiny-msmarco") == "splade"
    assert teacher_kind(str(models["dense"])) == "sentence_transformer"
    assert teacher_kind(str(models["sparse"])) == "sparse_encoder"
    assert teacher_kind(str(models["cross"])) == "cross_encoder"
    assert teacher_kind(str(models["cls"])) == "cross_encoder"
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"--teacher .* not a model folder"):
        teacher_kind(str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="--teacher"):
        teacher_kind(str(tmp_path / "missing"))


def test_splade_teacher_scores_are_dot_products_of_its_reps() -> None:
    """Our checkpoint's teacher score of (query, candidate) is the dot product of the two reps, each text
    encoded alone at the lengths given; its top K are its best corpus scores."""
    from gradcache_sparton.data import QUERY_COLUMN
    from gradcache_sparton.primitives.column_routing import DOCUMENT_COLUMN, call_encoder

    teacher = load_teacher(
        "splade-tiny-msmarco", kind="splade", device="cpu", query_max_length=16, document_max_length=32
    )
    tokenizer = teacher.encoding.tokenizer

    def rep(text: str, column: str, length: int) -> torch.Tensor:
        features = tokenizer([text], truncation=True, max_length=length, return_tensors="pt")
        with torch.no_grad():
            return call_encoder(teacher.encoder, column, features)[0]

    def score(q: str, d: str) -> float:
        return float(rep(q, QUERY_COLUMN, 16) @ rep(d, DOCUMENT_COLUMN, 32))

    scores, top = teacher.scores(QUERIES, CANDIDATES, DOCUMENTS, depth=3)
    expected = _score_each(score)
    torch.testing.assert_close(scores, expected, **TOL)
    corpus = torch.tensor([[score(q, d) for d in DOCUMENTS] for q in QUERIES])
    torch.testing.assert_close(top, corpus.topk(3, dim=1).values, **TOL)
    assert (scores[:, 0] > scores[:, 1]).all()  # a pretrained SPLADE ranks the topic document first


def test_inference_free_checkpoint_scores_table_weights_times_document_rep(tmp_path: Path) -> None:
    """An inference-free checkpoint of ours scores a candidate as the sum over the query's distinct
    non-special tokens of the table weight times the document rep at that token."""
    from gradcache_sparton.data import QUERY_COLUMN
    from gradcache_sparton.modeling import InferenceFreeEncoder
    from gradcache_sparton.primitives.column_routing import DOCUMENT_COLUMN, call_encoder

    folder = tmp_path / "if"
    beir = tmp_path / "beir"
    (beir / "qrels").mkdir(parents=True)
    (beir / "corpus.jsonl").write_text(
        "".join(json.dumps({"_id": str(i), "text": t}) + "\n" for i, t in enumerate(DOCUMENTS))
    )
    assert (
        main(
            [
                "idf",
                "--model_name_or_path",
                "splade-tiny-msmarco",
                "--beir_path",
                str(beir),
                "--output_dir",
                str(folder),
            ]
        )
        == 0
    )
    assert teacher_kind(str(folder)) == "splade"
    teacher = load_teacher(
        str(folder), kind="splade", device="cpu", query_max_length=16, document_max_length=32
    )
    assert isinstance(teacher.encoder, InferenceFreeEncoder)
    tokenizer = teacher.encoding.tokenizer
    weight = teacher.encoder.query_table.weight.detach()

    def score(q: str, d: str) -> float:
        ids = set(tokenizer(q, truncation=True, max_length=16)["input_ids"]) - set(tokenizer.all_special_ids)
        features = tokenizer([d], truncation=True, max_length=32, return_tensors="pt")
        with torch.no_grad():
            d_rep = call_encoder(teacher.encoder, DOCUMENT_COLUMN, features)[0]
        return float(sum(weight[i] * d_rep[i] for i in ids))

    assert QUERY_COLUMN == "query"
    scores, _ = teacher.scores(QUERIES, CANDIDATES, DOCUMENTS)
    torch.testing.assert_close(scores, _score_each(score), **TOL)


def test_sentence_transformer_teacher_is_the_cosine_of_mean_pooled_embeddings(models) -> None:
    """A SentenceTransformer teacher scores by its similarity (cosine) of mean-pooled BERT states, each text
    alone; its top K are its best corpus cosines."""
    from transformers import BertModel

    bert = BertModel.from_pretrained(models["dense"]).eval()

    def embed(text: str) -> torch.Tensor:
        features = _tokens(models["dense"], text)
        with torch.no_grad():
            states = bert(**features).last_hidden_state[0]  # [S, D]
        return states.mean(dim=0)  # one text: no padding

    def score(q: str, d: str) -> float:
        return float(torch.nn.functional.cosine_similarity(embed(q), embed(d), dim=0))

    teacher = load_teacher(
        str(models["dense"]), kind="sentence_transformer", device="cpu", show_progress=False
    )
    scores, top = teacher.scores(QUERIES, CANDIDATES, DOCUMENTS, depth=2)
    torch.testing.assert_close(scores, _score_each(score), **TOL)
    corpus = torch.tensor([[score(q, d) for d in DOCUMENTS] for q in QUERIES])
    torch.testing.assert_close(top, corpus.topk(2, dim=1).values, **TOL)


def test_sparse_encoder_teacher_is_the_dot_product_of_splade_pooled_logits(models) -> None:
    """A SparseEncoder teacher's score is the dot product of max-pooled log1p(relu(MLM logits)), each text
    alone."""
    from transformers import BertForMaskedLM

    mlm = BertForMaskedLM.from_pretrained(models["sparse"]).eval()

    def rep(text: str) -> torch.Tensor:
        with torch.no_grad():
            logits = mlm(**_tokens(models["sparse"], text)).logits[0]  # [S, V]
        return torch.log1p(torch.relu(logits)).max(dim=0).values  # [V]

    teacher = load_teacher(str(models["sparse"]), kind="sparse_encoder", device="cpu", show_progress=False)
    scores, top = teacher.scores(QUERIES, CANDIDATES, DOCUMENTS, depth=2)
    torch.testing.assert_close(scores, _score_each(lambda q, d: float(rep(q) @ rep(d))), **TOL)
    assert top.shape == (3, 2)


def test_cross_encoder_teacher_is_the_raw_logit_of_each_pair(models) -> None:
    """A CrossEncoder teacher's score is its classifier's raw logit (no sigmoid) of the (query, candidate)
    pair; it refuses a top K over a corpus."""
    from transformers import BertForSequenceClassification

    classifier = BertForSequenceClassification.from_pretrained(models["cross"]).eval()

    def score(q: str, d: str) -> float:
        with torch.no_grad():
            return float(classifier(**_tokens(models["cross"], q, d)).logits[0, 0])

    teacher = load_teacher(str(models["cross"]), kind="cross_encoder", device="cpu", show_progress=False)
    scores, top = teacher.scores(QUERIES, CANDIDATES, DOCUMENTS)
    torch.testing.assert_close(scores, _score_each(score), **TOL)
    assert top is None
    with pytest.raises(ValueError, match="zscore"):
        teacher.scores(QUERIES, CANDIDATES, DOCUMENTS, depth=2)


def test_bm25_teacher_is_bm25_under_the_corpus_index() -> None:
    """The bm25 teacher's scores are bm25_scores' under the corpus given (bm25s's own, tested there)."""
    pytest.importorskip("bm25s")
    scores, top = BM25Teacher(show_progress=False).scores(QUERIES, CANDIDATES, DOCUMENTS, depth=2)
    expected, expected_top = bm25_scores(QUERIES, CANDIDATES, DOCUMENTS, depth=2, show_progress=False)
    torch.testing.assert_close(scores, expected)
    torch.testing.assert_close(top, expected_top)


def test_every_teacher_refuses_rows_without_an_r_by_c_shape_before_scoring() -> None:
    """Teacher.scores checks its input once for every kind, before any scoring: one row of candidates a
    query, the same number (>= 1) in every row, a depth >= 1."""

    class Unreachable(Teacher):
        kind = "test"

        def _scores(self, rows: TeacherInput) -> tuple[torch.Tensor, torch.Tensor | None]:
            raise AssertionError("scored despite bad input")

    for teacher in (Unreachable(), BM25Teacher(show_progress=False)):
        with pytest.raises(ValueError, match="one row a query"):
            teacher.scores(QUERIES, CANDIDATES[:-1], DOCUMENTS)
        with pytest.raises(ValueError, match=r"same number \(>= 1\) of candidates, got \[2, 3\]"):
            teacher.scores(QUERIES, [*CANDIDATES[:-1], CANDIDATES[-1][:2]], DOCUMENTS)
        with pytest.raises(ValueError, match=r"same number \(>= 1\) of candidates, got \[0\]"):
            teacher.scores(QUERIES, [[] for _ in QUERIES], DOCUMENTS)
        for depth in (0, 1.5, True):
            with pytest.raises(ValueError, match="depth must be an int >= 1"):
                teacher.scores(QUERIES, CANDIDATES, DOCUMENTS, depth=depth)


def test_normalisations_and_ensemble_by_hand() -> None:
    """minmax maps a row's candidates onto [0, 1] (ties: 0s), zscore uses the query's top K, none keeps the
    scores; the ensemble is scale times the weighted sum."""
    scores = torch.tensor([[3.0, 1.0, 2.0], [5.0, 5.0, 5.0], [-1.0, 1.0, 0.0]])
    minmax = torch.tensor([[1.0, 0.0, 0.5], [0.0, 0.0, 0.0], [0.0, 1.0, 0.5]], dtype=torch.float64)
    torch.testing.assert_close(minmax_normalise(scores), minmax)
    torch.testing.assert_close(normalise_scores(scores, None, normalisation="minmax"), minmax)
    torch.testing.assert_close(normalise_scores(scores, None, normalisation="none"), scores.double())
    top = torch.tensor([[4.0, 2.0], [5.0, 5.0], [1.0, -1.0]])
    zscore = torch.tensor([[0.0, -2.0, -1.0], [0.0, 0.0, 0.0], [-1.0, 1.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(normalise_scores(scores, top, normalisation="zscore"), zscore)
    with pytest.raises(ValueError, match="top-K"):
        normalise_scores(scores, None, normalisation="zscore")
    with pytest.raises(ValueError, match="normalisation must be one of"):
        normalise_scores(scores, None, normalisation="softmax")
    mixed = ensemble_scores([minmax, zscore], [0.25, 0.75], scale=30.0)
    torch.testing.assert_close(mixed, (30 * (0.25 * minmax + 0.75 * zscore)).float())
    with pytest.raises(ValueError, match="scale"):
        ensemble_scores([minmax], [1.0], scale=0.0)


def test_teacher_command_writes_the_weighted_minmax_ensemble(tmp_path: Path) -> None:
    """`teacher` with our checkpoint and BM25 at 0.7 / 0.3 writes, per row, 30 · (0.7 · minmax(ours) + 0.3 ·
    minmax(bm25)) of the positive then each negative, the rows otherwise unchanged; a row scored alone gets
    the same scores (minmax reads only the row's candidates; BM25's corpus given by --beir_path)."""
    pytest.importorskip("bm25s")
    beir = tmp_path / "beir"
    beir.mkdir()
    (beir / "corpus.jsonl").write_text(
        "".join(json.dumps({"_id": str(i), "text": t}) + "\n" for i, t in enumerate(DOCUMENTS))
    )
    data = _write_rows(tmp_path / "rows.jsonl")
    out = tmp_path / "scored.jsonl.gz"
    lengths = ["--query_max_length", "16", "--document_max_length", "32", "--device", "cpu"]
    argv = ["teacher", "--train_data", str(data), "--teacher", "splade-tiny-msmarco", "bm25",
            "--teacher_weights", "0.7", "0.3", "--beir_path", str(beir), "--output_file", str(out), *lengths]  # fmt: skip
    assert main(argv) == 0
    written = _read(out)
    assert [{k: v for k, v in r.items() if k != "teacher_scores"} for r in written] == ROWS
    ours = load_teacher(
        "splade-tiny-msmarco", kind="splade", device="cpu", query_max_length=16, document_max_length=32
    ).scores(QUERIES, CANDIDATES, DOCUMENTS)[0]
    bm25 = BM25Teacher(show_progress=False).scores(QUERIES, CANDIDATES, DOCUMENTS)[0]
    expected = 30 * (0.7 * minmax_normalise(ours) + 0.3 * minmax_normalise(bm25))
    # float32 of a float64 mix in [0, 30]; the model half's fp32 batch-shape noise (~1e-6) times 30
    torch.testing.assert_close(torch.tensor([r["teacher_scores"] for r in written]), expected.float(), **TOL)
    alone = tmp_path / "alone.jsonl"
    argv = ["teacher", "--train_data", str(_write_rows(tmp_path / "one.jsonl", ROWS[1:2])), "--teacher",
            "splade-tiny-msmarco", "bm25", "--teacher_weights", "0.7", "0.3", "--beir_path", str(beir),
            "--output_file", str(alone), *lengths]  # fmt: skip
    assert main(argv) == 0
    torch.testing.assert_close(
        torch.tensor(_read(alone)[0]["teacher_scores"]), torch.tensor(written[1]["teacher_scores"]), **TOL
    )


def test_an_interrupted_write_leaves_no_file(tmp_path: Path, monkeypatch) -> None:
    """An interruption while the rows are written leaves neither the output file nor a temporary file."""
    import gradcache_sparton.data.output as output

    def interrupted(dataset, stream) -> None:
        stream.write(b'{"query": "half a row')
        raise KeyboardInterrupt

    monkeypatch.setattr(output, "_write_rows", interrupted)
    data = _write_rows(tmp_path / "rows.jsonl")
    out = tmp_path / "out" / "scored.jsonl"
    with pytest.raises(KeyboardInterrupt):
        run_teacher_scores(
            train_data=data,
            teacher=["splade-tiny-msmarco"],
            output_file=out,
            device="cpu",
            show_progress=False,
        )
    assert list(out.parent.iterdir()) == []


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"teacher_weights": [0.5]}, "1 weight\\(s\\) for 2 --teacher"),
        ({"teacher_weights": [0.5, 0.6]}, "must sum to 1"),
        ({"teacher_weights": [1.5, -0.5]}, "finite and > 0"),
        ({"normalisation": "softmax"}, "--normalisation must be one of"),
        ({"scale": 0.0}, "--scale"),
        ({"depth": 5}, "--depth is zscore's"),
        ({"train_data": "missing.jsonl"}, "--train_data .* does not exist"),
        ({"teacher": ["cross"], "normalisation": "zscore"}, "cross-encoder"),
        ({"teacher": ["nowhere/at/all"]}, "--teacher"),
        ({"output_file": "exists.jsonl"}, "exists: pass overwrite"),
        ({"output_file": "scored.txt"}, "must end in one of"),
        ({"train_data": "no_negatives.jsonl"}, "no negative_1 column"),
        ({"train_data": "scored.jsonl"}, "already has a teacher_scores column"),
    ],
)
def test_bad_input_is_refused_before_any_model_work(
    models, tmp_path: Path, monkeypatch, change, message
) -> None:
    """Every bad input is one ValueError naming the flag or file, raised before any teacher loads, and nothing
    is written."""
    import gradcache_sparton.mining.teacher_job as job

    def no_model(*args, **kwargs):
        raise AssertionError("a teacher was loaded before the inputs were checked")

    monkeypatch.setattr(job, "load_teacher", no_model)
    _write_rows(tmp_path / "rows.jsonl")
    _write_rows(
        tmp_path / "no_negatives.jsonl", [{"query": r["query"], "positive": r["positive"]} for r in ROWS]
    )
    _write_rows(tmp_path / "scored.jsonl", [{**r, "teacher_scores": [1.0, 0.0, 0.0]} for r in ROWS])
    (tmp_path / "exists.jsonl").write_text("keep me\n")
    kwargs = {
        "train_data": "rows.jsonl",
        "teacher": ["splade-tiny-msmarco", "bm25"],
        "output_file": "new.jsonl",
        **change,
    }
    kwargs["teacher"] = [str(models["cross"]) if t == "cross" else t for t in kwargs["teacher"]]
    monkeypatch.chdir(tmp_path)
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(ValueError, match=message):
        run_teacher_scores(**kwargs, show_progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert (tmp_path / "exists.jsonl").read_text() == "keep me\n"
