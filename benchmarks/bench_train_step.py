"""Benchmark of full SPLADE training steps: uncached vs GradCache, PyTorch head vs Sparton, one process.

Legend: B batch (triplets), S sequence, D hidden, V vocabulary.

Model: a BERT-base-width masked LM with random weights (D = 768, 12 heads, FFN 3,072, 6 layers,
V = 30,522; the "v250002" configurations change only V to XLM-R's 250,002), wrapped as a
``SpladeEncoder`` (decoder bias -0.5: fixed, so runs stay comparable; the training pipeline's default
now scales with the width, -1.22 at D = 768). Data: synthetic triplets
(query 32 tokens, positive 256, one hard negative 256) of random token ids, no padding, generated on
the GPU: no tokenizer is involved, so the numbers are those of the model step alone. A step is

  uncached   with autocast: reps = {column: encoder(**features)}; loss = SpladeLoss(reps);
             loss.backward(); optimizer.step(); optimizer.zero_grad()
  cached     with autocast: loss = CachedLoss(encoder, SpladeLoss, mini_batch_size=mb)(columns);
             loss.backward() (GradCache Step (3) replays the mini-batches); optimizer step and zero_grad

with SpladeLoss = InfoNCE (in-batch + the hard negative) + FLOPS regularizers (query 5e-4, doc 3e-4,
full weight), AdamW (fused on CUDA), bf16 autocast on CUDA (fp32 on CPU). Two heads:

  sparton    SpladeEncoder as shipped: the fused head (Triton on CUDA) never forms the [B, S, V] logits;
  torch      the head as usually written: the backbone's own masked-LM logits [B, S, V], then
             log1p(relu(.)) * mask and max over S (:class:`TorchHeadEncoder`).

Configurations (``--configs``, group names or single names such as ``cached-sparton-v30522-b1024-mb128``),
in the order "all" (the default: every group but "huge") runs them:

  uncached-sparton                  uncached, the largest batch that fits: B = 16, 32, 64, ... until the
                                    first out-of-memory (every size tried is a row);
  cached-sparton                    effective batch 1,024 in mini-batches of 32 ... 512;
  cached-torch                      effective batch 1,024 in mini-batches of 32 / 64 / 128;
  uncached-torch                    as uncached-sparton, with the PyTorch head;
  xlmr                              cached Sparton at V = 250,002, effective 1,024, mini-batch 128;
  large                             cached Sparton at effective 4,096 / 8,192 / 16,384, mini-batch 128;
  huge                              cached Sparton at effective 32,768, mini-batch 128.

Every configuration starts from the same weights and a fresh optimizer. Timing: one or two warm-up
steps (Triton compilation, optimizer state), then up to ``--steps`` timed steps (fewer for slow steps,
at least 2), each between CUDA events after a synchronize; the row reports the median. Sequences per step = 3 B (query, positive, negative).
Peak memory is ``torch.cuda.max_memory_allocated`` over the timed steps: everything the step holds,
weights, gradients and AdamW state included (``peak_reserved_gib`` is the allocator's reservation).
A configuration that runs out of memory is a row with status "OOM"; the run goes on.

Afterwards the issue's targets are computed from the rows (ratios within this run) and printed as
PASS / MISS. ``--profile NAMES`` instead profiles configurations one by one: per pass (GradCache Steps
(1)-(3) and the optimizer, or forward / backward / optimizer) the wall time against the device-busy
time, the host-device synchronisations, the top kernels and the top host-side operators.

Run on the GPU machine from the repository root (each call stays under ~8 minutes):

    export PYTHONPATH=$PWD:$PYTHONPATH PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
    python benchmarks/bench_train_step.py --configs all,huge --time-budget 430 --out $OUT/train_step
    python benchmarks/bench_train_step.py --profile cached-sparton-v30522-b256-mb32,cached-torch-v30522-b256-mb32 --out $OUT/prof
    python benchmarks/bench_train_step.py --merge A/train_step.json B/train_step.json --out merged

It writes ``train_step.json`` (rows, targets, device, versions, date; rewritten after every
configuration, so a run cut short keeps its rows) and ``train_step.md`` under ``--out``.
``--smoke`` shrinks everything (tiny model, short sequences, small batches) so the whole script runs
on a CPU in well under a minute; its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import re
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from transformers import BertConfig

from benchmarks.common import run_stamp
from gradcache_sparton import CachedLoss, GradCache, SpladeEncoder, SpladeLoss, SpladeLossConfig
from gradcache_sparton.kernels import splade_max_pool

GiB = 2**30
COLUMNS = ("query", "positive", "negative_1")
# Host-side calls that wait for the GPU (what a ``.item()``, ``.tolist()`` or ``bool(tensor)`` costs).
SYNC_EVENTS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
# Reported target thresholds (issue 9).
CACHED_VS_UNCACHED_MIN = 0.75
SPEEDUP_MIN = 2.0
MEMORY_RATIO_MAX = 0.40
SMALL_GPU_GIB = 16.0
XLMR_MIN_SEQUENCES_PER_S = 1000.0


@dataclass(frozen=True)
class Scale:
    """Every size the benchmark uses; ``FULL`` is the issue's, ``SMOKE`` a CPU-sized stand-in."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    vocab: int
    xlmr_vocab: int
    query_len: int
    doc_len: int
    search_batches: tuple[int, ...]
    effective: int
    torch_mini_batches: tuple[int, ...]
    sparton_mini_batches: tuple[int, ...]
    large_batches: tuple[int, ...]
    huge_batch: int
    large_mini_batch: int


