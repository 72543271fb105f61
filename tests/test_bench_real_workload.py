"""The real-workload benchmark (benchmarks/bench_real_workload.py and its harness, benchmarks.real_workload):
its data, its sparsity calibration, its targets and a CPU smoke run."""

from __future__ import annotations

import functools
import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, BertConfig, BertForMaskedLM, PreTrainedModel

from benchmarks import bench_real_workload as script
from benchmarks.harness import StepTimer
from benchmarks.real_workload import steps
from benchmarks.real_workload.configs import Config, file_stem, plan, token_budget
from benchmarks.real_workload.models import calibrate_decoder_bias, nonzeros_per_row
from benchmarks.real_workload.report import plot, plot_style
from benchmarks.real_workload.targets import evaluate_targets
from benchmarks.real_workload.workloads import (
    Workload,
    read_scifact_pairs,
    scifact_triplets,
    short_triplets,
    take_rows,
)
from gradcache_sparton import SpladeEncoder
from gradcache_sparton.resources import default_tokenizer_path


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(default_tokenizer_path())


def test_scifact_negative_is_another_rows_positive() -> None:
    """Every hard negative is some other row's positive, never the row's own (even when rows share one)."""
    pairs = [("q0", "a"), ("q1", "a"), ("q2", "b"), ("q3", "c"), ("q4", "d")]
    triplets = scifact_triplets(pairs, seed=0)
    assert [t["query"] for t in triplets] == [q for q, _ in pairs]
    for triplet, (_, positive) in zip(triplets, pairs, strict=True):
        assert triplet["positive"] == positive
        assert triplet["negative_1"] != positive
        assert triplet["negative_1"] in {p for _, p in pairs}


def test_short_passages_have_the_requested_token_lengths(tokenizer) -> None:
    """Short-workload passages are cut to 40-120 wordpieces of a real abstract (a few tokens of re-tokenization slack)."""
    pairs = read_scifact_pairs()[:20]
    rows = short_triplets(scifact_triplets(pairs, seed=0), tokenizer, (40, 120), seed=0)
    lengths = [
        len(tokenizer(r[c], add_special_tokens=False)["input_ids"])
        for r in rows
        for c in ("positive", "negative_1")
    ]
    assert min(lengths) >= 38 and max(lengths) <= 122, lengths
    assert max(lengths) - min(lengths) > 20  # a spread of lengths, not one fixed cut


def test_take_rows_cuts_to_the_longest_kept_row() -> None:
    """Taking the first n rows also drops the padding columns none of them uses, as a collator would."""
    mask = torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 1]])
    columns = {"query": {"input_ids": torch.arange(12).view(3, 4), "attention_mask": mask}}
    taken = take_rows(columns, 2)["query"]
    assert taken["attention_mask"].tolist() == [[1, 1], [1, 0]]
    assert taken["input_ids"].tolist() == [[0, 1], [4, 5]]


def test_calibrated_bias_gives_the_target_density(tokenizer) -> None:
    """After calibration the SpladeEncoder's reps of the sample have the target fraction of non-zeros."""
    config = BertConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
    )
    torch.manual_seed(0)
    model = BertForMaskedLM(config).eval()
    texts = ["The amount of DNA data doubles.", "Bile acids regulate the transcription of genes.", "Mice."]
    features = dict(tokenizer(texts, padding=True, return_tensors="pt"))
    for target in (0.01, 0.2):
        bias = calibrate_decoder_bias(model, [features], target)
        assert float(model.get_output_embeddings().bias.detach().max()) == pytest.approx(bias)
        encoder = SpladeEncoder(model)
        nnz = nonzeros_per_row(encoder, {"all": features})["all"]
        # Exact up to ties and rounding at the threshold: a few of the 3 * V entries may flip.
        assert nnz / len(tokenizer) == pytest.approx(target, abs=2e-3)


