"""`python -m chaos --soak MINUTES`: one stack under load for that long, cycling the chosen scenarios (or, with
`--scenario none`, plain fault-free load), with every process's resident memory at the start and at the end."""

from __future__ import annotations

import itertools
import os
import time

from chaos.harness import ChaosHarness, ChaosOptions, _mismatches
from chaos.load import run_batch
from chaos.scenarios import run_scenario

PLAIN = "none"  # a batch of fault-free load: one request per prompt, compared with the references


def rss_mb(pid: int | None) -> float | None:
    """Resident set size of a process from /proc (Linux); None when it is gone."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        return None
    return None


def processes(h: ChaosHarness) -> dict[str, int | None]:
    """Name -> pid of every process of the run: the stack's services, Redis, and this process (the load)."""
    s = h.stack
    procs = {"orchestrator": s.orchestrator, "target": s.target, **{d.name: d for d in s.drafts}}
    out = {name: (p.proc.pid if p is not None and p.alive() else None) for name, p in procs.items()}
    out["redis"] = s.redis.proc.pid if s.redis.proc is not None and s.redis.proc.poll() is None else None
    out["chaos (load clients)"] = os.getpid()
    return out


def memory(h: ChaosHarness) -> dict[str, dict]:
    return {name: {"pid": pid, "rss_mb": rss_mb(pid)} for name, pid in processes(h).items()}


def plain_load(h: ChaosHarness) -> dict:
    o = h.opts
    t0 = time.monotonic()
    recs = run_batch(h.address, h.prompts, o.max_new_tokens, o.concurrency, t0 + o.time_limit_s + 60)
    mism = sum(_mismatches(r.tokens, h.references[r.prompt_index], r.completed) for r in recs)
    failed = sum(not r.completed for r in recs)
    return {"scenario": PLAIN, "requests": len(recs), "completed": len(recs) - failed, "failed": failed,
            "mismatched_tokens": mism, "duration_s": round(time.monotonic() - t0, 2), "ok": failed == 0 and mism == 0}


def soak(names: list[str], opts: ChaosOptions, minutes: float, emit=None) -> dict:
    """Run `names` round-robin on one stack until `minutes` have passed (the last one started runs to its end)."""
    h = ChaosHarness(opts).start()
    try:
        start_mem = memory(h)
        t0 = time.monotonic()
        runs, failed = 0, []
        for name in itertools.cycle(names):
            if time.monotonic() - t0 >= minutes * 60:
                break
            try:
                res = plain_load(h) if name == PLAIN else run_scenario(h, name)
            except Exception as e:  # noqa: BLE001 - reported, and the next scenario heals the stack
                res = {"scenario": name, "ok": False, "error": f"{type(e).__name__}: {e}"}
            runs += 1
            if not res.get("ok"):
                failed.append(f"run {runs}: {name}: {[k for k, v in (res.get('checks') or {}).items() if not v] or res.get('error') or res.get('failed')}")
            if emit is not None:
                emit(res)
        if h.stack is not None:
            h.ensure_healthy()
        end_mem = memory(h)
    finally:
        h.stop()
    growth = {n: round(end_mem[n]["rss_mb"] - m["rss_mb"], 1) for n, m in start_mem.items()
              if m["rss_mb"] is not None and end_mem.get(n, {}).get("rss_mb") is not None
              and end_mem[n]["pid"] == m["pid"]}
    return {"soak_minutes": minutes, "elapsed_s": round(time.monotonic() - t0, 1), "scenarios": list(names),
            "runs": runs, "failed_runs": failed, "rss_start": start_mem, "rss_end": end_mem,
            "rss_growth_mb": growth,  # processes that ran the whole soak (a restarted one has a new pid)
            "ok": not failed and runs > 0}