FULL = Scale(
    hidden_size=768,
    num_hidden_layers=6,
    num_attention_heads=12,
    intermediate_size=3072,
    vocab=30522,
    xlmr_vocab=250002,
    query_len=32,
    doc_len=256,
    search_batches=(16, 32, 64, 128, 256, 512, 1024, 2048, 4096),
    effective=1024,
    torch_mini_batches=(32, 64, 128),
    sparton_mini_batches=(32, 64, 128, 256, 512),
    large_batches=(4096, 8192, 16384),
    huge_batch=32768,
    large_mini_batch=128,
)
SMOKE = Scale(
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    intermediate_size=64,
    vocab=1000,
    xlmr_vocab=4000,
    query_len=8,
    doc_len=16,
    search_batches=(2, 4),
    effective=16,
    torch_mini_batches=(8,),
    sparton_mini_batches=(8, 16),
    large_batches=(32, 64),
    huge_batch=128,
    large_mini_batch=8,
)


# ---------------------------------------------------------------------------------------------------
# Configurations
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StepConfig:
    """One training-step configuration: head, cached or not, batch (triplets), mini-batch, vocabulary."""

    head: str  # "sparton" | "torch"
    cached: bool
    batch: int
    vocab: int
    mini_batch: int | None = None
    group: str = ""

    @property
    def name(self) -> str:
        mode = "cached" if self.cached else "uncached"
        suffix = f"-mb{self.mini_batch}" if self.cached else ""
        return f"{mode}-{self.head}-v{self.vocab}-b{self.batch}{suffix}"


_NAME = re.compile(r"^(cached|uncached)-(sparton|torch)-v(\d+)-b(\d+)(?:-mb(\d+))?$")


def parse_config_name(name: str) -> StepConfig:
    """``cached-sparton-v30522-b1024-mb128`` / ``uncached-torch-v30522-b64`` -> StepConfig."""
    match = _NAME.match(name)
    if match is None:
        raise ValueError(
            f"configuration name {name!r} must look like cached-sparton-v30522-b1024-mb128 or "
            "uncached-torch-v30522-b64"
        )
    mode, head, vocab, batch, mini_batch = match.groups()
    cached = mode == "cached"
    if cached != (mini_batch is not None):
        raise ValueError(f"configuration name {name!r}: a cached configuration needs -mb<N>, uncached none")
    return StepConfig(head, cached, int(batch), int(vocab), None if mini_batch is None else int(mini_batch))


@dataclass(frozen=True)
class Search:
    """Uncached steps at growing batch sizes until the first out-of-memory."""

    head: str
    vocab: int
    batches: tuple[int, ...]
    group: str


Plan = StepConfig | Search


def plan_groups(scale: Scale) -> dict[str, list[Plan]]:
    """Group name -> what it runs, in the order the default run takes them."""
    v, eff = scale.vocab, scale.effective
    return {
        "uncached-sparton": [Search("sparton", v, scale.search_batches, "uncached-sparton")],
        "cached-sparton": [
            StepConfig("sparton", True, eff, v, mb, "cached-sparton")
            for mb in scale.sparton_mini_batches
            if mb <= eff
        ],
        "cached-torch": [
            StepConfig("torch", True, eff, v, mb, "cached-torch")
            for mb in scale.torch_mini_batches
            if mb <= eff
        ],
        "uncached-torch": [Search("torch", v, scale.search_batches, "uncached-torch")],
        "xlmr": [StepConfig("sparton", True, eff, scale.xlmr_vocab, scale.large_mini_batch, "xlmr")],
        "large": [
            StepConfig("sparton", True, b, v, scale.large_mini_batch, "large") for b in scale.large_batches
        ],
        "huge": [StepConfig("sparton", True, scale.huge_batch, v, scale.large_mini_batch, "huge")],
    }


