"""Training data: BEIR folders, self-supervised pairs, validation, loading, collator, shipped sample."""

from __future__ import annotations

import filecmp
import gzip
import json
import math
import subprocess
import sys
from pathlib import Path

import datasets
import pytest
import torch
from torch.utils.data import DataLoader

from gradcache_sparton.data import (
    BeirData,
    TrainingCollator,
    beir_training_pairs,
    default_dev_beir_path,
    default_train_data_path,
    iter_corpus,
    load_beir,
    load_training_data,
    read_corpus,
    self_supervised_pairs,
    split_sentences,
    validate_training_dataset,
)

ROOT = Path(__file__).resolve().parents[1]
SHARED_SCIFACT = ROOT.parent / "shared" / "data" / "scifact"


def write_beir(folder: Path, *, gzip_corpus: bool = False, qrels_lines: list[str] | None = None) -> Path:
    """A tiny BEIR folder: 4 docs (one without title), 3 queries (one unjudged), a header'd qrels file."""
    corpus = [
        {"_id": "d1", "title": "Proteins", "text": "Proteins fold."},
        {"_id": "d2", "title": "", "text": "Cells divide."},
        {"_id": "d3", "title": "Genes", "text": "Genes express."},
        {"_id": "d4", "title": "Noise", "text": "Unrelated text."},
    ]
    queries = [
        {"_id": "q1", "text": "how do proteins fold", "metadata": {}},
        {"_id": "q2", "text": "cell division", "metadata": {}},
        {"_id": "q3", "text": "never judged", "metadata": {}},
    ]
    folder.mkdir(parents=True, exist_ok=True)
    corpus_bytes = "".join(json.dumps(d) + "\n" for d in corpus).encode()
    if gzip_corpus:
        (folder / "corpus.jsonl.gz").write_bytes(gzip.compress(corpus_bytes))
    else:
        (folder / "corpus.jsonl").write_bytes(corpus_bytes)
    (folder / "queries.jsonl").write_text("".join(json.dumps(q) + "\n" for q in queries))
    (folder / "qrels").mkdir(exist_ok=True)
    lines = qrels_lines if qrels_lines is not None else ["q2\td2\t1", "q1\td1\t2", "q1\td3\t1", "q1\td4\t0"]
    (folder / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\n" + "\n".join(lines) + "\n")
    return folder


# --------------------------------------------------------------------------------------------- BEIR


@pytest.mark.parametrize("gzip_corpus", [False, True])
def test_load_beir_reads_tiny_folder(tmp_path: Path, gzip_corpus: bool) -> None:
    """Corpus text is title + " " + text (or text alone); queries are the judged ones, in qrels order."""
    beir = load_beir(write_beir(tmp_path / "beir", gzip_corpus=gzip_corpus), split="test")
    assert list(beir.corpus) == ["d1", "d2", "d3", "d4"]  # file order = retrieval index order
    assert beir.corpus["d1"] == "Proteins Proteins fold."
    assert beir.corpus["d2"] == "Cells divide."
    assert beir.queries == {"q2": "cell division", "q1": "how do proteins fold"}
    assert beir.qrels == {"q2": {"d2": 1}, "q1": {"d1": 2, "d3": 1, "d4": 0}}


def test_beir_training_pairs_keep_relevant_judgements(tmp_path: Path) -> None:
    """One (query, positive) row per judgement with relevance > 0, in qrels order; relevance 0 is dropped."""
    pairs = beir_training_pairs(load_beir(write_beir(tmp_path / "beir"), split="test"))
    assert pairs.column_names == ["query", "positive"]
    assert pairs.to_list() == [
        {"query": "cell division", "positive": "Cells divide."},
        {"query": "how do proteins fold", "positive": "Proteins Proteins fold."},
        {"query": "how do proteins fold", "positive": "Genes Genes express."},
    ]


@pytest.mark.parametrize(
    ("qrels_lines", "split", "match"),
    [
        (None, "dev", r"split='dev'.*splits found: \['test'\]"),
        (["q1\td9\t1"], "test", r"test.tsv:2: doc id 'd9' is not in"),
        (["q1\td1\t1", "q7\td1\t1"], "test", r"test.tsv:3: query id 'q7' is not in"),
        (["q1\td1\thigh"], "test", r"score 'high' is not an integer"),
        (["q1\td1"], "test", r"expected 3 tab-separated fields"),
        ([], "test", r"holds no judgements"),
    ],
)
def test_load_beir_rejects_bad_folders(tmp_path: Path, qrels_lines, split: str, match: str) -> None:
    """Malformed qrels, unknown ids and a missing split raise ValueError naming the file/line."""
    folder = write_beir(tmp_path / "beir", qrels_lines=qrels_lines)
    with pytest.raises(ValueError, match=match):
        load_beir(folder, split=split)


def test_load_beir_requires_corpus(tmp_path: Path) -> None:
    """A folder without corpus.jsonl(.gz) is a ValueError naming the file."""
    folder = write_beir(tmp_path / "beir")
    (folder / "corpus.jsonl").unlink()
    with pytest.raises(ValueError, match=r"has no corpus.jsonl"):
        load_beir(folder, split="test")


def test_load_beir_qrels_without_header_keeps_first_judgement(tmp_path: Path) -> None:
    """A qrels file without a header line: its first line is a judgement (told by content, not position)."""
    folder = write_beir(tmp_path / "beir")
    (folder / "qrels" / "test.tsv").write_text("q2\td2\t1\nq1\td1\t2\n")
    assert load_beir(folder, split="test").qrels == {"q2": {"d2": 1}, "q1": {"d1": 2}}


def test_load_beir_graded_first_line_is_a_judgement_not_a_header(tmp_path: Path) -> None:
    """A headerless qrels file whose first line has a graded score (2.5) is refused naming that line, never
    dropped as a header (which silently lost the query)."""
    folder = write_beir(tmp_path / "beir")
    (folder / "qrels" / "test.tsv").write_text("q2\td2\t2.5\nq1\td1\t2\n")
    with pytest.raises(ValueError, match=r"test\.tsv:1: score '2\.5' is not an integer"):
        load_beir(folder, split="test")


def rewrite_jsonl(path: Path, line: int, record: dict) -> None:
    """Replace the 1-based ``line`` of a jsonl file with ``record``."""
    lines = path.read_text().splitlines()
    lines[line - 1] = json.dumps(record)
    path.write_text("\n".join(lines) + "\n")


@pytest.mark.parametrize(
    ("file", "line", "record", "match"),
    [
        ("corpus.jsonl", 2, {"_id": "d2", "title": "", "text": None}, r"corpus.jsonl:2: 'text' must be a string"),
        ("corpus.jsonl", 3, {"_id": "d3", "title": "Genes", "text": 7}, r"corpus.jsonl:3: 'text' must be a string"),
        ("corpus.jsonl", 2, {"_id": "d2", "title": None, "text": "x"}, r"corpus.jsonl:2: 'title' must be a string"),
        ("corpus.jsonl", 4, {"_id": "d1", "title": "", "text": "x"}, r"corpus.jsonl:4: duplicate _id 'd1' \(first at line 1\)"),
        ("queries.jsonl", 3, {"_id": "q1", "text": "again"}, r"queries.jsonl:3: duplicate _id 'q1' \(first at line 1\)"),
        ("queries.jsonl", 2, {"_id": "q2", "text": None}, r"queries.jsonl:2: 'text' must be a string"),
        ("queries.jsonl", 2, {"_id": None, "text": "x"}, r"queries.jsonl:2: _id must be a string or an integer"),
    ],
)  # fmt: skip
def test_load_beir_rejects_bad_records(
    tmp_path: Path, file: str, line: int, record: dict, match: str
) -> None:
    """A null or numeric text/title, a null id and a duplicate doc/query id are refused at load, naming
    the file and line (before, a null text became "T None" and duplicates were silently overwritten)."""
    folder = write_beir(tmp_path / "beir")
    rewrite_jsonl(folder / file, line, record)
    with pytest.raises(ValueError, match=match):
        load_beir(folder, split="test")


def test_load_beir_rejects_duplicate_judgement(tmp_path: Path) -> None:
    """A (query, doc) pair judged twice is refused naming both lines, not silently overwritten."""
    folder = write_beir(tmp_path / "beir", qrels_lines=["q1\td1\t2", "q2\td2\t1", "q1\td1\t0"])
    with pytest.raises(
        ValueError, match=r"test.tsv:4: duplicate judgement of \('q1', 'd1'\) \(first at line 2\)"
    ):
        load_beir(folder, split="test")


def test_read_corpus_reads_gzip_and_keeps_title_and_text(tmp_path: Path) -> None:
    """The one corpus reader (also behind --self_supervised_corpus) reads corpus.jsonl.gz, in file order."""
    docs = read_corpus(write_beir(tmp_path / "beir", gzip_corpus=True))
    assert [(d.doc_id, d.title, d.text) for d in docs][:2] == [
        ("d1", "Proteins", "Proteins fold."),
        ("d2", "", "Cells divide."),
    ]
    assert [d.full_text for d in docs][:2] == ["Proteins Proteins fold.", "Cells divide."]
    assert len(read_corpus(default_dev_beir_path())) == 1583  # the shipped corpus.jsonl.gz


def test_iter_corpus_streams_and_checks_each_line_as_it_comes(tmp_path: Path) -> None:
    """iter_corpus yields read_corpus's documents one at a time: a bad line is reported (file and line)
    when reached, after the documents before it."""
    folder = write_beir(tmp_path / "beir")
    assert list(iter_corpus(folder)) == read_corpus(folder)
    with (folder / "corpus.jsonl").open("a") as handle:
        handle.write('{"_id": "d9", "text": null}\n')
    documents = iter_corpus(folder)
    assert [next(documents).doc_id for _ in range(4)] == ["d1", "d2", "d3", "d4"]
    with pytest.raises(ValueError, match=r"corpus\.jsonl:5: 'text' must be a string"):
        next(documents)


# ------------------------------------------------------------------------------- self-supervised pairs


def test_split_sentences_rule() -> None:
    """Splits after . ! ? before an upper-case letter, digit or opening bracket; not before lower case."""
    text = 'First one, e.g. this stays. Second? "Third" here! 4 cells (n=2). (Fifth.) End'
    assert split_sentences(text) == [
        "First one, e.g. this stays.",
        "Second?",
        '"Third" here!',
        "4 cells (n=2).",
        "(Fifth.)",
        "End",
    ]
    assert split_sentences("   ") == []


def test_self_supervised_pairs_follow_the_rule() -> None:
    """Each query is an eligible sentence, the positive title + the other sentences; others skipped."""
    texts = [
        "Alpha beta gamma delta epsilon. Short one. Zeta eta theta iota kappa lambda.",
        "Only one sentence with enough words here.",  # < 2 sentences: skipped
        "Tiny. Too small.",  # no sentence with >= 5 words: skipped
        "Mu nu xi omicron pi rho. Sigma tau upsilon phi chi psi.",
    ]
    titles = ["T0", "T1", "T2", ""]
    pairs = self_supervised_pairs(texts, titles=titles, pairs_per_document=5, min_words=5, seed=3)
    rows = pairs.to_list()
    by_doc = {
        0: [r for r in rows if r["positive"].startswith("T0 ")],
        3: [r for r in rows if "Mu" in r["query"] + r["positive"]],
    }
    assert len(rows) == 4 and len(by_doc[0]) == 2 and len(by_doc[3]) == 2  # every eligible sentence once
    for row in by_doc[0]:
        sentences = split_sentences(texts[0])
        assert row["query"] in sentences and row["query"] != "Short one."
        assert row["positive"] == "T0 " + " ".join(s for s in sentences if s != row["query"])
    assert {r["positive"] for r in by_doc[3]} == {
        "Mu nu xi omicron pi rho.",
        "Sigma tau upsilon phi chi psi.",
    }


def test_self_supervised_pairs_are_seeded() -> None:
    """The same seed gives the same pairs; another seed picks other sentences."""
    texts = [" ".join(f"Sentence {i} of doc {d} has words." for i in range(8)) for d in range(20)]
    first = self_supervised_pairs(texts, seed=0).to_list()
    assert first == self_supervised_pairs(texts, seed=0).to_list()
    assert first != self_supervised_pairs(texts, seed=1).to_list()
    assert len(first) == 20


def test_self_supervised_pairs_errors() -> None:
    """No eligible document, mismatched titles and bad arguments raise clear errors."""
    with pytest.raises(ValueError, match="no document of the 1 gave a pair"):
        self_supervised_pairs(["Too short."])
    with pytest.raises(ValueError, match="titles must have one entry per text"):
        self_supervised_pairs(["a. B."], titles=[])
    with pytest.raises(ValueError, match="pairs_per_document"):
        self_supervised_pairs(["a. B."], pairs_per_document=0)
    with pytest.raises(TypeError, match="texts must be a sequence"):
        self_supervised_pairs("A string. Not a list.")


# --------------------------------------------------------------------------- validation and loading


def rows_with_negatives(num_rows: int = 4) -> list[dict]:
    return [
        {
            "query": f"query {i}",
            "positive": f"positive document {i}",
            "negative_1": f"first negative {i}",
            "negative_2": f"second negative {i}",
            "teacher_scores": [float(i), 0.5, -1.0],
        }
        for i in range(num_rows)
    ]


def test_validate_returns_column_order() -> None:
    """Text columns come back as query, positive, negative_1..k in numeric order (negative_10 after 9)."""
    rows = [{"query": "q", "positive": "p", **{f"negative_{i}": "n" for i in range(10, 0, -1)}, "label": 1}]
    columns = validate_training_dataset(datasets.Dataset.from_list(rows))
    assert columns == ["query", "positive"] + [f"negative_{i}" for i in range(1, 11)]


@pytest.mark.parametrize(
    ("rows", "match"),
    [
        ([{"query": "q", "negative_1": "n"}], r"missing \['positive'\]"),
        ([{"query": "q", "positive": "p", "negative_2": "n"}], r"numbered 1..k without gaps"),
        ([{"query": "q", "positive": "p", "negative_1": "n", "negatives": ["n"]}], r"both a 'negatives'"),
        ([{"query": "q", "positive": "p", "source": "web"}], r"column 'source'.*remove_columns"),
        ([{"query": "q", "positive": 3}], r"column 'positive' must hold strings"),
        (
            [{"query": "q", "positive": "p", "negatives": ["a", "b"]}] * 3
            + [{"query": "q", "positive": "p", "negatives": ["a"]}],
            r"column 'negatives': row 3 has 1 entries but row 0 has 2",
        ),
        (
            [{"query": "q", "positive": "p", "negative_1": "a", "negative_2": "b"}] * 2
            + [{"query": "q", "positive": "p", "negative_1": "a", "negative_2": None}],
            r"column 'negative_2' is empty \(null\) in row 2",
        ),
        (
            [
                {"query": "q", "positive": "p", "teacher_scores": [1.0, 2.0]},
                {"query": "q", "positive": "p", "teacher_scores": [1.0]},
            ],
            r"column 'teacher_scores': row 1 has 1 entries",
        ),
        (
            [
                {"query": "q", "positive": "p", "teacher_scores": [1.0, 2.0]},
                {"query": "q", "positive": "p", "teacher_scores": [float("nan"), 2.0]},
            ],
            r"column 'teacher_scores' holds nan in row 1",
        ),
        ([{"query": "q", "positive": "p", "score": float("inf")}], r"column 'score' holds inf in row 0"),
    ],
)
def test_validate_rejects_bad_datasets(rows: list[dict], match: str) -> None:
    """Missing columns, gaps, mixed negative forms, wrong types, ragged negatives, non-finite numbers (NaN,
    infinity: the loss would stop at its first step): ValueError naming them."""
    with pytest.raises(ValueError, match=match):
        validate_training_dataset(datasets.Dataset.from_list(rows))


def test_a_nan_teacher_score_in_a_file_is_refused_at_load_naming_file_and_line(tmp_path: Path) -> None:
    """NaN as Python's json writes it, in a JSON-lines training file: refused at load, naming file and line."""
    path = tmp_path / "train.jsonl"
    rows = [{"query": "q", "positive": "p", "teacher_scores": [1.0, 2.0]}] * 2
    rows.append({"query": "q", "positive": "p", "teacher_scores": [float("nan"), 2.0]})
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    with pytest.raises(ValueError, match=r"train\.jsonl:3: column 'teacher_scores' holds nan"):
        load_training_data(str(path))


def test_validate_rejects_empty_dataset_and_empty_negatives() -> None:
    """An empty dataset, or `negatives` lists that are all empty, is a ValueError, not a silent no-op."""
    empty = datasets.Dataset.from_dict({"query": [], "positive": []})
    with pytest.raises(ValueError, match="dataset is empty"):
        validate_training_dataset(empty)
    string = datasets.Value("string")
    features = datasets.Features({"query": string, "positive": string, "negatives": datasets.List(string)})
    no_negatives = datasets.Dataset.from_list(
        [{"query": "q", "positive": "p", "negatives": []}], features=features
    )
    with pytest.raises(ValueError, match="holds empty lists"):
        validate_training_dataset(no_negatives)


def test_validate_honours_selection() -> None:
    """Row numbers refer to the selected/shuffled view; a bad row outside the selection is not reported."""
    rows = [{"query": "q", "positive": "p", "negative_1": "n"}] * 3 + [
        {"query": "q", "positive": "p", "negative_1": None}
    ]
    dataset = datasets.Dataset.from_list(rows)
    assert validate_training_dataset(dataset.select([0, 1, 2])) == ["query", "positive", "negative_1"]
    with pytest.raises(ValueError, match="in row 0"):
        validate_training_dataset(dataset.select([3, 0]))


def test_load_training_data_reads_every_format(tmp_path: Path) -> None:
    """jsonl, gzip'd jsonl, csv and parquet files load to the same rows; a Dataset passes through."""
    rows = [{k: v for k, v in row.items() if k != "teacher_scores"} for row in rows_with_negatives()]
    reference = datasets.Dataset.from_list(rows)
    jsonl = "".join(json.dumps(r) + "\n" for r in rows)
    (tmp_path / "t.jsonl").write_text(jsonl)
    (tmp_path / "t.jsonl.gz").write_bytes(gzip.compress(jsonl.encode()))
    reference.to_csv(tmp_path / "t.csv", index=False)
    reference.to_parquet(tmp_path / "t.parquet")
    for name in ("t.jsonl", "t.jsonl.gz", "t.csv", "t.parquet"):
        loaded = load_training_data(tmp_path / name, cache_dir=tmp_path / "cache")
        assert loaded.to_list() == rows, name
    assert load_training_data(reference) is reference


def test_load_training_data_errors(tmp_path: Path) -> None:
    """Unknown extensions, missing files, mixed formats and ragged csv negatives raise ValueError."""
    (tmp_path / "t.txt").write_text("x")
    with pytest.raises(ValueError, match="cannot tell the format"):
        load_training_data(tmp_path / "t.txt")
    with pytest.raises(ValueError, match="does not exist"):
        load_training_data(tmp_path / "missing.jsonl")
    (tmp_path / "a.jsonl").write_text('{"query": "q", "positive": "p"}\n')
    (tmp_path / "b.csv").write_text("query,positive\nq,p\n")
    with pytest.raises(ValueError, match="one format"):
        load_training_data([tmp_path / "a.jsonl", tmp_path / "b.csv"])
    # A row with fewer negatives than the others: an empty csv cell, read as null.
    (tmp_path / "ragged.csv").write_text("query,positive,negative_1,negative_2\nq,p,a,b\nq,p,a,\n")
    with pytest.raises(ValueError, match=r"column 'negative_2' is empty \(null\) in row 1"):
        load_training_data(tmp_path / "ragged.csv", cache_dir=tmp_path / "cache")


@pytest.mark.parametrize(
    ("content", "match"),
    [
        (b"", r"t.jsonl' is empty: it holds no rows"),
        (b"\n  \n", r"t.jsonl' is empty: it holds no rows"),
        (b'{"query": "q", "positive": "p"}\n{"query": "q", positive\n', r"t.jsonl:2: not valid JSON"),
        (b'{"query": "q", "positive": "p"}\n\n{"query": "q", "positive": "p"}\n{oops}\n', r"t.jsonl:4: not valid JSON"),
    ],
)  # fmt: skip
def test_load_training_data_names_empty_file_and_bad_line(tmp_path: Path, content: bytes, match: str) -> None:
    """An empty jsonl (a bare StopIteration inside datasets) and a malformed line (an error without the
    line) give one ValueError naming the file and, for a bad line, its number."""
    (tmp_path / "t.jsonl").write_bytes(content)
    with pytest.raises(ValueError, match=match):
        load_training_data(tmp_path / "t.jsonl", cache_dir=tmp_path / "cache")


def test_load_training_data_refuses_directory_datasetdict_and_stream(tmp_path: Path) -> None:
    """A directory, a DatasetDict and a streaming IterableDataset given as training data (to the loader
    or to the trainer's validation) each give one clear error saying what to pass instead."""
    (tmp_path / "folder").mkdir()
    with pytest.raises(ValueError, match=r"is a directory: give its files"):
        load_training_data(tmp_path / "folder")
    table = datasets.Dataset.from_list([{"query": "q", "positive": "p"}])
    splits = datasets.DatasetDict({"train": table})
    stream = table.to_iterable_dataset()
    for function in (load_training_data, validate_training_dataset):
        with pytest.raises(TypeError, match=r"DatasetDict with splits \['train'\]: pass one split"):
            function(splits)
        with pytest.raises(TypeError, match=r"streaming datasets.IterableDataset.*streaming=False"):
            function(stream)


# ------------------------------------------------------------------------------------------ collator


def test_collator_pads_each_column_to_multiple_of_8(tokenizer) -> None:
    """Output is {"columns": {query, positive, negative_1, negative_2}, "loss_kwargs": {...}}; each column
    is tokenised alone, truncated to its own max length and padded to a multiple of 8."""
    rows = rows_with_negatives()
    rows[1]["query"] = "a much longer query " * 20  # truncated to query_max_length
    rows[2]["positive"] = "word " * 5  # positives stay short: S is set by the longest row
    collator = TrainingCollator(tokenizer, query_max_length=16, document_max_length=64)
    batch = collator(rows)
    assert list(batch) == ["columns", "loss_kwargs", "repeated_positives"]
    assert list(batch["columns"]) == ["query", "positive", "negative_1", "negative_2"]
    for name, features in batch["columns"].items():
        max_length = 16 if name == "query" else 64
        unpadded = [
            len(tokenizer(r[name], truncation=True, max_length=max_length)["input_ids"]) for r in rows
        ]
        expected_s = math.ceil(max(unpadded) / 8) * 8
        assert set(features) == {"input_ids", "attention_mask", "token_type_ids"}
        for tensor in features.values():
            assert isinstance(tensor, torch.Tensor) and tensor.shape == (len(rows), expected_s), name
        assert features["attention_mask"].sum(1).tolist() == unpadded, name
        for i, row in enumerate(rows):  # each row's tokens are exactly its own, left-aligned
            ids = tokenizer(row[name], truncation=True, max_length=max_length)["input_ids"]
            assert features["input_ids"][i, : len(ids)].tolist() == ids
    assert batch["columns"]["query"]["input_ids"].shape[1] == 16  # the long query was truncated to 16
    assert batch["columns"]["query"]["input_ids"][1, -1].item() == tokenizer.sep_token_id


def test_collator_pads_to_max_length_when_asked(tokenizer) -> None:
    """pad_to_max_length: every column of every batch has its max length (one shape for a memory plan), and
    each row's tokens and attention mask are those of the default padding, extended with padding only."""
    rows = rows_with_negatives()
    collator = TrainingCollator(tokenizer, query_max_length=16, document_max_length=64)
    padded = TrainingCollator(tokenizer, query_max_length=16, document_max_length=64, pad_to_max_length=True)
    longest, fixed = collator(rows)["columns"], padded(rows)["columns"]
    for name, features in fixed.items():
        max_length = 16 if name == "query" else 64
        assert features["input_ids"].shape == (len(rows), max_length), name
        width = longest[name]["input_ids"].shape[1]
        assert width < max_length, name  # the rows are shorter: the default would not reach it
        for key, tensor in features.items():
            assert torch.equal(tensor[:, :width], longest[name][key]), (name, key)
        assert not features["attention_mask"][:, width:].any(), name
        assert (features["input_ids"][:, width:] == tokenizer.pad_token_id).all(), name


def test_collator_passes_numeric_columns_as_loss_kwargs(tokenizer) -> None:
    """Extra numeric columns become batch-first tensors: floats as float32, ints as int64."""
    rows = rows_with_negatives(3)
    for i, row in enumerate(rows):
        row["label"] = i
    batch = TrainingCollator(tokenizer)(rows)
    assert list(batch["loss_kwargs"]) == ["teacher_scores", "label"]
    scores = batch["loss_kwargs"]["teacher_scores"]
    assert scores.dtype == torch.float32 and scores.shape == (3, 3)
    assert scores[:, 0].tolist() == [0.0, 1.0, 2.0]
    assert batch["loss_kwargs"]["label"].dtype == torch.int64
    assert TrainingCollator(tokenizer)([{"query": "q", "positive": "p"}])["loss_kwargs"] == {}


def test_collator_negatives_list_equals_negative_columns(tokenizer) -> None:
    """A `negatives` list column gives exactly the batch of the equivalent negative_1..k columns."""
    rows = rows_with_negatives()
    listed = [
        {"query": r["query"], "positive": r["positive"], "negatives": [r["negative_1"], r["negative_2"]]}
        for r in rows
    ]
    columns = [{k: r[k] for k in ("query", "positive", "negative_1", "negative_2")} for r in rows]
    collator = TrainingCollator(tokenizer)
    a, b = collator(listed)["columns"], collator(columns)["columns"]
    assert list(a) == list(b)
    for name in a:
        for key in a[name]:
            assert torch.equal(a[name][key], b[name][key])


@pytest.mark.parametrize(
    ("rows", "error", "match"),
    [
        (
            [{"query": "q", "positive": "p"}, {"query": "q"}],
            ValueError,
            r"row 1 of the batch has no column 'positive'",
        ),
        (
            [
                {"query": "q", "positive": "p", "negatives": ["a", "b"]},
                {"query": "q", "positive": "p", "negatives": ["a"]},
            ],
            ValueError,
            r"row 1 of the batch: column 'negatives' must be a list of 2 texts",
        ),
        (
            [{"query": "q", "positive": "p"}, {"query": "q", "positive": "p", "negative_1": "n"}],
            ValueError,
            r"row 1 of the batch has column\(s\) \['negative_1'\] that row 0 lacks",
        ),
        (
            [{"query": "q", "positive": "p", "negative_1": None}],
            ValueError,
            r"column 'negative_1' must be a str, got NoneType",
        ),
        (
            [{"query": "q", "positive": "p", "source": "web"}],
            ValueError,
            r"extra column 'source' must hold numbers",
        ),
        ([{"positive": "p"}], ValueError, r"missing \['query'\]"),
        ([], ValueError, r"rows is empty"),
    ],
)
def test_collator_rejects_bad_rows(tokenizer, rows: list[dict], error: type, match: str) -> None:
    """Ragged negatives, missing columns and non-numeric extras raise errors naming the row and column."""
    with pytest.raises(error, match=match):
        TrainingCollator(tokenizer)(rows)


def test_collator_rejects_bad_settings(tokenizer) -> None:
    """Max lengths must be positive multiples of pad_to_multiple_of; the tokenizer must be a tokenizer."""
    with pytest.raises(ValueError, match="query_max_length=30 must be a multiple of pad_to_multiple_of=8"):
        TrainingCollator(tokenizer, query_max_length=30)
    with pytest.raises(ValueError, match="document_max_length must be a positive int"):
        TrainingCollator(tokenizer, document_max_length=0)
    with pytest.raises(TypeError, match="tokenizer must be"):
        TrainingCollator("bert-base-uncased")
    TrainingCollator(tokenizer, query_max_length=30, pad_to_multiple_of=None)  # no padding rule, any length


def test_collator_in_dataloader_drops_last_incomplete_batch(tokenizer) -> None:
    """With a datasets.Dataset and drop_last=True (the training setting) every batch is full-sized."""
    dataset = datasets.Dataset.from_list(rows_with_negatives(10))
    loader = DataLoader(dataset, batch_size=4, drop_last=True, collate_fn=TrainingCollator(tokenizer))
    batches = list(loader)
    assert len(batches) == 2
    for batch in batches:
        assert all(f["input_ids"].shape[0] == 4 for f in batch["columns"].values())
        assert batch["loss_kwargs"]["teacher_scores"].shape == (4, 3)


# -------------------------------------------------------------------------------------- shipped sample


def test_shipped_sample_holds_each_pair_once(tmp_path: Path) -> None:
    """No (query, positive) pair repeats in the shipped train rows (SciFact repeats a few claims under other
    ids): the default run starts without the repeated-pairs warning, and no copy is another's false negative."""
    train = load_training_data(default_train_data_path(), cache_dir=tmp_path)
    pairs = list(zip(train["query"], train["positive"], strict=True))
    assert len(set(pairs)) == len(pairs)


def test_shipped_sample_loads_and_holds_out_dev(tokenizer, tmp_path: Path) -> None:
    """The shipped train pairs and dev BEIR folder load, match the manifest; no dev claim is trained on."""
    manifest = json.loads((default_train_data_path().parent / "manifest.json").read_text())
    train = load_training_data(default_train_data_path(), cache_dir=tmp_path)
    dev = load_beir(default_dev_beir_path(), split="dev")
    assert isinstance(dev, BeirData)
    assert train.column_names == ["query", "positive"] and len(train) == manifest["train_rows"]
    assert len(dev.queries) == manifest["dev_queries"] and len(dev.corpus) == manifest["dev_corpus_docs"]
    assert not set(dev.queries.values()) & set(train["query"])
    relevant = [
        dev.corpus[d] for d in {d for judged in dev.qrels.values() for d, r in judged.items() if r > 0}
    ]
    # No abstract that answers a dev claim is a training positive, nor the source of a training query.
    assert not set(relevant) & set(train["positive"])
    assert not [q for q in train["query"] for doc in relevant if q in doc]
    total_bytes = sum(p.stat().st_size for p in default_train_data_path().parent.rglob("*") if p.is_file())
    assert total_bytes < 3_000_000  # "a few MB at most"
    TrainingCollator(tokenizer)(train.select(range(8)).to_list())


@pytest.mark.skipif(not SHARED_SCIFACT.is_dir(), reason=f"source data {SHARED_SCIFACT} not present")
def test_build_script_reproduces_shipped_sample(tmp_path: Path) -> None:
    """scripts/build_scifact_sample.py rebuilds the shipped files byte for byte from ../shared/data."""
    script = ROOT / "scripts" / "build_scifact_sample.py"
    subprocess.run(
        [sys.executable, str(script), "--source", str(SHARED_SCIFACT), "--output", str(tmp_path)],
        check=True,
        capture_output=True,
    )
    shipped = default_train_data_path().parent
    names = sorted(str(p.relative_to(shipped)) for p in shipped.rglob("*") if p.is_file())
    assert names == sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())
    _, mismatch, errors = filecmp.cmpfiles(shipped, tmp_path, names, shallow=False)
    assert mismatch == [] and errors == [], (mismatch, errors)


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


