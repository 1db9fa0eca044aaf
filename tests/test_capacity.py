"""Streams cannot starve the control RPCs: with every session slot streaming, Health, GetSession and CancelSession
answer at once, and one session more is refused with RESOURCE_EXHAUSTED (orchestrator/api/server.py CONTROL_WORKERS)."""

import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.v1 import orchestrator_pb2 as opb
from specdec.v1 import orchestrator_pb2_grpc
from tests.harness import TARGET, start_stack

SESSIONS = 64


@pytest.mark.serial  # 64 streams and a 200 ms bound
def test_control_rpcs_answer_while_every_session_slot_streams(redis_url):
    # Every slot running at once, static: an adaptive limit would start at 4 and queue the others until their held
    # calls returned (what is tested here is the worker threads, not admission).
    stack = start_stack(redis_url, target=TARGET, draft=None, max_active_sessions=SESSIONS, adaptive_admission=False)
    target = stack.servicer.target
    gate = threading.Event()  # every target call waits on it here: each stream stays open, holding its worker thread
    calls = threading.Semaphore(8)  # the target itself takes 32 RPCs at a time (its own limit, not tested here)

    def gated(call):
        def wait_then_call(*a, **k):
            gate.wait(60)
            with calls:
                return call(*a, **k)
        return wait_then_call

    # target-only sessions stream their tokens (decode_stream); a unary decode stays gated too
    target.decode, target.decode_stream = gated(target.decode), gated(target.decode_stream)
    channel = grpc.insecure_channel(stack.orchestrator_server.address)
    stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
    streams = []
    try:
        req = opb.GenerateRequest(token_ids=opb.TokenIds(ids=[1, 2, 3]), max_new_tokens=8, ignore_eos=True,
                                  speculation=opb.SPECULATION_OFF)
        streams = [stub.Generate(req, timeout=60) for _ in range(SESSIONS)]
        sids = [next(s).session_id for s in streams]  # each stream is open: its first message came
        deadline = time.monotonic() + 10
        while len(stack.servicer._active) < SESSIONS and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(stack.servicer._active) == SESSIONS

        health = health_pb2_grpc.HealthStub(channel)
        for _ in range(5):
            t0 = time.monotonic()
            reply = health.Check(health_pb2.HealthCheckRequest(), timeout=2)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            assert time.monotonic() - t0 < 0.2
        info = stub.GetSession(opb.GetSessionRequest(session_id=sids[0]), timeout=2)
        assert info.status == "running"
        assert stub.CancelSession(opb.CancelSessionRequest(session_id=sids[1]), timeout=2).cancelled
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(req, timeout=10))
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert f"{SESSIONS} sessions are generating; retry later" in e.value.details()

        gate.set()
        finals = [list(s)[-1] for s in streams]
        assert finals[1].finish_reason == opb.FINISH_REASON_CANCELLED
        assert all(f.finish_reason == opb.FINISH_REASON_LENGTH for i, f in enumerate(finals) if i != 1)
    finally:
        gate.set()
        for s in streams:
            s.cancel()
        channel.close()
        stack.stop()
