"""Fuzz every RPC with random well-formed messages and with random bytes: each call ends with a clear status
(never UNKNOWN, never an unhandled-exception INTERNAL), and every service stays healthy."""

import time

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specdec.core.grpc_util import check_health
from specdec.v1 import common_pb2, draft_pb2, orchestrator_pb2, target_pb2
from tests.harness import DRAFT_EARLY, start_stack

u32 = st.integers(0, 2**32 - 1)
small_tokens = st.lists(st.one_of(st.integers(0, 70), u32), max_size=12)
floats = st.floats(allow_nan=True, allow_infinity=True, width=32)
session_ids = st.one_of(st.just(""), st.text(max_size=40), st.text(min_size=129, max_size=140))
sampling = st.builds(common_pb2.SamplingParams, temperature=floats, top_k=st.integers(-5, 100), top_p=floats,
                     seed=st.integers(0, 2**64 - 1))
delta = st.builds(common_pb2.TokenDelta, prefix_len=st.one_of(st.integers(0, 20), u32), tokens=small_tokens)
dist = st.builds(common_pb2.Distribution, indices=st.lists(st.integers(0, 80), max_size=8),
                 values_fp16=st.binary(max_size=160))

block_sizes = st.one_of(st.integers(0, 40), u32)
decode_requests = st.builds(
    target_pb2.DecodeRequest, session_id=session_ids, delta=delta, max_tokens=st.one_of(st.integers(0, 100), u32),
    sampling=sampling, stop_token_ids=small_tokens, block_tokens=block_sizes, first_block_tokens=block_sizes,
    max_block_tokens=block_sizes)

REQUESTS = {
    "/specdec.v1.TargetService/Verify": st.builds(
        target_pb2.VerifyRequest, session_id=session_ids, delta=delta, draft_tokens=small_tokens,
        draft_probs=st.lists(dist, max_size=4), sampling=sampling, step=st.integers(0, 2**64 - 1)),
    "/specdec.v1.TargetService/Decode": decode_requests,
    "/specdec.v1.TargetService/DecodeStream": decode_requests,
    "/specdec.v1.TargetService/Prefill": st.builds(target_pb2.PrefillRequest, session_id=session_ids, delta=delta),
    "/specdec.v1.TargetService/Release": st.builds(common_pb2.ReleaseRequest, session_id=session_ids),
    "/specdec.v1.DraftService/Propose": st.builds(
        draft_pb2.ProposeRequest, session_id=session_ids, delta=delta, max_draft_len=st.integers(0, 40),
        sampling=sampling, min_confidence=floats),
    "/specdec.v1.DraftService/Release": st.builds(common_pb2.ReleaseRequest, session_id=session_ids),
    "/specdec.v1.Orchestrator/Generate": st.builds(
        orchestrator_pb2.GenerateRequest, text=st.text(max_size=30), max_new_tokens=st.integers(0, 20),
        temperature=floats, top_k=st.integers(-3, 50), top_p=floats, seed=st.integers(0, 2**64 - 1),
        stop=st.lists(st.text(max_size=5), max_size=20), stop_token_ids=small_tokens,
        max_draft_len=st.integers(0, 20), resume_session_id=st.one_of(st.just(""), st.text(max_size=10)),
        resume_from=st.integers(0, 5)),
    "/specdec.v1.Orchestrator/GetSession": st.builds(orchestrator_pb2.GetSessionRequest, session_id=session_ids),
    "/specdec.v1.Orchestrator/CancelSession": st.builds(orchestrator_pb2.CancelSessionRequest, session_id=session_ids),
}
STREAMING = {"/specdec.v1.Orchestrator/Generate", "/specdec.v1.TargetService/DecodeStream"}
CALL_TIMEOUT_S = 20.0


@pytest.fixture(scope="module")
def stack(redis_url):
    s = start_stack(redis_url, draft=DRAFT_EARLY, max_new_tokens_limit=20)
    yield s
    s.stop()


def address_for(stack, method):
    if "TargetService" in method:
        return stack.target_server.address
    if "DraftService" in method:
        return stack.draft_server.address
    return stack.orchestrator_server.address


