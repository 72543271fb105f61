"""Real-workload training-step benchmark: ours (GradCache + Sparton) vs sentence-transformers, one process.

Legend: B batch (pairs), S sequence, D hidden, V vocabulary.

What one step is, for every provider: the same batch of ``--effective_batch`` (query, positive,
negative_1) triplets of real text, tokenized once with the bert-base-uncased tokenizer and padded to
each column's longest row (queries at most 64 tokens, passages at most 256), the same SPLADE loss
(InfoNCE over in-batch + hard negatives at temperature 1, FLOPS regularizers query 5e-4, doc 3e-4),
AdamW (lr 1e-5, fused on CUDA), bf16 autocast around the loss and its backward (fp32 on CPU), then
``optimizer.step()`` and ``zero_grad``. Providers, side by side:

  ours-mb<N>        ``CachedLoss(SpladeEncoder, SpladeLoss, mini_batch_size=N)`` (the Sparton head);
  ours+reuse-...    the same with ``reuse_argmax=True`` (``--reuse_argmax on`` or ``both``): the replay
                    rebuilds the head from Step (1)'s max and argmax instead of running its forward;
  ours+sparse-...   the same with ``sparse_reps=True`` (``--sparse_reps on`` or ``both``): Step (1) keeps
                    each column's reps as their non-zeros, not [B, V] (less memory for the cache);
  ours-tok<T>       the same with token-budget mini-batches of at most T tokens, when ``GradCache``
                    offers them (detected from its signature, ``mini_batch_tokens``; absent otherwise):
                    rows grouped by length, T bounds rows x the mini-batch's longest row;
  st-mb<N>          sentence-transformers' ``CachedSpladeLoss(SparseEncoder, SparseMultipleNegatives
                    RankingLoss(scale=1), document_regularizer_weight=3e-4, query_regularizer_weight=5e-4,
                    mini_batch_size=N)``; the SparseEncoder is ``Transformer(path, transformer_task=
                    "fill-mask")`` + ``SpladePooling("max")`` loaded from the same directory as ours;
  st-tok<T>         the same with ``mini_batch_num_tokens=T``: consecutive rows, T bounds their
                    non-padding tokens;
  ours-uncached     ``SpladeLoss({column: encoder(**features)})`` at the effective batch, halved until it
                    fits (each size tried is a row).

Backbone options, given to both providers alike (each provider runs once per setting):

  ...+ckpt          ``--checkpointing on|both``: activation checkpointing in the backbone (transformers'
                    ``activation_checkpointing_enable``, ``gradient_checkpointing_enable`` before 5.23;
                    non-reentrant): each layer's activations are recomputed in the backward, so a
                    memory budget holds larger mini-batches;
  ...+compile       ``--compile on|both``: the backbone's base model (the transformer stack) under
                    ``torch.compile(dynamic=True)`` (default mode: fused kernels, fewer launches per
                    encoder call); the head stays as it is (ours: the Sparton op; theirs: the MLM head
                    and SpladePooling). Ours runs it with ``check_replay=False``, as the trainer does
                    under ``torch_compile``; ours uncached is compiled too. Compilation falls in the
                    two warm-up steps (the row's ``warmup_s`` is the first). ``--compile_mode``
                    picks torch.compile's mode (``+compile-ro``: reduce-overhead, CUDA graphs; each
                    encoder call is then marked as a new iteration);
  ours+pad<m>-...   ``--pad_to_multiple_of m``: ours rounds each mini-batch's length up to a multiple of
                    m (``GradCache(pad_to_multiple_of=m)``; the same loss and gradients, a few shapes),
                    and a compiled backbone of ours is compiled with static shapes (dynamo's recompile
                    limit raised to 64). sentence-transformers has no such option: its compiled
                    backbone stays dynamic.
  ours+...+graphs   ``--cuda_graphs on|both`` (with ``--pad_to_multiple_of``): ours replays each
                    mini-batch's Step (1), and its Step (3) forward and backward, as one CUDA graph per
                    mini-batch shape (``GradCache(cuda_graphs=True)``), recorded in the warm-up steps;
                    row budgets only, not with ``reuse_argmax``.

Token budgets T are the row budgets N times the workload's mean tokens per passage, rounded to 256, so
``mb32`` and ``tok<T>`` aim at about the same activation memory. Both providers get the identical
padded tensors; both trim each mini-batch's trailing padding.

Workloads (``--workloads``), built from the shipped SciFact sample
(``gradcache_sparton/resources/scifact_sample/train.jsonl.gz``, 3,204 pairs: a claim or a sentence of
an abstract -> the abstract; on average 231 tokens per abstract and 33 per query, [CLS] and [SEP]
included):

  scifact   query -> positive as shipped (abstract: title + text), negative_1 = another row's
            abstract (a fixed permutation of the rows; never the row's own positive);
  short     MS MARCO-like passages of 40-120 tokens: each positive and negative is a window of
            uniform-random length in [40, 120] tokens of an abstract, starting at a sentence start.

Models (``--models``):

  tiny      the pretrained SPLADE-tiny (BERT-tiny shape: D 128, 2 layers, V 30,522; reps ~99% zeros),
            from ``--model_path`` (default: the package's copy, else ../shared's; the model is skipped
            with a message when neither exists);
  base      BERT-base width (D 768, 12 heads, FFN 3,072, 6 layers, V 30,522), random init, with the
            decoder bias set so that the reps of real text have ``--target_density`` non-zeros (2%:
            trained SPLADE models have 1-3%). Calibrated in the script: with the bias at 0 the max over
            positions of each (row, term) logit is computed on a sample of every column of every
            workload, and the bias is minus its (1 - target) quantile (a rep entry is non-zero exactly
            when that max plus the bias is positive). The measured non-zeros per row are printed and
            recorded. The weights are saved to a temporary directory that both providers load.

Before timing, each model's reps from ours and from the SparseEncoder are compared on a few rows (eval
mode, fp32): the JSON records the largest difference (the same weights give the same function).

Measurement per configuration: a fresh model from the same initial weights and a fresh optimizer;
``torch.cuda.reset_peak_memory_stats`` before the first step; one warm-up step (two when it is cheap;
Triton compilation, AdamW state); then up to ``--steps`` timed steps, each on a different batch,
wall time between two ``torch.cuda.synchronize`` calls. A row reports the median's pairs/s (pairs per
step = effective batch), the peak ``torch.cuda.max_memory_allocated`` over all its steps (weights,
gradients and AdamW state included), for ours the mean non-zeros per row of each column (64 rows,
after its steps), and with
``--busy_fraction`` (CUDA; off by default) the device-busy fraction of one more step run under
``torch.profiler`` (sum of its kernel times over the median wall time; with ``--profile_host`` the
host's operators are recorded too and that step's operators by host time go to
``profile_<configuration>.txt``: slow at small mini-batches), and with ``--sync_audit`` (CUDA) the
host-device synchronisations of one more step, counted by call site (``torch.cuda.set_sync_debug_mode``);
with ``--cprofile`` (CUDA) one more step under cProfile, its table in ``cprofile_<configuration>.txt``.
A configuration that runs out
of memory is a row with status "OOM"; one not started within ``--time_budget_s`` is "skipped".

The targets of issue 15 are computed within each (model, workload): for memory budgets of 4 GiB,
8 GiB and unlimited, our best pairs/s and sentence-transformers' best among the rows that fit, and
their ratio; our best at 4 GiB over our best at 8 GiB; our best cached over our best uncached.

Run on the GPU machine from the repository root. One (model, workload) with the default four budgets
(17 configurations, 2 timed steps each) takes about 5 minutes on an H100 for base/scifact, less for
the others, so a session of 10-minute calls runs them one or two per call and merges the JSON files:

    export PYTHONPATH=$PWD:$PYTHONPATH PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True HF_HUB_OFFLINE=1
    python benchmarks/bench_real_workload.py --models base --workloads scifact --output_dir $OUT/rw1
    python benchmarks/bench_real_workload.py --models base --workloads short --output_dir $OUT/rw2
    python benchmarks/bench_real_workload.py --models tiny --output_dir $OUT/rw3
    python benchmarks/bench_real_workload.py --merge rw1/real_workload.json rw2/real_workload.json \
        rw3/real_workload.json --output_dir rw        # one table, targets and plot (no GPU needed)

``--time_budget_s`` (420) records every configuration not started by then as skipped, so a call ends
in about 8 minutes whatever it was given.

It writes ``real_workload.json`` (rows, targets, calibration, device, versions, date; rewritten after
every configuration), ``real_workload.md`` and, when matplotlib is importable, ``real_workload.png``
(pairs/s against peak memory) under ``--output_dir``. ``--smoke`` runs everything at tiny sizes (a
tiny random model instead of the pretrained one, few rows) on a CPU in seconds; its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import gzip
import inspect
import json
import math
import os
import random
import re
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
from common import headless_pyplot, run_stamp  # benchmarks/common.py, beside this script
from torch import Tensor
from transformers import (
    AutoTokenizer,
    BertConfig,
    BertForMaskedLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from gradcache_sparton import CachedLoss, GradCache, SpladeEncoder, SpladeLoss, SpladeLossConfig
from gradcache_sparton.resources import RESOURCES_DIR, default_tokenizer_path

GiB = 2**30
ROOT = Path(__file__).resolve().parents[1]
COLUMNS = ("query", "positive", "negative_1")
SCIFACT_TRAIN = RESOURCES_DIR / "scifact_sample" / "train.jsonl.gz"
PACKAGED_MODEL = RESOURCES_DIR / "splade-tiny-msmarco"
SHARED_MODEL = ROOT.parent / "shared" / "models" / "splade-tiny-msmarco"
QUERY_WEIGHT, DOC_WEIGHT = 5e-4, 3e-4  # FLOPS weights, the same for both providers
LEARNING_RATE = 1e-5
NNZ_ROWS = 64  # rows whose reps' non-zeros a row reports (eval mode, fp32)
SHORT_PASSAGE_TOKENS = (40, 120)
MEMORY_BUDGETS_GIB = (4.0, 8.0, None)  # issue 15's budgets; None: unlimited
SETTINGS = {"off": (False,), "on": (True,), "both": (False, True)}  # an off / on / both option's values
# Issue 15's thresholds (ratios within one run).
SPEEDUP_MIN, SMALL_BUDGET_MIN, CACHED_VS_UNCACHED_MIN = 2.0, 0.85, 0.72


@dataclass(frozen=True)
class Scale:
    """Every size the benchmark uses; ``FULL`` is issue 15's, ``SMOKE`` a CPU-sized stand-in."""

    query_max_len: int
    doc_max_len: int
    short_tokens: tuple[int, int]
    base_hidden: int
    base_layers: int
    base_heads: int
    base_ffn: int
    calibration_rows: int


