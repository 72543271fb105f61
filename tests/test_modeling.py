"""SpladeEncoder: equal to the plain PyTorch SPLADE computation per backbone family, forward and gradients;
saved as a standard masked-LM checkpoint; clear errors on bad input.

Legend: B batch, S sequence, D hidden, V vocabulary.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from torch import Tensor
from transformers import (
    AlbertConfig,
    AlbertForMaskedLM,
    AutoModelForMaskedLM,
    AutoTokenizer,
    BertConfig,
    BertModel,
    DistilBertConfig,
    GPT2Config,
    ModernBertConfig,
    PreTrainedConfig,
    PreTrainedModel,
    RobertaConfig,
    XLMRobertaConfig,
)

from gradcache_sparton.kernels import sparton_head_reference, splade_max_pool
from gradcache_sparton.modeling import SPLADE_CONFIG_NAME, SpladeEncoder, supported_masked_lm_classes

# V is prime and different per family, so no size coincidence (or multiple of a tile) hides a bug.
FAMILIES: dict[str, tuple[type[PreTrainedConfig], dict]] = {
    "bert": (
        BertConfig,
        dict(
            vocab_size=401, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64
        ),
    ),
    "distilbert": (
        DistilBertConfig,
        dict(vocab_size=409, dim=32, n_layers=2, n_heads=2, hidden_dim=64),
    ),
    "roberta": (
        RobertaConfig,
        dict(
            vocab_size=419, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64
        ),
    ),
    "xlm-roberta": (
        XLMRobertaConfig,
        dict(
            vocab_size=421, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64
        ),
    ),
    # Special ids inside V (the defaults are ModernBERT's 50k-vocabulary ones); local attention
    # narrower than S = 13, so the sliding-window layers differ from the global ones.
    "modernbert": (
        ModernBertConfig,
        dict(
            vocab_size=431,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            global_attn_every_n_layers=2,
            local_attention=4,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            cls_token_id=1,
            sep_token_id=2,
        ),
    ),
}

# fp32 throughout. The head reduces chunked [B, S, C] matmuls, the reference a full nn.Linear: the
# sums differ only in rounding order, ~1e-7 relative over D = 32. 1e-5 leaves 100x headroom yet is far
# below what a wrong bias (values ~0.1), a missing activation or LayerNorm would shift (>1e-2).
REP_TOL = dict(rtol=1e-5, atol=1e-5)
# Gradients go back through 2 transformer layers; the head's and the reference's paths round
# differently, so allow 1e-4 relative (still orders of magnitude below a wrong-argmax or wrong-bias error).
GRAD_TOL = dict(rtol=1e-4, atol=1e-5)


def tiny_mlm(family: str, **overrides) -> PreTrainedModel:
    """A seeded random-init tiny masked-LM of ``family`` with every parameter perturbed.

    Random init leaves biases at 0 and LayerNorms at identity; perturbing every parameter (tied ones once,
    since ``parameters()`` deduplicates) makes a dropped bias or LayerNorm visible in the reps.
    """
    config_class, kwargs = FAMILIES[family]
    config = config_class(max_position_embeddings=64, **kwargs, **overrides)
    torch.manual_seed(0)
    model = AutoModelForMaskedLM.from_config(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def padded_batch(model: PreTrainedModel, *, with_token_types: bool = False) -> dict[str, Tensor]:
    """B = 3, S = 13 random ids with right padding (row lengths 13, 8, 3), pads set to the pad id."""
    V = model.config.vocab_size
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    g = torch.Generator().manual_seed(1)
    input_ids = torch.randint(3, V, (3, 13), generator=g)  # [B, S]
    attention_mask = torch.zeros(3, 13, dtype=torch.long)  # [B, S]
    for row, length in enumerate((13, 8, 3)):
        attention_mask[row, :length] = 1
    input_ids = input_ids.masked_fill(attention_mask == 0, pad)
    features = {"input_ids": input_ids, "attention_mask": attention_mask}
    if with_token_types:
        features["token_type_ids"] = torch.randint(0, 2, (3, 13), generator=g) * attention_mask
    return features


def plain_splade(model: PreTrainedModel, features: dict[str, Tensor], mask: Tensor | None = None) -> Tensor:
    """The plain SPLADE computation: the masked-LM's own full logits, log1p(relu(.)), mask, max over S."""
    logits = model(**features).logits  # [B, S, V]
    mask = features["attention_mask"] if mask is None else mask  # [B, S]
    return splade_max_pool(logits, mask)  # [B, S, V] -> [B, V]


