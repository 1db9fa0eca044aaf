"""One speculative step: the draft proposes, the target verifies, the accepted tokens and the target's next one are
committed; if the draft fails (error, deadline, malformed reply) the step decodes target-only instead, so the output
never depends on the draft, only the speed does.

    reply = draft.propose(k)             # a prefetched block when pipelining guessed right
    v = target.verify(reply)             # (n accepted, next token)
    new = reply.tokens[:n] + [next]      # accept ... or fallback: target.decode(chunk)
"""

from __future__ import annotations

from orchestrator import metrics
from orchestrator.policy.draft_length import FREE_DRAFTERS, Evidence, dry_step_tokens, make_draft_length
from orchestrator.loop.accounting import record_decode, record_verify
from orchestrator.loop.draft_call import DraftCall
from orchestrator.loop.handover import PromptHandover
from orchestrator.loop.prefetch import Prefetcher
from orchestrator.loop.state import LoopState
from orchestrator.loop.target_call import TargetCall
from orchestrator.loop.tree import TreeStrategy


WEAK_RAMP = 2  # a free drafter's weak steps right after a Verify that decode in Decode calls (1, 2 tokens)


class Step:
    def __init__(self, state: LoopState):
        self.state = state
        self.draft = DraftCall(state)
        self.target = TargetCall(state)
        self.prefetch = Prefetcher(state, self.draft)
        self.handover = PromptHandover(state)
        cfg, measured, fixed = state.cfg, state.measured, state.rec.params.max_draft_len
        # A per-request max_draft_len is a fixed length (within the limit, resolved at admission); the server
        # default may adapt (chains only).
        evidence = Evidence(measured.target_cost, measured.acceptance_prior, measured.draft_evidence,
                            measured.draft_cost)
        self.draft_len = make_draft_length(fixed or min(cfg.default_draft_len, state.max_draft_len),
                                           state.max_draft_len, cfg.adaptive_draft_len and not fixed
                                           and not cfg.tree_budget, cfg.draft_len_policy, evidence, cfg.fallback_chunk)
        pool = state.backends.pool
        self.draft_len.use_free_drafter(pool is not None and any(
            getattr(r, "info", None) is not None and r.info.strategy in FREE_DRAFTERS
            for r in getattr(pool, "replicas", ())))
        self.tree = TreeStrategy(state, self) if cfg.tree_budget > 0 else None
        self.dry_steps = 0  # steps in a row whose drafter proposed nothing (no n-gram match)

    def __call__(self, remaining: int) -> tuple[list[int], bool]:
        """(newly committed tokens before stop handling, whether the step ran degraded)."""
        stats, fallback = self.state.stats, min(self.state.cfg.fallback_chunk, remaining)
        if self.prefetch.resolve():  # the draft failed this step already: no second deadline before falling back
            return self.decode(fallback, degraded=True), True
        if not self.draft.wanted():  # target-only: one decode stream for the rest of the generation
            return self.stream(remaining, degraded=False), False
        k = min(self.draft_len.k, remaining - 1)
        if k <= 0 and self.streams_weak_drafts():  # the last token: from the open stream, as any other
            return self.stream(remaining, degraded=False, grow=True), False
        if k <= 0:
            if self.draft_len.k == 0:  # no draft length pays: target-only until the policy probes again
                stats.speculation_paused_steps += 1
                metrics.record_paused()
                steps_left = self.draft_len.steps_to_probe() if hasattr(self.draft_len, "steps_to_probe") else 1
                tokens = self.stream(min(remaining, fallback * steps_left), degraded=False)
                self.draft_len.step_taken()
                return tokens, False
            return self.decode(fallback, degraded=False), False
        if self._overloaded():
            stats.load_shed_steps += 1
            metrics.record_load_shed()
            return self.decode(fallback, degraded=False), False
        replica = self.draft.pick_replica()
        if replica is not None:
            new, failed = (self.tree.run if self.tree else self.chain)(replica, k, remaining)
            if new is not None:
                self.dry_steps = 0
                return new, False
            if not failed and self.streams_weak_drafts():  # the stream's next block, then draft again
                return self.stream(remaining, degraded=False, grow=True), False
            if not failed:  # nothing drafted (or nothing that pays): target tokens, then draft again
                n = dry_step_tokens(self.draft_len, self.dry_steps, fallback)
                self.dry_steps += 1
                return self.decode(n, degraded=False), False
        # Every replica failed or is open: target-only for a few tokens, then try the draft again.
        return self.decode(fallback, degraded=True), True

    def chain(self, replica, k: int, remaining: int) -> tuple[list[int] | None, bool]:
        """Propose about k tokens (the prefetched block, or a Propose taking the target's prompt KV or with the
        target prefilling alongside for a new session), verify them: (new tokens, False); (None, failed) when
        nothing was drafted or the draft failed."""
        self.draft_len.pipelined = self.prefetch.pipelines(replica)
        self.draft_len.stream_open = self.target.stream is not None  # verifying would close it: priced
        self.draft_len.context = len(self.state.rec.committed)
        ask = min(self.draft_len.request_len(k), remaining - 1)  # a scored draft is trimmed
        reply = self.prefetch.take(replica, ask)
        if reply is None:
            kv = self.handover.target_kv(replica)
            prefill = None if kv is not None else self.handover.start_parallel_prefill(replica)
            reply, failed = self.draft.propose(replica, ask, kv)
            self.handover.finish_parallel_prefill(prefill)
            if reply is None:
                return None, failed
        self.draft.trim_to_verified_prefix(self.draft_len, reply, remaining - 1)
        if not reply.tokens:  # no prefix of this block pays (a free drafter's weak match): target tokens instead
            self.state.rec.draft_pos = min(len(self.state.rec.committed), reply.cached_len)
            return None, False
        started = self.prefetch.start(replica, reply, ask)
        new = self.accept(reply, self.target.verify(reply))
        self.prefetch.finish(started, replica, reply, new)
        return new, False

    def accept(self, reply, v) -> list[int]:
        """A chain's verify result: count it, move the draft's position; the committed tokens."""
        rec = self.state.rec
        ctx = len(rec.committed)
        rec.target_pos = v.cached_len
        rec.draft_pos = min(ctx + v.num_accepted, reply.cached_len)
        record_verify(self.state, self.draft_len, len(reply.tokens), v.num_accepted, v.verify_ms, reply.scores)
        return reply.tokens[: v.num_accepted] + [v.next_token]

    def streams_weak_drafts(self) -> bool:
        """A free drafter's session takes the tokens of its unpaid or empty drafts from its decode stream, as a
        target-only session does, and drafts again at every block of it (microseconds): it closes the stream for a
        Verify only when a draft pays for that too (GoodputDraftLength.switch_ms: the stream's step in flight is
        waited for and lost). Right after a Verify (a copied passage pauses for a word or two, then goes on) its
        first WEAK_RAMP weak steps decode 1, then 2 tokens in Decode calls instead, so a draft that pays again soon
        needs no stream closed (replayed, bench/stream_policy_replay.py, docs/benchmark.md: ahead of streaming every
        weak step on every prompt set, 1.047x target-only against 1.046x, 1.035x against 1.017x)."""
        if not self.draft_len.free:
            return False
        return (self.target.stream is not None or self.dry_steps >= WEAK_RAMP
                or self.state.stats.verify_steps == 0)

    def stream(self, total: int, degraded: bool, grow: bool = False) -> list[int]:
        """The next block of target-only tokens from the session's decode stream (one of `total` tokens is opened
        when none is): a paused or target-only session costs what plain decoding does, one stream, no call a block;
        a weak-draft stream's blocks grow (TargetCall.stream_plan)."""
        d = self.target.stream_block(total, degraded, grow)
        record_decode(self.state, len(d.tokens), d.decode_ms, degraded)
        return d.tokens

    def decode(self, n: int, degraded: bool) -> list[int]:
        d = self.target.decode(n, degraded)
        record_decode(self.state, len(d.tokens), d.decode_ms, degraded)
        return d.tokens

    def _overloaded(self) -> bool:
        """Under high load a batched target is compute-bound: a verify of k+1 tokens per session costs more than
        the accepted tokens save, so decode target-only (vLLM's speculative_disable_by_batch_size)."""
        limit, active = self.state.cfg.speculation_max_sessions, self.state.measured.active_sessions
        return limit > 0 and active is not None and active() > limit
