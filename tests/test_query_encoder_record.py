"""The query encoder recorded in the model folder (splade_config.json's ``query_encoder``): written by every
save and by `idf`, read by every loader, folders from before the record loaded from their files as before,
and a record the files contradict refused naming both (docs/inference_free.md#on-disk)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from gradcache_sparton.arguments import ModelArguments
from gradcache_sparton.cli import main
from gradcache_sparton.model_loading import build_encoder
from gradcache_sparton.modeling import (
    QUERY_TABLE_NAME,
    SPLADE_CONFIG_NAME,
    InferenceFreeEncoder,
    LiLsrTable,
    QueryTable,
    SpladeEncoder,
    li_lsr_table_from,
    load_query_encoder,
    save_query_table,
)


def _save(folder: Path, config, tokenizer, query_encoder: str) -> Path:
    """A model folder whose query encoder is ``query_encoder``, saved by save_pretrained."""
    torch.manual_seed(0)
    encoder = SpladeEncoder.from_config(config)
    if query_encoder != "splade":
        weight = torch.rand(len(tokenizer)) + 0.5
        table = QueryTable(weight, special_token_ids=tokenizer.all_special_ids, frozen=query_encoder == "idf")
        if query_encoder == "li_lsr":
            table, _ = li_lsr_table_from(table, encoder.model.get_input_embeddings().weight)
        encoder = InferenceFreeEncoder.from_document_encoder(encoder, table)
    encoder.save_pretrained(folder, tokenizer=tokenizer)
    return folder


def _record(folder: Path, query_encoder: str | None) -> None:
    """Set (None: remove, as in a folder written before the record) the folder's recorded query encoder."""
    file = folder / SPLADE_CONFIG_NAME
    options = json.loads(file.read_text())
    options.pop("query_encoder", None)
    if query_encoder is not None:
        options["query_encoder"] = query_encoder
    file.write_text(json.dumps(options))


def _load(folder: Path, tokenizer, query_encoder: str | None = None) -> SpladeEncoder:
    return build_encoder(
        ModelArguments(model_name_or_path=str(folder), query_encoder=query_encoder), tokenizer
    )


def _kind(model: SpladeEncoder) -> str:
    """What a loaded model's queries are, from its classes (not from its query_encoder property)."""
    if not isinstance(model, InferenceFreeEncoder):
        return "splade"
    if isinstance(model.query_table, LiLsrTable):
        return "li_lsr"
    return "idf" if model.query_table.frozen else "learned_idf"


QUERY_ENCODERS = ("splade", "idf", "learned_idf", "li_lsr")


@pytest.mark.parametrize("query_encoder", QUERY_ENCODERS)
def test_save_records_the_query_encoder_and_loading_follows_it(
    tmp_path, tiny_bert_config, tokenizer, query_encoder
) -> None:
    """save_pretrained writes the model's query encoder to splade_config.json; build_encoder and
    load_query_encoder give it back, and the loaded model is of that kind."""
    folder = _save(tmp_path / "m", tiny_bert_config, tokenizer, query_encoder)
    assert json.loads((folder / SPLADE_CONFIG_NAME).read_text())["query_encoder"] == query_encoder
    assert load_query_encoder(folder)[0] == query_encoder
    loaded = _load(folder, tokenizer)
    assert _kind(loaded) == query_encoder and loaded.query_encoder == query_encoder
    if query_encoder != "splade":
        assert InferenceFreeEncoder.from_pretrained(folder).query_encoder == query_encoder


@pytest.mark.parametrize("query_encoder", QUERY_ENCODERS)
def test_folder_without_the_record_loads_from_its_files_as_before(
    tmp_path, tiny_bert_config, tokenizer, query_encoder
) -> None:
    """A folder written before the record (no query_encoder field) has the query encoder its files hold: its
    table's (li_lsr by kind, idf / learned_idf by frozen), else splade."""
    folder = _save(tmp_path / "m", tiny_bert_config, tokenizer, query_encoder)
    _record(folder, None)
    assert load_query_encoder(folder)[0] == query_encoder
    assert _kind(_load(folder, tokenizer)) == query_encoder


