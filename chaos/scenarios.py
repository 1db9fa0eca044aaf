"""Chaos scenarios against a real LocalStack (Redis, target, >= 2 draft replicas, orchestrator) on loopback.

Each scenario runs a continuous streaming load in client threads while a fault-injector thread injects one
fault at a moment chosen from the seed (after a seeded fraction of the expected tokens has streamed), keeps
it for a seeded duration, heals it, and waits until the orchestrator sees the healed service again. The load
keeps issuing requests until the heal has settled and then runs a post-heal batch, so the whole fault
window is under load and the recovery is observed. Every request's tokens are compared with the target-only
greedy output of the same prompt computed in the same run, and with what GetSession stored.
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass

import grpc
import redis as redis_lib

from chaos import DRAFT_FAULTS, SCENARIOS
from chaos.faults import FAULTS as _FAULTS
from chaos.faults_network import NETWORK_FAULTS, store_check_after_loss
from chaos.harness import ChaosHarness, ChaosOptions, _mismatches, _pct
from chaos.load import Progress, RequestRecord, Retry, run_request
from chaos.target_pool import POOL_FAULTS, options_for, pool_checks
# orchestrator.* is imported here, not at the moment of a fault: its first import pulls in torch (seconds).
from orchestrator.replicas.draft_pool import _rank
from orchestrator.store.session_store import KEY_PREFIX
from specdec.client import GenerateOptions, SpecdecClient

FAULTS = {**_FAULTS, **NETWORK_FAULTS}


@dataclass
class Timeline:
    start: float = 0.0
    injected: float | None = None
    heal_started: float | None = None
    healed: float | None = None
    settled: float | None = None
    settled_ok: bool = False
    error: str | None = None

    def rel(self, t: float | None) -> float | None:
        return None if t is None else round(t - self.start, 3)


class Scenario:
    def __init__(self, h: ChaosHarness, name: str):
        self.h = h
        self.name = name
        self.opts = h.opts
        self.rng = random.Random(f"{self.opts.seed}:{name}")
        self.fault = {**FAULTS, **POOL_FAULTS}[name](h, self.rng)
        self.fault.in_flight = self._in_flight
        self.progress = Progress()
        self.timeline = Timeline()
        self.records: list[RequestRecord] = []
        self._lock = threading.Lock()
        self._issued = {"load": 0, "post_heal": 0}
        self._stop = threading.Event()

    def _in_flight(self) -> list[str]:
        with self._lock:
            return [r.session_id for r in self.records if r.session_id and r.start and not r.end]

    # The injector: trigger on progress, hold the fault, heal, wait until the orchestrator uses it again.
    def _inject(self, trigger_tokens: int, fault_s: float, deadline: float) -> None:
        tl = self.timeline
        try:
            while self.progress.tokens < trigger_tokens and time.monotonic() < deadline and not self._stop.is_set():
                time.sleep(0.01)
            tl.injected = time.monotonic()
            self.fault.inject()
            time.sleep(max(0.0, min(fault_s, deadline - time.monotonic())))
            tl.heal_started = time.monotonic()
            self.fault.heal()
            tl.healed = time.monotonic()
            # A healed replica's breaker may still back off (up to 10 s) after a probe failed on a busy host.
            tl.settled_ok = self.fault.settle(timeout=45.0)
        except Exception as e:  # noqa: BLE001 - reported in the result; the harness heals the stack later
            tl.error = f"{type(e).__name__}: {e}"
        finally:
            tl.settled = time.monotonic()

    def _next(self, deadline: float, post_n: int) -> tuple[int, str] | None:
        with self._lock:
            if time.monotonic() >= deadline or self._stop.is_set():
                return None
            # Requests keep coming until the heal settled (the whole fault window is under load); those
            # started after it are the post-heal batch: at least post_n, and at least `requests` in all.
            phase = "post_heal" if self.timeline.settled is not None else "load"
            if (phase == "post_heal" and self._issued["post_heal"] >= post_n
                    and sum(self._issued.values()) >= max(self.opts.requests, self.fault.min_requests)):
                return None
            self._issued[phase] += 1
            rec = RequestRecord(len(self.records), len(self.records) % len(self.h.prompts), phase)
            self.records.append(rec)
            return rec.index, phase

    def _request(self, client: SpecdecClient, rec: RequestRecord, deadline: float) -> None:
        args = {"prompt": self.h.prompts[rec.prompt_index], "max_new_tokens": self.opts.max_new_tokens,
                **self.fault.stream_args(rec)}  # a fault may ask for its own requests (sampling_draft_faults)
        prompt = args.pop("prompt")  # the rest: max_new_tokens and the sampling parameters
        run_request(client, prompt, rec, GenerateOptions(ignore_eos=True, **args), Retry(deadline), self.progress)

    def run(self) -> dict:
        o = self.opts
        tl = self.timeline
        self.fault.prepare()
        post_n = o.post_heal_requests or max(2, o.concurrency)
        expected = o.requests * o.max_new_tokens
        trigger = int(self.rng.uniform(*o.trigger_frac) * expected)
        fault_s = max(self.rng.uniform(*o.fault_s), self.fault.min_hold_s)
        tl.start = time.monotonic()
        deadline = tl.start + o.time_limit_s
        request_deadline = deadline + 60.0
        injector = threading.Thread(target=self._inject, args=(trigger, fault_s, deadline), daemon=True)
        injector.start()

        def worker():
            with SpecdecClient(self.h.address, timeout_s=600) as client:
                while True:
                    nxt = self._next(deadline, post_n)
                    if nxt is None:
                        return
                    i, phase = nxt
                    rec = self.records[i]
                    self._request(client, rec, request_deadline)
                    if (o.extension_think_s and phase == "load" and tl.settled is None
                            and self._issued["load"] >= o.requests):
                        # Past `requests`, a long heal (a process restart) stays under a lighter load so the
                        # restart, which shares this host's CPUs, does not take much longer than it must.
                        time.sleep(o.extension_think_s)

        workers = [threading.Thread(target=worker, daemon=True) for _ in range(o.concurrency)]
        for w in workers:
            w.start()
        injector.join(max(0.0, deadline - time.monotonic()) + 200)
        for w in workers:
            w.join(max(0.0, request_deadline - time.monotonic()) + 10)
        self._stop.set()
        return self.result(fault_s, trigger)

    # -- the result ---------------------------------------------------------------------------------

    def _store_check(self) -> tuple[int, list[str]]:
        """GetSession of every session must hold exactly the tokens its client received."""
        if self.fault.data_loss_allowed:  # sessions may be lost whole or lose their tail, never get a hole
            return store_check_after_loss(self.fault, self.records)
        bad, notes = 0, []
        with SpecdecClient(self.h.address) as c:
            for r in self.records:
                if not r.session_id:
                    continue
                try:
                    stored = list(c.get_session(r.session_id, timeout_s=10).generated_token_ids)
                except grpc.RpcError as e:
                    bad += 1
                    notes.append(f"request {r.index}: GetSession {e.code().name}: {e.details()}")
                    continue
                ok = stored == r.tokens if r.completed else stored[: len(r.tokens)] == r.tokens
                if not ok:
                    bad += 1
                    notes.append(f"request {r.index} ({r.session_id}): received {len(r.tokens)} tokens, "
                                 f"stored {len(stored)}")
        return bad, notes

    def _healed_replica_serving(self, post: list[RequestRecord]) -> dict | None:
        """Post-heal sessions whose rendezvous ranking prefers a healed replica: did they end on it?"""
        if self.name not in ("kill_draft", "kill_all_drafts", "hang_draft", "slow_draft"):
            return None
        addrs = [d.address for d in self.h.stack.drafts]
        r = redis_lib.Redis.from_url(self.h.stack.redis.url, socket_timeout=2)
        preferring, on_it = 0, 0
        try:
            for rec in post:
                if not rec.session_id:
                    continue
                top = max(addrs, key=lambda a: _rank(rec.session_id, a))
                used = (r.hget(KEY_PREFIX + rec.session_id, "draft_replica") or b"").decode()
                preferring += top in self.fault.victim_addresses
                on_it += used in self.fault.victim_addresses
        finally:
            r.close()
        # A session may end on another replica after a noise timeout on a busy machine, so the check only
        # asks that the healed replica serves again when post-heal sessions prefer it.
        return {"sessions_preferring_healed": preferring, "ended_on_healed": on_it}

    def _detail(self, r: RequestRecord) -> dict:
        st = r.stats
        return {"request": r.index, "phase": r.phase, "session_id": r.session_id, "tokens": len(r.tokens),
                "start_s": round(r.start - self.timeline.start, 3), "latency_ms": round(r.latency_ms, 1),
                "verify_steps": st.get("verify_steps", 0), "fallback_steps": st.get("fallback_steps", 0),
                "accepted": st.get("draft_tokens_accepted", 0), "draft_failures": st.get("draft_failures_by_kind", {}),
                "resumes": r.resumes, "retries": r.retries, "error": r.error}

    def _stalls(self, recs) -> tuple[list, float, list, dict]:
        """(every gap between a stream's messages as (time, ms, request), the longest, those inside the fault
        window, the stall bound from the target's own Verify time over the requests that overlapped it)."""
        tl, h = self.timeline, self.h
        gaps = [(t, g, r.index) for r in recs for t, g in r.gaps_ms]
        max_stall = max((g for _, g, _ in gaps), default=0.0)
        window = [(t, g, i) for t, g, i in gaps if tl.injected is not None and t >= tl.injected
                  and (tl.settled is None or t - g / 1e3 <= tl.settled)]
        overlap = [r for r in recs if tl.injected is not None and r.end >= tl.injected
                   and r.start <= (tl.settled or r.start)] or recs
        v_ms = sum(float(r.stats.get("verify_ms", 0.0) or 0.0) for r in overlap)
        v_n = sum(int(r.stats.get("verify_steps", 0) or 0) for r in overlap)
        return gaps, max_stall, window, h.stall_bound(v_ms / v_n if v_n else h.baseline["target_step_ms"])

    def _fault_detail(self, fault_s: float, trigger: int) -> dict:
        tl = self.timeline
        return {"victims": self.fault.victims, "trigger_tokens": trigger, "hold_s": round(fault_s, 2),
                "injected_at_s": tl.rel(tl.injected), "heal_started_at_s": tl.rel(tl.heal_started),
                "healed_at_s": tl.rel(tl.healed), "settled_at_s": tl.rel(tl.settled), "settled": tl.settled_ok,
                "outage_s": round(tl.healed - tl.injected, 2) if tl.healed and tl.injected else None,
                "error": tl.error, **self.fault.details()}

    def _config(self) -> dict:
        o, h = self.opts, self.h
        return {"seed": o.seed, "quick": o.quick, "concurrency": o.concurrency, "max_new_tokens": o.max_new_tokens,
                "draft_replicas": len(h.stack.drafts), "target_replicas": len(h.stack.targets),
                "draft_timeout_floor_ms": o.draft_timeout_floor_ms, "draft_timeout_factor": o.draft_timeout_factor,
                "breaker_open_s": o.breaker_open_s, "target_grace_s": o.target_grace_s,
                "store_grace_s": o.store_grace_s, "fallback_chunk": o.fallback_chunk,
                "slow_latency_ms": o.slow_latency_ms, "target_model": o.target_model,
                "draft_strategy": h.stack.draft_strategy}

    def result(self, fault_s: float, trigger: int) -> dict:
        tl, h = self.timeline, self.h
        recs = self.records
        completed = [r for r in recs if r.completed]
        failed = [r for r in recs if not r.completed]
        mism = sum(_mismatches(r.tokens, h.references[r.prompt_index], r.completed) for r in recs)
        keys = ("fallback_steps", "verify_steps", "draft_failures", "replica_failovers", "target_resyncs",
                "draft_tokens_proposed", "draft_tokens_accepted", "decode_steps")
        totals = {k: sum(int(r.stats.get(k, 0) or 0) for r in recs) for k in keys}
        by_kind: dict[str, int] = {}
        for r in recs:
            for k, v in (r.stats.get("draft_failures_by_kind") or {}).items():
                by_kind[k] = by_kind.get(k, 0) + int(v)
        post = [r for r in recs if r.phase == "post_heal"]
        post_verify = [int(r.stats.get("verify_steps", 0) or 0) for r in post]
        post_accepted = sum(int(r.stats.get("draft_tokens_accepted", 0) or 0) for r in post)
        resumed = (bool(post) and all(r.completed for r in post) and all(v > 0 for v in post_verify)
                   and post_accepted > 0)
        gaps, max_stall, window, bound = self._stalls(recs)
        lat = [r.latency_ms for r in completed]
        store_bad, store_notes = self._store_check()
        serving = self._healed_replica_serving(post)
        end = max((r.end for r in recs), default=time.monotonic())
        codes: dict[str, int] = {}
        for r in recs:
            for code in (e.split(":", 1)[0] for e in r.errors):
                codes[code] = codes.get(code, 0) + 1
        out = {
            "scenario": self.name,
            "requests": len(recs),
            "completed": len(completed),
            "failed": len(failed),
            "ended_data_loss": sum((r.error or "").startswith("DATA_LOSS") for r in failed),
            "data_loss_allowed": self.fault.data_loss_allowed,
            "error_codes": codes,
            "mismatched_tokens": mism,
            "duplicated_or_lost_offsets": sum(r.offset_errors for r in recs),
            "store_mismatches": store_bad,
            "fallback_steps": totals["fallback_steps"],
            "speculation_resumed": resumed,
            "max_stall_ms": round(max_stall, 1),
            "stall_bound_ms": bound["bound_ms"] if self.name in DRAFT_FAULTS else self.fault.stall_bound_ms(),
            "stall_bound": bound,  # its terms; a target fault's bound is set by the fault (chaos/faults_target.py)
            "max_stall_in_fault_window_ms": round(max((g for _, g, _ in window), default=0.0), 1),
            "verify_steps": totals["verify_steps"],
            "draft_failures": totals["draft_failures"],
            "draft_failures_by_kind": by_kind,
            "replica_failovers": totals["replica_failovers"],
            "target_resyncs": totals["target_resyncs"],
            "degraded_ms": round(sum(float(r.stats.get("degraded_ms", 0.0) or 0.0) for r in recs), 1),
            "acceptance_rate": round(totals["draft_tokens_accepted"] / max(1, totals["draft_tokens_proposed"]), 3),
            "resumed_streams": sum(r.resumes > 0 for r in recs),
            "resumes": sum(r.resumes for r in recs),
            "retried_requests": sum(r.retries for r in recs),
            "post_heal_requests": len(post),
            "post_heal_verify_steps": sum(post_verify),
            "post_heal_accepted_tokens": post_accepted,
            "healed_replica": serving,
            "p50_latency_ms": round(_pct(lat, 0.5), 1),
            "p95_latency_ms": round(_pct(lat, 0.95), 1),
            "duration_s": round(end - tl.start, 2),
            "tokens": sum(len(r.tokens) for r in recs),
            "fault": self._fault_detail(fault_s, trigger),
            "config": self._config(),
            "baseline": h.baseline,
            "errors": sorted({e for r in recs for e in r.errors})[:5],
            "failures": [f"request {r.index}: {r.error}" for r in failed][:5],
            "store_notes": store_notes[:5],
            "request_detail": [self._detail(r) for r in recs if r.phase == "post_heal" or not r.completed
                               or r.resumes or r.retries][:20],
            "stalls": [{"request": i, "ms": round(g, 1), "at_s": round(t - tl.start, 3)}
                       for t, g, i in sorted(gaps, key=lambda x: -x[1])[:3]],
            "log_problems": h.log_problems(),
            "log_dir": str(h.stack.log_dir),
        }
        out["checks"] = checks(out)
        self.fault.judge(out, self.records, tl)  # a fault's own figures and checks (chaos/faults_target.py)
        out["ok"] = all(out["checks"].values())
        return out


def checks(res: dict) -> dict[str, bool]:
    """The outcomes each scenario must show (docs/chaos.md, tests/test_chaos.py)."""
    name = res["scenario"]
    lost = res["ended_data_loss"] if res.get("data_loss_allowed") else 0  # only where Redis loses data
    c = {
        "all_completed": res["completed"] + lost == res["requests"] and res["failed"] == lost,
        "no_mismatched_tokens": res["mismatched_tokens"] == 0,
        "no_offset_errors": res["duplicated_or_lost_offsets"] == 0,
        "store_matches_client": res["store_mismatches"] == 0,
        "speculation_resumed": res["speculation_resumed"],
        "fault_healed": res["fault"]["error"] is None and res["fault"]["settled"],
    }
    if name in DRAFT_FAULTS:
        c["stall_within_bound"] = res["max_stall_ms"] <= res["stall_bound_ms"]
        c["streams_never_broken"] = res["resumes"] == 0 and res["retried_requests"] == 0
        # A hang can be caught by the health check before any call times out: then sessions just move.
        c["fault_exercised"] = res["draft_failures"] + res["replica_failovers"] > 0
        if name == "kill_all_drafts":
            c["degraded_to_target_only"] = res["fallback_steps"] > 0
        else:
            c["failed_over"] = res["replica_failovers"] > 0
        hr = res.get("healed_replica")
        if hr and hr["sessions_preferring_healed"]:
            c["healed_replica_serving"] = hr["ended_on_healed"] > 0
    elif name == "kill_target":
        c["streams_never_broken"] = res["resumes"] == 0 and res["retried_requests"] == 0
        c["within_target_grace"] = (res["fault"]["outage_s"] or 1e9) < res["config"]["target_grace_s"]
        c["fault_exercised"] = res["target_resyncs"] > 0
    elif name in POOL_FAULTS:
        c.update(pool_checks(res))
    elif name == "redis_restart":
        c["in_flight_never_broken"] = res["resumes"] == 0
        c["within_store_grace"] = (res["fault"]["outage_s"] or 1e9) < res["config"]["store_grace_s"]
    elif name == "kill_orchestrator":
        c["fault_exercised"] = res["resumes"] > 0
    if name in FAULTS:
        c.update(FAULTS[name].checks(res))
    return c


def run_scenario(harness: ChaosHarness, name: str) -> dict:
    """One scenario on a healthy harness; what earlier scenarios logged is not counted against it."""
    if name not in SCENARIOS:
        raise ValueError(f"unknown scenario {name!r}; choose from {', '.join(SCENARIOS)} or all")
    harness.ensure_healthy()
    harness.log_problems()  # skip what earlier scenarios logged
    return Scenario(harness, name).run()


def run_scenarios(names: list[str], opts: ChaosOptions, emit=None) -> list[dict]:
    """Run scenarios on one shared stack (or one stack each with opts.fresh_stack); emit(result) per scenario."""
    results = []
    harness = None
    try:
        for name in names:
            wanted = options_for(name, opts)
            replicas = harness.opts.target_replicas if harness is not None else 0
            if harness is not None and not opts.fresh_stack and 0 < replicas < wanted.target_replicas:
                harness.add_targets(wanted)  # kill_target_pool: one more target on the shared stack
            elif harness is None or opts.fresh_stack or replicas != wanted.target_replicas:
                if harness is not None:
                    harness.stop()
                harness = ChaosHarness(wanted).start()
            try:
                res = run_scenario(harness, name)
            except Exception as e:  # noqa: BLE001 - report it and heal the stack for the next scenario
                res = {"scenario": name, "ok": False, "error": f"{type(e).__name__}: {e}",
                       "log_dir": str(harness.stack.log_dir) if harness.stack else None}
            results.append(res)
            if emit is not None:
                emit(res)
    finally:
        if harness is not None:
            harness.stop()
    return results


__all__ = ["Scenario", "checks", "run_scenario", "run_scenarios"]
