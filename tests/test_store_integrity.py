"""What the session store refuses to write: a block after the store lost the session (or some of its tokens), a
block from a stream that another one fenced out, and a new session when Redis is full (orchestrator/store/session_store.py).

Each refusal ends the stream with its own status: DATA_LOSS (what was lost, never a hole or INTERNAL), ABORTED (a
stale writer), RESOURCE_EXHAUSTED (a full store, while running sessions finish).
"""

import threading
import time

import grpc
import pytest
import redis

from orchestrator.store.session_store import (KEY_PREFIX, LeaseLost, MemorySessionStore, RedisSessionStore, SessionLost,
                                        SessionRecord)
from specdec.ops.redis_server import RedisServer
from specdec.v1 import orchestrator_pb2 as opb
from tests.harness import DRAFT_EARLY as DRAFT, TARGET, start_stack


@pytest.fixture
def own_redis(tmp_path):
    """A Redis of this test's own: the tests flush it and fill it up."""
    server = RedisServer(data_dir=str(tmp_path / "redis")).start()
    yield server
    server.stop()


def _new(store, sid):
    rec = SessionRecord(sid, [1, 2, 3], {"owner": ""})
    store.create(rec)
    assert store.acquire_lease(sid, "A") is None
    rec.generated += [7, 8]
    store.commit(rec, [7, 8], lease="A")
    return rec


def test_a_commit_after_the_store_lost_the_session_is_refused(own_redis):
    store = RedisSessionStore(own_redis.url)
    rec = _new(store, "lost-flush")
    store.client.flushall()
    rec.generated += [9, 10]
    with pytest.raises(SessionLost, match="session lost-flush lost its stored state: its record is gone"):
        store.commit(rec, [9, 10], lease="A")
    assert store.client.keys("*") == [], "nothing written after the loss (no [0, 0, 9, 10], no hash)"
    assert store.load("lost-flush") is None


def test_a_commit_past_lost_tokens_is_refused_and_load_names_the_loss(own_redis):
    store = RedisSessionStore(own_redis.url)
    rec = _new(store, "lost-tokens")
    gen = KEY_PREFIX + "lost-tokens:gen"
    store.client.set(gen, store.client.get(gen)[:4])  # the store kept only the first token of [7, 8]
    rec.generated += [9, 10]
    with pytest.raises(SessionLost, match="holds 1 generated tokens where 2 were committed"):
        store.commit(rec, [9, 10], lease="A")
    assert store.client.get(gen) == store.client.get(gen)[:4]  # no block written past the hole
    with pytest.raises(SessionLost, match="holds 1 generated tokens where 2 were committed"):
        store.load("lost-tokens")
    store.client.hdel(KEY_PREFIX + "lost-tokens", "prompt", "params")
    with pytest.raises(SessionLost, match="lacks prompt, params"):
        store.load("lost-tokens")


def test_the_memory_store_refuses_the_same():
    store = MemorySessionStore()
    rec = _new(store, "mem-lost")
    store.delete("mem-lost")
    rec.generated += [9]
    with pytest.raises(SessionLost, match="session mem-lost"):
        store.commit(rec, [9], lease="A")
    rec = _new(store, "mem-hole")
    rec.generated += [9, 10, 11]
    with pytest.raises(SessionLost, match="holds 2 generated tokens where 3 were committed"):
        store.commit(rec, [10, 11], lease="A")  # a block whose offset is past the stored end
    full = MemorySessionStore(max_sessions=1)
    full.create(SessionRecord("running", [1], {}))
    with pytest.raises(Exception, match="running sessions: no new sessions"):
        full.create(SessionRecord("next", [1], {}))


@pytest.mark.parametrize("kind", ["redis", "memory"])
def test_a_stale_writer_is_fenced_out_after_another_stream_took_the_session(redis_url, kind):
    """A's lease expires; B acquires, commits the end, releases; A's late commit is refused (not taken back)."""
    store = RedisSessionStore(redis_url, lease_ttl_s=0.3) if kind == "redis" else MemorySessionStore(lease_ttl_s=0.3)
    sid = f"fence-{kind}"
    store.delete(sid)
    stale = _new(store, sid)
    epoch = store.fencing_epoch(sid)
    time.sleep(0.5)  # A stalls past its lease
    assert store.acquire_lease(sid, "B") is None
    assert store.fencing_epoch(sid) == epoch + 1
    fresh = store.load(sid)
    fresh.generated += [5]
    fresh.status, fresh.finish_reason = "finished", opb.FINISH_REASON_LENGTH
    store.commit(fresh, [5], lease="B")
    store.release_lease(sid, "B")
    stale.generated += [9, 10]
    with pytest.raises(LeaseLost, match=f"fencing epoch {epoch + 1}"):
        store.commit(stale, [9, 10], lease="A")
    assert store.renew_leases({sid: "A"}) == {sid}
    back = store.load(sid)
    assert back.generated == [7, 8, 5] and back.status == "finished" and store.lease_holder(sid) is None


