"""The draft replicas' circuit breaker (closed -> open -> half-open with one probe -> closed or open again) and the
pool's periodic health checks."""

from __future__ import annotations

import time
import types

import pytest

from orchestrator.replicas.clients import DraftReply
from orchestrator.replicas.draft_pool import CLOSED, HALF_OPEN, OPEN, CircuitBreaker
from orchestrator.replicas.pool import PoolSettings


def test_breaker_opens_after_its_threshold_probes_once_and_backs_off_on_a_failed_probe(monkeypatch):
    now = [100.0]
    monkeypatch.setattr("orchestrator.replicas.pool.time.monotonic", lambda: now[0])
    b = CircuitBreaker(open_s=1.0, max_open_s=3.0, failure_threshold=2)
    b.failure()
    assert b.state == CLOSED and b.allow()
    b.failure()
    assert b.state == OPEN and not b.allow()
    now[0] += 1.0  # the back-off is over: one caller probes, the others wait for its outcome
    assert b.allow() and b.state == HALF_OPEN and not b.allow()
    b.failure()  # the probe failed: open again, twice as long
    assert b.state == OPEN and b.open_s == 2.0
    now[0] += 1.5
    assert not b.allow()
    now[0] += 0.5
    assert b.allow()
    b.failure()
    assert b.open_s == 3.0  # capped at max_open_s
    b.health_ok()  # a passing health check: probe on the next call without waiting out the back-off
    assert b.state == HALF_OPEN and b.allow()
    b.success()
    assert (b.state, b.failures, b.open_s) == (CLOSED, 0, 1.0) and b.allow()


def test_a_breaker_opened_by_timeouts_waits_out_its_back_off_though_health_checks_pass(monkeypatch):
    """A slow replica answers health checks: were they to end its back-off, a session would pay a draft deadline
    probing it at every check. Failures that health checks do see (unreachable) still end early."""
    now = [100.0]
    monkeypatch.setattr("orchestrator.replicas.pool.time.monotonic", lambda: now[0])
    b = CircuitBreaker(open_s=1.0, failure_threshold=1)
    b.failure(health_blind=True)  # a timeout
    b.health_ok()
    assert b.state == OPEN and not b.allow()
    now[0] += 1.0
    assert b.allow() and b.state == HALF_OPEN  # the back-off is over: one probe
    b.failure(health_blind=True)
    b.health_ok()
    assert b.state == OPEN and b.open_s == 2.0 and not b.allow()
    b.health_failed()  # now the health check sees it too (a hung replica): its recovery ends the back-off
    b.health_ok()
    assert b.state == HALF_OPEN and b.allow()
    b.success()
    b.failure()  # unreachable (a connection refused): the health check's recovery ends the back-off
    b.health_ok()
    assert b.state == HALF_OPEN


def test_a_probe_slot_taken_by_a_step_that_made_no_call_is_given_back():
    """A step that pick() let through a half-open breaker but that used a prefetched block made no call: the next
    caller must be able to probe, or the replica would stay half-open with a probe in flight for ever."""
    b = CircuitBreaker(open_s=1.0, failure_threshold=1)
    b.failure()
    b.health_ok()
    assert b.allow() and not b.allow()
    b.no_call()
    assert b.state == HALF_OPEN and b.allow()

    replica = types.SimpleNamespace(address="draft:1", breaker=CircuitBreaker(open_s=1.0, failure_threshold=1))
    replica.breaker.failure()
    replica.breaker.health_ok()
    assert replica.breaker.allow()  # the step's pick()
    from orchestrator.loop.prefetch import Prefetcher
    from tests.harness import loop_state

    state = loop_state()
    rec = state.rec
    prefetcher = Prefetcher(state, draft=None)
    prefetcher.prefetched, prefetcher.prefetched_for = DraftReply([7, 8], [], 5, 1.0, False), (3, "draft:1")
    reply = prefetcher.take(replica, 2)
    assert reply.tokens == [7, 8] and rec.stats.pipeline_hits == 1
    assert replica.breaker.allow()  # the probe is still to come


def _wait(cond, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.01)
    return cond()


@pytest.mark.serial  # time bounds on a server's stop: alone on the cores (scripts/test.sh)
@pytest.mark.parametrize("grace", [0.0, 5.0])
def test_health_checks_open_the_breaker_when_a_replica_goes_away(grace):
    """A stopped replica (killed: grace 0; graceful: it refuses new calls) fails the pool's next health check, which
    opens its breaker before any session calls it; a graceful stop has no stream of the pool's to wait out."""
    from orchestrator.replicas.draft_pool import DraftPool
    from tests.harness import start_draft

    server = start_draft("ngram")
    pool = DraftPool([server.address], PoolSettings(health_interval_s=0.5))
    try:
        replica = pool.replicas[0]
        assert _wait(lambda: replica.check_health(1.0))
        assert replica.breaker.state == CLOSED
        t0 = time.monotonic()
        server.stop(grace)
        assert time.monotonic() - t0 < min(grace, 2.0) + 1.5
        assert _wait(lambda: replica.breaker.state == OPEN, 2.0)
    finally:
        pool.close()


