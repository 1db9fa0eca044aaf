"""Pipelining: draft block k+1 while the target verifies block k, on the guess that block k is accepted whole."""

from __future__ import annotations

import time
from dataclasses import dataclass

import grpc

from orchestrator.replicas.clients import DraftReply
from orchestrator.loop.draft_call import DraftCall, stoppable
from orchestrator.loop.state import LoopState
from orchestrator.loop.validate import draft_reply_problem
from specdec import observability as telemetry


@dataclass
class PendingPrefetch:
    future: object      # the Propose call in flight
    replica: object
    asked: int          # tokens it asked for
    verified: list[int]  # the block it assumed accepted whole (the verify's new tokens)
    committed_len: int  # the context's length before that block
    full: bool          # whether the block was accepted whole


class Prefetcher:
    def __init__(self, state: LoopState, draft: DraftCall):
        self.state, self.draft = state, draft
        self.prefetched: DraftReply | None = None  # a draft block ready for the current context
        self.prefetched_for: tuple[int, str] | None = None  # (committed length, replica address) it is valid for
        self.pending: PendingPrefetch | None = None
        self.last_block_full = True
        self.full_block_rate = 1.0  # EMA of "the whole block was accepted": how often a prefetch is usable

    def take(self, replica, k: int):
        """The prefetched block for this context and replica, cut to k tokens, or None."""
        reply, self.prefetched = self.prefetched, None
        if reply is None or self.prefetched_for != (len(self.state.rec.committed), replica.address):
            return None
        self.state.stats.pipeline_hits += 1
        replica.breaker.no_call()  # pick() may have let this step through as a half-open breaker's probe
        reply.tokens, reply.probs, reply.scores = reply.tokens[:k], reply.probs[:k], reply.scores[:k]
        return reply

    def pipelines(self, replica) -> bool:
        """Whether blocks for this replica are prefetched (as a rule; auto also weighs the full-block rate)."""
        mode = self.state.cfg.pipeline
        return mode == "on" or (mode == "auto" and stoppable(replica) and not self.draft_shared())

    def draft_shared(self) -> bool:
        """auto: more sessions generate than --pipeline-max-sessions. A prefetch pays by running the draft while it
        would idle (its session's verify); with several sessions the others' blocks fill that time already, and a
        prefetch whose block is not accepted whole only delays theirs (int8 draft, quick prompts: prefetching +8% at
        1 session, even at 2, -5% at 4, -15 to -22% at 8)."""
        limit = self.state.cfg.pipeline_max_sessions
        return limit > 0 and self.state.sessions() > limit

    def pays(self, replica) -> bool:
        """auto: a prefetch saves one Propose round trip when the block is fully accepted, and costs about one
        extra RPC either way; a free drafter (n-gram) or a low full-block rate makes it a loss. A model draft's
        prefetch is cancelled when its block is not fully accepted (it only used the draft's otherwise idle time),
        so it is started after any block; others only after a fully accepted one."""
        return ((self.last_block_full or stoppable(replica)) and not self.draft_shared()
                and self.full_block_rate * self.draft.propose_time.ms > self.state.cfg.pipeline_min_gain_ms)

    def start(self, replica, reply, k: int):
        """Assume the whole block is accepted and ask the draft for (its guess of the bonus token + k more; k - 1
        more at the longest draft length, which goodput picks for a draft this good: skipping the prefetch
        there would stop pipelining exactly when blocks are accepted whole). (future, tokens asked) or None."""
        state, rec, mode = self.state, self.state.rec, self.state.cfg.pipeline
        if mode == "off" or (mode == "auto" and not self.pays(replica)):
            return None
        n = min(k + 1, state.max_draft_len)
        if n < 2:
            return None
        ctx = len(rec.committed)
        held = reply.cached_len  # the draft holds ctx + the drafts it fed itself, or less (a lagging hybrid)
        delta = reply.tokens[held - ctx:] if held >= ctx else rec.committed[held:] + reply.tokens
        rec.stats.pipeline_prefetches += 1
        with telemetry.call_attributes(session_id=rec.session_id, k=n, replica=replica.address, prefetch=True):
            future = replica.client.propose_async(rec.session_id, held, delta, n, state.sampling, state.seed,
                                                  rec.step + 1, self.draft.timeout_s(n) + 1.0)
        return future, n

    def finish(self, started, replica, reply, new: list[int]) -> None:
        """After the verify of `reply` committed `new`: keep the prefetch `started` for the next step if it can
        still be of use."""
        full = len(new) == len(reply.tokens) + 1
        self.last_block_full = full
        self.full_block_rate = 0.8 * self.full_block_rate + 0.2 * full
        if started is None:
            return
        future, asked = started
        if not full and stoppable(replica):
            # Of no use now: cancel it rather than wait for a model draft's whole block. The draft stops between
            # tokens, and leaves the session's cache alone if it had not started (the cancellation reaches it before
            # the next Propose, on the same connection).
            future.cancel()
            return
        # Wait for it at the start of the next step, not now: this block's Redis commit and streaming overlap the
        # draft's remaining work (a draft slower than the verify made steps wait 8-31 ms for it).
        self.pending = PendingPrefetch(future, replica, asked, new, len(self.state.rec.committed), full)

    def resolve(self) -> bool:
        """The previous step's prefetch: wait for it (a stale prefetch landing after the next Propose would scramble
        the draft's cache) and keep its block if the whole previous block was accepted and its first token guessed
        the bonus token. The wait is one draft deadline at most (the RPC's own deadline, counted from before the
        verify, is longer); past it the prefetch is cancelled like a stale one. Returns whether the draft failed."""
        p, self.pending = self.pending, None
        if p is None:
            return False
        state = self.state
        t0 = time.perf_counter()
        wait_s = self.draft.timeout_s(len(p.verified))
        try:
            r = p.future.result(timeout=wait_s)
        except grpc.FutureCancelledError:
            return False
        except grpc.FutureTimeoutError:
            p.future.cancel()
            self.draft.failed(p.replica, "prefetch_deadline_exceeded", f"no block {wait_s * 1e3:.0f} ms into the step")
            return True
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.FAILED_PRECONDITION:
                return False
            self.draft.failed(p.replica, "prefetch_" + e.code().name.lower(), e.details())
            return True
        finally:  # waiting for the draft is drafting time, not the orchestrator's own (TargetCost.observe_step)
            waited = (time.perf_counter() - t0) * 1e3
            state.step_draft_ms += waited
            state.stats.prefetch_wait_ms += waited
        state.measured.draft_cost.observe_prefetch(r.draft_ms, len(r.tokens), state.sessions())
        usable = p.full and len(r.tokens) > 1 and r.tokens[0] == p.verified[-1]
        if usable and draft_reply_problem(r.tokens, r.probs, r.token_scores, vocab_size=state.vocab_size,
                                          greedy=state.sampling.is_greedy, max_tokens=p.asked) is None:
            self.prefetched = DraftReply(list(r.tokens[1:]), list(r.probs[1:]), r.cached_len, r.draft_ms, False,
                                         scores=list(r.token_scores[1:]))
            self.prefetched_for = (p.committed_len + len(p.verified), p.replica.address)
            state.stats.draft_ms += r.draft_ms
        return False

    def drop(self) -> None:
        """The generation ended (finished, cancelled or failed) with a prefetch in flight, or went back to its stored
        state: stop it; its block is of no use, and the session's caches are released next."""
        if self.pending is not None:
            self.pending.future.cancel()
            self.pending = None
        self.prefetched = None
