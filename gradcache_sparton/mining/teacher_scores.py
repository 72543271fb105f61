"""Teacher scores on one scale: per-query normalisation of each teacher's scores and their weighted ensemble.

Legend: R training rows, C = 1 + k candidates per row (the positive, then its k negatives), K normalisation
depth (a query's top K corpus scores).

A distillation loss reads a row's ``teacher_scores`` [C] as logits (``kl_div``: softmax over the row's
candidates) or margins (``margin_mse``). Teachers score on their own scales (a dot product of sparse reps in
the tens, a cosine in [-1, 1], BM25 in the tens, a cross-encoder logit), so each is put on one scale per query
before a weighted sum (:func:`ensemble_scores`):

- ``minmax``: ``(s - min) / (max - min)`` over the row's own C candidates, in [0, 1]; the sum is then times
  ``scale`` (30 by default, OpenSearch's inference-free distillation, arXiv 2411.04403). With one negative
  (C = 2) it is always 1 / 0 whatever the margin: the scale alone sets how sure the teacher is.
- ``zscore``: ``(s - mean) / std`` against the query's top K scores over the corpus (K = 100 by default),
  so a two-candidate margin keeps its size and two systems' scales become comparable; the sum is times
  ``scale`` (1 by default).
- ``none``: the raw scores, times ``scale`` (1 by default).

A query whose reference scores all tie (max = min, or a top K with std 0) gives no ranking information: 0s.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = [
    "DEFAULT_DEPTH",
    "DEFAULT_SCALES",
    "NORMALISATIONS",
    "ensemble_scores",
    "minmax_normalise",
    "normalise_scores",
    "zscore_normalise",
]

NORMALISATIONS = ("minmax", "zscore", "none")
# minmax: OpenSearch's x30 (arXiv 2411.04403: scores in [0, 30] make a confident teacher softmax); the others
# keep their own scale (a z-score of 3 is already a clear margin).
DEFAULT_SCALES = {"minmax": 30.0, "zscore": 1.0, "none": 1.0}
# zscore's depth: the evaluation's top 100, the window mined negatives come from.
DEFAULT_DEPTH = 100


def _check_rows(candidate_scores: Tensor) -> None:
    if not isinstance(candidate_scores, Tensor) or candidate_scores.dim() != 2:
        raise ValueError(
            f"candidate_scores must be an [R, C] tensor, got {getattr(candidate_scores, 'shape', candidate_scores)}"
        )


def zscore_normalise(candidate_scores: Tensor, top_scores: Tensor) -> Tensor:
    """Each query's candidate scores as z-scores against its own top-K scores over the corpus: [R, C] float64.

    ``(s - mean) / std`` with the mean and (population) standard deviation of row r of ``top_scores``
    [R, K]. Why these statistics rather than the C candidates' own: with one negative (C = 2) a z-score or
    min-max over the candidates is always ±1 or 0/1, whatever the margin; the top K (K = 100, the window
    the negatives come from) give every query a fixed reference, so a wide BM25 margin stays wide and the
    two systems' scales become comparable. A query whose top K all score alike (std 0: no query token in
    the corpus, or an all-zero rep) gives no ranking information: its z-scores are 0.
    """
    _check_rows(candidate_scores)
    if top_scores.dim() != 2 or candidate_scores.shape[0] != top_scores.shape[0]:
        raise ValueError(
            f"candidate_scores [R, C] and top_scores [R, K] must share R, got {tuple(candidate_scores.shape)} "
            f"and {tuple(top_scores.shape)}"
        )
    top = top_scores.double()
    mean = top.mean(dim=1, keepdim=True)  # [R, 1]
    std = top.std(dim=1, correction=0, keepdim=True)  # [R, 1]
    z = (candidate_scores.double() - mean) / torch.where(std > 0, std, 1.0)  # [R, C]
    return torch.where(std > 0, z, 0.0)


def minmax_normalise(candidate_scores: Tensor) -> Tensor:
    """Each row's candidate scores min-max normalised over the row: ``(s - min) / (max - min)`` in [0, 1],
    [R, C] float64; a row whose candidates all tie gives 0s."""
    _check_rows(candidate_scores)
    scores = candidate_scores.double()
    low = scores.min(dim=1, keepdim=True).values  # [R, 1]
    span = scores.max(dim=1, keepdim=True).values - low  # [R, 1]
    return torch.where(span > 0, (scores - low) / torch.where(span > 0, span, 1.0), 0.0)


def normalise_scores(candidate_scores: Tensor, top_scores: Tensor | None, *, normalisation: str) -> Tensor:
    """One teacher's [R, C] scores normalised per query as ``normalisation`` says (module docstring), float64;
    ``top_scores`` [R, K] is read by ``zscore`` only (and required by it)."""
    if normalisation == "zscore":
        if top_scores is None:
            raise ValueError("normalisation='zscore' needs each query's top-K corpus scores (top_scores)")
        return zscore_normalise(candidate_scores, top_scores)
    if normalisation == "minmax":
        return minmax_normalise(candidate_scores)
    if normalisation == "none":
        _check_rows(candidate_scores)
        return candidate_scores.double()
    raise ValueError(f"normalisation must be one of {NORMALISATIONS}, got {normalisation!r}")


def ensemble_scores(normalised: Sequence[Tensor], weights: Sequence[float], *, scale: float) -> Tensor:
    """``scale · Σ_i weights[i] · normalised[i]``: the ensemble's [R, C] teacher scores, float32 (each
    ``normalised[i]`` one teacher's [R, C] scores from :func:`normalise_scores`; the sum in float64)."""
    if len(normalised) != len(weights) or not normalised:
        raise ValueError(f"one weight per teacher: {len(weights)} weights for {len(normalised)} teachers")
    if not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a finite number > 0, got {scale!r}")
    shapes = {tuple(scores.shape) for scores in normalised}
    if len(shapes) != 1:
        raise ValueError(f"every teacher must score the same [R, C] candidates, got shapes {sorted(shapes)}")
    total = sum(float(w) * scores.double() for w, scores in zip(weights, normalised, strict=True))
    return (scale * total).float()
