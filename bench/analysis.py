"""The analytical model the measurements are compared with (Leviathan et al. 2023, section 3).

``predicted_speedup(a, g, c) = (1 - a^(g+1)) / ((1 - a)(g c + 1))`` where ``a`` is the per-token
acceptance probability, ``g`` the draft length and ``c`` the cost of one draft token relative to one
target step. For whole ``g`` this *is* :func:`specdec.core.sampling.speculative_speedup`; for an adaptive
draft length the mean proposed length (a real number) goes into the same closed form.

Acceptance rate vs. ``a``: the services report ``accepted / proposed``. A block is cut at its first
rejection, so that ratio is smaller than the per-token acceptance probability the formula wants
(a = 0.8, g = 4 gives accepted/proposed = 0.59). :func:`alpha_from_accepted_length` recovers ``a``
from the measured mean accepted length (tokens committed per verify step, bonus token included) by
solving ``expected_accepted_length(a, g) = measured``; both numbers are reported.
"""

from __future__ import annotations

import math
import numbers
import statistics

from specdec.core.sampling import expected_accepted_length, speculative_speedup


def _whole(g) -> bool:
    return isinstance(g, numbers.Integral) or (isinstance(g, float) and g.is_integer())


def accepted_length(a: float, g: float) -> float:
    """Expected tokens per verify step, (1 - a^(g+1)) / (1 - a), for a real draft length g."""
    if _whole(g):
        return expected_accepted_length(float(a), int(g))
    if a >= 1.0:
        return g + 1.0
    return (1.0 - a ** (g + 1.0)) / (1.0 - a)


def predicted_speedup(a: float, g: float, c: float) -> float:
    """(1 - a^(g+1)) / ((1 - a)(g c + 1)); exactly specdec.core.sampling.speculative_speedup for whole g."""
    if _whole(g):
        return speculative_speedup(float(a), int(g), float(c))
    if not 0.0 <= a <= 1.0 or g < 0 or not math.isfinite(c) or c < 0:
        raise ValueError(f"bad model arguments a={a!r} g={g!r} c={c!r}")
    return accepted_length(a, g) / (g * c + 1.0)


def predicted_speedup_with_plain_steps(a: float, g: float, c: float, verify_steps: int, plain_steps: int,
                                       verify_cost: float = 1.0) -> float:
    """The same model when some steps had no draft (an n-gram drafter without a match decodes one
    target token, cost 1): tokens / cost over all steps. Equal to predicted_speedup when plain_steps == 0
    and verify_cost == 1. ``verify_cost``: a verify forward over g+1 tokens in target steps (the
    paper's model takes 1; on a CPU it is more)."""
    if plain_steps <= 0 and verify_cost == 1.0:
        return predicted_speedup(a, g, c)
    tokens = verify_steps * accepted_length(a, g) + plain_steps
    cost = verify_steps * (g * c + verify_cost) + plain_steps
    return tokens / cost


def interpolate_cost(costs: dict, n: float) -> float | None:
    """Linear interpolation of {block size (str or int): cost in target steps} at n tokens (1 token costs 1)."""
    pts = sorted([(1.0, 1.0)] + [(float(k), float(v)) for k, v in costs.items()])
    if len(pts) < 2:
        return None
    if n <= pts[0][0]:
        return pts[0][1]
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if n <= x1:
            return y0 + (y1 - y0) * (n - x0) / (x1 - x0)
    (x0, y0), (x1, y1) = pts[-2], pts[-1]
    return y1 + (y1 - y0) * (n - x1) / (x1 - x0)  # extrapolate from the last segment


def alpha_from_accepted_length(mean_accepted_length: float, g: float) -> float:
    """The per-token acceptance probability a with accepted_length(a, g) == mean_accepted_length."""
    if g <= 0 or mean_accepted_length <= 1.0:
        return 0.0
    if mean_accepted_length >= g + 1.0:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(100):  # accepted_length is increasing in a
        mid = (lo + hi) / 2
        if accepted_length(mid, g) < mean_accepted_length:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or not b:
        return None
    return a / b


def spread(values: list[float]) -> dict | None:
    if not values:
        return None
    return {"min": min(values), "median": statistics.median(values), "max": max(values), "n": len(values)}
