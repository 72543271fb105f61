"""The in-batch teacher (``--in_batch_teacher``): each teacher kind's [B, (1+k)·B] batch scores against the pair
scores of the ``teacher`` command's teachers, the per-query normalisation and ensemble, the collator that attaches
them, and every refusal before training (CPU, tiny models)."""

from __future__ import annotations

from pathlib import Path

import datasets
import pytest
import torch
from test_teacher_scores import ROWS, TOL, models  # noqa: F401 (models: the tiny sentence-transformers teachers)

from gradcache_sparton.data import TrainingCollator
from gradcache_sparton.mining import (
    BatchTeacher,
    bm25_scores,
    build_batch_teacher,
    ensemble_scores,
    load_teacher,
    normalise_scores,
    parse_teacher_spec,
)

SHIPPED = "splade-tiny-msmarco"
QUERIES = [row["query"] for row in ROWS]
# The batch's document columns (positives, negative_1, negative_2), B = 3 texts each.
COLUMNS = [[row[name] for row in ROWS] for name in ("positive", "negative_1", "negative_2")]
BATCH_DOCUMENTS = [text for column in COLUMNS for text in column]  # column c·B + r: row r of column c
DOCUMENTS = list(dict.fromkeys(BATCH_DOCUMENTS))  # the training documents, first seen first (by row)


def _dataset(rows=ROWS) -> datasets.Dataset:
    return datasets.Dataset.from_list(rows)


def _every_document(teacher) -> torch.Tensor:
    """The ``teacher`` command's teacher's scores of each query against all (1+k)·B documents of the batch."""
    scores, _ = teacher.scores(QUERIES, [BATCH_DOCUMENTS] * len(QUERIES), DOCUMENTS)
    return scores.double()


def _corpus_order_documents() -> list[str]:
    """The distinct documents in the order the batch teacher reads them (column by column)."""
    return list(
        dict.fromkeys(t for name in ("positive", "negative_1", "negative_2") for t in _dataset()[name])
    )


def test_spec_parsing_shares_the_teacher_commands_weight_checks() -> None:
    """TEACHER[:WEIGHT],...: equal shares by default, weights all or none, > 0 and summing to 1 (check_weights);
    a path keeps its own colons."""
    assert parse_teacher_spec("a,bm25") == (["a", "bm25"], [0.5, 0.5])
    assert parse_teacher_spec("out/x:0.7, bm25:0.3") == (["out/x", "bm25"], [0.7, 0.3])
    assert parse_teacher_spec("c:/m:1") == (["c:/m"], [1.0])
    for spec, message in [
        ("a:0.5,bm25", "every teacher a weight, or none"),
        ("a:0.5,bm25:0.6", "must sum to 1"),
        ("a:0,bm25:1", "finite and > 0"),
        ("a,,b", "empty teacher"),
    ]:
        with pytest.raises(ValueError, match=f"--in_batch_teacher.*{message}"):
            parse_teacher_spec(spec)


