"""Faults on the target side, and sampled load under draft faults:

* slow_target: the target sleeps `--inject-latency-ms` in every Verify and Decode (SIGUSR1 turns it on and off);
* hang_target: SIGSTOP the target, SIGCONT it after the hold (shorter than the orchestrator's target grace);
* sampling_draft_faults: temperature 1 load (a fixed prompt, one seed per request) while one draft replica is hung
  and the other killed; the first tokens of every request must follow the target's own distribution (chi-square).

The scenarios (chaos/scenarios.py) call these like the faults of chaos/faults.py; `judge` adds each one's figures
and checks to the result.
"""

from __future__ import annotations

import json
import signal
import statistics
import threading

from chaos.harness import ChaosHarness

SAMPLING = {"temperature": 1.0, "top_k": 6, "top_p": 0.95}
SAMPLED_TOKENS = 2          # the joint distribution of a request's first tokens is tested (<= 6 x 6 outcomes)
SAMPLE_MAX_NEW_TOKENS = 8   # a sampled request: several steps, so fault paths run mid-request too
SAMPLES = {True: 320, False: 1200}  # requests at least, quick / full
ALPHA = 1e-3                # a correct system fails a check at random once in 1000 runs
MIN_WINDOW_SAMPLES = 80     # the fault-window subset is tested on its own when it has this many


class TargetSideFault:
    """The interface of chaos.faults.Fault (not imported: chaos.faults registers these)."""

    min_requests = 0
    min_hold_s = 0.0
    data_loss_allowed = False

    def stall_bound_ms(self) -> float | None:
        return None  # set by judge() from the measured terms

    def details(self) -> dict:
        return {}

    @staticmethod
    def checks(res: dict) -> dict[str, bool]:
        return {}

    def __init__(self, h: ChaosHarness, rng):
        self.h = h
        self.rng = rng
        self.in_flight = lambda: []
        self.victims: list[str] = []
        self.victim_addresses: list[str] = []

    def prepare(self) -> None:
        self.victims = ["target"]
        self.victim_addresses = [self.h.stack.target.address]

    def settle(self, timeout: float) -> bool:
        return True

    def stream_args(self, rec) -> dict:
        return {}

    def judge(self, res: dict, records: list, timeline) -> None:
        pass


def _gaps_ms(records: list, since: float, until: float) -> list[float]:
    """Gaps between a stream's messages (after its first, which also holds the prefill) that ended in [since, until]."""
    if since is None or until is None:
        return []
    return [g for r in records for t, g in r.gaps_ms[1:] if since <= t <= until]


def _target_checks(res: dict, records: list, timeline, extra_ms: float, name: str) -> None:
    """Stall bound extra_ms + M x S (S: the longest fault-free loop step, scaled by host contention)."""
    terms = res["stall_bound"]
    bound = round(extra_ms + terms["steps"] * terms["step_ms"], 1)
    res["stall_bound_ms"] = bound
    res["stall_bound"] = {**terms, "bound_ms": bound, "fault_ms": round(extra_ms, 1)}
    window = _gaps_ms(records, since=timeline.injected, until=timeline.heal_started)
    res["fault_window_gap_p95_ms"] = round(sorted(window)[int(0.95 * (len(window) - 1))], 1) if window else None
    c = res["checks"]
    c["streams_never_broken"] = res["resumes"] == 0 and res["retried_requests"] == 0
    c["stall_within_bound"] = res["max_stall_ms"] <= bound
    res["checks_explained"] = {**res.get("checks_explained", {}), "stall_within_bound": f"{name}: {extra_ms:.0f} ms "
                               f"+ {terms['steps']} x {terms['step_ms']} ms"}


def delayed_calls(proc) -> int:
    """How many calls the target had delayed by its last latency toggle (its log line says)."""
    count = 0
    try:
        for line in proc.log_path.read_text(errors="replace").splitlines():
            if "injected latency toggled" in line:
                try:
                    count = int(json.loads(line).get("delayed_calls", 0))
                except ValueError:
                    pass
    except OSError:
        pass
    return count