def test_an_expired_lease_nobody_took_is_kept_by_its_holder(redis_url):
    store = RedisSessionStore(redis_url, lease_ttl_s=0.3)
    store.delete("fence-kept")
    rec = _new(store, "fence-kept")
    time.sleep(0.5)
    rec.generated += [9]
    store.commit(rec, [9], lease="A")  # a long step, nobody else came: it goes on
    assert store.lease_holder("fence-kept") == "A" and store.load("fence-kept").generated == [7, 8, 9]


def _gate(stack) -> threading.Event:
    """The target's steps wait while the returned event is clear (the test acts while the stream is mid-session)."""
    eng = stack.target_engine
    verify_many, decode = eng.verify_many, eng.decode
    gate = threading.Event()
    gate.set()

    def gated_verify_many(jobs):
        gate.wait(30)
        return verify_many(jobs)

    def gated_decode(*a, **k):
        gate.wait(30)
        return decode(*a, **k)

    eng.verify_many, eng.decode = gated_verify_many, gated_decode
    return gate


def _paused_stream(stack, store, n=200):
    """A stream with tokens stored, held in its next step, everything before it committed."""
    gate = _gate(stack)
    stream = stack.client.stream([1, 2, 3], max_new_tokens=n, ignore_eos=True)
    first = next(m for m in stream if m.token_ids)
    gate.clear()
    sid, last, since = first.session_id, -1, time.monotonic()
    while time.monotonic() - since < 0.4:  # its blocks already drafted are stored: the length stops moving
        n_stored = len(store.load(sid).generated)
        if n_stored != last:
            last, since = n_stored, time.monotonic()
        time.sleep(0.05)
    return gate, stream, sid


def _drain(stream):
    with pytest.raises(grpc.RpcError) as e:
        for _ in stream:
            pass
    return e.value


@pytest.mark.serial  # the stream is held mid-session while the test acts
@pytest.mark.parametrize("loss", ["flushall", "lost_tokens"])
def test_a_session_whose_stored_state_is_lost_ends_with_data_loss(own_redis, loss):
    stack = start_stack(own_redis.url, target=TARGET, draft=DRAFT)
    store = RedisSessionStore(own_redis.url)
    try:
        gate, stream, sid = _paused_stream(stack, store)
        if loss == "flushall":
            store.client.flushall()
        else:
            store.client.setrange(KEY_PREFIX + sid + ":gen", 0, b"")  # no-op write, then drop the last token:
            gen = store.client.get(KEY_PREFIX + sid + ":gen")
            store.client.set(KEY_PREFIX + sid + ":gen", gen[:-4])
        gate.set()
        error = _drain(stream)
        assert error.code() == grpc.StatusCode.DATA_LOSS, error.details()
        assert f"session {sid} lost its stored state" in error.details()
        with pytest.raises(grpc.RpcError) as e:
            stack.client.get_session(sid)
        if loss == "flushall":
            assert e.value.code() == grpc.StatusCode.NOT_FOUND
            assert store.client.keys(KEY_PREFIX + sid + "*") == [], "nothing written after the loss"
        else:
            assert e.value.code() == grpc.StatusCode.DATA_LOSS and "generated tokens where" in e.value.details()
            with pytest.raises(grpc.RpcError) as e:
                list(stack.client.stream(resume_session_id=sid, resume_from=0))
            assert e.value.code() == grpc.StatusCode.DATA_LOSS
    finally:
        stack.stop()


