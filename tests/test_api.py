"""Public API details: health checking and reflection, stop strings, streaming text, sessions in Redis."""

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from orchestrator.store.session_store import KEY_PREFIX, RedisSessionStore, SessionRecord
from tests.harness import DRAFT_EARLY, start_stack

PROMPT = [1, 5, 9, 12, 5, 9]


@pytest.fixture(scope="module")
def stack(redis_url):
    s = start_stack(redis_url, draft=DRAFT_EARLY)
    yield s
    s.stop()


def test_health_and_reflection_on_every_service(stack):
    expected = {stack.target_server.address: "specdec.v1.TargetService",
                stack.draft_server.address: "specdec.v1.DraftService",
                stack.orchestrator_server.address: "specdec.v1.Orchestrator"}
    for address, service in expected.items():
        channel = grpc.insecure_channel(address)
        health = health_pb2_grpc.HealthStub(channel)
        for name in ("", service):
            reply = health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        refl = reflection_pb2_grpc.ServerReflectionStub(channel)
        replies = refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                            timeout=5)
        names = {s.name for r in replies for s in r.list_services_response.service}
        assert service in names and "grpc.health.v1.Health" in names
        channel.close()


def test_stop_string_truncates_text_and_stream_is_consistent(stack):
    full = stack.client.generate(PROMPT, max_new_tokens=30, ignore_eos=True, speculation=False)
    words = full.text.split()
    stop = " ".join(words[5:7])  # a stop string that really occurs, spanning two tokens
    got = stack.client.generate(PROMPT, max_new_tokens=30, ignore_eos=True, stop=[stop], max_draft_len=4)
    assert got.finish_reason == "stop"
    assert got.text == full.text[: full.text.index(stop)]
    assert got.token_ids == full.token_ids[: len(got.token_ids)]
    assert len(got.token_ids) == 7  # up to the token that completed the stop string


def test_stream_offsets_and_text_deltas_add_up(stack):
    offsets, tokens, text = [], [], ""
    for msg in stack.client.stream(PROMPT, max_new_tokens=25, ignore_eos=True):
        if msg.token_ids:
            assert msg.offset == len(tokens)
        tokens += msg.token_ids
        text += msg.text
    tok = stack.servicer.tokenizer
    assert text == tok.decode(tokens, skip_special_tokens=True)
    assert len(tokens) == 25


def test_client_options_object_and_keywords_send_the_same_request(stack):
    """GenerateOptions and keywords are one API: keywords override the object's fields; a typo is a TypeError."""
    from specdec.client import GenerateOptions

    opts = GenerateOptions(max_new_tokens=9, ignore_eos=True, temperature=0.8, top_k=5, seed=3, stop=["x"],
                           speculation=False, chat=True, max_draft_len=2)
    req = opts.request("hi")
    assert (req.text, req.max_new_tokens, req.top_k, req.seed, list(req.stop), req.apply_chat_template,
            req.max_draft_len) == ("hi", 9, 5, 3, ["x"], True, 2)
    assert GenerateOptions.of(opts, seed=4).request([1, 2]).token_ids.ids == [1, 2]
    with pytest.raises(TypeError):
        GenerateOptions.of(max_new_token=3)
    by_object = stack.client.generate(PROMPT, options=GenerateOptions(max_new_tokens=12, ignore_eos=True,
                                                                      temperature=0.9, seed=7))
    by_keywords = stack.client.generate(PROMPT, max_new_tokens=12, ignore_eos=True, temperature=0.9, seed=7)
    overridden = stack.client.generate(PROMPT, options=GenerateOptions(max_new_tokens=3, seed=7), max_new_tokens=12,
                                       ignore_eos=True, temperature=0.9)
    assert by_object.token_ids == by_keywords.token_ids == overridden.token_ids and len(by_object.token_ids) == 12


def test_client_reports_time_to_first_tokens(stack):
    r = stack.client.generate(PROMPT, max_new_tokens=12, ignore_eos=True, max_draft_len=4)
    assert 0 < r.ttft_s < r.wall_s and 1 <= r.first_tokens <= 5  # the first step: at most 4 drafts + 1
    assert r.to_json()["ttft_s"] == r.ttft_s


