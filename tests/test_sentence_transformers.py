"""sentence-transformers ``SparseEncoder`` models through the fused head, the engine and the trainer.

Every model is a tiny BERT built from a config and saved to a temporary folder (no hub). The
references are sentence-transformers' own: its forward (MLM logits, then ``SpladePooling``) and its
``SpladeLoss(SparseMultipleNegativesRankingLoss)``. Comparisons run in fp64, where the only
difference between the two paths is summation order (the head takes the vocabulary in chunks, the
decoder in one product): ~1e-16 relative per score, so 1e-10 leaves margin yet fails on any real
difference (a wrong bias, transform or mask moves reps by ~1e-2).
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from transformers import BertConfig

pytest.importorskip("sentence_transformers", reason="needs the sentence-transformers extra")

from engine_helpers import save_small_masked_lm
from sentence_transformers import SparseEncoder
from sentence_transformers.base.modules import Transformer
from sentence_transformers.sparse_encoder.losses import (
    FlopsLoss,
    SparseMultipleNegativesRankingLoss,
    SpladeLoss,
)
from sentence_transformers.sparse_encoder.modules import SpladePooling

from gradcache_sparton.engine import CachedLoss
from gradcache_sparton.integrations.sentence_transformers import (
    as_rep_encoder,
    from_sentence_transformers_columns,
    run_model_card,
    sentence_transformers_can_load,
    splade_loss_config_from,
    use_sparton_head,
    uses_sparton_head,
    write_sentence_transformers_files,
)
from gradcache_sparton.losses import SpladeLoss as OurSpladeLoss
from gradcache_sparton.modeling import SpladeEncoder

TOL = 1e-10  # fp64, see the module docstring

QUERIES = ["what causes rain", "sunny weather today", "who drove to work", "cells divide"]
POSITIVES = [
    "Rain forms when water vapour condenses into droplets heavy enough to fall.",
    "It is so sunny outside.",
    "He took the car to the office this morning.",
    "Mitosis is how a cell divides into two identical cells.",
]
NEGATIVES = ["A recipe for bread.", "Stock markets fell.", "The cat sleeps.", "Volcanoes erupt lava and ash."]


@pytest.fixture(scope="module")
def backbone_dir(tmp_path_factory) -> Path:
    """A tiny dropout-free BERT masked-LM and a 3,000-token WordPiece tokenizer, saved like a hub checkpoint
    (:func:`engine_helpers.save_small_masked_lm`)."""
    return save_small_masked_lm(tmp_path_factory.mktemp("bert"))


def sparse_encoder(path: Path, *, legacy: bool = False) -> SparseEncoder:
    """A SPLADE SparseEncoder over ``path``: fill-mask Transformer (or the legacy MLMTransformer) + max pooling."""
    kwargs = {"max_seq_length": 64, "model_kwargs": {"local_files_only": True}}
    if legacy:
        from sentence_transformers.sparse_encoder.modules import MLMTransformer

        transformer = MLMTransformer(str(path), _from_auto_load=True, **kwargs)
    else:
        transformer = Transformer(str(path), transformer_task="fill-mask", **kwargs)
    return SparseEncoder(modules=[transformer, SpladePooling("max")], device="cpu").to(torch.float64)


def features(model: SparseEncoder, texts: list[str]) -> dict[str, torch.Tensor]:
    return model.preprocess(texts)


def st_splade_loss(model: SparseEncoder, *, query_weight: float | None = 5e-3) -> SpladeLoss:
    return SpladeLoss(
        model,
        loss=SparseMultipleNegativesRankingLoss(model, scale=0.5),
        document_regularizer_weight=3e-3,
        query_regularizer_weight=query_weight,
    )


def param_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("legacy", [False, True], ids=["Transformer", "MLMTransformer"])
def test_converted_model_gives_sentence_transformers_reps(backbone_dir, legacy: bool) -> None:
    """After use_sparton_head the reps equal sentence-transformers' own forward; type and modules unchanged."""
    reference = sparse_encoder(backbone_dir, legacy=legacy)
    model = use_sparton_head(copy.deepcopy(reference))
    assert type(model) is SparseEncoder and uses_sparton_head(model) and not uses_sparton_head(reference)
    assert [type(m) for m in model.children()] == [type(m) for m in reference.children()]
    batch = features(reference, QUERIES + POSITIVES)
    expected = reference(dict(batch))["sentence_embedding"]
    actual = model(dict(batch))["sentence_embedding"]
    assert actual.dtype == torch.float64 and (expected > 0).any()
    torch.testing.assert_close(actual, expected, rtol=TOL, atol=TOL)
    torch.testing.assert_close(
        model.encode(POSITIVES, convert_to_tensor=True, convert_to_sparse_tensor=False),
        reference.encode(POSITIVES, convert_to_tensor=True, convert_to_sparse_tensor=False),
        rtol=TOL,
        atol=TOL,
    )
    assert use_sparton_head(model) is model  # idempotent


