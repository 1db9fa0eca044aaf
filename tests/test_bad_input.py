"""Bad input gets the right gRPC status and a message a person can read; the services stay up."""

import math
import time

import grpc
import pytest

from orchestrator.api.server import IncompatibleModels, check_compatible
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc
from tests.harness import DRAFT_EARLY, model, model_info, start_stack


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
