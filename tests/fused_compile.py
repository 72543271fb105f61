"""Compile the fused loss's Triton kernels for an H100 (sm_90) without a GPU: one process, run by
tests/test_fused_lse_compile.py without TRITON_INTERPRET (under the interpreter ``@triton.jit`` gives functions
Triton's compiler cannot take).

``python tests/fused_compile.py SHAPE TILES`` compiles every kernel specialization the GPU path launches under the
setting SHAPE (a JSON object of ``fused_lse.TileShape``'s fields) with tiles of dtype TILES (bf16 or fp32) and
prints one JSON line per specialization: its name, the shared memory a block needs, or the compiler's error.
"""

from __future__ import annotations

import json
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from gradcache_sparton.losses import fused_lse, fused_lse_triton, stored_weights_triton

V = 30_522  # BERT's vocabulary: the document block and its windows follow from it
POINTERS = {"QT", "COLS", "TILE_PTR", "ROWS", "DT", "RUN_MAX", "RUN_SUM", "LSE", "G", "GQT", "GDT", "DENSE",
            "DENSE_COUNT", "P", "PAIR_ROW", "PAIR_DOC", "PAIR_P", "PAIR_COUNT", "Q_OFF", "Q_IDS", "Q_W", "GQ",
            "COLD_END", "QH", "HOT_IDS", "CHUNK_TILE", "CHUNK_ROW"}  # fmt: skip
INT_POINTERS = {
    "COLS",
    "TILE_PTR",
    "ROWS",
    "DENSE",
    "DENSE_COUNT",
    "PAIR_ROW",
    "PAIR_DOC",
    "PAIR_COUNT",
    "Q_IDS",
    "COLD_END",
    "HOT_IDS",
    "CHUNK_TILE",
    "CHUNK_ROW",
}


def signature(kernel: triton.JITFunction, constexprs: dict, tiles: str) -> dict[str, str]:
    """Triton's signature of ``kernel``: tiles (QT, DT) of dtype ``tiles``, the CSR offsets int64, other tables
    int32, buffers fp32 (the stored weights P bf16 where SPLIT), scalars int32 (``inv_t`` fp32), the ``constexprs``
    as such."""

    def kind(name: str) -> str:
        if name in constexprs:
            return "constexpr"
        if name in ("QT", "DT", "QH") or (name == "P" and constexprs.get("SPLIT")):
            return "*" + tiles
        if name == "Q_OFF":
            return "*i64"
        if name in POINTERS:
            return "*i32" if name in INT_POINTERS else "*fp32"
        return "fp32" if name == "inv_t" else "i32"

    return {name: kind(name) for name in kernel.arg_names}


def launches(shape: fused_lse.TileShape, ieee: bool) -> list[tuple[str, triton.JITFunction, dict]]:
    """Every (name, kernel, constexprs) the GPU path launches under ``shape``: both gradients or either alone, the
    dense tiles listed by the scan or all of them, windows as the setting makes them at V; with ``store_weights``
    the query pass stores the softmax weights and the document pass reads them; with ``hot_columns`` the document
    pass leaves the hot columns to the hot kernel; with ``query_grad_from_stored`` the query pass only stores the
    weights (``bn_store`` documents wide) and the query-gradient kernel reads them; with ``store_split`` (bf16 tiles)
    the weights are stored as bf16 parts."""
    bd = fused_lse._document_rows(V, shape)
    split = shape.store_split and not ieee
    windowed = fused_lse._window(shape, bd) < bd
    common = {"BM": shape.bm, "BK": shape.bk, "IEEE": ieee}
    out = [
        (
            "forward",
            fused_lse_triton._forward_kernel,
            {**common, "BN": shape.bn_forward, "WINDOWED": windowed},
        ),
        ("scan", fused_lse_triton._scan_kernel, {**common, "BN": shape.bn_scan, "WINDOWED": windowed}),
    ]

    def dense(name: str, bn: int = shape.bn_backward, **flags: bool) -> tuple[str, triton.JITFunction, dict]:
        constexprs = {**common, "BN": bn, "SPAN": shape.bn_scan, "PARTS": fused_lse.SPLIT_PARTS, "WINDOWED": windowed,
                      "HOT": False, "SPLIT": split and (flags["STORE"] or flags["LOAD"]), **flags}  # fmt: skip
        return f"dense {name}", fused_lse_triton._dense_kernel, constexprs

    for need_q, need_d in ((True, True), (True, False), (False, True)):
        for listed in (False, True):
            out.append(dense(
                f"q{need_q:d} d{need_d:d} listed{listed:d}", NEED_Q=need_q, NEED_D=need_d,
                STORE=shape.store_weights and not need_d, LOAD=shape.store_weights and not need_q, LISTED=listed,
            ))  # fmt: skip
    if shape.hot_columns:
        out.append(
            dense(
                "q0 d1 listed0 hot", NEED_Q=False, NEED_D=True, STORE=False, LOAD=True, LISTED=False, HOT=True
            )
        )
        hot = stored_weights_triton.HOT_TILE
        out.append((
            "hot", stored_weights_triton._hot_kernel,
            {"BH": hot.bh, "BN": hot.bn, "BR": shape.bm, "IEEE": ieee, "PARTS": fused_lse.SPLIT_PARTS, "SPLIT": split},
        ))  # fmt: skip
    if shape.query_grad_from_stored:
        store = {"NEED_Q": False, "NEED_D": False, "STORE": True, "LOAD": False, "LISTED": False}
        out.append(dense("q0 d0 listed0 store", shape.bn_store or shape.bn_backward, **store))
        chunk = stored_weights_triton.QUERY_GRAD_TILE
        out.append((
            "query_grad", stored_weights_triton._query_grad_kernel,
            {"BM": shape.bm, "BC": chunk.bc, "BN": chunk.bn, "IEEE": ieee, "PARTS": fused_lse.SPLIT_PARTS,
             "SPLIT": split},
        ))  # fmt: skip
    out.append((
        "pairs", fused_lse_triton._pairs_kernel,
        {"P": fused_lse_triton.PAIR_BLOCK, "E": fused_lse_triton.ENTRY_BLOCK, "IEEE": ieee, "NEED_Q": True,
         "NEED_D": True},
    ))  # fmt: skip
    return out


def main(shape_json: str, tiles: str) -> int:
    shape = fused_lse.TileShape(**json.loads(shape_json))
    own = {"hot": stored_weights_triton.HOT_TILE, "query_grad": stored_weights_triton.QUERY_GRAD_TILE}
    for name, kernel, constexprs in launches(shape, ieee=tiles == "fp32"):
        setting = own.get(name, shape)  # the whole-block kernels' own launch settings
        options = {"num_warps": setting.warps, "num_stages": setting.stages}
        source = ASTSource(kernel, signature(kernel, constexprs, tiles), constexprs=constexprs)
        try:
            compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
            row = {
                "name": name,
                "shared": compiled.metadata.shared,
                "cubin_bytes": len(compiled.asm["cubin"]),
            }
        except Exception as error:
            row = {"name": name, "error": f"{type(error).__name__}: {error}"[:2000]}
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
