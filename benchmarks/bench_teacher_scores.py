"""Teacher scoring throughput (training rows a second) on the GPU in bf16, and CPU fp32 against GPU bf16 agreement.

Legend: R training rows, C = 1 + k candidates per row, S tokens.

The rows: SciFact queries (claims and abstract sentences, ``benchmarks.scifact_text``) each with its positive
abstract and ``--negatives`` abstracts drawn at random (seeded), i.e. what ``gradcache-sparton teacher`` scores.
The teachers (``--kinds``): ``splade``, the shipped SPLADE-tiny (real weights, ours, queries 32 / documents 256
tokens); ``sparse_encoder``, ``sentence_transformer`` and ``cross_encoder``, sentence-transformers models of a
BERT shape with random weights (``--shape base``: 12 layers, 768 wide, the size of the usual public teachers;
``tiny`` for a smoke run), documents at 256 tokens. Each kind scores the R rows' candidates (no corpus: the
``minmax`` path) once to warm up on 64 rows, then once timed: rows/s = R / seconds (CUDA synchronised).

Agreement: the first ``--check_rows`` rows scored again on the CPU in fp32; per row, the largest difference
between the GPU's bf16 score and the CPU's, relative to the row's largest |score| (the scale the per-query
normalisation divides by). Tolerance 2^-6 = 4 bf16 units of roundoff (u = 2^-8): a score is a sum of products
q_v · d_v (or a cosine of two embeddings, or a logit); if each factor is within two bf16 roundings of its fp32
value (the autocast matmul's bf16 inputs, its bf16 output), each product is within (1 + 2u)^2 - 1 ≈ 4u, and so
is a sum of same-sign products relative to its own size. Sums of mixed-sign products (dense embeddings, the
cross-encoder's logit) can cancel, so their error is stated against the row's scale, not the score's; the
fraction of rows within the tolerance and the largest error are both written.

    python -m benchmarks.bench_teacher_scores --output benchmarks/results/teacher_scores_h100.json

``--smoke`` (tiny shapes, 32 rows, any device) checks the script; its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import run_stamp, write_result
from benchmarks.scifact_text import teacher_rows

__all__ = ["build_random_teachers", "main", "parse_args"]

KINDS = ("splade", "sparse_encoder", "sentence_transformer", "cross_encoder")
SHAPES = {
    "base": {
        "hidden_size": 768,
        "num_hidden_layers": 12,
        "num_attention_heads": 12,
        "intermediate_size": 3072,
    },
    "tiny": {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 64},
}
TOLERANCE = 2.0**-6  # 4 bf16 roundoffs (module docstring)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--beir_path", default="default", help="BEIR folder of the texts ('default': the shipped sample)"
    )
    parser.add_argument("--rows", type=int, default=4096, help="training rows scored (R)")
    parser.add_argument("--negatives", type=int, default=7, help="negatives a row (C = 1 + k)")
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    parser.add_argument(
        "--shape", default="base", choices=sorted(SHAPES), help="random sentence-transformers models"
    )
    parser.add_argument("--batch_size", type=int, default=128, help="texts (cross-encoder: pairs) at once")
    parser.add_argument("--check_rows", type=int, default=256, help="rows scored on the CPU too (agreement)")
    parser.add_argument(
        "--smoke", action="store_true", help="tiny shapes and 32 rows: checks the script only"
    )
    parser.add_argument("--output", type=Path, default=None, help="JSON result file")
    args = parser.parse_args(argv)
    if args.smoke:
        args.rows, args.check_rows, args.shape, args.batch_size = 32, 8, "tiny", 16
    return args


def build_random_teachers(folder: Path, shape: dict[str, int]) -> dict[str, Path]:
    """sentence-transformers teachers of a BERT ``shape`` with random weights and the shipped tokenizer."""
    from sentence_transformers import CrossEncoder, SentenceTransformer, SparseEncoder
    from sentence_transformers.sentence_transformer.modules import Pooling, Transformer
    from sentence_transformers.sparse_encoder.modules import SpladePooling
    from transformers import (
        AutoTokenizer,
        BertConfig,
        BertForMaskedLM,
        BertForSequenceClassification,
        BertModel,
    )

    from gradcache_sparton.resources import default_tokenizer_path

    tokenizer = AutoTokenizer.from_pretrained(default_tokenizer_path())
    torch.manual_seed(0)
    config = {"vocab_size": len(tokenizer), **shape}
    for name, model in (
        ("bert", BertModel(BertConfig(**config))),
        ("mlm", BertForMaskedLM(BertConfig(**config))),
        ("cls", BertForSequenceClassification(BertConfig(**config, num_labels=1))),
    ):
        model.save_pretrained(folder / name)
        tokenizer.save_pretrained(folder / name)
    kwargs = {"max_seq_length": 256}
    width = shape["hidden_size"]
    SentenceTransformer(modules=[Transformer(str(folder / "bert"), **kwargs), Pooling(width, "mean")]).save(
        str(folder / "sentence_transformer")
    )
    SparseEncoder(
        modules=[
            Transformer(str(folder / "mlm"), transformer_task="fill-mask", **kwargs),
            SpladePooling("max"),
        ]
    ).save(str(folder / "sparse_encoder"))
    CrossEncoder(str(folder / "cls"), max_length=256).save(str(folder / "cross_encoder"))
    return {kind: folder / kind for kind in ("sentence_transformer", "sparse_encoder", "cross_encoder")}


def _scores(
    name: str, kind: str, device: str, batch_size: int, queries: list, candidates: list
) -> torch.Tensor:
    from gradcache_sparton.mining import load_teacher

    teacher = load_teacher(
        name, kind=kind, device=device, bf16=True, batch_size=batch_size, query_max_length=32,
        document_max_length=256, show_progress=False,
    )  # fmt: skip
    return teacher.scores(queries, candidates, [])[0]


def _timed(
    name: str, kind: str, batch_size: int, queries: list, candidates: list
) -> tuple[torch.Tensor, float]:
    from gradcache_sparton.mining import load_teacher

    teacher = load_teacher(
        name, kind=kind, device="cuda", bf16=True, batch_size=batch_size, query_max_length=32,
        document_max_length=256, show_progress=False,
    )  # fmt: skip
    teacher.scores(queries[:64], candidates[:64], [])  # warm-up: kernels, allocator
    torch.cuda.synchronize()
    start = time.perf_counter()
    scores = teacher.scores(queries, candidates, [])[0]
    torch.cuda.synchronize()
    return scores, time.perf_counter() - start


def _agreement(gpu: torch.Tensor, cpu: torch.Tensor) -> dict[str, Any]:
    scale = cpu.abs().max(dim=1, keepdim=True).values.clamp_min(torch.finfo(torch.float32).tiny)  # [R, 1]
    error = ((gpu - cpu).abs() / scale).max(dim=1).values  # [R]
    return {
        "max_relative_error": error.max().item(),
        "median_relative_error": error.median().item(),
        "rows_within_tolerance": (error <= TOLERANCE).float().mean().item(),
        "tolerance": TOLERANCE,
        "agree": bool((error <= TOLERANCE).all()),
        "same_top_candidate": (gpu.argmax(dim=1) == cpu.argmax(dim=1)).float().mean().item(),
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    on_gpu = torch.cuda.is_available()
    if not on_gpu and not args.smoke:
        print("bench_teacher_scores: needs a CUDA GPU (or --smoke)", file=sys.stderr)
        return 2
    queries, candidates = teacher_rows(args.beir_path, args.rows, args.negatives)
    result: dict[str, Any] = {
        "stamp": run_stamp(),
        "command": "python -m benchmarks.bench_teacher_scores "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "rows": len(queries),
        "candidates_per_row": 1 + args.negatives,
        "shape": args.shape,
        "teachers": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        folders = {"splade": "splade-tiny-msmarco"}
        if set(args.kinds) - {"splade"}:
            folders.update(
                {k: str(v) for k, v in build_random_teachers(Path(tmp), SHAPES[args.shape]).items()}
            )
        for kind in args.kinds:
            entry: dict[str, Any] = {
                "teacher": folders[kind] if kind == "splade" else f"random BERT {args.shape}"
            }
            if on_gpu:
                gpu, seconds = _timed(folders[kind], kind, args.batch_size, queries, candidates)
                entry.update(seconds=round(seconds, 3), rows_per_second=round(len(queries) / seconds, 1))
            else:
                gpu = _scores(folders[kind], kind, "cpu", args.batch_size, queries, candidates)
            n = args.check_rows
            cpu = _scores(folders[kind], kind, "cpu", args.batch_size, queries[:n], candidates[:n])
            entry["cpu_fp32_vs_gpu_bf16"] = _agreement(gpu[:n], cpu)
            result["teachers"][kind] = entry
            print(kind, entry, flush=True)
    print(write_result(result, args.output))
    return 0


if __name__ == "__main__":
    sys.exit(main())