def test_bm25_batch_scores_equal_bm25_scores_of_every_pair() -> None:
    """BM25's batch matrix is bm25_scores of each query against every document of the batch under the index of
    the training documents: its own candidates' scores are those the teacher command writes."""
    pytest.importorskip("bm25s")
    teacher = build_batch_teacher("bm25", _dataset(), show_progress=False)
    (raw,) = teacher.raw_scores(QUERIES, COLUMNS)
    expected, _ = bm25_scores(
        QUERIES, [BATCH_DOCUMENTS] * 3, _corpus_order_documents(), depth=1, show_progress=False
    )
    assert raw.shape == (3, 9) and float(raw.max()) > 0
    # The reps are kept in float32: scores of O(10) within a few float32 ulps (2^-24 relative each) of float64.
    torch.testing.assert_close(raw, expected.double(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["splade", "sentence_transformer", "sparse_encoder"])
def test_model_batch_scores_equal_the_teacher_commands_pair_scores(kind: str, models) -> None:  # noqa: F811
    """A model teacher's batch matrix (reps made once, one sparse or dense product) equals the teacher command's
    score of every (query, document) pair of the batch, for ours, a SentenceTransformer and a SparseEncoder."""
    name = {
        "splade": SHIPPED,
        "sentence_transformer": str(models["dense"]),
        "sparse_encoder": str(models["sparse"]),
    }
    teacher = build_batch_teacher(name[kind], _dataset(), device="cpu", show_progress=False)
    (raw,) = teacher.raw_scores(QUERIES, COLUMNS)
    expected = _every_document(load_teacher(name[kind], kind=kind, device="cpu", show_progress=False))
    assert raw.shape == (3, 9) and float(raw.abs().max()) > 0
    torch.testing.assert_close(raw, expected, **TOL)


def test_batch_scores_are_normalised_per_query_over_the_whole_row_and_ensembled() -> None:
    """The collator's matrix: each teacher min-max normalised over the query's (1+k)·B candidates (or not at
    all), weighted and scaled by the mining functions; a row's values span [0, scale] under minmax."""
    pytest.importorskip("bm25s")
    teacher = build_batch_teacher(f"{SHIPPED}:0.25,bm25:0.75", _dataset(), device="cpu", show_progress=False)
    raw = teacher.raw_scores(QUERIES, COLUMNS)
    scores = teacher(QUERIES, COLUMNS)
    expected = ensemble_scores(
        [normalise_scores(r, None, normalisation="minmax") for r in raw], [0.25, 0.75], scale=30
    )
    assert scores.dtype == torch.float32 and scores.shape == (3, 9)
    torch.testing.assert_close(scores, expected)
    assert float(scores.max()) <= 30 + 1e-5 and float(scores.min()) >= 0
    plain = BatchTeacher(
        teacher.query_row,
        teacher.document_row,
        teacher.reps,
        weights=[0.25, 0.75],
        normalisation="none",
        scale=2.0,
    )
    torch.testing.assert_close(plain(QUERIES, COLUMNS), (2 * (0.25 * raw[0] + 0.75 * raw[1])).float())


def test_collator_attaches_the_batch_matrix_and_refuses_a_second_source() -> None:
    """The collator passes the batch's queries and document columns (positives, then each negative column) and
    attaches the teacher's [B, (1+k)·B] matrix as teacher_scores; rows that carry teacher_scores as well are
    refused (neither source is preferred silently)."""
    from transformers import AutoTokenizer

    from gradcache_sparton.resources import default_tokenizer_path

    seen = []

    def teacher(queries, documents):
        seen.append((queries, documents))
        return torch.ones(len(queries), len(queries) * len(documents))

    collator = TrainingCollator(
        AutoTokenizer.from_pretrained(default_tokenizer_path()), batch_teacher=teacher
    )
    batch = collator(ROWS)
    assert seen == [(QUERIES, COLUMNS)]
    assert batch["loss_kwargs"]["teacher_scores"].shape == (3, 9)
    with pytest.raises(ValueError, match=r"teacher_scores.*batch_teacher"):
        collator([{**row, "teacher_scores": [1.0, 0.0, 0.0]} for row in ROWS])


def test_bad_teachers_are_refused_before_any_encoding(tmp_path: Path, models) -> None:  # noqa: F811
    """A missing folder, a cross-encoder (B·(1+k)·B pairs a step), a data file with its own teacher_scores and
    a checkpoint whose reps are NaN: one ValueError naming --in_batch_teacher (or the column)."""
    from engine_helpers import save_small_masked_lm
    from transformers import BertForMaskedLM

    with pytest.raises(ValueError, match=r"--in_batch_teacher.*no such folder"):
        build_batch_teacher(str(tmp_path / "missing"), _dataset(), show_progress=False)
    with pytest.raises(ValueError, match=r"--in_batch_teacher.*cross-encoder"):
        build_batch_teacher(str(models["cross"]), _dataset(), show_progress=False)
    scored = _dataset([{**row, "teacher_scores": [1.0, 0.0, 0.0]} for row in ROWS])
    with pytest.raises(ValueError, match="teacher_scores column and --in_batch_teacher"):
        build_batch_teacher(SHIPPED, scored, show_progress=False)
    broken = save_small_masked_lm(tmp_path / "broken")
    model = BertForMaskedLM.from_pretrained(broken)
    with torch.no_grad():
        model.cls.predictions.bias.fill_(float("nan"))
    model.save_pretrained(broken)
    with pytest.raises(ValueError, match=r"--in_batch_teacher.*NaN"):
        build_batch_teacher(str(broken), _dataset(), device="cpu", show_progress=False)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"contrastive": "kl_div", "in_batch_teacher": "bm25"},
            "needs contrastive='kl_div' with kl_in_batch",
        ),
        ({"in_batch_teacher": "bm25"}, "needs contrastive='kl_div' with kl_in_batch"),
        (
            {
                "contrastive": "kl_div",
                "kl_in_batch": True,
                "in_batch_teacher": "bm25",
                "in_batch_teacher_normalisation": "zscore",
            },
            "in_batch_teacher_normalisation must be one of",
        ),
        ({"in_batch_teacher_normalisation": "none"}, "applies to an in_batch_teacher only"),
    ],
)
def test_in_batch_teacher_options_are_checked_with_the_loss_config(kwargs, message) -> None:
    """--in_batch_teacher only with kl_div and kl_in_batch; its normalisation minmax or none (zscore needs a
    corpus search), and not without a teacher: one ValueError naming the option."""
    from gradcache_sparton.losses import SpladeLossConfig

    with pytest.raises(ValueError, match=message):
        SpladeLossConfig(**kwargs)


