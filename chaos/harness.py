"""The stack a chaos run works on: a real LocalStack (Redis, target, >= 2 draft replicas, orchestrator) on
loopback, the run's options, and the target-only greedy reference every streamed reply is compared with."""

from __future__ import annotations

import json
import random
import signal
import statistics
import threading
import time
from dataclasses import dataclass

import grpc

from chaos.load import run_batch
from specdec.client import SpecdecClient
from launcher.stack import LocalStack, ServiceProcess, StackConfig


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
    requests: int = 96                 # phase-1 requests at least (the load keeps going until the heal settles)
    max_new_tokens: int = 64
    concurrency: int = 32
    time_limit_s: float = 180.0        # per scenario: no request is started after it
    seed: int = 0
    quick: bool = False
    post_heal_requests: int = 0        # 0: max(2, concurrency)
    fault_s: tuple = (2.0, 4.0)        # seeded fault duration range (before the heal starts)
    trigger_frac: tuple = (0.1, 0.3)   # seeded: inject after this fraction of phase 1's expected tokens
    prompts: int = 32                  # the baseline runs one request per prompt: as many as the concurrency
    extension_think_s: float = 0.0     # pause between a worker's requests once `requests` were issued
    target_model: str = TINY_TARGET
    draft_strategy: str = "model"
    draft_model: str = TINY_DRAFT
    draft_replicas: int = 2
    target_replicas: int = 1           # kill_target_pool runs with 2 (chaos/target_pool.py)
    draft_len: int = 4
    engine: str = "torch"              # the target's engine (llamacpp needs a GGUF target such as smollm2)
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
    speculation_max_sessions: int | None = None  # None: the stack's default (launcher/stack.py)
    slow_latency_ms: float = 300.0     # slow_draft: per-Propose latency, well above the draft deadline
    slow_target_ms: float = 300.0      # slow_target: per-Verify/Decode latency, armed by the target's flag
    stall_steps: float = 0.0           # M in the stall bound; 0: fallback_chunk + 2
    log_dir: str | None = None
    fresh_stack: bool = False

    @classmethod
    def quick_preset(cls, **overrides) -> "ChaosOptions":
        base = dict(requests=16, max_new_tokens=48, concurrency=8, time_limit_s=90.0, fault_s=(0.6, 1.2),
                    prompts=8, extension_think_s=0.5, quick=True)
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
        self.target_latency_on = False        # the target's injected latency (slow_target), off at start
        self._log_offsets: dict[str, int] = {}
        self.proxies: dict = {}  # link name -> the FaultProxy the orchestrator reaches it through (faults_network)

    # -- the stack ---------------------------------------------------------------------------------

    def start(self) -> "ChaosHarness":
        o = self.opts
        orch = ["--draft-timeout-floor-ms", str(o.draft_timeout_floor_ms),
                "--draft-timeout-factor", str(o.draft_timeout_factor), "--breaker-open-s", str(o.breaker_open_s),
                "--target-grace-s", str(o.target_grace_s), "--store-grace-s", str(o.store_grace_s),
                "--fallback-chunk", str(o.fallback_chunk)]
        if o.speculation_max_sessions is not None:  # later on the orchestrator's command line than the stack's
            orch += ["--speculation-max-sessions", str(o.speculation_max_sessions)]
        cfg = StackConfig(target_model=o.target_model, draft_strategy=o.draft_strategy, draft_model=o.draft_model,
                          draft_replicas=o.draft_replicas, target_replicas=o.target_replicas,
                          draft_len=o.draft_len, adaptive_draft_len=False,
                          store="redis", engine=o.engine, threads=o.threads,
                          device=o.device, dtype=o.dtype, orchestrator_args=orch,
                          draft_args=["--inject-latency-ms", str(o.slow_latency_ms)],
                          target_args=["--inject-latency-ms", str(o.slow_target_ms)])  # armed, off until SIGUSR1
        self.stack = LocalStack(cfg, o.log_dir).start(timeout=300)
        self.latency_flag = [True] * len(self.stack.drafts)
        self.latency_on = [True] * len(self.stack.drafts)  # a replica starts with its injected latency on
        for i in range(len(self.stack.drafts)):
            self.set_latency(i, False)
        self._make_prompts()
        self._measure()
        return self

    def add_targets(self, opts: ChaosOptions) -> None:
        """Grow the running stack to opts.target_replicas targets (kill_target_pool) and restart the orchestrator
        on its port with all of them: two service starts instead of a new stack's five, on a small host tens of
        seconds. Redis and the drafts stay; the references and the baseline are measured again on the pool."""
        s = self.stack
        new = [s.add_target() for _ in range(len(s.targets), opts.target_replicas)]
        for t in new:
            t.wait_ready(300)
        s.cfg.target_replicas = len(s.targets)
        # The network scenarios routed the orchestrator to the first target and Redis through proxies (the
        # --target/--redis they appended win over the stack's own): the pool reaches every target directly.
        args = s.cfg.orchestrator_args
        while "--target" in args or "--redis" in args:
            i = args.index("--target") if "--target" in args else args.index("--redis")
            del args[i:i + 2]
        for p in self.proxies.values():
            p.close()
        self.proxies = {}
        s.orchestrator.stop()
        s.start_orchestrator()
        self.opts = opts
        self.ensure_healthy()
        self._measure()

    def stop(self) -> None:
        if self.stack is not None:
            s = self.stack
            for d in [*s.drafts, *s.targets]:
                d.signal(signal.SIGCONT)
            procs = [p for p in [s.orchestrator, *s.drafts, *s.targets] if p is not None]
            threads = [threading.Thread(target=p.stop, daemon=True) for p in procs]  # in parallel: faster
            for t in threads:
                t.start()
            for t in threads:
                t.join(30)
            s.stop()  # anything left, and Redis
            self.stack = None
        for p in self.proxies.values():
            p.close()
        self.proxies = {}

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
        self._toggle_latency(proc, on, timeout)
        self.latency_on[i] = on

    def _toggle_latency(self, proc: ServiceProcess, on: bool, timeout: float) -> None:
        """SIGUSR1 to proc, then wait until its log confirms the new state."""
        before = len(self._log_toggles(proc))
        proc.signal(signal.SIGUSR1)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            toggles = self._log_toggles(proc)
            if len(toggles) > before:
                if toggles[-1] != on:
                    raise RuntimeError(f"{proc.name}: latency toggled to {toggles[-1]}, wanted {on}")
                return
            time.sleep(0.05)
        raise TimeoutError(f"{proc.name} did not confirm the latency toggle within {timeout} s")

    def set_target_latency(self, on: bool, timeout: float = 10.0) -> None:
        """Toggle the target's injected Verify/Decode latency with SIGUSR1; wait until its log confirms it."""
        if self.target_latency_on == on:
            return
        self._toggle_latency(self.stack.target, on, timeout)
        self.target_latency_on = on

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

    def wait_speculating(self, timeout: float) -> bool:
        """Until a short request is verified speculatively without a draft failure and every breaker is closed."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                with SpecdecClient(self.address) as c:
                    st = c.generate(self.prompts[0], max_new_tokens=8, ignore_eos=True, timeout_s=10).stats
                if st.get("verify_steps", 0) > 0 and not st.get("draft_failures") and self.wait_breakers(
                        max(0.0, deadline - time.monotonic()), ("closed",)):
                    return True
            except grpc.RpcError:
                pass
            time.sleep(0.2)
        return False

    def ensure_healthy(self) -> None:
        """Heal anything a previous scenario left broken, so scenarios can share the stack."""
        s = self.stack
        for p in self.proxies.values():
            p.heal()
        if s.redis.proc is None or s.redis.proc.poll() is not None:
            s.redis.start()
        for d in [*s.drafts, *s.targets]:
            d.signal(signal.SIGCONT)
        for t in s.targets:
            if not t.alive():
                self.target_latency_on = False  # a restarted target starts with its latency off
                t.restart()
        for i, d in enumerate(s.drafts):
            if not d.alive():
                self.restart_draft(i)
        for i in range(len(s.drafts)):
            if self.latency_on[i]:
                self.set_latency(i, False)
        if self.target_latency_on:
            self.set_target_latency(False)
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
        """The longest draft deadline the orchestrator gives a call here (orchestrator/loop/draft_call.py: DraftCall.timeout_s): max(floor,
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
