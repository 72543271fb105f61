"""Reliability round 5: the newest paths (inference-free models, `idf`, ONNX export, `crossval --compare`,
``EncodingSettings``, kept graphs, resume checks) tried as a careless user would, each fault one clear error
before any work (CLI: one line, exit 2) or an exact result (docs/reliability*.md name each row's test)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gradcache_sparton.cli import main
from gradcache_sparton.run_state import TRAIN_DATA_FILE, TrainDataRecord


def _one_line_error(capsys, *words: str) -> str:
    """The CLI's error: one line (no traceback) holding every word of ``words``."""
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    line = next(line for line in err.splitlines() if ": error: " in line)
    assert all(word in line for word in words), line
    return line


@pytest.mark.parametrize(
    ("entry", "key"),
    [("keep_graphs: 1", "keep_graphs"), ("check_replay: 0", "check_replay"), ("mini_batch_size: 2.5", "mini_batch_size")],
)  # fmt: skip
def test_config_value_of_the_wrong_type_is_one_error_naming_file_and_key(
    tmp_path, capsys, entry, key
) -> None:
    """A YAML value its argument cannot take (an int for a bool, a float for an int) is one error naming the
    file and the key, exit 2, for `train --config` and a crossval recipe's config alike; nothing written."""
    config = tmp_path / "run.yaml"
    config.write_text(entry + "\n")
    out = tmp_path / "out"
    assert main(["train", "--config", str(config), "--output_dir", str(out)]) == 2
    _one_line_error(capsys, str(config), key)
    argv = ["crossval", "--beir_path", "default", "--output_dir", str(out), "--", "--config", str(config)]
    assert main(argv) == 2
    _one_line_error(capsys, str(config), key)
    assert not out.exists()


@pytest.mark.parametrize(
    "record",
    [
        [],
        {"train_data": {"rows": 3}},
        {"train_data": {"rows": 3, "columns": ["query"], "sha256": "ab"}, "switches": 2},
        {"train_data": None, "switches": [{"step": 2}]},
    ],
    ids=["a-list", "identity-without-fields", "switches-not-a-list", "switch-without-records"],
)
def test_edited_train_data_record_is_refused_naming_the_file(tmp_path, record) -> None:
    """A checkpoint's train_data.json edited into another shape (a list, an identity without its fields) is
    one ValueError naming the file on resume, not an AttributeError or KeyError."""
    (tmp_path / TRAIN_DATA_FILE).write_text(json.dumps(record))
    with pytest.raises(ValueError, match=rf"{TRAIN_DATA_FILE} is not a training data record"):
        TrainDataRecord([{"query": "q", "positive": "p"}]).resume(tmp_path, allow_changed=False)


@pytest.mark.parametrize("content", ["null", '"crossval"', "[1, 2]"])
def test_compare_of_a_file_holding_no_object_names_it(tmp_path, capsys, content) -> None:
    """`crossval --compare` of a file holding JSON null, a string or a list: one error naming the file."""
    good, bad = tmp_path / "a.json", tmp_path / "b.json"
    good.write_text("{}")
    bad.write_text(content)
    argv = ["crossval", "--compare", str(bad), str(good), "--output_dir", str(tmp_path / "cmp")]
    assert main(argv) == 2
    _one_line_error(capsys, str(bad), "not a crossval.json")
    assert not (tmp_path / "cmp").exists()


