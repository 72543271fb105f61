"""A new user's first hour (issue 35) and the user-path acceptance suite on a GPU (issue 32, item 2).

CPU tests: model paths that look local fail at once, the shipped data is every command's default, the
help reads top down, nothing prints that the user did not cause, the model card names no path of this
machine, and `train` ends by naming its output folder and the next command. GPU tests (marked `gpu`,
skipped with the reason elsewhere): `train` / `evaluate` / `mine` / `export`, the examples and a 2-process
`accelerate launch`, in bf16, as a GPU user runs them; the README's and docs' blocks run through
tests/test_docs.py's `test_docs_on_gpu`.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from gradcache_sparton.cli import main
from gradcache_sparton.data import beir_folder
from gradcache_sparton.model_loading import looks_like_local_path, resolve_model_location

ROOT = Path(__file__).resolve().parents[1]
CUDA = torch.cuda.is_available()


def _no_network(*args: object, **kwargs: object) -> socket.socket:
    raise AssertionError(f"the network was touched: socket.create_connection{args}")


@pytest.mark.parametrize(
    "name", ["outputs/run", "./run", "../run", "~/no-such-run-xyz", "/no/such/run", "a/b/c"]
)
def test_missing_local_looking_model_path_fails_at_once(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A model path that can only be local and does not exist is refused at once, naming the path, with
    no network access (was: 76 s of hub retries for `evaluate --model_name_or_path outputs/run`)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "outputs").mkdir()
    monkeypatch.setattr(socket, "create_connection", _no_network)
    began = time.monotonic()
    with pytest.raises(ValueError, match="no such folder") as exc:
        resolve_model_location(name)
    assert repr(name) in str(exc.value)
    assert time.monotonic() - began < 1.0


def test_missing_path_names_the_checkpoints_beside_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The error for a mistyped run folder lists the checkpoint folders next to it (what `train` wrote)."""
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "outputs" / "splade-20261126-061500"
    run.mkdir(parents=True)
    (run / "config.json").write_text("{}")
    (run / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="outputs/splade-20261126-061500"):
        resolve_model_location("outputs/run")


def test_hub_id_offline_fails_without_the_network(monkeypatch: pytest.MonkeyPatch) -> None:
    """With HF_HUB_OFFLINE set, a hub id that is not cached fails at once and touches no socket."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(socket, "create_connection", _no_network)
    with pytest.raises(ValueError, match="HF_HUB_OFFLINE is set"):
        resolve_model_location("no-such-owner-xyz/no-such-model")


def test_hub_id_with_the_hub_unreachable_fails_after_one_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """Online mode with no route to the hub: one connection check, then a clear error (no retries)."""
    from huggingface_hub import constants

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    for proxy in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(proxy, raising=False)
    calls = []

    def refuse(*args: object, **kwargs: object) -> socket.socket:
        calls.append(args)
        raise OSError("no route to host")

    monkeypatch.setattr(socket, "create_connection", refuse)
    with pytest.raises(ValueError, match="cannot be reached"):
        resolve_model_location("no-such-owner-xyz/no-such-model")
    assert len(calls) == 1


@pytest.mark.parametrize(
    ("name", "local"),
    [("outputs/run", True), ("./x", True), ("~/x", True), ("/x", True), ("a/b/c", True), ("x/", True),
     ("naver/splade-v3", False), ("bert-base-uncased", False)],
)  # fmt: skip
def test_local_looking_names(name: str, local: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What counts as a local path: '.', '~', '/' starts, several '/', or an existing first folder;
    `owner/name` and bare names stay hub ids."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "outputs").mkdir()
    assert looks_like_local_path(name) is local


def test_default_folder_refuses_a_split_it_lacks(capsys: pytest.CaptureFixture[str]) -> None:
    """`evaluate --split test` on the default folder is refused naming its one split (was: exit 0 with
    the dev metrics), before any model is loaded."""
    assert beir_folder("default", split="dev").endswith("dev")
    with pytest.raises(ValueError, match="only the split 'dev'"):
        beir_folder("default", split="test")
    assert main(["evaluate", "--model_name_or_path", "splade-tiny-msmarco", "--split", "test"]) == 2
    assert "only the split 'dev'" in capsys.readouterr().err


def test_export_defaults_to_the_shipped_sample(monkeypatch: pytest.MonkeyPatch) -> None:
    """`export` without --beir_path encodes the shipped SciFact dev sample's corpus, as `evaluate` does."""
    from gradcache_sparton import pipeline
    from gradcache_sparton.data import default_dev_beir_path

    seen = {}
    monkeypatch.setattr(pipeline, "run_export", lambda model, **kwargs: seen.update(kwargs) or {})
    assert main(["export", "--model_name_or_path", "splade-tiny-msmarco", "--output_file", "x.jsonl"]) == 0
    assert beir_folder(seen["beir_path"]) == str(default_dev_beir_path())


