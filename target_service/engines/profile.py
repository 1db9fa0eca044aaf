"""An engine's cost profile: milliseconds of one cached forward over 1 .. n new tokens, which the orchestrator's
draft-length policy reads from GetInfo. Shared by both engines (each times its own forward)."""

from __future__ import annotations

import statistics


def _isotonic(values: list[float]) -> list[float]:
    """The non-decreasing sequence closest to `values` in least squares (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [mean, count]
    for v in values:
        blocks.append([v, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            m2, c2 = blocks.pop()
            m1, c1 = blocks.pop()
            blocks.append([(m1 * c1 + m2 * c2) / (c1 + c2), c1 + c2])
    return [m for m, c in blocks for _ in range(int(c))]


PROFILE_SIZES = (2, 3, 4, 5, 6, 8, 11, 14, 17, 24, 32, 48, 64, 96, 128)  # measured; sizes between interpolated


def measure_profile(forward_ms, max_tokens: int, reps: int = 3) -> list[float]:
    """forward_ms(n) times one forward over n tokens; returns the cost of n = 1 .. max_tokens.

    Each size n > 1 is timed between two 1-token forwards and costed as its ratio to their mean: a shared
    machine's slow spells last longer than three forwards, so the ratios (the profile's shape, which is what a
    draft length is chosen by) survive them where the fastest of a few runs per size did not (measured on an AVX2
    CPU, four profiles in a row: a 6-token forward at 1.42-1.56 steps this way, 1.21-1.58 by the fastest run).
    The median ratio over `reps` rounds times the median 1-token time gives milliseconds; the result is made
    non-decreasing by isotonic regression (more tokens never cost less; one outlier is pooled with its
    neighbours rather than carried to every larger size)."""
    grid = sorted({n for n in PROFILE_SIZES if n < max_tokens} | ({max_tokens} if max_tokens > 1 else set()))
    ratios: dict[int, list[float]] = {n: [] for n in grid}
    ones: list[float] = []
    for rep in range(reps + 1):  # repetition 0 warms up
        before = forward_ms(1)
        if rep:
            ones.append(before)
        order = grid[rep % len(grid):] + grid[: rep % len(grid)] if grid else []  # rotated: drift hits all alike
        for n in order:
            t = forward_ms(n)
            after = forward_ms(1)
            if rep:
                ratios[n].append(t / ((before + after) / 2))
                ones.append(after)
            before = after
    one = statistics.median(ones)
    measured = [1, *grid]
    fitted = dict(zip(measured, (one * r for r in _isotonic([1.0, *(statistics.median(ratios[n]) for n in grid)]))))
    out = []
    for n in range(1, max_tokens + 1):
        if n in fitted:
            v = fitted[n]
        else:  # between two measured sizes
            lo = max(g for g in measured if g < n)
            hi = min(g for g in measured if g > n)
            v = fitted[lo] + (fitted[hi] - fitted[lo]) * (n - lo) / (hi - lo)
        out.append(round(v, 3))
    return out