@pytest.mark.slow
def test_learned_idf_resume_from_a_table_of_another_size_names_the_file(
    tmp_path, capsys, tiny_bert_config, tokenizer
) -> None:
    """Resuming a learned_idf run from a checkpoint whose query table has another vocabulary size: one error
    naming the checkpoint's table file, exit 2 (before: a RuntimeError from the tensor copy naming no file)."""
    import torch

    from gradcache_sparton.modeling import QUERY_TABLE_NAME, QueryTable, SpladeEncoder, save_query_table

    start = tmp_path / "start"
    SpladeEncoder.from_config(tiny_bert_config).save_pretrained(start, tokenizer=tokenizer)
    save_query_table(QueryTable(torch.ones(len(tokenizer)), special_token_ids=[0], frozen=False), start)
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(
        "".join(json.dumps({"query": f"q {i}", "positive": f"answer {i}"}) + "\n" for i in range(8))
    )
    run = tmp_path / "run"
    argv = ["train", "--model_name_or_path", str(start), "--query_encoder", "learned_idf", "--train_data",
            str(pairs), "--per_device_train_batch_size", "4", "--mini_batch_size", "2", "--query_max_length", "16",
            "--document_max_length", "16", "--max_steps", "2", "--save_strategy", "steps", "--save_steps", "1",
            "--eval_beir", "none", "--use_cpu", "--disable_tqdm", "True", "--report_to", "none",
            "--output_dir", str(run)]  # fmt: skip
    assert main(argv) == 0
    checkpoint = run / "checkpoint-1"
    save_query_table(QueryTable(torch.ones(len(tokenizer) - 8), frozen=False), checkpoint)
    capsys.readouterr()
    resume = ["--resume_from_checkpoint", str(checkpoint), "--overwrite_output_dir", "True"]
    assert main([*argv, *resume]) == 2
    _one_line_error(capsys, str(checkpoint / QUERY_TABLE_NAME), "weights")


