"""Chaos scenarios against a real LocalStack (Redis, target, >= 2 draft replicas, orchestrator) on loopback.

Each scenario runs a continuous streaming load in client threads while a fault-injector thread injects one
fault at a moment chosen from the seed (after a seeded fraction of the expected tokens has streamed), keeps
it for a seeded duration, heals it, and waits until the orchestrator sees the healed service again. The load
keeps issuing requests until the heal has settled and then runs a post-heal batch, so the whole fault
window is under load and the recovery is observed. Every request's tokens are compared with the target-only
greedy output of the same prompt computed in the same run, and with what GetSession stored.
"""

from __future__ import annotations

import json
import random
import signal
import statistics
import threading
import time
from dataclasses import dataclass

import grpc
import redis as redis_lib

# orchestrator.* is imported here, not at the moment of a fault: its first import pulls in torch (seconds).
from chaos import DRAFT_FAULTS, SCENARIOS
from chaos.load import Progress, RequestRecord, run_batch, run_request
from orchestrator.draft_pool import _rank
from orchestrator.session_store import KEY_PREFIX
from specdec.client import SpecdecClient
from specdec.stack import LocalStack, ServiceProcess, StackConfig

TINY_TARGET = "tiny:vocab=64,layers=2,hidden=64,seed=0,std=0.3"
TINY_DRAFT = "tiny:vocab=64,layers=1,hidden=64,seed=0,std=0.3"  # the target's first layer: partial acceptance

TEXT_PROMPTS = [
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. The quick",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
    "List the days of the week: Monday, Tuesday, Wednesday, Thursday, Friday,",
    "Once upon a time there was a little robot. The little robot liked to count: one, two, three,",
    "Question: What is the capital of France? Answer: The capital of France is Paris. Question: What is the",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,",
    "Roses are red, violets are blue, sugar is sweet, and so are you. Roses are red,",
    "Write a haiku about the sea. The sea is wide and",
]


@dataclass
class ChaosOptions:
    requests: int = 24                 # phase-1 requests at least (the load keeps going until the heal settles)
    max_new_tokens: int = 64
    concurrency: int = 4
    time_limit_s: float = 180.0        # per scenario: no request is started after it
    seed: int = 0
    quick: bool = False
    post_heal_requests: int = 0        # 0: max(2, concurrency)
    fault_s: tuple = (2.0, 4.0)        # seeded fault duration range (before the heal starts)
    trigger_frac: tuple = (0.1, 0.3)   # seeded: inject after this fraction of phase 1's expected tokens
    prompts: int = 8
    extension_think_s: float = 0.0     # pause between a worker's requests once `requests` were issued
    target_model: str = TINY_TARGET
    draft_strategy: str = "model"
    draft_model: str = TINY_DRAFT
    draft_replicas: int = 2
    draft_len: int = 4
    threads: int = 1
    device: str = "cpu"
    dtype: str = "float32"
    # Orchestrator fault-tolerance settings (passed as flags; the stall bound is computed from them): the server's
    # defaults. A target restart takes 11-25 s on a busy 2-core host (importing torch), inside the 30 s grace.
    draft_timeout_floor_ms: float = 100.0
    draft_timeout_factor: float = 2.0
    breaker_open_s: float = 1.0
    target_grace_s: float = 30.0
    store_grace_s: float = 10.0
    fallback_chunk: int = 4
    slow_latency_ms: float = 300.0     # slow_draft: per-Propose latency, well above the draft deadline
    stall_steps: float = 0.0           # M in the stall bound; 0: fallback_chunk + 2
    log_dir: str | None = None
    fresh_stack: bool = False

    @classmethod
    def quick_preset(cls, **overrides) -> "ChaosOptions":
        base = dict(requests=6, max_new_tokens=48, concurrency=2, time_limit_s=60.0, fault_s=(0.6, 1.2),
                    prompts=6, extension_think_s=0.5, quick=True)
        base.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**base)