def param_grads(model: torch.nn.Module) -> dict[str, Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@contextmanager
def transformers_warnings() -> Iterator[list[logging.LogRecord]]:
    """Collect WARNING-and-above records from the ``transformers`` loggers (they do not propagate)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(level=logging.WARNING)
    handler.emit = records.append
    logger = logging.getLogger("transformers")
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_reps_and_grads_match_plain_splade(family: str) -> None:
    """Reps and every parameter gradient equal autograd through full logits -> log1p(relu) -> mask -> max."""
    model = tiny_mlm(family)
    encoder = SpladeEncoder(model)
    features = padded_batch(model, with_token_types=family == "bert")
    reps = encoder(**features)  # [B, V]
    assert reps.shape == (3, model.config.vocab_size)
    # Enough active entries that a wrong max position or bias shows up in many places.
    assert (reps > 0).float().mean() > 0.2
    weights = torch.randn_like(reps)
    (reps * weights).sum().backward()
    ours = param_grads(model)
    model.zero_grad(set_to_none=True)

    expected = plain_splade(model, features)
    torch.testing.assert_close(reps, expected, **REP_TOL)
    (expected * weights).sum().backward()
    theirs = param_grads(model)
    assert ours.keys() == theirs.keys() and len(ours) == len(list(model.parameters()))
    for name in theirs:
        torch.testing.assert_close(ours[name], theirs[name], **GRAD_TOL, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.gpu
@pytest.mark.parametrize("family", list(FAMILIES))
def test_cuda_reps_and_grads_match_plain_splade(family: str) -> None:
    """On CUDA (Triton head): fp32 reps and grads, and bf16-autocast reps, equal the plain computation."""
    model = tiny_mlm(family).cuda()
    encoder = SpladeEncoder(model)
    features = {k: v.cuda() for k, v in padded_batch(model).items()}
    reps = encoder(**features)  # [B, V]
    weights = torch.randn_like(reps)
    (reps * weights).sum().backward()
    ours = param_grads(model)
    model.zero_grad(set_to_none=True)
    expected = plain_splade(model, features)
    torch.testing.assert_close(reps, expected, **REP_TOL)
    (expected * weights).sum().backward()
    theirs = param_grads(model)
    # Measured on an H100: worst gradient error 3e-7 of the largest gradient (~40); 1e-5 of it leaves
    # 30x headroom, far below the O(1) relative error of a gradient sent to the wrong position.
    scale = max(g.abs().max().item() for g in theirs.values())
    for name in theirs:
        torch.testing.assert_close(ours[name], theirs[name], rtol=1e-4, atol=1e-5 * scale)
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        reps16 = encoder(**features)
        expected16 = plain_splade(model, features)
    assert reps16.dtype == torch.bfloat16
    # The plain path rounds logits (up to ~3 here) to bf16, 2**-8 relative, ~0.01 absolute at worst
    # (measured 0.003); the head keeps them in fp32 and rounds only Y. Gradients are not compared in
    # bf16: rounded logits tie or swap near-equal maxima, moving a gradient to another position.
    torch.testing.assert_close(reps16.float(), expected16.float(), rtol=0, atol=1.5e-2)


@pytest.mark.parametrize("family", ["bert", "distilbert", "roberta", "xlm-roberta"])
def test_encoder_mask_is_never_read_on_the_host(family: str, monkeypatch) -> None:
    """Under sdpa the encoder hands these backbones a 4-D mask, so transformers never tests the padding
    mask's values on the host (``padding_mask.all()``: a device sync per call on a GPU); the reps are
    still the plain computation's (above, per family)."""
    import transformers.masking_utils as masking_utils

    def host_read(*args, **kwargs):
        raise AssertionError("transformers read the padding mask on the host")

    model = tiny_mlm(family)
    assert model.config._attn_implementation == "sdpa"
    features = padded_batch(model)
    with monkeypatch.context() as patch:  # the check fires on the 2-D path the model takes by itself
        patch.setattr(masking_utils, "_ignore_bidirectional_mask_sdpa", host_read)
        with pytest.raises(AssertionError, match="on the host"), torch.no_grad():
            model(**features)
        with torch.no_grad():
            reps = SpladeEncoder(model)(**features)
    with torch.no_grad():
        torch.testing.assert_close(reps, plain_splade(model, features), **REP_TOL)


@pytest.mark.parametrize("family", ["bert", "roberta"])
def test_head_uses_the_bias_the_logits_use(family: str) -> None:
    """Untied, the family keeps two bias vectors; reps follow the decoder's, as the logits do."""
    model = tiny_mlm(family, tie_word_embeddings=False)
    decoder = model.get_output_embeddings()
    other_bias = model.cls.predictions.bias if family == "bert" else model.lm_head.bias
    assert other_bias is not decoder.bias and not torch.equal(other_bias, decoder.bias)
    encoder = SpladeEncoder(model)
    features = padded_batch(model)
    with torch.no_grad():
        expected = plain_splade(model, features)
        torch.testing.assert_close(encoder(**features), expected, **REP_TOL)
        # The comparison is sensitive to the bias: the head fed the other bias (or none) fails it.
        hidden = encoder.token_hidden_states(**features)  # [B, S, D]
        for wrong in (other_bias, None):
            wrong_reps = sparton_head_reference(hidden, decoder.weight, wrong, features["attention_mask"])
            assert not torch.allclose(wrong_reps, expected, **REP_TOL)


def test_special_token_positions_are_masked() -> None:
    """special_token_ids drop those positions from the max: reps equal the plain computation on that mask."""
    model = tiny_mlm("bert")
    features = padded_batch(model)
    cls_id, sep_id = 5, 7
    features["input_ids"][:, 0] = cls_id
    features["input_ids"][torch.arange(3), features["attention_mask"].sum(1) - 1] = sep_id
    encoder = SpladeEncoder(model, special_token_ids=[sep_id, cls_id, 0])
    assert encoder.special_token_ids == (0, cls_id, sep_id)
    keep = features["attention_mask"] * ~torch.isin(features["input_ids"], torch.tensor([0, cls_id, sep_id]))
    with torch.no_grad():
        reps = encoder(**features)
        torch.testing.assert_close(reps, plain_splade(model, features, mask=keep), **REP_TOL)
        # ... and that differs from the unmasked reps, so the option is not a no-op.
        assert not torch.allclose(reps, SpladeEncoder(model)(**features), **REP_TOL)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_save_reload_is_a_standard_masked_lm(family: str, tmp_path: Path) -> None:
    """save_pretrained writes one [V, D] matrix; AutoModelForMaskedLM loads it cleanly; reps are identical."""
    model = tiny_mlm(family)
    encoder = SpladeEncoder(model, special_token_ids=[1, 2])
    features = padded_batch(model)
    with torch.no_grad():
        reps = encoder(**features)
    # The Trainer's call shape: an encoder state dict (with the head's aliases) and safe_serialization.
    for directory, kwargs in (
        (tmp_path / "plain", {}),
        (tmp_path / "trainer", dict(state_dict=encoder.state_dict(), safe_serialization=True)),
    ):
        encoder.save_pretrained(directory, **kwargs)
        V, D = model.get_output_embeddings().weight.shape
        with safe_open(directory / "model.safetensors", framework="pt") as f:
            shapes = {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}  # noqa: SIM118
        # The input embeddings: word_embeddings in BERT-style families, tok_embeddings in ModernBERT.
        embeddings = [k for k in shapes if k.endswith(("word_embeddings.weight", "tok_embeddings.weight"))]
        assert [k for k, s in shapes.items() if s == (V, D)] == embeddings
        assert len([s for s in shapes.values() if s == (V, D)]) == 1
        # Only the backbone's own keys: no encoder prefix, no head.* alias (ModernBERT's own keys do
        # start with "model." and "head.", so compare with the backbone's state dict).
        assert set(shapes) <= set(model.state_dict())
        assert json.loads((directory / SPLADE_CONFIG_NAME).read_text()) == {
            "pooling": "max",
            "special_token_ids": [1, 2],
            "query_encoder": "splade",
        }

        with transformers_warnings() as warned:
            reloaded, info = AutoModelForMaskedLM.from_pretrained(directory, output_loading_info=True)
        assert type(reloaded) is type(model)
        assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
        assert not warned, [r.getMessage() for r in warned]
        reloaded.eval()
        rewrapped = SpladeEncoder.from_pretrained(directory).eval()
        assert rewrapped.special_token_ids == (1, 2)
        with torch.no_grad():
            assert torch.equal(SpladeEncoder(reloaded, special_token_ids=[1, 2])(**features), reps)
            assert torch.equal(rewrapped(**features), reps)
            keep = features["attention_mask"] * ~torch.isin(features["input_ids"], torch.tensor([1, 2]))
            torch.testing.assert_close(plain_splade(reloaded, features, mask=keep), reps, **REP_TOL)


def test_save_with_tokenizer_round_trips(tiny_bert_mlm, tokenizer, tmp_path: Path) -> None:
    """The tokenizer is saved alongside, reloads to the same vocabulary, and tokenised reps survive reload."""
    encoder = SpladeEncoder(tiny_bert_mlm)
    encoder.save_pretrained(tmp_path, tokenizer=tokenizer)
    reloaded_tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    assert reloaded_tokenizer.get_vocab() == tokenizer.get_vocab()
    batch = tokenizer(
        ["sparse retrieval", "a longer document about proteins"], padding=True, return_tensors="pt"
    )
    with torch.no_grad():
        reps = encoder(**batch)
        rewrapped = SpladeEncoder.from_pretrained(tmp_path).eval()
        rewrapped.check_tokenizer(reloaded_tokenizer)
        assert torch.equal(rewrapped(**batch), reps)


def test_from_config_and_pretrained_overrides(tmp_path: Path) -> None:
    """from_config builds a random-init encoder; explicit from_pretrained options override the sidecar."""
    config_class, kwargs = FAMILIES["distilbert"]
    encoder = SpladeEncoder.from_config(config_class(**kwargs), special_token_ids=[3])
    assert encoder.vocab_size == kwargs["vocab_size"] and encoder.config.dim == 32
    assert encoder.special_token_ids == (3,)
    encoder.save_pretrained(tmp_path)
    assert SpladeEncoder.from_pretrained(tmp_path, special_token_ids=[]).special_token_ids == ()
    # A standard checkpoint with no sidecar gets the defaults: max pooling, no masked ids.
    encoder.model.save_pretrained(tmp_path / "plain")
    plain = SpladeEncoder.from_pretrained(tmp_path / "plain")
    assert plain.pooling == "max" and plain.special_token_ids == ()


def test_no_copy_of_the_vocabulary_matrix() -> None:
    """The head shares the decoder's weight and bias, which are the input embeddings' and the MLM bias."""
    model = tiny_mlm("roberta")
    encoder = SpladeEncoder(model)
    assert encoder.head.weight is model.get_input_embeddings().weight
    assert encoder.head.bias is model.lm_head.bias is model.get_output_embeddings().bias
    assert sum(p.numel() for p in encoder.parameters()) == sum(p.numel() for p in model.parameters())


def test_stale_head_is_refused_until_retied() -> None:
    """A replaced decoder makes forward raise rather than use stale weights; tie_weights() re-ties."""
    model = tiny_mlm("bert")
    encoder = SpladeEncoder(model)
    features = padded_batch(model)
    D, V = model.config.hidden_size, model.config.vocab_size
    model.set_output_embeddings(torch.nn.Linear(D, V))
    with pytest.raises(RuntimeError, match="tie_weights"):
        encoder(**features)
    encoder.tie_weights()
    assert encoder.head.weight is model.get_input_embeddings().weight
    with torch.no_grad():
        torch.testing.assert_close(encoder(**features), plain_splade(model, features), **REP_TOL)


def test_gradient_checkpointing_passthrough() -> None:
    """gradient_checkpointing_enable makes the backbone recompute its layers in backward, grads unchanged."""
    config_class, kwargs = FAMILIES["bert"]
    torch.manual_seed(0)
    config = config_class(**kwargs, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    encoder = SpladeEncoder.from_config(config).train()
    features = padded_batch(encoder.model)
    layer_calls = []
    encoder.model.base_model.encoder.layer[0].attention.register_forward_hook(
        lambda *_: layer_calls.append(1)
    )
    grads, calls = [], []
    for checkpointing in (False, True, False):
        if checkpointing:
            encoder.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        else:
            encoder.gradient_checkpointing_disable()
        layer_calls.clear()
        encoder.zero_grad(set_to_none=True)
        encoder(**features).sum().backward()
        grads.append(param_grads(encoder))
        calls.append(len(layer_calls))
    assert calls == [1, 2, 1], "a checkpointed layer runs again in backward, an ordinary one does not"
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], **GRAD_TOL)


