"""The speculative loop: draft proposes, target verifies, the orchestrator commits and stores each block.

One step:  tokens = draft.propose(k)  ->  (n, next) = target.verify(tokens)  ->  commit tokens[:n] + [next]
If the draft fails (error, deadline, malformed reply) the step decodes target-only instead, so output
never depends on the draft; only speed does.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

import grpc

from orchestrator.clients import DraftClient, TargetClient
from orchestrator.session_store import SessionRecord
from orchestrator.text import TextTracker
from specdec import telemetry
from specdec.sampling import SamplingParams
from specdec.v1 import orchestrator_pb2 as opb

log = logging.getLogger("specdec.orchestrator")

FINISH_LENGTH = opb.FINISH_REASON_LENGTH
FINISH_EOS = opb.FINISH_REASON_EOS
FINISH_STOP = opb.FINISH_REASON_STOP
FINISH_CANCELLED = opb.FINISH_REASON_CANCELLED


class GenerationError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass
class LoopConfig:
    default_draft_len: int = 4
    max_draft_len: int = 16
    fallback_chunk: int = 4            # tokens per target-only Decode call when degraded
    draft_timeout_floor_ms: float = 100.0
    draft_timeout_factor: float = 3.0  # x the measured target step time
    draft_first_call_timeout_ms: float = 5000.0  # the draft's first call per session prefills the prompt
    draft_retry_after_s: float = 1.0   # after a draft failure, decode target-only this long before retrying
    target_timeout_s: float = 30.0


@dataclass
class Chunk:
    tokens: list[int]
    text: str
    offset: int
    finish_reason: int = 0


class AcceptanceWindow:
    """Acceptance over the orchestrator's most recent verify steps (all sessions), for the outline and metrics."""

    def __init__(self, max_steps: int = 1000):
        from collections import deque

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


class DraftHealth:
    """A minimal breaker shared by all sessions: after a failure, skip the draft for a cool-down."""

    def __init__(self, retry_after_s: float):
        self.retry_after_s = retry_after_s
        self._open_until = 0.0
        self._lock = threading.Lock()
        self.failures: dict[str, int] = {}

    def available(self) -> bool:
        return time.monotonic() >= self._open_until

    def failed(self, kind: str) -> None:
        with self._lock:
            self.failures[kind] = self.failures.get(kind, 0) + 1
            self._open_until = time.monotonic() + self.retry_after_s


