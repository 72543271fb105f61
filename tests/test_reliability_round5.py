"""Reliability round 5: the newest paths (inference-free models, `idf`, ONNX export, `crossval --compare`,
``EncodingSettings``, kept graphs, resume checks) tried as a careless user would, each fault one clear error
before any work (CLI: one line, exit 2) or an exact result (docs/reliability*.md name each row's test)."""

from __future__ import annotations

import json

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
