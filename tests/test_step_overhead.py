"""The orchestrator's critical-path overhead stats (rpc_overhead_ms, store_ms, store_overlapped_ms,
prefetch_wait_ms): what the bench's gRPC + Redis overhead target is measured with; and the stepper thread that
takes each block's Redis commit and its send off the steps' path."""

import time

import pytest

from orchestrator.settings import LoopConfig
from tests.harness import DRAFT_SAME, start_stack

pytestmark = pytest.mark.serial  # compares round trips with a sleep: alone on the cores (scripts/test.sh)

PROMPT = [1, 5, 9, 12, 5, 9]
SLEEP_MS = 100.0  # the draft's handler sleeps this long before drafting: to the orchestrator, pure RPC overhead


@pytest.mark.parametrize("pipeline", ["off", "on"])
def test_rpc_overhead_counts_the_calls_a_step_waits_for(redis_url, pipeline):
    cfg = LoopConfig(pipeline=pipeline, pipeline_min_gain_ms=0.0, draft_timeout_floor_ms=5000)
    s = start_stack(redis_url, draft=DRAFT_SAME, cfg=cfg)  # a perfect draft: every block accepted whole
    try:
        servicer = s.draft_servers[0].servicer
        servicer.inject_latency_ms, servicer.latency_enabled = SLEEP_MS, True
        st = s.client.generate(PROMPT, max_new_tokens=24, max_draft_len=4, ignore_eos=True).stats
        steps, hits = st["verify_steps"] + st["decode_steps"], st["pipeline_hits"]
        waited = steps - hits  # steps whose Propose the loop waited for
        assert steps >= 4 and st["store_ms"] > 0
        # Each waited-for Propose slept in its handler (the draft does not report that time); each step's own
        # round trips cost far less than the sleep.
        assert waited * SLEEP_MS <= st["rpc_overhead_ms"] < waited * SLEEP_MS + steps * SLEEP_MS / 2
        # Each block is committed (and sent) while the stepper already runs the next step: off its critical path.
        assert 0 < st["store_overlapped_ms"] <= st["store_ms"]
        if pipeline == "off":
            assert hits == 0 and st["prefetch_wait_ms"] == 0
        else:
            # A prefetched block's Propose ran during the (tiny) verify: the step still waited for most of the
            # sleep, after its verify. That is the prefetch wait, not RPC overhead on the critical path.
            assert hits >= 2
            assert st["prefetch_wait_ms"] >= hits * SLEEP_MS / 2
    finally:
        s.stop()


def _record_step_overheads(cost) -> list[float]:
    """What each step reports to TargetCost as its overhead beyond the target's time (step_ms - server_ms)."""
    seen = []
    observe = cost.observe_step
    cost.observe_step = lambda step_ms, server_ms: (seen.append(step_ms - server_ms), observe(step_ms, server_ms))
    return seen


def test_the_target_step_cost_leaves_out_waiting_for_the_draft(redis_url):
    """TargetCost's per-step overhead (what the goodput draft length adds to every verify) is the step's time
    beyond the target's and the draft's: a step that missed its prefetch waits for the stale one (an n-gram
    draft's; a model draft's is cancelled) and then a fresh Propose, and neither wait is the target's. (The fresh
    Propose's time used to overwrite the stale wait, which then counted as target overhead.)"""
    from tests.harness import DRAFT_EARLY

    cfg = LoopConfig(pipeline="on", pipeline_min_gain_ms=0.0, draft_timeout_floor_ms=5000)
    s = start_stack(redis_url, draft="ngram", cfg=cfg, forward_ms="measure")  # an n-gram prefetch is waited for
    try:
        seen = _record_step_overheads(s.servicer.measured.target_cost)
        servicer = s.draft_servers[0].servicer
        servicer.inject_latency_ms, servicer.latency_enabled = SLEEP_MS, True
        st = s.client.generate(PROMPT, max_new_tokens=32, max_draft_len=4, ignore_eos=True).stats
        assert st["verify_steps"] >= 4 and st["pipeline_hits"] < st["verify_steps"]  # stale prefetches
        assert st["prefetch_wait_ms"] > SLEEP_MS  # steps did wait for the (sleeping) draft's stale prefetches
        assert seen and max(seen) < SLEEP_MS / 2
    finally:
        s.stop()


