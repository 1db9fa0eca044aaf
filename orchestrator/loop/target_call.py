"""The target side of a step: Verify (a chain or a tree) and target-only Decode, waiting out a target that went away
for its grace period."""

from __future__ import annotations

import logging
import time

import grpc

from orchestrator.loop.state import GenerationError, LoopState
from specdec import observability as telemetry

log = logging.getLogger("specdec.orchestrator")

# The target went away: UNAVAILABLE, DEADLINE_EXCEEDED, or CANCELLED (a target stopping mid-call cancels it).
RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)


class TargetCall:
    def __init__(self, state: LoopState):
        self.state = state

    def call(self, fn, what: str):
        """fn(timeout_s) on the target; if it is down, wait (grpc wait_for_ready) up to the grace period for it."""
        state, cfg = self.state, self.state.cfg
        deadline = time.monotonic() + cfg.target_grace_s
        while True:
            try:
                reply = fn(min(cfg.target_timeout_s, max(0.05, deadline - time.monotonic())))
                if reply.resynced:
                    state.stats.target_resyncs += 1
                return reply
            except grpc.RpcError as e:
                if e.code() not in RETRYABLE:
                    raise GenerationError(e.code(), f"target {what} failed: {e.details()}") from e
                if time.monotonic() >= deadline or state.control.cancel.is_set():
                    raise GenerationError(grpc.StatusCode.UNAVAILABLE,
                                          f"target unavailable for {cfg.target_grace_s:.0f} s during {what}: "
                                          f"{e.details()}; the session can be resumed") from e
                log.warning("target unavailable; waiting", extra={"session_id": state.rec.session_id,
                                                                  "code": e.code().name})
                time.sleep(0.1)

    def verify(self, reply):
        """Verify a draft reply (a chain, or a tree when reply.tree_parents is set); the target's VerifyReply. Moves
        the session's cache positions; the caller counts the verify (accounting.py)."""
        state, rec = self.state, self.state.rec
        ctx = len(rec.committed)
        tree = reply.tree_parents is not None
        t0 = time.perf_counter()
        with telemetry.call_attributes(session_id=rec.session_id, k=len(reply.tokens), **({"tree": True} if tree else {})):
            v = self.call(lambda t: state.backends.target.verify(
                rec.session_id, rec.committed, rec.target_pos, reply.tokens, reply.probs, state.sampling,
                state.seed, rec.step, t, wait_for_ready=True, tree_parents=reply.tree_parents), "verify")
        state.count_overhead(t0, v.verify_ms)
        cost = state.measured.target_cost
        if not tree and cost is not None and rec.target_pos == ctx - 1:  # a plain step: last token + the drafts
            cost.observe(len(reply.tokens) + 1, v.verify_ms)
            state.step_server_ms = v.verify_ms
        return v

    def decode(self, n: int, degraded: bool):
        """Up to n tokens target-only; the DecodeReply."""
        state, rec = self.state, self.state.rec
        plain = rec.target_pos == len(rec.committed) - 1  # no prefill or resync in this call
        t0 = time.perf_counter()
        with telemetry.call_attributes(session_id=rec.session_id, n=n, degraded=degraded):
            d = self.call(lambda t: state.backends.target.decode(
                rec.session_id, rec.committed, rec.target_pos, n, state.sampling, state.seed, rec.step,
                sorted(state.stop_ids), t, wait_for_ready=True), "decode")
        state.count_overhead(t0, d.decode_ms)
        cost = state.measured.target_cost
        if cost is not None and plain and d.tokens:
            cost.observe(1, d.decode_ms, calls=len(d.tokens))
            if not degraded:
                state.step_server_ms = d.decode_ms
        rec.target_pos = d.cached_len
        return d
