"""Sparse reps in training: ``CachedLoss(sparse_reps=...)``, the trainer's ``sparse_reps`` option, its checks.

The invariant: keeping the reps as their non-zeros (``SparseReps``) from Step (1) to Step (3) changes
nothing but memory: the loss, its logged components and every parameter gradient equal the dense
cached loss's and the uncached loss's.

Tolerances (fp32). The sparse SpladeLoss adds the same fp32 terms as the dense one in another order
(scores summed over a row's non-zeros instead of over V, a blocked log-sum-exp instead of one
cross-entropy), and the cached paths sum mini-batch by mini-batch. Reordering an n-term fp32 sum moves
it by at most (n - 1)·u·Σ|terms| (u = 2^-24 ≈ 6e-8), about √n·u in practice: with n ≤ V = 500 that is
≈ 1.3e-6 per sum, and a gradient goes through a few such sums (scores, log-sum-exp, the head's
backward), so a few 1e-6 relative to each parameter's largest gradient (measured: ≤ 2.7e-6,
tests/test_sparse_reps.py). rtol 1e-5 for gradients (relative to each parameter's largest gradient,
``assert_grads_close``) and for the loss leaves ≥ 3x room; a dropped, doubled or mis-scaled mini-batch
or non-zero is an O(1e-2) or larger error. Trainer parameters after 2 SGD steps move by ~lr·g (≥ 1e-4,
checked) and differ between the two paths by summation order only: rtol 1e-5, atol 1e-7.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import datasets
import pytest
import torch
from engine_helpers import (
    assert_grads_close,
    grads_of,
    make_columns,
    make_encoder,
    per_mini_batch_loss,
    small_config,
    uncached_loss,
)
from trainer_helpers import trainer_args, trainer_model

from gradcache_sparton.arguments import CachedSpladeTrainingArguments
from gradcache_sparton.cli import main
from gradcache_sparton.data import default_train_data_path, load_training_data
from gradcache_sparton.engine import CachedLoss
from gradcache_sparton.engine.settings import encoder_facts, resolve_settings
from gradcache_sparton.losses import SpladeLoss, SpladeLossConfig
from gradcache_sparton.primitives.sparse_reps import SparseReps
from gradcache_sparton.trainer import CachedSpladeTrainer

RTOL = 1e-5  # see the module docstring
BATCH = 8


@pytest.fixture
def config(tiny_bert_config):
    return small_config(tiny_bert_config)


class _RecordingLoss:
    """A loss that records the layout of the reps it receives (SparseReps or Tensor) and delegates."""

    def __init__(self, loss: Any) -> None:
        self.loss = loss
        self.layouts: list[set[type]] = []

    def __call__(self, reps: Mapping[str, Any], **loss_kwargs: Any) -> Any:
        self.layouts.append({type(rep) for rep in reps.values()})
        return self.loss(reps, **loss_kwargs)


def _splade_loss(**settings: Any) -> _RecordingLoss:
    return _RecordingLoss(SpladeLoss(SpladeLossConfig(query_reg_weight=0.3, doc_reg_weight=0.2, **settings)))


def _encoder(config, *, dropout: bool, bias_shift: float):
    """The tiny encoder with its output bias lowered: reps ~93% (0.0), ~21% (0.2) or ~3% (0.3) non-zero."""
    encoder = make_encoder(config, train=dropout)
    with torch.no_grad():
        encoder.mlm.cls.predictions.bias -= bias_shift
    return encoder


def _columns() -> dict[str, dict[str, torch.Tensor]]:
    columns = make_columns(BATCH, 3)  # query, positive, one hard negative
    columns["positive"]["attention_mask"][5] = 0  # an all-zero rep row
    return columns


def _cached(encoder, columns, loss_fn, *, sparse_reps, seed: int = 3, **options: Any):
    """Loss, components and every parameter gradient of one CachedLoss forward and backward."""
    torch.manual_seed(seed)  # the same dropout draws in every Step (1)
    cached = CachedLoss(encoder, loss_fn, sparse_reps=sparse_reps, **options)
    loss, components = cached(columns, return_components=True)
    loss.backward()
    return loss.detach(), components, grads_of(encoder)


@pytest.mark.parametrize(
    ("mini_batch_size", "dropout", "bias_shift", "mini_batch_tokens", "score_block_size"),
    [
        (4, False, 0.3, None, None),
        (3, False, 0.2, None, 3),
        (3, True, 0.3, None, None),
        (3, True, 0.2, 25, None),
    ],
    ids=["mb4-divides-3pct", "mb3-21pct-block3", "mb3-dropout-3pct", "tok25-dropout-21pct"],
)
def test_sparse_cached_loss_matches_dense_and_uncached(
    config, mini_batch_size: int, dropout: bool, bias_shift: float, mini_batch_tokens, score_block_size
) -> None:
    """CachedLoss with sparse_reps=True hands the loss SparseReps and gives the dense CachedLoss's loss,
    components and every parameter gradient, and the uncached loss and gradients (mini-batches dividing
    the batch or not, length-grouped, dropout on and off, reps 3% and 21% non-zero, an all-zero row,
    one or several score blocks)."""
    columns = _columns()
    loss_fn = _splade_loss(score_block_size=score_block_size)
    options = {"mini_batch_size": mini_batch_size, "mini_batch_tokens": mini_batch_tokens}

    encoder = _encoder(config, dropout=dropout, bias_shift=bias_shift)
    torch.manual_seed(3)
    if dropout:  # the reference draws the engine's dropout masks: mini-batches encoded in its order
        ref_loss, _ = per_mini_batch_loss(
            encoder, columns, loss_fn, mini_batch_size, mini_batch_tokens=mini_batch_tokens
        )
    else:
        ref_loss, _ = uncached_loss(encoder, columns, loss_fn)
    ref_loss.backward()
    ref_grads = grads_of(encoder)

    dense_loss, dense_parts, dense_grads = _cached(
        _encoder(config, dropout=dropout, bias_shift=bias_shift),
        columns,
        loss_fn,
        sparse_reps=False,
        **options,
    )
    loss_fn.layouts.clear()
    sparse_loss, sparse_parts, sparse_grads = _cached(
        _encoder(config, dropout=dropout, bias_shift=bias_shift),
        columns,
        loss_fn,
        sparse_reps=True,
        **options,
    )

    assert loss_fn.layouts == [{SparseReps}]  # the sparse path really ran
    torch.testing.assert_close(sparse_loss, dense_loss, rtol=RTOL, atol=0)
    torch.testing.assert_close(sparse_loss, ref_loss.detach(), rtol=RTOL, atol=0)
    assert sparse_parts.keys() == dense_parts.keys()
    for name, value in dense_parts.items():
        torch.testing.assert_close(sparse_parts[name], value, rtol=RTOL, atol=0, msg=name)
    assert_grads_close(sparse_grads, dense_grads, rtol=RTOL)
    assert_grads_close(sparse_grads, ref_grads, rtol=RTOL)


def test_sparse_cached_loss_gradient_accumulation_scaling(config) -> None:
    """Two accumulation micro-steps of loss / 2 (what the Trainer backpropagates) with sparse_reps give the
    uncached micro-steps' summed loss and gradients: the incoming gradient 1/2 reaches the sparse replay
    (scaled once, not twice or not at all)."""
    k = 2
    columns = make_columns(2 * BATCH, 3, seed=1)
    micro_steps = [
        {
            name: {f: v[step * BATCH : (step + 1) * BATCH] for f, v in features.items()}
            for name, features in columns.items()
        }
        for step in range(k)
    ]
    loss_fn = _splade_loss()
    results = {}
    for path in ("uncached", "sparse"):
        encoder = _encoder(config, dropout=False, bias_shift=0.3)
        total = torch.zeros(())
        for part in micro_steps:
            if path == "uncached":
                loss = uncached_loss(encoder, part, loss_fn)[0] / k
            else:
                loss = CachedLoss(encoder, loss_fn, mini_batch_size=3, sparse_reps=True)(part) / k
            loss.backward()
            total += loss.detach()
        results[path] = (total, grads_of(encoder))
    assert loss_fn.layouts[k:] == [{SparseReps}] * k  # the sparse path ran in every micro-step
    torch.testing.assert_close(results["sparse"][0], results["uncached"][0], rtol=RTOL, atol=0)
    assert_grads_close(results["sparse"][1], results["uncached"][1], rtol=RTOL)


def test_sparse_cached_loss_auto_follows_the_engine(config) -> None:
    """CachedLoss(sparse_reps="auto") hands the loss SparseReps when the first mini-batch is ~3% non-zero
    and dense reps at ~93%, as GradCache's "auto" decides, with the dense path's loss and gradients either
    way; under torch.no_grad() (evaluation) it computes the same loss and keeps no graph."""
    columns = _columns()
    for bias_shift, layout in ((0.3, SparseReps), (0.0, torch.Tensor)):
        loss_fn = _splade_loss()
        dense_loss, _, dense_grads = _cached(
            _encoder(config, dropout=False, bias_shift=bias_shift),
            columns,
            loss_fn,
            sparse_reps=False,
            mini_batch_size=4,
        )
        loss_fn.layouts.clear()
        encoder = _encoder(config, dropout=False, bias_shift=bias_shift)
        auto_loss, _, auto_grads = _cached(encoder, columns, loss_fn, sparse_reps="auto", mini_batch_size=4)
        with torch.no_grad():
            evaluated = CachedLoss(encoder, loss_fn, mini_batch_size=4, sparse_reps="auto")(columns)
        assert loss_fn.layouts == [{layout}, {layout}], bias_shift
        torch.testing.assert_close(auto_loss, dense_loss, rtol=RTOL, atol=0)
        assert_grads_close(auto_grads, dense_grads, rtol=RTOL)
        assert not evaluated.requires_grad
        torch.testing.assert_close(evaluated, dense_loss, rtol=RTOL, atol=0)


def _dense_only_loss(reps: Mapping[str, Any], **loss_kwargs: Any) -> torch.Tensor:
    """InfoNCE written for [B, V] tensors (`q @ d.T`), as a user would write it."""
    scores = reps["query"] @ reps["positive"].T
    return torch.nn.functional.cross_entropy(scores, torch.arange(len(scores)))


@pytest.mark.parametrize("sparse_reps", [True, "auto"])
def test_dense_loss_on_sparse_reps_is_an_error_naming_sparse_reps(config, sparse_reps) -> None:
    """A loss written for dense reps, handed SparseReps (sparse_reps true, or auto on sparse reps), fails with a
    TypeError naming sparse_reps and both ways out, the loss's own error chained."""
    encoder = _encoder(config, dropout=False, bias_shift=0.3)  # ~3% non-zero: 'auto' goes sparse
    cached = CachedLoss(encoder, _dense_only_loss, sparse_reps=sparse_reps, mini_batch_size=4)
    with pytest.raises(TypeError, match=r"sparse_reps='(true|auto)'") as raised:
        cached(_columns())
    message = str(raised.value)
    assert "accepts SparseReps" in message and "sparse_reps='false'" in message
    assert isinstance(raised.value.__cause__, AttributeError)
    assert (sparse_reps == "auto") == ("found this step's reps sparse enough" in message)