def test_bad_inputs_raise_clear_errors(tokenizer, tmp_path: Path) -> None:
    """No MLM head, unsupported family, wrong vocabulary, pooling or ids: errors naming the problem."""
    config_class, kwargs = FAMILIES["bert"]
    config = config_class(**kwargs)
    with pytest.raises(TypeError, match="BertModel, which has no masked-LM head"):
        SpladeEncoder(BertModel(config))
    with pytest.raises(TypeError, match="PreTrainedModel, got str"):
        SpladeEncoder("bert-base-uncased")
    albert = AlbertConfig(
        vocab_size=50,
        embedding_size=16,
        hidden_size=32,
        num_attention_heads=2,
        intermediate_size=64,
        num_hidden_layers=1,
    )
    with pytest.raises(TypeError, match=r"AlbertForMaskedLM is not a supported .*BertForMaskedLM"):
        SpladeEncoder(AlbertForMaskedLM(albert))
    with pytest.raises(ValueError, match="AlbertForMaskedLM is not a supported"):
        SpladeEncoder.from_config(albert)
    with pytest.raises(ValueError, match="GPT2Config, which has no masked-LM class"):
        SpladeEncoder.from_config(GPT2Config(n_layer=1, n_embd=32, n_head=2))
    with pytest.raises(ValueError, match="pooling must be one of"):
        SpladeEncoder.from_config(config, pooling="sum")
    with pytest.raises(ValueError, match=r"special_token_ids must be ints in \[0, 401\), got \[401\]"):
        SpladeEncoder.from_config(config, special_token_ids=[0, 401])
    with pytest.raises(ValueError, match=r"special_token_ids must be ints .*got \['\[CLS\]'\]"):
        SpladeEncoder.from_config(config, special_token_ids=[0, "[CLS]"])

    encoder = SpladeEncoder.from_config(config)
    with pytest.raises(
        ValueError, match="tokenizer has 30522 tokens but the model's decoder has vocab_size 401"
    ):
        encoder.check_tokenizer(tokenizer)
    with pytest.raises(ValueError, match="tokenizer has 30522 tokens"):
        encoder.save_pretrained(tmp_path / "out", tokenizer=tokenizer)
    assert not (tmp_path / "out").exists(), "the vocabulary check must run before anything is written"
    with pytest.raises(ValueError, match="safe_serialization must be True"):
        encoder.save_pretrained(tmp_path / "out", safe_serialization=False)
    with pytest.raises(ValueError, match="got key 'weight'"):
        encoder.save_pretrained(tmp_path / "out", state_dict={"weight": torch.zeros(1)})
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / SPLADE_CONFIG_NAME).write_text('{"pooling": "max", "temperature": 2}')
    with pytest.raises(ValueError, match="must hold a JSON object with pooling and special_token_ids"):
        SpladeEncoder.from_pretrained(tmp_path / "bad")
    assert supported_masked_lm_classes() == (
        "BertForMaskedLM",
        "DistilBertForMaskedLM",
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "ModernBertForMaskedLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
        "RobertaForMaskedLM",
        "XLMRobertaForMaskedLM",
    )