def select_plans(spec: str, scale: Scale) -> list[Plan]:
    """``--configs``: comma list of group names, 'all', or single configuration names."""
    groups = plan_groups(scale)
    plans: list[Plan] = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        if item == "all":
            plans += [p for name, group in groups.items() if name != "huge" for p in group]
        elif item in groups:
            plans += groups[item]
        else:
            plans.append(replace(parse_config_name(item), group="single"))
    if not plans:
        raise ValueError(f"--configs {spec!r} selects nothing; groups: all, {', '.join(groups)}")
    return plans


# ---------------------------------------------------------------------------------------------------
# Model, heads, data
# ---------------------------------------------------------------------------------------------------


class TorchHeadEncoder(nn.Module):
    """The same encoder with the plain PyTorch head: the backbone's own masked-LM logits, then max-pooling.

    Shares every parameter with ``encoder`` (it calls ``encoder.model``, the masked LM, whose decoder the
    Sparton head is tied to), so both heads train the same weights and compute the same reps.
    """

    def __init__(self, encoder: SpladeEncoder) -> None:
        super().__init__()
        self.encoder = encoder

    def forward(self, input_ids: Tensor, attention_mask: Tensor, **kwargs: Any) -> Tensor:
        logits = self.encoder.model(input_ids=input_ids, attention_mask=attention_mask, **kwargs).logits
        return splade_max_pool(logits, attention_mask)  # [B, S, V] -> [B, V]


def build_encoder(scale: Scale, vocab: int, device: torch.device, init_decoder_bias: float) -> SpladeEncoder:
    config = BertConfig(
        vocab_size=vocab,
        hidden_size=scale.hidden_size,
        num_hidden_layers=scale.num_hidden_layers,
        num_attention_heads=scale.num_attention_heads,
        intermediate_size=scale.intermediate_size,
        max_position_embeddings=max(512, scale.doc_len),
    )
    torch.manual_seed(0)
    encoder = SpladeEncoder.from_config(config)
    with torch.no_grad():
        encoder.model.get_output_embeddings().bias.fill_(init_decoder_bias)
    return encoder.to(device).train()


def synthetic_columns(
    scale: Scale, batch: int, vocab: int, device: torch.device
) -> dict[str, dict[str, Tensor]]:
    """Triplets of random token ids, no padding: query [B, S_q], positive and negative_1 [B, S_d]."""
    generator = torch.Generator(device=device).manual_seed(1234)
    columns = {}
    for column in COLUMNS:
        length = scale.query_len if column == "query" else scale.doc_len
        ids = torch.randint(0, vocab, (batch, length), device=device, generator=generator)
        columns[column] = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    return columns


# ---------------------------------------------------------------------------------------------------
# Measurement
# ---------------------------------------------------------------------------------------------------