def test_converted_forward_never_forms_the_logits(backbone_dir) -> None:
    """The decoder (the [B, S, V] logits) never runs in the converted forward; it does in the original."""
    model = sparse_encoder(backbone_dir)
    calls = []
    model[0].auto_model.get_output_embeddings().register_forward_hook(lambda *args: calls.append(1))
    batch = features(model, QUERIES)
    model(dict(batch))
    assert calls == [1]
    use_sparton_head(model)
    model(dict(batch))
    assert calls == [1]


def test_cached_loss_matches_sentence_transformers_splade_loss(backbone_dir, tokenizer) -> None:
    """Our CachedLoss + mapped SpladeLoss on the converted model: loss and every gradient equal ST's SpladeLoss."""
    reference = sparse_encoder(backbone_dir).train()
    model = use_sparton_head(copy.deepcopy(reference))
    columns = [features(reference, texts) for texts in (QUERIES, POSITIVES, NEGATIVES)]

    st_loss = st_splade_loss(reference)
    expected = sum(st_loss([dict(c) for c in columns], labels=None).values())
    expected.backward()

    loss_fn = OurSpladeLoss(splade_loss_config_from(st_splade_loss(model)))
    named = {
        name: {k: v for k, v in column.items() if isinstance(v, torch.Tensor)}
        for name, column in zip(("query", "positive", "negative_1"), columns, strict=True)
    }
    actual = CachedLoss(as_rep_encoder(model), loss_fn, mini_batch_size=3)(named)
    actual.backward()

    torch.testing.assert_close(actual, expected, rtol=TOL, atol=TOL)
    expected_grads, actual_grads = param_grads(reference), param_grads(model)
    assert expected_grads.keys() == actual_grads.keys() and len(expected_grads) > 10
    for name, grad in expected_grads.items():
        torch.testing.assert_close(actual_grads[name], grad, rtol=1e-8, atol=TOL, msg=name)


def test_loss_mapping_refuses_what_has_no_counterpart(backbone_dir) -> None:
    """Non-dot similarities, a query FLOPS threshold and other base losses are refused; a document one maps."""
    model = sparse_encoder(backbone_dir)
    config = splade_loss_config_from(st_splade_loss(model, query_weight=None), reg_warmup_steps=5)
    assert (config.query_reg_weight, config.doc_reg_weight, config.temperature, config.reg_warmup_steps) == (
        0.0,
        3e-3,
        2.0,
        5,
    )
    from sentence_transformers import util

    cosine = SpladeLoss(
        model,
        loss=SparseMultipleNegativesRankingLoss(model, similarity_fct=util.cos_sim),
        document_regularizer_weight=1e-3,
    )
    with pytest.raises(ValueError, match="dot-product scores"):
        splade_loss_config_from(cosine)
    thresholded = SpladeLoss(
        model,
        loss=SparseMultipleNegativesRankingLoss(model),
        document_regularizer_weight=1e-3,
        document_regularizer=FlopsLoss(model, threshold=10.5),
    )
    assert splade_loss_config_from(thresholded).doc_reg_l0_threshold == 10  # l0 > 10.5 iff l0 > 10
    query_thresholded = SpladeLoss(
        model,
        loss=SparseMultipleNegativesRankingLoss(model),
        document_regularizer_weight=1e-3,
        query_regularizer_weight=1e-3,
        query_regularizer=FlopsLoss(model, threshold=10),
    )
    with pytest.raises(ValueError, match="without threshold"):
        splade_loss_config_from(query_thresholded)
    with pytest.raises(TypeError, match="SpladeLoss"):
        splade_loss_config_from(SparseMultipleNegativesRankingLoss(model))


def test_conversion_refuses_other_pipelines(backbone_dir) -> None:
    """Sum pooling, extra modules and non-SparseEncoders get one clear error; nothing changes (the log1p_relu
    activation converts: test_head_activation_models.py)."""
    model = sparse_encoder(backbone_dir)
    with pytest.raises(TypeError, match="SparseEncoder"):
        use_sparton_head(model[0])
    summed = SparseEncoder(modules=[model[0], SpladePooling("sum")], device="cpu")
    with pytest.raises(ValueError, match="max pooling"):
        use_sparton_head(summed)
    assert not uses_sparton_head(summed)
    with pytest.raises(ValueError, match="exactly a fill-mask Transformer"):
        use_sparton_head(SparseEncoder(modules=[model[0]], device="cpu"))
    with pytest.raises(ValueError, match="use_sparton_head"):
        as_rep_encoder(model)