def test_several_processes_are_refused(tmp_path: Path, monkeypatch) -> None:
    """Under data parallelism the loss sees the gathered batch, whose other processes' documents a process's
    teacher never scored: validate_run refuses in_batch_teacher with more than one process."""
    from gradcache_sparton.arguments import CachedSpladeTrainingArguments
    from gradcache_sparton.run_checks import validate_run

    args = CachedSpladeTrainingArguments(
        output_dir=str(tmp_path),
        contrastive="kl_div",
        kl_in_batch=True,
        in_batch_teacher="bm25",
        use_cpu=True,
    )
    monkeypatch.setattr(CachedSpladeTrainingArguments, "world_size", property(lambda self: 2))
    with pytest.raises(ValueError, match="in_batch_teacher with 2 processes"):
        validate_run(args, num_train_rows=10_000)


def test_train_distils_over_the_batch_from_an_in_batch_teacher(tmp_path: Path, monkeypatch) -> None:
    """`train --contrastive kl_div --kl_in_batch True --in_batch_teacher ...` builds the teacher before the model
    and every step's loss reads a [B, (1+k)·B] teacher matrix; without the teacher, the trainer refuses the
    option."""
    pytest.importorskip("bm25s")
    import json

    from gradcache_sparton.cli import main

    shapes = []
    real = BatchTeacher.__call__

    def recording(self, queries, documents):
        scores = real(self, queries, documents)
        shapes.append(tuple(scores.shape))
        return scores

    monkeypatch.setattr(BatchTeacher, "__call__", recording)
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    argv = ["train", "--model_name_or_path", SHIPPED, "--train_data", str(data), "--eval_beir", "none",
            "--output_dir", str(tmp_path / "out"), "--per_device_train_batch_size", "3", "--max_steps", "2",
            "--query_max_length", "16", "--document_max_length", "32", "--use_cpu", "--disable_tqdm", "True",
            "--contrastive", "kl_div", "--kl_in_batch", "True", "--in_batch_teacher", f"{SHIPPED}:0.5,bm25:0.5"]  # fmt: skip
    assert main(argv) == 0
    assert shapes == [(3, 9), (3, 9)]
    assert (tmp_path / "out" / "model.safetensors").is_file()

    from gradcache_sparton.arguments import CachedSpladeTrainingArguments, ModelArguments
    from gradcache_sparton.model_loading import build_encoder, build_tokenizer
    from gradcache_sparton.trainer import CachedSpladeTrainer

    model_args = ModelArguments(model_name_or_path=SHIPPED)
    tokenizer = build_tokenizer(model_args)
    args = CachedSpladeTrainingArguments(
        output_dir=str(tmp_path / "x"),
        per_device_train_batch_size=3,
        contrastive="kl_div",
        kl_in_batch=True,
        in_batch_teacher="bm25",
        use_cpu=True,
    )
    with pytest.raises(ValueError, match="in_batch_teacher needs its batch_teacher"):
        CachedSpladeTrainer(
            build_encoder(model_args, tokenizer), args, train_dataset=_dataset(), processing_class=tokenizer
        )
