"""CachedSpladeTrainer: equal to uncached training, resumable, learning, and strict about its inputs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import datasets
import pytest
import torch
from trainer_helpers import trainer_model
from transformers import AutoModelForMaskedLM

from gradcache_sparton.arguments import CachedSpladeTrainingArguments, DataArguments, ModelArguments
from gradcache_sparton.cli import main
from gradcache_sparton.data import default_train_data_path, load_training_data
from gradcache_sparton.model_loading import build_encoder, checkpoint_max_lengths
from gradcache_sparton.modeling import SpladeEncoder
from gradcache_sparton.trainer import CachedSpladeTrainer


def _encoder(tokenizer: Any, *, dropout: float) -> SpladeEncoder:
    return trainer_model(tokenizer, dropout=dropout)


@pytest.fixture(scope="module")
def sample_rows() -> datasets.Dataset:
    """The first 96 rows of the shipped SciFact training sample (real text)."""
    return load_training_data(default_train_data_path()).select(range(96))


def _args(output_dir: Path, **overrides: Any) -> CachedSpladeTrainingArguments:
    values: dict[str, Any] = {
        "output_dir": str(output_dir),
        "per_device_train_batch_size": 32,
        "mini_batch_size": 8,
        "query_max_length": 16,
        "document_max_length": 32,
        "max_steps": 2,
        "learning_rate": 1e-3,
        "query_reg_weight": 1e-3,
        "doc_reg_weight": 1e-3,
        "reg_warmup_steps": 2,
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": "none",
        "use_cpu": True,
        "seed": 7,
        "disable_tqdm": True,
    }
    values.update(overrides)
    return CachedSpladeTrainingArguments(**values)


class _UncachedTrainer(CachedSpladeTrainer):
    """The reference: the same Trainer, loss and data order, but the plain uncached forward/backward."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        reps = {name: model(**features) for name, features in inputs["columns"].items()}
        loss, _ = self.loss(reps, step=self.state.global_step, **inputs["loss_kwargs"])
        return loss


@pytest.mark.parametrize(
    ("accumulation", "checkpointing", "tokens", "pad"),
    [(1, False, None, None), (2, True, None, None), (1, False, 96, None), (1, False, 96, 16)],
    ids=["plain", "accumulation+checkpointing", "token-budget", "token-budget+pad16"],
)
def test_cached_trainer_matches_uncached_splade_loss(
    tmp_path,
    tokenizer,
    sample_rows,
    accumulation: int,
    checkpointing: bool,
    tokens: int | None,
    pad: int | None,
) -> None:
    """Effective batch 32 in mini-batches of 8 (also with 2 accumulation steps and gradient checkpointing,
    with length-grouped mini-batches of at most 96 padded tokens, and those with lengths rounded up to
    multiples of 16): parameters after 2 SGD steps equal uncached training's."""
    initial = {k: v.detach().clone() for k, v in _encoder(tokenizer, dropout=0.0).named_parameters()}
    params = {}
    for name, trainer_class in (("cached", CachedSpladeTrainer), ("uncached", _UncachedTrainer)):
        model = _encoder(tokenizer, dropout=0.0)
        args = _args(
            tmp_path / name,
            optim="sgd",
            gradient_accumulation_steps=accumulation,
            gradient_checkpointing=checkpointing,
            mini_batch_tokens=tokens,
            mini_batch_length_multiple=pad,
        )
        trainer = trainer_class(model, args, train_dataset=sample_rows, processing_class=tokenizer)
        trainer.train()
        backbone = (
            model.model
        )  # transformers 5.23 renamed gradient to activation checkpointing; 5.17 has the old
        enabled = getattr(backbone, "is_activation_checkpointing", None)
        assert (backbone.is_gradient_checkpointing if enabled is None else enabled) == checkpointing
        params[name] = {k: v.detach().clone() for k, v in model.named_parameters()}
    # SGD, not AdamW: Adam divides out the gradient's scale, so a replay that mis-scales gradients (e.g.
    # ignoring gradient accumulation's 1/k) would pass under it; SGD moves parameters by lr * gradient.
    for key, cached in params["cached"].items():
        # fp32: cached and uncached gradients differ by summation order only; measured max difference of
        # the parameters 1e-8 (values ~0.02-1). rtol 1e-5 / atol 1e-7 fail on any real gradient error:
        # parameters moved by up to ~1e-2 here (checked below).
        torch.testing.assert_close(
            cached, params["uncached"][key], rtol=1e-5, atol=1e-7, msg=f"parameter {key}"
        )
    moved = max((params["cached"][k] - initial[k]).abs().max().item() for k in initial)
    assert moved > 1e-4, f"parameters moved by at most {moved}: the comparison would be vacuous"


