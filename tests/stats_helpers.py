"""Statistics the distribution tests share (tests/test_jacobi.py, tests/test_vllm_draft.py): Pearson's
chi-square against exact probabilities, and its 99.9% bound."""

from __future__ import annotations

import math

import numpy as np


def chi_square(counts: np.ndarray, probabilities: np.ndarray) -> tuple[float, int]:
    """Pearson's statistic with cells of expected count < 5 pooled into one; (statistic, dof)."""
    n = counts.sum()
    expected = probabilities * n
    small = expected < 5
    observed = np.append(counts[~small], counts[small].sum())
    expected = np.append(expected[~small], expected[small].sum())
    keep = expected > 0
    return float(((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum()), int(keep.sum() - 1)


def chi_square_bound(dof: int, z: float = 3.09) -> float:
    """The 99.9% quantile of chi-square(dof) (Wilson-Hilferty)."""
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3