FULL = Scale(64, 256, SHORT_PASSAGE_TOKENS, 768, 6, 12, 3072, 32)
SMOKE = Scale(16, 32, (8, 24), 32, 2, 2, 64, 4)


# ---------------------------------------------------------------------------------------------------
# Workloads: real text
# ---------------------------------------------------------------------------------------------------


def read_scifact_pairs(path: Path = SCIFACT_TRAIN) -> list[tuple[str, str]]:
    """(query, positive) pairs of the shipped SciFact sample, in file order."""
    with gzip.open(path, "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [(row["query"], row["positive"]) for row in rows]


def scifact_triplets(pairs: Sequence[tuple[str, str]], seed: int) -> list[dict[str, str]]:
    """query -> positive, negative_1 = the positive of another row (a fixed permutation, never its own)."""
    order = list(range(len(pairs)))
    random.Random(seed).shuffle(order)
    triplets = []
    for i, (query, positive) in enumerate(pairs):
        j = order[i]
        while pairs[j][1] == positive:  # rows sharing an abstract: take the next one
            j = (j + 1) % len(pairs)
        triplets.append({"query": query, "positive": positive, "negative_1": pairs[j][1]})
    return triplets


_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z0-9(\[])")


def passage_window(text: str, length: int, tokenizer: PreTrainedTokenizerBase, rng: random.Random) -> str:
    """About ``length`` wordpieces of ``text``, starting at a sentence start chosen by ``rng``."""
    sentences = _SENTENCE_END.split(text)
    starts = list(range(len(sentences)))
    rng.shuffle(starts)
    for start in starts:  # the first start that leaves enough text, else the whole text
        ids = tokenizer(" ".join(sentences[start:]), add_special_tokens=False)["input_ids"]
        if len(ids) >= length:
            return tokenizer.decode(ids[:length])
    return text


def short_triplets(
    triplets: Sequence[dict[str, str]],
    tokenizer: PreTrainedTokenizerBase,
    lengths: tuple[int, int],
    seed: int,
) -> list[dict[str, str]]:
    """MS MARCO-like rows: each passage a window of uniform-random length in ``lengths`` tokens."""
    rng = random.Random(seed)
    return [
        {
            "query": row["query"],
            **{c: passage_window(row[c], rng.randint(*lengths), tokenizer, rng) for c in COLUMNS[1:]},
        }
        for row in triplets
    ]


@dataclass
class Workload:
    """The step batches of one workload (tokenized once, kept on the device) and their mean lengths."""

    name: str
    batches: list[dict[str, dict[str, Tensor]]]
    mean_doc_tokens: float
    mean_query_tokens: float


def tokenize_rows(
    rows: Sequence[dict[str, str]], tokenizer: PreTrainedTokenizerBase, scale: Scale, device: torch.device
) -> dict[str, dict[str, Tensor]]:
    """One step's columns: [B, S_column] features, padded to each column's longest row."""
    columns = {}
    for column in COLUMNS:
        max_length = scale.query_max_len if column == "query" else scale.doc_max_len
        features = tokenizer(
            [row[column] for row in rows],
            padding=True,
            truncation=True,
            max_length=max_length,
            return_tensors="pt",
        )
        columns[column] = {name: value.to(device) for name, value in features.items()}
    return columns


def take_rows(columns: dict[str, dict[str, Tensor]], n: int) -> dict[str, dict[str, Tensor]]:
    """The first ``n`` rows of every column, cut to their own longest row (as a collator pads them)."""
    out = {}
    for column, features in columns.items():
        if features["input_ids"].shape[0] <= n:
            out[column] = features
            continue
        keep = int(features["attention_mask"][:n].sum(dim=1).max())  # right padding: lengths are counts
        out[column] = {name: value[:n, :keep] for name, value in features.items()}
    return out


def build_workload(
    name: str,
    rows: list[dict[str, str]],
    tokenizer: PreTrainedTokenizerBase,
    scale: Scale,
    batch: int,
    n_batches: int,
    device: torch.device,
) -> Workload:
    """``n_batches`` consecutive batches of ``batch`` rows (wrapping around ``rows``)."""
    batches = []
    for i in range(n_batches):
        chosen = [rows[(i * batch + k) % len(rows)] for k in range(batch)]
        batches.append(tokenize_rows(chosen, tokenizer, scale, device))

    def mean_tokens(columns: Sequence[str]) -> float:
        counts = [b[c]["attention_mask"].sum(dim=1).float() for b in batches for c in columns]
        return float(torch.cat(counts).mean())

    return Workload(name, batches, mean_tokens(COLUMNS[1:]), mean_tokens(COLUMNS[:1]))


# ---------------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------------


def default_model_path() -> Path:
    """The shipped SPLADE-tiny if the package has it, else the shared copy."""
    return PACKAGED_MODEL if PACKAGED_MODEL.is_dir() else SHARED_MODEL


def save_model_dir(model: BertForMaskedLM, tokenizer: PreTrainedTokenizerBase, path: Path) -> Path:
    """A directory both providers load: the masked LM and its tokenizer."""
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def max_logits(model: BertForMaskedLM, features: dict[str, Tensor], chunk: int = 8) -> Tensor:
    """[B, V] max over the kept positions of the masked-LM logits (fp32, no grad)."""
    out = []
    with torch.no_grad():
        for start in range(0, features["input_ids"].shape[0], chunk):
            part = {name: value[start : start + chunk] for name, value in features.items()}
            logits = model(**part).logits.float()  # [b, S, V]
            kept = part["attention_mask"].bool()[:, :, None]  # [b, S, 1]
            out.append(logits.masked_fill(~kept, -math.inf).amax(dim=1))  # [b, V]
    return torch.cat(out)


def calibrate_decoder_bias(
    model: BertForMaskedLM, samples: Sequence[dict[str, Tensor]], target_density: float
) -> float:
    """Set the decoder bias (one value) so that a fraction ``target_density`` of rep entries is non-zero.

    A SPLADE rep entry log1p(relu(max_s logit + b)) is non-zero exactly when max_s logit + b > 0, so with
    the bias at 0 the answer is minus the (1 - target) quantile of the max logits over the samples.
    """
    bias = model.get_output_embeddings().bias
    with torch.no_grad():
        bias.zero_()
        maxima = torch.cat([max_logits(model, s).flatten().cpu() for s in samples])  # [rows * V]
        k = max(1, min(maxima.numel(), maxima.numel() - round(target_density * maxima.numel())))
        value = -float(maxima.kthvalue(k).values)
        bias.fill_(value)
    return value


def nonzeros_per_row(encoder: SpladeEncoder, columns: dict[str, dict[str, Tensor]]) -> dict[str, float]:
    """Mean non-zeros per row of each column's reps (eval mode, no grad)."""
    was_training = encoder.training
    encoder.eval()
    with torch.no_grad():
        nnz = {c: float((encoder(**f) > 0).sum(dim=1).float().mean()) for c, f in columns.items()}
    encoder.train(was_training)
    return nnz


def sentence_transformers_version() -> str | None:
    try:
        import sentence_transformers
    except ImportError:
        return None
    return sentence_transformers.__version__


def build_sparse_encoder(path: Path, device: torch.device) -> Any:
    """sentence-transformers' SPLADE model from the same directory: masked LM + max SpladePooling."""
    from sentence_transformers import SparseEncoder
    from sentence_transformers.sparse_encoder.modules import SpladePooling, Transformer

    modules = [Transformer(str(path), transformer_task="fill-mask"), SpladePooling(pooling_strategy="max")]
    return SparseEncoder(modules=modules, device=str(device))


def rep_difference(path: Path, features: dict[str, Tensor], device: torch.device) -> float:
    """Largest |ours - sentence-transformers| rep entry on ``features`` (eval mode, fp32)."""
    ours = SpladeEncoder.from_pretrained(path).to(device).eval()
    theirs = build_sparse_encoder(path, device).eval()
    with torch.no_grad():
        diff = (ours(**features) - theirs(dict(features))["sentence_embedding"]).abs().max()
    return float(diff)


# ---------------------------------------------------------------------------------------------------
# Configurations and steps
# ---------------------------------------------------------------------------------------------------


def token_budget_parameter() -> str | None:
    """The name of GradCache's token-budget argument, if this version has one (e.g. ``mini_batch_tokens``)."""
    names = [n for n in inspect.signature(GradCache.__init__).parameters if "token" in n]
    cached = set(inspect.signature(CachedLoss.__init__).parameters)
    names = [n for n in names if n in cached]
    return names[0] if names else None


@dataclass(frozen=True)
class Config:
    """One row: model, workload, provider ("ours" | "st" | "ours-uncached") and its mini-batch budget."""

    model: str
    workload: str
    provider: str
    mini_batch: int | None = None  # rows per mini-batch
    tokens: int | None = None  # tokens per mini-batch
    batch: int = 0  # pairs per step
    reuse_argmax: bool = False  # ours: the replay rebuilds the head from Step (1)'s record
    sparse_reps: bool = False  # ours: Step (1) keeps each column's reps as their non-zeros
    checkpointing: bool = False  # activation checkpointing in the backbone (either provider)
    compiled: bool = False  # the backbone under torch.compile (either provider)
    compile_mode: str = "default"  # torch.compile's mode when compiled ("reduce-overhead": CUDA graphs)
    pad_to_multiple_of: int | None = None  # ours: mini-batch lengths rounded up (static shapes)
    cuda_graphs: bool = False  # ours: each mini-batch's Step (1) and Step (3) as one CUDA graph per shape

    @property
    def name(self) -> str:
        budget = f"-mb{self.mini_batch}" if self.mini_batch else f"-tok{self.tokens}" if self.tokens else ""
        return f"{self.model}/{self.workload}/{self.variant}{budget}-b{self.batch}"

    @property
    def variant(self) -> str:
        """The provider, with ``+reuse`` / ``+sparse`` / ``+ckpt`` / ``+compile`` for the options it runs with."""
        return _variant(asdict(self))

    @property
    def family(self) -> str:
        """The plot series: provider variant and kind of budget."""
        kind = "-mb" if self.mini_batch else "-tok" if self.tokens else ""
        return self.variant + kind


def autocast(device: torch.device) -> contextlib.AbstractContextManager[object]:
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()  # CPU (smoke): fp32


def splade_loss() -> SpladeLoss:
    return SpladeLoss(SpladeLossConfig(query_reg_weight=QUERY_WEIGHT, doc_reg_weight=DOC_WEIGHT))


Step = Callable[[dict[str, dict[str, Tensor]]], None]


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
        static = config.provider != "st" and config.pad_to_multiple_of is not None
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
            kwargs: dict[str, Any] = {token_param: config.tokens}
            if (
                inspect.signature(CachedLoss.__init__).parameters["mini_batch_size"].default
                is inspect.Parameter.empty
            ):
                kwargs["mini_batch_size"] = config.batch  # required: rows are then bounded by tokens only
        else:
            kwargs = {"mini_batch_size": config.mini_batch}
        if config.reuse_argmax:
            kwargs["reuse_argmax"] = True
        if config.sparse_reps:
            kwargs["sparse_reps"] = True
        if config.pad_to_multiple_of is not None:
            kwargs["pad_to_multiple_of"] = config.pad_to_multiple_of
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


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def is_oom(exc: BaseException) -> bool:
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and ("out of memory" in text.lower() or "ALLOC_FAILED" in text)


class Bench:
    """Runs configurations; each builds its model from a directory, times its steps and frees it."""

    def __init__(self, args: argparse.Namespace, device: torch.device) -> None:
        self.args = args
        self.device = device
        self.cuda = device.type == "cuda"
        self.token_param = token_budget_parameter()

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def timed(self, step: Step, columns: dict[str, dict[str, Tensor]]) -> float:
        """Seconds of one step, CUDA-synchronized wall time."""
        self.sync()
        start = time.perf_counter()
        step(columns)
        self.sync()
        return time.perf_counter() - start

    def sync_sites(self, step: Step, columns: dict[str, dict[str, Tensor]]) -> dict[str, int]:
        """Host-device synchronisations of one step, by call site (the innermost frames outside torch).

        One step runs under ``torch.cuda.set_sync_debug_mode("warn")``: every operation that waits for
        the device (``.item()``, ``.tolist()``, ``nonzero``, a copy to the host, ...) warns, and each
        warning is attributed to the innermost three Python frames outside torch that issued it; a
        sync with no such frame (e.g. from autograd's worker thread) is counted under an empty site.
        """
        import warnings

        sites: dict[str, int] = {}
        show = warnings.showwarning

        def record(message, category, filename, lineno, file=None, line=None) -> None:
            if "synchronizing" not in str(message):
                return show(message, category, filename, lineno, file, line)
            frames = [
                f for f in traceback.extract_stack()[:-1]
                if "/torch/" not in f.filename and Path(f.filename).name != "warnings.py"
            ]  # fmt: skip
            site = " <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(frames[-3:]))
            sites[site] = sites.get(site, 0) + 1

        self.sync()
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            torch.cuda.set_sync_debug_mode("warn")
            try:
                step(columns)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        self.sync()
        return dict(sorted(sites.items(), key=lambda kv: -kv[1]))

    def busy_seconds(self, step: Step, columns: dict[str, dict[str, Tensor]], config: Config) -> float:
        """Device-busy seconds of one step: the sum of its kernels' durations under torch.profiler.

        Only the device's activity is recorded, unless ``--profile_host``: then the host's operators
        too (a profiled 16-row step then outlasts a 4-minute call: ~200,000 events), and the step's
        operators by host time (self CPU, top 40) go to ``profile_<config>.txt`` in the output folder.
        """
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CUDA]
        if self.args.profile_host:
            activities.append(ProfilerActivity.CPU)
        with profile(activities=activities) as prof:
            self.timed(step, columns)
        averages = prof.key_averages()
        if self.args.profile_host:
            out = Path(self.args.output_dir)
            out.mkdir(parents=True, exist_ok=True)
            table = averages.table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=60)
            (out / f"profile_{_file_stem(config)}.txt").write_text(table)
        busy = sum(e.self_device_time_total for e in averages if e.device_type.name == "CUDA") / 1e6
        if busy <= 0:  # a step launches kernels: none recorded is a profiler failure, not an idle device
            raise RuntimeError("torch.profiler recorded no device kernels for the profiled step")
        return busy

    def python_profile(self, step: Step, columns: dict[str, dict[str, Tensor]], config: Config) -> float:
        """Host seconds of one step under cProfile; its functions by own and by cumulative time (top 60
        each) go to ``cprofile_<config>.txt`` in the output folder. Where the host bounds the step, this
        is where its time goes (cProfile's own cost inflates small Python functions)."""
        import cProfile
        import io
        import pstats

        profiler = cProfile.Profile()
        self.sync()
        start = time.perf_counter()
        profiler.enable()
        step(columns)
        profiler.disable()
        self.sync()
        seconds = time.perf_counter() - start
        text = io.StringIO()
        stats = pstats.Stats(profiler, stream=text)
        stats.sort_stats("tottime").print_stats(60)
        stats.sort_stats("cumulative").print_stats(60)
        out = Path(self.args.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"cprofile_{_file_stem(config)}.txt").write_text(text.getvalue())
        return seconds

    def measure(self, config: Config, path: Path, workload: Workload) -> dict[str, Any]:
        """Warm-up, timed steps and the row's numbers (raises on out-of-memory)."""
        if config.provider == "st":
            step, model = make_sentence_transformers(config, path, self.device)
        else:
            step, model = make_ours(config, path, self.device, self.token_param)
        batches = [take_rows(b, config.batch) for b in workload.batches]
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        last = first = self.timed(step, batches[0])
        warmup = 1
        # A compiled backbone compiles in the first step and may recompile in the second (other shapes);
        # CUDA graphs record the shapes met in the first two steps: with one warm-up step (the first
        # graphed configuration of a process, whose first step compiles Triton's kernels, took > 2 s)
        # the timed step recorded graphs too: 319 pairs/s at 16 rows against 691 with two (H200).
        second = first < 2.0 or config.compiled or config.cuda_graphs
        if second and len(batches) > 2 and not self.args.smoke:
            last = self.timed(step, batches[1])
            warmup = 2
        n_timed = max(
            1, min(self.args.steps, len(batches) - warmup, math.floor(self.args.seconds_per_config / last))
        )
        times = [self.timed(step, batches[warmup + i]) for i in range(n_timed)]
        median = statistics.median(times)
        row: dict[str, Any] = {
            "step_s_median": median,
            "step_s": times,
            "pairs_per_s": config.batch / median,
            "warmup_steps": warmup,
            "warmup_s": first,
            "timed_steps": n_timed,
        }
        if self.cuda:
            row["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / GiB
            row["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / GiB
            if self.args.busy_fraction:
                row["busy_fraction"] = self.busy_seconds(step, batches[0], config) / median
            if self.args.cprofile:
                row["cprofile_step_s"] = self.python_profile(step, batches[0], config)
            if self.args.sync_audit:
                sites = self.sync_sites(step, batches[0])
                row["syncs_per_step"] = sum(sites.values())
                row["sync_sites"] = sites
        if isinstance(model, SpladeEncoder):
            row["nnz_per_row"] = nonzeros_per_row(model, take_rows(batches[0], NNZ_ROWS))  # after training
        return row

    def run(self, config: Config, path: Path, workload: Workload) -> dict[str, Any]:
        """One row: the measurements, or status "OOM" / "error: ..."; memory is freed either way."""
        row = header(config)
        status = "ok"
        try:
            row.update(self.measure(config, path, workload))
        except Exception as exc:  # one broken configuration must not lose the others' rows
            if is_oom(exc):
                status = "OOM"
            else:
                traceback.print_exc()
                status = f"error: {type(exc).__name__}: {exc}"[:300]
        # Outside the except block: the traceback (and the step's graph it references) is gone.
        free_memory(self.device)
        row["status"] = status
        return row


def _file_stem(config: Config) -> str:
    """The configuration's name as a file name: letters, digits, dots and dashes (``+`` and ``/`` -> ``_``)."""
    return re.sub(r"[^A-Za-z0-9.-]", "_", config.name)


def header(config: Config) -> dict[str, Any]:
    return {"name": config.name, **asdict(config), "family": config.family}


def plan(
    model: str,
    workload: Workload,
    mini_batches: Sequence[int],
    batch: int,
    token_param: str | None,
    with_st: bool,
    *,
    reuse: Sequence[bool] = (False,),
    sparse_reps: Sequence[bool] = (False,),
    token_budgets: bool = True,
    checkpointing: Sequence[bool] = (False,),
    compiled: Sequence[bool] = (False,),
    compile_mode: str = "default",
    pad_to_multiple_of: int | None = None,
    cuda_graphs: Sequence[bool] = (False,),
) -> list[Config]:
    """The configurations of one (model, workload), budget by budget, ours and theirs side by side: each
    provider once per ``checkpointing`` x ``compiled`` setting (the backbone options both get alike;
    compiled ones in ``compile_mode``), ours also once per ``reuse`` x ``sparse_reps`` setting (reuse
    not with ``compiled``: a compiled encoder records no argmax to reuse) and per ``cuda_graphs``
    setting (not with reuse, nor by tokens), with its mini-batch lengths rounded up to
    ``pad_to_multiple_of``; by tokens too unless ``token_budgets`` is False."""
    backbone_options = [
        {"checkpointing": c, "compiled": k, "compile_mode": compile_mode if k else "default"}
        for c in checkpointing
        for k in compiled
    ]
    ours_options = [
        {
            "reuse_argmax": r,
            "sparse_reps": sr,
            "pad_to_multiple_of": pad_to_multiple_of,
            "cuda_graphs": g,
            **o,
        }
        for o in backbone_options
        for r in reuse
        for sr in sparse_reps
        for g in cuda_graphs
        if not (r and o["compiled"]) and not (r and g)
    ]
    configs: list[Config] = []
    for mb in mini_batches:
        budgets = [{"mini_batch": mb}]
        if token_budgets:
            budgets.append({"tokens": token_budget(mb, workload)})
        for budget in budgets:
            if "tokens" not in budget or token_param is not None:
                configs += [
                    Config(model, workload.name, "ours", batch=batch, **budget, **o)
                    for o in ours_options
                    if not ("tokens" in budget and o["cuda_graphs"])  # a row count per mini-batch
                ]
            if with_st:
                configs += [
                    Config(model, workload.name, "st", batch=batch, **budget, **o) for o in backbone_options
                ]
    return configs


def token_budget(mini_batch: int, workload: Workload) -> int:
    """Tokens per mini-batch matching ``mini_batch`` rows of the workload's mean passage, rounded to 256."""
    return max(256, round(mini_batch * workload.mean_doc_tokens / 256) * 256)


# ---------------------------------------------------------------------------------------------------
# Targets, tables, plot
# ---------------------------------------------------------------------------------------------------


def _best(rows: list[dict], limit_gib: float | None) -> dict | None:
    fits = [
        r
        for r in rows
        if r["status"] == "ok" and (limit_gib is None or r.get("peak_allocated_gib", 0) <= limit_gib)
    ]
    return max(fits, key=lambda r: r["pairs_per_s"]) if fits else None


def _target(
    group: str, target: str, value: float | None, threshold: str, passed: bool | None, detail: str
) -> dict:
    status = "n/a" if passed is None else ("PASS" if passed else "MISS")
    return {
        "group": group,
        "target": target,
        "value": value,
        "threshold": threshold,
        "status": status,
        "detail": detail,
    }


def _variant(row: dict) -> str:
    """A row's provider with its options: ``+reuse`` (reuse_argmax), ``+sparse`` (sparse_reps), ``+ckpt``
    (activation checkpointing), ``+compile`` (a compiled backbone, ``+compile-ro`` in mode
    reduce-overhead), ``+pad<m>`` (lengths rounded up to m), ``+graphs`` (cuda_graphs); rows of older
    runs lack these keys."""
    options = (
        ("reuse_argmax", "+reuse"),
        ("sparse_reps", "+sparse"),
        ("checkpointing", "+ckpt"),
        ("compiled", "+compile"),
    )
    name = row["provider"] + "".join(suffix for key, suffix in options if row.get(key))
    if row.get("compiled") and row.get("compile_mode", "default") != "default":
        name += "-ro"  # reduce-overhead, the one other mode
    if row.get("pad_to_multiple_of"):
        name += f"+pad{row['pad_to_multiple_of']}"
    if row.get("cuda_graphs"):
        name += "+graphs"
    return name


def _label(row: dict | None) -> str:
    if row is None:
        return "none fits"
    peak = row.get("peak_allocated_gib")
    memory = f", {peak:.1f} GiB" if peak is not None else ""
    return (
        f"{_variant(row)}{'-mb' + str(row['mini_batch']) if row['mini_batch'] else ''}"
        + (f"-tok{row['tokens']}" if row["tokens"] else "")
        + f" {row['pairs_per_s']:.0f} pairs/s{memory}"
    )


def evaluate_targets(rows: list[dict]) -> list[dict]:
    """Issue 15's targets per (model, workload), as ratios between rows of this run."""
    targets = []
    for group in dict.fromkeys(f"{r['model']}/{r['workload']}" for r in rows):
        mine = [r for r in rows if f"{r['model']}/{r['workload']}" == group]
        ours = [r for r in mine if r["provider"] == "ours"]
        theirs = [r for r in mine if r["provider"] == "st"]
        for limit in MEMORY_BUDGETS_GIB:
            name = f"ours vs sentence-transformers at {'unlimited memory' if limit is None else f'<= {limit:g} GiB'}"
            a, b = _best(ours, limit), _best(theirs, limit)
            if a is None or b is None:
                targets.append(
                    _target(group, name, None, f">= {SPEEDUP_MIN}x", None, f"{_label(a)} vs {_label(b)}")
                )
                continue
            ratio = a["pairs_per_s"] / b["pairs_per_s"]
            targets.append(
                _target(
                    group,
                    name,
                    ratio,
                    f">= {SPEEDUP_MIN}x",
                    ratio >= SPEEDUP_MIN,
                    f"{_label(a)} vs {_label(b)}",
                )
            )
        small, large = _best(ours, MEMORY_BUDGETS_GIB[0]), _best(ours, MEMORY_BUDGETS_GIB[1])
        name = "ours at 4 GiB / ours at 8 GiB"
        if small and large:
            ratio = small["pairs_per_s"] / large["pairs_per_s"]
            targets.append(
                _target(group, name, ratio, f">= {SMALL_BUDGET_MIN}", ratio >= SMALL_BUDGET_MIN, "")
            )
        else:
            targets.append(_target(group, name, None, f">= {SMALL_BUDGET_MIN}", None, "missing rows"))
        cached, uncached = (
            _best(ours, None),
            _best([r for r in mine if r["provider"] == "ours-uncached"], None),
        )
        name = "ours cached / ours uncached"
        if cached and uncached:
            ratio = cached["pairs_per_s"] / uncached["pairs_per_s"]
            detail = (
                f"{_label(cached)} vs uncached b{uncached['batch']} {uncached['pairs_per_s']:.0f} pairs/s"
            )
            targets.append(
                _target(
                    group,
                    name,
                    ratio,
                    f">= {CACHED_VS_UNCACHED_MIN}",
                    ratio >= CACHED_VS_UNCACHED_MIN,
                    detail,
                )
            )
        else:
            targets.append(_target(group, name, None, f">= {CACHED_VS_UNCACHED_MIN}", None, "missing rows"))
    return targets


def _cell(x: object, fmt: str = "{:.2f}") -> str:
    if x is None:
        return "-"
    return fmt.format(x) if isinstance(x, float) else str(x)


TABLE_HEAD = [
    "model",
    "workload",
    "provider",
    "mb",
    "tokens",
    "B",
    "status",
    "step s",
    "pairs/s",
    "peak GiB",
    "busy",
    "syncs",
    "nnz q/d",
]
TARGET_HEAD = ["model/workload", "target", "value", "threshold", "status", "detail"]


def table_rows(rows: list[dict]) -> list[list[str]]:
    out = []
    for r in rows:
        nnz = r.get("nnz_per_row")
        out.append([
            r["model"], r["workload"], _variant(r), _cell(r["mini_batch"]), _cell(r["tokens"]), str(r["batch"]),
            r["status"], _cell(r.get("step_s_median"), "{:.3f}"),
            _cell(r.get("pairs_per_s"), "{:.0f}"), _cell(r.get("peak_allocated_gib")), _cell(r.get("busy_fraction")),
            _cell(r.get("syncs_per_step"), "{}"),
            f"{nnz['query']:.0f}/{nnz['positive']:.0f}" if nnz else "-",
        ])  # fmt: skip
    return out


def target_rows(targets: list[dict]) -> list[list[str]]:
    return [
        [t["group"], t["target"], _cell(t["value"], "{:.3g}"), t["threshold"], t["status"], t["detail"]]
        for t in targets
    ]


def markdown(meta: dict, rows: list[dict], targets: list[dict]) -> str:
    def md(head: list[str], body: list[list[str]]) -> str:
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        return "\n".join(lines + ["| " + " | ".join(b) + " |" for b in body])

    stamp = ", ".join(
        f"{k} {meta.get(k)}"
        for k in ("device", "torch", "triton", "transformers", "sentence_transformers", "date")
    )
    calibration = "\n".join(f"- {k}: {json.dumps(v)}" for k, v in meta.get("models", {}).items())
    return (
        f"Real-workload benchmark ({stamp}; `{meta.get('command')}`)\n\nModels:\n{calibration}\n\n"
        + md(TABLE_HEAD, table_rows(rows))
        + "\n\nTargets\n\n"
        + md(TARGET_HEAD, target_rows(targets))
        + "\n"
    )


def show(head: list[str], body: list[list[str]]) -> None:
    widths = [max(len(x) for x in col) for col in zip(head, *body, strict=True)]
    for line in [head, *body]:
        print("  ".join(x.ljust(w) for x, w in zip(line, widths, strict=True)))
    sys.stdout.flush()


# One color per provider with its options; sentence-transformers' in warm colors, ours in cool ones.
VARIANT_COLORS = {
    "ours": "tab:blue", "ours+reuse": "tab:green", "ours+ckpt": "tab:cyan", "ours+reuse+ckpt": "tab:olive",
    "ours+compile": "tab:purple", "ours+ckpt+compile": "tab:pink", "ours+sparse": "navy",
    "ours+reuse+sparse": "darkgreen", "ours+sparse+ckpt": "teal", "ours+reuse+sparse+ckpt": "yellowgreen",
    "ours+sparse+compile": "slateblue", "ours+sparse+ckpt+compile": "magenta", "ours-uncached": "tab:gray",
    "ours-uncached+compile": "black", "st": "tab:red", "st+ckpt": "tab:orange", "st+compile": "tab:brown",
    "st+ckpt+compile": "gold",
}  # fmt: skip


def _plot_style(family: str) -> tuple[str, str]:
    """(matplotlib format, color) of a plot series: circles for rows per mini-batch, squares for tokens,
    diamonds for uncached; solid lines for ours, dashed for sentence-transformers."""
    variant, _, kind = family.rpartition("-") if family.endswith(("-mb", "-tok")) else (family, "", "")
    marker = {"mb": "o", "tok": "s"}.get(kind, "D")
    line = "" if marker == "D" else "--" if variant.startswith("st") else "-"
    return marker + line, VARIANT_COLORS.get(variant, "tab:gray")


def plot(rows: list[dict], path: Path) -> str:
    """pairs/s against peak memory, one panel per (model, workload), one series per provider and budget kind."""
    plt = headless_pyplot()
    if plt is None:
        return "matplotlib is not installed: no plot (pip install matplotlib)"
    done = [r for r in rows if r["status"] == "ok" and "peak_allocated_gib" in r]
    if not done:
        return "no rows with peak memory (CPU run or nothing finished): no plot"
    groups = list(dict.fromkeys((r["model"], r["workload"]) for r in done))
    fig, axes = plt.subplots(1, len(groups), figsize=(5.5 * len(groups), 4.5), squeeze=False)
    for ax, (model, workload) in zip(axes[0], groups, strict=True):
        for family in sorted({r["family"] for r in done}):
            style, color = _plot_style(family)
            series = sorted(
                (
                    r
                    for r in done
                    if (r["model"], r["workload"]) == (model, workload) and r["family"] == family
                ),
                key=lambda r: r["peak_allocated_gib"],
            )
            if not series:
                continue
            xs = [r["peak_allocated_gib"] for r in series]
            ax.plot(xs, [r["pairs_per_s"] for r in series], style, color=color, label=family)
            for r in series:
                ax.annotate(str(r["mini_batch"] or r["tokens"] or r["batch"]), (r["peak_allocated_gib"], r["pairs_per_s"]),
                            fontsize=7, textcoords="offset points", xytext=(3, 3))  # fmt: skip
        ax.set_title(f"{model} / {workload}")
        ax.set_xlabel("peak allocated GiB")
        ax.set_ylabel("pairs/s")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"plot: {path}"


# ---------------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------------


def metadata(device: torch.device, args: argparse.Namespace) -> dict[str, Any]:
    """The run stamp (device, versions, date) and this run's command and settings."""
    meta: dict[str, Any] = {
        **run_stamp(device),
        "sentence_transformers": sentence_transformers_version(),
        "command": " ".join(sys.argv),
        "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
        "dtype": "bfloat16 autocast" if device.type == "cuda" else "float32",
        "args": vars(args),
    }
    if device.type == "cuda":
        meta["gpu_memory_gib"] = torch.cuda.get_device_properties(device).total_memory / GiB
    return meta


def write_outputs(out: Path, meta: dict, rows: list[dict]) -> list[dict]:
    targets = evaluate_targets(rows)
    out.mkdir(parents=True, exist_ok=True)
    (out / "real_workload.json").write_text(
        json.dumps({"meta": meta, "rows": rows, "targets": targets}, indent=1, default=str)
    )
    (out / "real_workload.md").write_text(markdown(meta, rows, targets))
    return targets


def int_list(text: str) -> list[int]:
    values = [int(x) for x in text.split(",") if x.strip()]
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected a comma list of positive integers, got {text!r}")
    return values


def name_list(allowed: Sequence[str]) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        names = [x.strip() for x in text.split(",") if x.strip()]
        bad = [n for n in names if n not in allowed]
        if not names or bad:
            raise argparse.ArgumentTypeError(f"expected a comma list of {', '.join(allowed)}, got {text!r}")
        return names

    return parse


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output_dir", required=True, help="folder for real_workload.json / .md / .png")
    parser.add_argument("--model_path", type=Path, default=default_model_path(),
                        help="pretrained SPLADE-tiny directory (default: the package's copy, else ../shared's)")  # fmt: skip
    parser.add_argument("--models", type=name_list(("base", "tiny")), default=["base", "tiny"])
    parser.add_argument("--workloads", type=name_list(("scifact", "short")), default=["scifact", "short"])
    parser.add_argument("--providers", type=name_list(("ours", "st", "ours-uncached")), default=["ours", "st", "ours-uncached"])  # fmt: skip
    parser.add_argument("--reuse_argmax", choices=("off", "on", "both"), default="both",
                        help="ours without / with reuse_argmax (the replay skips the head's forward), or both")  # fmt: skip
    parser.add_argument("--sparse_reps", choices=("off", "on", "both"), default="off",
                        help="ours with the reps of Step (1) kept dense / as their non-zeros (sparse_reps), or both")  # fmt: skip
    parser.add_argument("--checkpointing", choices=("off", "on", "both"), default="off",
                        help="every provider without / with activation checkpointing in the backbone, or both")  # fmt: skip
    parser.add_argument("--compile", choices=("off", "on", "both"), default="off",
                        help="every provider with its backbone eager / under torch.compile, or both")  # fmt: skip
    parser.add_argument("--compile_mode", choices=("default", "reduce-overhead"),
                        default="default", help="torch.compile's mode for compiled backbones (reduce-overhead: CUDA graphs)")  # fmt: skip
    parser.add_argument("--pad_to_multiple_of", type=int, default=None,
                        help="ours: round each mini-batch's length up to this multiple (few static shapes; "
                        "a compiled backbone of ours is then compiled with static shapes)")  # fmt: skip
    parser.add_argument("--cuda_graphs", choices=("off", "on", "both"), default="off",
                        help="ours without / with each mini-batch replayed as a CUDA graph (GradCache(cuda_graphs=True); "
                        "needs --pad_to_multiple_of), or both")  # fmt: skip
    parser.add_argument("--token_budgets", action=argparse.BooleanOptionalAction, default=True,
                        help="also run every provider with token-budget mini-batches")  # fmt: skip
    parser.add_argument("--effective_batch", type=int, default=1024, help="pairs per step (every provider)")
    parser.add_argument("--mini_batches", type=int_list, default=[16, 32, 64, 128],
                        help="rows per mini-batch; token budgets are these times the mean passage length")  # fmt: skip
    parser.add_argument(
        "--steps", type=int, default=2, help="at most this many timed steps per configuration"
    )
    parser.add_argument(
        "--seconds_per_config", type=float, default=5.0, help="timed steps are cut to fit about this long"
    )
    parser.add_argument("--time_budget_s", type=float, default=420.0,
                        help="configurations not started by then are recorded as skipped")  # fmt: skip
    parser.add_argument(
        "--target_density", type=float, default=0.02, help="rep non-zeros of the base-width start"
    )
    parser.add_argument("--busy_fraction", action=argparse.BooleanOptionalAction, default=False,
                        help="profile one more step per configuration for the device-busy fraction (CUDA)")  # fmt: skip
    parser.add_argument("--profile_host", action=argparse.BooleanOptionalAction, default=False,
                        help="with --busy_fraction: also record the host's operators (slow) and write their table")  # fmt: skip
    parser.add_argument("--sync_audit", action=argparse.BooleanOptionalAction, default=False,
                        help="run one more step per configuration counting its host-device syncs by call site (CUDA)")  # fmt: skip
    parser.add_argument("--cprofile", action=argparse.BooleanOptionalAction, default=False,
                        help="run one more step per configuration under cProfile and write its table (CUDA)")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--merge", nargs="+", type=Path, metavar="JSON",
                        help="merge real_workload.json files of several runs into --output_dir (no GPU work)")  # fmt: skip
    parser.add_argument(
        "--smoke", action="store_true", help="tiny sizes (tiny random models) for a CPU check"
    )
    args = parser.parse_args(argv)
    if args.effective_batch < 1:
        parser.error(f"--effective_batch must be >= 1, got {args.effective_batch}")
    if args.pad_to_multiple_of is not None and args.pad_to_multiple_of < 1:
        parser.error(f"--pad_to_multiple_of must be >= 1, got {args.pad_to_multiple_of}")
    if args.cuda_graphs != "off" and args.pad_to_multiple_of is None:
        parser.error("--cuda_graphs needs --pad_to_multiple_of (one graph per mini-batch shape)")
    if not 0 < args.target_density < 1:
        parser.error(f"--target_density must be in (0, 1), got {args.target_density}")
    if "tiny" in args.models and not args.smoke and not (args.model_path / "config.json").is_file():
        if any(a.startswith("--model_path") for a in (sys.argv[1:] if argv is None else argv)):
            parser.error(
                f"--model_path {args.model_path} has no config.json (the pretrained SPLADE-tiny directory)"
            )
        # Neither the package's copy nor ../shared's: run what can run, say what is missing.
        print(f"no pretrained SPLADE-tiny at {args.model_path}: the tiny model is skipped", flush=True)
        args.models = [m for m in args.models if m != "tiny"]
        if not args.models:
            parser.error("--models has nothing left to run")
    return args


def random_model(scale: Scale, vocab: int, seed: int) -> BertForMaskedLM:
    """The base-width masked LM (a tiny one with ``SMOKE``), random weights from ``seed``."""
    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=vocab,
        hidden_size=scale.base_hidden,
        num_hidden_layers=scale.base_layers,
        num_attention_heads=scale.base_heads,
        intermediate_size=scale.base_ffn,
        max_position_embeddings=512,
    )
    return BertForMaskedLM(config)