@pytest.mark.parametrize(
    ("saved", "recorded", "words"),
    [
        ("splade", "learned_idf", ["'learned_idf'", QUERY_TABLE_NAME, "does not exist"]),
        ("idf", "splade", [QUERY_TABLE_NAME, "'idf' query table", "records query_encoder 'splade'"]),
        ("learned_idf", "idf", [SPLADE_CONFIG_NAME, "records query_encoder 'idf'", "'learned_idf' query table"]),
        ("li_lsr", "learned_idf", ["records query_encoder 'learned_idf'", "'li_lsr' query table"]),
    ],
)  # fmt: skip
def test_a_record_the_files_contradict_is_one_error_naming_both(
    tmp_path, tiny_bert_config, tokenizer, saved, recorded, words
) -> None:
    """A recorded query encoder that the folder's files contradict (a table recorded without its file, a table
    file beside 'splade', a table of another kind or frozen) is one ValueError naming the files and both facts,
    before any weights load (the weights file is gone and the error is still this one)."""
    folder = _save(tmp_path / "m", tiny_bert_config, tokenizer, saved)
    _record(folder, recorded)
    (folder / "model.safetensors").unlink()
    for load in (lambda: _load(folder, tokenizer), lambda: InferenceFreeEncoder.from_pretrained(folder)):
        with pytest.raises(ValueError) as caught:
            load()
        assert all(word in str(caught.value) for word in words), str(caught.value)


def test_an_unknown_recorded_query_encoder_is_refused_naming_the_file(
    tmp_path, tiny_bert_config, tokenizer
) -> None:
    """A query_encoder value outside the four names is a ValueError naming splade_config.json and the choices."""
    folder = _save(tmp_path / "m", tiny_bert_config, tokenizer, "idf")
    _record(folder, "bm25")
    with pytest.raises(ValueError, match=rf"{SPLADE_CONFIG_NAME}: query_encoder must be one of .*'bm25'"):
        _load(folder, tokenizer)


def test_the_flag_decides_and_the_folder_table_is_the_start(tmp_path, tiny_bert_config, tokenizer) -> None:
    """--query_encoder over a folder recording another one decides the model (an idf folder starts a
    learned_idf run from its table, or loads siamese), and the model saved from it records the flag's value."""
    folder = _save(tmp_path / "m", tiny_bert_config, tokenizer, "idf")
    saved = load_query_encoder(folder)[1].weight.detach()
    learned = _load(folder, tokenizer, "learned_idf")
    assert _kind(learned) == "learned_idf" and torch.equal(learned.query_table.weight.detach(), saved)
    learned.save_pretrained(tmp_path / "trained", tokenizer=tokenizer)
    assert load_query_encoder(tmp_path / "trained")[0] == "learned_idf"
    assert _kind(_load(folder, tokenizer, "splade")) == "splade"
    assert _kind(_load(folder, tokenizer)) == "idf"  # the folder itself is unchanged


def test_idf_command_records_idf_in_a_new_folder_and_in_the_models_own(
    tmp_path, tiny_bert_config, tokenizer
) -> None:
    """`idf` records query_encoder 'idf' in the folder it writes, and in the model's own folder it adds the
    record to splade_config.json keeping every other key."""
    corpus = tmp_path / "beir"
    corpus.mkdir()
    documents = [{"_id": f"d{i}", "title": "", "text": f"protein folding study {i}"} for i in range(4)]
    (corpus / "corpus.jsonl").write_text("".join(json.dumps(d) + "\n" for d in documents))
    model = _save(tmp_path / "model", tiny_bert_config, tokenizer, "splade")
    before = json.loads((model / SPLADE_CONFIG_NAME).read_text())
    argv = ["idf", "--model_name_or_path", str(model), "--beir_path", str(corpus)]
    assert main([*argv, "--output_dir", str(tmp_path / "new")]) == 0
    assert load_query_encoder(tmp_path / "new")[0] == "idf"
    assert main([*argv, "--output_dir", str(model)]) == 0
    assert json.loads((model / SPLADE_CONFIG_NAME).read_text()) == {**before, "query_encoder": "idf"}
    assert _kind(_load(model, tokenizer)) == "idf"