# ------------------------------------------------------------------------------------------- trainer


@pytest.fixture(scope="module")
def sample_rows() -> datasets.Dataset:
    """The first 32 rows of the shipped SciFact training sample (real text)."""
    return load_training_data(default_train_data_path()).select(range(32))


def _args(output_dir, **overrides: Any) -> CachedSpladeTrainingArguments:
    """The trainer comparison's arguments (SGD, fp32 on the CPU; trainer_helpers.trainer_args) at 16
    rows in mini-batches of 6, 6 and 4, one step per batch, without clipping: SGD without clipping moves
    parameters by lr x gradient, so a mis-scaled gradient shows (clipping to max_grad_norm would divide
    its scale out)."""
    values: dict[str, Any] = {
        "gradient_accumulation_steps": 1,
        "mini_batch_size": 6,
        "document_max_length": 24,
        "max_grad_norm": 0.0,
        "query_reg_weight": 1e-2,
        "doc_reg_weight": 1e-2,
        "reg_warmup_steps": 0,
        **overrides,
    }
    return trainer_args(output_dir, per_device_batch=16, **values)


def test_trainer_with_sparse_reps_matches_dense(tmp_path, tokenizer, sample_rows) -> None:
    """CachedSpladeTrainer with sparse_reps true (reps ~17% non-zero, mini-batches of 6 for 16 rows, SGD,
    2 steps): the loss sees SparseReps, and the parameters after the steps and the logged loss and
    components equal the run with sparse_reps false.

    Dropout off, as in tests/test_trainer.py: after step 1 the two runs' parameters differ by summation
    order (~4e-9), and with dropout on such a perturbation flipped a near-tie of the head's max-pool
    argmax in step 2 (measured: one vocabulary row's update off by 1.4e-6), a jump of the max itself,
    not of the sparse path; the dropout replay through the sparse path is checked in the CachedLoss
    tests above."""
    runs = {}
    for setting in ("false", "true"):
        model = trainer_model(tokenizer, dropout=0.0)
        with torch.no_grad():
            model.head.bias -= 0.25  # reps ~17% non-zero
        initial = {k: v.detach().clone() for k, v in model.named_parameters()}
        args = _args(tmp_path / setting, sparse_reps=setting)
        loss = _RecordingLoss(SpladeLoss(args.splade_loss_config()))
        trainer = CachedSpladeTrainer(
            model, args, train_dataset=sample_rows, processing_class=tokenizer, loss=loss
        )
        trainer.train()
        expected = SparseReps if setting == "true" else torch.Tensor
        assert loss.layouts and all(layouts == {expected} for layouts in loss.layouts), setting
        logs = [entry for entry in trainer.state.log_history if "nnz_doc" in entry]
        assert len(logs) == 2
        runs[setting] = ({k: v.detach().clone() for k, v in model.named_parameters()}, logs)
    (dense_params, dense_logs), (params, logs) = runs["false"], runs["true"]
    moved = max((dense_params[k] - initial[k]).abs().max().item() for k in initial)
    assert moved > 1e-4, f"parameters moved by at most {moved}: the comparison would be vacuous"
    for key, value in params.items():
        torch.testing.assert_close(
            value, dense_params[key], rtol=1e-5, atol=1e-7, msg=lambda m, k=key: f"{k}: {m}"
        )
    for entry, dense_entry in zip(logs, dense_logs, strict=True):
        for name in ("loss", "contrastive", "reg_query", "reg_doc", "nnz_query", "nnz_doc", "flops"):
            assert entry[name] == pytest.approx(dense_entry[name], rel=RTOL), name