@pytest.mark.slow
def test_mine_defaults_to_the_shipped_training_pairs(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """`mine` with no input mines the shipped training pairs (every one, so the README's recipe trains
    on them), quietly: no bm25s bars or DEBUG line, one ranking bar."""
    from gradcache_sparton.data import default_train_data_path, load_training_data

    out = tmp_path / "negatives.jsonl.gz"
    assert main(["mine", "--output_file", str(out)]) == 0
    summary = json.loads(capfd.readouterr().out)
    err = capfd.readouterr().err
    assert summary["rows"] == len(load_training_data(default_train_data_path())) > 3_000
    mined = load_training_data(str(out))
    assert {"query", "positive", "negative_1", "negative_2"} <= set(mined.column_names)
    assert "DEBUG" not in err and "Split strings" not in err and "BM25S" not in err


def test_train_help_starts_with_our_options_grouped(capsys: pytest.CaptureFixture[str]) -> None:
    """`train --help` shows this project's options by theme, the engine's first (--mini_batch_size and
    --max_memory within its first 40 lines), the Trainer's most used ones after them and the rest behind
    --help-all (was: 917 lines, --mini_batch_size at line 832; then 296 lines, at line 153)."""
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = capsys.readouterr().out
    lines = text.splitlines()
    titles = [line[:-1] for line in lines if line and not line.startswith(" ") and line.endswith(":")]
    assert titles[:7] == [
        "general", "engine and memory", "model", "data", "loss", "evaluation", "run (the Trainer's most used options)",
    ]  # fmt: skip
    assert len(lines) < 320
    for flag in ("--mini_batch_size ", "--max_memory "):
        assert next(i for i, line in enumerate(lines) if line.startswith(f"  {flag}")) < 40, flag
    assert "--adam_beta1" not in text and "--help-all" in text
    with pytest.raises(SystemExit) as exc:
        main(["train", "--help-all"])
    assert exc.value.code == 0 and "--adam_beta1" in capsys.readouterr().out


def test_train_help_shows_each_option_once_with_one_default(capsys: pytest.CaptureFixture[str]) -> None:
    """`train --help` lists each option once, none with its default written twice (a "Default:" in its help
    and the "[default: ...]" shown), and leaves the engine's three-state options to --help-all."""
    decided = ("--cuda_graphs", "--reuse_argmax", "--check_replay", "--sparse_reps", "--gather_across_ranks")
    for flag, shown in (("--help", False), ("--help-all", True)):
        with pytest.raises(SystemExit):
            main(["train", flag])
        entries: dict[str, list[str]] = {}
        for line in capsys.readouterr().out.splitlines():
            if line.startswith("  --"):
                name = line.split()[0]
                entries.setdefault(name, []).append(line)
            elif line.startswith("    ") and entries:
                entries[name][-1] += " " + line.strip()
        assert all(len(texts) == 1 for texts in entries.values()), [
            n for n, t in entries.items() if len(t) > 1
        ]
        doubled = [n for n, (text,) in entries.items() if "Default:" in text and "[default:" in text]
        assert not doubled, doubled
        assert all((option in entries) == shown for option in decided)
        assert "--max_memory" in entries and entries["--max_memory"][0].endswith("[default: auto]")


def test_misspelled_flag_gets_a_suggestion(capsys: pytest.CaptureFixture[str]) -> None:
    """A misspelled `train` flag is refused with "did you mean" the closest option, before any work."""
    assert main(["train", "--mini_batchsize", "8"]) == 2
    err = capsys.readouterr().err
    assert "did you mean --mini_batch_size" in err and "HfArgumentParser" not in err


def test_no_pin_memory_without_an_accelerator(tmp_path: Path) -> None:
    """On a machine without an accelerator the dataloader does not pin memory (torch warns otherwise)."""
    from gradcache_sparton.arguments import CachedSpladeTrainingArguments

    args = CachedSpladeTrainingArguments(output_dir=str(tmp_path))
    assert args.dataloader_pin_memory is torch.accelerator.is_available()


def test_cli_quiets_third_party_bars() -> None:
    """The CLI turns off transformers' per-file bars and datasets' split bars; hub downloads keep theirs."""
    import datasets
    import huggingface_hub.utils
    import transformers

    from gradcache_sparton.cli.app import _quiet_third_parties

    try:
        _quiet_third_parties()
        assert not transformers.utils.logging.is_progress_bar_enabled()
        assert not datasets.is_progress_bar_enabled()
        assert not huggingface_hub.utils.are_progress_bars_disabled()
    finally:
        transformers.utils.logging.enable_progress_bar()
        datasets.enable_progress_bars()


def test_bm25_keeps_its_debug_line_to_itself(caplog: pytest.LogCaptureFixture) -> None:
    """BM25 ranking logs no bm25s DEBUG record (bm25s sets its logger to DEBUG at import)."""
    from gradcache_sparton.mining import bm25_rankings

    with caplog.at_level(logging.DEBUG):
        bm25_rankings(
            ["fever cause", "star light"], ["fever is caused", "stars emit light", "cells"], depth=2
        )
    assert not [record for record in caplog.records if record.name.startswith("bm25s")]


def test_model_card_names_no_absolute_path(tmp_path: Path) -> None:
    """The model card's base model is the shipped name or the folder's own name, never an absolute path."""
    from gradcache_sparton import SpladeEncoder
    from gradcache_sparton.integrations.sentence_transformers import model_card
    from gradcache_sparton.resources import shipped_model_path

    shipped = shipped_model_path("splade-tiny-msmarco")
    encoder = SpladeEncoder.from_pretrained(shipped)
    card = model_card(encoder=encoder, max_seq_length=128, base_model=str(shipped.resolve()))
    assert "Base model: splade-tiny-msmarco" in card and str(shipped.parent) not in card
    card = model_card(encoder=encoder, max_seq_length=128, base_model=str(tmp_path / "my-start"))
    assert "Base model: my-start (a local folder)" in card and str(tmp_path) not in card


def test_train_ends_with_the_model_folder_and_the_next_command(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`train` ends by printing where the model went and the `evaluate` command to run on it, and logs
    the shipped config by its package path, not this machine's."""
    monkeypatch.chdir(tmp_path)
    argv = [
        "train", "--config_name", "bert-tiny", "--hidden_size", "32", "--num_hidden_layers", "1",
        "--num_attention_heads", "2", "--intermediate_size", "64", "--per_device_train_batch_size", "8",
        "--mini_batch_size", "8", "--query_max_length", "16", "--document_max_length", "32", "--max_steps", "1",
        "--max_train_samples", "16", "--eval_beir", "none", "--output_dir", "outputs/first", "--report_to", "none",
        "--disable_tqdm", "True",
    ]  # fmt: skip
    assert main(argv) == 0
    captured = capsys.readouterr()
    summary = json.loads(
        captured.out[captured.out.rindex('{\n  "output_dir"') :]
    )  # stdout ends with the JSON
    assert summary["output_dir"] == "outputs/first"
    lines = captured.err.strip().splitlines()
    assert lines[-2:] == [
        "The trained model is in outputs/first/. Next, evaluate it:",
        "  gradcache-sparton evaluate --model_name_or_path outputs/first",
    ]
    assert (tmp_path / "outputs" / "first" / "model.safetensors").is_file()
    card = tmp_path / "outputs" / "first" / "README.md"
    assert not card.exists() or str(tmp_path) not in card.read_text()


def test_logs_name_the_shipped_config_by_its_package_path() -> None:
    """The start log names the embedded config relative to the package, not this machine's folders."""
    from gradcache_sparton.cli.train import _shown_path
    from gradcache_sparton.resources import default_train_config_path

    assert _shown_path(default_train_config_path()) == "gradcache_sparton/resources/default_train.yaml"


def test_docs_recommend_no_deprecated_checkpointing_flag() -> None:
    """No page tells users to pass `--gradient_checkpointing True` (transformers >= 5.23 warns that it is
    deprecated); they name `--activation_checkpointing`."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    offenders = [p.name for p in pages if "--gradient_checkpointing True" in p.read_text(encoding="utf-8")]
    assert not offenders
    assert "--activation_checkpointing True" in (ROOT / "docs" / "memory.md").read_text(encoding="utf-8")


def test_readme_quick_subset_marker_exists() -> None:
    """The README's quick test subset (`-m "not slow"`) names a marker pytest declares (--strict-markers)."""
    readme = (ROOT / "README.md").read_text()
    assert '-m "not slow"' in readme
    assert '"slow: ' in (ROOT / "pyproject.toml").read_text()


# ----------------------------------------------------------------------------------------------------
# GPU acceptance: the commands as a GPU user runs them, in bf16.


def _cli(args: list[str], cwd: Path, *, timeout: int = 1200) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.run(
        [sys.executable, "-m", "gradcache_sparton.cli", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.gpu
@pytest.mark.slow
def test_gpu_train_evaluate_mine_export_in_bf16(tmp_path: Path) -> None:
    """On CUDA: `train` in bf16 (shipped model and data), then `evaluate`, `mine --method splade` and
    `export` on its output folder, each exit 0, with the outputs the docs describe."""
    run = _cli(
        ["train", "--model_name_or_path", "splade-tiny-msmarco", "--per_device_train_batch_size", "256",
         "--mini_batch_size", "64", "--bf16", "True", "--max_steps", "10", "--eval_before_training", "True",
         "--output_dir", "outputs/gpu-run", "--report_to", "none"],
        tmp_path,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-4000:]
    assert run.stderr.rstrip().endswith("gradcache-sparton evaluate --model_name_or_path outputs/gpu-run")
    assert "gradient_checkpointing is deprecated" not in run.stderr and "Loading weights" not in run.stderr
    evaluated = _cli(["evaluate", "--model_name_or_path", "outputs/gpu-run"], tmp_path)
    assert evaluated.returncode == 0, evaluated.stderr[-4000:]
    assert 0.0 < json.loads(evaluated.stdout)["ndcg_at_10"] <= 1.0
    mined = _cli(
        ["mine", "--method", "splade", "--model_name_or_path", "outputs/gpu-run", "--beir_path", "default",
         "--device", "cuda", "--output_file", "self.jsonl.gz"],
        tmp_path,
    )  # fmt: skip
    assert mined.returncode == 0, mined.stderr[-4000:]
    exported = _cli(
        ["export", "--model_name_or_path", "outputs/gpu-run", "--output_file", "c.jsonl"], tmp_path
    )
    assert exported.returncode == 0, exported.stderr[-4000:]
    assert json.loads(exported.stdout)["documents"] > 0


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("name", ["engine_on_cpu.py", "train_and_encode.py", "own_training_loop.py"])
def test_gpu_examples_run(name: str) -> None:
    """Each examples/ recipe runs to completion on a CUDA machine, as a user starts it."""
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / name)],
        capture_output=True,
        text=True,
        timeout=1200,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-4000:]


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(CUDA and torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_gpu_accelerate_launch_two_processes(tmp_path: Path) -> None:
    """`examples/launch_2gpu.sh` (accelerate launch, 2 processes, bf16) trains and saves one model."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    result = subprocess.run(
        ["bash", str(ROOT / "examples" / "launch_2gpu.sh"), "--max_steps", "5", "--output_dir", "outputs/ddp",
         "--report_to", "none", "--logging_steps", "1"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    assert (tmp_path / "outputs" / "ddp" / "model.safetensors").is_file()
    assert "global_batch_size" in result.stdout + result.stderr
