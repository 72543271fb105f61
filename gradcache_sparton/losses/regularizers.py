"""Sparsity regularizers of SPLADE reps: FLOPS and L1.

Legend: B batch, V vocabulary.

- FLOPS (Paria et al. 2020, used by SPLADE): ``sum_v (mean_b reps[b, v])²``. It penalises terms that
  are active across many reps of the batch, a smooth stand-in for the expected cost of an
  inverted-index lookup (:func:`gradcache_sparton.losses.expected_flops`). It is *batch-coupled*: the
  mean runs over the whole batch, so it must be computed on the full batch of reps (the GradCache
  engine provides the full concatenated batch; computing it per mini-batch and averaging gives a
  different value and gradient).
- L1: ``mean_b sum_v |reps[b, v]|``, the per-rep L1 norm averaged over the batch (separable over rows).

Both accept one [B, V] tensor or a sequence of them (e.g. the positive and hard-negative columns),
treated as their row-wise concatenation without building it, and reduce in fp32 (fp64 stays fp64)
without an fp32 copy of the reps.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from torch import Tensor

from gradcache_sparton.losses.columns import accumulation_dtype, column_list

__all__ = ["REGULARIZERS", "REGULARIZER_CORES", "flops_regularizer", "get_regularizer", "l1_regularizer"]


def flops_regularizer(reps: Tensor | Sequence[Tensor]) -> Tensor:
    """FLOPS regularizer ``sum_v (mean_b reps[b, v])²`` over all rows of ``reps``: a 0-d fp32 tensor.

    Gradient: ``d/d reps[b, v] = 2 · mean_b' reps[b', v] / N`` with N the total number of rows.
    """
    return _flops(column_list(reps))


def l1_regularizer(reps: Tensor | Sequence[Tensor]) -> Tensor:
    """L1 regularizer ``mean_b sum_v |reps[b, v]|`` over all rows of ``reps``: a 0-d fp32 tensor.

    Gradient: ``d/d reps[b, v] = sign(reps[b, v]) / N`` with N the total number of rows (0 at 0).
    """
    return _l1(column_list(reps))


def _flops(columns: list[Tensor]) -> Tensor:
    """:func:`flops_regularizer` of checked columns."""
    dtype = accumulation_dtype(*columns)
    rows = sum(column.shape[0] for column in columns)
    column_sum = sum(column.sum(dim=0, dtype=dtype) for column in columns)  # [B_i, V] -> [V], summed
    return (column_sum / rows).square().sum()  # [V] -> []


def _l1(columns: list[Tensor]) -> Tensor:
    """:func:`l1_regularizer` of checked columns."""
    dtype = accumulation_dtype(*columns)
    rows = sum(column.shape[0] for column in columns)
    total = sum(column.abs().sum(dtype=dtype) for column in columns)  # [B_i, V] -> [], summed
    return total / rows


# Names accepted wherever a regularizer is chosen by configuration.
REGULARIZERS: dict[str, Callable[[Tensor | Sequence[Tensor]], Tensor]] = {
    "flops": flops_regularizer,
    "l1": l1_regularizer,
}


def get_regularizer(name: str, *, argument: str = "name") -> Callable[[Tensor | Sequence[Tensor]], Tensor]:
    """The regularizer registered as ``name`` (one of :data:`REGULARIZERS`).

    ``argument`` is how a ``ValueError`` for an unknown name refers to the caller's argument.
    """
    if name not in REGULARIZERS:
        raise ValueError(f"{argument} must be one of {sorted(REGULARIZERS)}, got {name!r}")
    return REGULARIZERS[name]


# The unchecked cores behind REGULARIZERS, for callers that validated the columns (SpladeLoss).
REGULARIZER_CORES: dict[str, Callable[[list[Tensor]], Tensor]] = {"flops": _flops, "l1": _l1}