def test_trainer_logs_the_engines_settings_never_its_own_prediction(
    tmp_path, tokenizer, sample_rows, caplog
) -> None:
    """The trainer logs the settings its engine decided (engine.settings), once, never a prediction of its
    own: here the query column's own mini-batch size, reuse_argmax's default (on) and a max_memory that plans
    nothing on a CPU, which a prediction from the arguments got wrong or left out."""
    args = _args(tmp_path, max_steps=2, query_mini_batch_size=4, max_memory="4GiB")
    trainer = CachedSpladeTrainer(
        _encoder(tokenizer, dropout=0.0), args, train_dataset=sample_rows, processing_class=tokenizer
    )
    with caplog.at_level("INFO", logger="gradcache_sparton.trainer"):
        trainer.train()
    logged = [
        r.getMessage() for r in caplog.records if r.getMessage().startswith("GradCache engine settings")
    ]
    engine = trainer._engine.engine
    assert logged == [f"GradCache engine settings: {engine.settings.describe()}."]
    assert trainer.engine_settings is engine.settings and engine.memory_plan is None
    assert engine.settings.mini_batch_size == {"query": 4, "positive": 8}
    assert "mini_batch_size query 4, positive 8;" in logged[0] and "reuse_argmax on" in logged[0]


@pytest.mark.parametrize("max_memory", ["auto", "4GiB"])
def test_start_line_says_max_memory_plans_on_one_cuda_device_only(
    tmp_path, tokenizer, sample_rows, caplog, max_memory
) -> None:
    """On a CPU, max_memory plans nothing: the start line (Effective batch) says the plan runs on one CUDA
    device only and that the engine's defaults apply, for auto (otherwise silent) and for a size."""
    args = _args(tmp_path, max_steps=1, mini_batch_size=None, max_memory=max_memory)
    trainer = CachedSpladeTrainer(
        _encoder(tokenizer, dropout=0.0), args, train_dataset=sample_rows, processing_class=tokenizer
    )
    with caplog.at_level("INFO", logger="gradcache_sparton.trainer"):
        trainer.train()
    (start,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Effective batch")]
    assert (
        f"mini_batch_size 32 (max_memory {max_memory} is planned on one CUDA device only: on cpu, the engine's "
        "defaults apply to the options left unset);" in start
    )


_EVERY_FIELD_FLAGS = {
    "mini_batch_size": "4",
    "query_mini_batch_size": "2",
    "mini_batch_tokens": "256",
    "mini_batch_length_multiple": "8",
    "same_batch_size": "false",
    "allow_non_finite": "true",
    "show_mini_batch_progress": "true",
    "gather_across_ranks": "false",
    "check_replay": "false",
    "sparse_reps": "auto",
    "reuse_argmax": "false",
    "keep_graphs": "false",
    "max_memory": "4GiB",
}
_EVERY_FIELD_CONFIG = {
    "mini_batch_size": {"query": 2, "positive": 4, "negative_1": 4},
    "mini_batch_tokens": 256,
    "mini_batch_length_multiple": 8,
    "same_batch_size": False,
    "allow_non_finite": True,
    "show_mini_batch_progress": True,
    "gather_across_ranks": False,
    "check_replay": False,
    "sparse_reps": "auto",
    "reuse_argmax": False,
    "keep_graphs": False,
    "max_memory": "4GiB",
}


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (_EVERY_FIELD_FLAGS, _EVERY_FIELD_CONFIG),
        (
            {"mini_batch_length_multiple": "16", "cuda_graphs": "true", "sparse_reps": "true"},
            # max_memory not given: the trainer's default (auto; the engine's own default is off)
            {
                "mini_batch_length_multiple": 16,
                "cuda_graphs": True,
                "sparse_reps": "true",
                "max_memory": "auto",
            },
        ),
    ],
    ids=["every-field", "cuda-graphs"],
)
def test_every_engine_option_is_a_trainer_flag_that_reaches_the_engine(
    tmp_path, tokenizer, flags: dict[str, str], expected: dict[str, Any]
) -> None:
    """Each GradCacheConfig field is a `train` flag (HfArgumentParser), and the values given on the command
    line are the ones the trainer's engine is built with (query_mini_batch_size: the query column's size);
    the trainer keeps one engine across steps and builds another for another model."""
    from dataclasses import fields

    from transformers import HfArgumentParser

    from gradcache_sparton.engine import GradCacheConfig

    names = [f.name for f in fields(GradCacheConfig)]
    parser = HfArgumentParser(CachedSpladeTrainingArguments)
    assert set(names) <= {action.dest for action in parser._actions}
    default = GradCacheConfig()  # the first case sets every field but cuda_graphs to another value
    assert flags is not _EVERY_FIELD_FLAGS or all(
        getattr(GradCacheConfig(**expected), name) != getattr(default, name)
        for name in names
        if name != "cuda_graphs"
    )
    argv = [
        "--output_dir",
        str(tmp_path),
        "--use_cpu",
        "true",
        "--report_to",
        "none",
        "--query_max_length",
        "16",
    ]
    argv += ["--document_max_length", "32"]
    (args,) = parser.parse_args_into_dataclasses([*argv, *(f"--{k}={v}" for k, v in flags.items())])
    model = _encoder(tokenizer, dropout=0.0)
    trainer = CachedSpladeTrainer(model, args, processing_class=tokenizer)
    columns = {"query": {}, "positive": {}, "negative_1": {}}
    engine = trainer._cached_loss(model, columns).engine
    assert engine.config == GradCacheConfig(**expected)
    assert trainer._cached_loss(model, columns).engine is engine
    assert trainer._cached_loss(_encoder(tokenizer, dropout=0.0), columns).engine is not engine