class SlowTarget(TargetSideFault):
    """Every Verify and Decode sleeps L ms: streams slow down and go on; nothing fails over or breaks."""

    def inject(self):
        self.h.set_target_latency(True)

    def heal(self):
        self.h.set_target_latency(False)
        self.delayed_calls = delayed_calls(self.h.stack.target)

    def judge(self, res, records, timeline):
        lat = self.h.opts.slow_target_ms
        # A message may wait for two slowed target calls (a Verify, then a Decode after a failed draft or a resync).
        _target_checks(res, records, timeline, 2 * lat, "two slowed target calls")
        c = res["checks"]
        # The target slept in calls (its log says how many), and a stream waited at least that long meanwhile.
        res["target_delayed_calls"] = getattr(self, "delayed_calls", 0)
        c["fault_exercised"] = res["target_delayed_calls"] > 0 and res["max_stall_in_fault_window_ms"] >= lat
        # Throughput resumes: a still-slowed target makes every loop step take at least L, however many clients
        # share it, so the post-heal streams' median step (the gaps after each stream's first message) is below L.
        # (A request's whole latency is no measure: with 32 clients it is mostly queueing.)
        gaps = sorted(g for r in records if r.phase == "post_heal" and r.completed for _, g in r.gaps_ms[1:])
        res["post_heal_step_p50_ms"] = round(statistics.median(gaps), 1) if gaps else None
        res["slowed_step_min_ms"] = lat
        c["throughput_resumed"] = bool(gaps) and statistics.median(gaps) < lat


class HangTarget(TargetSideFault):
    """SIGSTOP: the target's connections stay open and its calls wait (their deadline is the target grace)."""

    def inject(self):
        self.h.stack.target.signal(signal.SIGSTOP)

    def heal(self):
        self.h.stack.target.signal(signal.SIGCONT)

    def judge(self, res, records, timeline):
        outage_ms = (res["fault"]["outage_s"] or 1e6) * 1e3
        _target_checks(res, records, timeline, outage_ms, "the hang")
        c = res["checks"]
        c["within_target_grace"] = outage_ms / 1e3 < res["config"]["target_grace_s"]
        c["fault_exercised"] = res["max_stall_in_fault_window_ms"] >= 0.9 * outage_ms  # a stream waited it out


def exact_first_tokens(target_model: str, prompt: list[int], n: int = SAMPLED_TOKENS) -> dict:
    """P(first n generated tokens) under the target with SAMPLING (top-k keeps the support small)."""
    import torch

    from specdec.core.sampling import SamplingParams, warp_probs
    from specdec.models import load_model

    model = load_model(target_model, device="cpu", dtype="float32").model
    params = SamplingParams(**SAMPLING)
    out = {(): 1.0}
    with torch.no_grad():
        for _ in range(n):
            prefixes = list(out)
            ids = torch.tensor([prompt + list(p) for p in prefixes])
            probs = warp_probs(model(input_ids=ids).logits[:, -1, :], params)
            out = {p + (t,): out[p] * float(probs[i, t]) for i, p in enumerate(prefixes)
                   for t in range(probs.shape[-1]) if probs[i, t] > 0}
    return out


