"""Admission follows the target's measured latency (orchestrator/policy/admission.py AdaptiveLimit): while the target's
calls come back close to their deadline it runs fewer generations at once, so admitted ones finish instead of all
sharing a starved target until every call passes its deadline. The limiter alone on a synthetic latency feed, then
a real stack whose target is slow."""

import threading
import time

import grpc
import pytest

from orchestrator.policy.admission import START_LIMIT, Admission, AdaptiveLimit
from orchestrator.settings import LoopConfig
from specdec import observability as telemetry
from tests.harness import count_sessions_at_target, run_sampling, start_stack

PROMPTS = [[1, 5, 9, 12], [3, 3, 20, 21], [7, 2, 7, 2, 40], [11, 13, 17], [4, 8, 15, 16, 23], [30, 1, 30, 2]]
FAST, SLOW, BETWEEN = 0.001, 0.34, 0.15  # fractions of a call's deadline


def feed(lim: AdaptiveLimit, fraction: float, ceiling: int, calls: int, running=None) -> list[int]:
    """`calls` observations; running: as many as the limit allows unless given. The limit after each."""
    seen = []
    for _ in range(calls):
        lim.observe(fraction, lim.limit(ceiling) if running is None else running, ceiling)
        seen.append(lim.limit(ceiling))
    return seen


def test_the_limit_drops_under_slow_calls_and_recovers_within_its_bounds():
    lim = AdaptiveLimit()
    assert lim.limit(16) == START_LIMIT and lim.limit(2) == 2  # a fresh one; the ceiling caps it
    # Fast calls with the limit in use: it doubles per round of calls up to the ceiling, never past it.
    assert feed(lim, FAST, 16, 200)[-1] == 16 and lim.value == 16
    # Calls near their deadline with all 16 running: a round of them about halves it; it goes down to 1, never below.
    seen = feed(lim, SLOW, 16, 200, running=16)
    assert 6 <= seen[15] <= 10, seen[:16]
    assert seen == sorted(seen, reverse=True) and seen[-1] == 1 and lim.value >= 1
    assert feed(lim, 5.0, 16, 5) == [1] * 5  # calls past their deadline: still 1
    # Calls neither near their deadline nor far from it hold it.
    assert feed(lim, BETWEEN, 16, 50) == [1] * 50
    # Fast calls again: it comes back one per round of calls (additive), up to the ceiling.
    seen = feed(lim, FAST, 16, 1000)
    assert seen[-1] == 16 and max(seen) == 16
    assert seen.index(16) > 100  # gradual: 1 + 2 + ... + 15 calls, not a doubling per round
    assert all(b - a in (0, 1) for a, b in zip(seen, seen[1:]))


def test_fast_calls_raise_it_only_while_it_is_in_use_and_a_lower_ceiling_holds_at_once():
    lim = AdaptiveLimit()
    assert feed(lim, FAST, 16, 100, running=1) == [START_LIMIT] * 100  # one stream says nothing about sixteen
    feed(lim, FAST, 16, 100)
    assert lim.limit(16) == 16
    lim.observe(FAST, 3, ceiling=3)  # replicas left the pool
    assert lim.value == 3 and lim.limit(16) == 3


def test_admission_runs_what_the_latency_allows_reports_it_and_a_raise_admits_the_waiters():
    adm = Admission(lambda: 8, timeout_s=10, max_queued=8)
    assert adm.current_limit() == START_LIMIT
    gauge = telemetry.metric_value(telemetry.snapshot(), "specdec.admission.limit")  # other admissions' too
    tickets = [adm.ticket(str(i)) for i in range(START_LIMIT)]
    for t in tickets:
        adm.admit(t)
    for _ in range(50):
        adm.observe(10.0, 30.0)  # a third of the deadline, with 4 running
    assert adm.current_limit() == 1
    assert telemetry.metric_value(telemetry.snapshot(), "specdec.admission.limit") == gauge - (START_LIMIT - 1)
    for t in tickets[1:]:
        adm.release(t)
    waiter = adm.ticket("w")
    admitted = threading.Thread(target=adm.admit, args=(waiter,))
    admitted.start()
    deadline = time.monotonic() + 10
    while adm.queued() != 1:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert adm.running() == 1  # one running, the limit 1: the waiter waits
    adm.observe(0.01, 30.0)  # fast, with the limit in use: 2
    admitted.join(10)
    assert waiter.running and adm.running() == 2 and adm.current_limit() == 2
    static = Admission(lambda: 8, timeout_s=10, max_queued=8, adaptive=False)
    for _ in range(20):
        static.observe(29.0, 30.0)
    assert static.current_limit() == 8


# -- through the services -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("adaptive", [False, True], ids=["static", "adaptive"])
def test_a_slow_target_runs_fewer_generations_instead_of_failing_them_all(redis_url, adaptive):
    """12 generations at once with a static limit of 12, on a target whose calls take 0.2 s each, one at a time,
    against a 2 s call deadline: twelve at once make a call wait 2.4 s, so admitted generations fail on the
    deadline (what `bench --serving` saw at 64 streams on a starved CPU). Adaptive, the limit drops as the calls
    near their deadline: every generation completes (or would be refused by the queue timeout)."""
    cfg = LoopConfig(default_draft_len=4, adaptive_draft_len=False, draft_timeout_floor_ms=5000,
                     target_timeout_s=2.0, target_grace_s=2.0, fallback_chunk=4)
    n = 12
    stack = start_stack(redis_url, draft="ngram", cfg=cfg, max_running=n, queue_timeout_s=60,
                        **({} if adaptive else {"adaptive_admission": False}))
    try:
        peak = count_sessions_at_target(stack.target_engine, delay_s=0.2, serial=True)
        results, errors = [None] * n, [None] * n

        def run(i):
            try:
                results[i] = stack.client.generate(PROMPTS[i % len(PROMPTS)] + [i + 1], max_new_tokens=12,
                                                   ignore_eos=True, speculation=False)
            except grpc.RpcError as e:
                errors[i] = (e.code(), e.details())

        limits = set()
        run_sampling(run, n, lambda: limits.add(stack.servicer.admission.current_limit()))
        failed = [e for e in errors if e is not None and e[0] != grpc.StatusCode.RESOURCE_EXHAUSTED]
        if not adaptive:
            # The reproduction: admitted generations fail on the target's deadline.
            assert failed and all("eadline" in detail for _, detail in failed), errors
            assert peak[0] > START_LIMIT
            return
        assert failed == [], failed
        assert all(r is not None and len(r.token_ids) == 12 for r, e in zip(results, errors) if e is None)
        assert peak[0] <= START_LIMIT  # never more at the target than a fresh limit allows
        assert stack.servicer.admission.current_limit() < START_LIMIT and min(limits) < START_LIMIT
        assert stack.servicer.admission.running() == 0 and stack.servicer.admission.queued() == 0
    finally:
        stack.stop()


def test_the_admission_flag():
    import argparse

    from orchestrator.api import server

    p = argparse.ArgumentParser()
    server.add_arguments(p)
    assert p.parse_args([]).admission == "adaptive"
    assert p.parse_args(["--admission", "static"]).admission == "static"
    with pytest.raises(SystemExit):
        p.parse_args(["--admission", "sometimes"])
