"""The speculative loop: draft proposes, target verifies, the orchestrator commits and stores each block.

One step:  tokens = draft.propose(k)  ->  (n, next) = target.verify(tokens)  ->  commit tokens[:n] + [next]
If the draft fails (error, deadline, malformed reply) the step decodes target-only instead, so the output
never depends on the draft; only the speed does.
"""

from __future__ import annotations

import contextvars
import dataclasses
import logging
import math
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from orchestrator import metrics
from orchestrator.clients import TargetClient
from orchestrator.draft_length import (AcceptancePrior, AdaptiveLength, DraftCost, DraftEvidence, Ema, TargetCost,
                                       make_draft_length)
from orchestrator.draft_pool import DraftPool
from orchestrator.local_draft import is_local
from orchestrator.session_store import LeaseLost, SessionRecord, StoreUnavailable
from orchestrator.text import TextTracker
from specdec import observability as telemetry
from specdec.core import wire
from specdec.core.sampling import SamplingParams
from specdec.v1 import orchestrator_pb2 as opb

log = logging.getLogger("specdec.orchestrator")

FINISH_LENGTH = opb.FINISH_REASON_LENGTH
FINISH_EOS = opb.FINISH_REASON_EOS
FINISH_STOP = opb.FINISH_REASON_STOP
FINISH_CANCELLED = opb.FINISH_REASON_CANCELLED

COUNTERS = ("verify_steps", "draft_tokens_proposed", "draft_tokens_accepted", "fallback_steps", "fallback_tokens",
            "draft_failures", "decode_steps", "replica_failovers", "target_resyncs", "pipeline_prefetches",
            "pipeline_hits", "load_shed_steps", "speculation_paused_steps", "draft_tokens_trimmed",
            "parallel_prefills", "kv_imports")
TIMERS = ("draft_ms", "verify_ms", "wall_ms", "degraded_ms", "decode_ms", "prefill_ms", "rpc_overhead_ms", "store_ms",
          "prefetch_wait_ms", "store_overlapped_ms")
STOPPABLE_DRAFTS = ("model", "quantized")  # draft strategies whose Propose stops when the call is cancelled


def _stoppable(replica) -> bool:
    return replica.info is not None and replica.info.strategy in STOPPABLE_DRAFTS


class GenerationError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass
class LoopConfig:
    default_draft_len: int = 4
    max_draft_len: int = 16
    adaptive_draft_len: bool = False   # per-session draft length (see orchestrator/draft_length.py)
    draft_len_policy: str = "goodput"  # adaptive: goodput (measured costs) | heuristic (transformers' +2/-1)
    pipeline: str = "off"              # off | on | auto (prefetch when the measured saving beats its cost)
    pipeline_min_gain_ms: float = 1.0  # auto: what a prefetch must save on average (about one extra RPC's cost)
    pipeline_max_sessions: int = 2     # auto: no prefetching while more sessions generate (0 = no limit)
    draft_prefill: str = "target-kv"   # target-kv: an int8-copy draft takes the target's prompt KV | own
    speculation_max_sessions: int = 0  # above this many generating sessions, decode target-only (0 = no limit)
    draft_min_confidence: float = 0.0  # the draft stops early when its top probability falls below (llama.cpp p-min)
    fallback_chunk: int = 4            # tokens per target-only Decode call (degraded or speculation off)
    draft_timeout_floor_ms: float = 100.0
    draft_timeout_factor: float = 2.0  # x the measured target step: a slower draft is no help
    draft_first_call_timeout_ms: float = 5000.0  # a replica's first call per session prefills the prompt
    target_timeout_s: float = 30.0
    target_grace_s: float = 30.0       # how long a step waits for a dead target to come back
    store_grace_s: float = 10.0        # how long a step waits for the session store to come back
    tree_budget: int = 0               # tree speculation: draft a token tree of this many nodes (0 = chain)
    tree_branch: int = 0               # children of an uncertain tree node (0 = the draft's default, 2)
    tree_branch_below: float = 0.0     # a tree node is uncertain below this draft top probability (0 = default)


@dataclass
class Chunk:
    tokens: list[int]
    text: str
    offset: int
    finish_reason: int = 0


class AcceptanceWindow:
    """Acceptance over the orchestrator's most recent verify steps (all sessions), for the outline and metrics."""

    def __init__(self, max_steps: int = 1000):
        self.max_steps = max_steps
        self._steps = deque(maxlen=max_steps)
        self._lock = threading.Lock()

    def add(self, proposed: int, accepted: int) -> None:
        with self._lock:
            self._steps.append((proposed, accepted))

    def snapshot(self) -> dict:
        with self._lock:
            steps = list(self._steps)
        proposed = sum(p for p, _ in steps)
        accepted = sum(a for _, a in steps)
        return {"steps": len(steps), "window_steps": self.max_steps, "proposed": proposed, "accepted": accepted,
                "acceptance_rate": accepted / proposed if proposed else None,
                "mean_accepted_length": (accepted + len(steps)) / len(steps) if steps else None}


class StepTimer(Ema):
    """EMA of a step's duration: the target forward (shared by all sessions; it sets the draft deadline) or a
    session's Propose round trip (what a prefetch saves). 0 until measured."""

    @property
    def ms(self) -> float:
        return self.get(0.0)