def test_sentence_transformers_columns_are_renamed() -> None:
    """anchor/negative become query/negative_1; positional mode maps string columns in order; clashes are refused."""
    from datasets import Dataset

    named = Dataset.from_dict({"anchor": ["q"], "positive": ["p"], "negative": ["n"], "label": [1.0]})
    assert from_sentence_transformers_columns(named).column_names == [
        "query",
        "positive",
        "negative_1",
        "label",
    ]
    by_position = Dataset.from_dict({"question": ["q"], "answer": ["p"], "wrong": ["n"], "score": [0.5]})
    assert from_sentence_transformers_columns(by_position, positional=True).column_names == [
        "query",
        "positive",
        "negative_1",
        "score",
    ]
    ours = Dataset.from_dict({"query": ["q"], "positive": ["p"]})
    assert from_sentence_transformers_columns(ours, positional=True) is ours
    unnamed = Dataset.from_dict({"question": ["q"], "answer": ["p"]})
    assert from_sentence_transformers_columns(unnamed) is unnamed  # validation reports the missing columns
    with pytest.raises(ValueError, match="overwrite existing columns \\['negative_1'\\]"):
        from_sentence_transformers_columns(
            Dataset.from_dict({"anchor": ["q"], "positive": ["p"], "negative": ["n"], "negative_1": ["m"]})
        )
    with pytest.raises(ValueError, match="at least two string columns"):
        from_sentence_transformers_columns(Dataset.from_dict({"text": ["q"], "label": [1]}), positional=True)


@pytest.mark.slow
def test_trainer_trains_a_sparse_encoder_and_saves_its_format(backbone_dir, tmp_path) -> None:
    """CachedSpladeTrainer accepts a SparseEncoder, trains it, and saves a SparseEncoder with equal reps."""
    from datasets import Dataset
    from sentence_transformers.sparse_encoder.evaluation import SparseInformationRetrievalEvaluator

    from gradcache_sparton.arguments import CachedSpladeTrainingArguments
    from gradcache_sparton.evaluation import RetrievalEvalCallback
    from gradcache_sparton.trainer import CachedSpladeTrainer

    model = sparse_encoder(backbone_dir).to(torch.float32)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    # sentence-transformers' column names, read by position: anchor, positive, negative.
    rows = Dataset.from_dict({"anchor": QUERIES, "positive": POSITIVES, "negative": NEGATIVES})
    args = CachedSpladeTrainingArguments(
        output_dir=str(tmp_path / "run"),
        per_device_train_batch_size=4,
        per_device_eval_batch_size=4,
        mini_batch_size=2,
        max_steps=2,
        learning_rate=1e-3,
        query_reg_weight=1e-3,
        doc_reg_weight=1e-3,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        query_max_length=16,
        document_max_length=32,
    )
    trainer = CachedSpladeTrainer(
        model, args, train_dataset=rows, eval_dataset=rows, processing_class=model.tokenizer
    )
    assert trainer.eval_dataset.column_names == ["query", "positive", "negative_1"]
    ids = [str(i) for i in range(len(QUERIES))]
    evaluator = SparseInformationRetrievalEvaluator(
        queries=dict(zip(ids, QUERIES, strict=True)),
        corpus=dict(zip(ids, POSITIVES + NEGATIVES, strict=False)),
        relevant_docs={i: {i} for i in ids},
        name="tiny",
        write_csv=False,
    )
    trainer.add_callback(RetrievalEvalCallback(evaluator, trainer=trainer, eval_steps=2))
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "eval_tiny_dot_ndcg@10" in entry]
    assert len(logged) == 1 and 0.0 <= logged[0]["eval_tiny_dot_ndcg@10"] <= 1.0
    assert uses_sparton_head(model)
    assert any(not torch.equal(before[name], p) for name, p in model.named_parameters())
    trainer.save_model(str(tmp_path / "final"))

    assert "eval_loss" in trainer.evaluate()  # the loss on sentence-transformers' columns
    trained = {name: p.detach().clone() for name, p in model.named_parameters()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    trainer._load_from_checkpoint(str(tmp_path / "final"))  # what resuming and load_best_model_at_end run
    for name, p in model.named_parameters():
        torch.testing.assert_close(p, trained[name], rtol=0, atol=0, msg=name)
    loaded = SparseEncoder(str(tmp_path / "final"), device="cpu", local_files_only=True)
    assert type(loaded[0]) is type(model[0]) and type(loaded[1]) is SpladePooling
    model.eval()
    batch = features(model, QUERIES)
    torch.testing.assert_close(
        loaded(dict(batch))["sentence_embedding"], model(dict(batch))["sentence_embedding"], rtol=0, atol=0
    )


# ---------------------------------------------------------------------------------------------- our checkpoints out


def splade_encoder(tokenizer, *, special_token_ids=()) -> SpladeEncoder:
    """A tiny random-init SpladeEncoder (fp32, eval) with a non-zero decoder bias."""
    config = BertConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
    )
    torch.manual_seed(1)
    encoder = SpladeEncoder.from_config(config, special_token_ids=special_token_ids).eval()
    with torch.no_grad():
        encoder.model.cls.predictions.bias.normal_(0.0, 0.05)
    return encoder


