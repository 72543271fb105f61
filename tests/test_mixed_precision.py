"""CachedSpladeTrainer on our own SpladeEncoder in mixed precision: accelerate's autocast forward, the
engine's replay under it, and fp16's GradScaler. (The sentence-transformers bridge's mixed-precision tests
are in test_sentence_transformers.py; bf16 on CUDA with compile and CUDA graphs in test_trainer.py.)"""

from __future__ import annotations

import pytest
import torch
from trainer_helpers import trainer_model

from gradcache_sparton.arguments import CachedSpladeTrainingArguments
from gradcache_sparton.data import default_train_data_path, load_training_data
from gradcache_sparton.trainer import CachedSpladeTrainer


@pytest.mark.slow
@pytest.mark.parametrize(
    ("device", "precision"),
    [("cpu", "bf16"), pytest.param("cuda", "fp16", marks=pytest.mark.gpu)],
)
def test_trainer_trains_a_splade_encoder_in_mixed_precision(tmp_path, tokenizer, device, precision) -> None:
    """bf16=True (CPU autocast) / fp16=True (CUDA, GradScaler): every forward of the head's input runs
    under the autocast dtype, Step (3) reproduces Step (1) (check_replay and reuse_argmax on, the
    defaults), the losses are finite and the steps are taken (fp16: or skipped with a lower scale)."""
    model = trainer_model(tokenizer)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    seen: list[torch.dtype | None] = []

    def record(*args: object) -> None:
        seen.append(torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None)

    model.model.cls.predictions.transform.register_forward_hook(record)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    args = CachedSpladeTrainingArguments(
        output_dir=str(tmp_path / "run"),
        per_device_train_batch_size=8,
        mini_batch_size=3,
        query_max_length=16,
        document_max_length=32,
        max_steps=3,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=device == "cpu",
        disable_tqdm=True,
        **{precision: True},
    )
    rows = load_training_data(default_train_data_path()).select(range(24))
    trainer = CachedSpladeTrainer(model, args, train_dataset=rows, processing_class=tokenizer)
    trainer.train()
    # Step (1) and Step (3) of 2 columns (query, positive) x 3 mini-batches, 3 steps: all under autocast;
    # on CUDA, max_memory's probe (the trainer's default, auto) adds its own forwards to the first step.
    steps = 2 * 2 * 3 * 3
    assert (len(seen) > steps if device == "cuda" else len(seen) == steps) and set(seen) == {dtype}, seen
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses))), losses
    assert all(torch.isfinite(p).all() for p in model.parameters())
    changed = any(not torch.equal(before[name], p.cpu()) for name, p in model.named_parameters())
    if precision == "fp16":
        scaler = trainer.accelerator.scaler
        assert scaler is not None and (changed or scaler.get_scale() < 2.0**16)
    else:
        assert changed
