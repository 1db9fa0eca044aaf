"""The serving benchmark's arithmetic, free of processes and sockets: percentiles, the Poisson arrival schedule,
per-request latencies (TTFT, TPOT, inter-token gaps), one level's summary and the targets with their reasons.

Definitions follow vLLM's benchmark_serving: TTFT = request sent -> first streamed tokens; TPOT = (end - first
tokens) / the tokens after the first chunk; ITL = the gap between consecutive streamed chunks (a speculative step
streams several tokens at once, so its gaps are longer and fewer); output tokens/s and requests/s over the level's
wall time (first request sent -> last one done)."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

# Targets, judged on ratios measured in one run: speculative / target-only output tokens/s at one stream and at
# every concurrency, and speculative p99 TPOT against target-only's at every concurrency.
SINGLE_STREAM_MIN_RATIO = 1.5
EVERY_LEVEL_MIN_RATIO = 0.97
TPOT_P99_MAX_RATIO = 1.10


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation between order statistics (numpy's default)."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be in 0..100, not {q}")
    xs = sorted(v for v in values if v is not None)
    if not xs:
        return None
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def poisson_arrivals(rate_per_s: float, count: int, seed: int = 0) -> list[float]:
    """Send times (seconds from the start, the first at 0) of `count` requests arriving as a Poisson process of
    `rate_per_s`: exponential gaps with mean 1/rate, from a seeded generator, so both modes get the same schedule."""
    if rate_per_s <= 0:
        raise ValueError(f"request rate must be positive, not {rate_per_s}")
    if count <= 0:
        return []
    rng = random.Random(seed)
    out, t = [0.0], 0.0
    for _ in range(count - 1):
        t += rng.expovariate(rate_per_s)
        out.append(t)
    return out


@dataclass
class RequestRecord:
    """One streamed generation as the client saw it; times in seconds from the request's send."""
    prompt: str
    tokens: int = 0
    wall_s: float = 0.0
    chunks: list[tuple[float, int]] = field(default_factory=list)  # (arrival time, tokens in the chunk)
    stats: dict = field(default_factory=dict)
    token_ids: list[int] = field(default_factory=list)
    refusals: int = 0  # RESOURCE_EXHAUSTED answers before it was admitted
    error: str | None = None

    @property
    def ttft_s(self) -> float | None:
        return self.chunks[0][0] if self.chunks else None

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first chunk (None with a single chunk)."""
        if len(self.chunks) < 2:
            return None
        after = self.tokens - self.chunks[0][1]
        return (self.wall_s - self.chunks[0][0]) / after if after > 0 else None

    def itl_s(self) -> list[float]:
        return [b[0] - a[0] for a, b in zip(self.chunks, self.chunks[1:])]


def _ms(x: float | None) -> float | None:
    return None if x is None else x * 1e3


def summarise_level(records: list[RequestRecord], wall_s: float) -> dict:
    """Throughput, latency percentiles and speculation counters of one mode at one level."""
    done = [r for r in records if r.error is None]
    tokens = sum(r.tokens for r in done)
    ttft = [r.ttft_s for r in done if r.ttft_s is not None]
    tpot = [r.tpot_s for r in done if r.tpot_s is not None]
    itl = [g for r in done for g in r.itl_s()]
    st = lambda k: sum(int(r.stats.get(k, 0) or 0) for r in done)  # noqa: E731
    queued = [float(r.stats.get("queued_ms", 0.0) or 0.0) for r in done]  # the server's admission queue, in TTFT
    proposed, accepted = st("draft_tokens_proposed"), st("draft_tokens_accepted")
    verify, decode = st("verify_steps"), st("decode_steps")
    return {
        "requests": len(records), "completed": len(done), "errors": len(records) - len(done),
        "refusals": sum(r.refusals for r in records), "output_tokens": tokens, "wall_s": wall_s,
        "tokens_per_s": tokens / wall_s if wall_s > 0 else None,
        "requests_per_s": len(done) / wall_s if wall_s > 0 else None,
        "ttft_p50_ms": _ms(percentile(ttft, 50)), "ttft_p99_ms": _ms(percentile(ttft, 99)),
        "queued_p50_ms": percentile(queued, 50), "queued_p99_ms": percentile(queued, 99),
        "tpot_p50_ms": _ms(percentile(tpot, 50)), "tpot_p99_ms": _ms(percentile(tpot, 99)),
        "itl_p50_ms": _ms(percentile(itl, 50)), "itl_p99_ms": _ms(percentile(itl, 99)),
        "acceptance_rate": accepted / proposed if proposed else None,
        "speculated_step_share": verify / (verify + decode) if verify + decode else None,
        "verify_steps": verify, "decode_steps": decode, "draft_tokens_proposed": proposed,
        "draft_tokens_accepted": accepted, "load_shed_steps": st("load_shed_steps"),
        "speculation_paused_steps": st("speculation_paused_steps"), "fallback_steps": st("fallback_steps"),
        "first_error": next((r.error for r in records if r.error), None),
    }


LEVEL_KEYS = ("tokens_per_s", "requests_per_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms",
              "itl_p50_ms", "itl_p99_ms", "acceptance_rate", "speculated_step_share")


def level_row(key: str, value, spec: dict, target_only: dict, same_tokens: bool | None) -> dict:
    """One row of the "levels" (or "poisson") list: the speculative figures under their plain names, target-only's
    with a target_only_ prefix, the ratio of output tokens/s, and both modes' whole summaries."""
    row = {key: value, "spec_tokens_per_s": spec["tokens_per_s"],
           "target_only_tokens_per_s": target_only["tokens_per_s"],
           "ratio": ratio(spec["tokens_per_s"], target_only["tokens_per_s"]),
           "tpot_p99_ratio": ratio(spec["tpot_p99_ms"], target_only["tpot_p99_ms"])}
    for k in LEVEL_KEYS[1:]:
        row[k] = spec[k]
        row["target_only_" + k] = target_only[k]
    row["same_tokens"] = same_tokens
    row["speculative"], row["target_only"] = spec, target_only
    return row


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def same_outputs(a: list[RequestRecord], b: list[RequestRecord]) -> bool | None:
    """Whether both modes produced the same tokens for each prompt (greedy speculation is lossless)."""
    ref = {r.prompt: r.token_ids for r in b if r.error is None}
    pairs = [(r.token_ids, ref[r.prompt]) for r in a if r.error is None and r.prompt in ref]
    return all(x == y for x, y in pairs) if pairs else None


