"""A busy target does not compute work whose caller has stopped waiting, and serves prefills one at a time.

Without this, 32 sessions starting at once on 2 loaded cores all passed the orchestrator's 30 s deadline (their
prefills shared the cores and finished together), their retries queued behind the abandoned work, and every later
request failed too (`python -m bench --serving`, docs/benchmark.md)."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from specdec.core.grpc_util import _CALL_DEADLINE, call_deadline, handle_errors
from target_service.engines.batching import VerifyBatcher
from target_service.engines.jobs import VerifyJob, VerifyOutcome, VerifyTask
from target_service.engines.torch import TargetEngine
from specdec.core.sampling import SamplingParams
from tests.harness import TARGET, model


class _SlowEngine:
    """Records what the batcher computes; each batch takes `forward_s`."""

    def __init__(self, forward_s: float):
        self.forward_s = forward_s
        self.computed: list[str] = []

    def verify_many(self, jobs):
        time.sleep(self.forward_s)
        for j in jobs:
            self.computed.append(j.task.session_id)
            j.result = VerifyOutcome(0, 1, j.task.prefix_len + 1, 1.0)


def _job(sid: str) -> VerifyJob:
    return VerifyTask(sid, 0, [1, 2], [], None, SamplingParams()).job()


def test_the_batcher_skips_jobs_whose_caller_stopped_waiting():
    engine = _SlowEngine(2.0)  # "first" computes for 2 s: giving up at the deadline is far from waiting for it
    batcher = VerifyBatcher(engine, window_ms=1, max_batch=1)
    first = threading.Thread(target=batcher.submit, args=(_job("first"),))
    first.start()
    time.sleep(0.05)  # "first" is being computed: the next job waits its turn
    token = _CALL_DEADLINE.set(time.monotonic() + 0.1)
    try:
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match="did not get its turn before the call's deadline"):
            batcher.submit(_job("late"))
        assert time.monotonic() - t0 < 1.5  # gave up at the call's deadline, not when "first" ended nor the 60 s default
    finally:
        _CALL_DEADLINE.reset(token)
    first.join(5)
    assert batcher.submit(_job("next"), timeout=5).cached_len == 1  # the batcher goes on
    assert engine.computed == ["first", "next"]  # "late" was never computed


def test_handle_errors_publishes_the_deadline_and_maps_timeouts():
    seen = []

    class Ctx:
        def time_remaining(self):
            return 2.0

        def abort(self, code, message):
            seen.append((code, message))
            raise grpc.RpcError()

    class Servicer:
        @handle_errors
        def Work(self, request, context):
            seen.append(call_deadline())
            raise TimeoutError("the target was busy")

    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError):
        Servicer().Work(None, Ctx())
    assert t0 + 1.9 < seen[0] <= time.monotonic() + 2.0
    assert seen[1] == (grpc.StatusCode.DEADLINE_EXCEEDED, "the target was busy")
    assert call_deadline() is None  # reset after the call


def test_prefills_run_one_at_a_time_and_a_late_one_is_skipped():
    engine = TargetEngine(model(TARGET))
    inside, most, calls = [0], [0], [0]
    lock = threading.Lock()
    extend = engine.lm.extend

    def counting_extend(*a, **k):
        with lock:
            inside[0] += 1
            calls[0] += 1
            most[0] = max(most[0], inside[0])
        try:
            time.sleep(0.05)
            return extend(*a, **k)
        finally:
            with lock:
                inside[0] -= 1

    engine.lm.extend = counting_extend
    threads = [threading.Thread(target=engine.prefill, args=(f"s{i}", 0, [1 + i, 2, 3, 4])) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert most[0] == 1  # never two prefills at once
    assert all(engine.prefill(f"s{i}", 0, [1 + i, 2, 3, 4]) == 4 for i in range(6))
    before = calls[0]
    token = _CALL_DEADLINE.set(time.monotonic() - 1.0)  # its caller gave up already
    try:
        with pytest.raises(TimeoutError, match="prefill did not start"):
            engine.prefill("late", 0, [5, 6, 7])
    finally:
        _CALL_DEADLINE.reset(token)
    assert calls[0] == before  # no forward for it


class _ThreadRecordingEngine(_SlowEngine):
    def __init__(self):
        super().__init__(0.0)
        self.threads: list[str] = []

    def verify_many(self, jobs):
        self.threads.append(threading.current_thread().name)
        super().verify_many(jobs)


def test_a_lone_sessions_step_runs_in_the_callers_thread_and_concurrent_ones_batch():
    engine = _ThreadRecordingEngine()
    batcher = VerifyBatcher(engine, window_ms=200, max_batch=4)
    alone = []

    def lone_session():
        for _ in range(3):  # one session alone: no hand-off to the batcher thread and back
            alone.append(batcher.submit(_job("alone"), timeout=5).cached_len)

    caller = threading.Thread(target=lone_session, name="caller")
    caller.start()
    caller.join(5)
    assert alone == [1, 1, 1] and engine.threads == ["caller"] * 3
    batcher.forget("alone")
    engine.threads.clear()
    results = []
    both = [threading.Thread(target=lambda s=s: results.append(batcher.submit(_job(s), timeout=5)))
            for s in ("a", "b", "a", "b")]
    for t in both[:2]:
        t.start()
        time.sleep(0.02)
    for t in both[:2]:
        t.join(5)
    for t in both[2:]:  # "a" and "b" are both active now: their steps meet in one batch
        t.start()
    for t in both[2:]:
        t.join(5)
    assert len(results) == 4
    assert engine.threads[-1] == "verify-batcher"
    assert batcher.batched_jobs - batcher.batches >= 1  # at least one batch held both sessions
