"""Bad input gets the right gRPC status and a message a person can read; the services stay up."""

import math
import threading
import time

import grpc
import pytest

from orchestrator.api.server import IncompatibleModels, check_compatible
from specdec.core.grpc_util import check_health
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc
from tests.harness import DRAFT_EARLY, model, model_info, start_stack, wait_until


@pytest.fixture(scope="module")
def stack(redis_url):
    s = start_stack(redis_url, draft=DRAFT_EARLY, max_new_tokens_limit=100)
    yield s
    s.stop()


def status_of(fn):
    with pytest.raises(grpc.RpcError) as e:
        result = fn()
        if hasattr(result, "__iter__") and not isinstance(result, (str, bytes)):
            list(result)
    return e.value.code(), e.value.details()


@pytest.mark.parametrize("kwargs, code, words", [
    (dict(prompt=""), grpc.StatusCode.INVALID_ARGUMENT, "prompt is empty"),
    (dict(prompt="   "), grpc.StatusCode.INVALID_ARGUMENT, "prompt is empty"),
    (dict(prompt=None), grpc.StatusCode.INVALID_ARGUMENT, "prompt is empty"),
    (dict(prompt=[]), grpc.StatusCode.INVALID_ARGUMENT, "prompt is empty"),
    (dict(max_new_tokens=0), grpc.StatusCode.INVALID_ARGUMENT, "max_new_tokens must be at least 1"),
    (dict(max_new_tokens=101), grpc.StatusCode.INVALID_ARGUMENT, "exceeds this server's limit of 100"),
    (dict(temperature=-0.5), grpc.StatusCode.INVALID_ARGUMENT, "temperature must be a finite number >= 0"),
    (dict(temperature=math.nan), grpc.StatusCode.INVALID_ARGUMENT, "temperature must be a finite number >= 0"),
    (dict(temperature=math.inf), grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
    (dict(top_p=1.5), grpc.StatusCode.INVALID_ARGUMENT, "top_p must be in (0, 1]"),
    (dict(top_p=-0.1), grpc.StatusCode.INVALID_ARGUMENT, "top_p must be in (0, 1]"),
    (dict(top_p=math.nan), grpc.StatusCode.INVALID_ARGUMENT, "top_p must be in (0, 1]"),
    (dict(top_k=-1), grpc.StatusCode.INVALID_ARGUMENT, "top_k"),
    (dict(max_draft_len=99), grpc.StatusCode.INVALID_ARGUMENT, "max_draft_len"),
    (dict(prompt=[1, 2, 64]), grpc.StatusCode.INVALID_ARGUMENT, "outside the vocabulary"),
    (dict(prompt=[1] * 1000, max_new_tokens=50), grpc.StatusCode.OUT_OF_RANGE, "exceeds the model's context"),
    (dict(resume_session_id="no-such-session"), grpc.StatusCode.NOT_FOUND, "unknown session id"),
    # Every repeated and string field is bounded; the message names the field and the limit.
    (dict(stop=["."] * 17), grpc.StatusCode.INVALID_ARGUMENT, "stop has 17 strings; the limit is 16"),
    (dict(stop=[".", "é" * 129]), grpc.StatusCode.INVALID_ARGUMENT, "stop[1] is 258 bytes long; the limit is 256 bytes"),
    (dict(stop_token_ids=[1] * 65), grpc.StatusCode.INVALID_ARGUMENT, "stop_token_ids has 65 ids; the limit is 64"),
    (dict(stop_token_ids=[3, 64]), grpc.StatusCode.INVALID_ARGUMENT,
     "stop_token_ids: token id 64 is outside the vocabulary (size 64)"),
    (dict(stop_token_ids=[2**32 - 1]), grpc.StatusCode.INVALID_ARGUMENT, "stop_token_ids: token id 4294967295"),
    (dict(prompt="word " * 300_000), grpc.StatusCode.INVALID_ARGUMENT,
     "text prompt is 1500000 bytes long; the limit is 1048576 bytes"),
    (dict(prompt=[1] * 5000), grpc.StatusCode.INVALID_ARGUMENT, "token_ids has 5000 tokens; the limit is"),
])
def test_generate_rejects_bad_requests(stack, kwargs, code, words):
    args = dict(prompt=[1, 2, 3], max_new_tokens=5)
    args.update(kwargs)
    prompt = args.pop("prompt")
    got_code, details = status_of(lambda: stack.client.stream(prompt, **args))
    assert got_code == code, details
    assert words in details


def test_oversized_request_is_resource_exhausted(stack):
    from specdec.v1 import orchestrator_pb2, orchestrator_pb2_grpc

    # A plain channel (no client-side limit), so it is the server that refuses the 10 MB message.
    stub = orchestrator_pb2_grpc.OrchestratorStub(grpc.insecure_channel(stack.orchestrator_server.address))
    req = orchestrator_pb2.GenerateRequest(max_new_tokens=5, text="word " * 2_000_000)
    code, details = status_of(lambda: stub.Generate(req, timeout=10))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, details
    assert "larger than max" in details
    code, details = status_of(lambda: stack.client.stream([1] * 2000, max_new_tokens=5))
    assert code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE) and "tokens" in details


