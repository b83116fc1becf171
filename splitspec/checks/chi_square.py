"""Chi-square goodness of fit of sampled token counts against a distribution: how the sampler's exactness is checked
(the test suite and ``splitspec.checks.gpu``)."""

from __future__ import annotations

import math

import torch

Z = 3.719  # one-sided z for a 1e-4 false-alarm rate per check (many checks run)
MIN_EXPECTED = 5  # chi-square needs >= 5 expected counts per bin


def threshold(df: int, z: float = Z) -> float:
    """Wilson–Hilferty approximation of the chi-square quantile."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """(statistic, degrees of freedom) of ``counts`` [V] against ``probs`` [V]; the bins expecting fewer than
    MIN_EXPECTED counts are merged into one. df is 0 when fewer than two bins remain (nothing to test)."""
    expected = probs * counts.sum().item()
    big = expected >= MIN_EXPECTED
    obs = torch.cat([counts[big].double(), counts[~big].sum().double()[None]])
    exp = torch.cat([expected[big].double(), expected[~big].sum().double()[None]])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    if len(obs) < 2:
        return 0.0, 0
    return (((obs - exp) ** 2) / exp).sum().item(), len(obs) - 1