def test_missing_pretrained_model_skips_it_unless_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without SPLADE-tiny (no package copy, no ../shared) the default run goes on without it; a
    --model_path that was given but holds no model is refused before any work."""
    missing = tmp_path / "missing"
    monkeypatch.setattr(script, "default_model_path", lambda: missing)
    args = script.parse_args(["--output_dir", str(tmp_path), "--models", "tiny,base"])
    assert args.models == ["base"]
    with pytest.raises(SystemExit):
        script.parse_args(["--output_dir", str(tmp_path), f"--model_path={missing}"])


def _row(
    provider: str, pairs_per_s: float, peak: float, mini_batch: int | None = 32, batch: int = 64
) -> dict:
    return {
        "model": "m", "workload": "w", "provider": provider, "mini_batch": mini_batch, "tokens": None,
        "batch": batch, "status": "ok", "pairs_per_s": pairs_per_s, "peak_allocated_gib": peak,
    }  # fmt: skip


def test_targets_compare_the_best_rows_within_each_memory_budget() -> None:
    """Each budget compares the fastest rows that fit it; a budget nobody fits is n/a, not a pass."""
    rows = [
        _row("ours", 100.0, 3.0),
        _row("ours", 200.0, 7.0, mini_batch=64),
        _row("st", 80.0, 3.5),
        _row("st", 150.0, 20.0, mini_batch=128),
        _row("ours-uncached", 250.0, 30.0, mini_batch=None),
        {**_row("st", 0.0, 0.0, mini_batch=256), "status": "OOM"},
    ]
    targets = {t["target"]: t for t in evaluate_targets(rows)}
    assert targets["ours vs sentence-transformers at <= 4 GiB"]["value"] == pytest.approx(100 / 80)
    assert targets["ours vs sentence-transformers at <= 8 GiB"]["value"] == pytest.approx(200 / 80)
    assert targets["ours vs sentence-transformers at <= 8 GiB"]["status"] == "PASS"
    assert targets["ours vs sentence-transformers at unlimited memory"]["value"] == pytest.approx(200 / 150)
    assert targets["ours vs sentence-transformers at unlimited memory"]["status"] == "MISS"
    assert targets["ours at 4 GiB / ours at 8 GiB"]["value"] == pytest.approx(0.5)
    assert targets["ours cached / ours uncached"]["value"] == pytest.approx(200 / 250)
    none_fit = evaluate_targets([_row("ours", 1.0, 9.0), _row("st", 1.0, 9.0)])
    assert {t["status"] for t in none_fit if "4 GiB" in t["target"] and "vs" in t["target"]} == {"n/a"}


def test_plan_gives_both_providers_the_same_backbone_options() -> None:
    """Checkpointing and compilation are run for ours and sentence-transformers alike, at every budget;
    reuse_argmax and sparse_reps only for ours, reuse never with a compiled encoder (it records no
    argmax); every configuration has its own name, and every series its own plot style."""
    workload = Workload("short", [], 100.0, 30.0)
    both = (False, True)
    configs = plan("base", workload, [16, 32], 64, "mini_batch_tokens", True, reuse=both,
                         sparse_reps=both, checkpointing=both, compiled=both)  # fmt: skip
    ours = {
        "ours", "ours+reuse", "ours+ckpt", "ours+reuse+ckpt", "ours+compile", "ours+ckpt+compile",
        "ours+sparse", "ours+reuse+sparse", "ours+sparse+ckpt", "ours+reuse+sparse+ckpt",
        "ours+sparse+compile", "ours+sparse+ckpt+compile",
    }  # fmt: skip
    theirs = {"st", "st+ckpt", "st+compile", "st+ckpt+compile"}
    assert len(configs) == 2 * 2 * len(ours | theirs)
    for budget in ({"mini_batch": 16}, {"tokens": token_budget(32, workload)}):
        mine = {
            c.variant
            for c in configs
            if c.mini_batch == budget.get("mini_batch") and c.tokens == budget.get("tokens")
        }
        assert mine == ours | theirs
    assert len({c.name for c in configs}) == len(configs)
    families = {c.family for c in configs} | {"ours-uncached", "ours-uncached+compile"}
    assert len({plot_style(f) for f in families}) == len(families)
    assert len({plot_style(f)[1] for f in families if f.endswith("-mb")}) == len(ours | theirs)
    assert plot_style("st+ckpt-mb") == ("o--", "tab:orange")
    assert plot_style("ours+compile-tok") == ("s-", "tab:purple")
    assert plot_style("ours-uncached+compile")[0] == "D"
    plain = plan("base", workload, [16], 64, None, False)
    assert [c.variant for c in plain] == ["ours"]
    rounded = plan("base", workload, [16], 64, None, True, compiled=both, token_budgets=False,
                         compile_mode="reduce-overhead", mini_batch_length_multiple=32)  # fmt: skip
    assert [c.variant for c in rounded] == ["ours+pad32", "ours+compile-ro+pad32", "st", "st+compile-ro"]
    assert [c.compile_mode for c in rounded] == ["default", "reduce-overhead", "default", "reduce-overhead"]


def test_plot_draws_or_says_why_not(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The plot is a PNG when matplotlib is importable, else a message (never an error); OOM rows are left out."""
    rows = [
        {**_row(provider, 100.0 * k, 2.0 * k, mini_batch=16 * k), "family": f"{provider}-mb"}
        for provider in ("ours", "st")
        for k in (1, 2)
    ]
    rows.append({**rows[0], "status": "OOM"})
    if importlib.util.find_spec("matplotlib") is not None:
        assert plot(rows, tmp_path / "a.png").startswith("plot:")
        assert (tmp_path / "a.png").read_bytes()[:4] == b"\x89PNG"
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    assert "matplotlib is not installed" in plot(rows, tmp_path / "b.png")
    assert not (tmp_path / "b.png").exists()


