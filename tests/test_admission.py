"""Admission control (orchestrator/policy/admission.py): generations beyond --max-running wait in a FIFO queue instead of
all decoding at once; a wait past the queue timeout is RESOURCE_EXHAUSTED (HTTP 429); a cancelled waiter leaves.
The queue alone, then real services (tiny models, real Redis) through the gRPC and HTTP APIs."""

import re
import threading
import time

import grpc
import httpx2 as httpx
import pytest

from orchestrator.policy.admission import Admission, QueueCancelled, QueueTimeout
from orchestrator.api.http import HttpServer
from orchestrator.replicas.target_pool import merge_infos
from specdec import observability as telemetry
from specdec.v1 import common_pb2
from specdec.core.kv_cache import SessionCacheStore
from specdec.core.sampling import SamplingParams
from target_service.engines.torch import TargetEngine
from tests.harness import TARGET, count_sessions_at_target, model, run_sampling, start_stack
from target_service.engines.jobs import DecodeTask, VerifyTask

PROMPTS = [[1, 5, 9, 12], [3, 3, 20, 21], [7, 2, 7, 2, 40], [11, 13, 17], [4, 8, 15, 16, 23], [30, 1, 30, 2]]


def wait_until(condition, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


# -- the queue alone ----------------------------------------------------------------------------------------------

def test_queue_admits_in_arrival_order_within_the_limit():
    adm = Admission(lambda: 1, timeout_s=10, max_queued=8)
    first = adm.ticket("a")
    assert adm.admit(first) == pytest.approx(0, abs=0.05) and adm.running() == 1
    order, threads = [], []
    for key in "bcd":
        def wait(ticket=adm.ticket(key)):
            adm.admit(ticket)
            order.append(ticket.key)
            time.sleep(0.02)
            adm.release(ticket)
        threads.append(threading.Thread(target=wait))
        threads[-1].start()
        wait_until(lambda n=len(threads): adm.queued() == n)  # each joins the queue before the next
    assert order == [] and adm.running() == 1
    adm.release(first)
    for t in threads:
        t.join(5)
    assert order == ["b", "c", "d"] and adm.running() == 0 and adm.queued() == 0


def test_queue_times_out_with_a_message_and_is_bounded():
    adm = Admission(lambda: 1, timeout_s=0.2, max_queued=1)
    running = adm.ticket("a")
    adm.admit(running)
    t0 = time.monotonic()
    with pytest.raises(QueueTimeout, match=r"server busy: 1 generations running, 0 queued; waited 0\.2 s"):
        adm.admit(adm.ticket("b"))
    assert 0.2 <= time.monotonic() - t0 < 2 and adm.queued() == 0
    # A queue timeout far above the waits below: a loaded host's scheduling delays cannot pass for the timeout.
    adm = Admission(lambda: 1, timeout_s=30.0, max_queued=1)
    adm.admit(adm.ticket("a"))
    # The caller's own deadline shortens the wait.
    t0 = time.monotonic()
    with pytest.raises(QueueTimeout):
        adm.admit(adm.ticket("c"), wait_s=0.05)
    assert time.monotonic() - t0 < 10
    # Bounded: with one waiting, the next is refused at once.
    waiter, ended = adm.ticket("d"), []
    waiting = threading.Thread(target=lambda: ended.append(pytest.raises(Exception, adm.admit, waiter).type))
    waiting.start()
    wait_until(lambda: adm.queued() == 1)
    t0 = time.monotonic()
    with pytest.raises(QueueTimeout, match="1 queued"):
        adm.admit(adm.ticket("e"))
    assert time.monotonic() - t0 < 10
    adm.cancel_ticket(waiter)  # rather than wait out the 30 s
    waiting.join(5)
    assert ended == [QueueCancelled] and adm.queued() == 0


def test_cancelled_waiters_leave_the_queue_and_the_next_moves_up():
    adm = Admission(lambda: 1, timeout_s=10, max_queued=8)
    running = adm.ticket("a")
    adm.admit(running)
    results = {}

    def wait(ticket):
        try:
            adm.admit(ticket)
            results[ticket.key] = "admitted"
        except QueueCancelled:
            results[ticket.key] = "cancelled"

    tickets = [adm.ticket("b", owner="alice"), adm.ticket("c"), adm.ticket("d")]
    threads = [threading.Thread(target=wait, args=(t,)) for t in tickets]
    for i, t in enumerate(threads):
        t.start()
        wait_until(lambda n=i + 1: adm.queued() == n)
    assert not adm.cancel("b", owner="mallory")  # another caller's generation is not found
    assert adm.cancel("b", owner="alice")  # CancelSession
    adm.cancel_ticket(tickets[1])  # the client went away
    threads[0].join(5)
    threads[1].join(5)
    assert results == {"b": "cancelled", "c": "cancelled"} and adm.queued() == 1
    assert not adm.cancel("b")  # gone already
    adm.release(running)
    threads[2].join(5)
    assert results["d"] == "admitted" and adm.running() == 1


def test_a_raised_limit_admits_the_waiters():
    limit = [1]
    adm = Admission(lambda: limit[0], timeout_s=10, max_queued=8)
    adm.admit(adm.ticket("a"))
    waiters = [threading.Thread(target=adm.admit, args=(adm.ticket(k),)) for k in "bc"]
    for w in waiters:
        w.start()
    wait_until(lambda: adm.queued() == 2)
    limit[0] = 3  # a replica joined the pool
    for w in waiters:
        w.join(5)
    assert adm.running() == 3 and adm.queued() == 0


def test_pool_capacity_is_the_replicas_cached_and_batched_sessions():
    info = dict(model_name="m", vocab_size=64, max_context=512)
    a = common_pb2.ModelInfo(**info, max_sessions=64, max_batch=16)
    b = common_pb2.ModelInfo(**info, max_sessions=8, max_batch=16)
    merged = merge_infos([a, b])
    assert merged.max_sessions == 8  # per replica, the strictest
    assert merge_infos([a, common_pb2.ModelInfo(**info)]).max_sessions == 0  # one does not say: unknown

    class Replica:
        refused = None

        def __init__(self, info):
            self.info = info

    from orchestrator.replicas.target_pool import TargetPool

    pool = TargetPool.__new__(TargetPool)
    pool.replicas = [Replica(a), Replica(b), Replica(None)]
    assert pool.capacity(merged) == 16 + 8 + 8  # a: its batch; b: its cache; the unasked one: the pool's
    pool.replicas[2].refused = "another model"
    assert pool.capacity(merged) == 24
    pool.replicas.append(Replica(common_pb2.ModelInfo(**info, max_sessions=4, max_batch=1)))  # no batching
    assert pool.capacity(merged) == 28
    pool.replicas.append(Replica(common_pb2.ModelInfo(**info)))
    assert pool.capacity(merged) == 0


@pytest.mark.parametrize("window_ms", [0.0, 5.0])
def test_a_target_only_prompt_prefills_through_the_one_at_a_time_gate(window_ms):
    """A Decode carrying a prompt prefills it as a speculative session's Prefill does (one at a time, in arrival
    order), not as a long row of a batch every decoding session waits for; the tokens are the same."""
    engine = TargetEngine(model(TARGET), SessionCacheStore(), batch_window_ms=window_ms)
    prefills, real = [], engine._prefill_session  # what prefill() runs: the gate, then the forward
    engine._prefill_session = lambda sess, prefix_len, delta: prefills.append(
        (sess.session_id, prefix_len, list(delta))) or real(sess, prefix_len, delta)
    prompt = PROMPTS[4]
    whole = engine.verify(VerifyTask("ref", 0, prompt, [], None, SamplingParams(), 0, 0)).next_token  # one forward
    tokens, cached, _ = engine.decode(DecodeTask("s", 0, prompt, 3, SamplingParams(), 0, 0))
    assert prefills == [("s", 0, prompt[:-1])] and tokens[0] == whole
    engine.decode(DecodeTask("s", cached, [tokens[-1]], 2, SamplingParams(), 0, 1))  # a step: nothing to prefill
    assert len(prefills) == 1


# -- through the services -----------------------------------------------------------------------------------------

def test_six_generations_with_two_running_all_complete_as_target_only(redis_url):
    stack = start_stack(redis_url, draft="ngram", max_running=2)
    try:
        refs = [stack.client.generate(p, max_new_tokens=24, ignore_eos=True, speculation=False).token_ids
                for p in PROMPTS]
        peak = count_sessions_at_target(stack.target_engine, delay_s=0.005)
        before = telemetry.snapshot()
        results = [None] * len(PROMPTS)

        def run(i):  # half speculative, half target-only: both go through admission
            results[i] = stack.client.generate(PROMPTS[i], max_new_tokens=24, ignore_eos=True,
                                               speculation=None if i % 2 else False)

        gauges = {"queued": 0, "running": 0}

        def sample():  # the exported gauges, as a dashboard sees them
            snap = telemetry.snapshot()
            for k in gauges:
                gauges[k] = max(gauges[k], telemetry.metric_value(snap, f"specdec.admission.{k}"))

        run_sampling(run, len(PROMPTS), sample)
        after = telemetry.snapshot()
        assert gauges["running"] <= 2 and gauges["queued"] >= 1, gauges
        assert [r.token_ids for r in results] == refs
        assert 1 <= peak[0] <= 2  # never more than two sessions at the target at once
        queued = [r.stats["queued_ms"] for r in results]
        assert sum(q > 0 for q in queued) >= len(PROMPTS) - 2, queued  # all but the first two waited
        waits = (telemetry.metric_value(after, "specdec.admission.queue_wait")
                 - telemetry.metric_value(before, "specdec.admission.queue_wait"))
        assert waits == len(PROMPTS)
        assert stack.servicer.admission.running() == 0 and stack.servicer.admission.queued() == 0
        assert telemetry.metric_value(telemetry.snapshot(), "specdec.admission.queued") == 0
    finally:
        stack.stop()


def test_queue_timeout_cancel_and_http_429(redis_url):
    stack = start_stack(redis_url, draft="ngram", max_running=1, queue_timeout_s=0.5)
    http = HttpServer("127.0.0.1:0").start(stack.servicer)
    gate = threading.Event()
    try:
        count_sessions_at_target(stack.target_engine, gate=gate)  # the running generation holds its slot
        admission = stack.servicer.admission
        holder = {}
        running = threading.Thread(target=lambda: holder.update(r=stack.client.generate(
            PROMPTS[0], max_new_tokens=8, ignore_eos=True, speculation=False)))
        running.start()
        wait_until(lambda: admission.running() == 1)
        # A wait past the queue timeout: RESOURCE_EXHAUSTED, saying why.
        with pytest.raises(grpc.RpcError) as refused:
            stack.client.generate(PROMPTS[1], max_new_tokens=8)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        # It waited the whole timeout (a loaded machine wakes the waiter a little later, so no upper bound).
        busy = re.search(r"server busy: 1 generations running, 0 queued; waited (\d+\.\d) s "
                         r"\(the queue timeout is 0\.5 s\)", refused.value.details())
        assert busy and float(busy.group(1)) >= 0.5, refused.value.details()
        # The HTTP API goes through the same queue: 429, as OpenAI answers an overloaded server.
        reply = httpx.post(http.url + "/v1/completions", json={"model": TARGET, "prompt": PROMPTS[1], "max_tokens": 4},
                           timeout=30)
        assert reply.status_code == 429 and "server busy" in reply.json()["error"]["message"]
        # CancelSession of a queued generation: the session id comes in the response headers while it waits.
        stack.servicer.admission.timeout_s = 30
        call = stack.client.stream(PROMPTS[2], max_new_tokens=8)
        sid = dict(call.initial_metadata())["x-specdec-session-id"]
        assert admission.queued() == 1
        assert stack.client.cancel(sid) is True
        with pytest.raises(grpc.RpcError) as cancelled:
            list(call)
        assert cancelled.value.code() == grpc.StatusCode.CANCELLED and admission.queued() == 0
        # A client that cancels its call while queued leaves the queue too.
        call = stack.client.stream(PROMPTS[3], max_new_tokens=8)
        call.initial_metadata()
        assert admission.queued() == 1
        call.cancel()
        wait_until(lambda: admission.queued() == 0, timeout=5)
        # An HTTP client that disconnects while queued leaves it as well.
        with pytest.raises(httpx.TimeoutException):
            httpx.post(http.url + "/v1/completions", json={"model": TARGET, "prompt": PROMPTS[3], "max_tokens": 4},
                       timeout=1.0)
        wait_until(lambda: admission.queued() == 0, timeout=5)
        gate.set()
        running.join(30)
        assert len(holder["r"].token_ids) == 8 and holder["r"].stats["queued_ms"] == 0
        assert admission.running() == 0
    finally:
        gate.set()
        http.stop()
        stack.stop()