def test_a_stream_that_fails_midway_says_where_to_resume(stack):
    """The client's deadline passes after the session started (the caller was slow to read): generate raises
    GenerationInterrupted with the session and the first token it did not deliver; resuming there gives the rest,
    exactly as an uninterrupted run."""
    import time

    from specdec.client import GenerationInterrupted

    reference = stack.client.generate(PROMPT, max_new_tokens=60, ignore_eos=True, speculation=False).token_ids
    seen = []

    def slow_reader(msg):
        seen.extend(msg.token_ids)
        if len(seen) >= 3:
            time.sleep(1.5)  # past the call's deadline

    with pytest.raises(GenerationInterrupted) as failed:
        stack.client.generate(PROMPT, max_new_tokens=60, ignore_eos=True, max_draft_len=3, timeout_s=1.0,
                              on_message=slow_reader)
    e = failed.value
    assert isinstance(e, grpc.RpcError) and e.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert e.session_id and e.resume_from == len(seen) and 3 <= len(seen) < 60
    assert seen == reference[: len(seen)]
    deadline = time.monotonic() + 10
    while stack.client.get_session(e.session_id).status == "running" and time.monotonic() < deadline:
        time.sleep(0.05)  # the orchestrator records the stream's end
    rest = stack.client.generate(resume_session_id=e.session_id, resume_from=e.resume_from)
    assert seen + rest.token_ids == reference and rest.finish_reason == "length"


def test_an_exception_in_the_reader_cancels_the_generation(stack):
    import time

    class Stop(Exception):
        pass

    sid = []

    def reader(msg):
        sid.append(msg.session_id)
        raise Stop

    with pytest.raises(Stop):
        stack.client.generate(PROMPT, max_new_tokens=400, ignore_eos=True, on_message=reader)
    deadline = time.monotonic() + 10
    while stack.client.get_session(sid[0]).status == "running" and time.monotonic() < deadline:
        time.sleep(0.05)
    info = stack.client.get_session(sid[0])
    assert info.status == "cancelled" and len(info.generated_token_ids) < 400


def test_stop_token_ids(stack):
    full = stack.client.generate(PROMPT, max_new_tokens=30, ignore_eos=True, speculation=False)
    stop_id = full.token_ids[4]
    got = stack.client.generate(PROMPT, max_new_tokens=30, ignore_eos=True, stop_token_ids=[stop_id])
    assert got.finish_reason == "stop"
    assert got.token_ids == full.token_ids[: full.token_ids.index(stop_id) + 1]


def test_get_session_reads_redis(stack, redis_url):
    r = stack.client.generate(PROMPT, max_new_tokens=12, ignore_eos=True)
    info = stack.client.get_session(r.session_id)
    assert info.status == "finished" and list(info.generated_token_ids) == r.token_ids
    assert info.stats.generated_tokens == 12 and info.prompt_tokens == len(PROMPT)
    store = RedisSessionStore(redis_url)
    rec = store.load(r.session_id)
    assert rec.committed == PROMPT + r.token_ids
    assert 0 < store.client.ttl(KEY_PREFIX + r.session_id) <= store.ttl_s


def test_commit_is_one_round_trip(redis_url):
    store = RedisSessionStore(redis_url)
    rec = SessionRecord(session_id="rt-test", prompt_ids=[1, 2], params={"a": 1})
    store.create(rec)
    calls = []
    real = store.client.connection_pool.get_connection

    def counting(*a, **k):
        calls.append(1)
        return real(*a, **k)

    store.client.connection_pool.get_connection = counting
    rec.generated += [3, 4, 5]
    rec.step = 1
    store.commit(rec, [3, 4, 5])
    store.client.connection_pool.get_connection = real
    assert len(calls) == 1
    back = store.load("rt-test")
    assert back.generated == [3, 4, 5] and back.step == 1
    store.commit(rec, [3, 4, 5])  # a retry after a lost reply must not store the block twice
    assert store.load("rt-test").generated == [3, 4, 5]
    store.delete("rt-test")
    assert store.load("rt-test") is None
