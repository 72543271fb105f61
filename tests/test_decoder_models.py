"""Backbones beyond BERT: decoder-only LMs (Llama, Qwen2, Qwen3, Mistral), ModernBERT, registered masked LMs.

Each test says which invariant it guards. References materialise the [B, S, V] logits of the model's own
forward; the encoder never does. Tiny random-init configs (hidden 32, 2 layers, V ~1,000, a prime per
family so no size coincidence hides a bug), every parameter perturbed so a dropped norm or bias shows.

Legend: B batch, S sequence, D hidden, V vocabulary.
"""

from __future__ import annotations

import re
import sys

import pytest
import torch
from torch import Tensor
from transformers import (
    AutoModelForCausalLM,
    AutoModelForMaskedLM,
    BertConfig,
    BertForMaskedLM,
    LlamaConfig,
    MistralConfig,
    ModernBertConfig,
    PreTrainedConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen3Config,
)

from gradcache_sparton.engine import CachedLoss
from gradcache_sparton.kernels import splade_max_pool
from gradcache_sparton.losses import SpladeLoss, SpladeLossConfig
from gradcache_sparton.modeling import SpladeEncoder, register_masked_lm

_SHAPE = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
# Untied (Llama, Qwen2) and tied (Qwen3, Mistral) input embeddings; grouped-query attention (2 KV heads).
DECODERS: dict[str, tuple[type[PreTrainedConfig], dict]] = {
    "llama": (LlamaConfig, dict(vocab_size=997, num_key_value_heads=2, tie_word_embeddings=False)),
    "qwen2": (Qwen2Config, dict(vocab_size=1009, num_key_value_heads=2, tie_word_embeddings=False)),
    "qwen3": (
        Qwen3Config,
        dict(vocab_size=1013, num_key_value_heads=2, head_dim=8, tie_word_embeddings=True),
    ),
    "mistral": (MistralConfig, dict(vocab_size=1019, num_key_value_heads=2, tie_word_embeddings=True)),
}
MODERNBERT = dict(
    vocab_size=1021,
    global_attn_every_n_layers=2,
    local_attention=4,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    cls_token_id=1,
    sep_token_id=2,
)

# fp32: the head's chunked products and the reference's nn.Linear round differently (~1e-7 relative
# over D = 32); 1e-5 is 100x that, far below a dropped norm or a wrong position (>1e-2).
REP_TOL = dict(rtol=1e-5, atol=1e-5)
GRAD_TOL = dict(rtol=1e-4, atol=1e-5)
# fp64 (cached vs uncached): the two differ only in summation order, ~1e-16 relative per op.
EXACT = dict(rtol=1e-9, atol=1e-11)