@dataclass
class Generation:
    rec: SessionRecord
    target: TargetClient
    draft: DraftClient | None
    tokenizer: object
    eos_ids: set[int]
    vocab_size: int
    cfg: LoopConfig
    draft_health: DraftHealth
    cancel: threading.Event = field(default_factory=threading.Event)
    window: AcceptanceWindow | None = None
    target_step_ms: float = 0.0  # EMA of the target's per-step time, sets the draft deadline

    def __post_init__(self):
        p = self.rec.params
        self.params = SamplingParams(p["temperature"], p["top_k"], p["top_p"])
        self.seed = int(p["seed"])
        self.stop_ids = set(p["stop_token_ids"]) | (set() if p["ignore_eos"] else self.eos_ids)
        self.text = TextTracker(self.tokenizer, p["stop"])
        s = self.rec.stats
        for key in ("verify_steps", "draft_tokens_proposed", "draft_tokens_accepted", "fallback_steps",
                    "fallback_tokens", "draft_failures", "decode_steps"):
            s.setdefault(key, 0)
        for key in ("draft_ms", "verify_ms", "wall_ms"):
            s.setdefault(key, 0.0)

    # -- one step -------------------------------------------------------------------------------

    def _wants_draft(self) -> bool:
        return self.draft is not None and bool(self.rec.params["speculation"])

    def _draft_timeout_s(self) -> float:
        if self.rec.draft_pos == 0:
            return self.cfg.draft_first_call_timeout_ms / 1e3
        return max(self.cfg.draft_timeout_floor_ms, self.cfg.draft_timeout_factor * self.target_step_ms) / 1e3

    def _propose(self, k: int):
        """Draft k tokens: (reply, False), (None, False) if nothing was drafted, (None, True) if the draft failed."""
        rec = self.rec
        try:
            with telemetry.span("orchestrator.draft", session_id=rec.session_id, k=k):
                reply = self.draft.propose(rec.session_id, rec.committed, rec.draft_pos, k, self.params,
                                           self.seed, rec.step, self._draft_timeout_s())
        except grpc.RpcError as e:
            kind = "timeout" if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED else e.code().name.lower()
            self._draft_failed(kind, e.details())
            return None, True
        bad = (len(reply.tokens) > k or any(t >= self.vocab_size for t in reply.tokens)
               or (not self.params.is_greedy and len(reply.probs) not in (0, len(reply.tokens))))
        if bad:
            self._draft_failed("malformed", f"{len(reply.tokens)} tokens, {len(reply.probs)} distributions")
            return None, True
        if not reply.tokens:  # nothing to propose (e.g. no n-gram match): a plain target step
            rec.draft_pos = min(len(rec.committed), reply.cached_len)
            return None, False
        rec.stats["draft_ms"] += reply.draft_ms
        return reply, False

    def _draft_failed(self, kind: str, detail: str | None) -> None:
        self.rec.stats["draft_failures"] += 1
        self.draft_health.failed(kind)
        self.rec.draft_pos = 0  # the draft's state is unknown now; resync on the next call
        log.warning("draft failed; decoding target-only", extra={"session_id": self.rec.session_id,
                                                                   "kind": kind, "detail": detail})

    def _target_call(self, fn, what: str):
        try:
            return fn()
        except grpc.RpcError as e:
            raise GenerationError(e.code(), f"target {what} failed: {e.details()}") from e

    def step(self, remaining: int) -> list[int]:
        """Run one step; return the newly committed tokens (before stop handling)."""
        rec, stats = self.rec, self.rec.stats
        k = min(int(rec.params["max_draft_len"]) or self.cfg.default_draft_len, self.cfg.max_draft_len, remaining - 1)
        degraded = self._wants_draft() and not self.draft_health.available()
        n = self.cfg.fallback_chunk
        if k > 0 and self._wants_draft() and not degraded:
            reply, failed = self._propose(k)
            if reply is not None:
                return self._verify(reply)
            degraded = failed
            n = self.cfg.fallback_chunk if failed else 1  # nothing drafted: one target token, then draft again
        n = min(n, remaining)
        with telemetry.span("orchestrator.decode", session_id=rec.session_id, n=n, degraded=degraded):
            d = self._target_call(lambda: self.target.decode(
                rec.session_id, rec.committed, rec.target_pos, n, self.params, self.seed, rec.step,
                sorted(self.stop_ids), self.cfg.target_timeout_s), "decode")
        rec.target_pos = d.cached_len
        stats["decode_steps"] += 1
        if degraded:
            stats["fallback_steps"] += 1
            stats["fallback_tokens"] += len(d.tokens)
            telemetry.record_fallback()
        self._observe_target(d.decode_ms / max(1, len(d.tokens)))
        return d.tokens

    def _verify(self, reply) -> list[int]:
        rec, stats = self.rec, self.rec.stats
        ctx = len(rec.committed)
        with telemetry.span("orchestrator.verify", session_id=rec.session_id, k=len(reply.tokens)):
            v = self._target_call(lambda: self.target.verify(
                rec.session_id, rec.committed, rec.target_pos, reply.tokens, reply.probs, self.params,
                self.seed, rec.step, self.cfg.target_timeout_s), "verify")
        rec.target_pos = v.cached_len
        rec.draft_pos = min(ctx + v.num_accepted, reply.cached_len)
        stats["verify_steps"] += 1
        stats["draft_tokens_proposed"] += len(reply.tokens)
        stats["draft_tokens_accepted"] += v.num_accepted
        stats["verify_ms"] += v.verify_ms
        if self.window is not None:
            self.window.add(len(reply.tokens), v.num_accepted)
        self._observe_target(v.verify_ms)
        return reply.tokens[: v.num_accepted] + [v.next_token]

    def _observe_target(self, ms: float) -> None:
        self.target_step_ms = ms if self.target_step_ms == 0 else 0.8 * self.target_step_ms + 0.2 * ms

    # -- the loop -------------------------------------------------------------------------------

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

    def run(self, store) -> "iter[Chunk]":
        rec = self.rec
        max_new = int(rec.params["max_new_tokens"])
        while rec.status == "running":
            t0 = time.perf_counter()
            if self.cancel.is_set():
                rec.status, rec.finish_reason = "cancelled", FINISH_CANCELLED
                store.update_state(rec)
                yield Chunk([], self.text.delta(rec.generated, True), len(rec.generated), FINISH_CANCELLED)
                return
            offset = len(rec.generated)
            kept, finish = self.commit(self.step(max_new - offset))
            rec.step += 1
            if finish:
                rec.status, rec.finish_reason = "finished", finish
            rec.stats["wall_ms"] += (time.perf_counter() - t0) * 1e3
            store.commit(rec, kept)  # stored before the client sees it: nothing acknowledged is lost
            telemetry.record_generated(len(kept))
            stop_at = self.text.find_stop(rec.generated) if finish == FINISH_STOP else None
            yield Chunk(kept, self.text.delta(rec.generated, bool(finish), stop_at), offset, finish)


def stats_message(rec: SessionRecord) -> opb.GenerationStats:
    s = rec.stats
    proposed = s.get("draft_tokens_proposed", 0)
    accepted = s.get("draft_tokens_accepted", 0)
    vsteps = s.get("verify_steps", 0)
    wall_ms = s.get("wall_ms", 0.0)
    n = len(rec.generated)
    return opb.GenerationStats(
        prompt_tokens=len(rec.prompt_ids),
        generated_tokens=n,
        verify_steps=vsteps,
        draft_tokens_proposed=proposed,
        draft_tokens_accepted=accepted,
        acceptance_rate=accepted / proposed if proposed else 0.0,
        mean_accepted_length=(accepted + vsteps) / vsteps if vsteps else 0.0,
        draft_ms=s.get("draft_ms", 0.0),
        verify_ms=s.get("verify_ms", 0.0),
        fallback_steps=s.get("fallback_steps", 0),
        fallback_tokens=s.get("fallback_tokens", 0),
        wall_ms=wall_ms,
        tokens_per_second=n / (wall_ms / 1e3) if wall_ms > 0 else 0.0,
        draft_failures=s.get("draft_failures", 0),
        decode_steps=s.get("decode_steps", 0),
    )