def test_unknown_session_is_not_found(stack):
    for call in (stack.client.get_session, stack.client.cancel):
        code, details = status_of(lambda: call("does-not-exist"))
        assert code == grpc.StatusCode.NOT_FOUND and "unknown session id" in details
    code, _ = status_of(lambda: stack.client.get_session(""))
    assert code == grpc.StatusCode.INVALID_ARGUMENT


def test_services_reject_bad_rpcs_and_stay_healthy(stack):
    target = target_pb2_grpc.TargetServiceStub(grpc.insecure_channel(stack.target_server.address))
    draft = draft_pb2_grpc.DraftServiceStub(grpc.insecure_channel(stack.draft_server.address))
    delta = common_pb2.TokenDelta(prefix_len=0, tokens=[1, 2, 3])
    cases = [
        (lambda: target.Verify(target_pb2.VerifyRequest(delta=delta), timeout=5), "session_id is required"),
        (lambda: target.Verify(target_pb2.VerifyRequest(session_id="x", delta=delta, draft_tokens=[999]), timeout=5),
         "outside the vocabulary"),
        (lambda: target.Verify(target_pb2.VerifyRequest(session_id="x", delta=delta, draft_tokens=[1] * 50), timeout=5),
         "exceed this target's limit"),
        (lambda: target.Verify(target_pb2.VerifyRequest(
            session_id="x", delta=delta, draft_tokens=[1], sampling=common_pb2.SamplingParams(temperature=1.0),
            draft_probs=[common_pb2.Distribution(values_fp16=b"\x00\x7e" * 64)]), timeout=5), "NaN"),
        (lambda: target.Decode(target_pb2.DecodeRequest(session_id="x", delta=delta, max_tokens=0), timeout=5),
         "max_tokens must be in"),
        (lambda: target.Decode(target_pb2.DecodeRequest(
            session_id="x", delta=delta, max_tokens=1, sampling=common_pb2.SamplingParams(top_p=2.0)), timeout=5),
         "top_p"),
        (lambda: draft.Propose(draft_pb2.ProposeRequest(session_id="x", delta=delta, max_draft_len=0), timeout=5),
         "max_draft_len must be in"),
        (lambda: draft.Propose(draft_pb2.ProposeRequest(
            session_id="x", delta=common_pb2.TokenDelta(tokens=[70]), max_draft_len=2), timeout=5),
         "outside the vocabulary"),
    ]
    for call, words in cases:
        code, details = status_of(call)
        assert code == grpc.StatusCode.INVALID_ARGUMENT, details
        assert words in details
    code, details = status_of(lambda: target.Verify(
        target_pb2.VerifyRequest(session_id="fresh", delta=common_pb2.TokenDelta(prefix_len=5, tokens=[1])), timeout=5))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "cache-miss" in details
    # Still serving after all of that.
    r = stack.client.generate([1, 2, 3], max_new_tokens=5, ignore_eos=True)
    assert len(r.token_ids) == 5


def _target_stub(stack):
    return target_pb2_grpc.TargetServiceStub(grpc.insecure_channel(stack.target_server.address))


