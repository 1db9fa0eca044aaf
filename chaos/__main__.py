"""`python -m chaos --scenario NAME|all [--quick] [--json]`: one JSON object per scenario, one per line."""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")

from chaos import SCENARIOS  # noqa: E402
from chaos.harness import TINY_DRAFT, TINY_TARGET, ChaosOptions  # noqa: E402
from chaos.scenarios import run_scenarios  # noqa: E402
from chaos.soak import PLAIN, soak  # noqa: E402

SUMMARY_KEYS = ("scenario", "requests", "completed", "failed", "mismatched_tokens", "fallback_steps",
                "speculation_resumed", "max_stall_ms", "stall_bound_ms", "replica_failovers", "resumes", "ok")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m chaos", description=__doc__)
    p.add_argument("--scenario", action="append", default=None,
                   help=f"one of {', '.join(SCENARIOS)}, or all (repeatable; default all)")
    p.add_argument("--json", action="store_true", help="print one JSON object per scenario (one per line)")
    p.add_argument("--quick", action="store_true", help="the short version the tests run")
    p.add_argument("--requests", type=int, default=None, help="requests per scenario (at least)")
    p.add_argument("--max-new-tokens", type=int, default=None)
    p.add_argument("--concurrency", type=int, default=None)
    p.add_argument("--time-limit-s", type=float, default=None, help="per scenario: no request starts after it")
    p.add_argument("--seed", type=int, default=0, help="chooses prompts, victims and fault moments")
    p.add_argument("--fault-s", type=float, nargs=2, default=None, metavar=("MIN", "MAX"),
                   help="how long a fault is held before the heal starts (seeded within the range)")
    p.add_argument("--post-heal-requests", type=int, default=None)
    p.add_argument("--target-model", default=TINY_TARGET)
    p.add_argument("--draft-strategy", choices=["model", "ngram", "auto"], default="model")
    p.add_argument("--draft-model", default=TINY_DRAFT)
    p.add_argument("--draft-replicas", type=int, default=2)
    p.add_argument("--draft-len", type=int, default=4)
    p.add_argument("--speculation-max-sessions", type=int, default=None,
                   help="as the orchestrator's flag (default: the stack's; a llama.cpp target speculates for one "
                        "session generating at a time, so its chaos runs set 0 to keep the drafts under load)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--engine", choices=["auto", "llamacpp", "torch"], default="torch",
                   help="the target's engine (llamacpp: a GGUF target, e.g. --target-model smollm2)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--draft-timeout-floor-ms", type=float, default=None)
    p.add_argument("--draft-timeout-factor", type=float, default=None)
    p.add_argument("--breaker-open-s", type=float, default=None)
    p.add_argument("--target-grace-s", type=float, default=None)
    p.add_argument("--store-grace-s", type=float, default=None)
    p.add_argument("--slow-latency-ms", type=float, default=None)
    p.add_argument("--slow-target-ms", type=float, default=None, help="slow_target: latency per Verify/Decode")
    p.add_argument("--log-dir", default=None, help="service logs (default: a new temporary directory)")
    p.add_argument("--fresh-stack", action="store_true", help="a new stack per scenario instead of a shared one")
    p.add_argument("--soak", type=float, default=None, metavar="MINUTES",
                   help="keep one stack under load this long, cycling the scenarios (--scenario none: plain load), "
                        "and report every process's RSS at the start and the end")
    return p.parse_args(argv)


def options(args: argparse.Namespace) -> ChaosOptions:
    if args.draft_replicas < 2:
        raise SystemExit("the chaos suite needs at least two draft replicas")
    overrides = dict(requests=args.requests, max_new_tokens=args.max_new_tokens, concurrency=args.concurrency,
                     time_limit_s=args.time_limit_s, post_heal_requests=args.post_heal_requests,
                     fault_s=tuple(args.fault_s) if args.fault_s else None,
                     draft_timeout_floor_ms=args.draft_timeout_floor_ms,
                     draft_timeout_factor=args.draft_timeout_factor, breaker_open_s=args.breaker_open_s,
                     target_grace_s=args.target_grace_s, store_grace_s=args.store_grace_s,
                     slow_latency_ms=args.slow_latency_ms, slow_target_ms=args.slow_target_ms)
    fixed = dict(seed=args.seed, target_model=args.target_model, draft_strategy=args.draft_strategy,
                 draft_model=args.draft_model, draft_replicas=args.draft_replicas, draft_len=args.draft_len,
                 engine=args.engine, threads=args.threads, device=args.device, dtype=args.dtype, log_dir=args.log_dir,
                 fresh_stack=args.fresh_stack, speculation_max_sessions=args.speculation_max_sessions)
    if args.quick:
        return ChaosOptions.quick_preset(**overrides, **fixed)
    return ChaosOptions(**{k: v for k, v in overrides.items() if v is not None}, **fixed)


def _soak_text(summary: dict) -> str:
    rows = [f"soak {summary['soak_minutes']} min: {summary['runs']} runs, {len(summary['failed_runs'])} failed, "
            f"ok={summary['ok']}", "process                 RSS start MB   RSS end MB"]
    for name, start in summary["rss_start"].items():
        end = summary["rss_end"].get(name, {})
        restarted = " (restarted)" if end.get("pid") != start["pid"] else ""
        rows.append(f"{name:<22} {start['rss_mb']!s:>12} {end.get('rss_mb')!s:>12}{restarted}")
    return "\n".join(rows + summary["failed_runs"])


def main(argv=None) -> int:
    args = parse_args(argv)
    names = args.scenario or ["all"]
    if "all" in names:
        names = list(SCENARIOS)
    allowed = (*SCENARIOS, PLAIN) if args.soak is not None else SCENARIOS
    unknown = [n for n in names if n not in allowed]
    if unknown:
        raise SystemExit(f"unknown scenario {unknown[0]!r}; choose from {', '.join(SCENARIOS)} or all")

    def emit(res: dict) -> None:
        if args.json:
            print(json.dumps(res, sort_keys=False), flush=True)
        else:
            print("  ".join(f"{k}={res.get(k)}" for k in SUMMARY_KEYS), flush=True)
            if not res.get("ok"):
                bad = [k for k, v in (res.get("checks") or {}).items() if not v]
                print(f"    FAILED checks: {bad or res.get('error')}  (logs: {res.get('log_dir')})", flush=True)

    if args.soak is not None:
        summary = soak(names, options(args), args.soak, emit)
        print(json.dumps(summary) if args.json else _soak_text(summary), flush=True)
        return 0 if summary["ok"] else 1
    results = run_scenarios(names, options(args), emit)
    return 0 if all(r.get("ok") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
