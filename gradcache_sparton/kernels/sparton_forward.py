"""Triton forward of the Sparton SPLADE head: the fused max/argmax over S, one-row and packed-rows kernels.

Legend: B batch, S sequence, D hidden, V vocabulary.

Layout (Liger order): ``@triton.jit`` kernels -> launchers (validate nothing, allocate, pick blocks and
grid, launch). The tiles are in ``sparton_blocks.py``; input validation, autograd and the CPU path in
``sparton_ops.py``. Imported only when a CUDA tensor reaches the head (or by the interpreter tests), so
``import gradcache_sparton`` never imports triton.

Forward: one program per (batch row b, vocabulary tile). It walks the sequence in tiles of ``BLOCK_S``
(only up to the row's last unmasked position); each tile is a tensor-core product
[BLOCK_V, D] @ [D, BLOCK_S] accumulated in fp32, then bias, mask, and a max/argmax over the tile's
positions folded into a running (max, argmax) kept in registers. The running max starts at 0
(equivalent to -inf after relu) and is replaced only on a strictly larger value, so the first sequence
position wins ties (``tl.max`` breaks ties left inside a tile, ``>`` across tiles). NaN ranks above
+inf and the first NaN wins, as in ``Tensor.max(dim)``: the reference's non-finite semantics exactly
(see ``reference.py``). That order costs a pass over every tile, so large products run in two launches:
the plain max, then a NaN-aware launch whose programs redo the work only where the inputs' bound
(``_logits_bounded``, read on the device) cannot rule out a NaN or infinite logit, and otherwise exit;
smaller ones, where the bound would cost more than it saves, in one NaN-aware launch.
Only the fp32 max [B, V] and int32 argmax [B, V] are written: the [B, S, V] logits never exist.

Loads, both kernels: 16-bit inputs on sm90+ (and under the interpreter) read their H and E tiles through
tensor descriptors, the Hopper copy engine (TMA): one instruction per tile, no per-element address
registers, and zeros outside the tensor, which stand in for the pointer loads' masks (H's descriptor is
3-D, so an S tile past the row's end reads zeros, never the next row's positions). The copy engine needs
16-byte aligned base addresses and row strides; inputs without them (and fp32) take pointer loads, the
same kernels otherwise. With TMA loads the one-row kernel's default grid is persistent: one program per
SM, striding over the (batch row, V tile) pairs.

Packed forward, for short sequences (SPLADE queries, S <= 64): one program per (group of G batch rows,
vocabulary tile). The G rows' positions, each row padded to S_pad (the next power of two >= S), sit
side by side in the product's N: [BLOCK_V, D] @ [D, G·S_pad], so each E tile loaded serves G rows
instead of one. The epilogue views the fp32 tile as [BLOCK_V, G, S_pad] (a relabelling of registers, no
data movement) and takes each row's max and leftmost argmax over its own segment, with the same
masking, NaN order and clamp at 0 as above; a whole row fits in one tile, so there is no running max.
Its H descriptor's block is [G, S_pad, BLOCK_D]: positions S..S_pad-1 and rows past B read zeros.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.tools.tensor_descriptor import TensorDescriptor

from gradcache_sparton.kernels.reference import activation_from_max
from gradcache_sparton.kernels.sparton_blocks import (
    ForwardBlocks,
    PackedForwardBlocks,
    default_forward_blocks,
    interpreting,
    two_pass_forward,
)

__all__ = ["sparton_forward"]


# ---------------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------------


@triton.jit
def _sparton_fwd_pair(
    pid,  # which (batch row, V tile) pair, in the grouped order below
    h_ptr,  # [B, S, D] hidden states; TMA: a tensor descriptor, block [1, BLOCK_S, BLOCK_D]
    e_ptr,  # [V, D] vocabulary embeddings; TMA: a tensor descriptor, block [BLOCK_V, BLOCK_D]
    bias_ptr,  # [V] or a dummy when HAS_BIAS is False
    mask_ptr,  # [B, S] uint8 0/1 attention mask
    len_ptr,  # [B] int32: 1 + the last unmasked position of each row (0 for a fully masked row)
    max_ptr,  # [B, V] fp32 out: max_s of the masked logits, clamped at 0
    arg_ptr,  # [B, V] int32 out: first s attaining it (0 where the max is 0)
    B,
    S,
    V,
    D,
    stride_hb,
    stride_hs,
    stride_ev,
    stride_mb,
    HAS_BIAS: tl.constexpr,
    EVEN_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    NAN_PASS: tl.constexpr,  # "only": one NaN-aware launch; "plain" then "redo": see sparton_forward
    TMA: tl.constexpr,  # H and E tiles by tensor descriptors (Hopper TMA), else by pointer tensors
    BLOCK_S: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    GROUP_B: tl.constexpr,
):
    """One (batch row, V tile) pair of ``_sparton_fwd_kernel``: the running max/argmax over the row's S tiles."""
    # Grouped launch order: consecutive programs walk GROUP_B batch rows first, then the next V tile, so
    # the programs resident at once read a few H[b] and a few E tiles, all of which stay in L2.
    num_v_tiles = tl.cdiv(V, BLOCK_V)
    per_group = GROUP_B * num_v_tiles
    first_b = (pid // per_group) * GROUP_B
    group_rows = tl.minimum(B - first_b, GROUP_B)
    b = first_b + (pid % per_group) % group_rows
    v_tile = (pid % per_group) // group_rows

    offs_v = v_tile * BLOCK_V + tl.arange(0, BLOCK_V)  # [BLOCK_V]
    v_ok = offs_v < V
    offs_t = tl.arange(0, BLOCK_S)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_v, mask=v_ok, other=0.0).to(tl.float32)
    run_max = tl.zeros([BLOCK_V], dtype=tl.float32)
    run_arg = tl.zeros([BLOCK_V], dtype=tl.int32)
    if not TMA:
        offs_d = tl.arange(0, BLOCK_D)
        h_row = h_ptr + b.to(tl.int64) * stride_hb
        e_rows = e_ptr + offs_v.to(tl.int64)[:, None] * stride_ev  # [BLOCK_V, 1] row starts
    # Right padding costs nothing: only the S tiles up to the row's last unmasked position are computed.
    k_tiles = tl.cdiv(D, BLOCK_D)
    n_iters = tl.cdiv(tl.load(len_ptr + b), BLOCK_S) * k_tiles
    acc = tl.zeros([BLOCK_V, BLOCK_S], dtype=tl.float32)
    # One flat loop over (S tile, K step) instead of two nested loops: the software pipeline then runs
    # across S tiles, and the next tile's loads overlap the max/argmax epilogue of the previous one.
    for it in range(0, n_iters):
        kt = it % k_tiles
        s0 = (it // k_tiles) * BLOCK_S
        offs_s = s0 + offs_t
        s_ok = offs_s < S
        if TMA:
            # The copy engine fills what lies outside [V, D] or outside row b's [S, D] with zeros (the
            # descriptor is 3-D: past S comes zero, never row b + 1), as the pointer loads' masks do.
            e = e_ptr.load([v_tile * BLOCK_V, kt * BLOCK_D])
            h = h_ptr.load([b, s0, kt * BLOCK_D]).reshape([BLOCK_S, BLOCK_D])
        else:
            dd = kt * BLOCK_D + offs_d
            e_ptrs = e_rows + dd[None, :]  # [BLOCK_V, BLOCK_D]
            h_ptrs = h_row + offs_s[:, None] * stride_hs + dd[None, :]  # [BLOCK_S, BLOCK_D]
            if EVEN_D:
                e = tl.load(e_ptrs, mask=v_ok[:, None], other=0.0)
                h = tl.load(h_ptrs, mask=s_ok[:, None], other=0.0)
            else:
                d_ok = dd < D
                e = tl.load(e_ptrs, mask=v_ok[:, None] & d_ok[None, :], other=0.0)
                h = tl.load(h_ptrs, mask=s_ok[:, None] & d_ok[None, :], other=0.0)
        if UPCAST_DOT:
            e = e.to(tl.float32)
            h = h.to(tl.float32)
        # Logits transposed, [BLOCK_V, BLOCK_D] @ [BLOCK_D, BLOCK_S] -> [BLOCK_V, BLOCK_S], fp32
        # accumulation: the reduction over S then runs along the MMA's N axis, which lives inside a warp
        # (shuffles), not across warps (shared memory) as an M-axis reduction would.
        acc = tl.dot(e, tl.trans(h), acc, input_precision=DOT_PRECISION)
        if kt == k_tiles - 1:
            keep = tl.load(mask_ptr + b * stride_mb + offs_s, mask=s_ok, other=0) != 0
            x = acc
            if HAS_BIAS:
                x = x + bias[:, None]
            x = tl.where(keep[None, :], x, float("-inf"))
            if NAN_PASS != "plain":
                # [BLOCK_V, BLOCK_S] -> [BLOCK_V]: max over this S tile and its first (leftmost)
                # position, in Tensor.max(dim)'s order: NaN above +inf, the first NaN wins. tl.max's own
                # comparisons drop or keep a NaN depending on where it sits, so NaN is read as +inf ...
                is_nan = x != x
                tile_max, tile_arg = tl.max(
                    tl.where(is_nan, float("inf"), x),
                    axis=1,
                    return_indices=True,
                    return_indices_tie_break_left=True,
                )
                if tl.max(tile_max, axis=0) == float("inf"):  # ... and only a tile holding NaN or +inf
                    first_nan = tl.min(tl.where(is_nan, offs_t[None, :], BLOCK_S), axis=1)  # pays for this
                    has_nan = first_nan < BLOCK_S
                    tile_max = tl.where(has_nan, float("nan"), tile_max)
                    tile_arg = tl.where(has_nan, first_nan, tile_arg)
                # strict: an earlier tile keeps a tie; the first NaN replaces any number and then stays
                better = (tile_max > run_max) | ((tile_max != tile_max) & (run_max == run_max))
            else:
                # Every logit finite: the plain max and its first position; strict across tiles (ties).
                tile_max, tile_arg = tl.max(
                    x, axis=1, return_indices=True, return_indices_tie_break_left=True
                )
                better = tile_max > run_max
            run_max = tl.where(better, tile_max, run_max)
            run_arg = tl.where(better, s0 + tile_arg, run_arg)
            acc = tl.zeros([BLOCK_V, BLOCK_S], dtype=tl.float32)

    out = b.to(tl.int64) * V + offs_v
    tl.store(max_ptr + out, run_max, mask=v_ok)
    tl.store(arg_ptr + out, run_arg, mask=v_ok)


@triton.jit(do_not_specialize=["B", "S"])
def _sparton_fwd_kernel(
    h_ptr,  # [B, S, D] hidden states; TMA: a tensor descriptor, block [1, BLOCK_S, BLOCK_D]
    e_ptr,  # [V, D] vocabulary embeddings; TMA: a tensor descriptor, block [BLOCK_V, BLOCK_D]
    bias_ptr,  # [V] or a dummy when HAS_BIAS is False
    mask_ptr,  # [B, S] uint8 0/1 attention mask
    len_ptr,  # [B] int32: 1 + the last unmasked position of each row (0 for a fully masked row)
    bounded_ptr,  # [1] int32 ("redo" only): 1 where no logit can be NaN or infinite (see _logits_bounded)
    max_ptr,  # [B, V] fp32 out: max_s of the masked logits, clamped at 0
    arg_ptr,  # [B, V] int32 out: first s attaining it (0 where the max is 0)
    B,
    S,
    V,
    D,
    stride_hb,
    stride_hs,
    stride_ev,
    stride_mb,
    HAS_BIAS: tl.constexpr,
    EVEN_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    NAN_PASS: tl.constexpr,  # "only": one NaN-aware launch; "plain" then "redo": see sparton_forward
    TMA: tl.constexpr,  # H and E tiles by tensor descriptors (Hopper TMA), else by pointer tensors
    PERSISTENT: tl.constexpr,  # a grid of one program per SM, each looping over (b, V tile) pairs
    BLOCK_S: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    GROUP_B: tl.constexpr,
):
    if NAN_PASS == "redo":  # noqa: SIM102 (compile-time, then run-time)
        if tl.load(bounded_ptr) != 0:  # the plain launch's result stands: every logit was finite
            return
    if PERSISTENT:
        # One program per SM strides over the pairs by the grid's size (flatten: the compiler may fuse this
        # loop with the pair's own, so one pair's first loads can overlap the previous pair's tail). The
        # pointer loads keep one program per pair and no loop (a one-trip loop around them ran slower).
        for pid in tl.range(tl.program_id(0), B * tl.cdiv(V, BLOCK_V), tl.num_programs(0), flatten=True):
            _sparton_fwd_pair(
                pid,
                h_ptr,
                e_ptr,
                bias_ptr,
                mask_ptr,
                len_ptr,
                max_ptr,
                arg_ptr,
                B,
                S,
                V,
                D,
                stride_hb,
                stride_hs,
                stride_ev,
                stride_mb,
                HAS_BIAS,
                EVEN_D,
                DOT_PRECISION,
                UPCAST_DOT,
                NAN_PASS,
                TMA,
                BLOCK_S,
                BLOCK_V,
                BLOCK_D,
                GROUP_B,
            )
    else:
        _sparton_fwd_pair(
            tl.program_id(0),
            h_ptr,
            e_ptr,
            bias_ptr,
            mask_ptr,
            len_ptr,
            max_ptr,
            arg_ptr,
            B,
            S,
            V,
            D,
            stride_hb,
            stride_hs,
            stride_ev,
            stride_mb,
            HAS_BIAS,
            EVEN_D,
            DOT_PRECISION,
            UPCAST_DOT,
            NAN_PASS,
            TMA,
            BLOCK_S,
            BLOCK_V,
            BLOCK_D,
            GROUP_B,
        )


@triton.jit(do_not_specialize=["B", "S"])
def _sparton_fwd_packed_kernel(
    h_ptr,  # [B, S, D] hidden states; TMA: a tensor descriptor, block [ROWS, S_PAD, BLOCK_D]
    e_ptr,  # [V, D] vocabulary embeddings; TMA: a tensor descriptor, block [BLOCK_V, BLOCK_D]
    bias_ptr,  # [V] or a dummy when HAS_BIAS is False
    mask_ptr,  # [B, S] uint8 0/1 attention mask
    max_ptr,  # [B, V] fp32 out: max_s of the masked logits, clamped at 0
    arg_ptr,  # [B, V] int32 out: first s attaining it (0 where the max is 0)
    B,
    S,
    V,
    D,
    stride_hb,
    stride_hs,
    stride_ev,
    stride_mb,
    HAS_BIAS: tl.constexpr,
    EVEN_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    TMA: tl.constexpr,  # H and E tiles by tensor descriptors (Hopper TMA), else by pointer tensors
    S_PAD: tl.constexpr,  # next power of two >= S: the N columns of one batch row
    ROWS: tl.constexpr,  # G batch rows per program; the product's N is ROWS * S_PAD
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    GROUP_N: tl.constexpr,
):
    # Grouped launch order, as in _sparton_fwd_kernel, over groups of ROWS batch rows.
    pid = tl.program_id(0)
    num_v_tiles = tl.cdiv(V, BLOCK_V)
    num_row_groups = tl.cdiv(B, ROWS)
    per_band = GROUP_N * num_v_tiles
    first_group = (pid // per_band) * GROUP_N
    band_groups = tl.minimum(num_row_groups - first_group, GROUP_N)
    row_group = first_group + (pid % per_band) % band_groups
    v_tile = (pid % per_band) // band_groups

    offs_v = v_tile * BLOCK_V + tl.arange(0, BLOCK_V)  # [BLOCK_V]
    v_ok = offs_v < V
    # Column n of the product is position n % S_PAD of batch row first_row + n // S_PAD: [BLOCK_N]
    offs_n = tl.arange(0, ROWS * S_PAD)
    first_row = row_group * ROWS
    rows = first_row + offs_n // S_PAD
    pos = offs_n % S_PAD
    n_ok = (rows < B) & (pos < S)
    if not TMA:
        offs_d = tl.arange(0, BLOCK_D)
        e_rows = e_ptr + offs_v.to(tl.int64)[:, None] * stride_ev  # [BLOCK_V, 1] row starts
        h_cols = h_ptr + rows.to(tl.int64)[:, None] * stride_hb + pos[:, None] * stride_hs  # [BLOCK_N, 1]
    acc = tl.zeros([BLOCK_V, ROWS * S_PAD], dtype=tl.float32)
    for k in range(0, tl.cdiv(D, BLOCK_D)):
        if TMA:
            # zeros outside [V, D], past S within each row (S_PAD > S) and past the last row B - 1
            e = e_ptr.load([v_tile * BLOCK_V, k * BLOCK_D])
            h = h_ptr.load([first_row, 0, k * BLOCK_D]).reshape([ROWS * S_PAD, BLOCK_D])
        else:
            dd = k * BLOCK_D + offs_d
            if EVEN_D:
                e = tl.load(e_rows + dd[None, :], mask=v_ok[:, None], other=0.0)
                h = tl.load(h_cols + dd[None, :], mask=n_ok[:, None], other=0.0)
            else:
                d_ok = dd < D
                e = tl.load(e_rows + dd[None, :], mask=v_ok[:, None] & d_ok[None, :], other=0.0)
                h = tl.load(h_cols + dd[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        if UPCAST_DOT:
            e = e.to(tl.float32)
            h = h.to(tl.float32)
        # [BLOCK_V, BLOCK_D] @ [BLOCK_D, G·S_PAD] -> [BLOCK_V, G·S_PAD]: G batch rows share each E tile
        acc = tl.dot(e, tl.trans(h), acc, input_precision=DOT_PRECISION)
    keep = tl.load(mask_ptr + rows * stride_mb + pos, mask=n_ok, other=0) != 0  # padding never wins
    x = acc
    if HAS_BIAS:
        x = x + tl.load(bias_ptr + offs_v, mask=v_ok, other=0.0).to(tl.float32)[:, None]
    x = tl.where(keep[None, :], x, float("-inf"))
    # [BLOCK_V, G·S_PAD] -> [BLOCK_V, G, S_PAD] -> [BLOCK_V, G]: each row's max and first position, in
    # Tensor.max(dim)'s order, as in _sparton_fwd_kernel: NaN read as +inf by tl.max, and only a tile
    # holding NaN or +inf looks for the first NaN. Whole rows in one tile: no running max across tiles.
    is_nan = x != x
    row_max, row_arg = tl.max(
        tl.reshape(tl.where(is_nan, float("inf"), x), [BLOCK_V, ROWS, S_PAD]),
        axis=2,
        return_indices=True,
        return_indices_tie_break_left=True,
    )
    if tl.max(tl.max(row_max, axis=1), axis=0) == float("inf"):
        nan_at = tl.where(is_nan, pos[None, :], S_PAD)  # [BLOCK_V, G·S_PAD]
        first_nan = tl.min(tl.reshape(nan_at, [BLOCK_V, ROWS, S_PAD]), axis=2)  # [BLOCK_V, G]
        has_nan = first_nan < S_PAD
        row_max = tl.where(has_nan, float("nan"), row_max)
        row_arg = tl.where(has_nan, first_nan, row_arg)
    # relu: the max starts at 0 (a max <= 0, -inf for a fully masked row, gives (0, 0)); NaN passes
    live = (row_max > 0) | (row_max != row_max)
    out_rows = first_row + tl.arange(0, ROWS)  # [G]
    out = out_rows.to(tl.int64)[None, :] * V + offs_v[:, None]  # [BLOCK_V, G]
    out_ok = v_ok[:, None] & (out_rows < B)[None, :]
    tl.store(max_ptr + out, tl.where(live, row_max, 0.0), mask=out_ok)
    tl.store(arg_ptr + out, tl.where(live, row_arg, 0).to(tl.int32), mask=out_ok)


# ---------------------------------------------------------------------------------------------------
# Launchers
# ---------------------------------------------------------------------------------------------------


def _forward_dot_mode(dtype: torch.dtype) -> dict[str, object]:
    """How the forward kernels call tl.dot: IEEE fp32 for fp32 inputs ("tf32" is ignored for 16-bit)."""
    return {
        "DOT_PRECISION": "ieee" if dtype == torch.float32 else "tf32",
        # Triton 3.9's interpreter multiplies bf16 tl.dot operands wrongly (errors ~1e10); bf16 -> fp32 is
        # exact and the GPU's bf16 MMA forms the same exact products, so upcasting there computes the
        # same function. Never set on a GPU.
        "UPCAST_DOT": interpreting() and dtype == torch.bfloat16,
    }


def sparton_forward(
    hidden_states: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    attention_mask: Tensor,
    *,
    blocks: ForwardBlocks | PackedForwardBlocks | None = None,
    two_pass: bool | None = None,
    activation_function: str = "relu",
) -> tuple[Tensor, Tensor, Tensor]:
    """Fused forward: (Y [B, V] in the dtype of H, fp32 max [B, V], int32 argmax [B, V]).

    Expects validated inputs (``sparton_ops.py`` checks them): H [B, S, D] and E [V, D] of one dtype among
    fp16/bf16/fp32 on one device, bias [V] or None, a 0/1 mask [B, S]. Y = log1p(max) (log1p(log1p(max))
    for ``activation_function="log1p_relu"``: both monotone, so the kernels' max/argmax serve either),
    computed from the fp32 max and rounded once to the output dtype. ``blocks`` picks the kernel: ``ForwardBlocks`` the
    one-row kernel (any S), ``PackedForwardBlocks`` the packed-rows one (short S); by default the
    packed one for 16-bit inputs with S <= 64, the one-row one otherwise. ``two_pass`` (one-row kernel
    only): the plain max, then a NaN-aware launch that redoes the work only where the inputs' bound cannot
    rule out a NaN or infinite logit (read on the device, no sync), instead of one NaN-aware launch; by
    default where the product is large enough to pay for the bound (``two_pass_forward``).
    """
    B, S, D = hidden_states.shape
    V = weight.shape[0]
    blocks = blocks or default_forward_blocks(hidden_states.dtype, S)
    h = hidden_states.contiguous()
    e = weight.contiguous()
    mask = attention_mask.to(torch.uint8).contiguous()
    mx = torch.empty(B, V, device=h.device, dtype=torch.float32)
    arg = torch.empty(B, V, device=h.device, dtype=torch.int32)
    bias = bias.contiguous() if bias is not None else None
    if isinstance(blocks, PackedForwardBlocks):
        if two_pass:
            raise ValueError("two_pass=True runs the one-row kernel only (blocks: ForwardBlocks)")
        _forward_packed(h, e, bias, mask, mx, arg, blocks)
    elif two_pass_forward(B, S, D, V) if two_pass is None else two_pass:
        bounded = _logits_bounded(h, e, bias)
        for nan_pass in ("plain", "redo"):
            _forward_one_row(h, e, bias, mask, mx, arg, blocks, nan_pass=nan_pass, bounded=bounded)
    else:
        _forward_one_row(h, e, bias, mask, mx, arg, blocks, nan_pass="only")
    y = activation_from_max(mx, activation_function).to(hidden_states.dtype)  # [B, V]; relu already applied
    return y, mx, arg


def _logits_bounded(h: Tensor, e: Tensor, bias: Tensor | None) -> Tensor:
    """[1] int32 on the device: 1 where every logit is provably finite, else 0 (no host sync).

    |H[b, s] . E[v] + bias[v]| <= D max|H| max|E| + max|bias|, also for the fp32 accumulation of the
    products up to a relative D·2^-24; below 2^126 (a quarter of fp32's largest) no sum overflows, so no
    logit is +-inf or NaN. A NaN or inf input makes the bound NaN or inf (max |x| propagates both), and
    the comparison false. Masked positions count too: their non-finite values only cost the redo.
    """
    bound = (
        torch.linalg.vector_norm(h, ord=float("inf")).float()
        * torch.linalg.vector_norm(e, ord=float("inf")).float()
        * h.shape[-1]
    )
    if bias is not None:
        bound = bound + torch.linalg.vector_norm(bias, ord=float("inf")).float()
    return (bound < 2.0**126).to(torch.int32).reshape(1)


def _tma_loads(h: Tensor, e: Tensor) -> bool:
    """Whether the one-row kernel can load H and E by tensor descriptors: 16-bit inputs on an sm90+ GPU (or
    the interpreter), base addresses and row strides multiples of 16 bytes, the last dim contiguous (the
    copy engine's rules). Otherwise the kernel loads through pointer tensors."""
    if h.dtype not in (torch.float16, torch.bfloat16):
        return False
    if not interpreting() and torch.cuda.get_device_capability(h.device)[0] < 9:
        return False
    return all(
        t.data_ptr() % 16 == 0
        and t.stride(-1) == 1
        and all(stride * t.element_size() % 16 == 0 for stride in t.stride()[:-1])
        for t in (h, e)
    )


# Interpreter: programs of a persistent launch, fewer than the tests' (batch row, V tile) pairs, not a divisor.
_PERSISTENT_PROGRAMS_INTERPRET = 3


def _persistent_programs(device: torch.device) -> int:
    """Programs of a persistent launch: one per SM (the 16-bit tile's shared memory fits one per SM); under
    the interpreter a few, so that each test program walks several (batch row, V tile) pairs."""
    if interpreting():
        return _PERSISTENT_PROGRAMS_INTERPRET
    return torch.cuda.get_device_properties(device).multi_processor_count


def _forward_one_row(
    h: Tensor,
    e: Tensor,
    bias: Tensor | None,
    mask: Tensor,
    mx: Tensor,
    arg: Tensor,
    blocks: ForwardBlocks,
    *,
    nan_pass: str,
    bounded: Tensor | None = None,
) -> None:
    """One program per (batch row, V tile), walking the row's S tiles (``_sparton_fwd_kernel``); with TMA
    loads one program per SM, each taking every grid-size-th pair."""
    B, S, D = h.shape
    V = e.shape[0]
    # [B, S] -> [B]: 1 + last unmasked position (0 if none), so right padding is never computed
    positions = torch.arange(1, S + 1, device=h.device, dtype=torch.int32)
    lengths = (mask * positions).amax(dim=1).to(torch.int32)
    tma = blocks.tma and _tma_loads(h, e)
    persistent = blocks.persistent and tma
    n_tiles = B * triton.cdiv(V, blocks.block_v)
    grid = (min(n_tiles, _persistent_programs(h.device)) if persistent else n_tiles,)
    if tma:
        h_in = TensorDescriptor(h, list(h.shape), list(h.stride()), [1, blocks.block_s, blocks.block_d])
        e_in = TensorDescriptor(e, list(e.shape), list(e.stride()), [blocks.block_v, blocks.block_d])
    _sparton_fwd_kernel[grid](
        h_in if tma else h,
        e_in if tma else e,
        bias if bias is not None else mx,  # dummy pointer, never read without bias
        mask,
        lengths,
        bounded if bounded is not None else lengths,  # dummy pointer, read only by the "redo" pass
        mx,
        arg,
        B,
        S,
        V,
        D,
        h.stride(0),
        h.stride(1),
        e.stride(0),
        mask.stride(0),
        HAS_BIAS=bias is not None,
        EVEN_D=D % blocks.block_d == 0,
        **_forward_dot_mode(h.dtype),
        NAN_PASS=nan_pass,
        TMA=tma,
        PERSISTENT=persistent,
        BLOCK_S=blocks.block_s,
        BLOCK_V=blocks.block_v,
        BLOCK_D=blocks.block_d,
        GROUP_B=blocks.group_b,
        num_warps=blocks.num_warps,
        num_stages=blocks.num_stages,
    )


def _forward_packed(
    h: Tensor,
    e: Tensor,
    bias: Tensor | None,
    mask: Tensor,
    mx: Tensor,
    arg: Tensor,
    blocks: PackedForwardBlocks,
) -> None:
    """One program per (G batch rows, V tile), G = block_n // S_pad (``_sparton_fwd_packed_kernel``).

    S_pad is a compile-time constant, so each power of two up to S_pad recompiles once (7 variants up
    to S = 64); B and S themselves do not.
    """
    B, S, D = h.shape
    V = e.shape[0]
    s_pad = triton.next_power_of_2(S)
    rows = max(1, blocks.block_n // s_pad)
    grid = (triton.cdiv(B, rows) * triton.cdiv(V, blocks.block_v),)
    tma = blocks.tma and _tma_loads(h, e)
    if tma:
        h_in = TensorDescriptor(h, list(h.shape), list(h.stride()), [rows, s_pad, blocks.block_d])
        e_in = TensorDescriptor(e, list(e.shape), list(e.stride()), [blocks.block_v, blocks.block_d])
    _sparton_fwd_packed_kernel[grid](
        h_in if tma else h,
        e_in if tma else e,
        bias if bias is not None else mx,  # dummy pointer, never read without bias
        mask,
        mx,
        arg,
        B,
        S,
        V,
        D,
        h.stride(0),
        h.stride(1),
        e.stride(0),
        mask.stride(0),
        HAS_BIAS=bias is not None,
        EVEN_D=D % blocks.block_d == 0,
        **_forward_dot_mode(h.dtype),
        TMA=tma,
        S_PAD=s_pad,
        ROWS=rows,
        BLOCK_V=blocks.block_v,
        BLOCK_D=blocks.block_d,
        GROUP_N=blocks.group_n,
        num_warps=blocks.num_warps,
        num_stages=blocks.num_stages,
    )