def perturbed(model: PreTrainedModel, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    model = model.to(dtype).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def tiny_decoder(family: str, *, attn: str = "sdpa", dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    config_class, kwargs = DECODERS[family]
    config = config_class(max_position_embeddings=64, **_SHAPE, **kwargs)
    torch.manual_seed(0)
    return perturbed(AutoModelForCausalLM.from_config(config, attn_implementation=attn), dtype)


def tiny_modernbert(dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    config = ModernBertConfig(max_position_embeddings=64, **_SHAPE, **MODERNBERT)
    torch.manual_seed(0)
    return perturbed(AutoModelForMaskedLM.from_config(config), dtype)


def batch(
    vocab_size: int, lengths=(13, 8, 3), *, left_padded: bool = False, seed: int = 1
) -> dict[str, Tensor]:
    """B = len(lengths) random texts of those lengths, padded to the longest (id 0 at padding)."""
    S = max(lengths)
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, vocab_size, (len(lengths), S), generator=g)  # [B, S]
    attention_mask = torch.zeros(len(lengths), S, dtype=torch.long)  # [B, S]
    for row, length in enumerate(lengths):
        if left_padded:
            attention_mask[row, S - length :] = 1
        else:
            attention_mask[row, :length] = 1
    return {"input_ids": input_ids.masked_fill(attention_mask == 0, 0), "attention_mask": attention_mask}


def materialized(model: PreTrainedModel, features: dict[str, Tensor], pool: Tensor | None = None) -> Tensor:
    """Plain SPLADE: the model's own [B, S, V] logits, log1p(relu(.)), masked, max over S."""
    logits = model(**features).logits  # [B, S, V]
    pool = features["attention_mask"] if pool is None else pool  # [B, S]
    return splade_max_pool(logits, pool)  # [B, S, V] -> [B, V]


def grads(model: torch.nn.Module) -> dict[str, Tensor]:
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


# ---------------------------------------------------------------------------------------------- decoders


@pytest.mark.parametrize("family", list(DECODERS))
def test_decoder_reps_and_grads_match_materialized_logits(family: str) -> None:
    """Reps and every gradient equal plain SPLADE over lm_head's logits (final norm in place, no bias)."""
    model = tiny_decoder(family)
    encoder = SpladeEncoder(model)
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert tied == model.config.tie_word_embeddings
    assert encoder.head.weight is model.lm_head.weight and encoder.head.bias is None
    features = batch(model.config.vocab_size)
    weights = torch.rand(3, model.config.vocab_size)
    (encoder(**features) * weights).sum().backward()
    expected_grads = grads(model)
    expected = materialized(model, features)
    (expected * weights).sum().backward()
    torch.testing.assert_close(encoder(**features), expected, **REP_TOL)
    reference_grads = grads(model)
    assert expected_grads.keys() == reference_grads.keys()
    assert any("norm" in name for name in expected_grads)  # the final norm is trained through the head
    for name, grad in reference_grads.items():
        torch.testing.assert_close(expected_grads[name], grad, **GRAD_TOL, msg=name)


def test_left_and_right_padding_give_equal_reps() -> None:
    """Positions count attended tokens: a left-padded row has the reps of the same right-padded row."""
    model = tiny_decoder("llama")
    encoder = SpladeEncoder(model)
    right = batch(model.config.vocab_size)
    left = batch(model.config.vocab_size, left_padded=True)
    for row, length in enumerate((13, 8, 3)):  # same tokens, other side of the padding
        left["input_ids"][row, 13 - length :] = right["input_ids"][row, :length]
    with torch.no_grad():
        torch.testing.assert_close(encoder(**left), encoder(**right), **REP_TOL)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_bidirectional_attention_lets_tokens_see_later_tokens(attn: str) -> None:
    """bidirectional=True: position 0's state depends on the last token; causal: it does not. Padding stays out."""
    model = tiny_decoder("qwen3", attn=attn)
    causal, both_ways = SpladeEncoder(model), SpladeEncoder(model, bidirectional=True)
    features = batch(model.config.vocab_size, lengths=(9, 9))
    changed = {k: v.clone() for k, v in features.items()}
    changed["input_ids"][0, 8] = (changed["input_ids"][0, 8] + 1) % model.config.vocab_size
    with torch.no_grad():
        first = {
            name: e.token_hidden_states(**features)[0, 0] for name, e in (("c", causal), ("b", both_ways))
        }
        after = {
            name: e.token_hidden_states(**changed)[0, 0] for name, e in (("c", causal), ("b", both_ways))
        }
        torch.testing.assert_close(after["c"], first["c"], rtol=0, atol=0)
        assert (after["b"] - first["b"]).abs().max() > 1e-3
        # Padding keys stay masked: the padded row's reps equal those of the same text unpadded.
        padded = batch(model.config.vocab_size, lengths=(9, 5))
        alone = {k: v[1:, :5] for k, v in padded.items()}
        torch.testing.assert_close(both_ways(**padded)[1:], both_ways(**alone), **REP_TOL)


def test_bidirectional_eager_and_sdpa_agree() -> None:
    """The two mask formats (bool for sdpa, additive for eager) give the same bidirectional reps."""
    features = batch(DECODERS["mistral"][1]["vocab_size"])
    with torch.no_grad():
        reps = [
            SpladeEncoder(tiny_decoder("mistral", attn=attn), bidirectional=True)(**features)
            for attn in ("sdpa", "eager")
        ]
    torch.testing.assert_close(reps[0], reps[1], **REP_TOL)


def test_echo_pools_only_the_second_copy() -> None:
    """echo=True equals plain SPLADE over [text, text] pooled on the second copy (left padding too)."""
    model = tiny_decoder("qwen2")
    encoder = SpladeEncoder(model, echo=True)
    features = batch(model.config.vocab_size, left_padded=True)
    expected = []
    for row in range(3):
        tokens = features["input_ids"][row][features["attention_mask"][row].bool()]  # [L]
        doubled = torch.cat([tokens, tokens])[None]  # [1, 2L]
        pool = torch.zeros_like(doubled)
        pool[:, len(tokens) :] = 1
        expected.append(
            materialized(model, {"input_ids": doubled, "attention_mask": torch.ones_like(doubled)}, pool)
        )
    with torch.no_grad():
        reps = encoder(**features)
        torch.testing.assert_close(reps, torch.cat(expected), **REP_TOL)
        assert not torch.allclose(reps, SpladeEncoder(model)(**features), **REP_TOL)


def test_prefix_and_special_token_positions_are_not_pooled() -> None:
    """prefix_length drops each text's first attended tokens, special_token_ids their ids, from the max only."""
    model = tiny_decoder("llama")
    features = batch(model.config.vocab_size, left_padded=True)
    special = [int(features["input_ids"][0, -1])]
    encoder = SpladeEncoder(model, prefix_length=2, special_token_ids=special)
    rank = features["attention_mask"].cumsum(-1)  # 1-based rank among attended tokens
    pool = features["attention_mask"] * (rank > 2) * ~torch.isin(features["input_ids"], torch.tensor(special))
    with torch.no_grad():
        torch.testing.assert_close(encoder(**features), materialized(model, features, pool), **REP_TOL)


def test_decoder_bos_and_eos_positions_are_not_pooled_by_default(tmp_path) -> None:
    """A decoder's BOS/EOS positions (config ids) stay out of the pool by default (under causal attention BOS adds
    one fixed vector to every rep); special_token_ids=() keeps them; a masked LM's default pools every position."""
    model = tiny_decoder("llama")
    features = batch(model.config.vocab_size, left_padded=True)
    first = features["attention_mask"].cumsum(-1) == 1  # [B, S] each row's first attended position
    features["input_ids"] = features["input_ids"].masked_fill(first, model.config.bos_token_id)
    features["input_ids"][0, -1] = model.config.eos_token_id
    special = torch.tensor([model.config.bos_token_id, model.config.eos_token_id])
    encoder = SpladeEncoder(model)
    assert encoder.special_token_ids == (1, 2)
    pool = features["attention_mask"] * ~torch.isin(features["input_ids"], special)
    with torch.no_grad():
        bos = materialized(
            model, {"input_ids": features["input_ids"][:, -3:-2], "attention_mask": first[:, -3:-2]}
        )
        torch.testing.assert_close(encoder(**features), materialized(model, features, pool), **REP_TOL)
        kept = SpladeEncoder(model, special_token_ids=())(**features)
        torch.testing.assert_close(kept, materialized(model, features), **REP_TOL)
    assert not torch.equal(kept, encoder(**features).detach()) and bos.count_nonzero() > 0
    encoder.save_pretrained(tmp_path)
    assert SpladeEncoder.from_pretrained(tmp_path).special_token_ids == (1, 2)
    bert = BertForMaskedLM(
        BertConfig(vocab_size=101, hidden_size=32, num_hidden_layers=1, num_attention_heads=2)
    )
    assert SpladeEncoder(bert).special_token_ids == ()


@pytest.mark.parametrize(("flag", "expected"), [(None, (1, 2)), (False, ()), (True, "all")])
def test_mask_special_tokens_flag_keeps_or_drops_decoder_special_positions(
    tmp_path, tokenizer, flag, expected
) -> None:
    """mask_special_tokens: unset, a decoder checkpoint without splade_config.json masks its BOS/EOS ids; False
    pools every position; True masks every special id of the tokenizer."""
    from gradcache_sparton.arguments import ModelArguments
    from gradcache_sparton.model_loading import build_encoder, build_tokenizer

    folder = _saved_decoder(tmp_path / "start", tokenizer)
    (tmp_path / "start" / "splade_config.json").unlink()  # a plain causal-LM checkpoint
    model_args = ModelArguments(model_name_or_path=folder, mask_special_tokens=flag)
    small = build_tokenizer(model_args)
    encoder = build_encoder(model_args, small)
    assert encoder.special_token_ids == (
        tuple(sorted(set(small.all_special_ids))) if expected == "all" else expected
    )


@pytest.mark.parametrize(("name", "value"), [("query_max_length", 8), ("document_max_length", 16)])
def test_prefix_that_leaves_no_text_token_is_refused(tmp_path, tokenizer, name, value) -> None:
    """prefix_length (plus the tokens the tokenizer appends) >= a max length: ValueError naming both options
    when the trainer is built, before any step; a prefix that leaves one text token is accepted."""
    from transformers import BertTokenizer

    from gradcache_sparton.arguments import CachedSpladeTrainingArguments
    from gradcache_sparton.trainer import CachedSpladeTrainer

    model = tiny_decoder("llama")
    vocab = sorted(tokenizer.get_vocab(), key=tokenizer.get_vocab().get)[: model.config.vocab_size]
    small = BertTokenizer(vocab={token: i for i, token in enumerate(vocab)})  # appends [SEP]
    lengths = {"query_max_length": 32, "document_max_length": 32, name: value}
    args = CachedSpladeTrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", **lengths)
    with pytest.raises(ValueError, match=rf"prefix_length={value - 1}.*{name}={value}"):
        CachedSpladeTrainer(SpladeEncoder(model, prefix_length=value - 1), args, processing_class=small)
    with pytest.raises(ValueError, match=rf"prefix_length={value} .*{name}={value}"):
        SpladeEncoder(model, prefix_length=value).check_max_length(
            name, value
        )  # no tokenizer: the prefix alone
    CachedSpladeTrainer(SpladeEncoder(model, prefix_length=value - 2), args, processing_class=small)


def test_decoder_options_are_checked_and_saved(tmp_path) -> None:
    """Options are refused where they mean nothing; set ones round-trip through splade_config.json."""
    bert = BertForMaskedLM(
        BertConfig(vocab_size=101, hidden_size=32, num_hidden_layers=1, num_attention_heads=2)
    )
    for option in ("echo", "bidirectional"):
        with pytest.raises(ValueError, match=f"{option}=True is for decoder-only backbones"):
            SpladeEncoder(bert, **{option: True})
    with pytest.raises(ValueError, match="prefix_length must be an int >= 0"):
        SpladeEncoder(bert, prefix_length=-1)
    model = tiny_decoder("llama")
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="bidirectional=True needs attn_implementation"):
        SpladeEncoder(model, bidirectional=True)
    model.config._attn_implementation = "sdpa"
    encoder = SpladeEncoder(model, bidirectional=True, echo=True, prefix_length=1)
    encoder.save_pretrained(tmp_path)
    reloaded = SpladeEncoder.from_pretrained(tmp_path).eval()
    assert (reloaded.bidirectional, reloaded.echo, reloaded.prefix_length) == (True, True, 1)
    features = batch(model.config.vocab_size)
    with torch.no_grad():
        torch.testing.assert_close(reloaded(**features), encoder(**features), rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------- exactness


def _loss() -> SpladeLoss:
    return SpladeLoss(SpladeLossConfig(query_reg_weight=1e-3, doc_reg_weight=1e-3))


def _columns(vocab_size: int) -> dict[str, dict[str, Tensor]]:
    return {
        "query": batch(vocab_size, (5, 3, 4, 2), seed=2),
        "positive": batch(vocab_size, (11, 7, 9, 4), seed=3),
        "negative_1": batch(vocab_size, (6, 10, 8, 5), seed=4),
    }


def _with_lora(model: PreTrainedModel) -> PreTrainedModel:
    peft = pytest.importorskip("peft", reason="LoRA needs the peft extra")
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    peft.get_peft_model(model, config)  # injects the adapters into ``model`` in place, freezes the rest
    with torch.no_grad():  # LoRA's B starts at 0: move it so the adapters change the reps
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.05)
    return model


def _checkpointed(encoder: SpladeEncoder) -> SpladeEncoder:
    encoder.gradient_checkpointing_enable()
    return encoder.train()  # transformers checkpoints only in training mode (dropout is 0 here)


CASES = {
    "modernbert": lambda: SpladeEncoder(tiny_modernbert(torch.float64)),
    "llama": lambda: SpladeEncoder(tiny_decoder("llama", dtype=torch.float64)),
    "qwen3-bidirectional-echo": lambda: SpladeEncoder(
        tiny_decoder("qwen3", dtype=torch.float64), bidirectional=True, echo=True
    ),
    "llama-lora": lambda: SpladeEncoder(_with_lora(tiny_decoder("llama", dtype=torch.float64))),
    "qwen2-lora-bidirectional": lambda: SpladeEncoder(
        _with_lora(tiny_decoder("qwen2", dtype=torch.float64)), bidirectional=True
    ),
    "llama-lora-checkpointing": lambda: _checkpointed(
        SpladeEncoder(_with_lora(tiny_decoder("llama", dtype=torch.float64)))
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_cached_equals_uncached(case: str) -> None:
    """CachedLoss (mini-batches of 3) gives the full-batch loss and every trainable gradient; frozen ones stay None."""
    encoder = CASES[case]()
    columns = _columns(encoder.vocab_size)
    loss_fn = _loss()
    expected, _ = loss_fn({name: encoder(**features) for name, features in columns.items()})
    expected.backward()
    expected_grads = grads(encoder)
    actual = CachedLoss(encoder, loss_fn, mini_batch_size=3)(columns)
    actual.backward()
    actual_grads = grads(encoder)
    torch.testing.assert_close(actual, expected, **EXACT)
    trainable = {name for name, p in encoder.named_parameters() if p.requires_grad}
    assert actual_grads.keys() == expected_grads.keys() == trainable
    if "lora" in case:
        assert trainable and all("lora_" in name for name in trainable)
    for name, grad in expected_grads.items():
        torch.testing.assert_close(actual_grads[name], grad, **EXACT, msg=name)


# ---------------------------------------------------------------------------------------------- extension point


def test_registered_masked_lm_is_supported() -> None:
    """A class outside the table is refused until registered; then reps equal its own logits' SPLADE."""
    from gradcache_sparton.modeling.backbones import _lm_transforms

    class CustomBertForMaskedLM(BertForMaskedLM):
        pass

    config = BertConfig(
        vocab_size=401, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64
    )
    torch.manual_seed(0)
    model = perturbed(CustomBertForMaskedLM(config))
    with pytest.raises(TypeError, match="CustomBertForMaskedLM is not a supported"):
        SpladeEncoder(model)
    transform = lambda m, hidden: m.cls.predictions.transform(hidden)
    try:
        register_masked_lm(CustomBertForMaskedLM, transform)
        register_masked_lm(CustomBertForMaskedLM, transform)  # the same again: a no-op
        with pytest.raises(ValueError, match="already registered with another transform"):
            register_masked_lm(CustomBertForMaskedLM, lambda m, hidden: hidden)
        features = batch(401)
        with torch.no_grad():
            torch.testing.assert_close(
                SpladeEncoder(model)(**features), materialized(model, features), **REP_TOL
            )
    finally:
        _lm_transforms().pop(CustomBertForMaskedLM, None)
    with pytest.raises(TypeError, match="must be a PreTrainedModel subclass"):
        register_masked_lm(torch.nn.Linear, transform)


@pytest.mark.gpu
@pytest.mark.parametrize("family", list(DECODERS))
def test_cuda_decoder_reps_and_grads_match_materialized_logits(family: str) -> None:
    """On CUDA (Triton head, no bias): fp32 reps and grads, and bf16-autocast reps, equal the plain computation."""
    model = tiny_decoder(family).cuda()
    encoder = SpladeEncoder(model, bidirectional=family == "qwen3")
    features = {k: v.cuda() for k, v in batch(model.config.vocab_size).items()}
    reps = encoder(**features)  # [B, V]
    weights = torch.randn_like(reps)
    (reps * weights).sum().backward()
    ours = grads(model)
    reference = SpladeEncoder(model, bidirectional=family == "qwen3")
    hidden = reference.token_hidden_states(**features)  # the same backbone pass, logits materialised below
    logits = hidden @ model.lm_head.weight.T  # [B, S, D] @ [D, V] -> [B, S, V]
    expected = (torch.log1p(torch.relu(logits)) * features["attention_mask"][:, :, None]).max(dim=1).values
    torch.testing.assert_close(reps, expected, **REP_TOL)
    (expected * weights).sum().backward()
    theirs = grads(model)
    # As for the masked LMs (test_modeling): 1e-5 of the largest gradient, far below a misplaced one.
    scale = max(g.abs().max().item() for g in theirs.values())
    for name, grad in theirs.items():
        torch.testing.assert_close(ours[name], grad, rtol=1e-4, atol=1e-5 * scale, msg=name)
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        reps16 = encoder(**features)
        expected16 = materialized(model, features) if family != "qwen3" else None
    assert reps16.dtype == torch.bfloat16
    if expected16 is not None:  # bf16 logits round at 2**-8 relative: ~0.01 absolute at worst
        torch.testing.assert_close(reps16.float(), expected16.float(), rtol=0, atol=1.5e-2)


def test_trainer_reloads_a_decoder_checkpoint(tmp_path, tokenizer) -> None:
    """Resuming (and load_best_model_at_end) loads a decoder-only checkpoint through its causal-LM class."""
    from transformers import BertTokenizer

    from gradcache_sparton.arguments import CachedSpladeTrainingArguments
    from gradcache_sparton.trainer import CachedSpladeTrainer

    model = tiny_decoder("llama")
    vocab = sorted(tokenizer.get_vocab(), key=tokenizer.get_vocab().get)[: model.config.vocab_size]
    small = BertTokenizer(vocab={token: i for i, token in enumerate(vocab)})
    encoder = SpladeEncoder(model, echo=True)
    args = CachedSpladeTrainingArguments(
        output_dir=str(tmp_path / "run"),
        query_reg_weight=1e-3,
        doc_reg_weight=1e-3,
        use_cpu=True,
        report_to="none",
    )
    trainer = CachedSpladeTrainer(encoder, args, processing_class=small)
    trainer.save_model(str(tmp_path / "ckpt"))
    assert not (tmp_path / "ckpt" / "modules.json").exists()  # no sentence-transformers equivalent
    saved = {name: p.detach().clone() for name, p in model.named_parameters()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    trainer._load_from_checkpoint(str(tmp_path / "ckpt"))
    for name, p in model.named_parameters():
        torch.testing.assert_close(p, saved[name], rtol=0, atol=0, msg=name)


def test_cli_applies_decoder_options_and_saves_them(tmp_path, tokenizer, capsys) -> None:
    """`train --bidirectional True --prefix_length 1` loads a decoder checkpoint with those options and the
    trained checkpoint keeps them; `--echo True` on a masked LM is one clear error naming echo (exit 2)."""
    import json

    from transformers import BertTokenizer

    from gradcache_sparton.cli import main

    model = tiny_decoder("llama")
    vocab = sorted(tokenizer.get_vocab(), key=tokenizer.get_vocab().get)[: model.config.vocab_size]
    SpladeEncoder(model).save_pretrained(
        tmp_path / "start", tokenizer=BertTokenizer(vocab={token: i for i, token in enumerate(vocab)})
    )
    common = [
        "--per_device_train_batch_size", "4", "--mini_batch_size", "2", "--query_max_length", "16",
        "--document_max_length", "16", "--max_steps", "1", "--max_train_samples", "4", "--eval_beir", "none",
        "--use_cpu", "--disable_tqdm", "True", "--report_to", "none",
    ]  # fmt: skip
    argv = ["train", "--model_name_or_path", str(tmp_path / "start"), "--bidirectional", "True"]
    assert main([*argv, "--prefix_length", "1", "--output_dir", str(tmp_path / "run"), *common]) == 0
    saved = json.loads((tmp_path / "run" / "splade_config.json").read_text())
    assert saved["bidirectional"] is True and saved["prefix_length"] == 1
    assert SpladeEncoder.from_pretrained(tmp_path / "run").bidirectional
    capsys.readouterr()
    argv = ["train", "--config_name", "bert-tiny", "--echo", "True", "--output_dir", str(tmp_path / "bad")]
    assert main([*argv, *common]) == 2
    assert "echo" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------- LoRA from the CLI

# A 1-2 step CPU run of the tiny decoder: 4 rows, mini-batches of 2, no retrieval evaluation.
_RUN_FLAGS = [
    "--per_device_train_batch_size", "4", "--mini_batch_size", "2", "--query_max_length", "16",
    "--document_max_length", "16", "--max_train_samples", "4", "--eval_beir", "none", "--use_cpu",
    "--disable_tqdm", "True", "--report_to", "none",
]  # fmt: skip


def _saved_decoder(folder, tokenizer) -> str:
    """The tiny Llama saved as a start checkpoint, with a WordPiece tokenizer cut to its V tokens."""
    from transformers import BertTokenizer

    model = tiny_decoder("llama")
    vocab = sorted(tokenizer.get_vocab(), key=tokenizer.get_vocab().get)[: model.config.vocab_size]
    SpladeEncoder(model).save_pretrained(
        folder, tokenizer=BertTokenizer(vocab={token: i for i, token in enumerate(vocab)})
    )
    return str(folder)


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        ([], (4, 8, 0.0, ["q_proj", "v_proj"])),  # alpha 2 x r, peft's Llama targets
        (
            [
                "--lora_alpha",
                "16",
                "--lora_dropout",
                "0.1",
                "--lora_target_modules",
                "k_proj, o_proj,gate_proj",
            ],
            (4, 16, 0.1, ["k_proj", "o_proj", "gate_proj"]),
        ),
    ],
)
def test_lora_flags_reach_peft_and_only_adapters_get_gradients(flags: list[str], expected: tuple) -> None:
    """`--lora_*` flags become peft's LoraConfig (default alpha 2 x r and peft's targets); in a cached training
    step only lora_* tensors of every target get gradients, all others (lm_head, embeddings) keep .grad None."""
    pytest.importorskip("peft", reason="LoRA needs the peft extra")
    from gradcache_sparton.cli.train import train_parser
    from gradcache_sparton.model_loading import add_lora_adapters

    model_args, *_ = train_parser().parse_args_into_dataclasses(["--lora_r", "4", *flags])
    encoder = SpladeEncoder(tiny_decoder("llama")).train()
    config = add_lora_adapters(encoder, model_args).peft_config["default"]
    r, alpha, dropout, targets = expected
    assert (config.r, config.lora_alpha, config.lora_dropout) == (r, alpha, dropout)
    assert set(config.target_modules) == set(targets)
    assert encoder.lora == {
        "lora_r": r,
        "lora_alpha": alpha,
        "lora_dropout": dropout,
        "lora_target_modules": targets,
    }
    CachedLoss(encoder, _loss(), mini_batch_size=3)(_columns(encoder.vocab_size)).backward()
    trainable = {name for name, p in encoder.named_parameters() if p.requires_grad}
    with_grad = {name for name, p in encoder.named_parameters() if p.grad is not None}
    assert trainable and with_grad == trainable and all("lora_" in name for name in trainable)
    assert {name.split(".lora_")[0].rsplit(".", 1)[-1] for name in trainable} == set(targets)
    assert encoder.head.weight.grad is None and encoder.model.get_input_embeddings().weight.grad is None


def test_cli_lora_run_saves_a_plain_merged_checkpoint_and_the_adapter(
    tmp_path, tokenizer, monkeypatch
) -> None:
    """`train --lora_r 4` saves a checkpoint that plain `SpladeEncoder.from_pretrained` loads (no peft tensor
    names) with the merged in-memory model's reps, which training moved away from the start's; `adapter/`
    holds the trained adapters alone (start + adapter = the checkpoint) and splade_config.json records them.

    Tolerances (fp32, CPU): the reloaded checkpoint equals the in-memory merged model bitwise (safetensors
    round-trips fp32 exactly, same ops on the same weights). Against start + adapter unmerged (x·Wᵀ + s·(x·Aᵀ)·Bᵀ,
    not x·(W + s·B·A)ᵀ) REP_TOL, ~100x fp32 rounding over D = 32; the trained reps differ from the start's by
    more than 1e-3.
    """
    peft = pytest.importorskip("peft", reason="LoRA needs the peft extra")
    import json

    from safetensors.torch import load_file

    from gradcache_sparton import pipeline
    from gradcache_sparton.cli import main

    start, run = _saved_decoder(tmp_path / "start", tokenizer), tmp_path / "run"
    encoders = []
    real_add = pipeline.add_lora_adapters

    def add_and_keep(encoder: SpladeEncoder, model_args: object) -> object:
        encoders.append(encoder)
        return real_add(encoder, model_args)

    monkeypatch.setattr(pipeline, "add_lora_adapters", add_and_keep)
    argv = ["train", "--model_name_or_path", start, "--lora_r", "4", "--learning_rate", "1e-2"]
    assert main([*argv, "--max_steps", "2", "--output_dir", str(run), *_RUN_FLAGS]) == 0
    record = {"lora_r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "lora_target_modules": ["q_proj", "v_proj"]}
    assert json.loads((run / "splade_config.json").read_text())["lora"] == record
    assert not [key for key in load_file(run / "model.safetensors") if "lora_" in key or "base_layer" in key]
    adapter = load_file(run / "adapter" / "adapter_model.safetensors")
    lora_b = [value for key, value in adapter.items() if "lora_B" in key]
    assert lora_b and all(value.abs().max() > 0 for value in lora_b)  # B starts at 0: training moved it
    trained = SpladeEncoder.from_pretrained(run).eval()
    assert trained.lora == record
    features = batch(trained.vocab_size)
    with torch.no_grad():
        reps = trained(**features)
        torch.testing.assert_close(reps, encoders[0].eval()(**features), rtol=0, atol=0)
        base = SpladeEncoder.from_pretrained(start).eval()
        before = base(**features)
        peft.PeftModel.from_pretrained(base.model, run / "adapter")  # injects the adapters into base.model
        torch.testing.assert_close(reps, base(**features), **REP_TOL)
    assert (reps - before).abs().max() > 1e-3


def _train_without_a_model(argv: list[str], monkeypatch) -> int:
    """``main(["train", *argv, ...])`` with model building replaced by an error: the exit code."""
    from gradcache_sparton import pipeline
    from gradcache_sparton.cli import main

    def no_model(*args: object, **kwargs: object) -> None:
        raise AssertionError("the model was built before the arguments were checked")

    monkeypatch.setattr(pipeline, "build_encoder", no_model)
    return main(["train", "--config_name", "bert-tiny", *argv, "--max_steps", "1", *_RUN_FLAGS])


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--lora_r", "-1"], r"lora_r must be an int >= 0"),
        (["--lora_r", "4", "--lora_alpha", "0"], r"lora_alpha must be a positive int"),
        (["--lora_r", "4", "--lora_dropout", "1.0"], r"lora_dropout must be in \[0, 1\)"),
        (["--lora_r", "4", "--lora_dropout", "-0.1"], r"lora_dropout must be in \[0, 1\)"),
        (["--lora_target_modules", "q_proj"], r"lora_target_modules set but lora_r is 0"),
        (["--lora_alpha", "8", "--lora_dropout", "0.1"], r"lora_alpha, lora_dropout set but lora_r is 0"),
        (
            ["--lora_r", "4", "--lora_target_modules", "q_proj,,v_proj"],
            r"lora_target_modules must be a comma",
        ),
        (
            ["--lora_r", "4", "--resume_from_checkpoint", "{tmp}/checkpoint-1"],
            r"resume_from_checkpoint and load_best_model_at_end are not supported with lora_r > 0",
        ),
    ],
)
def test_bad_lora_flags_are_one_clear_error_before_the_model_loads(
    flags: list[str], message: str, tmp_path, capsys, monkeypatch
) -> None:
    """A bad --lora_* value (or resuming a LoRA run) is one error line naming the argument and what was
    expected (exit 2), before any model is built or anything written."""
    (tmp_path / "checkpoint-1").mkdir()  # a Trainer checkpoint folder, for the resume case
    (tmp_path / "checkpoint-1" / "trainer_state.json").write_text("{}")
    flags = [flag.format(tmp=tmp_path) for flag in flags]
    assert _train_without_a_model([*flags, "--output_dir", str(tmp_path / "run")], monkeypatch) == 2
    assert re.search(message, capsys.readouterr().err)
    assert not (tmp_path / "run").exists()


def test_lora_without_peft_says_how_to_install_it(tmp_path, capsys, monkeypatch) -> None:
    """--lora_r > 0 without peft installed is one error line with the pip command, before any model is built."""
    monkeypatch.setitem(sys.modules, "peft", None)  # importlib.util.find_spec("peft") is None: not installed
    argv = ["--lora_r", "4", "--output_dir", str(tmp_path / "run")]
    assert _train_without_a_model(argv, monkeypatch) == 2
    assert "lora_r=4 needs peft: pip install 'gradcache_sparton[peft]'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("targets", "message"),
    [
        ("lm_head", "name the embeddings or the decoder"),
        ("embed_tokens,q_proj", "name the embeddings or the decoder"),
        ("no_such_proj", "match no module of LlamaForCausalLM"),
        ("q_proj,nonexistent_proj", "['nonexistent_proj'] match no module of LlamaForCausalLM"),
        (None, "peft has no default for ModernBertForMaskedLM"),
    ],
)
def test_bad_lora_targets_are_refused_naming_the_argument(targets: str | None, message: str) -> None:
    """lora_target_modules naming the decoder or embeddings (the SPLADE head shares them), matching nothing, or
    left to a default peft does not have: ValueError naming lora_target_modules; the model is left unchanged."""
    pytest.importorskip("peft", reason="LoRA needs the peft extra")
    from gradcache_sparton.arguments import ModelArguments
    from gradcache_sparton.model_loading import add_lora_adapters

    model = tiny_modernbert() if targets is None else tiny_decoder("llama")
    encoder = SpladeEncoder(model)
    with pytest.raises(ValueError, match="lora_target_modules") as raised:
        add_lora_adapters(encoder, ModelArguments(lora_r=4, lora_target_modules=targets))
    assert message in str(raised.value)
    assert encoder.lora is None and not hasattr(model, "peft_config")
    assert all(p.requires_grad for p in model.parameters())


def test_lora_record_round_trips_and_a_malformed_one_is_refused(tmp_path) -> None:
    """splade_config.json's lora record is read back by from_pretrained; a malformed one is a ValueError naming
    the file and the key."""
    import json

    encoder = SpladeEncoder(tiny_decoder("llama"))
    record = {
        "lora_r": 8,
        "lora_alpha": 16,
        "lora_dropout": 0.05,
        "lora_target_modules": ["q_proj", "v_proj"],
    }
    encoder.lora = record
    encoder.save_pretrained(tmp_path / "ckpt")
    assert SpladeEncoder.from_pretrained(tmp_path / "ckpt").lora == record
    file = tmp_path / "ckpt" / "splade_config.json"
    saved = json.loads(file.read_text())
    for bad in ({**record, "lora_r": 0}, {**record, "lora_target_modules": []}, {"lora_r": 8}):
        file.write_text(json.dumps({**saved, "lora": bad}))
        with pytest.raises(ValueError, match=r"splade_config\.json: lora must be an object of lora_r"):
            SpladeEncoder.from_pretrained(tmp_path / "ckpt")
