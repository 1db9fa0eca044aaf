"""A session has one writer across orchestrator processes: the Redis lease (orchestrator/store/session_store.py).

Two orchestrators on one Redis (two stacks, as two replicas behind a load balancer would be): a resume of a
session that is streaming elsewhere is refused, a stream whose lease was taken stops without writing, a crashed
holder's lease is waited out, and CancelSession reaches a stream on the other orchestrator.
"""

import threading
import time

import grpc
import pytest

from orchestrator.store.session_store import KEY_PREFIX, LeaseLost, MemorySessionStore, RedisSessionStore, SessionRecord
from specdec.v1 import orchestrator_pb2 as opb
from tests.harness import DRAFT_EARLY as DRAFT, TARGET, start_stack

pytestmark = pytest.mark.serial  # timing-sensitive: runs after the parallel part, alone (scripts/test.sh)


def _store(redis_url, lease_s=5.0):
    return RedisSessionStore(redis_url, lease_ttl_s=lease_s)


@pytest.mark.parametrize("kind", ["redis", "memory"])
def test_a_commit_is_fenced_by_the_lease(redis_url, kind):
    store = _store(redis_url) if kind == "redis" else MemorySessionStore()
    rec = SessionRecord("lease-fence", [1, 2, 3], {"owner": ""})
    store.create(rec)
    assert store.acquire_lease(rec.session_id, "A") is None
    rec.generated += [7, 8]
    store.commit(rec, [7, 8], lease="A")
    rec.generated += [9]
    with pytest.raises(LeaseLost) as e:
        store.commit(rec, [9], lease="B")  # another stream's write: refused, nothing written
    assert e.value.holder == "A"
    assert store.load(rec.session_id).generated == [7, 8]
    store.release_lease(rec.session_id, "B")  # not B's to release
    assert store.lease_holder(rec.session_id) == "A"
    store.release_lease(rec.session_id, "A")
    assert store.lease_holder(rec.session_id) is None
    with pytest.raises(LeaseLost):
        store.commit(rec, [9], lease="B")  # a free lease is not B's: only acquiring it makes B the writer
    assert store.acquire_lease(rec.session_id, "B") is None
    store.commit(rec, [9], lease="B")
    assert store.lease_holder(rec.session_id) == "B" and store.load(rec.session_id).generated == [7, 8, 9]
    # The renewal reports a lease another stream holds, and keeps its own.
    assert store.renew_leases({rec.session_id: "A"}) == {rec.session_id}
    assert store.renew_leases({rec.session_id: "B"}) == set()


def test_a_dead_holders_lease_is_waited_out_a_live_one_is_refused(redis_url):
    store = _store(redis_url, lease_s=0.6)
    t0 = time.monotonic()
    assert store.acquire_lease("lease-dead", "crashed") is None
    assert store.acquire_lease("lease-dead", "next") is None  # never renewed: expires, then it is ours
    assert 0.4 < time.monotonic() - t0 < 3.0
    assert store.lease_holder("lease-dead") == "next"

    stop = threading.Event()
    assert store.acquire_lease("lease-live", "alive") is None

    def heartbeat():
        while not stop.wait(0.1):
            store.renew_leases({"lease-live": "alive"})

    threading.Thread(target=heartbeat, daemon=True).start()
    try:
        t0 = time.monotonic()
        assert store.acquire_lease("lease-live", "other") == "alive"
        assert time.monotonic() - t0 < 0.6  # refused as soon as a renewal shows the holder is alive
    finally:
        stop.set()


def _slow(stack, seconds=0.02):
    """Make this stack's target take `seconds` per step, so a stream is still running while the test acts."""
    eng = stack.target_engine
    verify_many, decode = eng.verify_many, eng.decode

    def slow_verify_many(jobs):
        time.sleep(seconds)
        return verify_many(jobs)

    def slow_decode(*a, **k):
        time.sleep(seconds)
        return decode(*a, **k)

    eng.verify_many, eng.decode = slow_verify_many, slow_decode


@pytest.fixture
def two_orchestrators(redis_url):
    a = start_stack(redis_url, target=TARGET, draft=DRAFT)
    b = start_stack(redis_url, target=TARGET, draft=DRAFT)
    _slow(a)
    yield a, b
    a.stop()
    b.stop()


def _first_message(stream):
    for msg in stream:
        if msg.token_ids:
            return msg
    raise AssertionError("stream ended without tokens")


def test_resume_elsewhere_is_refused_while_the_session_streams(two_orchestrators):
    a, b = two_orchestrators
    # Long enough (~2-3 s) for A's commits to renew the lease while B waits: B then knows A is alive.
    stream = a.client.stream([1, 2, 3], max_new_tokens=150, ignore_eos=True)
    first = _first_message(stream)
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as e:
        list(b.client.stream(resume_session_id=first.session_id, resume_from=0))
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "another orchestrator" in e.value.details()
    assert time.monotonic() - t0 < 4.0  # refused once a renewal showed A alive, not after the whole lease TTL
    received = list(first.token_ids) + [t for m in stream for t in m.token_ids]
    assert len(received) == 150
    # Once that stream ended (and let go of the lease), the other orchestrator serves the session.
    resumed = [t for m in b.client.stream(resume_session_id=first.session_id, resume_from=0) for t in m.token_ids]
    assert resumed == received


def test_a_stream_whose_lease_was_taken_stops_without_writing(two_orchestrators, redis_url):
    import redis

    a, _ = two_orchestrators
    stream = a.client.stream([1, 2, 3], max_new_tokens=200, ignore_eos=True)
    first = _first_message(stream)
    sid = first.session_id
    # Another stream takes the lease (as a resume elsewhere would after this one's lease expired).
    redis.Redis.from_url(redis_url).set(KEY_PREFIX + sid + ":lease", "intruder/1", px=60_000)
    received = list(first.token_ids)
    with pytest.raises(grpc.RpcError) as e:
        for m in stream:
            received += m.token_ids
    assert e.value.code() == grpc.StatusCode.ABORTED, e.value.details()
    assert "another orchestrator stream" in e.value.details()
    stored = _store(redis_url).load(sid).generated
    assert len(received) < 200 and stored == received  # nothing written after the lease was lost


def test_cancel_reaches_a_stream_on_the_other_orchestrator(two_orchestrators, redis_url):
    a, b = two_orchestrators
    stream = a.client.stream([1, 2, 3], max_new_tokens=200, ignore_eos=True)
    first = _first_message(stream)
    assert b.client.cancel(first.session_id) is True
    msgs = list(stream)  # the stream ends (not aborted) once its next commit sees the request
    assert msgs[-1].finish_reason == opb.FINISH_REASON_CANCELLED
    info = b.client.get_session(first.session_id)
    assert info.status == "cancelled" and len(info.generated_token_ids) < 200
    assert _store(redis_url).lease_holder(first.session_id) is None  # the stream let go of its lease
