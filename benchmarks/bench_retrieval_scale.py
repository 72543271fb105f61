"""Evaluation at corpus scale: encoding throughput, and retrieval over a 1M-document corpus.

Legend: N documents, Q queries, V vocabulary, K top-k.

1. **Statistics of a trained model.** The shipped SPLADE-tiny (``splade-tiny-msmarco``) encodes the
   shipped SciFact dev sample (1,108 abstracts at 256 tokens, 100 claims at 32): non-zeros per rep,
   each term's document frequency, and the weights.
2. **Encoding throughput** (docs/s): the same model encodes the abstracts, repeated to
   ``--encode_docs`` (real text), through :func:`~gradcache_sparton.evaluation.encode_texts` (the fused
   head on CUDA, bf16 autocast), after one warm-up batch.
3. **A synthetic corpus with those statistics**: N document and Q query reps, each with a non-zero count
   drawn from the measured ones, its terms drawn without replacement with probability proportional to
   their document frequency (Gumbel top-k), its weights drawn from the measured weights.
4. **Exhaustive search** (:func:`~gradcache_sparton.evaluation.retrieve`, chunked, on the GPU when there
   is one): wall time for all Q queries and peak GPU memory.
5. **seismic** (:func:`~gradcache_sparton.evaluation.build_seismic_index` /
   :func:`~gradcache_sparton.evaluation.search_seismic`): build time and per-query latency at fast
   settings (pruned posting lists, summaries and heap factor) over all N documents, then at the exact
   defaults over the first ``--exact_docs`` of them, the process's peak RSS after each build, and
   recall@10 against exhaustive search over the same documents. The exact index is not built over all
   N: its build grows faster than its postings (on the development CPU, 60,000 documents took 215 s
   exact against 79 s fast, for 1.4x the postings). With pyseismic-lsr 0.5.2 / 0.5.3 (no batched
   ``add_documents_by_id``) the documents enter the index one ``add_document`` call at a time, about
   27 µs per 250-term document on the development CPU.

On the GPU machine (``pyseismic-lsr`` must be installed; see ``../shared/device-wheels/README.md``):

    python -m benchmarks.bench_retrieval_scale --out $OUT/scale            # N = 1,000,000, Q = 1,000

``--smoke`` runs a CPU-sized version (statistics of 64 abstracts and 16 claims, N = 500, Q = 5). Writes ``retrieval_scale.json`` and
``retrieval_scale.md`` (the tables) to ``--out``; steps past ``--time_budget_s`` are skipped and named.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from benchmarks.common import run_stamp
from gradcache_sparton.arguments import ModelArguments
from gradcache_sparton.data import default_dev_beir_path, load_beir
from gradcache_sparton.evaluation import (
    SparseReps,
    build_seismic_index,
    encode_texts,
    retrieve,
    search_seismic,
    seismic_available,
)
from gradcache_sparton.model_loading import build_tokenizer, resolve_model_location
from gradcache_sparton.modeling import SpladeEncoder

MODEL = "splade-tiny-msmarco"
# Trained SPLADE settings for a fast, approximate index (seismic's guidelines: a few thousand postings
# per term, summaries keeping most of the energy, a heap factor just below 1).
FAST = {"n_postings": 4000, "summary_energy": 0.5, "heap_factor": 0.9}
# Documents per Gumbel top-k draw: [chunk, V] float32 scores (30,522 columns: 500 MB at 4,096).
SYNTH_CHUNK = 4096


def measured_statistics(reps: SparseReps) -> dict[str, Tensor]:
    """Non-zeros per row [R], document frequency per term [V] and all weights [nnz] of ``reps``."""
    df = torch.bincount(reps.token_ids.to(torch.int64), minlength=reps.vocab_size).to(torch.float32)
    return {"nnz": reps.nonzeros_per_row(), "df": df, "weights": reps.weights.to(torch.float32)}


def synthesize(stats: dict[str, Tensor], rows: int, *, device: torch.device, seed: int) -> SparseReps:
    """``rows`` reps with the non-zero counts, term frequencies and weights of ``stats`` (module doc)."""
    generator = torch.Generator(device=device).manual_seed(seed)
    log_p = (stats["df"] + 0.1).log().to(device)  # unseen terms stay possible, rarely
    nnz, weights = stats["nnz"].to(device), stats["weights"].to(device)
    max_nnz = int(nnz.max())
    parts = []
    for start in range(0, rows, SYNTH_CHUNK):
        count = min(SYNTH_CHUNK, rows - start)
        row_nnz = nnz[torch.randint(len(nnz), (count,), generator=generator, device=device)]  # [C]
        uniform = torch.rand(count, log_p.numel(), generator=generator, device=device)
        gumbel = log_p - torch.log(-torch.log(uniform.clamp_min(1e-20)))  # [C, V]
        terms = gumbel.topk(max_nnz, dim=1).indices  # [C, max_nnz]: a draw without replacement
        keep = torch.arange(max_nnz, device=device) < row_nnz[:, None]  # [C, max_nnz]
        values = weights[torch.randint(len(weights), terms.shape, generator=generator, device=device)]
        dense = torch.zeros(count, log_p.numel(), device=device)
        dense.scatter_(1, terms, values * keep)
        # Sparsified where it was drawn: only the non-zeros cross to the host (a dense chunk is 500 MB).
        parts.append(SparseReps.from_dense(dense).to("cpu"))
    return SparseReps.concat(parts)


def peak_rss_gib() -> float:
    """This process's peak resident memory so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--num_docs", type=int, default=1_000_000)
    parser.add_argument("--num_queries", type=int, default=1000)
    parser.add_argument("--encode_docs", type=int, default=20_000, help="abstracts encoded for throughput")
    parser.add_argument("--exact_docs", type=int, default=100_000, help="documents in the exact index")
    parser.add_argument("--top_k", type=int, default=100)
    parser.add_argument("--seismic_threads", type=int, default=0, help="index build threads (0: all)")
    parser.add_argument("--time_budget_s", type=float, default=540.0)
    parser.add_argument("--smoke", action="store_true", help="N 500, Q 5, 32 encoded docs (CPU check)")
    args = parser.parse_args()
    if args.smoke:
        args.num_docs, args.num_queries, args.encode_docs, args.exact_docs = 500, 5, 32, 300
    began = time.monotonic()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"stamp": run_stamp(device), "command": " ".join(sys.argv), "skipped": []}

    def save() -> None:
        (args.out / "retrieval_scale.json").write_text(json.dumps(results, indent=1) + "\n")
        (args.out / "retrieval_scale.md").write_text(tables(results))

    def within_budget(step: str) -> bool:
        if time.monotonic() - began < args.time_budget_s:
            return True
        results["skipped"].append(step)
        print(f"time budget spent: skipping {step}", flush=True)
        return False

    # 1. Statistics of the trained model on real text.
    dev = load_beir(default_dev_beir_path(), split="dev")
    tokenizer = build_tokenizer(ModelArguments(model_name_or_path=MODEL))
    encoder = SpladeEncoder.from_pretrained(resolve_model_location(MODEL)).to(device).eval()
    autocast = torch.bfloat16 if device.type == "cuda" else None
    abstracts = list(dev.corpus.values())[: 64 if args.smoke else None]
    encode = {"tokenizer": tokenizer, "device": device, "autocast_dtype": autocast, "show_progress": False}
    doc_reps = encode_texts(encoder, abstracts, max_length=256, batch_size=128, **encode)
    query_reps = encode_texts(
        encoder, list(dev.queries.values())[: 16 if args.smoke else None], max_length=32, **encode
    )
    doc_stats, query_stats = measured_statistics(doc_reps), measured_statistics(query_reps)
    results["statistics"] = {
        name: {"rows": stats["nnz"].numel(), "mean_nnz": stats["nnz"].float().mean().item(),
               "max_nnz": int(stats["nnz"].max()), "terms_seen": int((stats["df"] > 0).sum()),
               "mean_weight": stats["weights"].mean().item()}
        for name, stats in (("documents", doc_stats), ("queries", query_stats))
    }  # fmt: skip
    print(f"statistics: {results['statistics']}", flush=True)

    # 2. Encoding throughput on real text.
    texts = (abstracts * (args.encode_docs // len(abstracts) + 1))[: args.encode_docs]
    encode_texts(encoder, texts[:128], max_length=256, batch_size=128, **encode)  # warm-up (compilation)
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.monotonic()
    encode_texts(encoder, texts, max_length=256, batch_size=128, **encode)
    seconds = time.monotonic() - start
    results["encoding"] = {
        "docs": len(texts),
        "max_length": 256,
        "seconds": seconds,
        "docs_per_s": len(texts) / seconds,
    }
    print(f"encoding: {results['encoding']}", flush=True)
    save()

    # 3. The synthetic corpus and queries.
    start = time.monotonic()
    docs = synthesize(doc_stats, args.num_docs, device=device, seed=0)
    queries = synthesize(query_stats, args.num_queries, device=device, seed=1)
    results["corpus"] = {
        "documents": docs.num_rows, "queries": queries.num_rows, "postings": int(docs.token_ids.numel()),
        "mean_doc_nnz": docs.nonzeros_per_row().float().mean().item(),
        "mean_query_nnz": queries.nonzeros_per_row().float().mean().item(),
        "synthesis_s": time.monotonic() - start,
    }  # fmt: skip
    print(f"corpus: {results['corpus']}", flush=True)
    save()

    # 4. Exhaustive search.
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    retrieve(
        queries.select(torch.arange(min(8, queries.num_rows))),
        docs.select(torch.arange(min(1000, docs.num_rows))),
        device=device,
    )
    start = time.monotonic()
    _, index = retrieve(queries, docs, top_k=args.top_k, device=device)
    exhaustive_s = time.monotonic() - start
    results["exhaustive"] = {
        "device": str(device), "seconds": exhaustive_s, "ms_per_query": 1000 * exhaustive_s / queries.num_rows,
        "peak_gpu_gib": (torch.cuda.max_memory_allocated() - base) / 2**30 if device.type == "cuda" else None,
    }  # fmt: skip
    print(f"exhaustive: {results['exhaustive']}", flush=True)
    top10 = {"fast": [set(row[:10]) for row in index.tolist()]}
    exact_docs = docs.select(torch.arange(min(args.exact_docs, docs.num_rows)))
    top10["exact"] = [set(row) for row in retrieve(queries, exact_docs, top_k=10, device=device)[1].tolist()]
    save()

    # 5. seismic, fast over all documents, exact over the first exact_docs.
    results["seismic"] = []
    if not seismic_available():
        results["skipped"].append("seismic (pyseismic-lsr not installed)")
    for name, settings, indexed in (("fast", FAST, docs), ("exact", {}, exact_docs)):
        if not seismic_available() or not within_budget(f"seismic {name}"):
            continue
        start = time.monotonic()
        built = build_seismic_index(
            indexed, n_postings=settings.get("n_postings"), summary_energy=settings.get("summary_energy", 1.0),
            num_threads=args.seismic_threads,
        )  # fmt: skip
        build_s = time.monotonic() - start
        start = time.monotonic()
        hits = search_seismic(built, queries, top_k=args.top_k, heap_factor=settings.get("heap_factor", 1.0))
        search_s = time.monotonic() - start
        recall = sum(
            len(exact & {i for i, _ in found[:10]}) / max(1, len(exact)) for exact, found in zip(top10[name], hits, strict=True)
        ) / len(hits)  # fmt: skip
        row = {"settings": name, "documents": indexed.num_rows, **settings, "build_s": build_s,
               "ms_per_query": 1000 * search_s / len(hits), "recall_at_10_vs_exhaustive": recall,
               "peak_rss_gib": peak_rss_gib()}  # fmt: skip
        results["seismic"].append(row)
        print(f"seismic: {row}", flush=True)
        del built
        save()
    save()
    print(tables(results), flush=True)
    return 0


def tables(results: dict[str, Any]) -> str:
    """The results as markdown: where it ran, then one table per step that ran."""
    stamp = results["stamp"]
    lines = [f"{stamp['device']}, torch {stamp['torch']}, {stamp['date']}: `{results['command']}`", ""]
    if "encoding" in results:
        e = results["encoding"]
        lines += ["| encoding | docs | max length | s | docs/s |", "|---|---|---|---|---|",
                  f"| {MODEL} | {e['docs']:,} | {e['max_length']} | {e['seconds']:.1f} | {e['docs_per_s']:,.0f} |", ""]  # fmt: skip
    if "corpus" in results:
        c = results["corpus"]
        lines += ["| corpus | documents | queries | postings | doc nnz | query nnz |", "|---|---|---|---|---|---|",
                  f"| synthetic | {c['documents']:,} | {c['queries']:,} | {c['postings']:,} | "
                  f"{c['mean_doc_nnz']:.0f} | {c['mean_query_nnz']:.0f} |", ""]  # fmt: skip
    rows = []
    if "exhaustive" in results:
        x = results["exhaustive"]
        peak = "-" if x["peak_gpu_gib"] is None else f"{x['peak_gpu_gib']:.2f} GiB GPU"
        documents = results["corpus"]["documents"]
        rows.append(
            f"| exhaustive ({x['device']}) | {documents:,} | - | {x['ms_per_query']:.2f} | 1.000 | {peak} |"
        )
    for s in results.get("seismic", []):
        rows.append(f"| seismic {s['settings']} | {s['documents']:,} | {s['build_s']:.1f} | {s['ms_per_query']:.2f} | "
                    f"{s['recall_at_10_vs_exhaustive']:.3f} | {s['peak_rss_gib']:.1f} GiB RSS (process) |")  # fmt: skip
    if rows:
        lines += [
            "| retrieval | documents | build s | ms / query | recall@10 vs exhaustive | memory |",
            "|---|---|---|---|---|---|",
            *rows,
        ]
    if results["skipped"]:
        lines += ["", f"skipped: {', '.join(results['skipped'])}"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