def prepare_models(
    args: argparse.Namespace, scale: Scale, tokenizer: PreTrainedTokenizerBase, workloads: list[Workload],
    tmp: Path, device: torch.device,
) -> dict[str, tuple[Path, dict[str, Any]]]:  # fmt: skip
    """Model name -> (directory both providers load, what was measured about it)."""
    samples = [take_rows(w.batches[0], scale.calibration_rows) for w in workloads]
    models: dict[str, tuple[Path, dict[str, Any]]] = {}
    for name in args.models:
        info: dict[str, Any] = {}
        if name == "tiny" and not args.smoke:
            path = args.model_path
            info["source"] = str(path)
        else:
            # base width (or, with --smoke, a tiny stand-in for both): random init, calibrated bias
            model = random_model(scale, len(tokenizer), args.seed).to(device).eval()
            flat = [sample[c] for sample in samples for c in COLUMNS]
            info["decoder_bias"] = calibrate_decoder_bias(model, flat, args.target_density)
            info["source"] = f"random init D{scale.base_hidden} L{scale.base_layers}, calibrated bias"
            path = save_model_dir(model.cpu(), tokenizer, tmp / name)
            del model
        encoder = SpladeEncoder.from_pretrained(path).to(device)
        vocab = encoder.vocab_size
        info["nnz_per_row"] = {
            w.name: nonzeros_per_row(encoder, s) for w, s in zip(workloads, samples, strict=True)
        }
        info["density"] = {
            w: {c: n / vocab for c, n in nnz.items()} for w, nnz in info["nnz_per_row"].items()
        }
        del encoder
        if sentence_transformers_version() is not None and "st" in args.providers:
            info["max_rep_difference_vs_sentence_transformers"] = rep_difference(
                path, samples[0]["positive"], device
            )
        print(f"model {name}: {json.dumps(info)}", flush=True)
        models[name] = (path, info)
        free_memory(device)
    return models