def _saved_bert(tmp_path: Path, name: str) -> tuple[Path, dict[str, Tensor]]:
    """A tiny BERT encoder saved to tmp_path/name; returns the folder and its weights."""
    from safetensors.torch import load_file

    folder = tmp_path / name
    SpladeEncoder(tiny_mlm("bert")).save_pretrained(folder)
    return folder, load_file(folder / "model.safetensors")


@pytest.mark.parametrize("fault", ["missing", "renamed", "prefixed", "shape"])
def test_checkpoint_with_missing_or_renamed_tensors_is_refused(fault: str, tmp_path: Path) -> None:
    """A checkpoint lacking a model tensor (dropped, renamed, prefixed, reshaped) is refused, naming file and keys."""
    from safetensors.torch import save_file

    folder, weights = _saved_bert(tmp_path, fault)
    key = "bert.encoder.layer.0.attention.self.query.weight"
    if fault == "missing":
        weights.pop(key)
    elif fault == "renamed":
        weights["renamed.weight"] = weights.pop(key)
    elif fault == "prefixed":  # a wrapper's state_dict() saved as the model file
        weights = {f"model.{name}": value for name, value in weights.items()}
    else:
        weights[key] = weights[key][:, :-1].contiguous()
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="does not match") as raised:
        SpladeEncoder.from_pretrained(folder)
    message = str(raised.value)
    assert str(folder / "model.safetensors") in message
    if fault == "shape":  # transformers' own report lists the shapes
        return
    assert ("carry the prefix 'model.'" if fault == "prefixed" else key) in message
    if fault == "renamed":
        assert "renamed.weight" in message


