"""Exact tensor-core products in Triton: bf16 operands multiplied exactly and summed in fp32, and fp32 values split
into bf16 parts whose products are exact (the fused loss's kernels, :mod:`.fused_lse_triton` and
:mod:`.stored_weights_triton`).

An fp32 ``p`` is the sum of three bf16 parts of 8 significant bits each (:func:`split_parts`); a product of a bf16
weight with each part is exact in the tensor cores' fp32 accumulation, so 2 parts give ``p`` to 2^-16 and 3 parts
exactly (docs/losses.md, "The fused kernel"). Under Triton's interpreter (``TRITON_INTERPRET=1``, the CPU tests) two
of its bf16 operations differ from the GPU's; :func:`dot` and :func:`to_bf16` do them as the GPU does.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

__all__ = [
    "INTERPRETING",
    "dot",
    "load_parts",
    "mul_parts",
    "nonzero",
    "parts_mul",
    "split_parts",
    "store_parts",
    "to_bf16",
]

INTERPRETING: tl.constexpr = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")


@triton.jit
def dot(a, b, acc, IEEE: tl.constexpr):
    """``acc + a @ b`` in fp32: bf16 operands (exact products), or fp32 ones without TF32 (IEEE). Triton
    3.9's interpreter multiplies bf16 ``tl.dot`` operands wrongly (errors ~1e10): there (TRITON_INTERPRET=1)
    bf16 operands are upcast first, exactly, and multiplied as fp32, the same exact products."""
    if IEEE:
        out = tl.dot(a, b, acc, input_precision="ieee")
    elif INTERPRETING:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        out = tl.dot(a, b, acc)
    return out


@triton.jit
def mul_parts(a, b1, b2, b3, acc, PARTS: tl.constexpr, IEEE: tl.constexpr):
    """``acc + a @ (b1 + ... + b_PARTS)``: the first PARTS bf16 parts of an fp32 matrix (:func:`split_parts`) on the
    right, each product exact, or ``b1`` alone (fp32 tiles)."""
    acc = dot(a, b1, acc, IEEE)
    if not IEEE:
        if PARTS >= 2:
            acc = dot(a, b2, acc, IEEE)
        if PARTS == 3:
            acc = dot(a, b3, acc, IEEE)
    return acc


@triton.jit
def to_bf16(x):
    """fp32 ``x`` rounded to the nearest bf16 (ties to even), as the GPU's conversion does. Triton 3.9's interpreter
    truncates instead (errors up to 2^-7, all of one sign): there the rounding is done on the bits first, so the
    conversion only drops zeros."""
    if INTERPRETING:
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536  # round the low 16 bits away, ties to even
        x = bits.to(tl.float32, bitcast=True)
    return x.to(tl.bfloat16)


@triton.jit
def split_parts(p, IEEE: tl.constexpr):
    """fp32 ``p`` as three bf16 parts whose fp32 sum is ``p`` exactly (8 + 8 + 8 significant bits); for fp32
    tiles (IEEE) ``p`` itself, the other two unused."""
    if IEEE:
        hi, mid, lo = p, p, p
    else:
        hi = to_bf16(p)
        rest = p - hi.to(tl.float32)  # exact (fp32)
        mid = to_bf16(rest)
        lo = (rest - mid.to(tl.float32)).to(
            tl.bfloat16
        )  # exact difference, then its rounding (the last bits)
    return hi, mid, lo


@triton.jit
def nonzero(x, IEEE: tl.constexpr):
    """Where ``x``'s bits are not all zero: the reps' entries (an entry of weight 0 is stored as -0.0)."""
    if IEEE:  # noqa: SIM108 (a compile-time branch: each arm types x differently)
        out = x.to(tl.int32, bitcast=True) != 0
    else:
        out = x.to(tl.int16, bitcast=True) != 0
    return out


@triton.jit
def parts_mul(p1, p2, p3, b, acc, IEEE: tl.constexpr, PARTS: tl.constexpr):
    """``acc + (p1 + ... + p_PARTS) @ b``: the first PARTS bf16 parts of an fp32 matrix (:func:`split_parts`) on the
    left, each product exact, or ``p1`` alone (fp32 tiles)."""
    acc = dot(p1, b, acc, IEEE)
    if not IEEE:
        if PARTS >= 2:
            acc = dot(p2, b, acc, IEEE)
        if PARTS == 3:
            acc = dot(p3, b, acc, IEEE)
    return acc


@triton.jit
def store_parts(at, p, part_stride, mask, IEEE: tl.constexpr, PARTS: tl.constexpr, SPLIT: tl.constexpr):
    """Store fp32 ``p`` at the pointers ``at``: with SPLIT its first PARTS bf16 parts (:func:`split_parts`),
    ``part_stride`` elements apart (bf16 tiles only); else ``p`` itself (fp32)."""
    if SPLIT:
        p1, p2, p3 = split_parts(p, IEEE)
        tl.store(at, p1, mask=mask)
        if PARTS >= 2:
            tl.store(at + part_stride, p2, mask=mask)
        if PARTS == 3:
            tl.store(at + 2 * part_stride, p3, mask=mask)
    else:
        tl.store(at, p, mask=mask)


@triton.jit
def load_parts(at, part_stride, mask, IEEE: tl.constexpr, PARTS: tl.constexpr, SPLIT: tl.constexpr):
    """The parts of the fp32 values :func:`store_parts` stored at ``at`` (masked: 0): with SPLIT loaded as stored,
    else the fp32 values loaded and split here -> (p1, p2, p3), as :func:`split_parts` (unused parts: ``p1``)."""
    if SPLIT:
        p1 = tl.load(at, mask=mask, other=0.0)
        p2, p3 = p1, p1
        if PARTS >= 2:
            p2 = tl.load(at + part_stride, mask=mask, other=0.0)
        if PARTS == 3:
            p3 = tl.load(at + 2 * part_stride, mask=mask, other=0.0)
    else:
        p1, p2, p3 = split_parts(tl.load(at, mask=mask, other=0.0), IEEE)
    return p1, p2, p3
