"""The orchestrator's critical-path overhead stats (rpc_overhead_ms, store_ms, store_overlapped_ms,
prefetch_wait_ms): what the bench's gRPC + Redis overhead target is measured with."""

import pytest

from orchestrator.generation import LoopConfig
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
        assert 0 <= st["store_overlapped_ms"] <= st["store_ms"]
        if pipeline == "off":
            assert hits == 0 and st["prefetch_wait_ms"] == 0 and st["store_overlapped_ms"] == 0
        else:
            # The next block's prefetch (asleep in the draft) was still running while this block was committed.
            assert st["store_overlapped_ms"] > 0
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
        seen = _record_step_overheads(s.servicer.target_cost)
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
    paid, session 18)."""
    import time

    from tests.harness import INT8_SELF

    cfg = LoopConfig(draft_timeout_floor_ms=5000)
    s = start_stack(redis_url, draft=INT8_SELF, cfg=cfg, forward_ms="measure")
    try:
        engine = s.target_engine
        prefill = engine.prefill
        engine.prefill = lambda *a, **k: (time.sleep(SLEEP_MS / 1e3), prefill(*a, **k))[1]  # a slow prompt
        seen = _record_step_overheads(s.servicer.target_cost)
        prompt = [(7 * i) % 60 + 1 for i in range(40)]
        st = s.client.generate(prompt, max_new_tokens=16, max_draft_len=4, ignore_eos=True).stats
        assert st["kv_imports"] == 1 and st["prefill_ms"] >= SLEEP_MS  # the prompt was prefilled for the draft
        assert seen and max(seen) < SLEEP_MS / 2
    finally:
        s.stop()