def uncached_configs(config: Config) -> Iterator[Config]:
    """``config`` (ours uncached), then at half its batch, and so on: the sizes to try until one fits."""
    batch = config.batch
    while batch >= 1:
        yield replace(config, batch=batch)
        batch //= 2


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.merge:
        return merge(args.merge, Path(args.output_dir))
    start = time.monotonic()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not args.smoke:
        print("no GPU: the full-size benchmark needs one (use --smoke for a CPU check)", file=sys.stderr)
        return 2
    scale = SMOKE if args.smoke else FULL
    out = Path(args.output_dir)
    meta = metadata(device, args)
    with_st = "st" in args.providers and meta["sentence_transformers"] is not None
    if "st" in args.providers and not with_st:
        print("sentence-transformers is not installed: its rows are skipped", flush=True)
    bench = Bench(args, device)
    if args.pad_to_multiple_of is not None and args.compile != "off":
        # One program per static shape: (lengths per column) x (graph-less, graph-recording) passes.
        torch._dynamo.config.recompile_limit = 64
    meta["token_budget_parameter"] = bench.token_param
    print(f"{meta['device']}, torch {meta['torch']}, sentence-transformers {meta['sentence_transformers']}, "
          f"our token-budget option: {bench.token_param}", flush=True)  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(
        args.model_path if "tiny" in args.models and not args.smoke else default_tokenizer_path()
    )
    n_batches = args.steps + 2  # two warm-up steps at most
    triplets = scifact_triplets(read_scifact_pairs(), args.seed)[: args.effective_batch * n_batches]
    rows_by_name = {"scifact": triplets}
    if "short" in args.workloads:
        rows_by_name["short"] = short_triplets(triplets, tokenizer, scale.short_tokens, args.seed)
    workloads = [
        build_workload(name, rows_by_name[name], tokenizer, scale, args.effective_batch, n_batches, device)
        for name in args.workloads
    ]
    meta["workloads"] = {
        w.name: {"mean_query_tokens": w.mean_query_tokens, "mean_doc_tokens": w.mean_doc_tokens}
        for w in workloads
    }
    print(f"workloads: {json.dumps(meta['workloads'])} ({time.monotonic() - start:.0f} s)", flush=True)
    rows: list[dict] = []
    deadline = start + args.time_budget_s
    with tempfile.TemporaryDirectory(prefix="bench_real_workload_") as tmp:
        models = prepare_models(args, scale, tokenizer, workloads, Path(tmp), device)
        meta["models"] = {name: info for name, (_, info) in models.items()}
        for model_name, (path, _) in models.items():
            for workload in workloads:
                configs: list[Config] = []
                if {"ours", "st"} & set(args.providers):
                    configs = plan(model_name, workload, args.mini_batches, args.effective_batch,
                                   bench.token_param if "ours" in args.providers else None, with_st,
                                   reuse=SETTINGS[args.reuse_argmax], sparse_reps=SETTINGS[args.sparse_reps],
                                   token_budgets=args.token_budgets, checkpointing=SETTINGS[args.checkpointing],
                                   compiled=SETTINGS[args.compile], compile_mode=args.compile_mode,
                                   pad_to_multiple_of=args.pad_to_multiple_of,
                                   cuda_graphs=SETTINGS[args.cuda_graphs])  # fmt: skip
                    if "ours" not in args.providers:
                        configs = [c for c in configs if c.provider != "ours"]
                if "ours-uncached" in args.providers:
                    configs += [
                        Config(
                            model_name,
                            workload.name,
                            "ours-uncached",
                            batch=args.effective_batch,
                            compiled=k,
                            compile_mode=args.compile_mode if k else "default",
                        )
                        for k in SETTINGS[args.compile]
                    ]
                for config in configs:
                    if time.monotonic() > deadline:
                        rows.append({**header(config), "status": "skipped (time budget)"})
                        continue
                    if config.provider == "ours-uncached":
                        for smaller in uncached_configs(config):
                            row = bench.run(smaller, path, workload)
                            report(rows, row, out, meta, start)
                            if row["status"] != "OOM" or time.monotonic() > deadline:
                                break
                        continue
                    report(rows, bench.run(config, path, workload), out, meta, start)
    print(f"\n{meta['device']}, torch {meta['torch']}, {meta['dtype']}; {time.monotonic() - start:.0f} s\n")
    return finish(out, meta, rows)


