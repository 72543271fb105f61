"""The fused loss's Triton kernels (``losses/fused_lse_triton.py``) compile for an H100 (sm_90) on a machine without
a GPU, under every named setting (``fused_lse.VARIANTS``, ``GPU_TILES`` among them) with bf16 tiles, and under
GPU_TILES with fp32 tiles.

CI has no GPU, and the CPU tests run the kernels through the interpreter, which executes their Python and never
calls Triton's compiler: a kernel that only the compiler rejects (a type or a constexpr branch the interpreter
accepts), or a setting whose tiles need more shared memory than an H100 gives one block (227 KiB: its launch
would fail "out of resources"; no named setting comes near it today), would reach a GPU user first.
``tests/fused_compile.py`` compiles each specialization the GPU path can launch to a cubin (Triton's bundled
ptxas), in a process without TRITON_INTERPRET. Skipped where the installed Triton has no NVIDIA backend.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gradcache_sparton.losses import fused_lse

pytestmark = pytest.mark.kernel

SCRIPT = Path(__file__).with_name("fused_compile.py")
ROOT = SCRIPT.parents[1]
H100_SHARED_BYTES = 227 * 1024  # the most dynamic shared memory one block may use on sm_90


def _compiled(shape: fused_lse.TileShape, tiles: str) -> list[dict]:
    """What tests/fused_compile.py reports for ``shape`` and ``tiles``, one row a specialization."""
    pytest.importorskip("triton")
    from triton.backends import backends

    if "nvidia" not in backends:
        pytest.skip("this Triton has no NVIDIA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    done = subprocess.run([sys.executable, str(SCRIPT), json.dumps(shape._asdict()), tiles], env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in done.stdout.splitlines()]


GPU_TILES_NAME = next(name for name, shape in fused_lse.VARIANTS.items() if shape == fused_lse.GPU_TILES)
# bf16 tiles (reps made under bf16 autocast) under every setting; fp32 tiles (other reps) under the GPU's own:
# their ieee products compile several times slower.
CASES = [(name, "bf16") for name in fused_lse.VARIANTS] + [(GPU_TILES_NAME, "fp32")]


@pytest.mark.slow
@pytest.mark.parametrize(("variant", "tiles"), CASES)
def test_kernels_compile_for_sm90(variant: str, tiles: str) -> None:
    """Every kernel specialization the GPU path launches under ``variant`` (forward, scan, 6 dense, pairs; with hot
    columns the document pass without them and the hot kernel; with the query gradient from the stored weights the
    query pass that only stores them and the query-gradient kernel) compiles to an sm_90 cubin, each within the
    H100's shared memory a block."""
    shape = fused_lse.VARIANTS[variant]
    rows = _compiled(shape, tiles)
    assert len(rows) == 9 + 2 * (shape.hot_columns > 0) + 2 * shape.query_grad_from_stored, rows
    for row in rows:
        assert "error" not in row, row
        assert row["cubin_bytes"] > 0 and row["shared"] <= H100_SHARED_BYTES, row