def test_resume_from_checkpoint_continues_the_same_run(tmp_path, tokenizer, sample_rows) -> None:
    """Resuming from the step-2 checkpoint ends with weights bitwise equal to an uninterrupted 4-step run (dropout on)."""
    common = {"max_steps": 4, "save_strategy": "steps", "save_steps": 2}
    full = CachedSpladeTrainer(
        _encoder(tokenizer, dropout=0.1),
        _args(tmp_path / "run", **common),
        train_dataset=sample_rows,
        processing_class=tokenizer,
    )
    full.train()
    assert full.state.global_step == 4

    resumed = CachedSpladeTrainer(
        _encoder(tokenizer, dropout=0.1),
        _args(tmp_path / "run", **common),
        train_dataset=sample_rows,
        processing_class=tokenizer,
    )
    resumed.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-2"))
    # Weights, optimizer, scheduler, RNG (dropout) and data position are all restored: the same
    # computation in the same order, so the final weights are bitwise those of the uninterrupted run.
    # (The logged losses are rounded to 4 digits: too coarse to tell a slightly different run apart.)
    full_params = dict(full.model.named_parameters())
    for name, param in resumed.model.named_parameters():
        assert torch.equal(param, full_params[name]), f"parameter {name} differs after resuming"


def test_training_lowers_the_loss_and_saves_a_standard_checkpoint(tmp_path, tokenizer, sample_rows) -> None:
    """On one batch of real SciFact pairs seen at every step, without dropout (so that neither batch
    difficulty nor dropout noise can mask it), the loss falls over 6 steps (measured 9.5 -> 3.9 at lr
    1e-4; lr 1e-3 diverges on this random-init model); the saved model loads with AutoModelForMaskedLM."""
    model = _encoder(tokenizer, dropout=0.0)
    trainer = CachedSpladeTrainer(
        model,
        _args(
            tmp_path / "run",
            max_steps=6,
            per_device_train_batch_size=16,
            learning_rate=1e-4,
            query_reg_weight=0.0,
            doc_reg_weight=0.0,
        ),
        train_dataset=sample_rows.select(range(16)),
        processing_class=tokenizer,
    )
    trainer.train()
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    assert sum(losses[-2:]) < sum(losses[:2]), losses
    logged = next(log for log in trainer.state.log_history if "loss" in log)
    for key in ("contrastive", "reg_query", "nnz_doc", "train_sequences_per_second", "global_batch_size"):
        assert key in logged, key
    trainer.save_model()
    reloaded, info = AutoModelForMaskedLM.from_pretrained(str(tmp_path / "run"), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    features = tokenizer(["a claim about proteins"], return_tensors="pt")
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(
            SpladeEncoder(reloaded.eval())(**features), model(**features), rtol=0, atol=0
        )


def test_trainer_rejects_bad_input_before_training(tmp_path, tokenizer, sample_rows) -> None:
    """Missing columns, empty data, a batch below the mini-batch, cuda_graphs without what it needs, ragged
    negatives, unknown backbones, a used output_dir."""
    model = _encoder(tokenizer, dropout=0.0)

    def build(dataset: Any, **overrides: Any) -> CachedSpladeTrainer:
        return CachedSpladeTrainer(
            model, _args(tmp_path / "run", **overrides), train_dataset=dataset, processing_class=tokenizer
        )

    with pytest.raises(ValueError, match="positive"):
        build(sample_rows.remove_columns("positive"))
    with pytest.raises(ValueError, match=r"empty|no rows|0 rows"):
        build(sample_rows.select([]))
    with pytest.raises(ValueError, match="fewer than one batch"):
        build(sample_rows.select(range(10)))
    with pytest.raises(ValueError, match="mini_batch_size"):
        _args(tmp_path, per_device_train_batch_size=4, mini_batch_size=8)
    with pytest.raises(ValueError, match=r"cuda_graphs=True needs no mini_batch_tokens .*; reuse_argmax off"):
        _args(
            tmp_path,
            cuda_graphs=True,
            mini_batch_length_multiple=16,
            mini_batch_tokens=512,
            reuse_argmax=True,
        )
    ragged = datasets.Dataset.from_list(
        [{"query": "q", "positive": "p", "negatives": ["n"] * (1 + i % 2)} for i in range(40)]
    )
    with pytest.raises(ValueError, match="negatives"):
        build(ragged)
    with pytest.raises(ValueError, match="config_name"):
        ModelArguments(config_name="bert-large-cased")
    with pytest.raises(ValueError, match="max_train_samples"):
        DataArguments(max_train_samples=0)
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "trainer_state.json").write_text("{}")
    trainer = CachedSpladeTrainer(
        model, _args(tmp_path / "used"), train_dataset=sample_rows, processing_class=tokenizer
    )
    with pytest.raises(ValueError, match="already holds another run"):
        trainer.train()


