"""Each provider's training step on one batch: ours (``CachedLoss`` over a ``SpladeEncoder``, or the plain
loss uncached) and sentence-transformers' ``CachedSpladeLoss``; the backbone options both get alike."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from transformers import PreTrainedModel

from benchmarks.harness import Step, autocast
from benchmarks.real_workload.configs import Config
from benchmarks.real_workload.models import build_sparse_encoder
from benchmarks.real_workload.workloads import COLUMNS
from gradcache_sparton import CachedLoss, SpladeEncoder, SpladeLoss, SpladeLossConfig
from gradcache_sparton.engine import GradCacheConfig

__all__ = [
    "make_ours",
    "make_sentence_transformers",
    "prepare_backbone",
    "splade_loss",
    "token_budget_parameter",
]

QUERY_WEIGHT, DOC_WEIGHT = 5e-4, 3e-4  # FLOPS weights, the same for both providers
LEARNING_RATE = 1e-5


def token_budget_parameter() -> str | None:
    """The name of GradCache's token-budget option, if this version has one (e.g. ``mini_batch_tokens``)."""
    names = [f.name for f in dataclasses.fields(GradCacheConfig) if "token" in f.name]
    return names[0] if names else None


def splade_loss() -> SpladeLoss:
    return SpladeLoss(SpladeLossConfig(query_reg_weight=QUERY_WEIGHT, doc_reg_weight=DOC_WEIGHT))


def prepare_backbone(backbone: PreTrainedModel, config: Config) -> None:
    """The options every provider's backbone gets alike: activation checkpointing (transformers' own,
    non-reentrant: each layer's activations recomputed in the backward) and ``torch.compile`` of the
    base model (the transformer stack; dynamic shapes, since every mini-batch is cut to its own longest
    row)."""
    if config.checkpointing:
        options = {"use_reentrant": False}
        if hasattr(backbone, "activation_checkpointing_enable"):  # the newer name (transformers 5.23)
            backbone.activation_checkpointing_enable(activation_checkpointing_kwargs=options)
        else:
            backbone.gradient_checkpointing_enable(gradient_checkpointing_kwargs=options)
    if config.compiled:
        # Static shapes where ours rounds its mini-batch lengths (one program per shape; dynamo's
        # recompile limit raised in main), dynamic ones otherwise (every mini-batch its own length).
        static = config.provider != "st" and config.mini_batch_length_multiple is not None
        backbone.base_model.compile(dynamic=not static, mode=config.compile_mode)


def mark_cudagraph_steps(model: torch.nn.Module, config: Config) -> None:
    """Under ``reduce-overhead`` (CUDA graphs), tell torch a new iteration begins at every encoder call.

    Both providers call their encoder once per mini-batch, in Step (1) and again in the replay; a
    graph's outputs live in memory its next replay overwrites, and torch's error for reading such an
    output recommends marking each call as a new iteration (``torch.compiler.cudagraph_mark_step_begin``),
    done here by a forward pre-hook on the encoder (not itself compiled). On the H100 our Step (3)
    still failed with that error (benchmarks/NOTES.md).
    """
    if config.compiled and config.compile_mode == "reduce-overhead":
        model.register_forward_pre_hook(lambda module, args: torch.compiler.cudagraph_mark_step_begin())


def make_ours(config: Config, path: Path, device: torch.device, token_param: str | None) -> tuple[Step, Any]:
    """Our step: CachedLoss (or the plain loss, uncached) over a SpladeEncoder with the Sparton head."""
    encoder = SpladeEncoder.from_pretrained(path).to(device).train()
    prepare_backbone(encoder.model, config)
    mark_cudagraph_steps(encoder, config)
    optimizer = torch.optim.AdamW(encoder.parameters(), lr=LEARNING_RATE, fused=device.type == "cuda")
    loss_fn = splade_loss()
    cached = None
    if config.provider == "ours":
        if config.tokens is not None:
            assert token_param is not None
            # Rows are then bounded by tokens only.
            kwargs: dict[str, Any] = {token_param: config.tokens, "mini_batch_size": config.batch}
        else:
            kwargs = {"mini_batch_size": config.mini_batch}
        kwargs["reuse_argmax"] = bool(config.reuse_argmax)  # explicit: the engine's default is automatic
        if config.sparse_reps:
            kwargs["sparse_reps"] = True
        if config.mini_batch_length_multiple is not None:
            kwargs["mini_batch_length_multiple"] = config.mini_batch_length_multiple
        if config.cuda_graphs:
            kwargs["cuda_graphs"] = True
        if config.compiled:
            # As the trainer does under torch_compile: the graph-less and the graph-recording programs
            # may fuse differently, so the replay need not be bitwise Step (1) (docs/engine.md).
            kwargs["check_replay"] = False
        cached = CachedLoss(encoder, loss_fn, **kwargs)

    def step(columns: dict[str, dict[str, Tensor]]) -> None:
        with autocast(device):
            if cached is not None:
                loss = cached(columns)
            else:
                loss, _ = loss_fn({name: encoder(**features) for name, features in columns.items()})
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step, encoder


def make_sentence_transformers(config: Config, path: Path, device: torch.device) -> tuple[Step, Any]:
    """sentence-transformers' step: CachedSpladeLoss over a SparseEncoder of the same weights.

    The backward runs inside the autocast too: sentence-transformers re-embeds (its Step (3)) inside
    ``backward()``, and under its Trainer the model's forward is autocast-wrapped by accelerate, so this
    is how its replay runs in training (outside autocast it would run in fp32).
    """
    from sentence_transformers.sparse_encoder.losses import (
        CachedSpladeLoss,
        SparseMultipleNegativesRankingLoss,
    )

    model = build_sparse_encoder(path, device).train()
    prepare_backbone(next(m for m in model.modules() if isinstance(m, PreTrainedModel)), config)
    mark_cudagraph_steps(model, config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, fused=device.type == "cuda")
    loss = CachedSpladeLoss(
        model,
        SparseMultipleNegativesRankingLoss(model, scale=1.0),
        document_regularizer_weight=DOC_WEIGHT,
        query_regularizer_weight=QUERY_WEIGHT,
        mini_batch_size=config.mini_batch or config.batch,
        mini_batch_num_tokens=config.tokens,
    )

    def step(columns: dict[str, dict[str, Tensor]]) -> None:
        with autocast(device):
            components = loss([dict(columns[c]) for c in COLUMNS], None)
            sum(components.values()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step, model
