"""A trained query table's own learning rate: its parameters in one optimizer group of their own, at
``query_table_learning_rate`` (default ``learning_rate`` x ``QUERY_TABLE_LEARNING_RATE_SCALE``), for our
inference-free model and for a sentence-transformers ``Router`` with a ``SparseStaticEmbedding``.

The step test uses SGD without momentum or weight decay: a parameter moves by exactly its group's learning
rate times its gradient, so the table's and the encoder's steps tell their rates apart (fp32, rtol 1e-6: one
multiply and one subtract per entry).
"""

from __future__ import annotations

import pytest
import torch
from trainer_helpers import trainer_args, trainer_model, trainer_rows

from gradcache_sparton.arguments import QUERY_TABLE_LEARNING_RATE_SCALE, CachedSpladeTrainingArguments
from gradcache_sparton.modeling import InferenceFreeEncoder, QueryTable, query_table_parameters
from gradcache_sparton.trainer import CachedSpladeTrainer


def _inference_free(tokenizer, *, frozen: bool) -> InferenceFreeEncoder:
    weight = torch.rand(len(tokenizer), generator=torch.Generator().manual_seed(1)) + 0.5
    table = QueryTable(weight, special_token_ids=tokenizer.all_special_ids, frozen=frozen)
    return InferenceFreeEncoder.from_document_encoder(trainer_model(tokenizer), table)


def _groups(trainer: CachedSpladeTrainer) -> list[tuple[float, set[int]]]:
    return [
        (g["lr"], {id(p) for p in g["params"]})
        for g in trainer.create_optimizer().param_groups
        if g["params"]
    ]


@pytest.mark.parametrize("rate", [None, 0.05], ids=["default", "given"])
def test_table_has_its_own_group(tmp_path, tokenizer, rate) -> None:
    """The learned table's weight is in one group at the table rate; every other trainable tensor at learning_rate."""
    model = _inference_free(tokenizer, frozen=False)
    args = trainer_args(tmp_path, per_device_batch=8, query_table_learning_rate=rate)
    trainer = CachedSpladeTrainer(model, args, train_dataset=trainer_rows(), processing_class=tokenizer)
    expected = rate if rate is not None else args.learning_rate * QUERY_TABLE_LEARNING_RATE_SCALE
    table = {id(model.query_table.weight)}
    groups = _groups(trainer)
    assert [lr for lr, ids in groups if ids & table] == [expected]
    assert [ids for lr, ids in groups if ids & table] == [table]
    others = {id(p) for p in model.parameters() if p.requires_grad} - table
    assert set().union(*(ids for lr, ids in groups if lr == args.learning_rate)) == others


def test_frozen_table_adds_no_group(tmp_path, tokenizer) -> None:
    """A frozen table has no trainable parameter: the optimizer is the Trainer's own, every group at learning_rate."""
    model = _inference_free(tokenizer, frozen=True)
    args = trainer_args(tmp_path, per_device_batch=8, query_table_learning_rate=0.05)
    trainer = CachedSpladeTrainer(model, args, train_dataset=trainer_rows(), processing_class=tokenizer)
    assert query_table_parameters(model) == []
    assert {lr for lr, _ in _groups(trainer)} == {args.learning_rate}


def test_one_step_moves_table_by_its_rate(tmp_path, tokenizer) -> None:
    """After one SGD step the table moved by -table_rate x grad and the encoder by -learning_rate x grad."""
    model = _inference_free(tokenizer, frozen=False)
    args = trainer_args(
        tmp_path,
        per_device_batch=8,
        gradient_accumulation_steps=1,
        max_steps=1,
        query_table_learning_rate=0.5,
        weight_decay=0.0,
        lr_scheduler_type="constant",
        max_grad_norm=0.0,
    )
    trainer = CachedSpladeTrainer(model, args, train_dataset=trainer_rows(), processing_class=tokenizer)
    table, bias = model.query_table.weight, model.head.bias
    before = {"table": table.detach().clone(), "bias": bias.detach().clone()}
    grads = {}
    table.register_hook(lambda g: grads.__setitem__("table", grads.get("table", 0) + g))
    bias.register_hook(lambda g: grads.__setitem__("bias", grads.get("bias", 0) + g))
    trainer.train()
    assert float(grads["table"].abs().max()) > 0 and float(grads["bias"].abs().max()) > 0
    torch.testing.assert_close(table.detach(), before["table"] - 0.5 * grads["table"], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(bias.detach(), before["bias"] - 1e-3 * grads["bias"], rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("rate", [0.0, -1.0, float("inf"), True])
def test_bad_rate_is_refused(tmp_path, rate) -> None:
    """query_table_learning_rate must be a positive finite number: one ValueError naming it."""
    with pytest.raises(ValueError, match="query_table_learning_rate"):
        CachedSpladeTrainingArguments(output_dir=str(tmp_path), query_table_learning_rate=rate, use_cpu=True)
