"""The draft side of a step: which replica, how long it may take, the Propose call, and what a failure means."""

from __future__ import annotations

import logging
import time

import grpc

from orchestrator import metrics
from orchestrator.policy.draft_length import AdaptiveLength
from orchestrator.loop.state import LoopState, StepTimer
from orchestrator.loop.validate import draft_reply_problem
from specdec import observability as telemetry

log = logging.getLogger("specdec.orchestrator")

STOPPABLE_DRAFTS = ("model", "quantized")  # draft strategies whose Propose stops when the call is cancelled


def stoppable(replica) -> bool:
    return replica.info is not None and replica.info.strategy in STOPPABLE_DRAFTS


class DraftCall:
    def __init__(self, state: LoopState):
        self.state = state
        self.propose_time = StepTimer()  # Propose round trips: what a usable prefetch saves

    def wanted(self) -> bool:
        return self.state.backends.pool is not None and bool(self.state.rec.params.speculation)

    def timeout_s(self, k: int = 1) -> float:
        """A draft slower per token than the target's own step is no help: the deadline allows k tokens at the
        draft's measured time per token, each capped at the measured target step, and at least one target step
        (a draft model nearly the target's size, like its own weights in int8, needs several steps for a long
        block). A call that must first prefill the context (new session, failover, probe) gets time in proportion:
        the drafts' measured prefill time per context token (as slow as the target's own for a draft of its size;
        capped at a target step), or the first-call deadline until one was measured; so does every call until a
        draft token's time was."""
        state, cfg, measured = self.state, self.state.cfg, self.state.measured
        first_call = cfg.draft_first_call_timeout_ms
        if measured.target_step.ms == 0:  # nothing measured yet
            return first_call / 1e3
        step = measured.target_step.ms
        sessions = state.sessions()
        cost = measured.target_cost
        if cost is not None and cost.forward_ms:
            # Under load a target-only token waits for a forward batched with the other sessions' blocks: the
            # Decode-measured step (rare while speculating, maybe from a quieter time) understates it.
            step = max(step, cost.step_ms(1, cost.rows()))
        factor = cfg.draft_timeout_factor
        per_token = measured.draft_cost.deadline_per_token(sessions)
        if per_token is None and state.rec.draft_pos > 0:  # a fresh orchestrator
            return max(first_call, factor * step) / 1e3
        budget = factor * max(step, k * min(step, per_token or 0.0))
        if state.rec.draft_pos == 0:
            ctx = len(state.rec.committed)
            per_token = measured.draft_cost.per_prefill_token(sessions)
            if per_token is None:
                return max(first_call, budget * (1 + ctx / 128)) / 1e3
            # capped like a drafted token: a draft slower per context token than a target step is no help
            budget = max(budget * (1 + ctx / 128), budget + factor * ctx * min(step, per_token))
        return max(cfg.draft_timeout_floor_ms, budget) / 1e3

    def pick_replica(self):
        rec = self.state.rec
        replica = self.state.backends.pool.pick(rec.session_id)
        if replica is None:
            return None
        if replica.address != rec.draft_replica:
            if rec.draft_replica:
                rec.stats.replica_failovers += 1
                metrics.record_failover()
                log.info("draft failover", extra={"session_id": rec.session_id, "from": rec.draft_replica,
                                                  "to": replica.address})
            rec.draft_replica, rec.draft_pos = replica.address, 0  # the new replica rebuilds from token 0
        return replica

    def _call(self, replica, k: int, timeout_s: float, **extra):
        """The Propose RPC: (reply, None), or (None, (failure kind, detail))."""
        state, rec = self.state, self.state.rec
        try:
            with telemetry.call_attributes(session_id=rec.session_id, replica=replica.address,
                                           **({"tree_budget": extra["tree"]["tree_budget"]} if "tree" in extra
                                              else {"k": k})):
                return replica.client.propose(state.propose_call(k, **extra), timeout_s), None
        except grpc.RpcError as e:
            kind = "timeout" if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED else e.code().name.lower()
            return None, (kind, e.details())

    def _check(self, replica, reply, max_tokens: int, **tree) -> bool:
        problem = draft_reply_problem(reply.tokens, reply.probs, reply.scores, vocab_size=self.state.vocab_size,
                                      greedy=self.state.sampling.is_greedy, max_tokens=max_tokens, **tree)
        if problem:
            self.failed(replica, "malformed", problem)
            return False
        replica.breaker.success()
        self.state.stats.draft_ms += reply.draft_ms
        return True

    def _nothing_drafted(self, reply) -> bool:
        if reply.tokens:
            return False
        rec = self.state.rec  # e.g. no n-gram match: a plain target step
        rec.draft_pos = min(len(rec.committed), reply.cached_len)
        return True

    def propose(self, replica, k: int, kv=None):
        """Draft k tokens: (reply, False); (None, False) if nothing was drafted; (None, True) if the draft failed.
        kv: the target's KV of the context's first kv.length tokens (a new session: handover.py)."""
        state, rec, cost = self.state, self.state.rec, self.state.measured.draft_cost
        t0 = time.perf_counter()
        # A call whose draft must first take in more than one block's worth of context (a new session's prompt,
        # the tokens decoded target-only during a pause or a failure) pays for that intake at the drafts' prefill
        # rate; only the rest is what drafting costs. Positions whose KV comes along are not taken in.
        held = max(rec.draft_pos, kv.length if kv is not None else 0)
        prefilled = held == 0
        intake = len(rec.committed) - held
        catching_up = intake > state.max_draft_len + 1
        timeout_s = self.timeout_s(k)
        reply, error = self._call(replica, k, timeout_s, kv=kv)
        if error:
            if error[0] == "timeout":
                cost.timed_out(timeout_s * 1e3, k, intake if prefilled or catching_up else 0, state.sessions())
            self.failed(replica, *error)
            return None, True
        if not self._check(replica, reply, k):
            return None, True
        # A Propose carrying the target's KV spends its extra round-trip time moving the prompt's KV (MBs): that is
        # the prefill handover's cost (prefill_ms), not a decoding step's.
        wall_ms = state.count_overhead(t0, reply.draft_ms, "prefill_ms" if kv is not None else "rpc_overhead_ms")
        state.step_draft_ms += wall_ms  # a miss step also waited for its stale prefetch (prefetch.py)
        self.propose_time.observe(wall_ms)
        sessions = state.sessions()
        if prefilled or reply.resynced:  # the draft took in the whole context first
            cost.observe_prefill(reply.draft_ms, len(rec.committed), len(reply.tokens), sessions)
        elif not catching_up or cost.prefill_token_ms.value is not None:
            # A probe after a pause catches up first: measured too (its intake charged at the prefill rate), else a
            # cost learned in a slow spell would never be measured again and the pause would last.
            intake_ms = intake * cost.per_prefill_token(sessions) if catching_up else 0.0
            cost.observe(wall_ms - intake_ms, max(0.0, reply.draft_ms - intake_ms), len(reply.tokens), sessions)
        if self._nothing_drafted(reply):
            return None, False
        return reply, False

    def propose_tree(self, replica, tree: dict, chain_len: int, max_depth: int):
        """A token tree (tree speculation): like propose; a drafter without trees answers with a chain of at most
        chain_len tokens."""
        t0 = time.perf_counter()
        reply, error = self._call(replica, chain_len, self.timeout_s(tree["tree_budget"]), tree=tree)
        if error:
            self.failed(replica, *error)
            return None, True
        shape = ({"max_tokens": chain_len} if reply.tree_parents is None else
                 {"max_tokens": tree["tree_budget"], "tree_parents": reply.tree_parents, "max_depth": max_depth})
        if not self._check(replica, reply, **shape):
            return None, True
        self.state.count_overhead(t0, reply.draft_ms)
        if self._nothing_drafted(reply):
            return None, False
        return reply, False

    def trim_to_verified_prefix(self, draft_len: AdaptiveLength, reply, limit: int) -> None:
        """Cut a scored draft to the prefix worth verifying (at least one token); an unscored one stays whole."""
        if not reply.scores:
            return
        d = draft_len.verify_len(reply.scores, limit)
        if d < len(reply.tokens):
            self.state.stats.draft_tokens_trimmed += len(reply.tokens) - d
            metrics.record_trimmed(len(reply.tokens) - d)
            reply.tokens, reply.scores, reply.probs = reply.tokens[:d], reply.scores[:d], reply.probs[:d]

    def failed(self, replica, kind: str, detail: str | None) -> None:
        state = self.state
        state.stats.count_draft_failure(kind)
        # A replica that could not be reached shows in its health checks; one that answers late or wrongly does not.
        replica.breaker.failure(health_blind=kind not in ("unavailable", "prefetch_unavailable"))
        if kind not in ("timeout", "prefetch_deadline_exceeded") or not stoppable(replica):
            # The replica's state is unknown now: resync from token 0 on the next call. A model draft's timed-out
            # call leaves its session consistent (it stops, and does not touch the session once its caller is
            # gone; the next call crops it to what is committed; a draft that lost it answers with a cache miss
            # and the client resends): re-prefilling the whole context after every late block would only load a
            # busy draft further.
            state.rec.draft_pos = 0
        metrics.record_draft_failure(kind)
        log.warning("draft failed; decoding target-only", extra={
            "session_id": state.rec.session_id, "replica": replica.address, "kind": kind, "detail": detail})