def saved_for_sentence_transformers(encoder: SpladeEncoder, tokenizer, path: Path) -> Path:
    encoder.save_pretrained(path, tokenizer=tokenizer)
    write_sentence_transformers_files(path, encoder=encoder, max_seq_length=32)
    return path


def test_our_checkpoint_is_a_sparse_encoder_with_exactly_our_reps(tokenizer, tmp_path) -> None:
    """SparseEncoder(path) of our checkpoint: max_seq_length as trained, reps bit-identical to ours."""
    encoder = splade_encoder(tokenizer)
    path = saved_for_sentence_transformers(encoder, tokenizer, tmp_path / "ckpt")
    loaded = SparseEncoder(str(path), device="cpu", local_files_only=True)
    assert [type(m) for m in loaded.children()] == [Transformer, SpladePooling]
    assert loaded.max_seq_length == 32 and loaded.similarity_fn_name == "dot"
    batch = loaded.preprocess(QUERIES + POSITIVES)
    assert batch["input_ids"].shape[1] <= 32
    ours = encoder(**{k: v for k, v in batch.items() if isinstance(v, torch.Tensor)})
    theirs = loaded(dict(batch))["sentence_embedding"]
    assert (ours > 0).any()
    torch.testing.assert_close(theirs, ours, rtol=0, atol=0)
    card = (path / "README.md").read_text()
    assert "library_name: sentence-transformers" in card and "Maximum sequence length: 32" in card


def test_masked_special_tokens_load_exactly_or_are_refused(tokenizer, tmp_path) -> None:
    """With special_token_ids: plain SparseEncoder(path) refuses; with trust_remote_code the reps are exact."""
    encoder = splade_encoder(tokenizer, special_token_ids=tokenizer.all_special_ids)
    path = saved_for_sentence_transformers(encoder, tokenizer, tmp_path / "masked")
    with pytest.raises(ValueError, match="trust_remote_code"):
        SparseEncoder(str(path), device="cpu", local_files_only=True)
    loaded = SparseEncoder(str(path), device="cpu", local_files_only=True, trust_remote_code=True)
    batch = loaded.preprocess(QUERIES)
    features_only = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}
    ours = encoder(**features_only)
    unmasked = SpladeEncoder(encoder.model)(**features_only)
    assert not torch.equal(ours, unmasked)  # the masking matters for these inputs
    torch.testing.assert_close(loaded(dict(batch))["sentence_embedding"], ours, rtol=0, atol=0)
    use_sparton_head(loaded)  # the fused forward keeps the masking
    torch.testing.assert_close(loaded(dict(batch))["sentence_embedding"], ours, rtol=1e-6, atol=1e-6)


def test_writing_sentence_transformers_files_refuses_bad_input(tokenizer, tmp_path) -> None:
    """No tokenizer, no model or a max_seq_length beyond the positions: a clear error, nothing written."""
    encoder = splade_encoder(tokenizer)
    encoder.save_pretrained(tmp_path / "bare")
    with pytest.raises(ValueError, match="holds no tokenizer"):
        write_sentence_transformers_files(tmp_path / "bare", encoder=encoder, max_seq_length=32)
    with pytest.raises(ValueError, match="holds no saved model"):
        write_sentence_transformers_files(tmp_path / "none", encoder=encoder, max_seq_length=32)
    with pytest.raises(ValueError, match="exceeds the backbone's max_position_embeddings 64"):
        write_sentence_transformers_files(tmp_path / "bare", encoder=encoder, max_seq_length=512)
    prefixed = SpladeEncoder(encoder.model, prefix_length=1)
    assert not sentence_transformers_can_load(prefixed)
    with pytest.raises(ValueError, match="has no sentence-transformers equivalent"):
        write_sentence_transformers_files(tmp_path / "bare", encoder=prefixed, max_seq_length=32)
    assert not (tmp_path / "bare" / "modules.json").exists()


