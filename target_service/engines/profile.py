"""An engine's cost profile: milliseconds of one cached forward over 1 .. n new tokens, which the orchestrator's
draft-length policy reads from GetInfo. Shared by both engines (each times its own forward)."""

from __future__ import annotations

import logging
import statistics
import time

log = logging.getLogger("specdec.target")


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


# A CPU engine's forward profile is believed only when its threads ran for most of the time the forwards took: on
# a loaded machine a thread waits for a core at every barrier of every forward, a fixed cost per forward that
# compresses the ratios towards 1 and makes long verify blocks look cheap.
MIN_CPU_SHARE = 0.75
# A forward over n tokens on a CPU costs at least 1 + MIN_STEP_SLOPE * (n - 1) single steps: a third of the
# flattest quiet curve measured (an F16 copy of the shipped GGUF, 8 tokens = 2.2 steps); checked from 8 tokens on.
MIN_STEP_SLOPE = 0.05
# The curve a profile that stays implausible is raised to: about the quiet curves measured for the shipped GGUF or
# above them (1.71 steps for 2 tokens on a 2-vCPU AVX2 EPYC; 4.7 for 8, 17.8 for 32 on a 2-vCPU AVX-512 Xeon), so
# the policy errs towards shorter blocks, which cost at most the speculation a quiet profile would have allowed.
FALLBACK_STEP_SLOPE = 0.7
# A failed profile is measured again only if it took at most this long (a profile takes a few seconds on free cores;
# one that took longer ran on a share of a core, a CPU quota's or a loaded host's, that the next one would get too,
# and start-up should not pay twice for it).
RETRY_WITHIN_MS = 15_000.0


class _CpuMeter:
    """forward_ms wrapped to add up the forwards' wall time and the process's CPU time over them."""

    def __init__(self, forward_ms, cpu_clock):
        self.forward_ms, self.cpu_clock = forward_ms, cpu_clock
        self.wall_ms = self.cpu_ms = 0.0

    def __call__(self, n: int) -> float:
        c0 = self.cpu_clock()
        ms = self.forward_ms(n)
        self.cpu_ms += (self.cpu_clock() - c0) * 1e3
        self.wall_ms += ms
        return ms

    def share(self, threads: int) -> float:
        """The share of its threads' time the engine had: 1.0 when every thread ran (or spun) throughout."""
        return self.cpu_ms / (self.wall_ms * threads) if self.wall_ms > 0 and threads > 0 else 1.0


def implausible(profile: list[float], cpu_share: float) -> str | None:
    """Why a CPU engine's profile cannot be believed, or None."""
    if cpu_share < MIN_CPU_SHARE:
        return f"the engine's threads had {cpu_share:.0%} of their CPU time (other processes on its cores)"
    n = len(profile)
    if n >= 8 and profile[0] > 0 and profile[-1] / profile[0] < 1 + MIN_STEP_SLOPE * (n - 1):
        return (f"a {n}-token forward costs {profile[-1] / profile[0]:.2f} single steps; on a CPU it costs at "
                f"least {1 + MIN_STEP_SLOPE * (n - 1):.2f}")
    return None


def conservative(profile: list[float]) -> list[float]:
    """The profile raised to the fallback curve: n tokens cost at least 1 + FALLBACK_STEP_SLOPE * (n - 1) steps."""
    one = profile[0]
    return [round(max(v, one * (1 + FALLBACK_STEP_SLOPE * i)), 3) for i, v in enumerate(profile)]


def cpu_engine_profile(forward_ms, max_tokens: int, reps: int = 3, *, threads: int,
                       cpu_clock=time.process_time, attempts: int = 2) -> list[float]:
    """measure_profile for a CPU engine whose `threads` compute (or spin at barriers) throughout a forward, as
    llama.cpp's do, with a guard against a loaded machine: the process's CPU time over the forwards must be most of
    threads x their wall time, and the curve must rise as a CPU forward does (`implausible`). A profile that fails
    is measured again, up to `attempts` times (while one takes at most RETRY_WITHIN_MS); then the one taken with the
    most CPU is raised to the conservative curve. Each failure is logged (a structured warning with the reason and
    the CPU share)."""
    tried: list[tuple[float, list[float]]] = []
    for attempt in range(1, attempts + 1):
        meter = _CpuMeter(forward_ms, cpu_clock)
        profile = measure_profile(meter, max_tokens, reps)
        share = meter.share(threads)
        reason = implausible(profile, share)
        if reason is None:
            return profile
        tried.append((share, profile))
        again = attempt < attempts and meter.wall_ms <= RETRY_WITHIN_MS
        log.warning("forward cost profile implausible", extra={
            "reason": reason, "cpu_share": round(share, 3), "attempt": attempt, "attempts": attempts,
            "profile_s": round(meter.wall_ms / 1e3, 1), "action": "re-measure" if again else "conservative curve"})
        if not again:
            break
    share, profile = max(tried, key=lambda t: t[0])
    fallback = conservative(profile)
    log.warning("forward cost profile: conservative curve", extra={
        "cpu_share": round(share, 3), "measured_ms": profile, "forward_ms": fallback,
        "step_slope": FALLBACK_STEP_SLOPE})
    return fallback