def call(channel, method, payload: bytes):
    if method in STREAMING:
        return list(channel.unary_stream(method)(payload, timeout=CALL_TIMEOUT_S))
    return channel.unary_unary(method)(payload, timeout=CALL_TIMEOUT_S)


@pytest.mark.parametrize("method", sorted(REQUESTS))
def test_random_messages_get_clear_statuses(stack, method):
    channel = grpc.insecure_channel(address_for(stack, method))
    seen = set()

    @settings(max_examples=40, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
    @given(REQUESTS[method])
    def one(msg):
        t0 = time.monotonic()
        try:
            call(channel, method, msg.SerializeToString())
            seen.add("OK")
        except grpc.RpcError as e:
            seen.add(e.code().name)
            assert e.code() not in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL), (msg, e.details())
            assert e.code() != grpc.StatusCode.DEADLINE_EXCEEDED, (msg, e.details())  # a hang, not an answer
            assert e.details() and len(e.details()) < 500
        assert time.monotonic() - t0 < CALL_TIMEOUT_S / 2, msg  # a tiny model answers any of these at once

    one()
    channel.close()
    assert seen  # something ran
    for addr in {stack.target_server.address, stack.draft_server.address, stack.orchestrator_server.address}:
        assert check_health(addr, timeout=2.0)


@pytest.mark.parametrize("method", sorted(REQUESTS))
def test_random_bytes_are_refused_cleanly(stack, method):
    channel = grpc.insecure_channel(address_for(stack, method))

    @settings(max_examples=25, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(st.binary(max_size=64))
    def one(payload):
        try:
            call(channel, method, payload)
        except grpc.RpcError as e:
            # Undecodable bytes are refused by grpc itself (INTERNAL "Exception deserializing request");
            # anything decodable must get a proper status from our handlers.
            assert e.code() != grpc.StatusCode.UNKNOWN, e.details()
            if e.code() == grpc.StatusCode.INTERNAL:
                assert "deserializ" in e.details().lower(), e.details()

    one()
    channel.close()
    assert check_health(address_for(stack, method), timeout=2.0)


# Oversized fields, each with the field name its refusal must mention.
OVERSIZED = st.one_of(
    st.integers(17, 200).map(lambda n: ("stop", dict(stop=["."] * n))),
    st.text(min_size=257, max_size=2000).map(lambda t: ("stop[0]", dict(stop=[t]))),
    st.lists(u32, min_size=65, max_size=5000).map(lambda ids: ("stop_token_ids", dict(stop_token_ids=ids))),
    st.integers(64, 2**32 - 1).map(lambda t: ("stop_token_ids", dict(stop_token_ids=[1, t]))),
    st.integers((1 << 20) + 1, 3 << 20).map(lambda n: ("text prompt", dict(text="é" * (n // 2 + 1)))),
    st.integers(4097, 200_000).map(lambda n: ("token_ids", dict(token_ids=orchestrator_pb2.TokenIds(ids=[1] * n)))),
)


def test_oversized_fields_are_invalid_arguments_naming_the_field(stack):
    channel = grpc.insecure_channel(stack.orchestrator_server.address)
    assert stack.servicer.request_limits().max_prompt_tokens < 4097

    @settings(max_examples=30, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                     HealthCheck.data_too_large])
    @given(OVERSIZED)
    def one(case):
        field, kwargs = case
        if "text" not in kwargs:
            kwargs.setdefault("token_ids", orchestrator_pb2.TokenIds(ids=[1, 2]))
        msg = orchestrator_pb2.GenerateRequest(max_new_tokens=4, **kwargs)
        with pytest.raises(grpc.RpcError) as e:
            call(channel, "/specdec.v1.Orchestrator/Generate", msg.SerializeToString())
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
        assert e.value.details().startswith(field) and ("limit" in e.value.details()
                                                        or "outside the vocabulary" in e.value.details())

    one()
    channel.close()
    assert check_health(stack.orchestrator_server.address, timeout=2.0)