def test_run_model_card_names_base_model_data_settings_and_metrics(tokenizer) -> None:
    """The trainer's model card carries the base model, the data, the settings and the latest eval metrics."""
    from types import SimpleNamespace

    from datasets import Dataset

    encoder = splade_encoder(tokenizer)
    encoder.model.config._name_or_path = "org/tiny-bert"
    args = SimpleNamespace(
        world_size=2,
        per_device_train_batch_size=8,
        mini_batch_size=4,
        gradient_accumulation_steps=1,
        learning_rate=2e-5,
        query_max_length=16,
        document_max_length=48,
        bf16=True,
        fp16=False,
    )
    log_history = [{"eval_ndcg_at_10": 0.25, "eval_runtime": 3.0}, {"loss": 1.0}, {"eval_ndcg_at_10": 0.5}]
    trainer = SimpleNamespace(
        args=args,
        state=SimpleNamespace(global_step=100, log_history=log_history),
        loss="SpladeLoss(...)",
        train_dataset=Dataset.from_dict({"query": ["q"] * 3, "positive": ["p"] * 3}),
    )
    card = run_model_card(trainer, encoder)
    assert "base_model: org/tiny-bert" in card and "Base model: org/tiny-bert" in card
    assert "3 rows, columns ['query', 'positive']" in card
    assert "| global batch (rows per loss) | 16 |" in card and "| precision | bf16 |" in card
    assert "Maximum sequence length: 48 tokens" in card
    assert "| eval_ndcg_at_10 | 0.5000 |" in card and "eval_runtime" not in card


@pytest.mark.gpu
def test_cuda_converted_model_gives_sentence_transformers_reps(backbone_dir) -> None:
    """On CUDA (Triton head): fp32 and bf16-autocast reps of the converted model equal ST's own forward."""
    reference = sparse_encoder(backbone_dir).to(device="cuda", dtype=torch.float32)
    model = use_sparton_head(copy.deepcopy(reference))
    batch = {
        k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in features(reference, QUERIES).items()
    }
    with torch.no_grad():
        torch.testing.assert_close(
            model(dict(batch))["sentence_embedding"],
            reference(dict(batch))["sentence_embedding"],
            rtol=1e-5,
            atol=1e-5,
        )
        with torch.autocast("cuda", dtype=torch.bfloat16):
            ours, theirs = (m(dict(batch))["sentence_embedding"] for m in (model, reference))
    # ST rounds the logits to bf16 (2**-8 relative, ~0.01 absolute at worst); the head keeps them in fp32.
    torch.testing.assert_close(ours.float(), theirs.float(), rtol=0, atol=1.5e-2)


# ---------------------------------------------------------------------------------------------- mixed precision

# bf16's unit roundoff: 8 significand bits.
BF16_U = 2.0**-8


def _on(device: str, batch: dict) -> dict:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def _flat_grads(model: torch.nn.Module) -> torch.Tensor:
    """Every parameter gradient, in name order, as one fp64 vector on the CPU."""
    grads = [p.grad.reshape(-1) for _, p in sorted(model.named_parameters()) if p.grad is not None]
    return torch.cat(grads).double().cpu()


class _AutocastSeen:
    """A forward hook recording, per call, the autocast dtype in force on ``device`` (None when off)."""

    def __init__(self, module: torch.nn.Module, device: str) -> None:
        self.device, self.dtypes = device, []
        module.register_forward_hook(lambda *args: self.dtypes.append(self.dtype()))

    def dtype(self) -> torch.dtype | None:
        enabled = torch.is_autocast_enabled(self.device)
        return torch.get_autocast_dtype(self.device) if enabled else None


