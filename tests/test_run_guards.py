"""Run-level guards: one live run per output folder, a stopped run reported as stopped, batches and lengths
checked against the loss and the model before any step, full disks named."""

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

from gradcache_sparton.run_state import LOCK_FILE_NAME, output_dir_lock


def _lock_record(pid: int, host: str | None = None) -> str:
    host = socket.gethostname() if host is None else host
    return json.dumps({"pid": pid, "host": host, "started": time.time(), "command": "train --fake"})


def test_output_dir_lock_refuses_a_second_live_run(tmp_path: Path) -> None:
    """A lock held by a live process (or one on another host) is refused, naming its pid and command."""
    lock = tmp_path / LOCK_FILE_NAME
    for record in (_lock_record(os.getppid()), _lock_record(1, host="elsewhere")):
        lock.write_text(record)
        with (
            pytest.raises(ValueError, match="in use by another training run") as raised,
            output_dir_lock(tmp_path),
        ):
            pass
        assert "train --fake" in str(raised.value) and str(lock) in str(raised.value)
        assert lock.read_text() == record  # the other run's lock is left alone


def test_output_dir_lock_takes_over_a_dead_runs_lock_and_removes_its_own(tmp_path: Path, caplog) -> None:
    """A lock of a dead pid on this host is taken over with a warning; the lock goes at exit, error or not."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    lock = tmp_path / "out" / LOCK_FILE_NAME
    lock.parent.mkdir()
    lock.write_text(_lock_record(dead.pid))
    with caplog.at_level(logging.WARNING, logger="gradcache_sparton.run_state"), output_dir_lock(lock.parent):
        assert json.loads(lock.read_text())["pid"] == os.getpid()
        with output_dir_lock(lock.parent):  # re-entrant within the process
            pass
        assert lock.exists()
    assert "no longer alive" in caplog.text and not lock.exists()
    with pytest.raises(RuntimeError), output_dir_lock(lock.parent):
        raise RuntimeError("the run failed")
    assert not lock.exists()


def test_output_dir_naming_a_file_is_refused(tmp_path: Path) -> None:
    """An output_dir that is an existing file is one clear error (the lock never builds a folder over it)."""
    file = tmp_path / "a_file"
    file.write_text("x")
    with pytest.raises(ValueError, match="is an existing file"), output_dir_lock(file):
        pass
    assert file.read_text() == "x"


def _tiny_train_argv(output_dir: Path, *flags: str) -> list[str]:
    """A `train` command on a tiny random BERT over the shipped sample, no retrieval evaluation."""
    return [
        "train", "--config_name", "bert-tiny", "--hidden_size", "32", "--num_hidden_layers", "1",
        "--num_attention_heads", "2", "--intermediate_size", "64", "--per_device_train_batch_size", "8",
        "--mini_batch_size", "8", "--query_max_length", "16", "--document_max_length", "32",
        "--eval_beir", "none", "--output_dir", str(output_dir), "--use_cpu", "--disable_tqdm", "True",
        "--report_to", "none", "--max_train_samples", "64", *flags,
    ]  # fmt: skip


@pytest.mark.slow
def test_run_stopped_by_sigterm_exits_non_zero_and_writes_no_final_model(
    tmp_path, capsys, monkeypatch
) -> None:
    """SIGTERM under --enable_jit_checkpoint: a checkpoint, no final model or summary, exit 3, how to resume."""
    import signal

    from gradcache_sparton.cli import main
    from gradcache_sparton.trainer import CachedSpladeTrainer

    compute_loss = CachedSpladeTrainer.compute_loss

    def signalled(self, *args, **kwargs):  # the run's own process receives SIGTERM at its second step
        if self.state.global_step == 1 and self.model.training:
            os.kill(os.getpid(), signal.SIGTERM)
        return compute_loss(self, *args, **kwargs)

    monkeypatch.setattr(CachedSpladeTrainer, "compute_loss", signalled)
    out = tmp_path / "run"
    assert (
        main(
            _tiny_train_argv(
                out, "--max_steps", "100000", "--save_steps", "100000", "--enable_jit_checkpoint"
            )
        )
        == 3
    )
    captured = capsys.readouterr()
    assert "training stopped at step" in captured.err and "of 100000" in captured.err
    checkpoints = sorted(out.glob("checkpoint-*"))
    assert len(checkpoints) == 1 and f"--resume_from_checkpoint {checkpoints[0]}" in captured.err
    assert not (out / "model.safetensors").exists() and '"output_dir"' not in captured.out
    assert not (out / LOCK_FILE_NAME).exists()


def test_batch_without_a_contrastive_signal_is_refused_before_the_model(
    tmp_path, capsys, monkeypatch
) -> None:
    """One row per batch and no negatives (InfoNCE loss 0 at every step) is refused; with negatives it is not."""
    from gradcache_sparton.cli import main

    monkeypatch.setattr("gradcache_sparton.pipeline.build_encoder", _never_build_the_model)
    out = tmp_path / "run"
    argv = _tiny_train_argv(out, "--max_steps", "1")
    argv[argv.index("--per_device_train_batch_size") + 1] = "1"
    argv[argv.index("--mini_batch_size") + 1] = "1"
    assert main(argv) == 2
    assert "per_device_train_batch_size 1 x 1 process with no negative column" in capsys.readouterr().err
    assert not out.exists()
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"query": "q", "positive": "p", "negative_1": "n"}) + "\n")
    with pytest.raises(AssertionError, match="the model was built"):
        main([*argv, "--train_data", str(rows)])


def _never_build_the_model(*args, **kwargs) -> None:
    raise AssertionError("the model was built")


def test_lengths_beyond_the_position_table_are_refused_before_any_step(tmp_path, capsys, monkeypatch) -> None:
    """--document_max_length / --query_max_length past max_position_embeddings: one error naming the flag, the
    value and the limit, before any step (train) or any encoding (evaluate, mine)."""
    from gradcache_sparton.cli import main
    from gradcache_sparton.data import default_dev_beir_path
    from gradcache_sparton.evaluation import SparseRetrievalEvaluator
    from gradcache_sparton.trainer import CachedSpladeTrainer

    def never(*args, **kwargs):
        raise AssertionError("work started")

    monkeypatch.setattr(CachedSpladeTrainer, "compute_loss", never)
    monkeypatch.setattr(SparseRetrievalEvaluator, "evaluate", never)
    out = tmp_path / "run"
    argv = _tiny_train_argv(out, "--max_steps", "1")
    argv[argv.index("--document_max_length") + 1] = "520"
    assert main(argv) == 2
    assert "document_max_length=520 is more tokens than the model can read" in capsys.readouterr().err
    assert not out.exists()
    evaluate = ["evaluate", "--model_name_or_path", "splade-tiny-msmarco", "--device", "cpu"]
    assert main([*evaluate, "--query_max_length", "520"]) == 2
    err = capsys.readouterr().err
    assert "query_max_length=520" in err and "holds 512" in err
    beir = str(default_dev_beir_path())
    mine = ["mine", "--beir_path", beir, "--split", "dev", "--method", "splade"]
    mine += ["--model_name_or_path", "splade-tiny-msmarco"]
    assert main([*mine, "--document_max_length", "1024", "--output_file", str(tmp_path / "mined.jsonl")]) == 2
    assert "document_max_length=1024 is more tokens than the model can read" in capsys.readouterr().err


def test_flags_without_effect_are_refused(tmp_path, capsys) -> None:
    """Evaluation settings with --eval_beir none, a split without its BEIR source, a shape or decoder bias with
    a checkpoint: one error naming them, before any work; --eval_beir none alone stays valid."""
    from gradcache_sparton.arguments import DataArguments, ModelArguments
    from gradcache_sparton.cli import main

    for kwargs, named in (
        ({"eval_beir": "none", "retrieval_eval_steps": 5}, "retrieval_eval_steps would have no effect"),
        (
            {"eval_beir": "None", "eval_batch_size": 8, "eval_beir_split": "test"},
            "eval_beir_split, eval_batch_size",
        ),
        ({"train_beir_split": "dev"}, "train_beir_split (without train_beir)"),
    ):
        with pytest.raises(ValueError, match=named.replace("(", r"\(").replace(")", r"\)")):
            DataArguments(**kwargs)
    DataArguments(eval_beir="none", eval_before_training=True)  # the embedded config's value: no error
    with pytest.raises(
        ValueError, match="hidden_size, init_decoder_bias would have no effect with model_name"
    ):
        ModelArguments(model_name_or_path="splade-tiny-msmarco", hidden_size=64, init_decoder_bias=-1.0)
    assert main(_tiny_train_argv(tmp_path / "run", "--retrieval_eval_steps", "2")) == 2
    assert "retrieval_eval_steps would have no effect with eval_beir none" in capsys.readouterr().err


@pytest.mark.slow
def test_full_disk_while_writing_a_checkpoint_names_the_file(tmp_path, capsys, monkeypatch) -> None:
    """optimizer.pt cut short by a full disk (torch's writer names no errno): the error names the file and "no
    space left", and the partial folder no longer looks like a checkpoint (checkpoint-N.incomplete)."""
    import collections

    import torch
    from transformers.trainer_utils import get_last_checkpoint

    from gradcache_sparton.cli import main

    save = torch.save

    def full_disk(obj, f, *args, **kwargs):
        if str(f).endswith("optimizer.pt"):
            Path(f).write_bytes(b"PK\x03\x04")  # what a writer leaves when the device fills up
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 9920 vs 9812")
        return save(obj, f, *args, **kwargs)

    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(torch, "save", full_disk)
    monkeypatch.setattr(
        "gradcache_sparton.run_state.shutil.disk_usage", lambda path: usage(1 << 30, 1 << 30, 0)
    )
    out = tmp_path / "run"
    assert main(_tiny_train_argv(out, "--max_steps", "1", "--save_steps", "1")) == 1
    err = capsys.readouterr().err
    assert f"writing {out / 'checkpoint-1' / 'optimizer.pt'} failed: no space left on the device" in err
    assert "Traceback" not in err and get_last_checkpoint(str(out)) is None
    assert (out / "checkpoint-1.incomplete" / "optimizer.pt").is_file() and not (
        out / LOCK_FILE_NAME
    ).exists()


def test_half_a_trainer_state_is_named_before_the_model(tmp_path, capsys, monkeypatch) -> None:
    """--resume_from_checkpoint on a checkpoint whose trainer_state.json is cut short: one error naming it."""
    from gradcache_sparton.cli import main

    monkeypatch.setattr("gradcache_sparton.pipeline.build_encoder", _never_build_the_model)
    checkpoint = tmp_path / "run" / "checkpoint-2"
    checkpoint.mkdir(parents=True)
    (checkpoint / "trainer_state.json").write_text('{"global_step": 2, "log_hist')
    argv = _tiny_train_argv(tmp_path / "run", "--max_steps", "4", "--resume_from_checkpoint", str(checkpoint))
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"{checkpoint / 'trainer_state.json'} line 1: not valid JSON" in err and "Traceback" not in err


def _pairs_file(path: Path, word: str) -> Path:
    rows = [{"query": f"{word} question {i}", "positive": f"{word} answer number {i}"} for i in range(16)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.mark.slow
def test_resume_refuses_other_training_data_or_records_the_switch(tmp_path, capsys) -> None:
    """A resume on other training data than its checkpoint's is refused before any step; with
    --allow_changed_train_data it continues and the checkpoints' train_data.json record the switch."""
    from gradcache_sparton.cli import main

    first, other = _pairs_file(tmp_path / "a.jsonl", "alpha"), _pairs_file(tmp_path / "b.jsonl", "beta")
    out = tmp_path / "run"
    common = ("--max_steps", "4", "--save_steps", "2", "--save_strategy", "steps")
    assert main(_tiny_train_argv(out, "--train_data", str(first), *common)) == 0
    recorded = json.loads((out / "checkpoint-2" / "train_data.json").read_text())
    assert recorded["train_data"]["rows"] == 16 and recorded["switches"] == []
    capsys.readouterr()
    resume = ("--resume_from_checkpoint", str(out / "checkpoint-2"), "--overwrite_output_dir", "True")
    assert main(_tiny_train_argv(out, "--train_data", str(other), *common, *resume)) == 2
    err = capsys.readouterr().err
    assert "was trained on other data" in err and "allow_changed_train_data" in err and "Traceback" not in err
    assert main(_tiny_train_argv(out, "--train_data", str(first), *common, *resume)) == 0  # the same data
    argv = _tiny_train_argv(
        out, "--train_data", str(other), *common, *resume, "--allow_changed_train_data", "True"
    )
    assert main(argv) == 0
    (switch,) = json.loads((out / "checkpoint-4" / "train_data.json").read_text())["switches"]
    assert (
        switch["step"] == 2
        and switch["before"] == recorded["train_data"]
        and switch["after"] != switch["before"]
    )
    assert json.loads((out / "train_data.json").read_text())["switches"] == [switch]