def _f(x, nd=2) -> str:
    return "n/a" if x is None else f"{x:.{nd}f}"


def _level_context(row: dict) -> str:
    failed = [f"{m.replace('_', '-')}: {row[m]['errors']} of {row[m]['requests']} requests failed ({row[m]['first_error']})"
              for m in ("speculative", "target_only") if row[m].get("errors")]
    spec = row["speculative"]
    return "; ".join([*failed, f"acceptance {_f(row.get('acceptance_rate'))}, speculated on "
                      f"{_f(100 * (row.get('speculated_step_share') or 0), 0)}% of steps ({spec.get('load_shed_steps', 0)} "
                      f"load-shed, {spec.get('speculation_paused_steps', 0)} paused by the goodput policy)"])


def _every_level(levels: list[dict], key: str, threshold: float, misses, worst_of, describe) -> dict:
    """A target every level must meet: met only when every level was measured and none misses; the reason lists each
    level that missed (with its measurement) and each that could not be measured (with its failed requests)."""
    measured = [r for r in levels if r.get(key) is not None]
    if not measured:
        return {"met": None, "threshold": threshold, "value": None, "why": "no level with both modes measured"}
    worst = worst_of(measured, key=lambda r: r[key])
    why = [f"{r['concurrency']} streams: {describe(r)}, {_level_context(r)}" for r in measured if misses(r[key])]
    why += [f"{r['concurrency']} streams not measured: {_level_context(r)}" for r in levels if r.get(key) is None]
    return {"met": not why, "threshold": threshold, "value": worst[key], "at_concurrency": worst["concurrency"],
            "why": "; ".join(why)}


def evaluate_targets(levels: list[dict]) -> dict:
    """Each target: met (True / False / None when not measured), the measured value and, unless met, why."""
    out = {}
    by_n = {r["concurrency"]: r for r in levels}
    one = by_n.get(1)
    if one is None or one["ratio"] is None:
        out["single_stream_ratio"] = {"met": None, "threshold": SINGLE_STREAM_MIN_RATIO, "value": None,
                                      "why": "no 1-stream level with both modes measured"}
    else:
        met = one["ratio"] >= SINGLE_STREAM_MIN_RATIO
        out["single_stream_ratio"] = {
            "met": met, "threshold": SINGLE_STREAM_MIN_RATIO, "value": one["ratio"],
            "why": "" if met else (f"1 stream: {_f(one['spec_tokens_per_s'], 1)} vs {_f(one['target_only_tokens_per_s'], 1)} "
                                   f"tokens/s = {_f(one['ratio'])}x; {_level_context(one)}")}
    out["every_level_ratio"] = _every_level(
        levels, "ratio", EVERY_LEVEL_MIN_RATIO, lambda v: v < EVERY_LEVEL_MIN_RATIO, min,
        lambda r: f"{_f(r['spec_tokens_per_s'], 1)} vs {_f(r['target_only_tokens_per_s'], 1)} tokens/s = {_f(r['ratio'])}x")
    out["tpot_p99"] = _every_level(
        levels, "tpot_p99_ratio", TPOT_P99_MAX_RATIO, lambda v: v > TPOT_P99_MAX_RATIO, max,
        lambda r: (f"p99 TPOT {_f(r['tpot_p99_ms'], 1)} vs {_f(r['target_only_tpot_p99_ms'], 1)} ms = "
                   f"{_f(r['tpot_p99_ratio'])}x (p50 {_f(r['tpot_p50_ms'], 1)} vs {_f(r['target_only_tpot_p50_ms'], 1)} ms)"))
    return out