def test_converted_model_is_recognised_through_its_wrappers(backbone_dir) -> None:
    """A converted model stays recognised (and its view gives the fused reps) under accelerate's
    mixed-precision forward, torch.compile's wrapper, DataParallel and DDP; an unconverted one never is."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from torch.nn.parallel import DistributedDataParallel

    plain = sparse_encoder(backbone_dir).to(torch.float32)
    model = use_sparton_head(copy.deepcopy(plain))
    batch = features(model, QUERIES)
    with torch.no_grad():
        expected = model(dict(batch))["sentence_embedding"]
    # accelerate's process-wide state, which an earlier Trainer in this process may have set to fp32.
    AcceleratorState._reset_state(reset_partial_state=True)
    try:
        accelerator = Accelerator(mixed_precision="bf16", cpu=True)
        prepared, unconverted = (
            accelerator.prepare_model(model),
            accelerator.prepare_model(copy.deepcopy(plain)),
        )
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    assert prepared is model and hasattr(model.forward, "__wrapped__")  # accelerate wrapped the forward
    seen = _AutocastSeen(model[0].auto_model.cls.predictions.transform, "cpu")
    with torch.no_grad():
        reps = as_rep_encoder(prepared)(**{k: v for k, v in batch.items() if isinstance(v, torch.Tensor)})
    assert seen.dtypes == [torch.bfloat16] and reps.dtype == torch.float32  # autocast inside, fp32 out
    # bf16 hidden states and decoder (2**-8 relative each) move the fp32-accumulated logits by ~1e-2.
    torch.testing.assert_close(reps, expected, rtol=0, atol=4e-2)
    assert uses_sparton_head(prepared) and not uses_sparton_head(unconverted)
    for wrap in (lambda m: torch.compile(m, backend="eager"), torch.nn.DataParallel):
        assert uses_sparton_head(wrap(model)) and not uses_sparton_head(wrap(plain))
        as_rep_encoder(wrap(model))
        with pytest.raises(ValueError, match="converted with use_sparton_head"):
            as_rep_encoder(wrap(plain))
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    try:
        assert uses_sparton_head(DistributedDataParallel(model))
        assert not uses_sparton_head(DistributedDataParallel(plain))
    finally:
        dist.destroy_process_group()


def test_data_parallel_replicas_run_their_own_weights(backbone_dir) -> None:
    """nn.DataParallel's replicas of a converted model (plain, and under accelerate's bf16 forward) call the
    fused forward on themselves, not on the original: a replica whose weights differ gives its own reps."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    model = use_sparton_head(sparse_encoder(backbone_dir).to(torch.float32))
    batch = {k: v for k, v in features(model, QUERIES).items() if isinstance(v, torch.Tensor)}
    AcceleratorState._reset_state(reset_partial_state=True)
    try:
        wrapped = Accelerator(mixed_precision="bf16", cpu=True).prepare_model(
            use_sparton_head(sparse_encoder(backbone_dir).to(torch.float32))
        )
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    for original in (model, wrapped):
        replica = original._replicate_for_data_parallel()
        assert replica.forward.__self__ is replica and uses_sparton_head(replica)
        # DataParallel gives each replica its own parameter tensors, plain tensors in each module's
        # _parameters as torch's replicate() leaves them (not nn.Parameter): here, a changed decoder bias.
        replica._modules = {name: copy.deepcopy(module) for name, module in original._modules.items()}
        for module in replica.modules():
            for name, parameter in module._parameters.items():
                if parameter is not None:
                    module._parameters[name] = parameter.detach().clone().requires_grad_()
        replica[0].auto_model.get_output_embeddings().bias.data += 5.0
        with torch.no_grad():
            ours, theirs = (
                replica(dict(batch))["sentence_embedding"],
                original(dict(batch))["sentence_embedding"],
            )
        assert (ours - theirs).abs().max() > 1.0