@pytest.mark.serial  # time bounds on a server's stop
def test_a_draft_server_watched_by_several_orchestrators_stops_promptly():
    """Four orchestrators' pools on one draft service. A pool holding a Health.Watch stream per replica made the
    server's graceful shutdown deadlock in grpc's health servicer (the NOT_SERVING push to one stream waits while
    that stream's callback waits for the servicer's lock): a stop hung for good in some runs. Each stop runs in a
    thread so that a hang fails the test instead of holding it."""
    import threading

    from orchestrator.replicas.draft_pool import DraftPool
    from tests.harness import start_draft

    for attempt in range(4):
        server = start_draft("ngram")
        pools = [DraftPool([server.address], PoolSettings(health_interval_s=0.1)) for _ in range(4)]
        try:
            assert _wait(lambda: all(p.replicas[0].check_health(1.0) for p in pools))
            time.sleep(0.3)  # several health checks in between
            stopper = threading.Thread(target=server.stop, args=(1.0,), daemon=True)
            t0 = time.monotonic()
            stopper.start()
            stopper.join(3.0)
            assert not stopper.is_alive(), f"stop {attempt} still running after {time.monotonic() - t0:.1f} s"
        finally:
            for p in pools:
                p.close()


@pytest.mark.serial  # time bounds on a server's stop
def test_a_server_with_several_health_watch_streams_open_stops_cleanly_every_time():
    """Standing Health.Watch streams (a draft pool of an older orchestrator, a gRPC health prober) on a server that
    stops: grpc's health servicer pushed NOT_SERVING to them while holding the lock a closing stream's callback
    needs, and a stop() hung. Each watcher must see NOT_SERVING and its stream end, and the stop return promptly,
    many times in a row (each stop on a thread, so that a hang fails the test instead of holding it)."""
    import threading

    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from specdec.core.grpc_util import ServiceServer, make_channel

    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    for attempt in range(12):
        server = ServiceServer("127.0.0.1:0").start()
        channels = [make_channel(server.address) for _ in range(5)]
        seen: list[list[int]] = [[] for _ in channels]

        def watch(channel, out):
            try:
                for reply in health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service="")):
                    out.append(reply.status)
            except grpc.RpcError:
                out.append(-1)  # cancelled by the server's stop instead of ended by it

        readers = [threading.Thread(target=watch, args=(c, out), daemon=True) for c, out in zip(channels, seen)]
        try:
            for r in readers:
                r.start()
            assert _wait(lambda: all(out[:1] == [serving] for out in seen), 5.0)
            stopper = threading.Thread(target=server.stop, args=(1.0,), daemon=True)
            t0 = time.monotonic()
            stopper.start()
            stopper.join(4.0)
            assert not stopper.is_alive(), f"stop {attempt} still running after {time.monotonic() - t0:.1f} s"
            for r in readers:
                r.join(2.0)
            assert all(out == [serving, not_serving] for out in seen), (attempt, seen)
        finally:
            for c in channels:
                c.close()


def test_a_target_restarted_with_another_model_is_checked_again_before_it_gets_sessions():
    """A target replica goes away and a server with another model comes up on its address: once its breaker opened
    (or a health check failed) its ModelInfo counts as unchecked, it gets no session until asked again, and then
    it is refused; restarted with the right model once more, it serves again."""
    from orchestrator.replicas.target_pool import IncompatibleTargets, TargetPool, model_mismatch
    from specdec.v1 import common_pb2

    reference = common_pb2.ModelInfo(model_name="m", vocab_size=64, tokenizer_fingerprint="tok-a", max_context=128)
    other = common_pb2.ModelInfo(model_name="other", vocab_size=64, tokenizer_fingerprint="tok-b", max_context=128)
    now_serving = [reference]

    def check(replica, info):
        problem = model_mismatch(reference, info)
        if problem:
            raise IncompatibleTargets(problem)

    pool = TargetPool(["127.0.0.1:1"], PoolSettings(health_interval_s=3600), on_info=check)
    try:
        replica = pool.replicas[0]
        replica.client.close()  # a stand-in answers GetInfo for whatever server is on the address
        replica.client = types.SimpleNamespace(info=lambda timeout=None: now_serving[0], close=lambda: None,
                                               release_async=lambda *a, **k: None)
        pool._ask_info(replica)
        assert pool.place("s1") is replica
        pool.leave(replica)
        replica.breaker.failure()
        replica.breaker.failure()  # the calls failed: it went away (the breaker opens)
        assert replica.breaker.state == OPEN and replica.info is None
        now_serving[0] = other  # what answers on its address now
        replica.breaker.health_ok()
        assert pool.place("s2") is None  # healthy again, but not checked yet: no session
        pool._ask_info(replica)  # the health loop's next passing check
        assert replica.refused and "model" in replica.refused
        assert pool.place("s3") is None and not pool.any_available()
        replica.breaker.health_failed()
        pool._recheck(replica)  # the health loop on a failed check: restarted once more, with the right model
        now_serving[0] = reference
        replica.breaker.health_ok()
        pool._ask_info(replica)
        assert replica.refused is None and pool.place("s4") is replica
    finally:
        pool.close()