@pytest.mark.parametrize(
    ("row", "column"),
    [
        ({"query": "", "positive": "p"}, "query"),
        ({"query": "q", "positive": " \t"}, "positive"),
        ({"query": "q", "positive": "p", "negatives": ["n", ""]}, "negatives"),
    ],
)
def test_empty_text_is_refused_with_file_and_line(tmp_path: Path, row: dict, column: str) -> None:
    """An empty or blank query, positive or negative is one error naming the file, its line and the column."""
    good = {"query": "q0", "positive": "p0", **({"negatives": ["a", "b"]} if "negatives" in row else {})}
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps(good) + "\n\n" + json.dumps(row) + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match=f"{path}:3: column '{column}' is an empty text in row 1"):
        load_training_data(path)


def test_repeated_pairs_are_reported_in_the_data_and_in_a_batch(tmp_path: Path, tokenizer, caplog) -> None:
    """A (query, positive) pair repeated in the data is a warning with its count, once (not again when the
    trainer checks the loaded data); a positive repeated inside one batch (an in-batch false negative) is a
    warning and counted by the collator."""
    rows = [{"query": "q", "positive": "p"}, {"query": "r", "positive": "s"}, {"query": "q", "positive": "p"}]
    with caplog.at_level("WARNING"):
        dataset = load_training_data(_write_jsonl(tmp_path / "rows.jsonl", rows))
    assert "1 row(s) repeat an earlier row's (query, positive) pair (e.g. row 2 repeats row 0)" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING"):  # the trainer's second look at loaded data: no second warning
        validate_training_dataset(dataset, warn_repeats=False)
    assert not caplog.text
    collator = TrainingCollator(tokenizer, query_max_length=8, document_max_length=8)
    with caplog.at_level("WARNING"):
        assert collator([dataset[0], dataset[1]])["repeated_positives"] == 0
        assert collator.repeated_positives == 0 and not caplog.text
        assert collator([dataset[0], dataset[1], dataset[2]])["repeated_positives"] == 1
    assert collator.repeated_positives == 1 and "1 row(s) of a batch of 3 repeat" in caplog.text