def test_data_parallel_replicas_keep_the_callers_autocast_dtype(backbone_dir) -> None:
    """A DataParallel replica of a converted model, run in a thread of its own with autocast re-entered
    without a dtype (as parallel_apply does), computes in the dtype of the thread that replicated it, not in
    that thread's default (the GPU acceptance run's bf16 trainer on 2 GPUs computed in fp16)."""
    import threading

    model = use_sparton_head(sparse_encoder(backbone_dir).to(torch.float32))
    batch = {k: v for k, v in features(model, QUERIES).items() if isinstance(v, torch.Tensor)}
    with torch.autocast("cpu", dtype=torch.float16):  # the caller's dtype, not the CPU default (bf16)
        replica = model._replicate_for_data_parallel()
    seen = _AutocastSeen(model[0].auto_model.cls.predictions.transform, "cpu")  # the replica shares it
    failures = []

    def replica_thread() -> None:
        try:
            with torch.no_grad(), torch.autocast("cpu", enabled=True):
                replica(dict(batch))
        except Exception as exc:  # re-raised in the test's thread
            failures.append(exc)

    thread = threading.Thread(target=replica_thread)
    thread.start()
    thread.join()
    assert not failures, failures
    assert seen.dtypes == [torch.float16]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_cached_bf16_gradients_match_sentence_transformers_splade_loss(backbone_dir, device: str) -> None:
    """Under bf16 autocast, our cached loss on the converted model gives sentence-transformers' own
    (uncached) SpladeLoss gradients within bf16 noise, measured against the exact (fp64) gradient.

    Tolerance: first-order, a gradient computed with n bf16-rounded tensor ops on its path is off by at
    most n·u (u = 2**-8) norm-wise. A 2-layer BERT's longest path is 6 matmuls per layer forward, 12
    backward, plus the LM transform and head (~4 each way): n = 2·18 + 8 = 44, so 44u = 0.17. Ours
    must also be no farther from the exact gradient than sentence-transformers' own bf16 path (which
    also rounds the [B, S, V] logits and the scores to bf16), hence within twice its error of it.
    A wrong scale, a dropped column or a gradient sent to the wrong token is off by O(1).
    """
    exact_model = sparse_encoder(backbone_dir).train()  # fp64, dropout-free
    columns = [features(exact_model, texts) for texts in (QUERIES, POSITIVES, NEGATIVES)]

    def st_step(model: SparseEncoder, autocast: bool, on: str) -> torch.Tensor:
        with torch.autocast(on, dtype=torch.bfloat16, enabled=autocast):
            loss = sum(st_splade_loss(model)([_on(on, c) for c in columns], labels=None).values())
        loss.backward()
        return loss.detach().double().cpu()

    exact_loss = st_step(exact_model, False, "cpu")
    exact = _flat_grads(exact_model)
    theirs_model = copy.deepcopy(exact_model).to(device=device, dtype=torch.float32)
    theirs_loss = st_step(theirs_model, True, device)
    theirs = _flat_grads(theirs_model)

    ours_model = use_sparton_head(copy.deepcopy(exact_model).to(device=device, dtype=torch.float32))
    loss_fn = OurSpladeLoss(splade_loss_config_from(st_splade_loss(ours_model)))
    named = {
        name: {k: v for k, v in _on(device, column).items() if isinstance(v, torch.Tensor)}
        for name, column in zip(("query", "positive", "negative_1"), columns, strict=True)
    }
    with torch.autocast(device, dtype=torch.bfloat16):
        ours_loss = CachedLoss(as_rep_encoder(ours_model), loss_fn, mini_batch_size=3, reuse_argmax=True)(
            named
        )
    ours_loss.backward()
    ours = _flat_grads(ours_model)

    scale = exact.norm()
    ours_error, theirs_error = (ours - exact).norm() / scale, (theirs - exact).norm() / scale
    assert ours_error <= 44 * BF16_U, (ours_error, theirs_error)
    assert ours_error <= theirs_error, (ours_error, theirs_error)
    assert (ours - theirs).norm() / scale <= 2 * theirs_error
    for loss in (ours_loss.detach().double().cpu(), theirs_loss):
        torch.testing.assert_close(loss, exact_loss, rtol=44 * BF16_U, atol=0)


def _rows_for(model: SparseEncoder):
    from datasets import Dataset

    return Dataset.from_dict({"anchor": QUERIES, "positive": POSITIVES, "negative": NEGATIVES})


@pytest.mark.slow
@pytest.mark.parametrize(
    ("device", "precision", "compiled"),
    [
        ("cpu", "bf16", False),
        pytest.param("cuda", "bf16", False, marks=pytest.mark.gpu),
        pytest.param("cuda", "fp16", False, marks=pytest.mark.gpu),
        pytest.param("cuda", "bf16", True, marks=pytest.mark.gpu),
    ],
)
def test_trainer_trains_a_sparse_encoder_in_mixed_precision(
    backbone_dir, tmp_path, device: str, precision: str, compiled: bool
) -> None:
    """CachedSpladeTrainer on a SparseEncoder with bf16=True / fp16=True (accelerate wraps its forward),
    also under the Trainer's torch_compile: recognised, the fused head runs under autocast (never the
    decoder), the steps are taken (fp16: by its GradScaler)."""
    from gradcache_sparton.arguments import CachedSpladeTrainingArguments
    from gradcache_sparton.trainer import CachedSpladeTrainer

    model = sparse_encoder(backbone_dir).to(torch.float32)
    decoder_calls = []
    model[0].auto_model.get_output_embeddings().register_forward_hook(lambda *args: decoder_calls.append(1))
    # Not under compile: a hook appending to a list inside the traced program makes it recompile.
    seen = None if compiled else _AutocastSeen(model[0].auto_model.cls.predictions.transform, device)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    args = CachedSpladeTrainingArguments(
        output_dir=str(tmp_path / "run"),
        per_device_train_batch_size=4,
        mini_batch_size=2,
        max_steps=3,
        learning_rate=1e-3,
        save_strategy="no",
        report_to="none",
        use_cpu=device == "cpu",
        disable_tqdm=True,
        query_max_length=16,
        document_max_length=32,
        logging_steps=1,
        torch_compile=compiled,
        **{precision: True},
    )
    trainer = CachedSpladeTrainer(
        model, args, train_dataset=_rows_for(model), processing_class=model.tokenizer
    )
    trainer.train()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    assert not decoder_calls
    if seen is not None:
        assert seen.dtypes and set(seen.dtypes) == {dtype}
    assert uses_sparton_head(model)
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses))), losses
    assert all(torch.isfinite(p).all() for p in model.parameters())
    changed = any(not torch.equal(before[name], p.cpu()) for name, p in model.named_parameters())
    scaler = trainer.accelerator.scaler
    if precision == "fp16":  # the GradScaler takes the step, or skips it and lowers its scale
        assert scaler is not None and (changed or scaler.get_scale() < 2.0**16)
    else:
        assert changed