def test_merge_puts_several_runs_in_one_table(tmp_path: Path) -> None:
    """--merge joins the rows of separate calls (one per model or workload) and computes the targets
    over them, without any model work."""
    paths = []
    for i, provider in enumerate(("ours", "st")):
        meta = {"device": "X", "command": "c", "models": {f"m{i}": {"source": "s"}}}
        rows = [{**_row(provider, 100.0 * (i + 1), 3.0), "name": provider, "family": f"{provider}-mb"}]
        paths.append(tmp_path / f"{provider}.json")
        paths[-1].write_text(json.dumps({"meta": meta, "rows": rows, "targets": []}))
    out = tmp_path / "merged"
    assert script.main(["--merge", *map(str, paths), "--output_dir", str(out)]) == 0
    merged = json.loads((out / "real_workload.json").read_text())
    assert [r["provider"] for r in merged["rows"]] == ["ours", "st"]
    assert set(merged["meta"]["models"]) == {"m0", "m1"}
    speedup = {t["target"]: t["value"] for t in merged["targets"]}[
        "ours vs sentence-transformers at <= 4 GiB"
    ]
    assert speedup == pytest.approx(0.5)


def _smoke(out: Path, providers: str, *options: str) -> dict:
    argv = [
        "--smoke", "--output_dir", str(out), "--models", "base", "--workloads", "short", "--providers", providers,
        "--effective_batch", "4", "--mini_batches", "2", "--steps", "1", *options,
    ]  # fmt: skip
    assert script.main(argv) == 0
    assert (out / "real_workload.md").read_text().startswith("Real-workload benchmark")
    payload = json.loads((out / "real_workload.json").read_text())
    rows = payload["rows"]
    assert rows and all(r["status"] == "ok" for r in rows), [(r["name"], r["status"]) for r in rows]
    return payload


def test_smoke_run_of_our_providers(tmp_path: Path) -> None:
    """A tiny CPU run times every configuration of ours (cached with and without reuse_argmax, token budget
    if offered, uncached) and records the calibrated start's density within 1-3% of the tokens, measured
    on the workload's text."""
    payload = _smoke(tmp_path, "ours,ours-uncached")
    families = {r["family"] for r in payload["rows"]}
    expected = {"ours-mb", "ours+reuse-mb", "ours-uncached"}
    if steps.token_budget_parameter():
        expected |= {"ours-tok", "ours+reuse-tok"}
    assert families == expected
    density = payload["meta"]["models"]["base"]["density"]["short"]
    assert all(0.005 < d < 0.05 for d in density.values()), density


@pytest.mark.skipif(
    importlib.util.find_spec("sentence_transformers") is None,
    reason="sentence-transformers is not installed (it is optional: pip install sentence-transformers==6.0.1)",
)
def test_smoke_run_of_sentence_transformers(tmp_path: Path) -> None:
    """sentence-transformers' CachedSpladeLoss runs by rows and by tokens, and its SparseEncoder built from
    the same directory gives our reps (so both providers train the same function)."""
    payload = _smoke(tmp_path, "st")
    assert {r["family"] for r in payload["rows"]} == {"st-mb", "st-tok"}
    assert payload["meta"]["models"]["base"]["max_rep_difference_vs_sentence_transformers"] < 1e-5