def _cut_gzip(path: Path, rows: list[dict]) -> Path:
    """``rows`` as JSON lines, gzip-compressed, with the second half of the compressed bytes cut off."""
    data = gzip.compress("".join(json.dumps(row) + "\n" for row in rows).encode())
    path.write_bytes(data[: len(data) // 2])
    return path


def test_truncated_gzip_training_file_and_corpus_are_named(tmp_path: Path) -> None:
    """A cut .jsonl.gz (training file past the first read, BEIR corpus) is a ValueError naming file and line."""
    rows = [
        {"query": f"query {i} {i * 7919}", "positive": f"document {i} " + "text " * 40} for i in range(3000)
    ]
    train = _cut_gzip(tmp_path / "train.jsonl.gz", rows)
    with pytest.raises(ValueError, match=rf"{train}:\d+: the file is truncated or corrupted"):
        load_training_data(train)
    beir = write_beir(tmp_path / "beir", gzip_corpus=True)
    corpus = [{"_id": f"d{i}", "title": "", "text": f"document {i} " + "text " * 40} for i in range(3000)]
    _cut_gzip(beir / "corpus.jsonl.gz", corpus)
    with pytest.raises(
        ValueError, match=rf"{beir / 'corpus.jsonl.gz'}:\d+: the file is truncated or corrupted"
    ):
        read_corpus(beir)