def _corpus(folder: Path) -> Path:
    """A BEIR folder of 4 documents (what `idf` counts over)."""
    folder.mkdir()
    docs = [{"_id": f"d{i}", "title": "", "text": f"protein folding study {i}"} for i in range(4)]
    (folder / "corpus.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    return folder


def _model(folder: Path, tiny_bert_config, tokenizer) -> Path:
    from gradcache_sparton.modeling import SpladeEncoder

    SpladeEncoder.from_config(tiny_bert_config).save_pretrained(folder, tokenizer=tokenizer)
    return folder


def test_idf_refuses_a_folder_holding_another_checkpoint(
    tmp_path, capsys, tiny_bert_config, tokenizer
) -> None:
    """`idf --output_dir` onto a folder holding another checkpoint (no query table) is refused without
    --overwrite, its files unchanged; the model's own folder only gains the table files."""
    beir = _corpus(tmp_path / "beir")
    model, other = _model(tmp_path / "model", tiny_bert_config, tokenizer), tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text('{"trained": "elsewhere"}')
    (other / "model.safetensors").write_bytes(b"weights of another run")
    before = {p.name: p.read_bytes() for p in other.iterdir()}
    argv = ["idf", "--model_name_or_path", str(model), "--beir_path", str(beir)]
    assert main([*argv, "--output_dir", str(other)]) == 2
    _one_line_error(capsys, str(other), "config.json", "--overwrite")
    assert {p.name: p.read_bytes() for p in other.iterdir()} == before
    assert main([*argv, "--output_dir", str(model)]) == 0  # its own folder: the table files added
    assert (model / "query_table.safetensors").is_file() and (model / "idf.json").is_file()
    assert main([*argv, "--output_dir", str(other), "--overwrite"]) == 0
    assert (other / "config.json").read_bytes() != before["config.json"]


def test_idf_replaces_a_symlinked_idf_json_never_writing_through(
    tmp_path, capsys, tiny_bert_config, tokenizer
) -> None:
    """An idf.json that is a symlink to a file outside the folder: refused without --overwrite; with it, the
    link is replaced by the folder's own file and the file it pointed to is unchanged."""
    beir = _corpus(tmp_path / "beir")
    model = _model(tmp_path / "model", tiny_bert_config, tokenizer)
    outside = tmp_path / "outside.json"
    outside.write_text("keep me\n")
    (model / "idf.json").symlink_to(outside)
    argv = ["idf", "--model_name_or_path", str(model), "--beir_path", str(beir), "--output_dir", str(model)]
    assert main(argv) == 2
    _one_line_error(capsys, "idf.json", "--overwrite")
    assert main([*argv, "--overwrite"]) == 0
    assert outside.read_text() == "keep me\n"
    assert not (model / "idf.json").is_symlink() and len(json.loads((model / "idf.json").read_text())) == len(
        tokenizer
    )


def test_onnx_export_of_an_inference_free_model_refuses_an_existing_idf_json(
    tmp_path, capsys, tiny_bert_config, tokenizer
) -> None:
    """`export --format onnx` of an inference-free model refuses to replace an existing <stem>.idf.json without
    --overwrite (as the index export does), before any export work."""
    import torch

    from gradcache_sparton.modeling import QueryTable, save_query_table

    model = _model(tmp_path / "model", tiny_bert_config, tokenizer)
    save_query_table(QueryTable(torch.ones(len(tokenizer)), special_token_ids=[0]), model)
    (tmp_path / "doc.idf.json").write_text("{}")
    out = tmp_path / "doc.onnx"
    assert (
        main(["export", "--model_name_or_path", str(model), "--format", "onnx", "--output_file", str(out)])
        == 2
    )
    _one_line_error(capsys, "doc.idf.json", "exists")
    assert (tmp_path / "doc.idf.json").read_text() == "{}" and not out.exists()


def test_query_table_without_special_token_ids_is_refused_naming_the_file(tmp_path) -> None:
    """A query_table.safetensors without its special_token_ids metadata is refused naming the file (it would
    load with no special ids: [CLS] and [SEP] counting in every query)."""
    import torch
    from safetensors.torch import save_file

    from gradcache_sparton.modeling import QUERY_TABLE_NAME, load_query_table

    save_file({"weight": torch.ones(8)}, str(tmp_path / QUERY_TABLE_NAME))
    with pytest.raises(ValueError, match=rf"{QUERY_TABLE_NAME} has no special_token_ids"):
        load_query_table(tmp_path)
    save_file({"weight": torch.ones(8)}, str(tmp_path / QUERY_TABLE_NAME), metadata={"frozen": "true"})
    with pytest.raises(ValueError, match="special_token_ids"):
        load_query_table(tmp_path)


def _beir(folder: Path) -> Path:
    """A BEIR folder of 4 claims, each judging its own document, in qrels/train.tsv."""
    _corpus(folder)
    queries = [{"_id": f"q{i}", "text": f"protein folding {i}"} for i in range(4)]
    (folder / "queries.jsonl").write_text("".join(json.dumps(q) + "\n" for q in queries))
    (folder / "qrels").mkdir()
    qrels = "".join(f"q{i}\td{i}\t1\n" for i in range(4))
    (folder / "qrels" / "train.tsv").write_text("query-id\tcorpus-id\tscore\n" + qrels)
    return folder


@pytest.mark.parametrize(
    ("flags", "named"),
    [(["--query_max_length", "12"], "query_max_length"), (["--document_max_length", "1024"], "document_max_length")],
)  # fmt: skip
def test_crossval_checks_every_encoding_setting_before_any_file(tmp_path, capsys, flags, named) -> None:
    """`crossval --query_max_length 12` (not a multiple of 8) or a document length past the model's position
    table is refused before any file is written (before: after the folds and their training files)."""
    beir, out = _beir(tmp_path / "beir"), tmp_path / "cv"
    argv = [
        "crossval",
        "--beir_path",
        str(beir),
        "--output_dir",
        str(out),
        "--folds",
        "2",
        "--no_bm25",
        *flags,
    ]
    assert main([*argv, "--", "--max_steps", "1"]) == 2
    _one_line_error(capsys, named)
    assert not out.exists()


class _Calls:
    """Counts an encoder's forward calls (a hook), to show a refusal came before any encoding."""

    def __init__(self, encoder) -> None:
        self.count = 0
        encoder.register_forward_pre_hook(lambda *_: setattr(self, "count", self.count + 1))


def _api_calls(tokenizer, tiny_bert_config, tmp_path: Path):
    """Each Python API that encodes texts with an EncodingSettings, as (name, call(encoder, **keywords))."""
    from datasets import Dataset

    from gradcache_sparton.data import BeirData
    from gradcache_sparton.evaluation import SparseRetrievalEvaluator, export_corpus
    from gradcache_sparton.mining import mine_hard_negatives, splade_rankings

    data = BeirData(
        corpus={f"d{i}": f"protein folding study {i}" for i in range(12)},
        queries={f"q{i}": f"protein {i}" for i in range(4)},
        qrels={f"q{i}": {f"d{i}": 1} for i in range(4)},
    )
    pairs = Dataset.from_list(
        [{"query": f"protein {i}", "positive": f"protein folding study {i}"} for i in range(4)]
    )
    return [
        ("SparseRetrievalEvaluator", lambda encoder, **kw: SparseRetrievalEvaluator(data, **kw)(encoder)),
        ("export_corpus", lambda encoder, **kw: export_corpus(encoder, data.corpus.items(), tmp_path / "c.jsonl",
                                                              export_format="seismic", **kw)),
        ("mine_hard_negatives", lambda encoder, **kw: mine_hard_negatives(
            pairs, corpus=data.corpus, method="splade", num_negatives=1, rank_start=2, rank_end=4, encoder=encoder,
            show_progress=False, **kw)),
        ("splade_rankings", lambda encoder, **kw: splade_rankings(
            encoder, list(data.queries.values()), list(data.corpus.values()), depth=2, **kw)),
    ]  # fmt: skip


FITS = {"query_max_length": 16, "document_max_length": 64}  # within the tiny BERT's 128 positions


def test_python_api_checks_lengths_against_the_position_table_before_encoding(
    tmp_path, tokenizer, tiny_bert_config
) -> None:
    """SparseRetrievalEvaluator, export_corpus, mine_hard_negatives and splade_rankings refuse a length past the
    encoder's position table (128 here) with one ValueError naming it, before any encoder call (before: a
    RuntimeError from the position embeddings after encoder calls)."""
    from gradcache_sparton.evaluation import EncodingSettings
    from gradcache_sparton.modeling import SpladeEncoder

    encoder = SpladeEncoder.from_config(tiny_bert_config)
    calls = _Calls(encoder)
    for name, call in _api_calls(tokenizer, tiny_bert_config, tmp_path):
        for length in ("query_max_length", "document_max_length"):
            encoding = EncodingSettings(tokenizer, show_progress=False, **{**FITS, length: 136})
            with pytest.raises(ValueError, match=rf"{length}=136 is more tokens than the model can read"):
                call(encoder, encoding=encoding)
            assert calls.count == 0, name
    call(encoder, encoding=EncodingSettings(tokenizer, show_progress=False, **FITS))  # within the table: runs
    assert calls.count > 0


@pytest.mark.parametrize(
    ("keywords", "shown"),
    [
        ({"tokenizer": "TOKENIZER"}, "encoding=EncodingSettings(tokenizer)"),
        ({"query_max_length": 64, "batch_size": 8}, "encoding=EncodingSettings(tokenizer, query_max_length=64, batch_size=8)"),
        ({"encoding": "TOKENIZER"}, "encoding must be an EncodingSettings, got BertTokenizer"),
    ],
    ids=["tokenizer", "lengths", "tokenizer-as-encoding"],
)  # fmt: skip
def test_former_encoding_keywords_show_the_call_to_write(
    tmp_path, tokenizer, tiny_bert_config, keywords, shown
) -> None:
    """The keywords EncodingSettings replaced (tokenizer=, query_max_length=, ...) and a tokenizer passed as
    encoding= are one TypeError showing `encoding=EncodingSettings(...)`, for each API that takes one."""
    from gradcache_sparton.modeling import SpladeEncoder

    encoder = SpladeEncoder.from_config(tiny_bert_config)
    keywords = {k: tokenizer if v == "TOKENIZER" else v for k, v in keywords.items()}
    for name, call in _api_calls(tokenizer, tiny_bert_config, tmp_path):
        with pytest.raises(TypeError, match=rf"^{name}: .*") as raised:
            call(encoder, **keywords)
        assert shown in str(raised.value) and "encoding=EncodingSettings(tokenizer" in str(raised.value)