def test_smoke_run_with_checkpointing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--checkpointing on turns on transformers' non-reentrant activation checkpointing in every
    provider's backbone (sentence-transformers' too, when installed) and the steps still run."""
    name, key = (
        ("activation_checkpointing_enable", "activation_checkpointing_kwargs")
        if hasattr(PreTrainedModel, "activation_checkpointing_enable")
        else ("gradient_checkpointing_enable", "gradient_checkpointing_kwargs")
    )
    enabled = []
    original = getattr(PreTrainedModel, name)

    def spy(self, **kwargs):
        enabled.append((type(self).__name__, kwargs[key]))
        return original(self, **kwargs)

    monkeypatch.setattr(PreTrainedModel, name, spy)
    with_st = importlib.util.find_spec("sentence_transformers") is not None
    providers = "ours,st" if with_st else "ours"
    options = ("--checkpointing", "on", "--reuse_argmax", "off", "--no-token_budgets")
    payload = _smoke(tmp_path, providers, *options)
    assert {r["family"] for r in payload["rows"]} == {"ours+ckpt-mb"} | ({"st+ckpt-mb"} if with_st else set())
    assert enabled == [("BertForMaskedLM", {"use_reentrant": False})] * (2 if with_st else 1)


def test_smoke_run_with_sparse_reps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--sparse_reps both runs ours with the dense and with the sparse rep cache (CachedLoss's
    sparse_reps off, then on); both steps run."""
    seen = []

    class Spy(steps.CachedLoss):
        @functools.wraps(steps.CachedLoss.__init__)  # the script reads CachedLoss's signature
        def __init__(self, *args, **kwargs):
            seen.append(kwargs.get("sparse_reps", False))
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(steps, "CachedLoss", Spy)
    options = ("--sparse_reps", "both", "--reuse_argmax", "off", "--no-token_budgets")
    payload = _smoke(tmp_path, "ours", *options)
    assert {r["family"] for r in payload["rows"]} == {"ours-mb", "ours+sparse-mb"}
    assert seen == [r["sparse_reps"] for r in payload["rows"]] == [False, True]


def test_smoke_run_with_rounded_lengths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--mini_batch_length_multiple reaches ours' engine (CachedLoss's mini_batch_length_multiple) and names the rows."""
    seen = []

    class Spy(steps.CachedLoss):
        @functools.wraps(steps.CachedLoss.__init__)  # the script reads CachedLoss's signature
        def __init__(self, *args, **kwargs):
            seen.append(kwargs.get("mini_batch_length_multiple"))
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(steps, "CachedLoss", Spy)
    options = ("--mini_batch_length_multiple", "16", "--reuse_argmax", "off", "--no-token_budgets")
    payload = _smoke(tmp_path, "ours", *options)
    assert [r["family"] for r in payload["rows"]] == ["ours+pad16-mb"]
    assert seen == [16] and payload["rows"][0]["status"] == "ok"


def test_sync_audit_counts_syncs_by_call_site(monkeypatch: pytest.MonkeyPatch) -> None:
    """--sync_audit counts the sync warnings of one step by their innermost call sites outside torch, and
    lets other warnings through (torch's debug mode itself is stubbed: this machine may have no CUDA)."""
    import warnings

    modes = []
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)
    tool = StepTimer(torch.device("cpu"), Path("unused"))

    def synchronising() -> None:
        warnings.warn("called a synchronizing CUDA operation", UserWarning, stacklevel=1)

    def step(columns) -> None:
        for _ in range(3):
            synchronising()
        warnings.warn("something else", UserWarning, stacklevel=1)

    with pytest.warns(UserWarning, match="something else"):
        sites = tool.sync_sites(step, {})
    assert modes == ["warn", "default"]
    assert list(sites.values()) == [3]
    site = next(iter(sites))
    assert site.startswith("test_bench_real_workload.py:") and "synchronising" in site


def test_python_profile_writes_the_step_table(tmp_path: Path) -> None:
    """--cprofile times one step under cProfile and writes its functions by own and cumulative time to
    cprofile_<configuration>.txt, the name's '+' and '/' made file-safe."""
    tool = StepTimer(torch.device("cpu"), tmp_path)
    config = Config("base", "scifact", "ours", mini_batch=16, batch=64, reuse_argmax=True)

    def busy_step(columns) -> None:
        sum(i * i for i in range(10_000))

    seconds = tool.python_profile(busy_step, {}, file_stem(config))
    text = (tmp_path / "cprofile_base_scifact_ours_reuse-mb16-b64.txt").read_text()
    assert seconds > 0 and "busy_step" in text and "Ordered by: internal time" in text
    assert "Ordered by: cumulative time" in text


def test_a_failing_configuration_keeps_its_row() -> None:
    """harness.measured_row: a configuration that runs out of memory or fails is a row with that status (the
    error named), one that runs is a row with its numbers and status ok; the header stays either way."""
    from benchmarks.harness import measured_row

    cpu = torch.device("cpu")

    def oom() -> dict:
        raise torch.OutOfMemoryError("CUDA out of memory")

    def broken() -> dict:
        raise ValueError("bad shape")

    assert measured_row({"name": "a"}, lambda: {"pairs_per_s": 3.0}, cpu) == {
        "name": "a",
        "pairs_per_s": 3.0,
        "status": "ok",
    }
    assert measured_row({"name": "b"}, oom, cpu) == {"name": "b", "status": "OOM"}
    assert measured_row({"name": "c"}, broken, cpu) == {"name": "c", "status": "error: ValueError: bad shape"}