@pytest.mark.slow
@pytest.mark.parametrize(
    ("device", "loss_name"),
    [
        ("cpu", "SpladeLoss"),
        ("cpu", "CachedSpladeLoss"),
        pytest.param("cuda", "SpladeLoss", marks=pytest.mark.gpu),
    ],
)
def test_sentence_transformers_trainer_trains_a_converted_model_in_bf16(
    backbone_dir, tmp_path, device: str, loss_name: str
) -> None:
    """sentence-transformers' own SparseEncoderTrainer with bf16=True, its SpladeLoss (or CachedSpladeLoss)
    on a converted model: the fused head runs under bf16 autocast (on one device; under the DataParallel the
    trainer picks for several GPUs transformers applies none), never the decoder, and it trains."""
    from sentence_transformers import SparseEncoderTrainer, SparseEncoderTrainingArguments
    from sentence_transformers.sparse_encoder import losses as st_losses

    model = use_sparton_head(sparse_encoder(backbone_dir).to(torch.float32))
    decoder_calls = []
    model[0].auto_model.get_output_embeddings().register_forward_hook(lambda *args: decoder_calls.append(1))
    seen = _AutocastSeen(model[0].auto_model.cls.predictions.transform, device)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    base = SparseMultipleNegativesRankingLoss(model, scale=0.5)
    extra = {"mini_batch_size": 2} if loss_name == "CachedSpladeLoss" else {}
    loss = getattr(st_losses, loss_name)(
        model, loss=base, document_regularizer_weight=3e-3, query_regularizer_weight=5e-3, **extra
    )
    args = SparseEncoderTrainingArguments(
        output_dir=str(tmp_path / "st"),
        per_device_train_batch_size=4,
        max_steps=2,
        learning_rate=1e-3,
        bf16=True,
        use_cpu=device == "cpu",
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
    )
    trainer = SparseEncoderTrainer(model=model, args=args, train_dataset=_rows_for(model), loss=loss)
    trainer.train()
    # With several GPUs visible the trainer wraps the model in nn.DataParallel, and transformers' Trainer then
    # skips accelerate's preparation, where autocast is applied: no autocast on that path, for any model.
    expected = {torch.bfloat16} if args.n_gpu <= 1 else {None}
    assert seen.dtypes and set(seen.dtypes) == expected and not decoder_calls
    assert uses_sparton_head(model)
    assert any(not torch.equal(before[name], p.cpu()) for name, p in model.named_parameters())


def test_trainer_refuses_what_fails_at_the_first_step_of_a_sparse_encoder(backbone_dir, tmp_path) -> None:
    """At construction, before any step: a sentence-transformers SpladeLoss not mapped (TypeError naming
    splade_loss_config_from), a document_max_length past the backbone's 128 positions (the default 256), and a
    numeric `score` column that the default InfoNCE loss does not read (naming the column)."""
    from datasets import Dataset

    from gradcache_sparton.arguments import CachedSpladeTrainingArguments
    from gradcache_sparton.trainer import CachedSpladeTrainer

    model = sparse_encoder(backbone_dir).to(torch.float32)
    rows = Dataset.from_dict({"anchor": QUERIES, "positive": POSITIVES})
    common = dict(
        output_dir=str(tmp_path / "run"),
        use_cpu=True,
        report_to="none",
        query_max_length=16,
        per_device_train_batch_size=4,
    )
    args = CachedSpladeTrainingArguments(**common, document_max_length=32)
    with pytest.raises(TypeError, match="splade_loss_config_from"):
        CachedSpladeTrainer(
            model, args, train_dataset=rows, processing_class=model.tokenizer, loss=st_splade_loss(model)
        )
    with pytest.raises(ValueError, match=r"document_max_length=256 .* holds 128"):
        CachedSpladeTrainer(
            model,
            CachedSpladeTrainingArguments(**common),
            train_dataset=rows,
            processing_class=model.tokenizer,
        )
    scored = rows.add_column("score", [1.0, 0.5, 0.2, 0.9])
    with pytest.raises(ValueError, match=r"\['score'\].*contrastive='infonce'.*remove_columns"):
        CachedSpladeTrainer(model, args, train_dataset=scored, processing_class=model.tokenizer)
    CachedSpladeTrainer(model, args, train_dataset=rows, processing_class=model.tokenizer)