def test_cli_train_and_evaluate_on_tiny_config(tmp_path, capsys) -> None:
    """`gradcache-sparton train` on a tiny config writes a checkpoint that `evaluate` scores on a BEIR folder."""
    beir = tmp_path / "beir"
    (beir / "qrels").mkdir(parents=True)
    docs = [("d1", "Proteins fold quickly."), ("d2", "Stars emit light."), ("d3", "Cells divide by mitosis.")]
    (beir / "corpus.jsonl").write_text(
        "".join(json.dumps({"_id": i, "title": "", "text": t}) + "\n" for i, t in docs)
    )
    queries = [("q1", "how do proteins fold"), ("q2", "what do stars emit")]
    (beir / "queries.jsonl").write_text("".join(json.dumps({"_id": i, "text": t}) + "\n" for i, t in queries))
    (beir / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\nq1\td1\t1\nq2\td2\t1\n")
    out = tmp_path / "run"
    argv = [
        "train", "--hidden_size", "32", "--num_hidden_layers", "1", "--num_attention_heads", "2",
        "--intermediate_size", "64", "--per_device_train_batch_size", "16", "--mini_batch_size", "8",
        "--query_max_length", "16", "--document_max_length", "32", "--max_steps", "1",
        "--max_train_samples", "32", "--eval_beir", str(beir), "--eval_beir_split", "test",
        "--output_dir", str(out), "--use_cpu", "--disable_tqdm", "True",
    ]  # fmt: skip
    assert main(argv) == 0
    stdout = capsys.readouterr().out
    summary = json.loads(stdout[stdout.rindex('{\n  "output_dir"') :])
    assert summary["output_dir"] == str(out)
    assert (out / "model.safetensors").is_file() and (out / "splade_config.json").is_file()
    metrics = json.loads((out / "retrieval_metrics.json").read_text())
    assert 0.0 <= metrics["eval_ndcg_at_10"] <= 1.0 and metrics == {k: summary[k] for k in metrics}
    assert (
        main(["evaluate", "--model_name_or_path", str(out), "--beir_path", str(beir), "--split", "test"]) == 0
    )
    evaluated = json.loads(capsys.readouterr().out)
    # The same checkpoint, data and lengths (evaluate reads the training lengths 16/32 the checkpoint
    # saved): the same metrics.
    assert evaluated["ndcg_at_10"] == pytest.approx(metrics["eval_ndcg_at_10"])
    # A second train into the same output_dir is refused with a one-line error (exit code 2).
    assert main(argv) == 2
    assert "already holds another run" in capsys.readouterr().err


def test_cli_train_help_lists_cached_arguments(capsys) -> None:
    """`gradcache-sparton train --help` documents the GradCache and loss flags next to the Trainer's."""
    with pytest.raises(SystemExit) as exc:
        main(["train", "--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    for flag in (
        "--mini_batch_size",
        "--per_device_train_batch_size",
        "--query_reg_weight",
        "--config",
        "--config_name",
    ):
        assert flag in text, flag


@pytest.mark.gpu
@pytest.mark.parametrize(
    "mode",
    ["eager", "torch_compile", "cuda_graphs", "cuda_graphs+torch_compile", "cuda_graphs+checkpointing"],
)
def test_bf16_training_on_gpu_runs_the_triton_head(tmp_path, tokenizer, sample_rows, mode: str) -> None:
    """On CUDA with bf16 (and with the Trainer's torch_compile, CUDA graphs, or CUDA graphs with either
    torch_compile or activation checkpointing): steps run, losses are finite and fall on one batch seen at
    every step without dropout, at lr 1e-4 (as the CPU test: lr 1e-3 diverges on this random-init model)."""
    model = _encoder(tokenizer, dropout=0.0)
    graphs = {"cuda_graphs": True, "mini_batch_length_multiple": 16} if "cuda_graphs" in mode else {}
    args = _args(
        tmp_path / "run",
        use_cpu=False,
        bf16=True,
        torch_compile="torch_compile" in mode,
        gradient_checkpointing="checkpointing" in mode,
        **graphs,
        max_steps=6,
        per_device_train_batch_size=16,
        learning_rate=1e-4,
        query_reg_weight=0.0,
        doc_reg_weight=0.0,
    )
    rows = sample_rows.select(range(16))
    trainer = CachedSpladeTrainer(model, args, train_dataset=rows, processing_class=tokenizer)
    trainer.train()
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    assert all(torch.isfinite(torch.tensor(losses))), losses
    assert sum(losses[-2:]) < sum(losses[:2]), losses


def test_collapsed_reps_are_reported(tmp_path, tokenizer, sample_rows, caplog) -> None:
    """A logging window whose mean non-zeros per rep is 0 logs a warning naming the collapse and the fix."""
    trainer = CachedSpladeTrainer(
        _encoder(tokenizer, dropout=0.0),
        _args(tmp_path / "run"),
        train_dataset=sample_rows,
        processing_class=tokenizer,
    )
    for nnz_query, expect_warning in ((3.0, False), (0.0, True)):
        caplog.clear()
        trainer._record(
            {"nnz_query": torch.tensor(nnz_query), "nnz_doc": torch.tensor(5.0)},
            {"query": {"input_ids": torch.zeros(2, 4)}},
        )
        with caplog.at_level("WARNING", logger="gradcache_sparton.trainer"):
            trainer.log({"loss": 5.545})
        assert ("collapsed to all zeros (nnz_query = 0" in caplog.text) == expect_warning, caplog.text


@pytest.mark.slow
def test_repeated_positives_are_counted_with_dataloader_workers(tmp_path, tokenizer, sample_rows) -> None:
    """The logged repeated_positives is the run's total of in-batch repeated positives also when dataloader
    workers collate (each worker's collator keeps its own count, which never reaches the trainer)."""
    rows = sample_rows.select(range(16))
    rows = datasets.concatenate_datasets([rows, rows.select(range(4))])  # 20 rows, 4 positives twice
    args = _args(tmp_path / "run", per_device_train_batch_size=20, max_steps=2, dataloader_num_workers=1)
    trainer = CachedSpladeTrainer(
        _encoder(tokenizer, dropout=0.0), args, train_dataset=rows, processing_class=tokenizer
    )
    trainer.train()
    logged = [entry["repeated_positives"] for entry in trainer.state.log_history if "loss" in entry]
    assert logged == [4, 8]  # every batch holds all 20 rows: 4 repeats a step
    assert trainer.data_collator.repeated_positives == 0  # the main process's collator collated nothing


def test_random_init_decoder_bias_scales_with_width(tokenizer) -> None:
    """The default decoder-bias start is -2.2 initial-logit deviations (-0.5 for bert-tiny, -1.0 for bert-small);
    an explicit value wins."""
    for config_name, expected in (("bert-tiny", -0.4978), ("bert-small", -0.9956)):
        bias = (
            build_encoder(ModelArguments(config_name=config_name), tokenizer)
            .model.get_output_embeddings()
            .bias
        )
        torch.testing.assert_close(bias, torch.full_like(bias, expected), rtol=0, atol=1e-4)
    bias = build_encoder(ModelArguments(init_decoder_bias=0.0), tokenizer).model.get_output_embeddings().bias
    assert torch.count_nonzero(bias) == 0


def test_cli_config_file_sets_defaults_and_rejects_unknown_keys(tmp_path, capsys) -> None:
    """`train --config` reads YAML/JSON values (flags still override) and refuses unknown argument names."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("per_device_train_batch_size: 16\nmini_batch_sise: 8\n")
    assert main(["train", "--config", str(bad)]) == 2
    assert "unknown argument(s) ['mini_batch_sise']" in capsys.readouterr().err
    out = tmp_path / "run"
    values = {
        "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 64,
        "per_device_train_batch_size": 16, "mini_batch_size": 8, "query_max_length": 16,
        "document_max_length": 32, "max_steps": 3, "max_train_samples": 32, "eval_beir": "none",
        "use_cpu": True, "disable_tqdm": True, "report_to": "none", "output_dir": str(out),
    }  # fmt: skip
    config = tmp_path / "run.json"
    config.write_text(json.dumps(values))
    assert main(["train", "--config", str(config), "--max_steps", "1"]) == 0
    stdout = capsys.readouterr().out
    summary = json.loads(stdout[stdout.rindex('{\n  "output_dir"') :])
    assert summary["output_dir"] == str(out) and "eval_ndcg_at_10" not in summary  # eval_beir: none
    assert summary["epoch"] == pytest.approx(
        0.5
    )  # 1 step (the flag) of 16 rows out of 32, not the config's 3


def _never_build_the_model(*args: Any, **kwargs: Any) -> None:
    raise AssertionError("the model was built: the bad argument should have been refused before")


def test_cli_refuses_a_run_that_trains_nothing_before_building_the_model(
    tmp_path, capsys, monkeypatch
) -> None:
    """`--num_train_epochs 0`, or fewer rows than one batch with drop_last: exit 2 naming the argument,
    before the model is built and before output_dir is written."""
    monkeypatch.setattr("gradcache_sparton.pipeline.build_encoder", _never_build_the_model)
    out = tmp_path / "run"
    common = [
        "train",
        "--config_name",
        "bert-tiny",
        "--eval_beir",
        "none",
        "--output_dir",
        str(out),
        "--use_cpu",
    ]
    for flags, expected in (
        (["--num_train_epochs", "0"], "num_train_epochs must be > 0"),
        (["--max_train_samples", "8", "--per_device_train_batch_size", "16", "--mini_batch_size", "8"],
         "8 rows, fewer than one batch of 16"),
    ):  # fmt: skip
        assert main([*common, *flags]) == 2
        assert expected in capsys.readouterr().err
        assert not out.exists()


def test_cli_bad_run_settings_are_one_line_errors(tmp_path, capsys, monkeypatch) -> None:
    """A YAML or JSON syntax error (file and line named), a resume_from_checkpoint that is not a
    checkpoint folder, a report_to whose package is missing, `evaluate --device` naming an absent GPU:
    one `error:` line on stderr and a non-zero exit, no traceback, no model built."""
    monkeypatch.setattr("gradcache_sparton.pipeline.build_encoder", _never_build_the_model)
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("max_steps: 3\nlearning_rate: [1e-3\n")
    bad_json = tmp_path / "bad.json"
    bad_json.write_text('{"max_steps": 3,\n "learning_rate": }\n')
    base = ["train", "--config_name", "bert-tiny", "--eval_beir", "none", "--use_cpu"]
    cases = [
        (["train", "--config", str(bad_yaml)], f"--config '{bad_yaml}' line 3: not valid YAML"),
        (["train", "--config", str(bad_json)], f"--config '{bad_json}' line 2: not valid JSON"),
        ([*base, "--output_dir", str(tmp_path / "a"), "--resume_from_checkpoint", str(tmp_path / "nowhere")],
         "resume_from_checkpoint"),
        ([*base, "--output_dir", str(tmp_path / "b"), "--resume_from_checkpoint", str(tmp_path)],
         "has no trainer_state.json"),
    ]  # fmt: skip
    from transformers.integrations import get_available_reporting_integrations

    if "wandb" not in get_available_reporting_integrations():
        cases.append(
            ([*base, "--output_dir", str(tmp_path / "c"), "--report_to", "wandb"], "pip install wandb")
        )
    for argv, expected in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("gradcache-sparton train: error: ") and expected in err, err
        assert "Traceback" not in err and err.count("\n") == 1, err
    if not torch.cuda.is_available():
        assert main(["evaluate", "--model_name_or_path", str(tmp_path), "--device", "cuda"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("gradcache-sparton evaluate: error: ") and "CUDA is not available" in err, err


def test_embedded_default_applies_only_when_no_model_or_data_is_named(tmp_path, caplog, monkeypatch) -> None:
    """`train` alone (or `--config default`) takes resources/default_train.yaml's values under the flags;
    a run naming its data or model takes the dataclass defaults instead (no demo step cap); the start log
    lists every config value no flag overrode."""
    import yaml

    from gradcache_sparton.resources import default_train_config_path

    demo = yaml.safe_load(default_train_config_path().read_text())
    seen: list[tuple[Any, Any, Any]] = []

    def fake_run_training(model_args: Any, data_args: Any, training_args: Any) -> dict[str, float]:
        seen.append((model_args, data_args, training_args))
        return {}

    monkeypatch.setattr("gradcache_sparton.pipeline.run_training", fake_run_training)
    data = str(default_train_data_path())
    out = ["--output_dir", str(tmp_path / "run")]
    with caplog.at_level("INFO", logger="gradcache_sparton.cli"):
        assert main(["train", *out, "--max_steps", "3"]) == 0
        _, _, args = seen.pop()
        assert args.max_steps == 3 and args.learning_rate == demo["learning_rate"]
        assert f"learning_rate={demo['learning_rate']!r}" in caplog.text and "max_steps=" not in caplog.text
        caplog.clear()
        assert main(["train", *out, "--train_data", data, "--num_train_epochs", "10"]) == 0
        _, data_args, args = seen.pop()
        assert data_args.train_data == [data] and args.num_train_epochs == 10 and args.max_steps == -1
        assert args.learning_rate != demo["learning_rate"]
        assert "--train_data given: the embedded default run" in caplog.text
        for argv in (["--config_name", "bert-mini"], ["--train_data", data, "--config", "default"]):
            assert main(["train", *out, *argv]) == 0
            model_args, _, args = seen.pop()
            assert (args.max_steps == demo["max_steps"]) == ("default" in argv), argv
        # The demo's settings on a random-init shape: the flag's shape replaces the demo's checkpoint.
        assert main(["train", *out, "--config", "default", "--config_name", "bert-mini"]) == 0
        model_args, _, args = seen.pop()
        assert model_args.model_name_or_path is None and model_args.config_name == "bert-mini"
        assert args.max_steps == demo["max_steps"]


def _tiny_beir(folder: Path) -> Path:
    """A 3-document BEIR folder (split test) whose texts are longer than 8 tokens."""
    (folder / "qrels").mkdir(parents=True)
    docs = [
        ("d1", "Proteins fold quickly into their native structure inside living cells of many organisms."),
        ("d2", "Stars emit light because nuclear fusion in their cores releases a great deal of energy."),
        ("d3", "Cells divide by mitosis, copying their chromosomes before the cell splits in two parts."),
    ]
    (folder / "corpus.jsonl").write_text(
        "".join(json.dumps({"_id": i, "title": "", "text": t}) + "\n" for i, t in docs)
    )
    queries = [("q1", "how do proteins fold in living cells"), ("q2", "why do stars emit light")]
    (folder / "queries.jsonl").write_text(
        "".join(json.dumps({"_id": i, "text": t}) + "\n" for i, t in queries)
    )
    (folder / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\nq1\td1\t1\nq2\td2\t1\n")
    return folder


def test_embedded_run_fine_tunes_the_shipped_model_and_reports_before_and_after(tmp_path, capsys) -> None:
    """The embedded run starts from the shipped pretrained SPLADE-tiny (not random weights), evaluates before
    and after training, and prints both; the checkpoint remembers its training lengths and evaluate uses them."""
    beir = _tiny_beir(tmp_path / "beir")
    out = tmp_path / "run"
    argv = [
        "train", "--max_steps", "1", "--per_device_train_batch_size", "8", "--mini_batch_size", "8",
        "--document_max_length", "48", "--eval_beir", str(beir), "--eval_beir_split", "test",
        "--output_dir", str(out), "--use_cpu", "--disable_tqdm", "True",
    ]  # fmt: skip
    assert main(argv) == 0
    stdout = capsys.readouterr().out
    summary = json.loads(stdout[stdout.rindex('{\n  "output_dir"') : stdout.rindex("}") + 1])
    # The pretrained model ranks the two relevant documents first before any training (random init does not).
    assert summary["eval_before_ndcg_at_10"] == pytest.approx(1.0)
    assert f"dev nDCG@10: before training {summary['eval_before_ndcg_at_10']:.4f}" in stdout
    saved = json.loads((out / "splade_config.json").read_text())
    assert saved["query_max_length"] == 32 and saved["document_max_length"] == 48  # demo's 32, the flag's 48
    # Documents are encoded at 256 at least (trained at 48: the length is no reason to truncate them)
    assert checkpoint_max_lengths(str(out)) == (32, 256)
    assert checkpoint_max_lengths(str(out), document_max_length=24) == (32, 24)  # an explicit value wins
    assert checkpoint_max_lengths("splade-tiny-msmarco") == (32, 256)  # not recorded: the defaults
    reloaded = SpladeEncoder.from_pretrained(out)
    assert (reloaded.query_max_length, reloaded.document_max_length) == (32, 48)


def test_model_name_that_is_no_folder_shipped_model_or_reachable_hub_id_is_one_clear_error(tokenizer) -> None:
    """A model_name_or_path that is neither a folder, a shipped name nor loadable from the hub (offline here,
    or no such repo online) raises ValueError naming the argument, not a hub traceback."""
    with pytest.raises(
        ValueError, match=r"model_name_or_path 'no-such-org-x1/no-such-model' is not a local folder"
    ):
        build_encoder(ModelArguments(model_name_or_path="no-such-org-x1/no-such-model"), tokenizer)


def test_saved_training_lengths_round_trip_and_bad_values_are_refused(tmp_path, tokenizer) -> None:
    """splade_config.json keeps query/document max lengths next to pooling and masked ids; a value that is
    not a positive int is refused when the checkpoint is read, naming the file and the key."""
    encoder = _encoder(tokenizer, dropout=0.0)
    encoder.query_max_length, encoder.document_max_length = 24, 96
    encoder.save_pretrained(tmp_path / "ckpt", tokenizer=tokenizer)
    saved = json.loads((tmp_path / "ckpt" / "splade_config.json").read_text())
    assert saved == {
        "pooling": "max",
        "special_token_ids": [],
        "query_max_length": 24,
        "document_max_length": 96,
        "query_encoder": "splade",
    }
    reloaded = SpladeEncoder.from_pretrained(tmp_path / "ckpt")
    assert (reloaded.query_max_length, reloaded.document_max_length) == (24, 96)
    (tmp_path / "ckpt" / "splade_config.json").write_text(json.dumps({**saved, "document_max_length": 0}))
    with pytest.raises(ValueError, match="document_max_length must be a positive int"):
        SpladeEncoder.from_pretrained(tmp_path / "ckpt")


@pytest.mark.parametrize(
    ("state", "named"),
    [
        ({"is_deepspeed_enabled": True, "is_fsdp_enabled": False, "version": None}, "deepspeed"),
        ({"is_deepspeed_enabled": False, "is_fsdp_enabled": True, "version": 1}, "fsdp_version 2"),
    ],
    ids=["deepspeed", "fsdp1"],
)
def test_trainer_refuses_deepspeed_and_fsdp1(state: dict, named: str) -> None:
    """DeepSpeed and FSDP version 1 are refused with an error naming the setting and what to use; FSDP2
    and no sharding pass."""
    from types import SimpleNamespace

    from gradcache_sparton.run_checks import check_sharding

    def trainer(deepspeed: bool, fsdp: bool, version: int | None) -> SimpleNamespace:
        plugin = SimpleNamespace(fsdp_version=version)
        accelerator = SimpleNamespace(state=SimpleNamespace(fsdp_plugin=plugin))
        return SimpleNamespace(is_deepspeed_enabled=deepspeed, is_fsdp_enabled=fsdp, accelerator=accelerator)

    with pytest.raises(ValueError, match=named):
        check_sharding(trainer(state["is_deepspeed_enabled"], state["is_fsdp_enabled"], state["version"]))
    check_sharding(trainer(False, True, 2))
    check_sharding(trainer(False, False, None))


def test_documents_encode_at_256_tokens_at_most_the_position_table(tmp_path, tiny_bert_config) -> None:
    """A checkpoint trained on short documents encodes them at the default 256 tokens, capped by its position
    table (128 here); queries keep their trained length; an explicit length wins."""
    encoder = SpladeEncoder.from_config(tiny_bert_config)  # max_position_embeddings 128
    encoder.query_max_length, encoder.document_max_length = 16, 48
    encoder.save_pretrained(tmp_path)
    assert checkpoint_max_lengths(str(tmp_path)) == (16, 128)
    assert checkpoint_max_lengths(str(tmp_path), document_max_length=40) == (16, 40)


def test_a_short_position_table_caps_the_default_lengths_of_a_plain_checkpoint(
    tmp_path, tiny_bert_config
) -> None:
    """A masked-LM checkpoint with no recorded lengths and 64 positions is read at 64 document tokens (what
    it can read), not refused for the default 256; an explicit length past the table stays an error."""
    from transformers import BertForMaskedLM

    config = tiny_bert_config.__class__.from_dict(
        {**tiny_bert_config.to_dict(), "max_position_embeddings": 64}
    )
    BertForMaskedLM(config).save_pretrained(tmp_path)
    assert checkpoint_max_lengths(str(tmp_path)) == (32, 64)
    with pytest.raises(ValueError, match="document_max_length=128"):
        checkpoint_max_lengths(str(tmp_path), document_max_length=128)


def test_several_visible_gpus_never_mean_data_parallel(tmp_path, monkeypatch) -> None:
    """With several GPUs visible and no distributed launch, the arguments report one GPU, so the Trainer
    never wraps the cached loss's encoder in nn.DataParallel (which would split replays across GPUs)."""
    from transformers import TrainingArguments

    monkeypatch.setattr(TrainingArguments, "n_gpu", property(lambda self: 4))
    args = CachedSpladeTrainingArguments(output_dir=str(tmp_path), use_cpu=True)
    assert args.n_gpu == 1
    assert args.train_batch_size == args.per_device_train_batch_size


@pytest.mark.parametrize(
    ("max_memory", "device", "padded"),
    [
        ("4GiB", "cpu", False),
        ("auto", "cpu", False),
        (None, "cpu", False),
        pytest.param("4GiB", "cuda", True, marks=pytest.mark.gpu),
        pytest.param("auto", "cuda", True, marks=pytest.mark.gpu),
        pytest.param(None, "cuda", False, marks=pytest.mark.gpu),
    ],
)
def test_trainer_pads_batches_to_one_shape_under_max_memory(
    tmp_path, tokenizer, sample_rows, max_memory, device, padded
) -> None:
    """With max_memory on CUDA the default collator pads every batch to the max lengths, so the plan measured on
    the first batch covers every later one (no probe in mid-training for a longer batch); without max_memory, or
    on a CPU (where no plan is made), to the longest row. Either way the training texts are tokenized once,
    before training (the collator's token cache)."""
    trainer = CachedSpladeTrainer(
        _encoder(tokenizer, dropout=0.0),
        _args(tmp_path, max_memory=max_memory, use_cpu=device == "cpu"),
        train_dataset=sample_rows,
        processing_class=tokenizer,
    )
    assert trainer.data_collator.pad_to_max_length is padded
    query = sample_rows[0]["query"]
    assert (
        trainer.data_collator.token_cache.features([query], is_query=True, length=None, multiple=8)
        is not None
    )


def test_trainer_logs_the_memory_plan_once(tmp_path, tokenizer) -> None:
    """A max_memory plan reaches the trainer's logs (memory_plan_* entries) with the first log after it, once."""
    from engine_helpers import plan_inputs

    from gradcache_sparton.engine.planner.memory_plan import ColumnFit, Footprint, choose_plan

    rows = {"query": 32, "positive": 32}
    fits = {column: ColumnFit(0.0, 2**20, 16) for column in rows}
    footprint = Footprint(
        allocated=0, grads=0, optimizer=0, rep_cache=0, records=0, sparse_rep_cache=0, sparse_loss=0
    )
    plan = choose_plan(2**30, rows, lambda on: fits, footprint, *plan_inputs(dict.fromkeys(rows)))
    trainer = CachedSpladeTrainer(
        _encoder(tokenizer, dropout=0.0), _args(tmp_path, max_memory="1GiB"), processing_class=tokenizer
    )
    trainer.memory_plan = plan
    for expected in (True, False):
        trainer._component_sums, trainer._component_calls = {"contrastive": torch.tensor(1.0)}, 1
        logs = {"loss": 1.0}
        trainer.log(logs)
        assert ("memory_plan_mini_batch_size_query" in logs) is expected
        assert not expected or logs["memory_plan_budget_gib"] == 1.0


def test_loss_columns_the_loss_does_not_read_are_refused_at_build(tmp_path, tokenizer) -> None:
    """A numeric column reaches the loss as a keyword: teacher_scores with the default InfoNCE, or any column a
    user loss's signature does not name, is a ValueError naming the column before any encoding; the losses that
    read it (margin_mse, kl_div; a user loss naming it or taking **kwargs) are accepted."""
    rows = datasets.Dataset.from_dict(
        {
            "query": ["q one", "q two"],
            "positive": ["p one", "p two"],
            "negative_1": ["n one", "n two"],
            "teacher_scores": [[1.0, 0.0], [2.0, 0.5]],
        }
    )
    model = trainer_model(tokenizer)

    def build(loss: Any = None, **overrides: Any) -> CachedSpladeTrainer:
        args = CachedSpladeTrainingArguments(
            output_dir=str(tmp_path),
            per_device_train_batch_size=2,
            document_max_length=32,
            use_cpu=True,
            report_to="none",
            **overrides,
        )
        return CachedSpladeTrainer(model, args, train_dataset=rows, processing_class=tokenizer, loss=loss)

    with pytest.raises(
        ValueError, match=r"\['teacher_scores'\].*contrastive='infonce'.*'margin_mse' or 'kl_div'"
    ):
        build()

    def dense_loss(reps, *, step=None):
        return reps["query"].sum()

    with pytest.raises(ValueError, match=r"\['teacher_scores'\].*loss .*dense_loss reads none"):
        build(dense_loss)
    build(contrastive="kl_div")
    build(lambda reps, *, step=None, teacher_scores=None: reps["query"].sum())
    build(lambda reps, **kwargs: reps["query"].sum())