def _valid_distributions(msgs, vocab_size: int) -> bool:
    """The same checks the target applies (wire.decode_distribution): a draft is never trusted blindly."""
    try:
        for m in msgs:
            wire.decode_distribution(m, vocab_size)
    except ValueError:
        return False
    return True


@dataclass
class Generation:
    rec: SessionRecord
    target: TargetClient
    pool: DraftPool | None
    tokenizer: object
    eos_ids: set[int]
    vocab_size: int
    cfg: LoopConfig
    cancel: threading.Event = field(default_factory=threading.Event)
    window: AcceptanceWindow | None = None
    target_step: StepTimer = field(default_factory=StepTimer)
    active_sessions: Callable[[], int] | None = None  # generations running in this orchestrator (load switch)
    target_cost: TargetCost | None = None  # the target's measured step costs (goodput draft length)
    acceptance_prior: AcceptancePrior | None = None  # all sessions' acceptance (goodput draft length)
    lease: str = ""  # this stream's session lease token: every write is fenced by it (session_store.py)
    draft_evidence: DraftEvidence | None = None  # what the drafter's token scores mean (goodput draft length)
    draft_cost: DraftCost = field(default_factory=DraftCost)  # shared by the orchestrator's sessions
    target_kv_fingerprint: str = ""  # ModelInfo.kv_fingerprint of the target: drafts with the same take its KV

    def __post_init__(self):
        p = self.rec.params
        self.params = SamplingParams(p["temperature"], p["top_k"], p["top_p"])
        self.seed = int(p["seed"])
        self.stop_ids = set(p["stop_token_ids"]) | (set() if p["ignore_eos"] else self.eos_ids)
        self.text = TextTracker(self.tokenizer, p["stop"])
        for key in COUNTERS:
            self.rec.stats.setdefault(key, 0)
        for key in TIMERS:
            self.rec.stats.setdefault(key, 0.0)
        self.rec.stats.setdefault("draft_failures_by_kind", {})
        start = int(p["max_draft_len"]) or self.cfg.default_draft_len
        # A per-request max_draft_len is a fixed length; the server default may adapt.
        self.draft_len: AdaptiveLength = make_draft_length(
            start, self.cfg.max_draft_len,
            self.cfg.adaptive_draft_len and not int(p["max_draft_len"]) and not self.cfg.tree_budget,  # chains only
            self.cfg.draft_len_policy, self.target_cost, self.acceptance_prior, self.draft_evidence,
            self.cfg.fallback_chunk, self.draft_cost)
        self.step_server_ms: float | None = None  # the target's time in this step, if it was a plain one
        self.step_draft_ms = 0.0  # the Propose call's wall time in this step (goodput costs drafting apart)
        self.prefetched = None        # a draft block ready for the current context (pipelining)
        self.prefetched_for = None    # (committed length, replica address) it is valid for
        self.pending_prefetch = None  # (future, replica, verified block, committed length then, block accepted whole)
        self.last_block_full = True
        self.full_block_rate = 1.0    # EMA of "the whole block was accepted": how often a prefetch is usable
        self.propose_time = StepTimer()  # Propose round trips: what a usable prefetch saves

    # -- the draft side ----------------------------------------------------------------------------

    def _wants_draft(self) -> bool:
        return self.pool is not None and bool(self.rec.params["speculation"])

    def _overloaded(self) -> bool:
        """Under high load a batched target is compute-bound: a verify of k+1 tokens per session costs more than
        the accepted tokens save, so decode target-only (vLLM's speculative_disable_by_batch_size)."""
        limit = self.cfg.speculation_max_sessions
        return limit > 0 and self.active_sessions is not None and self.active_sessions() > limit

    def _draft_timeout_s(self, k: int = 1) -> float:
        """A draft slower per token than the target's own step is no help: the deadline allows k tokens at the
        draft's measured time per token, each capped at the measured target step, and at least one target step
        (a draft model nearly the target's size, like its own weights in int8, needs several steps for a long
        block). A call that must first prefill the context (new session, failover, probe) gets time in proportion:
        the drafts' measured prefill time per context token (as slow as the target's own for a draft of its size;
        capped at a target step), or the first-call deadline until one was measured; so does every call until a
        draft token's time was."""
        first_call = self.cfg.draft_first_call_timeout_ms
        if self.target_step.ms == 0:  # nothing measured yet
            return first_call / 1e3
        step = self.target_step.ms
        sessions = self._sessions()
        if self.target_cost is not None and self.target_cost.forward_ms:
            # Under load a target-only token waits for a forward batched with the other sessions' blocks: the
            # Decode-measured step (rare while speculating, maybe from a quieter time) understates it.
            step = max(step, self.target_cost.step_ms(1, self.target_cost.rows()))
        factor = self.cfg.draft_timeout_factor
        per_token = self.draft_cost.deadline_per_token(sessions)
        if per_token is None and self.rec.draft_pos > 0:  # a fresh orchestrator
            return max(first_call, factor * step) / 1e3
        budget = factor * max(step, k * min(step, per_token or 0.0))
        if self.rec.draft_pos == 0:
            ctx = len(self.rec.committed)
            per_token = self.draft_cost.per_prefill_token(sessions)
            if per_token is None:
                return max(first_call, budget * (1 + ctx / 128)) / 1e3
            # capped like a drafted token: a draft slower per context token than a target step is no help
            budget = max(budget * (1 + ctx / 128), budget + factor * ctx * min(step, per_token))
        return max(self.cfg.draft_timeout_floor_ms, budget) / 1e3

    def _sessions(self) -> int:
        """Generations running in this orchestrator now: they share the draft (DraftCost keeps costs per session)."""
        return max(1, int(self.active_sessions())) if self.active_sessions is not None else 1

    def _pick_replica(self):
        rec = self.rec
        replica = self.pool.pick(rec.session_id)
        if replica is None:
            return None
        if replica.address != rec.draft_replica:
            if rec.draft_replica:
                rec.stats["replica_failovers"] += 1
                metrics.record_failover()
                log.info("draft failover", extra={"session_id": rec.session_id, "from": rec.draft_replica,
                                                  "to": replica.address})
            rec.draft_replica, rec.draft_pos = replica.address, 0  # the new replica rebuilds from token 0
        return replica

    def _count_overhead(self, t0: float, service_ms: float, stat: str = "rpc_overhead_ms") -> float:
        """Count a call's round trip since ``t0`` less the time its service reported working (the wire's and
        gRPC's share) in ``stats[stat]``; return the round trip in ms."""
        wall_ms = (time.perf_counter() - t0) * 1e3
        self.rec.stats[stat] += max(0.0, wall_ms - service_ms)
        return wall_ms

    def _propose(self, replica, k: int, kv=None):
        """Draft k tokens: (reply, False); (None, False) if nothing was drafted; (None, True) if the draft failed.
        kv: the target's KV of the context's first kv.length tokens (a new session, _target_kv)."""
        rec = self.rec
        t0 = time.perf_counter()
        # A call whose draft must first take in more than one block's worth of context (a new session's prompt,
        # the tokens decoded target-only during a pause or a failure) pays for that intake at the drafts' prefill
        # rate; only the rest is what drafting costs. Positions whose KV comes along are not taken in.
        held = max(rec.draft_pos, kv.length if kv is not None else 0)
        prefilled = held == 0
        intake = len(rec.committed) - held
        catching_up = intake > self.cfg.max_draft_len + 1
        timeout_s = self._draft_timeout_s(k)
        try:
            with telemetry.call_attributes(session_id=rec.session_id, k=k, replica=replica.address):
                reply = replica.client.propose(rec.session_id, rec.committed, rec.draft_pos, k, self.params,
                                               self.seed, rec.step, timeout_s, self.cfg.draft_min_confidence,
                                               kv=kv)
        except grpc.RpcError as e:
            kind = "timeout" if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED else e.code().name.lower()
            if kind == "timeout":
                self.draft_cost.timed_out(timeout_s * 1e3, k, intake if prefilled or catching_up else 0,
                                          self._sessions())
            self._draft_failed(replica, kind, e.details())
            return None, True
        if (len(reply.tokens) > k or any(t >= self.vocab_size for t in reply.tokens)
                or (not self.params.is_greedy and len(reply.probs) not in (0, len(reply.tokens)))
                or len(reply.scores) not in (0, len(reply.tokens)) or not all(map(math.isfinite, reply.scores))
                or not _valid_distributions(reply.probs, self.vocab_size)):
            self._draft_failed(replica, "malformed", f"{len(reply.tokens)} tokens, {len(reply.probs)} distributions")
            return None, True
        replica.breaker.success()
        rec.stats["draft_ms"] += reply.draft_ms
        # A Propose carrying the target's KV spends its extra round-trip time moving the prompt's KV (MBs): that is
        # the prefill handover's cost (prefill_ms), not a decoding step's.
        wall_ms = self._count_overhead(t0, reply.draft_ms, "prefill_ms" if kv is not None else "rpc_overhead_ms")
        self.step_draft_ms += wall_ms  # a miss step also waited for its stale prefetch (_resolve_prefetch)
        self.propose_time.observe(wall_ms)
        sessions = self._sessions()
        if prefilled or reply.resynced:  # the draft took in the whole context first
            self.draft_cost.observe_prefill(reply.draft_ms, len(rec.committed), len(reply.tokens), sessions)
        elif not catching_up or self.draft_cost.prefill_token_ms.value is not None:
            # A probe after a pause catches up first: measured too (its intake charged at the prefill rate), else a
            # cost learned in a slow spell would never be measured again and the pause would last.
            intake_ms = intake * self.draft_cost.per_prefill_token(sessions) if catching_up else 0.0
            drafting_ms = max(0.0, reply.draft_ms - intake_ms)
            self.draft_cost.observe(wall_ms - intake_ms, drafting_ms, len(reply.tokens), sessions)
        if not reply.tokens:  # nothing to propose (e.g. no n-gram match): a plain target step
            rec.draft_pos = min(len(rec.committed), reply.cached_len)
            return None, False
        return reply, False

    def _trim_to_verified_prefix(self, reply, limit: int) -> None:
        """Cut a scored draft to the prefix worth verifying (at least one token); an unscored one stays whole."""
        if not reply.scores:
            return
        d = self.draft_len.verify_len(reply.scores, limit)
        if d < len(reply.tokens):
            self.rec.stats["draft_tokens_trimmed"] += len(reply.tokens) - d
            metrics.record_trimmed(len(reply.tokens) - d)
            reply.tokens, reply.scores, reply.probs = reply.tokens[:d], reply.scores[:d], reply.probs[:d]

    def _draft_failed(self, replica, kind: str, detail: str | None) -> None:
        stats = self.rec.stats
        stats["draft_failures"] += 1
        stats["draft_failures_by_kind"][kind] = stats["draft_failures_by_kind"].get(kind, 0) + 1
        # A replica that could not be reached shows in its health checks; one that answers late or wrongly does not.
        replica.breaker.failure(health_blind=kind not in ("unavailable", "prefetch_unavailable"))
        if kind not in ("timeout", "prefetch_deadline_exceeded") or not _stoppable(replica):
            # The replica's state is unknown now: resync from token 0 on the next call. A model draft's timed-out
            # call leaves its session consistent (it stops, and does not touch the session once its caller is
            # gone; the next call crops it to what is committed; a draft that lost it answers with a cache miss
            # and the client resends): re-prefilling the whole context after every late block would only load a
            # busy draft further.
            self.rec.draft_pos = 0
        metrics.record_draft_failure(kind)
        log.warning("draft failed; decoding target-only", extra={
            "session_id": self.rec.session_id, "replica": replica.address, "kind": kind, "detail": detail})

    # -- the target side ---------------------------------------------------------------------------

    def _target_call(self, fn, what: str):
        """Call the target; if it is down, wait (grpc wait_for_ready) up to the grace period for it to return."""
        deadline = time.monotonic() + self.cfg.target_grace_s
        while True:
            try:
                reply = fn(min(self.cfg.target_timeout_s, max(0.05, deadline - time.monotonic())))
                if reply.resynced:
                    self.rec.stats["target_resyncs"] += 1
                return reply
            except grpc.RpcError as e:
                # A target stopping mid-call cancels the call (the client sees CANCELLED): it went away too.
                retryable = e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                                         grpc.StatusCode.CANCELLED)
                if not retryable:
                    raise GenerationError(e.code(), f"target {what} failed: {e.details()}") from e
                if time.monotonic() >= deadline or self.cancel.is_set():
                    raise GenerationError(grpc.StatusCode.UNAVAILABLE,
                                          f"target unavailable for {self.cfg.target_grace_s:.0f} s during {what}: "
                                          f"{e.details()}; the session can be resumed") from e
                log.warning("target unavailable; waiting", extra={"session_id": self.rec.session_id,
                                                                  "code": e.code().name})
                time.sleep(0.1)

    def _verify(self, reply) -> list[int]:
        rec, stats = self.rec, self.rec.stats
        ctx = len(rec.committed)
        t0 = time.perf_counter()
        with telemetry.call_attributes(session_id=rec.session_id, k=len(reply.tokens)):
            v = self._target_call(lambda t: self.target.verify(
                rec.session_id, rec.committed, rec.target_pos, reply.tokens, reply.probs, self.params,
                self.seed, rec.step, t, wait_for_ready=True), "verify")
        self._count_overhead(t0, v.verify_ms)
        if self.target_cost is not None and rec.target_pos == ctx - 1:  # a plain step: last token + the drafts
            self.target_cost.observe(len(reply.tokens) + 1, v.verify_ms)
            self.step_server_ms = v.verify_ms
        rec.target_pos = v.cached_len
        rec.draft_pos = min(ctx + v.num_accepted, reply.cached_len)
        stats["verify_steps"] += 1
        stats["draft_tokens_proposed"] += len(reply.tokens)
        stats["draft_tokens_accepted"] += v.num_accepted
        stats["verify_ms"] += v.verify_ms
        self.draft_len.update(len(reply.tokens), v.num_accepted)
        self.draft_len.observe_evidence(reply.scores, len(reply.tokens), v.num_accepted)
        if self.window is not None:
            self.window.add(len(reply.tokens), v.num_accepted)
        metrics.record_acceptance(len(reply.tokens), v.num_accepted)
        self._observe_target(v.verify_ms)
        return reply.tokens[: v.num_accepted] + [v.next_token]

    def _decode(self, n: int, degraded: bool) -> list[int]:
        rec, stats = self.rec, self.rec.stats
        plain = rec.target_pos == len(rec.committed) - 1  # no prefill or resync in this call
        t0 = time.perf_counter()
        with telemetry.call_attributes(session_id=rec.session_id, n=n, degraded=degraded):
            d = self._target_call(lambda t: self.target.decode(
                rec.session_id, rec.committed, rec.target_pos, n, self.params, self.seed, rec.step,
                sorted(self.stop_ids), t, wait_for_ready=True), "decode")
        self._count_overhead(t0, d.decode_ms)
        if self.target_cost is not None and plain and d.tokens:
            self.target_cost.observe(1, d.decode_ms, calls=len(d.tokens))
            if not degraded:
                self.step_server_ms = d.decode_ms
        rec.target_pos = d.cached_len
        stats["decode_steps"] += 1
        stats["decode_ms"] += d.decode_ms
        if degraded:
            stats["fallback_steps"] += 1
            stats["fallback_tokens"] += len(d.tokens)
            telemetry.record_fallback()
        self._observe_target(d.decode_ms / max(1, len(d.tokens)))
        return d.tokens

    def _observe_target(self, ms: float) -> None:
        self.target_step.observe(ms)

    # -- one step ------------------------------------------------------------------------------------

    def step(self, remaining: int) -> tuple[list[int], bool]:
        """One step: (newly committed tokens before stop handling, whether it ran degraded)."""
        if self._resolve_prefetch():  # the draft failed this step already: no second deadline before falling back
            return self._decode(min(self.cfg.fallback_chunk, remaining), True), True
        k = min(self.draft_len.k, remaining - 1)
        if k <= 0 or not self._wants_draft():
            if self.draft_len.k == 0 and self._wants_draft():  # no draft length pays: target-only for now
                self.rec.stats["speculation_paused_steps"] += 1
                metrics.record_paused()
                self.draft_len.step_taken()
            return self._decode(min(self.cfg.fallback_chunk, remaining), False), False
        if self._overloaded():
            self.rec.stats["load_shed_steps"] += 1
            metrics.record_load_shed()
            return self._decode(min(self.cfg.fallback_chunk, remaining), False), False
        if self.cfg.tree_budget > 0:
            from orchestrator.tree_step import tree_step

            return tree_step(self, remaining)
        replica = self._pick_replica()
        if replica is not None:
            self.draft_len.pipelined = self._pipelines(replica)
            ask = min(self.draft_len.request_len(k), remaining - 1)  # more than k: a scored draft is trimmed
            reply, failed = self._take_prefetched(replica, ask)
            if reply is None:
                kv = self._target_kv(replica)
                prefill = None if kv is not None else self._start_target_prefill(replica)
                reply, failed = self._propose(replica, ask, kv)
                self._finish_target_prefill(prefill)
            if reply is not None:
                self._trim_to_verified_prefix(reply, remaining - 1)
                prefetch = self._start_prefetch(replica, reply, ask)
                new = self._verify(reply)
                self._finish_prefetch(prefetch, replica, reply, new)
                return new, False
            if not failed:
                return self._decode(1, False), False  # nothing drafted: one target token, then draft again
        # Every replica failed or is open: target-only for a few tokens, then try the draft again.
        return self._decode(min(self.cfg.fallback_chunk, remaining), True), True

    # -- a new session's prompt: the target prefills it while the draft does --------------------------

    PARALLEL_PREFILL_MIN_TOKENS = 16  # below this a prefill is cheaper than the extra round trip

    def _start_target_prefill(self, replica):
        """When the draft must first prefill the context (a new session, a new replica) and the target also lags
        behind it, let the target prefill at the same time instead of after the Propose (a draft model as large as
        the target prefills as slowly; they run on different machines). The Verify then carries only the last
        token and the drafts."""
        rec = self.rec
        lag = len(rec.committed) - 1 - rec.target_pos
        if rec.draft_pos != 0 or lag < self.PARALLEL_PREFILL_MIN_TOKENS or is_local(replica.address):
            return None
        rec.stats["parallel_prefills"] += 1
        return self.target.prefill_async(rec.session_id, rec.committed[:-1], rec.target_pos,
                                         self.cfg.target_timeout_s)

    def _target_kv(self, replica):
        """When the draft must take in a long context (a new session, a new replica) and it is the int8 copy of the
        target's own weights (equal kv fingerprints), the target prefills first and hands over its KV: the draft
        installs it instead of prefilling (its int8 prefill costs about twice the target's per token, and under load
        the prompts were half its work). The KvBlock, or None where that does not apply or the target failed (the
        draft then prefills as before)."""
        rec = self.rec
        fingerprint = self.target_kv_fingerprint
        info = replica.info
        if (self.cfg.draft_prefill != "target-kv" or not fingerprint or info is None
                or info.kv_fingerprint != fingerprint or rec.draft_pos != 0
                or len(rec.committed) - 1 < self.PARALLEL_PREFILL_MIN_TOKENS or is_local(replica.address)):
            return None
        t0 = time.perf_counter()
        try:
            with telemetry.call_attributes(session_id=rec.session_id):
                reply = self.target.prefill(rec.session_id, rec.committed[:-1],
                                            min(rec.target_pos, len(rec.committed) - 1), self.cfg.target_timeout_s,
                                            export_kv=True)
        except grpc.RpcError as e:  # the Verify resends what the target lacks; the draft prefills itself
            log.info("target prefill for the draft's KV failed", extra={"session_id": rec.session_id,
                                                                         "code": e.code().name})
            return None
        finally:  # the step waits for it: neither drafting nor verifying (the stats' overhead must not hold it)
            rec.stats["prefill_ms"] += (time.perf_counter() - t0) * 1e3
        self._target_prefilled(reply.cached_len)
        if not reply.HasField("kv") or not 1 <= reply.kv.length < len(rec.committed):
            return None
        rec.stats["kv_imports"] += 1
        return reply.kv

    def _finish_target_prefill(self, future) -> None:
        if future is None:
            return
        try:
            held = future.result().cached_len
        except grpc.RpcError as e:  # the Verify resends what the target lacks
            log.info("parallel prefill failed", extra={"session_id": self.rec.session_id, "code": e.code().name})
            return
        self._target_prefilled(held)

    def _target_prefilled(self, held: int) -> None:
        """A Prefill left the target holding `held` tokens: the next call sends only the rest."""
        if held <= len(self.rec.committed):
            self.rec.target_pos = held

    # -- pipelining: draft block k+1 while the target verifies block k -----------------------------

    def _take_prefetched(self, replica, k: int):
        reply, self.prefetched = self.prefetched, None
        if reply is None or self.prefetched_for != (len(self.rec.committed), replica.address):
            return None, False
        self.rec.stats["pipeline_hits"] += 1
        replica.breaker.no_call()  # pick() may have let this step through as a half-open breaker's probe
        reply.tokens, reply.probs, reply.scores = reply.tokens[:k], reply.probs[:k], reply.scores[:k]
        return reply, False

    def _pipelines(self, replica) -> bool:
        """Whether blocks for this replica are prefetched (as a rule; auto also weighs the full-block rate)."""
        return self.cfg.pipeline == "on" or (self.cfg.pipeline == "auto" and _stoppable(replica)
                                             and not self._draft_shared())

    def _draft_shared(self) -> bool:
        """auto: more sessions generate than --pipeline-max-sessions. A prefetch pays by running the draft while it
        would idle (its session's verify); with several sessions the others' blocks fill that time already, and a
        prefetch whose block is not accepted whole only delays theirs (measured, int8 draft, quick prompts:
        prefetching +8% at 1 session, even at 2, -5% at 4, -15 to -22% at 8)."""
        limit = self.cfg.pipeline_max_sessions
        return limit > 0 and self._sessions() > limit

    def _prefetch_pays(self, replica) -> bool:
        """auto: a prefetch saves one Propose round trip when the block is fully accepted, and costs about one
        extra RPC either way; a free drafter (n-gram) or a low full-block rate makes it a loss. A model draft's
        prefetch is cancelled when its block is not fully accepted (it only used the draft's otherwise idle time),
        so it is started after any block; others only after a fully accepted one."""
        return ((self.last_block_full or _stoppable(replica)) and not self._draft_shared()
                and self.full_block_rate * self.propose_time.ms > self.cfg.pipeline_min_gain_ms)

    def _start_prefetch(self, replica, reply, k: int):
        """Assume the whole block is accepted and ask the draft for (its guess of the bonus token + k more; k - 1
        more at the longest draft length, which goodput picks for a draft this good: skipping the prefetch
        there would stop pipelining exactly when blocks are accepted whole)."""
        if self.cfg.pipeline == "off" or (self.cfg.pipeline == "auto" and not self._prefetch_pays(replica)):
            return None
        n = min(k + 1, self.cfg.max_draft_len)
        if n < 2:
            return None
        rec = self.rec
        ctx = len(rec.committed)
        held = reply.cached_len  # the draft holds ctx + the drafts it fed itself, or less (a lagging hybrid)
        delta = reply.tokens[held - ctx:] if held >= ctx else rec.committed[held:] + reply.tokens
        rec.stats["pipeline_prefetches"] += 1
        with telemetry.call_attributes(session_id=rec.session_id, k=n, replica=replica.address, prefetch=True):
            return replica.client.propose_async(rec.session_id, held, delta, n, self.params, self.seed,
                                                rec.step + 1, self._draft_timeout_s(n) + 1.0)

    def _finish_prefetch(self, future, replica, reply, new: list[int]) -> None:
        full = len(new) == len(reply.tokens) + 1
        self.last_block_full = full
        self.full_block_rate = 0.8 * self.full_block_rate + 0.2 * full
        if future is None:
            return
        if not full and _stoppable(replica):
            # Of no use now: cancel it rather than wait for a model draft's whole block. The draft stops between
            # tokens, and leaves the session's cache alone if it had not started (the cancellation reaches it before
            # the next Propose, on the same connection).
            future.cancel()
            return
        # Wait for it at the start of the next step, not now: this block's Redis commit and streaming overlap the
        # draft's remaining work (a draft slower than the verify made steps wait 8-31 ms for it in the benchmark).
        self.pending_prefetch = (future, replica, new, len(self.rec.committed), full)

    def _resolve_prefetch(self) -> bool:
        """The previous step's prefetch: wait for it (a stale prefetch landing after the next Propose would scramble
        the draft's cache) and keep its block if the whole previous block was accepted and its first token guessed
        the bonus token. The wait is one draft deadline at most (the RPC's own deadline, counted from before the
        verify, is longer); past it the prefetch is cancelled like a stale one. Returns whether the draft failed."""
        if self.pending_prefetch is None:
            return False
        future, replica, new, committed_len, full = self.pending_prefetch
        self.pending_prefetch = None
        t0 = time.perf_counter()
        wait_s = self._draft_timeout_s(len(new))
        try:
            r = future.result(timeout=wait_s)
        except grpc.FutureCancelledError:
            return False
        except grpc.FutureTimeoutError:
            future.cancel()
            self._draft_failed(replica, "prefetch_deadline_exceeded", f"no block {wait_s * 1e3:.0f} ms into the step")
            return True
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.FAILED_PRECONDITION:
                return False
            self._draft_failed(replica, "prefetch_" + e.code().name.lower(), e.details())
            return True
        finally:  # waiting for the draft is drafting time, not the orchestrator's own (TargetCost.observe_step)
            waited = (time.perf_counter() - t0) * 1e3
            self.step_draft_ms += waited
            self.rec.stats["prefetch_wait_ms"] += waited
        self.draft_cost.observe_prefetch(r.draft_ms, len(r.tokens), self._sessions())
        if (full and len(r.tokens) > 1 and r.tokens[0] == new[-1] and all(t < self.vocab_size for t in r.tokens)
                and _valid_distributions(r.probs, self.vocab_size)
                and (self.params.is_greedy or len(r.probs) in (0, len(r.tokens)))):
            from orchestrator.clients import DraftReply

            self.prefetched = DraftReply(list(r.tokens[1:]), list(r.probs[1:]), r.cached_len, r.draft_ms, False,
                                         scores=list(r.token_scores[1:]))
            self.prefetched_for = (committed_len + len(new), replica.address)
            self.rec.stats["draft_ms"] += r.draft_ms
        return False

    # -- the loop --------------------------------------------------------------------------------------

    def commit(self, new: list[int]) -> tuple[list[int], int]:
        """Apply stop conditions to a block; append what survives; return (kept tokens, finish reason)."""
        rec = self.rec
        max_new = int(rec.params["max_new_tokens"])
        kept: list[int] = []
        finish = 0
        for t in new:
            kept.append(t)
            rec.generated.append(t)
            if t in self.stop_ids:
                finish = FINISH_EOS if (t in self.eos_ids and t not in rec.params["stop_token_ids"]) else FINISH_STOP
            elif len(rec.generated) >= max_new:
                finish = FINISH_LENGTH
            if finish:
                break
        if self.text.stop and self.text.find_stop(rec.generated) is not None:
            # Keep tokens up to the one that completed the stop string.
            while len(kept) > 1 and self.text.find_stop(rec.generated[:-1]) is not None:
                rec.generated.pop()
                kept.pop()
            finish = FINISH_STOP
        return kept, finish

    def _store(self, store, fn):
        """Write to the session store; if it is down, wait up to the grace period (nothing is streamed unstored).
        A write refused because another stream took the session's lease ends this stream (ABORTED): nothing of
        this stream's is written after that moment."""
        deadline = time.monotonic() + self.cfg.store_grace_s
        while True:
            try:
                with telemetry.call_attributes(session_id=self.rec.session_id):
                    return fn()
            except LeaseLost as e:
                log.warning("session lease lost; stopping this stream", extra={
                    "session_id": self.rec.session_id, "holder": e.holder})
                raise GenerationError(grpc.StatusCode.ABORTED, f"{e}; this stream stopped without writing more "
                                      "(resume the session to continue it where it was stored)") from e
            except StoreUnavailable as e:
                if time.monotonic() >= deadline or self.cancel.is_set():
                    raise GenerationError(grpc.StatusCode.UNAVAILABLE, f"{e}; the session keeps its last "
                                          "stored state and can be resumed when the store is back") from e
                time.sleep(0.1)

    def _drop_pending_prefetch(self) -> None:
        """The generation ended (finished, cancelled or failed) with a prefetch in flight: stop it; its block is of
        no use, and the session's caches are released next."""
        if self.pending_prefetch is not None:
            self.pending_prefetch[0].cancel()
            self.pending_prefetch = None

    # -- the loop: a stepper thread drafts and verifies; this stream stores and sends ---------------------------

    STREAM_AHEAD = 2  # blocks the stepper may be ahead of the stream (stored and sent in order, each before the next)

    def run(self, store) -> "iter[Chunk]":
        """The session's blocks, each stored before it is yielded. The steps run on a thread of their own (the
        stepper), so block k's Redis commit and its send to the client (a stream message waits for gRPC's send:
        together ~1.7 ms a step here) overlap block k+1's draft and verify instead of delaying them. All writes are
        this thread's; on any exit the record is put back to what was last stored (steps the stepper took past it
        were neither stored nor sent)."""
        handoff: queue.Queue = queue.Queue(maxsize=self.STREAM_AHEAD)
        stop = threading.Event()  # this stream ended: the stepper stops after its current step
        self._stored = self._snapshot()
        self._handoff_wait_ms = 0.0
        self._store_lock = threading.Lock()
        stepper = threading.Thread(target=contextvars.copy_context().run, args=(self._stepper, handoff, stop),
                                   name=f"stepper-{self.rec.session_id[:16]}", daemon=True)
        stepper.start()
        try:
            while True:
                try:
                    item = handoff.get(timeout=1.0)
                except queue.Empty:
                    if stepper.is_alive() or not handoff.empty():
                        continue
                    raise GenerationError(grpc.StatusCode.INTERNAL, "the generation loop ended without a result")
                if item is None:
                    return
                if isinstance(item, BaseException):
                    raise item
                chunk, snap, kept = item
                self._write_block(store, snap, kept)
                yield chunk
        finally:
            stop.set()
            stepper.join()
            self._restore_stored()

    def _snapshot(self) -> SessionRecord:
        """A copy of the record for the store (the stepper goes on changing the live one)."""
        rec = self.rec
        stats = dict(rec.stats)
        stats["draft_failures_by_kind"] = dict(stats.get("draft_failures_by_kind", {}))
        return dataclasses.replace(rec, generated=list(rec.generated), stats=stats)

    def _write_block(self, store, snap: SessionRecord, kept: list[int]) -> None:
        t_store = time.perf_counter()
        if self._store(store, lambda: store.commit(snap, kept, self.lease)):  # stored before the client sees it
            self.cancel.set()  # CancelSession reached another orchestrator: the stepper stops after its step
        self._stored = snap
        store_ms = (time.perf_counter() - t_store) * 1e3
        with self._store_lock:
            stats = self.rec.stats
            stats["store_ms"] += store_ms
            # The stepper went on meanwhile, except while it waited for room in the handoff: that part is critical.
            stats["store_overlapped_ms"] = max(0.0, stats["store_ms"] - self._handoff_wait_ms)

    def _restore_stored(self) -> None:
        """Put the record back to the stored snapshot, keeping the store timers (real time spent)."""
        stored, rec = self._stored, self.rec
        if len(rec.generated) == len(stored.generated) and rec.step == stored.step and rec.status == stored.status:
            return
        keep = {k: rec.stats[k] for k in ("store_ms", "store_overlapped_ms")}
        for f in dataclasses.fields(rec):  # what a step changes: everything but the session's identity and request
            if f.name not in ("session_id", "prompt_ids", "params"):
                setattr(rec, f.name, getattr(stored, f.name))
        rec.stats = {**stored.stats, **keep}
        self.pending_prefetch = self.prefetched = None

    def _stepper(self, handoff: queue.Queue, stop: threading.Event) -> None:
        def hand_over(item) -> bool:
            t0 = time.perf_counter()
            while not stop.is_set():
                try:
                    handoff.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            waited = (time.perf_counter() - t0) * 1e3
            if waited > 0.05:
                with self._store_lock:
                    self._handoff_wait_ms += waited
            return not stop.is_set()

        try:
            for chunk, kept in self._steps(stop):
                if not hand_over((chunk, self._snapshot(), kept)):
                    return
            hand_over(None)
        except BaseException as e:  # noqa: BLE001 - the stream raises it after the blocks before it
            hand_over(e)
        finally:
            self._drop_pending_prefetch()

    def _steps(self, stop: threading.Event) -> "iter[tuple[Chunk, list[int]]]":
        rec = self.rec
        max_new = int(rec.params["max_new_tokens"])
        while rec.status == "running" and not stop.is_set():
            t0 = time.perf_counter()
            if self.cancel.is_set():
                rec.status, rec.finish_reason = "cancelled", FINISH_CANCELLED
                yield Chunk([], self.text.delta(rec.generated, True), len(rec.generated), FINISH_CANCELLED), []
                return
            offset = len(rec.generated)
            self.step_server_ms, self.step_draft_ms = None, 0.0
            prefill_ms = rec.stats["prefill_ms"]
            new, degraded = self.step(max_new - offset)
            kept, finish = self.commit(new)
            rec.step += 1
            if finish:
                rec.status, rec.finish_reason = "finished", finish
            step_ms = (time.perf_counter() - t0) * 1e3
            rec.stats["wall_ms"] += step_ms
            if degraded:
                rec.stats["degraded_ms"] += step_ms
                metrics.record_degraded(step_ms / 1e3)
            # A step that also prefilled (a new session's prompt, its KV for the draft: tens of ms) is not what a
            # decoding step costs: counted in the per-step overhead it made longer drafts look cheap.
            if (self.target_cost is not None and self.step_server_ms is not None
                    and rec.stats["prefill_ms"] == prefill_ms):
                self.target_cost.observe_step((time.perf_counter() - t0) * 1e3 - self.step_draft_ms,
                                              self.step_server_ms)
            telemetry.record_generated(len(kept))
            stop_at = self.text.find_stop(rec.generated) if finish == FINISH_STOP else None
            yield Chunk(kept, self.text.delta(rec.generated, bool(finish), stop_at), offset, finish), kept


def stats_message(rec: SessionRecord) -> opb.GenerationStats:
    s = rec.stats
    proposed = s.get("draft_tokens_proposed", 0)
    accepted = s.get("draft_tokens_accepted", 0)
    vsteps = s.get("verify_steps", 0)
    wall_ms = s.get("wall_ms", 0.0)
    n = len(rec.generated)
    msg = opb.GenerationStats(
        prompt_tokens=len(rec.prompt_ids),
        generated_tokens=n,
        acceptance_rate=accepted / proposed if proposed else 0.0,
        mean_accepted_length=(accepted + vsteps) / vsteps if vsteps else 0.0,
        tokens_per_second=n / (wall_ms / 1e3) if wall_ms > 0 else 0.0,
        **{k: s.get(k, 0) for k in COUNTERS},
        **{k: s.get(k, 0.0) for k in TIMERS},
    )
    for kind, count in s.get("draft_failures_by_kind", {}).items():
        msg.draft_failures_by_kind[kind] = count
    return msg
