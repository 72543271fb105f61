"""scripts/compare_on_dev.py: the paired statistics behind "a gain on the dev set is clear"."""

from __future__ import annotations

import pytest
import torch
from script_helpers import import_script

compare = import_script("scripts", "compare_on_dev")


def test_paired_statistics_on_known_differences() -> None:
    """Every query up by 0.1: the mean is 0.1, every bootstrap mean too, and only the two all-equal sign
    assignments reach it (p = 1 / (R + 1) at 40 queries); no difference at all: p = 1."""
    up = torch.full((40,), 0.1, dtype=torch.float64)
    stats = compare.paired_statistics(up, resamples=999, seed=0)
    assert stats["mean_difference"] == pytest.approx(0.1)
    assert stats["ci95_low"] == pytest.approx(0.1) and stats["ci95_high"] == pytest.approx(0.1)
    assert stats["p_value"] == pytest.approx(1 / 1000)
    none = compare.paired_statistics(torch.zeros(40, dtype=torch.float64), resamples=999, seed=0)
    assert none["p_value"] == 1.0 and none["ci95_low"] == 0.0 == none["ci95_high"]


def test_paired_statistics_separate_noise_from_a_shift() -> None:
    """Symmetric noise around 0 is not significant and its interval holds 0; the same noise plus a shift
    of three standard errors is significant and its interval excludes 0."""
    g = torch.Generator().manual_seed(1)
    noise = torch.randn(100, generator=g, dtype=torch.float64) * 0.2
    noise = noise - noise.mean()  # mean exactly 0
    flat = compare.paired_statistics(noise, resamples=4000, seed=0)
    assert flat["p_value"] > 0.5 and flat["ci95_low"] < 0 < flat["ci95_high"]
    shift = 3 * noise.std().item() / 100**0.5
    moved = compare.paired_statistics(noise + shift, resamples=4000, seed=0)
    assert moved["p_value"] < 0.01 and moved["ci95_low"] > 0
