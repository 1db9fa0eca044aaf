"""Helpers for distribution tests: compare observed samples with an exact expected distribution."""

from __future__ import annotations

import math
import os
from collections import Counter
from typing import Hashable, Mapping, Sequence

from scipy import stats as _scipy_stats

def draws(n: int) -> int:
    """Sample count for a distribution test, scaled by env SPECDEC_STAT_SCALE (default 1): the default suite
    keeps its time; `SPECDEC_STAT_SCALE=4 bash scripts/test.sh tests/test_*distribution_e2e.py` buys power."""
    return max(1, round(n * float(os.environ.get("SPECDEC_STAT_SCALE", "1"))))


_OTHER = object()  # the merged bin; a private sentinel so it can never clash with a real outcome


def _check_expected(expected: Mapping[Hashable, float]) -> float:
    if any(not (v >= 0.0) for v in expected.values()):  # also catches NaN
        raise ValueError("expected probabilities must be >= 0")
    total = math.fsum(expected.values())
    if total > 1.0 + 1e-6:
        raise ValueError(f"expected probabilities sum to {total} > 1")
    return total


def chi_square_test(
    samples: Sequence[Hashable],
    expected: Mapping[Hashable, float],
    min_expected: float = 5.0,
) -> tuple[float, float]:
    """Pearson chi-square goodness-of-fit test. Returns ``(statistic, p_value)``.

    Outcomes whose expected count ``n * p`` is below ``min_expected`` are merged into one "other"
    bin, together with samples that are not keys of ``expected`` (expected mass ``1 - sum``). If
    "other" is still too small it absorbs the smallest remaining bins, so the chi-square
    approximation stays valid. Seeing an outcome that ``expected`` makes impossible (probability 0,
    or outside it when its mass sums to 1) gives ``(inf, 0.0)``.
    """
    n = len(samples)
    if n == 0:
        raise ValueError("no samples")
    total = _check_expected(expected)
    counts = Counter(samples)

    # Observing an outcome the expected distribution rules out is a certain failure; check before
    # merging bins, which could otherwise hide it.
    outside = sum(c for key, c in counts.items() if key not in expected)
    if any(expected[key] == 0.0 for key in counts if key in expected) or (
        outside and 1.0 - total <= 1e-9
    ):
        return math.inf, 0.0

    bins: dict[Hashable, tuple[float, float]] = {}  # key -> (observed, expected count)
    other_obs = float(outside)
    other_exp = max(0.0, 1.0 - total) * n
    for key, p in expected.items():
        if n * p < min_expected:
            other_obs += counts.get(key, 0)
            other_exp += n * p
        else:
            bins[key] = (float(counts.get(key, 0)), n * p)

    # Grow "other" with the smallest bins until it is big enough (or is the only bin left).
    by_size = sorted(bins, key=lambda key: bins[key][1])
    while other_exp > 0 and other_exp < min_expected and by_size:
        obs, exp = bins.pop(by_size.pop(0))
        other_obs += obs
        other_exp += exp
    if other_exp > 0 or other_obs > 0:
        bins[_OTHER] = (other_obs, other_exp)

    if len(bins) < 2:
        return 0.0, 1.0  # everything fell into one bin: nothing to test
    f_obs = [o for o, _ in bins.values()]
    f_exp = [e for _, e in bins.values()]
    scale = n / math.fsum(f_exp)  # absorb float drift so scipy's sum check passes
    res = _scipy_stats.chisquare(f_obs, [e * scale for e in f_exp])
    return float(res.statistic), float(res.pvalue)


def total_variation(samples: Sequence[Hashable], expected: Mapping[Hashable, float]) -> float:
    """Total-variation distance between the empirical distribution of ``samples`` and ``expected``.

    As in :func:`chi_square_test`, samples outside ``expected`` and the missing mass
    ``1 - sum(expected)`` are treated as one "other" outcome.
    """
    n = len(samples)
    if n == 0:
        raise ValueError("no samples")
    total = _check_expected(expected)
    counts = Counter(samples)
    diff = [abs(counts.get(key, 0) / n - p) for key, p in expected.items()]
    other = sum(c for key, c in counts.items() if key not in expected) / n
    diff.append(abs(other - max(0.0, 1.0 - total)))
    return 0.5 * math.fsum(diff)