class Bench:
    """Holds one encoder at a time (per vocabulary) and its initial weights; runs configurations."""

    def __init__(self, args: argparse.Namespace, scale: Scale, device: torch.device) -> None:
        self.args = args
        self.scale = scale
        self.device = device
        self.cuda = device.type == "cuda"
        self.loss = SpladeLoss(SpladeLossConfig(query_reg_weight=5e-4, doc_reg_weight=3e-4))
        self._vocab: int | None = None
        self._encoder: SpladeEncoder | None = None
        self._initial: dict[str, Tensor] = {}
        self.attn_implementation: str | None = None  # the backbone's attention kernel, for the record

    def encoder(self, vocab: int) -> SpladeEncoder:
        """The encoder for ``vocab``, reset to the initial weights (built on first use)."""
        if self._vocab != vocab:
            self._encoder, self._initial, self._vocab = None, {}, None
            free_memory(self.cuda)
            self._encoder = build_encoder(self.scale, vocab, self.device, self.args.init_decoder_bias)
            self._initial = {k: v.detach().cpu().clone() for k, v in self._encoder.model.state_dict().items()}
            self._vocab = vocab
            self.attn_implementation = self._encoder.model.config._attn_implementation
        assert self._encoder is not None
        self._encoder.model.load_state_dict(self._initial)
        self._encoder.zero_grad(set_to_none=True)
        return self._encoder

    def autocast(self) -> contextlib.AbstractContextManager[object]:
        if self.cuda:
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()  # CPU (smoke): fp32

    def make_step(self, config: StepConfig) -> Callable[[], dict[str, Tensor]]:
        """A closure running one full training step of ``config`` on its synthetic batch."""
        encoder = self.encoder(config.vocab)
        model: nn.Module = encoder if config.head == "sparton" else TorchHeadEncoder(encoder)
        optimizer = torch.optim.AdamW(encoder.parameters(), lr=1e-5, fused=self.cuda)
        columns = synthetic_columns(self.scale, config.batch, config.vocab, self.device)
        cached = None
        if config.cached:
            choice = self.args.reuse_argmax
            reuse = {} if choice == "auto" else {"reuse_argmax": choice == "on"}
            cached = CachedLoss(model, self.loss, mini_batch_size=config.mini_batch, **reuse)

        def step() -> dict[str, Tensor]:
            with self.autocast():
                if cached is not None:
                    loss, components = cached(columns, return_components=True)
                else:
                    loss, components = self.loss({name: model(**f) for name, f in columns.items()})
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return components

        return step

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def timed(self, fn: Callable[[], Any]) -> tuple[float, Any]:
        """(milliseconds, result) of ``fn``, between CUDA events on CUDA (after a synchronize)."""
        self.sync()
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            result = fn()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end), result
        t0 = time.perf_counter()
        result = fn()
        return (time.perf_counter() - t0) * 1e3, result

    def measure(self, config: StepConfig) -> dict[str, Any]:
        """Warm-up, then timed steps; the row's measurements (raises OutOfMemoryError)."""
        step = self.make_step(config)
        first_ms, _ = self.timed(step)
        # The first step compiles Triton kernels and allocates AdamW state; a cheap step gets a second
        # warm-up, a slow one (tens of seconds at the largest batches) does not need it.
        warmup = 1
        if first_ms < 5000:
            self.timed(step)
            warmup = 2
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        n_timed = max(2, min(self.args.steps, math.floor(self.args.seconds_per_config * 1e3 / first_ms)))
        times, components = [], {}
        for _ in range(n_timed):
            ms, components = self.timed(step)
            times.append(ms)
        median = statistics.median(times)
        sequences = len(COLUMNS) * config.batch
        row: dict[str, Any] = {
            "step_ms_median": median,
            "step_ms": times,
            "sequences_per_s": sequences / (median / 1e3),
            "warmup_steps": warmup,
            "timed_steps": n_timed,
            "loss_contrastive": float(components["contrastive"]),
            "nnz_query": float(components["nnz_query"]),
            "nnz_doc": float(components["nnz_doc"]),
        }
        if self.cuda:
            row["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / GiB
            row["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / GiB
        return row

    def run(self, config: StepConfig) -> dict[str, Any]:
        """One row: the measurements, or status "OOM" / "error: ..."; memory is freed either way."""
        row = _row_header(config)
        status = "ok"
        try:
            row.update(self.measure(config))
        except torch.OutOfMemoryError:
            status = "OOM"
        except RuntimeError as exc:  # cuBLAS/cuDNN allocation failures are RuntimeErrors
            if "out of memory" in str(exc).lower() or "ALLOC_FAILED" in str(exc):
                status = "OOM"
            else:
                traceback.print_exc()
                status = f"error: {type(exc).__name__}: {exc}"[:300]
        except Exception as exc:  # one broken configuration must not lose the others' rows
            traceback.print_exc()
            status = f"error: {type(exc).__name__}: {exc}"[:300]
        # Outside the except blocks: the traceback (and the step's graph it references) is gone.
        if self._encoder is not None:
            self._encoder.zero_grad(set_to_none=True)
        free_memory(self.cuda)
        row["status"] = status
        return row

    def profile(self, config: StepConfig, out: Path) -> dict[str, Any]:
        """Where one step's time goes, pass by pass: host-bound or device-bound, and which kernels.

        After a warm-up step, one unprofiled step times each pass (GradCache Steps (1)-(3) and the
        optimizer, or forward / backward / optimizer) between CUDA events. Then each pass runs once more
        under ``torch.profiler``, alone, which gives its device-busy time (the sum of its kernels'
        durations), its host-device synchronisations (``cudaStreamSynchronize`` and friends, e.g. a
        ``.item()``) and its top kernels and top host-side operators. Wall time well above busy time
        means the GPU waits for the host (launch overhead, synchronisations); close to it, the kernels
        bound the pass.
        """
        from torch.profiler import ProfilerActivity, profile

        encoder = self.encoder(config.vocab)
        model: nn.Module = encoder if config.head == "sparton" else TorchHeadEncoder(encoder)
        optimizer = torch.optim.AdamW(encoder.parameters(), lr=1e-5, fused=self.cuda)
        columns = synthetic_columns(self.scale, config.batch, config.vocab, self.device)
        engine = GradCache(model, mini_batch_size=config.mini_batch or config.batch)

        def passes() -> Iterator[tuple[str, Callable[[], Any]]]:
            # The passes of one step, in order; each callable runs one of them.
            state: dict[str, Any] = {}
            if config.cached:

                def encode() -> None:
                    with self.autocast():
                        state["reps"], state["replay"] = engine.encode(columns)

                def loss() -> None:
                    with self.autocast():
                        _, state["grads"] = engine.rep_gradients(state.pop("reps"), self.loss)

                yield "step1_encode", encode
                yield "step2_loss_and_rep_grads", loss
                yield "step3_replay", lambda: engine.replay(state.pop("replay"), state.pop("grads"))
            else:

                def forward() -> None:
                    with self.autocast():
                        reps = {name: model(**f) for name, f in columns.items()}
                        state["loss"], _ = self.loss(reps)

                yield "forward_and_loss", forward
                yield "backward", lambda: state.pop("loss").backward()
            yield "optimizer", lambda: (optimizer.step(), optimizer.zero_grad(set_to_none=True))

        for _, fn in passes():  # warm-up step: compilation and optimizer state outside the measurements
            fn()
        wall_ms = {name: self.timed(fn)[0] for name, fn in passes()}
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        sort_device = "self_device_time_total" if self.cuda else "self_cpu_time_total"
        phases: dict[str, dict[str, Any]] = {}
        text = [f"{config.name}"]
        for name, fn in passes():
            with profile(activities=activities) as prof:
                profiled_ms, _ = self.timed(fn)
            averages = prof.key_averages()
            busy_ms = sum(e.self_device_time_total for e in averages if e.device_type.name == "CUDA") / 1e3
            syncs = {e.key: e.count for e in averages if e.key in SYNC_EVENTS}
            phases[name] = {
                "wall_ms": wall_ms[name],
                "profiled_wall_ms": profiled_ms,
                "device_busy_ms": busy_ms,
                "busy_fraction": busy_ms / wall_ms[name] if wall_ms[name] else None,
                "syncs": syncs,
            }
            text.append(
                f"\n== {name}: wall {wall_ms[name]:.1f} ms (under the profiler {profiled_ms:.1f} ms), "
                f"device busy {busy_ms:.1f} ms, synchronisations {syncs or 'none'}"
            )
            text.append(averages.table(sort_by=sort_device, row_limit=15, max_name_column_width=70))
            text.append(averages.table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=70))
        total_wall = sum(p["wall_ms"] for p in phases.values())
        total_busy = sum(p["device_busy_ms"] for p in phases.values())
        summary = (
            f"{config.name}: step wall {total_wall:.1f} ms, device busy {total_busy:.1f} ms\n"
            + "".join(
                f"  {k}: wall {v['wall_ms']:.1f} ms, busy {v['device_busy_ms']:.1f} ms, syncs {v['syncs']}\n"
                for k, v in phases.items()
            )
        )
        out.mkdir(parents=True, exist_ok=True)
        (out / f"profile_{config.name}.txt").write_text(summary + "\n".join(text))
        print(summary, flush=True)
        return {"name": config.name, "phases": phases, "step_wall_ms": total_wall, "step_busy_ms": total_busy}


def free_memory(cuda: bool) -> None:
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------------
# Targets, tables, output
# ---------------------------------------------------------------------------------------------------


def _ok(rows: list[dict], **match: Any) -> list[dict]:
    return [r for r in rows if r["status"] == "ok" and all(r.get(k) == v for k, v in match.items())]


def _target(target: str, value: float | None, threshold: str, passed: bool | None, detail: str) -> dict:
    status = "n/a" if passed is None else ("PASS" if passed else "MISS")
    return {"target": target, "value": value, "threshold": threshold, "status": status, "detail": detail}


def evaluate_targets(rows: list[dict], scale: Scale) -> list[dict]:
    """The issue's targets as ratios within the rows given (n/a where a row is missing)."""
    v, eff, mb_large = scale.vocab, scale.effective, scale.large_mini_batch
    targets = []
    uncached = _ok(rows, head="sparton", cached=False, vocab_size=v)
    cached = _ok(rows, head="sparton", cached=True, vocab_size=v, batch=eff)
    if uncached and cached:
        u = max(uncached, key=lambda r: r["batch"])
        c = max(cached, key=lambda r: r["sequences_per_s"])
        ratio = c["sequences_per_s"] / u["sequences_per_s"]
        detail = (
            f"cached b{eff} mb{c['mini_batch_size']} {c['sequences_per_s']:.0f} seq/s vs uncached at its "
            f"largest fitting b{u['batch']} {u['sequences_per_s']:.0f} seq/s"
        )
        beyond = [r for r in rows if r["head"] == "sparton" and not r["cached"] and r["vocab_size"] == v
                  and r["batch"] > u["batch"]]  # fmt: skip
        if not any(r["status"] == "OOM" for r in beyond):
            detail += " (no OOM above it: the search was cut short or the list ended)"
        targets.append(
            _target("cached/uncached Sparton speed", ratio, f">= {CACHED_VS_UNCACHED_MIN}",
                    ratio >= CACHED_VS_UNCACHED_MIN, detail)
        )  # fmt: skip
    else:
        targets.append(_target("cached/uncached Sparton speed", None, f">= {CACHED_VS_UNCACHED_MIN}", None,
                               "missing rows"))  # fmt: skip
    for mb in scale.torch_mini_batches:
        s = _ok(rows, head="sparton", cached=True, vocab_size=v, batch=eff, mini_batch_size=mb)
        t = [r for r in rows if r["head"] == "torch" and r["cached"] and r["vocab_size"] == v
             and r["batch"] == eff and r["mini_batch_size"] == mb]  # fmt: skip
        name = f"Sparton vs PyTorch head, cached mb{mb}"
        if s and t and t[0]["status"] == "OOM":
            targets.append(_target(f"{name}: speed", None, f">= {SPEEDUP_MIN}x", True, "PyTorch head OOM"))
            continue
        if not (s and t and t[0]["status"] == "ok"):
            targets.append(_target(f"{name}: speed", None, f">= {SPEEDUP_MIN}x", None, "missing rows"))
            continue
        s, t = s[0], t[0]
        speedup = s["sequences_per_s"] / t["sequences_per_s"]
        targets.append(
            _target(f"{name}: speed", speedup, f">= {SPEEDUP_MIN}x", speedup >= SPEEDUP_MIN,
                    f"{s['sequences_per_s']:.0f} vs {t['sequences_per_s']:.0f} seq/s")
        )  # fmt: skip
        if "peak_allocated_gib" in s and "peak_allocated_gib" in t:
            ratio = s["peak_allocated_gib"] / t["peak_allocated_gib"]
            targets.append(
                _target(f"{name}: peak memory", ratio, f"<= {MEMORY_RATIO_MAX:.0%}", ratio <= MEMORY_RATIO_MAX,
                        f"{s['peak_allocated_gib']:.2f} vs {t['peak_allocated_gib']:.2f} GiB")
            )  # fmt: skip
    for batch, name, limit in (
        (scale.large_batches[1], "fits a 16 GiB GPU", SMALL_GPU_GIB),
        (scale.huge_batch, "runs on the 80 GB H100", None),
    ):
        label = f"effective b{batch} mb{mb_large} {name}"
        found = [r for r in rows if r["head"] == "sparton" and r["cached"] and r["vocab_size"] == v
                 and r["batch"] == batch and r["mini_batch_size"] == mb_large]  # fmt: skip
        if not found:
            targets.append(_target(label, None, "", None, "not run"))
            continue
        r = found[0]
        peak = r.get("peak_allocated_gib")
        if r["status"] != "ok":
            targets.append(_target(label, None, "", False, r["status"]))
        elif limit is None:
            targets.append(_target(label, peak, "runs", True, f"{r['sequences_per_s']:.0f} seq/s"))
        else:
            targets.append(
                _target(label, peak, f"<= {limit} GiB", None if peak is None else peak <= limit,
                        f"{r['sequences_per_s']:.0f} seq/s")
            )  # fmt: skip
    x = _ok(
        rows, head="sparton", cached=True, vocab_size=scale.xlmr_vocab, batch=eff, mini_batch_size=mb_large
    )
    label = f"V={scale.xlmr_vocab} effective b{eff} mb{mb_large}"
    if x:
        r = x[0]
        peak = r.get("peak_allocated_gib")
        targets.append(_target(f"{label}: peak memory", peak, f"<= {SMALL_GPU_GIB} GiB",
                               None if peak is None else peak <= SMALL_GPU_GIB, ""))  # fmt: skip
        targets.append(
            _target(f"{label}: speed", r["sequences_per_s"], f">= {XLMR_MIN_SEQUENCES_PER_S:.0f} seq/s",
                    r["sequences_per_s"] >= XLMR_MIN_SEQUENCES_PER_S, "")
        )  # fmt: skip
    else:
        targets.append(_target(label, None, "", None, "not run or failed"))
    return targets


def _cell(x: object, fmt: str = "{:.2f}") -> str:
    if x is None:
        return "-"
    return fmt.format(x) if isinstance(x, float) else str(x)


TABLE_HEAD = ["configuration", "status", "B", "mb", "seq/step", "step ms", "seq/s", "peak GiB", "nnz q/d"]


def table_rows(rows: list[dict]) -> list[list[str]]:
    out = []
    for r in rows:
        nnz = f"{r['nnz_query']:.0f}/{r['nnz_doc']:.0f}" if "nnz_doc" in r else "-"
        out.append([
            r["name"], r["status"], str(r["batch"]), _cell(r["mini_batch_size"]), str(r["sequences_per_step"]),
            _cell(r.get("step_ms_median"), "{:.0f}"), _cell(r.get("sequences_per_s"), "{:.0f}"),
            _cell(r.get("peak_allocated_gib")), nnz,
        ])  # fmt: skip
    return out


def target_rows(targets: list[dict]) -> list[list[str]]:
    return [
        [t["target"], _cell(t["value"], "{:.3g}"), t["threshold"], t["status"], t["detail"]] for t in targets
    ]


def markdown(meta: dict, rows: list[dict], targets: list[dict]) -> str:
    def md(head: list[str], body: list[list[str]]) -> str:
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        return "\n".join(lines + ["| " + " | ".join(b) + " |" for b in body])

    stamp = ", ".join(f"{k} {meta.get(k)}" for k in ("device", "torch", "triton", "transformers", "date"))
    return (
        f"Training step benchmark ({stamp}; `{meta.get('command')}`)\n\n"
        + md(TABLE_HEAD, table_rows(rows))
        + "\n\nTargets\n\n"
        + md(["target", "value", "threshold", "status", "detail"], target_rows(targets))
        + "\n"
    )


def print_table(rows: list[dict], targets: list[dict]) -> None:
    def show(head: list[str], body: list[list[str]]) -> None:
        widths = [max(len(x) for x in col) for col in zip(head, *body, strict=True)]
        for line in [head, *body]:
            print("  ".join(x.ljust(w) for x, w in zip(line, widths, strict=True)))

    print()
    show(TABLE_HEAD, table_rows(rows))
    print()
    show(["target", "value", "threshold", "status", "detail"], target_rows(targets))
    sys.stdout.flush()


def metadata(device: torch.device, scale: Scale, args: argparse.Namespace) -> dict:
    meta = {
        **run_stamp(device),
        "command": " ".join(sys.argv),
        "smoke": args.smoke,
        "dtype": "bfloat16 autocast" if device.type == "cuda" else "float32",
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
        "init_decoder_bias": args.init_decoder_bias,
        "scale": scale.__dict__,
    }
    if device.type == "cuda":
        meta["gpu_memory_gib"] = torch.cuda.get_device_properties(device).total_memory / GiB
    return meta


def write_outputs(out: Path, meta: dict, rows: list[dict], scale: Scale) -> list[dict]:
    targets = evaluate_targets(rows, scale)
    out.mkdir(parents=True, exist_ok=True)
    payload = {"meta": meta, "rows": rows, "targets": targets}
    (out / "train_step.json").write_text(json.dumps(payload, indent=1))
    (out / "train_step.md").write_text(markdown(meta, rows, targets))
    return targets


# ---------------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------------


def run_plans(bench: Bench, plans: list[Plan], out: Path, meta: dict, deadline: float) -> list[dict]:
    rows: list[dict] = []

    def record(row: dict) -> None:
        rows.append(row)
        if bench.attn_implementation is not None:
            meta["attn_implementation"] = bench.attn_implementation
        keys = ("step_ms_median", "sequences_per_s", "peak_allocated_gib")
        shown = ", ".join(f"{k} {row[k]:.2f}" for k in keys if isinstance(row.get(k), float))
        print(f"{row['name']}: {row['status']} {shown}", flush=True)
        write_outputs(out, meta, rows, bench.scale)

    for plan in plans:
        configs = (
            [StepConfig(plan.head, False, b, plan.vocab, None, plan.group) for b in plan.batches]
            if isinstance(plan, Search)
            else [plan]
        )
        for config in configs:
            if time.monotonic() > deadline:
                record({**_row_header(config), "status": "skipped (time budget)"})
                if isinstance(plan, Search):
                    break
                continue
            row = bench.run(config)
            record(row)
            if isinstance(plan, Search) and row["status"] != "ok":
                break  # the largest batch that fits is the previous one
    return rows


def _row_header(config: StepConfig) -> dict:
    return {
        "name": config.name,
        "group": config.group,
        "head": config.head,
        "cached": config.cached,
        "vocab_size": config.vocab,
        "batch": config.batch,
        "mini_batch_size": config.mini_batch,
        "sequences_per_step": len(COLUMNS) * config.batch,
    }


def merge(paths: list[str], out: Path) -> int:
    """Rows of several runs (e.g. one GPU call each) into one table; targets across them."""
    payloads = [json.loads(Path(p).read_text()) for p in paths]
    devices = {p["meta"]["device"] for p in payloads}
    if len(devices) > 1:
        print(f"warning: merging runs from different devices {sorted(devices)}: ratios mix them", flush=True)
    scale = SMOKE if payloads[0]["meta"].get("smoke") else FULL
    meta = {**payloads[0]["meta"], "command": " ".join(sys.argv), "merged_from": paths}
    rows = [row for p in payloads for row in p["rows"]]
    targets = write_outputs(out, meta, rows, scale)
    print_table(rows, targets)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for train_step.json / train_step.md / profiles")
    parser.add_argument("--configs", default="all", help="comma list of groups (see the module doc) or names")
    parser.add_argument(
        "--steps", type=int, default=5, help="at most this many timed steps per configuration"
    )
    parser.add_argument(
        "--seconds-per-config",
        type=float,
        default=15.0,
        help="timed steps are cut to fit about this long (never fewer than 2)",
    )
    parser.add_argument(
        "--time-budget",
        type=float,
        default=420.0,
        help="seconds; configurations not started by then are recorded as skipped (keeps a call < 10 min)",
    )
    parser.add_argument(
        "--init-decoder-bias",
        type=float,
        help="decoder bias of the random-init head; sets how dense the reps are. Default -0.5 (fixed so "
        "that runs stay comparable; 0 with --smoke, whose tiny head would otherwise give all-zero reps)",
    )
    parser.add_argument(
        "--profile", metavar="NAMES", help="comma list of configurations to profile instead of benchmarking"
    )
    parser.add_argument("--merge", nargs="+", metavar="JSON", help="merge train_step.json files into --out")
    parser.add_argument(
        "--reuse-argmax",
        choices=("auto", "on", "off"),
        default="auto",
        help="the cached step's reuse_argmax: the engine's automatic default, or forced (to compare with "
        "trees from before it was automatic, where CachedLoss left it off)",
    )
    parser.add_argument("--smoke", action="store_true", help="tiny sizes for a CPU check of the script")
    args = parser.parse_args()
    out = Path(args.out)
    if args.merge:
        return merge(args.merge, out)
    start = time.monotonic()
    scale = SMOKE if args.smoke else FULL
    if args.init_decoder_bias is None:
        args.init_decoder_bias = 0.0 if args.smoke else -0.5
    if args.smoke:
        args.steps = min(args.steps, 2)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not args.smoke:
        print("no GPU: the full-size benchmark needs one (use --smoke for a CPU check)", file=sys.stderr)
        return 2
    bench = Bench(args, scale, device)
    meta = metadata(device, scale, args)
    if args.profile:
        for name in filter(None, (n.strip() for n in args.profile.split(","))):
            config = parse_config_name(name)
            result = bench.profile(config, out)
            (out / f"profile_{config.name}.json").write_text(json.dumps({"meta": meta, **result}, indent=1))
            free_memory(bench.cuda)
        return 0
    plans = select_plans(args.configs, scale)
    rows = run_plans(bench, plans, out, meta, deadline=start + args.time_budget)
    targets = write_outputs(out, meta, rows, scale)
    print(f"\n{meta['device']}, torch {meta['torch']}, {meta['dtype']}; {time.monotonic() - start:.0f} s")
    print_table(rows, targets)
    return 1 if any(r["status"].startswith("error") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