def test_tied_decoder_absent_from_the_file_is_not_missing(tmp_path: Path, caplog) -> None:
    """The decoder tied to the embeddings is saved once and loads without complaint; extra tensors only warn."""
    from safetensors.torch import save_file

    folder, weights = _saved_bert(tmp_path, "tied")
    assert "cls.predictions.decoder.weight" not in weights
    SpladeEncoder.from_pretrained(folder)
    weights["bert.pooler.dense.weight"] = torch.zeros(2, 2)  # e.g. a pre-training checkpoint's pooler
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    with caplog.at_level(logging.WARNING, logger="gradcache_sparton.modeling"):
        SpladeEncoder.from_pretrained(folder)
    assert "bert.pooler.dense.weight" in caplog.text


@pytest.mark.parametrize("fault", ["cut weights", "no config", "no weights", "half splade_config"])
def test_truncated_or_missing_checkpoint_files_are_named(fault: str, tmp_path: Path) -> None:
    """A cut model.safetensors, a missing config.json or weights, half a splade_config.json: the file is named."""
    folder, _ = _saved_bert(tmp_path, "checkpoint")
    if fault == "cut weights":
        file, expected = folder / "model.safetensors", "truncated or corrupted"
        file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    elif fault == "no config":
        file, expected = folder / "config.json", "has no config.json"
        file.unlink()
        file = folder  # the message names the folder
    elif fault == "no weights":
        (folder / "model.safetensors").unlink()
        file, expected = folder, "has no weights"
    else:
        file, expected = folder / SPLADE_CONFIG_NAME, "not valid JSON"
        file.write_text('{"pooling": "max", "spec', encoding="utf-8")
    with pytest.raises(ValueError, match=expected) as raised:
        SpladeEncoder.from_pretrained(folder)
    assert str(file) in str(raised.value)
