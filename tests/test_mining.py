"""Hard-negative mining: rankings, the rank window, known positives, k columns, determinism, files, CLI."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch
from torch import Tensor

import gradcache_sparton.data.output as output_module
import gradcache_sparton.mining.negatives as negatives_module
from gradcache_sparton.cli import main
from gradcache_sparton.data import (
    BeirData,
    beir_training_pairs,
    default_dev_beir_path,
    load_beir,
    load_training_data,
)
from gradcache_sparton.evaluation import EncodingSettings
from gradcache_sparton.mining import (
    beir_mining_pairs,
    bm25_rankings,
    bm25_scores,
    load_mining_pairs,
    mine_hard_negatives,
    run_mining,
    splade_rankings,
    write_training_file,
)
from gradcache_sparton.modeling import SpladeEncoder

pytest.importorskip("bm25s", reason="mining tests need bm25s (pip install -e '.[dev]')")
pytest.importorskip("Stemmer", reason="mining tests need PyStemmer (pip install -e '.[dev]')")

# ------------------------------------------------------------------------------------------- tiny data

_WORDS = [
    "protein",
    "cell",
    "gene",
    "tumour",
    "virus",
    "membrane",
    "enzyme",
    "receptor",
    "kinase",
    "neuron",
    "insulin",
    "plasma",
]


def _random_corpus(
    num_docs: int = 40, num_queries: int = 6, seed: int = 0
) -> tuple[BeirData, datasets.Dataset]:
    """A seeded synthetic BEIR set: docs of 3..8 words of a 12-word vocabulary, each query judged
    relevant to one or two docs, and its mining pairs (one row per relevant doc)."""
    rng = random.Random(seed)
    corpus = {
        f"d{i}": " ".join(rng.choices(_WORDS, k=rng.randint(3, 8))) + f" doc{i}" for i in range(num_docs)
    }
    queries = {f"q{i}": " ".join(rng.sample(_WORDS, 3)) for i in range(num_queries)}
    assert len(set(queries.values())) == num_queries  # the helpers below find a query by its text
    qrels = {q: {d: 1 for d in rng.sample(sorted(corpus), rng.randint(1, 2))} for q in queries}
    beir = BeirData(corpus=corpus, queries=queries, qrels=qrels)
    return beir, beir_mining_pairs(beir)


def _negatives(row: dict) -> list[str]:
    return [row[f"negative_{i}"] for i in range(1, sum(k.startswith("negative_") for k in row) + 1)]


def _known_positive_texts(beir: BeirData, query_text: str) -> set[str]:
    query_id = next(q for q, text in beir.queries.items() if text == query_text)
    return {beir.corpus[d] for d, r in beir.qrels[query_id].items() if r > 0}


# ---------------------------------------------------------------------------------------------- rankings


def test_bm25_rankings_match_full_sort_with_ties_by_index() -> None:
    """The partial top-depth equals a full stable sort of bm25s's scores: best first, equal scores
    (duplicate docs) ranked by lower corpus index, also across the partition boundary."""
    import bm25s
    import Stemmer

    beir, _ = _random_corpus()
    docs = list(beir.corpus.values())
    docs = docs + docs[:10]  # exact duplicates: tied scores
    queries = list(beir.queries.values())
    for depth in (1, 7, 25, len(docs)):
        got = bm25_rankings(queries, docs, depth=depth, show_progress=False)
        assert got.shape == (len(queries), depth) and got.dtype == torch.int64
        stemmer = Stemmer.Stemmer("english")
        retriever = bm25s.BM25()
        retriever.index(bm25s.tokenize(docs, stemmer=stemmer, return_ids=False, show_progress=False))
        for row, tokens in enumerate(
            bm25s.tokenize(queries, stemmer=stemmer, return_ids=False, show_progress=False)
        ):
            scores = retriever.get_scores(tokens)
            expected = np.argsort(-scores, kind="stable")[:depth]
            assert got[row].tolist() == expected.tolist()


def test_bm25_scores_are_bm25s_scores_of_any_text() -> None:
    """bm25_scores gives a corpus document bm25s's own score and each query its top-depth bm25s scores; a
    text outside the corpus is scored under the corpus's statistics alone (equal to a corpus document
    with the same text), and a text sharing no query token scores 0."""
    import bm25s
    import Stemmer

    beir, _ = _random_corpus()
    docs = list(beir.corpus.values())
    queries = list(beir.queries.values())
    outside = docs[3]  # a text given as a candidate, not by its corpus position
    candidates = [
        [docs[i % len(docs)], docs[(5 * i + 1) % len(docs)], outside, "zzz qqq"] for i in range(len(queries))
    ]
    got, top = bm25_scores(queries, candidates, docs, depth=7, show_progress=False)
    assert got.shape == (len(queries), 4) and top.shape == (len(queries), 7)
    stemmer = Stemmer.Stemmer("english")
    tokenize = dict(stopwords="en", stemmer=stemmer, return_ids=False, show_progress=False)
    retriever = bm25s.BM25()
    retriever.index(bm25s.tokenize(docs, **tokenize), show_progress=False)
    for row, tokens in enumerate(bm25s.tokenize(queries, **tokenize)):
        scores = torch.from_numpy(retriever.get_scores(tokens)).double()  # [N], bm25s computes in float32
        expected = torch.stack(
            [scores[row % len(docs)], scores[(5 * row + 1) % len(docs)], scores[3], scores[3] * 0]
        )
        # float32 vs float64: each term idf · tfc rounds ~4 times and a query sums < 20 terms, so the
        # relative error is below 24 · 2**-24 ≈ 1.4e-6; 1e-5 leaves room without hiding a formula change.
        torch.testing.assert_close(got[row], expected, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(top[row], scores.sort(descending=True).values[:7], rtol=1e-5, atol=1e-6)
    assert (got[:, 0] > 0).any()
    with pytest.raises(ValueError, match="same number"):
        bm25_scores(queries[:2], [["a"], ["a", "b"]], docs, depth=3)


# ------------------------------------------------------------------------------------ negative selection


def test_known_positives_are_never_mined() -> None:
    """Every positive of a query (from all its rows) is skipped: by id, by exact text (a duplicate text
    under another id) and by id alone (the pair's positive text differs from the corpus text)."""
    corpus = {
        "d0": "insulin receptor kinase signalling",
        "d1": "insulin receptor kinase in muscle",
        "d2": "Title. insulin receptor kinase in liver",
        "d3": "insulin receptor kinase signalling",  # same text as d0 under another id
        **{f"x{i}": f"insulin receptor background {i}" for i in range(6)},
        **{f"y{i}": f"unrelated plasma membrane {i}" for i in range(6)},
    }
    query = "insulin receptor kinase"
    pairs = datasets.Dataset.from_list(
        [
            {"query": query, "positive": corpus["d0"], "query_id": "q", "positive_id": "d0"},
            {"query": query, "positive": corpus["d1"], "query_id": "q", "positive_id": "d1"},
            # the pair's text lacks the title the corpus has: only the id can match it
            {
                "query": query,
                "positive": "insulin receptor kinase in liver",
                "query_id": "q",
                "positive_id": "d2",
            },
        ]
    )
    mined = mine_hard_negatives(
        pairs, corpus=corpus, num_negatives=5, rank_start=1, rank_end=20, sampling="top", show_progress=False
    )
    skipped = {corpus["d0"], corpus["d1"], corpus["d2"]}
    for row in mined:
        assert not skipped.intersection(_negatives(row)), row
        assert len(set(_negatives(row))) == 5  # distinct texts
    # Without positive_id only texts can match: d2's corpus text is then mined (the documented limit).
    by_text = mine_hard_negatives(
        pairs.remove_columns(["query_id", "positive_id"]),
        corpus=corpus,
        num_negatives=5,
        rank_start=1,
        rank_end=20,
        sampling="top",
        show_progress=False,
    )
    assert corpus["d2"] in _negatives(by_text[0])
    assert not {corpus["d0"], corpus["d1"]}.intersection(_negatives(by_text[0]))


def test_negatives_come_from_the_rank_window_in_rank_order() -> None:
    """Each negative sits at a rank in rank_start..rank_end of its query's ranking (1-based, positives
    counted), is not a known positive, and negative_1..k are in rank order."""
    beir, pairs = _random_corpus()
    rank_start, rank_end, k = 4, 15, 3
    mined = mine_hard_negatives(
        pairs,
        corpus=beir.corpus,
        num_negatives=k,
        rank_start=rank_start,
        rank_end=rank_end,
        show_progress=False,
    )
    doc_texts = list(beir.corpus.values())
    query_texts = list(dict.fromkeys(pairs["query"]))
    ranking = bm25_rankings(query_texts, doc_texts, depth=len(doc_texts), show_progress=False).tolist()
    for row in mined:
        ranks = [
            ranking[query_texts.index(row["query"])].index(doc_texts.index(text)) + 1
            for text in _negatives(row)
        ]
        assert all(rank_start <= r <= rank_end for r in ranks), ranks
        assert ranks == sorted(ranks)
        assert not _known_positive_texts(beir, row["query"]).intersection(_negatives(row))


def test_a_repeated_text_is_mined_once_per_row() -> None:
    """A text that the corpus holds under several ids counts once: a row's k negatives are distinct."""
    beir, pairs = _random_corpus()
    corpus = beir.corpus | {f"copy_{d}": text for d, text in beir.corpus.items()}  # every text twice
    for sampling in ("top", "random"):
        mined = mine_hard_negatives(
            pairs,
            corpus=corpus,
            num_negatives=4,
            rank_start=1,
            rank_end=40,
            sampling=sampling,
            show_progress=False,
        )
        for row in mined:
            assert len(set(_negatives(row))) == 4, row


def test_top_sampling_takes_the_best_ranked_candidates() -> None:
    """sampling='top' gives the k best-ranked non-positive documents from rank_start on."""
    beir, pairs = _random_corpus()
    mined = mine_hard_negatives(
        pairs,
        corpus=beir.corpus,
        num_negatives=2,
        rank_start=3,
        rank_end=30,
        sampling="top",
        show_progress=False,
    )
    doc_texts = list(beir.corpus.values())
    query_texts = list(dict.fromkeys(pairs["query"]))
    ranking = bm25_rankings(query_texts, doc_texts, depth=30, show_progress=False).tolist()
    for row in mined:
        positives = _known_positive_texts(beir, row["query"])
        window = [doc_texts[d] for d in ranking[query_texts.index(row["query"])][2:]]
        assert _negatives(row) == [text for text in window if text not in positives][:2]


def test_mining_is_deterministic_and_seeded(tmp_path: Path) -> None:
    """Equal inputs and seed give equal rows and byte-equal .jsonl.gz files; another seed draws other
    negatives; k columns negative_1..k, rows in input order with query and positive unchanged."""
    beir, pairs = _random_corpus()
    settings = dict(corpus=beir.corpus, num_negatives=3, rank_start=2, rank_end=30, show_progress=False)
    first = mine_hard_negatives(pairs, seed=7, **settings)
    second = mine_hard_negatives(pairs, seed=7, **settings)
    other = mine_hard_negatives(pairs, seed=8, **settings)
    assert first.column_names == ["query", "positive", "negative_1", "negative_2", "negative_3"]
    assert first["query"] == pairs["query"] and first["positive"] == pairs["positive"]
    assert first.to_list() == second.to_list()
    assert first.to_list() != other.to_list()
    a = write_training_file(first, tmp_path / "a.jsonl.gz")
    b = write_training_file(second, tmp_path / "b.jsonl.gz")
    assert a.read_bytes() == b.read_bytes()


def test_output_file_is_what_train_reads(tmp_path: Path) -> None:
    """The written file loads with load_training_data (train's reader) into the same rows and columns."""
    beir, pairs = _random_corpus()
    mined = mine_hard_negatives(
        pairs, corpus=beir.corpus, num_negatives=2, rank_start=2, rank_end=20, show_progress=False
    )
    for name in ("mined.jsonl", "mined.jsonl.gz"):
        path = write_training_file(mined, tmp_path / "sub" / name)
        loaded = load_training_data(path)
        assert loaded.column_names == ["query", "positive", "negative_1", "negative_2"]
        assert loaded.to_list() == mined.to_list()


def test_pairs_from_beir_and_jsonl_with_ids(tmp_path: Path) -> None:
    """beir_mining_pairs has beir_training_pairs' rows plus ids; a jsonl with integer ids groups rows by
    query_id and matches positives by id."""
    beir, pairs = _random_corpus()
    assert pairs.remove_columns(["query_id", "positive_id"]).to_list() == beir_training_pairs(beir).to_list()
    corpus = {str(i): f"kinase receptor text {i}" for i in range(12)}
    path = tmp_path / "pairs.jsonl"
    rows = [
        {
            "query": "kinase receptor",
            "positive": "no title: kinase receptor text 0",
            "query_id": 1,
            "positive_id": 0,
        },
        {"query": "kinase receptor", "positive": corpus["1"], "query_id": 1, "positive_id": 1},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    loaded = load_mining_pairs(path)
    mined = mine_hard_negatives(
        loaded, corpus=corpus, num_negatives=4, rank_start=1, rank_end=12, show_progress=False
    )
    for row in mined:
        assert not {corpus["0"], corpus["1"]}.intersection(_negatives(row))


def test_mining_without_a_corpus_uses_the_distinct_positives() -> None:
    """corpus=None mines among the pairs' distinct positives; a query's own positives are skipped."""
    beir, pairs = _random_corpus(num_queries=12)
    mined = mine_hard_negatives(pairs, num_negatives=2, rank_start=1, rank_end=10, show_progress=False)
    positives = set(pairs["positive"])
    for row in mined:
        assert set(_negatives(row)) <= positives
        assert not _known_positive_texts(beir, row["query"]).intersection(_negatives(row))


# --------------------------------------------------------------------------------------- SPLADE ranking


class _TokenPresence:
    """rep[b, v] = 1 where token v occurs unmasked in row b (specials dropped): score = shared tokens."""

    def __init__(self, vocab_size: int, special_ids: list[int]) -> None:
        self.vocab_size, self.special = vocab_size, torch.tensor(special_ids)

    def __call__(self, input_ids: Tensor, attention_mask: Tensor, **_: Tensor) -> Tensor:
        keep = (attention_mask.bool() & ~torch.isin(input_ids, self.special)).float()  # [B, S]
        reps = torch.zeros(input_ids.shape[0], self.vocab_size)
        return reps.scatter_reduce(1, input_ids, keep, reduce="amax")  # [B, V]


def test_splade_mining_ranks_with_the_encoder_at_its_max_lengths(tokenizer) -> None:
    """method='splade' ranks by the encoder's reps and truncates documents to document_max_length: a
    match past the limit does not count."""
    filler = " ".join(["plasma"] * 20)
    corpus = {
        "d0": "apple banana",
        "d1": "apple",
        "d2": "banana cherry",
        "d3": "cherry",
        "d4": f"{filler} apple banana",  # both query words, but only after 20 tokens
    }
    pairs = datasets.Dataset.from_list(
        [{"query": "apple banana", "positive": "apple banana", "positive_id": "d0"}]
    )
    encoder = _TokenPresence(len(tokenizer), tokenizer.all_special_ids)
    common = dict(corpus=corpus, method="splade", encoder=encoder, show_progress=False)
    common.update(num_negatives=2, rank_start=1, rank_end=5, sampling="top")
    short = mine_hard_negatives(pairs, encoding=EncodingSettings(tokenizer, document_max_length=8), **common)
    assert _negatives(short[0]) == [corpus["d1"], corpus["d2"]]  # d4 truncated: score 0
    long = mine_hard_negatives(pairs, encoding=EncodingSettings(tokenizer, document_max_length=64), **common)
    assert _negatives(long[0]) == [corpus["d4"], corpus["d1"]]  # d4 scores 2, ranked first


def _write_beir(folder: Path, beir: BeirData, split: str = "train") -> None:
    (folder / "qrels").mkdir(parents=True)
    with (folder / "corpus.jsonl").open("w") as f:
        f.writelines(json.dumps({"_id": d, "title": "", "text": t}) + "\n" for d, t in beir.corpus.items())
    with (folder / "queries.jsonl").open("w") as f:
        f.writelines(json.dumps({"_id": q, "text": t}) + "\n" for q, t in beir.queries.items())
    lines = [f"{q}\t{d}\t{r}\n" for q, judged in beir.qrels.items() for d, r in judged.items()]
    (folder / "qrels" / f"{split}.tsv").write_text("query-id\tcorpus-id\tscore\n" + "".join(lines))


def test_cli_mines_with_a_splade_checkpoint(tmp_path: Path, tokenizer, tiny_bert_config, monkeypatch) -> None:
    """`mine --method splade` loads a saved checkpoint, encodes queries at the length it was trained with and
    documents at 256 at least, capped by its position table (no length flag given), and writes k negatives
    per pair that train reads."""
    torch.manual_seed(0)
    encoder = SpladeEncoder.from_config(tiny_bert_config)
    encoder.query_max_length, encoder.document_max_length = 8, 16  # saved in splade_config.json
    encoder.save_pretrained(tmp_path / "ckpt", tokenizer=tokenizer)
    seen = {}

    def recording_rankings(*args, **kwargs):
        seen.update(kwargs)
        return splade_rankings(*args, **kwargs)

    monkeypatch.setattr(negatives_module, "splade_rankings", recording_rankings)
    beir, _ = _random_corpus()
    _write_beir(tmp_path / "beir", beir)
    out = tmp_path / "mined.jsonl"
    argv = ["mine", "--beir_path", str(tmp_path / "beir"), "--method", "splade"]
    argv += ["--model_name_or_path", str(tmp_path / "ckpt"), "--device", "cpu", "--output_file", str(out)]
    argv += ["--num_negatives", "2", "--rank_start", "2", "--rank_end", "20"]
    assert main(argv) == 0
    encoding = seen["encoding"]
    assert (encoding.query_max_length, encoding.document_max_length) == (8, 128)  # 128: the position table
    loaded = load_training_data(out)
    assert len(loaded) == sum(len(j) for j in beir.qrels.values())
    assert loaded.column_names == ["query", "positive", "negative_1", "negative_2"]
    for row in loaded:
        assert not _known_positive_texts(beir, row["query"]).intersection(_negatives(row))


# -------------------------------------------------------------------------------------------- bad input


def test_bad_input_fails_before_any_ranking(tmp_path: Path, monkeypatch) -> None:
    """k < 1, a window smaller than k, a window past the corpus, an empty corpus, unknown names, an
    encoder mismatch and pairs that already have negatives or other columns fail before ranking."""

    def no_ranking(*args, **kwargs):
        raise AssertionError("ranking ran despite bad input")

    monkeypatch.setattr(negatives_module, "bm25_rankings", no_ranking)
    monkeypatch.setattr(negatives_module, "splade_rankings", no_ranking)
    beir, pairs = _random_corpus()
    cases = [
        (dict(num_negatives=0), "num_negatives must be a positive int"),
        (dict(num_negatives=5, rank_start=10, rank_end=12), r"rank window 10\.\.12 holds 3 ranks"),
        (dict(rank_start=0), "rank_start must be a positive int"),
        (dict(rank_start=39, rank_end=100, num_negatives=3), "corpus has 40 documents"),
        (dict(corpus={}), "corpus is empty"),
        (dict(sampling="best"), "sampling must be one of"),
        (dict(method="dense"), "method must be one of"),
        (dict(encoder=lambda **f: f), "method='bm25' takes no encoder"),
        (dict(method="splade"), "method='splade' needs an encoder and its encoding settings"),
        (dict(bm25_stemmer="klingon"), "bm25_stemmer must be one of"),
    ]
    for overrides, message in cases:
        kwargs = dict(corpus=beir.corpus, show_progress=False) | overrides
        with pytest.raises(ValueError, match=message):
            mine_hard_negatives(pairs, **kwargs)
    with_negatives = pairs.add_column("negative_1", pairs["positive"])
    with pytest.raises(ValueError, match="pairs already have negatives"):
        mine_hard_negatives(with_negatives, corpus=beir.corpus)
    with pytest.raises(ValueError, match=r"pairs have column\(s\) \['score'\]"):
        mine_hard_negatives(pairs.add_column("score", [1.0] * len(pairs)), corpus=beir.corpus)
    with pytest.raises(ValueError, match="column 'positive_id' is empty"):
        mine_hard_negatives(
            pairs.remove_columns("positive_id").add_column("positive_id", [None] * len(pairs))
        )


def test_short_window_after_skipping_positives_is_an_error() -> None:
    """A query whose window holds fewer than k candidates once its positives are skipped is a clear
    error naming the query, not a ragged row."""
    corpus = {f"d{i}": f"kinase receptor {i}" for i in range(4)}
    pairs = datasets.Dataset.from_list(
        [{"query": "kinase receptor", "positive": corpus[d], "positive_id": d} for d in ("d0", "d1")]
    )
    with pytest.raises(
        ValueError, match=r"1 of 1 queries have fewer than num_negatives=3 .* 'kinase receptor' with 2"
    ):
        mine_hard_negatives(
            pairs, corpus=corpus, num_negatives=3, rank_start=1, rank_end=4, show_progress=False
        )


def test_run_mining_checks_paths_before_loading(tmp_path: Path, monkeypatch) -> None:
    """Missing files, a bad output suffix, an existing output without overwrite, a missing input, a pairs file
    that is not jsonl, splade without a checkpoint or with one that does not load are clear errors; the
    existing file is left as it was."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # a name that is no folder is never looked up on a hub
    existing = tmp_path / "out.jsonl"
    existing.write_text("keep\n")
    csv_pairs = tmp_path / "pairs.csv"
    csv_pairs.write_text("query,positive\nq,p\n")
    dev = str(default_dev_beir_path())
    cases = [
        (dict(output_file=existing, beir_path=dev, split="dev"), "exists: pass overwrite=True"),
        (dict(output_file=tmp_path / "o.csv", beir_path=dev), "must end in one of"),
        (dict(output_file=tmp_path / "o.jsonl", split="dev"), "split 'dev' is a qrels split of beir_path"),
        (dict(output_file=tmp_path / "o.jsonl", beir_path="default", split="train"), "only the split 'dev'"),
        (dict(output_file=tmp_path / "o.jsonl", train_data=tmp_path / "none.jsonl"), "does not exist"),
        (dict(output_file=tmp_path / "o.jsonl", beir_path=tmp_path / "none"), "is not a directory"),
        (dict(output_file=tmp_path / "o.jsonl", beir_path=dev, method="splade"), "needs model_name_or_path"),
        (
            dict(output_file=tmp_path / "o.jsonl", train_data=existing, corpus="beir"),
            "corpus='beir' needs beir_path",
        ),
        (dict(output_file=tmp_path / "o.jsonl", beir_path=dev, rank_start=5, rank_end=5), "rank window 5..5"),
        (dict(output_file=tmp_path / "o.jsonl", train_data=csv_pairs), r"mining reads \['.jsonl', '.json'\]"),
        (  # the checkpoint is loaded (and fails) before the pairs file is read
            dict(
                output_file=tmp_path / "o.jsonl",
                train_data=csv_pairs,
                method="splade",
                model_name_or_path="no/such",
            ),
            "model_name_or_path 'no/such' is not a local folder",
        ),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            run_mining(show_progress=False, **kwargs)
    assert existing.read_text() == "keep\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.jsonl", "pairs.csv"]


def test_failed_write_leaves_the_old_file_and_no_temporary(tmp_path: Path, monkeypatch) -> None:
    """A write that fails midway leaves an existing output byte-for-byte as it was and no temporary file."""
    beir, pairs = _random_corpus()
    mined = mine_hard_negatives(
        pairs, corpus=beir.corpus, num_negatives=1, rank_start=2, rank_end=10, show_progress=False
    )
    path = tmp_path / "out.jsonl"
    path.write_text("old\n")

    def fail_midway(dataset, stream):
        stream.write(b'{"query": "half')
        raise OSError("disk full")

    monkeypatch.setattr(output_module, "_write_rows", fail_midway)
    with pytest.raises(OSError, match="disk full"):
        write_training_file(mined, path, overwrite=True)
    assert path.read_text() == "old\n"
    assert [p.name for p in tmp_path.iterdir()] == ["out.jsonl"]


# ------------------------------------------------------------------------------------------ end to end


@pytest.mark.slow  # a fresh interpreter imports torch and transformers: most of its ~10-30 s
def test_cli_mines_the_shipped_scifact_sample(tmp_path: Path) -> None:
    """`python -m gradcache_sparton.cli mine` on the shipped SciFact dev sample writes one row per
    relevant judgement with 2 negatives that train reads, none a positive of its query; a second run
    refuses to overwrite (exit 2, file unchanged)."""
    out = tmp_path / "scifact_mined.jsonl.gz"
    command = [
        sys.executable,
        "-m",
        "gradcache_sparton.cli",
        "mine",
        "--beir_path",
        str(default_dev_beir_path()),
    ]
    command += ["--split", "dev", "--num_negatives", "2", "--rank_start", "5", "--rank_end", "50"]
    command += ["--output_file", str(out)]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["rows"] == 115
    beir = load_beir(default_dev_beir_path(), split="dev")
    loaded = load_training_data(out)
    assert len(loaded) == 115
    assert loaded.column_names == ["query", "positive", "negative_1", "negative_2"]
    for row in loaded:
        assert not _known_positive_texts(beir, row["query"]).intersection(_negatives(row))
    before = out.read_bytes()
    assert main(command[3:]) == 2  # in-process: same flags, the file exists
    assert out.read_bytes() == before


@pytest.mark.parametrize("chosen", [None, "cuda"])
def test_bm25_keeps_jax_off_the_gpu_unless_chosen(monkeypatch, chosen: str | None) -> None:
    """Loading bm25s for mining leaves JAX on the CPU (bm25s runs a JAX op at import, which on a GPU machine
    would hold 75% of the first GPU), and keeps a platform the user chose."""
    from gradcache_sparton.mining.rankings import check_bm25_installed

    monkeypatch.delitem(sys.modules, "jax", raising=False)
    if chosen is None:
        monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    else:
        monkeypatch.setenv("JAX_PLATFORMS", chosen)
    check_bm25_installed(None)
    assert os.environ["JAX_PLATFORMS"] == (chosen or "cpu")
