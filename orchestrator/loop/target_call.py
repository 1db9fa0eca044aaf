"""The target side of a step: Verify (a chain or a tree) and target-only Decode on the session's target replica,
moving to another replica when that one goes away and waiting for one to come back, for the grace period, only when
none is left."""

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
        self.client = None  # the replica's client and whether to wait on its channel, for the call being made
        self.wait_for_ready = True
        self.stream = None  # the open DecodeStream (clients.DecodeStream), if any: closed before any other call
        self.stream_client = None  # the client of the replica it is open on

    def call(self, fn, what: str):
        """fn(timeout_s) on the session's target replica (self.client). One that went away sends the session to
        another usable replica at once (its cache rebuilt there from the committed tokens); only while none is
        usable does the call wait, up to the grace period, for one to come back. Without a target pool (a unit
        test's state) fn is simply retried within the grace period."""
        state, cfg, seat = self.state, self.state.cfg, self.state.target_seat
        alone = seat is None or len(seat.pool.replicas) == 1
        # One replica: the grace period runs from the call's start, as it always did; several: from when none is left.
        waiting_since = time.monotonic() if alone else None
        last = None
        while True:
            replica = state.target_replica() if seat is not None else None
            if replica is not None or seat is None:
                # One replica: wait on its channel for it to come back (grpc wait_for_ready), as long as the grace
                # period allows. Several: fail fast on one that is down and move on.
                left = cfg.target_grace_s - (time.monotonic() - waiting_since if waiting_since else 0.0)
                timeout = min(cfg.target_timeout_s, max(0.05, left)) if alone else cfg.target_timeout_s
                self.client, self.wait_for_ready = (replica.client if replica else None), alone
                started = time.monotonic()
                try:
                    reply = fn(timeout)
                except grpc.RpcError as e:
                    if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                        self._timed(started)
                    if e.code() not in RETRYABLE:
                        if replica is not None:
                            replica.breaker.no_call()  # the replica answered: a probe it let through is not lost
                        raise GenerationError(e.code(), f"target {what} failed: {e.details()}") from e
                    last = e
                    log.warning("target unavailable", extra={"session_id": state.rec.session_id, "code": e.code().name,
                                                             "replica": replica.address if replica else ""})
                    if seat is not None:
                        seat.failed(health_blind=e.code() == grpc.StatusCode.DEADLINE_EXCEEDED)
                        if seat.pool.any_available():
                            continue  # another replica: at once
                else:
                    self._timed(started)
                    if replica is not None:
                        replica.breaker.success()
                    if reply.resynced:
                        state.stats.target_resyncs += 1
                    return reply
            waiting_since = waiting_since or time.monotonic()
            if time.monotonic() - waiting_since >= cfg.target_grace_s or state.control.cancel.is_set():
                detail = f": {last.details()}" if last is not None else ""
                raise GenerationError(grpc.StatusCode.UNAVAILABLE,
                                      f"target unavailable for {cfg.target_grace_s:.0f} s during {what}{detail}; "
                                      "the session can be resumed") from last
            time.sleep(0.1)

    def _timed(self, started: float) -> None:
        # Against the configured deadline, not this call's: one shortened by a grace period running out is no
        # sign of a slow target.
        observe = self.state.measured.target_latency
        if observe is not None:
            observe(time.monotonic() - started, self.state.cfg.target_timeout_s)

    def verify(self, reply):
        """Verify a draft reply (a chain, or a tree when reply.tree_parents is set); the target's VerifyReply. Moves
        the session's cache positions; the caller counts the verify (accounting.py)."""
        switched = self.stream is not None  # the target first finishes the stream's step in flight
        self.close_stream()
        state, rec = self.state, self.state.rec
        ctx = len(rec.committed)
        tree = reply.tree_parents is not None
        t0 = time.perf_counter()
        with telemetry.call_attributes(session_id=rec.session_id, k=len(reply.tokens), **({"tree": True} if tree else {})):
            v = self.call(lambda t: self.client.verify(state.verify_call(reply), t, self.wait_for_ready), "verify")
        state.count_overhead(t0, v.verify_ms)
        cost = state.measured.target_cost
        if not tree and cost is not None and rec.target_pos == ctx - 1 and switched:
            cost.observe_switch(len(reply.tokens) + 1, v.verify_ms, ctx)
            state.step_server_ms = v.verify_ms
        elif not tree and cost is not None and rec.target_pos == ctx - 1:  # a plain step: last token + the drafts
            cost.observe(len(reply.tokens) + 1, v.verify_ms, context=ctx)
            state.step_server_ms = v.verify_ms
        return v

    def decode(self, n: int, degraded: bool):
        """Up to n tokens target-only; the DecodeReply."""
        self.close_stream()
        state, rec = self.state, self.state.rec
        plain = rec.target_pos == len(rec.committed) - 1  # no prefill or resync in this call
        t0 = time.perf_counter()
        with telemetry.call_attributes(session_id=rec.session_id, n=n, degraded=degraded):
            d = self.call(lambda t: self.client.decode(state.decode_call(n), t, self.wait_for_ready), "decode")
        state.count_overhead(t0, d.decode_ms)
        cost = state.measured.target_cost
        if cost is not None and plain and d.tokens:
            cost.observe(1, d.decode_ms, calls=len(d.tokens), decode=True, context=len(rec.committed))
            if not degraded:
                state.step_server_ms = d.decode_ms
        rec.target_pos = d.cached_len
        return d

    def stream_block(self, total: int, degraded: bool, grow: bool = False):
        """Target-only tokens from the session's decode stream: the next block of the open one, else the first block
        of a new stream of up to `total` tokens (the target decodes on while this session's blocks are stored and
        sent; `grow`: its blocks grow to a target-only stream's, see stream_plan). A stream that ended or failed is
        closed here; a failure a target going away causes moves the session on (as any call's), a new stream then
        opening on the next usable replica."""
        state, rec = self.state, self.state.rec
        d = None
        plain = self.stream is not None or rec.target_pos == len(rec.committed) - 1  # no prefill in this block
        if self.stream is not None and state.target_seat is not None:
            replica = state.target_replica()  # the session's replica left the pool, or failed: move with it
            if replica is None or replica.client is not self.stream_client:
                self.close_stream()
        if self.stream is not None:
            t0 = time.perf_counter()
            d = self._next_block()
            if d is not None:
                state.count_overhead(t0, d.decode_ms)
        if d is None:
            d = self._open_stream(total, degraded, grow)
        cost = state.measured.target_cost
        if cost is not None and plain and len(d.tokens) > 1:  # the target's time a token; no call overhead
            cost.observe(1, d.decode_ms, calls=len(d.tokens), decode=True, context=len(rec.committed))
        rec.target_pos = d.cached_len
        return d

    def stream_plan(self, grow: bool) -> tuple[int, int, int]:
        """(block_tokens, first_block_tokens, max_block_tokens) of a new stream. Each block wakes the target's gRPC
        thread, this process, Redis and the client, on the cores the target computes on: a target-only generation's
        first token goes out at once, then blocks of stream_block_tokens. A free drafter's weak-draft stream (grow)
        also sends a generation's first token at once, then blocks of fallback_chunk doubling up to
        stream_block_tokens while the drafter, consulted at each block, finds nothing that pays: it costs what
        target-only does, and a new stream after a Verify starts short again. A paused session's blocks stay its
        steps (the draft-length policy probes again after a number of them, at the positions Decode calls reached)."""
        state, rec, cfg = self.state, self.state.rec, self.state.cfg
        target_only = state.backends.pool is None or not rec.params.speculation
        block = max(1, cfg.stream_block_tokens if target_only else cfg.fallback_chunk)
        first = 1 if not rec.generated and (target_only or grow) else block
        return block, first, max(block, cfg.stream_block_tokens) if grow else 0

    def _open_stream(self, total: int, degraded: bool, grow: bool = False):
        state, rec = self.state, self.state.rec
        block, first, max_block = self.stream_plan(grow)
        t0 = time.perf_counter()
        with telemetry.call_attributes(session_id=rec.session_id, n=total, degraded=degraded, stream=True):
            self.stream = self.call(lambda t: self.client.decode_stream(
                state.decode_call(total, block, first, max_block), t, self.wait_for_ready), "decode")
        self.stream_client = self.client
        d = self.stream.first
        state.count_overhead(t0, d.decode_ms)
        return d

    def _next_block(self):
        """The open stream's next block; None when it ended or failed (then it is closed)."""
        try:
            d = self.stream.next()
        except grpc.RpcError as e:
            self.close_stream()
            if e.code() not in RETRYABLE:
                raise GenerationError(e.code(), f"target decode failed: {e.details()}") from e
            log.warning("target stream ended", extra={"session_id": self.state.rec.session_id,
                                                      "code": e.code().name})
            if self.state.target_seat is not None:
                self.state.target_seat.failed(health_blind=e.code() == grpc.StatusCode.DEADLINE_EXCEEDED)
            return None
        if d is None:
            self.close_stream()
        return d

    def close_stream(self) -> None:
        """Stop the open stream (the target stops decoding it); its tokens not yet received are dropped, and the
        next call's TokenDelta crops the target's cache to what was committed."""
        if self.stream is not None:
            self.stream.cancel()
            self.stream = None
