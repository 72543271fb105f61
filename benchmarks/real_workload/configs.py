"""One row's settings (``Config``: model, workload, provider, budget, options), its names, and the plan of
a run: which configurations one (model, workload) gets."""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from benchmarks.real_workload.workloads import Workload

__all__ = [
    "SETTINGS",
    "Config",
    "file_stem",
    "header",
    "plan",
    "token_budget",
    "uncached_configs",
    "variant_name",
]

SETTINGS = {"off": (False,), "on": (True,), "both": (False, True)}  # an off / on / both option's values


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
    mini_batch_length_multiple: int | None = None  # ours: mini-batch lengths rounded up (static shapes)
    cuda_graphs: bool = False  # ours: each mini-batch's Step (1) and Step (3) as one CUDA graph per shape

    @property
    def name(self) -> str:
        budget = f"-mb{self.mini_batch}" if self.mini_batch else f"-tok{self.tokens}" if self.tokens else ""
        return f"{self.model}/{self.workload}/{self.variant}{budget}-b{self.batch}"

    @property
    def variant(self) -> str:
        """The provider, with ``+reuse`` / ``+sparse`` / ``+ckpt`` / ``+compile`` for the options it runs with."""
        return variant_name(asdict(self))

    @property
    def family(self) -> str:
        """The plot series: provider variant and kind of budget."""
        kind = "-mb" if self.mini_batch else "-tok" if self.tokens else ""
        return self.variant + kind


def variant_name(row: dict) -> str:
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
    if row.get("mini_batch_length_multiple"):
        name += f"+pad{row['mini_batch_length_multiple']}"
    if row.get("cuda_graphs"):
        name += "+graphs"
    return name


def file_stem(config: Config) -> str:
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
    mini_batch_length_multiple: int | None = None,
    cuda_graphs: Sequence[bool] = (False,),
) -> list[Config]:
    """The configurations of one (model, workload), budget by budget, ours and theirs side by side: each
    provider once per ``checkpointing`` x ``compiled`` setting (the backbone options both get alike;
    compiled ones in ``compile_mode``), ours also once per ``reuse`` x ``sparse_reps`` setting (reuse
    not with ``compiled``: a compiled encoder records no argmax to reuse) and per ``cuda_graphs``
    setting (not with reuse, nor by tokens), with its mini-batch lengths rounded up to
    ``mini_batch_length_multiple``; by tokens too unless ``token_budgets`` is False."""
    backbone_options = [
        {"checkpointing": c, "compiled": k, "compile_mode": compile_mode if k else "default"}
        for c in checkpointing
        for k in compiled
    ]
    ours_options = [
        {
            "reuse_argmax": r,
            "sparse_reps": sr,
            "mini_batch_length_multiple": mini_batch_length_multiple,
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


def uncached_configs(config: Config) -> Iterator[Config]:
    """``config`` (ours uncached), then at half its batch, and so on: the sizes to try until one fits."""
    batch = config.batch
    while batch >= 1:
        yield replace(config, batch=batch)
        batch //= 2