def test_bad_sparse_reps_values_are_refused(tmp_path, capsys, monkeypatch, config) -> None:
    """sparse_reps other than false/true/auto (any case, or a YAML bool) is refused by the training
    arguments with one error naming it, by the CLI as one line before any model is built, and by
    CachedLoss; the accepted spellings are normalised to false/true/auto and reach the engine so; left
    unset it is false without max_memory and left to max_memory's plan (None) with it."""
    for value in ("yes", "1", 1, "none", "sparse"):
        with pytest.raises(ValueError, match=r"sparse_reps must be one of false, true, auto, got"):
            _args(tmp_path, sparse_reps=value)
    for value, normalised in ((True, "true"), ("False", "false"), ("AUTO", "auto")):
        args = _args(tmp_path, sparse_reps=value)
        assert args.sparse_reps == args.grad_cache_config(["query"]).sparse_reps == normalised
    for max_memory in ("none", "auto", "4GiB"):  # unset: the engine's to decide (max_memory's plan where set)
        args = _args(tmp_path, sparse_reps=None, max_memory=max_memory)
        assert args.sparse_reps is args.grad_cache_config(["query"]).sparse_reps is None
        assert (
            resolve_settings(
                args.grad_cache_config(["query"]), encoder_facts(torch.nn.Linear(2, 2))
            ).sparse_reps
            == "false"
        )

    def never_build_the_model(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the model was built: the bad argument should have been refused before")

    monkeypatch.setattr("gradcache_sparton.pipeline.build_encoder", never_build_the_model)
    argv = ["train", "--config_name", "bert-tiny", "--eval_beir", "none", "--use_cpu", "--sparse_reps", "yes"]
    assert main([*argv, "--output_dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("gradcache-sparton train: error: ") and "sparse_reps must be one of" in err, err
    assert "Traceback" not in err and err.count("\n") == 1, err

    with pytest.raises(ValueError, match="sparse_reps must be one of false, true, auto, got 'yes'"):
        CachedLoss(make_encoder(config), _splade_loss(), mini_batch_size=2, sparse_reps="yes")


def test_cli_help_documents_sparse_reps(capsys) -> None:
    """`gradcache-sparton train --help-all` lists --sparse_reps (an option the engine decides by itself) with
    its three values and what it trades off."""
    with pytest.raises(SystemExit) as exc:
        main(["train", "--help-all"])
    assert exc.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # help lines re-wrapped to one
    assert "--sparse_reps {false,true,auto}" in text
    assert "memory grows with the non-zeros" in text