@pytest.mark.serial
def test_a_stream_fenced_out_by_a_later_acquirer_ends_aborted(own_redis):
    """The interleaving of a stale writer through the server: A's stream stalls, its lease lapses (the heartbeat
    stopped), B acquires, stores the end and releases; A's next commit is refused and its stream ends ABORTED."""
    stack = start_stack(own_redis.url, target=TARGET, draft=DRAFT)
    store = RedisSessionStore(own_redis.url)
    try:
        gate, stream, sid = _paused_stream(stack, store)
        stack.servicer.close()  # no more heartbeats: A's lease is left to lapse
        store.client.delete(KEY_PREFIX + sid + ":lease")  # ... as it would after its TTL
        assert store.acquire_lease(sid, "B/1") is None
        rec = store.load(sid)
        rec.generated += [5]
        rec.status, rec.finish_reason = "finished", opb.FINISH_REASON_LENGTH
        store.commit(rec, [5], lease="B/1")
        store.release_lease(sid, "B/1")
        gate.set()
        error = _drain(stream)
        assert error.code() == grpc.StatusCode.ABORTED, error.details()
        assert "another orchestrator stream (B/1, fencing epoch 2)" in error.details()
        back = store.load(sid)
        assert back.status == "finished" and back.generated == rec.generated  # nothing of A's after B
    finally:
        stack.stop()


@pytest.mark.serial
def test_a_full_store_refuses_new_sessions_while_running_ones_finish(own_redis):
    stack = start_stack(own_redis.url, target=TARGET, draft=DRAFT)
    store = RedisSessionStore(own_redis.url)
    try:
        gate, stream, sid = _paused_stream(stack, store, n=120)
        client = redis.Redis.from_url(own_redis.url)
        assert client.config_get("maxmemory-policy")["maxmemory-policy"] == "noeviction"
        for i in range(20):  # other data fills it past the limit
            client.set(f"other-data-{i}", b"x" * 50_000)
        client.config_set("maxmemory", client.info("memory")["used_memory"] - 500_000)
        with pytest.raises(grpc.RpcError) as e:
            list(stack.client.stream([1, 2], max_new_tokens=4))
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.value.details()
        assert "is full" in e.value.details() and "no new sessions" in e.value.details()
        gate.set()
        tokens = [t for m in stream for t in m.token_ids]
        info = stack.client.get_session(sid)
        assert info.status == "finished" and len(info.generated_token_ids) == 120
        assert list(info.generated_token_ids)[-len(tokens):] == tokens
        client.delete(*(f"other-data-{i}" for i in range(20)))
        assert len(stack.client.generate([1, 2], max_new_tokens=4).token_ids) == 4  # room again: new ones start
    finally:
        stack.stop()


def test_every_redis_the_project_starts_never_evicts(redis_server):
    from specdec.ops.redis_server import redis_memory_args

    client = redis.Redis.from_url(redis_server.url)
    assert client.config_get("maxmemory-policy")["maxmemory-policy"] == "noeviction"
    assert redis_memory_args()[-2:] == ["--maxmemory-policy", "noeviction"]


def test_cancel_of_a_session_nobody_streams_writes_under_its_own_lease(redis_url):
    """CancelSession writes the cancellation like any writer: under a lease of its own (a new epoch), so a stream
    whose lease lapsed cannot write after it; a session another stream holds gets the request instead."""
    stack = start_stack(redis_url, target=TARGET, draft=DRAFT)
    store = RedisSessionStore(redis_url)
    try:
        for sid in ("cancel-orphan", "cancel-held"):
            store.delete(sid)
        _new(store, "cancel-orphan")  # held by "A" (an orchestrator that died mid-stream); its lease lapses:
        store.client.delete(KEY_PREFIX + "cancel-orphan:lease")
        epoch = store.fencing_epoch("cancel-orphan")
        assert stack.client.cancel("cancel-orphan") is True
        back = store.load("cancel-orphan")
        assert back.status == "cancelled" and back.generated == [7, 8]
        assert store.fencing_epoch("cancel-orphan") == epoch + 1 and store.lease_holder("cancel-orphan") is None
        back.generated += [9]
        with pytest.raises(LeaseLost):
            store.commit(back, [9], lease="A")  # the dead stream's late write

        # "A" holds its lease for longer than the caller waits: it is asked to stop, and writes the cancellation itself
        _new(store, "cancel-held")
        assert stack.client.cancel("cancel-held", timeout_s=2.0) is True
        assert store.client.hget(KEY_PREFIX + "cancel-held", "cancel_requested") == b"1"
        assert store.load("cancel-held").status == "running"
    finally:
        store.delete("cancel-orphan")
        store.delete("cancel-held")
        stack.stop()