class SamplingDraftFaults(TargetSideFault):
    """Temperature 1 load; one replica hung (timeouts) and the other killed (unavailable): the steps run on the fault
    paths (draft timeouts, target-only fallback, fail-over, the restarted replica's rebuild), and the output must
    still be the target's distribution. Greedy identity is not defined here, and seeded identity does not hold by
    design: the target's coins are drawn per step (seed, step, "verify" or "decode") and which tokens a step
    accepts depends on the draft, so the same seed gives other tokens with other drafts; the check is statistical."""

    def __init__(self, h, rng):
        super().__init__(h, rng)
        self.min_requests = SAMPLES[h.opts.quick]
        self.prompt = h.prompts[0]

    def prepare(self):
        drafts = self.h.stack.drafts
        self.hung = self.rng.randrange(len(drafts))
        self.killed = [i for i in range(len(drafts)) if i != self.hung]
        self.victims = [drafts[i].name for i in [self.hung, *self.killed]]
        self.victim_addresses = [drafts[i].address for i in [self.hung, *self.killed]]
        self.expected = exact_first_tokens(self.h.opts.target_model, self.prompt)

    def stream_args(self, rec):
        return {"prompt": self.prompt, "max_new_tokens": SAMPLE_MAX_NEW_TOKENS, "seed": rec.index, **SAMPLING}

    def inject(self):
        drafts = self.h.stack.drafts
        drafts[self.hung].signal(signal.SIGSTOP)
        for i in self.killed:
            drafts[i].kill()

    def heal(self):
        # The hung one first: sessions fail over to it while the killed ones restart (minutes of fault paths).
        self.h.stack.drafts[self.hung].signal(signal.SIGCONT)
        threads = [threading.Thread(target=self.h.restart_draft, args=(i,)) for i in self.killed]
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)

    def settle(self, timeout):
        return self.h.wait_breakers(timeout, ("closed",))

    def judge(self, res, records, timeline):
        from tests.stats import chi_square_test  # the project's chi-square harness (merged bins, exact p)

        def p_value(recs):
            samples = [tuple(r.tokens[:SAMPLED_TOKENS]) for r in recs if r.completed]
            return (round(chi_square_test(samples, self.expected)[1], 6), len(samples)) if samples else (None, 0)

        # Not comparable with greedy references: the figure says so instead of counting nonsense mismatches.
        res["mismatched_tokens"] = None
        res["checks"].pop("no_mismatched_tokens", None)
        lo, hi = timeline.injected, timeline.settled
        in_window = [r for r in records if lo is not None and hi is not None and r.start >= lo and r.start <= hi]
        p_all, n_all = p_value(records)
        p_win, n_win = p_value(in_window)
        on_fault_paths = [r for r in records if r.stats.get("fallback_steps") or r.stats.get("draft_failures")
                          or r.stats.get("replica_failovers")]
        p_paths, n_paths = p_value(on_fault_paths)
        res["distribution"] = {
            "sampling": SAMPLING, "tokens_tested": SAMPLED_TOKENS, "alpha": ALPHA, "outcomes": len(self.expected),
            "p_value": p_all, "samples": n_all, "fault_window_p_value": p_win, "fault_window_samples": n_win,
            "fault_path_p_value": p_paths, "fault_path_samples": n_paths,
            "distinct_outputs": len({tuple(r.tokens) for r in records if r.completed}),
        }
        c = res["checks"]
        c["streams_never_broken"] = res["resumes"] == 0 and res["retried_requests"] == 0
        c["fault_exercised"] = res["fallback_steps"] > 0 and res["draft_failures"] + res["replica_failovers"] > 0
        res["stall_bound_ms"] = res["stall_bound"]["bound_ms"]  # the draft faults' bound (docs/chaos.md)
        c["stall_within_bound"] = res["max_stall_ms"] <= res["stall_bound_ms"]
        # 8-token requests: one draft call that misses its deadline on a busy host (its breaker opens for a second)
        # makes a whole request two target-only chunks, so not every post-heal request must verify drafts: three in
        # four, with tokens accepted.
        post = [r for r in records if r.phase == "post_heal"]
        verified = sum(int(r.stats.get("verify_steps", 0) or 0) > 0 for r in post)
        res["post_heal_verified_share"] = round(verified / len(post), 3) if post else 0.0
        res["speculation_resumed"] = (bool(post) and all(r.completed for r in post)
                                      and res["post_heal_verified_share"] >= 0.75 and res["post_heal_accepted_tokens"] > 0)
        c["speculation_resumed"] = res["speculation_resumed"]
        c["target_distribution"] = p_all is not None and n_all >= self.min_requests and p_all > ALPHA
        # The requests run while the fault lasted, and those that ran on a fault path, each tested on their own.
        c["target_distribution_in_fault_window"] = n_win < MIN_WINDOW_SAMPLES or p_win > ALPHA
        c["target_distribution_on_fault_paths"] = n_paths < MIN_WINDOW_SAMPLES or p_paths > ALPHA
        c["fault_paths_sampled"] = n_paths > 0


TARGET_FAULTS = {"slow_target": SlowTarget, "hang_target": HangTarget, "sampling_draft_faults": SamplingDraftFaults}
TARGET_SCENARIOS = tuple(TARGET_FAULTS)