def test_a_hub_checkpoint_recording_a_table_is_refused_not_loaded_siamese(monkeypatch, tokenizer) -> None:
    """A hub id whose splade_config.json records a query table (not downloaded) is one ValueError saying to
    download the folder, before any weights load; query_encoder 'splade' asks for its document encoder only."""
    import gradcache_sparton.model_loading as model_loading

    monkeypatch.setattr(model_loading, "resolve_model_location", lambda name, **_: name)
    monkeypatch.setattr(model_loading, "read_splade_config", lambda location: {"query_encoder": "idf"})
    with pytest.raises(
        ValueError, match=r"'owner/model' \(a hub id\) records query_encoder 'idf'.*hf download"
    ):
        _load(Path("owner/model"), tokenizer)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match="owner/model") as caught:  # no table needed: on to the weights
        _load(Path("owner/model"), tokenizer, "splade")
    assert "records query_encoder" not in str(caught.value)


def test_save_query_table_into_a_siamese_folder_records_the_table(
    tmp_path, tiny_bert_config, tokenizer
) -> None:
    """save_query_table into a saved siamese folder (the documented way to add a table made elsewhere) records
    the table's query encoder, other keys kept, and the folder then loads as that inference-free model."""
    folder = _save(tmp_path / "m", tiny_bert_config, tokenizer, "splade")
    before = json.loads((folder / SPLADE_CONFIG_NAME).read_text())
    save_query_table(QueryTable(torch.ones(len(tokenizer)), special_token_ids=[0], frozen=False), folder)
    assert json.loads((folder / SPLADE_CONFIG_NAME).read_text()) == {**before, "query_encoder": "learned_idf"}
    assert _kind(_load(folder, tokenizer)) == "learned_idf"


def test_resuming_from_a_checkpoint_whose_table_is_gone_names_the_record(
    tmp_path, capsys, tiny_bert_config, tokenizer
) -> None:
    """Resuming a learned_idf run from a checkpoint that records learned_idf but lost its table file is one
    error line (exit 2) naming splade_config.json, the missing table file and the recorded query encoder."""
    start = _save(tmp_path / "start", tiny_bert_config, tokenizer, "learned_idf")
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(
        "".join(json.dumps({"query": f"q {i}", "positive": f"answer {i}"}) + "\n" for i in range(8))
    )
    run = tmp_path / "run"
    argv = ["train", "--model_name_or_path", str(start), "--train_data", str(pairs),
            "--per_device_train_batch_size", "4", "--mini_batch_size", "2", "--query_max_length", "16",
            "--document_max_length", "16", "--max_steps", "2", "--save_strategy", "steps", "--save_steps", "1",
            "--eval_beir", "none", "--use_cpu", "--disable_tqdm", "True", "--report_to", "none",
            "--output_dir", str(run)]  # fmt: skip
    assert main(argv) == 0
    checkpoint = run / "checkpoint-1"
    assert load_query_encoder(checkpoint)[0] == "learned_idf"  # the run's checkpoints record it
    (checkpoint / QUERY_TABLE_NAME).unlink()
    capsys.readouterr()
    assert main([*argv, "--resume_from_checkpoint", str(checkpoint), "--overwrite_output_dir", "True"]) == 2
    line = next(line for line in capsys.readouterr().err.splitlines() if ": error: " in line)
    assert all(word in line for word in (SPLADE_CONFIG_NAME, QUERY_TABLE_NAME, "'learned_idf'")), line