def test_the_target_step_cost_leaves_out_a_new_sessions_prefill(redis_url):
    """A new session's first step prefills its prompt on the target and hands the KV to the int8 draft: tens of
    ms that are not what a decoding step costs (counted, they made the goodput policy draft 8-12 tokens where 5-7
    paid)."""

    from tests.harness import INT8_SELF

    cfg = LoopConfig(draft_timeout_floor_ms=5000)
    s = start_stack(redis_url, draft=INT8_SELF, cfg=cfg, forward_ms="measure")
    try:
        engine = s.target_engine
        prefill = engine.prefill
        engine.prefill = lambda *a, **k: (time.sleep(SLEEP_MS / 1e3), prefill(*a, **k))[1]  # a slow prompt
        seen = _record_step_overheads(s.servicer.measured.target_cost)
        prompt = [(7 * i) % 60 + 1 for i in range(40)]
        st = s.client.generate(prompt, max_new_tokens=16, max_draft_len=4, ignore_eos=True).stats
        assert st["kv_imports"] == 1 and st["prefill_ms"] >= SLEEP_MS  # the prompt was prefilled for the draft
        assert seen and max(seen) < SLEEP_MS / 2
    finally:
        s.stop()


COMMIT_MS = 40.0  # a slow session store: every block's commit sleeps this long first


def _slow_commits(store, ms: float) -> list[tuple[str, int]]:
    """Make every commit sleep `ms` first; returns a log of (session, tokens stored) after each."""
    log, commit = [], store.commit

    def slow(rec, kept, lease=""):
        time.sleep(ms / 1e3)
        out = commit(rec, kept, lease)
        log.append((rec.session_id, len(rec.generated)))
        return out

    store.commit = slow
    return log


def test_a_blocks_commit_overlaps_the_next_step_and_is_stored_before_it_is_sent(redis_url):
    """The stepper thread drafts and verifies block k+1 while the stream stores block k in Redis and sends it: a
    slow store (or a slow client) no longer lengthens every step. Each block still reaches the client only after
    it is stored."""
    s = start_stack(redis_url, draft=DRAFT_SAME, cfg=LoopConfig(draft_timeout_floor_ms=5000))
    try:
        servicer = s.draft_servers[0].servicer
        servicer.inject_latency_ms, servicer.latency_enabled = SLEEP_MS, True  # each step takes > SLEEP_MS
        stored = _slow_commits(s.servicer.store, COMMIT_MS)
        t0 = time.perf_counter()
        received, sid, stats = 0, "", {}
        for msg in s.client.stream(PROMPT, max_new_tokens=24, max_draft_len=4, ignore_eos=True):
            sid = msg.session_id or sid
            if msg.token_ids:
                received = msg.offset + len(msg.token_ids)
                assert max(n for k, n in stored if k == sid) >= received  # stored before it was sent
            if msg.HasField("stats"):
                stats = msg.stats
        wall_ms = (time.perf_counter() - t0) * 1e3
        steps = stats.verify_steps + stats.decode_steps
        assert received == 24 and steps >= 4
        assert stats.store_ms >= steps * COMMIT_MS
        # Sequentially each step would take over SLEEP_MS + COMMIT_MS (the old loop: ~755 ms for 5 steps, against a
        # bound of 680); overlapped, only the last commit is not hidden behind a step (~590 ms).
        assert wall_ms < steps * SLEEP_MS + COMMIT_MS * (steps - 0.5)
        assert stats.store_overlapped_ms >= stats.store_ms - 2 * COMMIT_MS
    finally:
        s.stop()


def test_a_stream_cancelled_while_the_stepper_is_ahead_stores_only_what_it_sent(redis_url):
    """With commits slower than steps the stepper runs up to STREAM_AHEAD blocks ahead of the stream. A client
    that goes away then leaves the session as stored (the blocks it was sent, the step count that goes with them);
    resuming it samples the same tokens as a run that was never interrupted (the sampling seeds follow the step)."""
    s = start_stack(redis_url, draft=DRAFT_SAME, cfg=LoopConfig(draft_timeout_floor_ms=5000))
    try:
        kw = dict(max_new_tokens=64, max_draft_len=4, ignore_eos=True, temperature=0.9, seed=7)
        reference = s.client.generate(PROMPT, **kw).token_ids
        _slow_commits(s.servicer.store, COMMIT_MS)
        call = s.client.stream(PROMPT, **kw)
        sent, sid = [], ""
        for msg in call:
            sid = msg.session_id or sid
            sent.extend(msg.token_ids)
            if len(sent) >= 8:
                break
        time.sleep(3 * COMMIT_MS / 1e3)  # the stepper fills the handoff meanwhile
        call.cancel()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and s.client.get_session(sid).status == "running":
            time.sleep(0.05)
        info = s.client.get_session(sid)
        assert info.status == "cancelled"
        stored = list(info.generated_token_ids)
        assert stored[: len(sent)] == sent and stored == reference[: len(stored)]
        assert len(stored) < len(reference)  # it stopped early
        rest = s.client.generate(resume_session_id=sid, resume_from=len(stored), **kw).token_ids
        assert stored + rest == reference
    finally:
        s.stop()
