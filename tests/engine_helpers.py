"""Shared pieces of the engine and loss tests: a tiny SPLADE-like encoder, random columns, losses, references
and the comparisons against them.

The references here are written independently of the engine (plain PyTorch, one forward and one
backward), so the tests compare the engine against something it does not share code with.

Legend: B batch, S sequence, V vocabulary.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import Tensor, nn
from transformers import BertConfig, BertForMaskedLM, PreTrainedTokenizerBase

from gradcache_sparton.engine import GradCacheConfig
from gradcache_sparton.engine.option_rules import EngineFacts
from gradcache_sparton.kernels import splade_max_pool

__all__ = [
    "COLUMN_LENGTHS",
    "SMALL_VOCAB",
    "FailingEncoder",
    "RecordingEncoder",
    "SpladeLikeEncoder",
    "accumulate_earlier_micro_step",
    "assert_grads_close",
    "assert_grads_unchanged",
    "assert_matches_reference",
    "contrastive_flops_loss",
    "dropout_free_config",
    "failing_encoder",
    "grads_of",
    "leaf_copies",
    "make_columns",
    "make_encoder",
    "make_tiny_bert_config",
    "pairwise_mse_loss",
    "per_mini_batch_loss",
    "saved_grads",
    "small_config",
    "splade_like_reps",
    "token_budget_groups",
    "uncached_loss",
    "uncached_reference",
]

# A 500-token vocabulary keeps the [B, S, V] logits of the plain head small: the engine never looks at
# V, and the tests run ~60x faster than with the real 30,522 tokens.
SMALL_VOCAB = 500

# Each column has its own padded length, as queries and passages do.
COLUMN_LENGTHS = {"query": 7, "positive": 13, "negative": 11}


def make_tiny_bert_config(tokenizer: PreTrainedTokenizerBase) -> BertConfig:
    """A 2-layer, 32-wide BERT config over the real 30,522-token vocabulary (fast on CPU): the conftest's
    ``tiny_bert_config``, for fixtures of a wider scope."""
    return BertConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=128,
        hidden_dropout_prob=0.1,
        attention_probs_dropout_prob=0.1,
    )


def small_config(config: BertConfig, *, dropout: float | None = None) -> BertConfig:
    """``config`` with the small vocabulary and, if given, both dropout probabilities replaced."""
    config = copy.deepcopy(config)
    config.vocab_size = SMALL_VOCAB
    if dropout is not None:
        config.hidden_dropout_prob = dropout
        config.attention_probs_dropout_prob = dropout
    return config


class SpladeLikeEncoder(nn.Module):
    """A masked-LM with the plain SPLADE head: max_s log1p(relu(logits)) · mask -> [B, V]."""

    def __init__(self, mlm: BertForMaskedLM) -> None:
        super().__init__()
        self.mlm = mlm

    def forward(
        self, input_ids: Tensor, attention_mask: Tensor, token_type_ids: Tensor | None = None
    ) -> Tensor:
        logits = self.mlm(
            input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids
        ).logits  # [B, S, V]
        return splade_max_pool(logits, attention_mask)  # [B, S, V] -> [B, V]


def make_encoder(config: BertConfig, *, seed: int = 0, train: bool = False) -> SpladeLikeEncoder:
    """A freshly seeded encoder; ``train=True`` turns dropout on."""
    torch.manual_seed(seed)
    return SpladeLikeEncoder(BertForMaskedLM(config)).train(train)


def dropout_free_config() -> BertConfig:
    """A tiny BERT (vocabulary SMALL_VOCAB) with dropout off, for data-parallel tests: each rank draws its own
    dropout masks, so only a dropout-free model gives the numbers of one process on the global batch."""
    return BertConfig(
        vocab_size=SMALL_VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=128,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )


def save_small_masked_lm(path: Path) -> Path:
    """A tiny dropout-free BERT masked-LM (:func:`dropout_free_config`'s shape) and a WordPiece tokenizer of the
    shipped vocabulary's first 3,000 entries (special tokens, characters, the most frequent words), saved in
    ``path`` like a hub checkpoint. Its decoder bias is not zero, so a head ignoring it would show; V 10x smaller
    than BERT's keeps fp64 gradient comparisons fast."""
    from transformers import AutoTokenizer, BertTokenizer

    from gradcache_sparton.resources import default_tokenizer_path

    full = AutoTokenizer.from_pretrained(default_tokenizer_path())
    vocab = sorted(full.get_vocab(), key=full.get_vocab().get)
    small = BertTokenizer(vocab={token: i for i, token in enumerate(vocab[:3000])})
    config = dropout_free_config()
    config.vocab_size = len(small)
    torch.manual_seed(0)
    model = BertForMaskedLM(config)
    with torch.no_grad():
        model.cls.predictions.bias.normal_(0.0, 0.05)
    model.save_pretrained(path)
    small.save_pretrained(path)
    return path


class RecordingEncoder(nn.Module):
    """Wraps an encoder and records each output (detached copy), whether autograd was recording, and the
    autocast dtype in force for the inputs' device type (None when autocast was off)."""

    def __init__(self, encoder: nn.Module) -> None:
        super().__init__()
        self.encoder = encoder
        self.calls: list[tuple[bool, Tensor, torch.dtype | None]] = []

    def forward(self, **features: Tensor) -> Tensor:
        device_type = features["input_ids"].device.type
        autocast = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None
        rep = self.encoder(**features)
        self.calls.append((rep.requires_grad, rep.detach().clone(), autocast))
        return rep

    def outputs(self, *, with_graph: bool) -> list[Tensor]:
        """The recorded outputs of Step (3) (``with_graph=True``) or of Step (1) (False)."""
        return [rep for grad, rep, _ in self.calls if grad == with_graph]

    def autocast_dtypes(self, *, with_graph: bool) -> list[torch.dtype | None]:
        """The autocast dtype each Step (3) (``with_graph=True``) or Step (1) call ran under."""
        return [autocast for grad, _, autocast in self.calls if grad == with_graph]


def make_columns(
    batch_size: int, n_columns: int, *, seed: int = 0, vocab_size: int = SMALL_VOCAB
) -> dict[str, dict[str, Tensor]]:
    """Random right-padded columns (first 2 or 3 of COLUMN_LENGTHS), row lengths in [2, S].

    Row 0 of each column is full length, as a tokenizer padding to the longest text would give; the
    other rows are shorter, so some mini-batches have trailing padding to trim.
    """
    generator = torch.Generator().manual_seed(seed)
    columns = {}
    for name, seq_len in list(COLUMN_LENGTHS.items())[:n_columns]:
        lengths = torch.randint(2, seq_len, (batch_size,), generator=generator)
        lengths[0] = seq_len
        # [B, S]: 1 up to each row's length, then 0
        mask = (torch.arange(seq_len).unsqueeze(0) < lengths.unsqueeze(1)).long()
        input_ids = torch.randint(1, vocab_size, (batch_size, seq_len), generator=generator) * mask
        columns[name] = {
            "input_ids": input_ids,
            "attention_mask": mask,
            "token_type_ids": torch.zeros_like(input_ids),
        }
    return columns


def contrastive_flops_loss(
    reps: Mapping[str, Tensor], *, temperature: float = 20.0, flops_weight: float = 0.1
) -> tuple[Tensor, dict[str, Tensor]]:
    """InfoNCE (in-batch + hard negatives) plus the batch-coupled FLOPS regularizer on the documents.

    The temperature suits the raw dot products of these random-init reps (~10-40), so the softmax is
    neither saturated nor flat and every rep gets a sizeable gradient.
    """
    q_reps, *d_columns = reps.values()
    d_reps = torch.cat(d_columns)  # [B · (columns - 1), V]
    scores = q_reps @ d_reps.T / temperature  # [B, V] @ [V, B'] -> [B, B']
    labels = torch.arange(q_reps.shape[0], device=q_reps.device)
    contrastive = nn.functional.cross_entropy(scores.float(), labels)
    flops = (d_reps.float().mean(dim=0) ** 2).sum()  # [B', V] -> [V] -> scalar
    return contrastive + flops_weight * flops, {"contrastive": contrastive, "flops": flops}


def pairwise_mse_loss(reps: Mapping[str, Tensor], *, targets: Tensor) -> Tensor:
    """Mean over examples of (q·p / V - target)²: decomposes over examples, so accumulation is exact."""
    q_reps, d_reps = reps["query"], reps["positive"]
    scores = (q_reps * d_reps).sum(dim=1) / q_reps.shape[1]  # [B, V] -> [B]
    return ((scores.float() - targets) ** 2).mean()


def uncached_loss(encoder: nn.Module, columns: Mapping[str, Mapping[str, Tensor]], loss_fn, **loss_kwargs):
    """The reference: every column encoded whole, with a graph, then the loss."""
    return loss_fn({name: encoder(**features) for name, features in columns.items()}, **loss_kwargs)


def uncached_reference(
    encoder: nn.Module, columns: Mapping[str, Mapping[str, Tensor]], loss_fn, **loss_kwargs
) -> tuple[Tensor, dict[str, Tensor]]:
    """The reference step (:func:`uncached_loss` and its backward): the detached loss and every parameter's
    gradient; ``encoder``'s gradients are zeroed again after, for the step under test."""
    loss, _ = uncached_loss(encoder, columns, loss_fn, **loss_kwargs)
    loss.backward()
    grads = grads_of(encoder)
    encoder.zero_grad()
    return loss.detach(), grads


def per_mini_batch_loss(
    encoder: nn.Module,
    columns: Mapping[str, Mapping[str, Tensor]],
    loss_fn,
    mini_batch_size: int,
    *,
    mini_batch_tokens: int | None = None,
    mini_batch_length_multiple: int | None = None,
    **loss_kwargs,
):
    """The dropout reference: mini-batches encoded in the engine's order, with a graph, then the loss.

    Each mini-batch is cut to its longest row (right padding), so it draws the same dropout masks from
    the global stream as the engine's Step (1) does. With ``mini_batch_tokens`` the mini-batches are
    the engine's length groups (:func:`token_budget_groups`), and the reps are put back in row order.
    With ``mini_batch_length_multiple`` each cut length is rounded up to a multiple, at most the column's width
    (dropout draws as many numbers as the tensor has, so the engine's rounded shapes draw other masks).
    """
    reps = {}
    for name, features in columns.items():
        mask = features["attention_mask"]
        batch = mask.shape[0]
        if mini_batch_tokens is None:
            groups = [
                list(range(start, min(start + mini_batch_size, batch)))
                for start in range(0, batch, mini_batch_size)
            ]
        else:
            groups = token_budget_groups(mask, mini_batch_tokens, mini_batch_size)
        chunks = []
        for group in groups:
            mb = {k: v[group] for k, v in features.items()}
            keep = max(int(mb["attention_mask"].sum(dim=1).max()), 1)
            if mini_batch_length_multiple is not None:
                keep = min(-(-keep // mini_batch_length_multiple) * mini_batch_length_multiple, mask.shape[1])
            chunks.append(encoder(**{k: v[:, :keep] for k, v in mb.items()}))
        order = torch.tensor([row for group in groups for row in group])
        reps[name] = torch.cat(chunks)[torch.argsort(order)]  # grouped order -> row order
    return loss_fn(reps, **loss_kwargs)


def token_budget_groups(mask: Tensor, tokens: int, max_rows: int) -> list[list[int]]:
    """The rows of each token-budget mini-batch, written plainly: rows longest first (ties in row order),
    each group as many as fit ``len(group) x its longest <= tokens`` and ``max_rows`` (at least one)."""
    lengths = [int(row.sum()) for row in mask]  # right padding: a row's length is its mask's sum
    order = sorted(range(len(lengths)), key=lambda row: -lengths[row])
    groups: list[list[int]] = []
    for row in order:
        group = groups[-1] if groups else None
        if group and len(group) < max_rows and (len(group) + 1) * max(lengths[group[0]], 1) <= tokens:
            group.append(row)
        else:
            groups.append([row])
    return groups


def enable_checkpointing(model: BertForMaskedLM, *, use_reentrant: bool) -> None:
    """Turn on the model's activation checkpointing, reentrant or not. transformers 5.23 renames
    gradient_checkpointing_enable (deprecated) to activation_checkpointing_enable; the GPU machine's
    5.17 may only have the old name."""
    kwargs = {"use_reentrant": use_reentrant}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        assert model.is_activation_checkpointing
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        assert model.is_gradient_checkpointing


def grads_of(module: nn.Module) -> dict[str, Tensor]:
    """A copy of every parameter gradient (zeros where a parameter got none)."""
    return {
        name: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
        for name, p in module.named_parameters()
    }


def assert_grads_close(actual: Mapping[str, Tensor], expected: Mapping[str, Tensor], *, rtol: float) -> None:
    """Every gradient within ``rtol`` of the reference, relative to that parameter's largest gradient.

    The scale is per parameter because elementwise relative error is meaningless at the many entries
    that are zero up to rounding. It is floored at 1e-6 of the model's largest gradient: the attention
    key biases have an exactly zero gradient in exact arithmetic (softmax is invariant to a shift
    shared by all keys), so theirs is rounding noise (~1e-12) that any summation order changes.
    The reference must carry signal: an all-zero gradient everywhere would make any comparison pass.
    """
    assert actual.keys() == expected.keys()
    largest = max(float(g.abs().max()) for g in expected.values())
    assert largest > 0, "reference gradients are all zero"
    for name, ref in expected.items():
        scale = max(float(ref.abs().max()), 1e-6 * largest)
        torch.testing.assert_close(
            actual[name], ref, rtol=rtol, atol=rtol * scale, msg=lambda m, n=name: f"{n}: {m}"
        )


def splade_like_reps(
    B: int, V: int, k: int, *, seed: int, dtype: torch.dtype = torch.float32
) -> dict[str, Tensor]:
    """Non-negative, mostly zero [B, V] reps like a SPLADE head's (log1p(relu(.)) of fp64 logits) for the
    columns query, positive, negative_1 .. negative_k, drawn in that order from one generator seeded ``seed``."""
    g = torch.Generator().manual_seed(seed)
    names = ["query", "positive", *(f"negative_{j + 1}" for j in range(k))]
    return {
        name: torch.log1p(torch.relu(torch.randn(B, V, generator=g, dtype=torch.float64) * 2 - 1.5)).to(dtype)
        for name in names
    }


def leaf_copies(reps: Mapping[str, Tensor], dtype: torch.dtype | None = None) -> dict[str, Tensor]:
    """Each rep detached, cast to ``dtype`` (default: its own) and cloned, as a new leaf that records its grad."""
    return {n: r.detach().to(dtype or r.dtype).clone().requires_grad_(True) for n, r in reps.items()}


def assert_matches_reference(
    loss: Tensor,
    reference: Tensor,
    leaves: Mapping[str, Tensor],
    reference_leaves: Mapping[str, Tensor],
    *,
    rtol: float,
    atol: float,
) -> None:
    """``loss`` equals its fp64 ``reference``, and, after one backward of each, every leaf's gradient equals
    the reference leaf's of the same name: both compared in fp64 within the caller's ``rtol`` and ``atol``
    (the test states why they are that size for its dtype)."""
    assert reference.dtype == torch.float64, f"the reference is {reference.dtype}, not fp64"
    torch.testing.assert_close(loss.double(), reference, rtol=rtol, atol=atol)
    loss.backward()
    reference.backward()
    for name, leaf in leaves.items():
        assert leaf.grad is not None, f"{name}: no gradient"
        torch.testing.assert_close(
            leaf.grad.double(),
            reference_leaves[name].grad,
            rtol=rtol,
            atol=atol,
            msg=lambda m, n=name: f"{n}: {m}",
        )


class FailingEncoder(nn.Module):
    """Wraps an encoder; its ``fail_on``-th replay (a call with autograd recording: Step (3)) raises ``error``.

    With ``backward_in`` (a sub-module of the encoder), that replay's forward succeeds and ``error`` is
    raised in its backward, when the gradient reaches ``backward_in``: the parameters after it have then
    already accumulated part of the failing mini-batch, as after an out-of-memory error midway.
    """

    def __init__(
        self, encoder: nn.Module, *, fail_on: int, error: BaseException, backward_in: nn.Module | None = None
    ) -> None:
        super().__init__()
        self.encoder = encoder
        self.fail_on = fail_on
        self.error = error
        self.backward_in = backward_in
        self.replays = 0

    def forward(self, **features: Tensor) -> Tensor:
        if not torch.is_grad_enabled():
            return self.encoder(**features)
        self.replays += 1
        if self.replays != self.fail_on:
            return self.encoder(**features)
        if self.backward_in is None:
            raise self.error

        def fail(*_: object) -> None:
            handle.remove()
            raise self.error

        handle = self.backward_in.register_full_backward_hook(fail)
        return self.encoder(**features)


def failing_encoder(config: BertConfig, kind: str) -> FailingEncoder:
    """An encoder whose 4th replay fails: ``kind`` "exception" in its forward, "oom-in-backward" midway
    through its backward (a simulated ``torch.OutOfMemoryError`` when the gradient reaches layer 0: the
    head and layer 1 have accumulated part of that mini-batch by then)."""
    inner = make_encoder(config)
    if kind == "exception":
        return FailingEncoder(inner, fail_on=4, error=RuntimeError("encoder failed"))
    error = torch.OutOfMemoryError("simulated out of memory")
    return FailingEncoder(inner, fail_on=4, error=error, backward_in=inner.mlm.bert.encoder.layer[0])


def accumulate_earlier_micro_step(encoder: nn.Module) -> None:
    """Gradients in .grad as after an earlier accumulation micro-step (uncached), one parameter's left None."""
    uncached_loss(encoder, make_columns(4, 2, seed=7), contrastive_flops_loss)[0].backward()
    next(encoder.parameters()).grad = None


def saved_grads(module: nn.Module) -> dict[str, tuple[Tensor | None, Tensor | None]]:
    """Per parameter: its ``.grad`` tensor object (or None) and a copy of its values."""
    return {
        name: (p.grad, None if p.grad is None else p.grad.detach().clone())
        for name, p in module.named_parameters()
    }


def assert_grads_unchanged(
    module: nn.Module, saved: Mapping[str, tuple[Tensor | None, Tensor | None]]
) -> None:
    """Every ``.grad`` is what ``saved`` recorded: None stays None, a gradient is the same tensor, bitwise."""
    for name, p in module.named_parameters():
        grad, values = saved[name]
        if grad is None:
            assert p.grad is None, f"{name}: a gradient appeared"
        else:
            assert p.grad is grad, f"{name}: the .grad tensor was replaced"
            assert torch.equal(p.grad, values), f"{name}: the gradient changed"


def plan_inputs(
    mini_batch_size: Mapping[str, int | None] | int | None = None,
    *,
    checkpointing: bool = False,
    can_checkpoint: bool = False,
    graphs_possible: bool = False,
    **options: object,
) -> tuple[GradCacheConfig, EngineFacts]:
    """What a memory plan is made from, as the planner tests write it: the user's options (``options``: any
    GradCacheConfig field) and the encoder's facts (a module where CUDA graphs are possible)."""
    config = GradCacheConfig(mini_batch_size=mini_batch_size, **options)  # type: ignore[arg-type]
    facts = EngineFacts(module=graphs_possible, checkpointing=checkpointing, can_checkpoint=can_checkpoint)
    return config, facts