def test_decode_stream_refuses_bad_requests_with_clear_statuses(stack):
    target = _target_stub(stack)
    limit = stack.target_server.servicer.engine.loaded.max_context
    delta = common_pb2.TokenDelta(prefix_len=0, tokens=[1, 2, 3])

    def stream(**fields):
        fields.setdefault("session_id", "bad-stream")
        fields.setdefault("delta", delta)
        fields.setdefault("max_tokens", 4)
        return lambda: target.DecodeStream(target_pb2.DecodeRequest(**fields), timeout=5)

    cases = [
        (stream(session_id=""), grpc.StatusCode.INVALID_ARGUMENT, "session_id is required"),
        (stream(session_id="s" * 129), grpc.StatusCode.INVALID_ARGUMENT, "longer than 128"),
        (stream(max_tokens=0), grpc.StatusCode.INVALID_ARGUMENT, f"max_tokens must be in 1..{limit}"),
        (stream(max_tokens=limit + 1), grpc.StatusCode.INVALID_ARGUMENT, f"max_tokens must be in 1..{limit}"),
        (stream(max_tokens=2**32 - 1), grpc.StatusCode.INVALID_ARGUMENT, "max_tokens must be in"),
        (stream(delta=common_pb2.TokenDelta(tokens=[1, 999])), grpc.StatusCode.INVALID_ARGUMENT,
         "outside the vocabulary"),
        (stream(sampling=common_pb2.SamplingParams(temperature=math.nan)), grpc.StatusCode.INVALID_ARGUMENT,
         "temperature"),
        (stream(sampling=common_pb2.SamplingParams(top_p=2.0)), grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
        (stream(block_tokens=limit + 1), grpc.StatusCode.INVALID_ARGUMENT,
         f"block_tokens must be at most {limit} (the stream's token limit), got {limit + 1}"),
        (stream(first_block_tokens=2**32 - 1), grpc.StatusCode.INVALID_ARGUMENT, "first_block_tokens must be at most"),
        (stream(max_block_tokens=2**32 - 1), grpc.StatusCode.INVALID_ARGUMENT, "max_block_tokens must be at most"),
        (stream(block_tokens=8, max_block_tokens=4), grpc.StatusCode.INVALID_ARGUMENT,
         "max_block_tokens (4) is below block_tokens (8)"),
        (stream(session_id="never-seen", delta=common_pb2.TokenDelta(prefix_len=7, tokens=[1])),
         grpc.StatusCode.FAILED_PRECONDITION, "cache-miss"),
    ]
    for call, code, words in cases:
        got, details = status_of(call)
        assert got == code, details
        assert words in details, details
    # max_block_tokens 0 (no growth) or at least block_tokens: a stream of the asked tokens
    for fields in (dict(block_tokens=2, max_block_tokens=0), dict(block_tokens=2, max_block_tokens=2),
                   dict(block_tokens=2, first_block_tokens=1, max_block_tokens=limit)):
        tokens = [t for r in stream(session_id="good-stream", max_tokens=6, **fields)() for t in r.tokens]
        assert len(tokens) == 6 or tokens[-1] in stack.target_server.servicer.info.eos_token_ids
    assert check_health(stack.target_server.address, timeout=2.0)


@pytest.fixture
def slow_target(stack, monkeypatch):
    """The stack's target decoding at one token per 20 ms (the tiny model would finish any stream at once), and the
    threads its decode streams run on."""
    engine = stack.target_server.servicer.engine
    decode = engine.decode

    def slow_decode(task, on_token=None):
        def slowly(token, cached_len):
            time.sleep(0.02)
            return on_token(token, cached_len)

        return decode(task, on_token=None if on_token is None else slowly)

    monkeypatch.setattr(engine, "decode", slow_decode)
    return lambda sid: [t for t in threading.enumerate() if t.name == f"decode-stream-{sid[:16]}" and t.is_alive()]


def _prompt_stream(stack, sid, max_tokens, timeout, block_tokens=1):
    target = _target_stub(stack)
    request = target_pb2.DecodeRequest(session_id=sid, delta=common_pb2.TokenDelta(tokens=[1, 2, 3, 4]),
                                       max_tokens=max_tokens, block_tokens=block_tokens)
    return target.DecodeStream(request, timeout=timeout)


@pytest.mark.serial  # deadline and stop bounds
def test_a_decode_stream_ends_by_its_deadline_and_stops_decoding(stack, slow_target):
    """A stream of 400 tokens (8 s at this pace) with a 1.5 s deadline ends by the deadline, cleanly after a block
    or as DEADLINE_EXCEEDED, and the target stops decoding it."""
    t0 = time.monotonic()
    tokens = []
    try:
        for r in _prompt_stream(stack, "deadline-stream", 400, timeout=1.5, block_tokens=4):
            tokens += r.tokens
    except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.DEADLINE_EXCEEDED, e.details()
    assert time.monotonic() - t0 < 2.5
    assert len(tokens) < 400
    assert wait_until(lambda: not slow_target("deadline-stream"), 3.0)


@pytest.mark.serial  # deadline and stop bounds
def test_a_client_cancelling_mid_stream_frees_the_session(stack, slow_target):
    """The client cancels after two blocks of a 400-token stream: the target stops decoding it at once (its thread
    ends, the session's cache stops growing) and the session serves its next call without waiting for the rest."""
    engine = stack.target_server.servicer.engine
    stream = _prompt_stream(stack, "cancel-stream", 400, timeout=30)
    assert len(next(stream).tokens) == 1 and len(next(stream).tokens) == 1
    stream.cancel()
    assert wait_until(lambda: not slow_target("cancel-stream"), 3.0)
    cached = len(engine.store.get("cancel-stream").tokens)
    assert cached < 4 + 100
    time.sleep(0.2)
    assert len(engine.store.get("cancel-stream").tokens) == cached
    t0 = time.monotonic()
    again = [t for r in _prompt_stream(stack, "cancel-stream", 5, timeout=10) for t in r.tokens]
    assert 1 <= len(again) <= 5 and time.monotonic() - t0 < 2.0
    _target_stub(stack).Release(common_pb2.ReleaseRequest(session_id="cancel-stream"), timeout=5)


def test_draft_with_another_tokenizer_is_refused():
    target = model_info(model("tiny:vocab=64"), "target")
    other = model_info(model("tiny:vocab=32"), "model")
    with pytest.raises(IncompatibleModels, match="different tokenizers"):
        check_compatible(target, other)
    check_compatible(target, model_info(model("tiny:vocab=64,seed=5"), "model"))
    check_compatible(target, common_pb2.ModelInfo(model_name="ngram", strategy="ngram"))


@pytest.mark.parametrize("fraction", ["-0.1", "1.5"])
def test_target_refuses_a_batch_wait_fraction_outside_0_to_1(fraction):
    import argparse

    from target_service import server

    p = argparse.ArgumentParser()
    server.add_arguments(p)
    with pytest.raises(SystemExit, match="--batch-wait-fraction must be between 0 and 1"):
        server.serve(p.parse_args(["--model", "tiny", "--batch-window-ms", "5", "--batch-wait-fraction", fraction]))


@pytest.mark.parametrize("lease", ["0", "-1", "7200"])
def test_orchestrator_refuses_a_session_lease_out_of_range(lease):
    import argparse

    from orchestrator.api import server

    p = argparse.ArgumentParser()
    server.add_arguments(p)
    with pytest.raises(SystemExit, match="--session-lease-s must be between 0.1 and 3600 seconds"):
        server.serve(p.parse_args(["--session-lease-s", lease]))


def test_each_caller_has_a_session_quota(redis_url):
    from specdec.client import SpecdecClient

    s = start_stack(redis_url, draft=DRAFT_EARLY, auth_tokens=["alice-token", "bob-token"],
                    max_sessions_per_principal=1)
    addr = s.orchestrator_server.address
    try:
        with SpecdecClient(addr, token="alice-token") as alice, SpecdecClient(addr, token="bob-token") as bob:
            first = alice.stream([1, 2, 3], max_new_tokens=100, ignore_eos=True)
            next(first)
            code, details = status_of(lambda: alice.stream([1, 2, 3], max_new_tokens=5))
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "this caller's quota of 1 generating sessions is used up" in details
            assert len(bob.generate([1, 2, 3], max_new_tokens=5, ignore_eos=True).token_ids) == 5  # another caller
            first.cancel()
            deadline = time.monotonic() + 10
            while s.servicer._active and time.monotonic() < deadline:
                time.sleep(0.05)
            assert len(alice.generate([1, 2, 3], max_new_tokens=5, ignore_eos=True).token_ids) == 5
    finally:
        s.stop()