def _pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    v = sorted(values)
    return v[min(len(v) - 1, max(0, int(round(q * (len(v) - 1)))))]


def _mismatches(got: list[int], ref: list[int], complete: bool) -> int:
    """Positions that differ from the reference (+ missing/extra tokens when the request completed)."""
    n = sum(a != b for a, b in zip(got, ref))
    if complete:
        n += abs(len(got) - len(ref))
    else:
        n += max(0, len(got) - len(ref))
    return n


def _find_replicas(obj):
    """The replica list (address, status, breaker) anywhere in the outline."""
    if isinstance(obj, dict):
        reps = obj.get("replicas")
        if isinstance(reps, list) and reps and isinstance(reps[0], dict) and "address" in reps[0]:
            return reps
        for v in obj.values():
            found = _find_replicas(v)
            if found:
                return found
    elif isinstance(obj, list):
        for v in obj:
            found = _find_replicas(v)
            if found:
                return found
    return None


class ChaosHarness:
    """One stack shared by the scenarios run through it; references and the baseline are measured once."""

    def __init__(self, opts: ChaosOptions):
        self.opts = opts
        self.stack: LocalStack | None = None
        self.prompts: list = []
        self.references: list[list[int]] = []
        self.baseline: dict = {}
        self.latency_flag: list[bool] = []    # replica i was started with --inject-latency-ms (SIGUSR1 toggles it)
        self.latency_on: list[bool] = []
        self._log_offsets: dict[str, int] = {}

    # -- the stack ---------------------------------------------------------------------------------

    def start(self) -> "ChaosHarness":
        o = self.opts
        orch = ["--draft-timeout-floor-ms", str(o.draft_timeout_floor_ms),
                "--draft-timeout-factor", str(o.draft_timeout_factor), "--breaker-open-s", str(o.breaker_open_s),
                "--target-grace-s", str(o.target_grace_s), "--store-grace-s", str(o.store_grace_s),
                "--fallback-chunk", str(o.fallback_chunk)]
        cfg = StackConfig(target_model=o.target_model, draft_strategy=o.draft_strategy, draft_model=o.draft_model,
                          draft_replicas=o.draft_replicas, draft_len=o.draft_len, store="redis", threads=o.threads,
                          device=o.device, dtype=o.dtype, orchestrator_args=orch,
                          draft_args=["--inject-latency-ms", str(o.slow_latency_ms)])
        self.stack = LocalStack(cfg, o.log_dir).start(timeout=300)
        self.latency_flag = [True] * len(self.stack.drafts)
        self.latency_on = [True] * len(self.stack.drafts)  # a replica starts with its injected latency on
        for i in range(len(self.stack.drafts)):
            self.set_latency(i, False)
        self._make_prompts()
        self._measure()
        return self

    def stop(self) -> None:
        if self.stack is not None:
            s = self.stack
            for d in s.drafts:
                d.signal(signal.SIGCONT)
            procs = [p for p in [s.orchestrator, *s.drafts, s.target] if p is not None]
            threads = [threading.Thread(target=p.stop, daemon=True) for p in procs]  # in parallel: faster
            for t in threads:
                t.start()
            for t in threads:
                t.join(30)
            s.stop()  # anything left, and Redis
            self.stack = None

    @property
    def address(self) -> str:
        return self.stack.address

    def _log_toggles(self, proc: ServiceProcess) -> list[bool]:
        out = []
        try:
            for line in proc.log_path.read_text(errors="replace").splitlines():
                if "injected latency toggled" in line:
                    try:
                        out.append(bool(json.loads(line).get("enabled")))
                    except ValueError:
                        out.append("true" in line.lower())
        except OSError:
            pass
        return out

    def set_latency(self, i: int, on: bool, timeout: float = 10.0) -> None:
        """Toggle replica i's injected latency with SIGUSR1 and wait until its log confirms the new state."""
        if self.latency_on[i] == on:
            return
        proc = self.stack.drafts[i]
        if not self.latency_flag[i]:
            raise RuntimeError(f"{proc.name} was started without --inject-latency-ms; SIGUSR1 would kill it")
        before = len(self._log_toggles(proc))
        proc.signal(signal.SIGUSR1)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            toggles = self._log_toggles(proc)
            if len(toggles) > before:
                if toggles[-1] != on:
                    raise RuntimeError(f"{proc.name}: latency toggled to {toggles[-1]}, wanted {on}")
                self.latency_on[i] = on
                return
            time.sleep(0.05)
        raise TimeoutError(f"{proc.name} did not confirm the latency toggle within {timeout} s")

    def restart_draft(self, i: int, with_latency_flag: bool = False) -> None:
        """(Re)start replica i on its address. Without the flag the new process has no latency to toggle."""
        proc = self.stack.drafts[i]
        args = proc.args
        if "--inject-latency-ms" in args:
            j = args.index("--inject-latency-ms")
            del args[j:j + 2]
        if with_latency_flag:
            args += ["--inject-latency-ms", str(self.opts.slow_latency_ms)]
        proc.signal(signal.SIGCONT)
        proc.stop(timeout=5)
        proc.start()
        proc.wait_ready(120)
        self.latency_flag[i] = with_latency_flag
        self.latency_on[i] = with_latency_flag
        if with_latency_flag:
            self.set_latency(i, False)

    def breakers(self) -> dict[str, str]:
        try:
            with SpecdecClient(self.address) as c:
                from google.protobuf.json_format import MessageToDict

                from specdec.v1 import orchestrator_pb2 as opb

                outline = MessageToDict(c.stub.GetOutline(opb.GetOutlineRequest(), timeout=5).outline)
        except grpc.RpcError:
            return {}
        return {r["address"]: r.get("breaker", "?") for r in (_find_replicas(outline) or [])}

    def wait_breakers(self, timeout: float = 15.0, states: tuple = ("closed", "half_open")) -> bool:
        """Wait until every replica's breaker (as the orchestrator's outline reports it) is in one of `states`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            b = self.breakers()
            if b and all(s in states for s in b.values()):
                return True
            time.sleep(0.2)
        return False

    def ensure_healthy(self) -> None:
        """Heal anything a previous scenario left broken, so scenarios can share the stack."""
        s = self.stack
        if s.redis.proc is None or s.redis.proc.poll() is not None:
            s.redis.start()
        for d in s.drafts:
            d.signal(signal.SIGCONT)
        if not s.target.alive():
            s.target.restart()
        for i, d in enumerate(s.drafts):
            if not d.alive():
                self.restart_draft(i)
        for i in range(len(s.drafts)):
            if self.latency_on[i]:
                self.set_latency(i, False)
        if not s.orchestrator.alive():
            s.start_orchestrator()
        with SpecdecClient(self.address) as c:
            c.wait_ready(60)
        self.wait_breakers()

    # -- prompts, references, baseline ---------------------------------------------------------------

    def _make_prompts(self) -> None:
        o = self.opts
        rng = random.Random(f"prompts:{o.seed}")
        if o.target_model.startswith("tiny"):
            from specdec.models import parse_tiny_spec

            vocab = int(parse_tiny_spec(o.target_model)["vocab"])
            self.prompts = [[rng.randrange(1, vocab) for _ in range(rng.randint(4, 12))] for _ in range(o.prompts)]
        else:
            self.prompts = [TEXT_PROMPTS[i % len(TEXT_PROMPTS)] for i in range(o.prompts)]

    def _measure(self) -> None:
        """Target-only references (the expected tokens) and a fault-free speculative baseline, same load."""
        o = self.opts
        deadline = time.monotonic() + max(120.0, o.time_limit_s)
        refs = run_batch(self.address, self.prompts, o.max_new_tokens, o.concurrency, deadline, speculation=False)
        bad = [r for r in refs if not r.completed]
        if bad:
            raise RuntimeError(f"reference run failed: {bad[0].error}")
        self.references = [r.tokens for r in refs]
        base = run_batch(self.address, self.prompts, o.max_new_tokens, o.concurrency, deadline)
        bad = [r for r in base if not r.completed]
        if bad:
            raise RuntimeError(f"baseline run failed: {bad[0].error}")
        mism = sum(_mismatches(r.tokens, self.references[r.prompt_index], True) for r in base)
        gaps = [g for r in base for _, g in r.gaps_ms[1:]]  # steps after the first (prefill) message
        verify_ms = sum(r.stats.get("verify_ms", 0.0) for r in base)
        verify_steps = sum(r.stats.get("verify_steps", 0) for r in base)
        ref_step = [r.stats.get("wall_ms", 0.0) / max(1, r.stats.get("decode_steps", 0)) for r in refs]
        target_step_ms = verify_ms / verify_steps if verify_steps else 0.0
        # The orchestrator's draft deadline: max(floor, factor x target step), the budget scaled by
        # (1 + context/128) for a call that must prefill (failover, probe); take the longest context here.
        deadline_ms = self.draft_deadline_ms(target_step_ms)
        step_p95 = _pct(gaps, 0.95)
        m = o.stall_steps or (o.fallback_chunk + 2)
        self.baseline = {
            "mismatched_tokens": mism,
            "target_step_ms": round(target_step_ms, 2),          # target Verify, measured by the target
            "target_only_step_ms": round(statistics.median(ref_step), 2) if ref_step else 0.0,
            "step_p50_ms": round(_pct(gaps, 0.5), 2),            # client-visible loop step, fault-free
            "step_p95_ms": round(step_p95, 2),
            "max_stall_ms": round(max(gaps, default=0.0), 2),
            "verify_steps": verify_steps,
            "draft_failures": sum(r.stats.get("draft_failures", 0) for r in base),
            "fallback_steps": sum(r.stats.get("fallback_steps", 0) for r in base),
            "acceptance_rate": round(sum(r.stats.get("draft_tokens_accepted", 0) for r in base)
                                     / max(1, sum(r.stats.get("draft_tokens_proposed", 0) for r in base)), 3),
            "draft_deadline_ms": round(deadline_ms, 2),
            "stall_steps": m,
        }
        # The longest stall a draft fault may cause, at the baseline's own target step (see stall_bound).
        self.baseline["stall_bound_ms"] = self.stall_bound(target_step_ms)["bound_ms"]

    def draft_deadline_ms(self, target_step_ms: float) -> float:
        """The longest draft deadline the orchestrator gives a call here (Generation._draft_timeout_s): max(floor,
        factor x target step, k drafted tokens each capped at a step), and for a call that must prefill (failover,
        or a half-open replica probed again after failing over away from it) that budget scaled by
        (1 + context/128), or the budget plus factor x context x the prefill rate per token, a rate capped at a
        target step (timeouts raise it there); the longest context is taken."""
        o = self.opts
        max_ctx = max(len(p) if isinstance(p, list) else 4 * len(p) for p in self.prompts) + o.max_new_tokens
        budget = o.draft_timeout_factor * max(target_step_ms, o.draft_len * target_step_ms)
        prefill = max(budget * (1 + max_ctx / 128), budget + o.draft_timeout_factor * max_ctx * target_step_ms)
        return max(o.draft_timeout_floor_ms, prefill)

    def stall_bound(self, target_step_ms: float) -> dict:
        """The longest stall a draft fault may cause, for the target step measured during the scenario.

        A step whose draft fails waits at most the draft deadline D, then decodes fallback_chunk tokens
        target-only; the next step rebuilds on another replica. So: D + M x S, with M = fallback_chunk + 2
        and S = one client-visible loop step (the longest fault-free one, scaled by how much slower the target's own
        Verify ran during the scenario than in the baseline: that is host contention, e.g. a restarting
        process sharing the CPU, not the draft fault). The longest step, not the p95: the bound is held against
        the longest stall, and a p95 step left a 2-core machine's scheduling hiccups out (a correct run once
        stalled 272.6 ms against a 261.6 ms bound)."""
        b = self.baseline
        contention = max(1.0, target_step_ms / b["target_step_ms"]) if b["target_step_ms"] else 1.0
        step = b["max_stall_ms"] * contention
        deadline = self.draft_deadline_ms(max(target_step_ms, b["target_step_ms"]))
        return {"bound_ms": round(deadline + b["stall_steps"] * step, 1), "draft_deadline_ms": round(deadline, 1),
                "step_ms": round(step, 1), "steps": b["stall_steps"], "contention": round(contention, 2),
                "target_step_ms": round(target_step_ms, 2)}

    # -- log scan ----------------------------------------------------------------------------------

    def log_problems(self) -> dict[str, list[str]]:
        """New error lines / tracebacks in the service logs since the last call."""
        out = {}
        for path in sorted(self.stack.log_dir.glob("*.log")):
            try:
                data = path.read_text(errors="replace")
            except OSError:
                continue
            start = self._log_offsets.get(str(path), 0)
            self._log_offsets[str(path)] = len(data)
            lines = [ln for ln in data[start:].splitlines()
                     if '"level": "error"' in ln or "Traceback" in ln or '"level": "critical"' in ln]
            if lines:
                more = [f"... {len(lines) - 5} more"] if len(lines) > 5 else []
                out[path.stem] = [ln[:300] for ln in lines[:5]] + more
        return out

    # -- scenarios -----------------------------------------------------------------------------------

    def run(self, name: str) -> dict:
        if name not in SCENARIOS:
            raise ValueError(f"unknown scenario {name!r}; choose from {', '.join(SCENARIOS)} or all")
        self.ensure_healthy()
        self.log_problems()  # skip what earlier scenarios logged
        return Scenario(self, name).run()


class Fault:
    """What a scenario does to the stack: inject() at the seeded moment, heal() after the seeded duration."""

    def __init__(self, h: ChaosHarness, rng: random.Random):
        self.h = h
        self.rng = rng
        self.in_flight = lambda: []  # session ids of the streams running now (set by the scenario)
        self.victims: list[str] = []
        self.victim_addresses: list[str] = []

    def prepare(self) -> None:
        pass

    def inject(self) -> None:
        raise NotImplementedError

    def heal(self) -> None:
        raise NotImplementedError

    def settle(self, timeout: float) -> bool:
        """Wait until the orchestrator uses the healed service again."""
        return True


class DraftFault(Fault):
    def _set_victims(self, idx: list[int]) -> list[int]:
        self.idx = idx
        self.victims = [self.h.stack.drafts[i].name for i in idx]
        self.victim_addresses = [self.h.stack.drafts[i].address for i in idx]
        return idx

    def choose_one(self) -> int:
        """At the moment of the fault: a replica that in-flight sessions prefer (rendezvous ranking), so the
        fault hits live streams; the seed picks among them (among all if nothing is in flight)."""
        addrs = [d.address for d in self.h.stack.drafts]
        preferred = sorted({max(range(len(addrs)), key=lambda i: _rank(sid, addrs[i])) for sid in self.in_flight()})
        return self._set_victims([self.rng.choice(preferred or list(range(len(addrs))))])[0]

    def settle(self, timeout: float) -> bool:
        # Closed, not merely half-open: a call to the healed replica succeeded. A half-open breaker can still take a
        # probe that started during the fault and fails after the heal, and open again for seconds: then the
        # post-heal requests never reach the healed replica (a clean-clone run: healed_replica_serving false).
        return self.h.wait_breakers(timeout, ("closed",))


class KillDraft(DraftFault):
    def inject(self):
        self.h.stack.drafts[self.choose_one()].kill()

    def heal(self):
        self.h.restart_draft(self.idx[0])


class KillAllDrafts(DraftFault):
    def prepare(self):
        self._set_victims(list(range(len(self.h.stack.drafts))))

    def inject(self):
        for i in self.idx:  # SIGKILL every process group back to back: all gone at once
            self.h.stack.drafts[i].signal(signal.SIGKILL)
        for i in self.idx:
            self.h.stack.drafts[i].kill()

    def heal(self):
        threads = [threading.Thread(target=self.h.restart_draft, args=(i,)) for i in self.idx]
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)


class HangDraft(DraftFault):
    def inject(self):
        self.h.stack.drafts[self.choose_one()].signal(signal.SIGSTOP)

    def heal(self):
        self.h.stack.drafts[self.idx[0]].signal(signal.SIGCONT)


class SlowDraft(DraftFault):
    def prepare(self):
        restarted = False
        for i in range(len(self.h.stack.drafts)):
            if not self.h.latency_flag[i]:  # restarted by an earlier scenario without the flag
                self.h.restart_draft(i, with_latency_flag=True)
                restarted = True
        if restarted:
            self.h.wait_breakers()

    def inject(self):
        self.h.set_latency(self.choose_one(), True)

    def heal(self):
        self.h.set_latency(self.idx[0], False)


class KillTarget(Fault):
    def prepare(self):
        self.victims = ["target"]
        self.victim_addresses = [self.h.stack.target.address]

    def inject(self):
        self.h.stack.target.kill()

    def heal(self):
        self.h.stack.target.start()
        self.h.stack.target.wait_ready(120)


class KillOrchestrator(Fault):
    def prepare(self):
        self.victims = ["orchestrator"]
        self.victim_addresses = [self.h.stack.address]

    def inject(self):
        self.h.stack.orchestrator.kill()

    def heal(self):
        self.h.stack.start_orchestrator()


class RedisRestart(Fault):
    def prepare(self):
        self.victims = ["redis"]
        self.victim_addresses = [self.h.stack.redis.url]

    def inject(self):
        self.h.stack.redis.stop()  # SIGTERM: Redis writes its AOF and exits; the port is free

    def heal(self):
        self.h.stack.redis.start()


FAULTS = {"kill_draft": KillDraft, "kill_all_drafts": KillAllDrafts, "hang_draft": HangDraft,
          "slow_draft": SlowDraft, "kill_target": KillTarget, "kill_orchestrator": KillOrchestrator,
          "redis_restart": RedisRestart}


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
        self.fault = FAULTS[name](h, self.rng)
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
            tl.settled_ok = self.fault.settle(timeout=20.0)
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
                    and sum(self._issued.values()) >= self.opts.requests):
                return None
            self._issued[phase] += 1
            rec = RequestRecord(len(self.records), len(self.records) % len(self.h.prompts), phase)
            self.records.append(rec)
            return rec.index, phase

    def run(self) -> dict:
        o = self.opts
        tl = self.timeline
        self.fault.prepare()
        post_n = o.post_heal_requests or max(2, o.concurrency)
        expected = o.requests * o.max_new_tokens
        trigger = int(self.rng.uniform(*o.trigger_frac) * expected)
        fault_s = self.rng.uniform(*o.fault_s)
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
                    run_request(client, self.h.prompts[rec.prompt_index], rec, o.max_new_tokens, request_deadline,
                                self.progress)
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

    def result(self, fault_s: float, trigger: int) -> dict:
        o, tl, h = self.opts, self.timeline, self.h
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
        gaps = [(t, g, r.index) for r in recs for t, g in r.gaps_ms]
        max_stall = max((g for _, g, _ in gaps), default=0.0)
        window = [(t, g, i) for t, g, i in gaps if tl.injected is not None and t >= tl.injected
                  and (tl.settled is None or t - g / 1e3 <= tl.settled)]
        lat = [r.latency_ms for r in completed]
        # The target's own Verify time over the requests that overlapped the fault window.
        overlap = [r for r in recs if tl.injected is not None and r.end >= tl.injected
                   and r.start <= (tl.settled or r.start)] or recs
        v_ms = sum(float(r.stats.get("verify_ms", 0.0) or 0.0) for r in overlap)
        v_n = sum(int(r.stats.get("verify_steps", 0) or 0) for r in overlap)
        bound = h.stall_bound(v_ms / v_n if v_n else h.baseline["target_step_ms"])
        store_bad, store_notes = self._store_check()
        serving = self._healed_replica_serving(post)
        end = max((r.end for r in recs), default=time.monotonic())
        out = {
            "scenario": self.name,
            "requests": len(recs),
            "completed": len(completed),
            "failed": len(failed),
            "mismatched_tokens": mism,
            "duplicated_or_lost_offsets": sum(r.offset_errors for r in recs),
            "store_mismatches": store_bad,
            "fallback_steps": totals["fallback_steps"],
            "speculation_resumed": resumed,
            "max_stall_ms": round(max_stall, 1),
            "stall_bound_ms": bound["bound_ms"] if self.name in DRAFT_FAULTS else None,
            "stall_bound": bound if self.name in DRAFT_FAULTS else None,
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
            "fault": {"victims": self.fault.victims, "trigger_tokens": trigger, "hold_s": round(fault_s, 2),
                      "injected_at_s": tl.rel(tl.injected), "heal_started_at_s": tl.rel(tl.heal_started),
                      "healed_at_s": tl.rel(tl.healed), "settled_at_s": tl.rel(tl.settled),
                      "settled": tl.settled_ok,
                      "outage_s": round(tl.healed - tl.injected, 2) if tl.healed and tl.injected else None,
                      "error": tl.error},
            "config": {"seed": o.seed, "quick": o.quick, "concurrency": o.concurrency,
                       "max_new_tokens": o.max_new_tokens, "draft_replicas": len(h.stack.drafts),
                       "draft_timeout_floor_ms": o.draft_timeout_floor_ms,
                       "draft_timeout_factor": o.draft_timeout_factor, "breaker_open_s": o.breaker_open_s,
                       "target_grace_s": o.target_grace_s, "store_grace_s": o.store_grace_s,
                       "fallback_chunk": o.fallback_chunk, "slow_latency_ms": o.slow_latency_ms,
                       "target_model": o.target_model, "draft_strategy": h.stack.draft_strategy},
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
        out["ok"] = all(out["checks"].values())
        return out


def checks(res: dict) -> dict[str, bool]:
    """The outcomes each scenario must show (docs/chaos.md, tests/test_chaos.py)."""
    name = res["scenario"]
    c = {
        "all_completed": res["completed"] == res["requests"] and res["failed"] == 0,
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
    elif name == "redis_restart":
        c["in_flight_never_broken"] = res["resumes"] == 0
        c["within_store_grace"] = (res["fault"]["outage_s"] or 1e9) < res["config"]["store_grace_s"]
    elif name == "kill_orchestrator":
        c["fault_exercised"] = res["resumes"] > 0
    return c


def run_scenarios(names: list[str], opts: ChaosOptions, emit=None) -> list[dict]:
    """Run scenarios on one shared stack (or one stack each with opts.fresh_stack); emit(result) per scenario."""
    results = []
    harness = None
    try:
        for name in names:
            if harness is None or opts.fresh_stack:
                if harness is not None:
                    harness.stop()
                harness = ChaosHarness(opts).start()
            try:
                res = harness.run(name)
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


__all__ = ["ChaosHarness", "ChaosOptions", "Scenario", "checks", "run_scenarios"]