def finish(out: Path, meta: dict, rows: list[dict]) -> int:
    """Final outputs, tables and plot; exit status 1 when a configuration failed other than by OOM."""
    targets = write_outputs(out, meta, rows)
    show(TABLE_HEAD, table_rows(rows))
    print()
    show(TARGET_HEAD, target_rows(targets))
    print(plot(rows, out / "real_workload.png"), flush=True)
    return 1 if any(r["status"].startswith("error") for r in rows) else 0


def merge(paths: Sequence[Path], out: Path) -> int:
    """The rows of several runs (e.g. one device call per model or workload) in one table and plot."""
    payloads = [json.loads(Path(p).read_text()) for p in paths]
    devices = {p["meta"]["device"] for p in payloads}
    if len(devices) > 1:
        print(f"warning: merging runs from different devices {sorted(devices)}: ratios mix them", flush=True)
    meta = {**payloads[0]["meta"], "command": " ".join(sys.argv), "merged_from": [str(p) for p in paths]}
    meta["models"] = {k: v for p in payloads for k, v in p["meta"].get("models", {}).items()}
    return finish(out, meta, [row for p in payloads for row in p["rows"]])


def report(rows: list[dict], row: dict, out: Path, meta: dict, start: float) -> None:
    """Record one row, print it and rewrite the outputs (a run cut short keeps its rows)."""
    rows.append(row)
    shown = ", ".join(
        f"{k} {row[k]:.{p}f}" for k, p in (("pairs_per_s", 0), ("peak_allocated_gib", 2), ("busy_fraction", 2))
        if isinstance(row.get(k), float)
    )  # fmt: skip
    print(f"[{time.monotonic() - start:5.0f} s] {row['name']}: {row['status']} {shown}", flush=True)
    for site, count in list(row.get("sync_sites", {}).items())[:8]:
        print(f"    {count:6d} syncs at {site}", flush=True)
    write_outputs(out, meta, rows)


if __name__ == "__main__":
    sys.exit(main())
