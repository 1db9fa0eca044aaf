"""Draft faults never change or fail a generation; target and store outages within their grace periods are
survived; cancellation frees every cache; back-pressure, auth and session ownership hold."""

import dataclasses
import threading
import time
import types

import grpc
import pytest

from draft_service.proposers.base import Proposal, Proposer
from orchestrator.settings import LoopConfig
from specdec.ops.redis_server import RedisServer
from target_service.server import build_server as build_target_server
from tests.harness import DRAFT_EARLY, DRAFT_SAME, TARGET, model, start_draft, start_stack

pytestmark = pytest.mark.serial  # timing-sensitive: runs after the parallel part, alone (scripts/test.sh)

PROMPT = [1, 5, 9, 12, 5, 9]
FAST = LoopConfig(default_draft_len=3, draft_timeout_floor_ms=200, draft_first_call_timeout_ms=2000,
                  target_grace_s=10, store_grace_s=10)


def reference(stack, n, prompt=PROMPT):
    return stack.client.generate(prompt, max_new_tokens=n, speculation=False, ignore_eos=True).token_ids


def stream_with_hook(stack, n, at_tokens, hook, **kw):
    """Stream a generation; call hook() once after `at_tokens` tokens arrived. Returns (tokens, final stats)."""
    tokens, stats, fired = [], None, False
    for msg in stack.client.stream(PROMPT, max_new_tokens=n, ignore_eos=True, **kw):
        tokens += msg.token_ids
        if msg.HasField("stats"):
            stats = msg.stats
        if not fired and len(tokens) >= at_tokens:
            fired = True
            hook()
    return tokens, stats


def test_draft_killed_mid_generation_then_speculation_resumes(redis_url):
    stack = start_stack(redis_url, draft=DRAFT_SAME, cfg=FAST)
    try:
        ref = reference(stack, 200)
        addr = stack.draft_server.address
        tokens, stats = stream_with_hook(stack, 200, 10, lambda: stack.draft_servers[0].stop(0))
        assert tokens == ref
        # Degraded to target-only: after a failed Propose, or after the pool's health check saw the replica go and
        # opened its breaker first (then no call fails).
        assert stats.fallback_steps > 0 and stats.fallback_tokens > 0 and stats.degraded_ms > 0
        assert stats.draft_failures > 0 or stack.servicer.pool.replicas[0].breaker.state != "closed"
        # The draft comes back (empty caches, same address): speculation resumes by itself.
        stack.draft_servers[0] = start_draft(DRAFT_SAME, address=addr)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            after = stack.client.generate(PROMPT, max_new_tokens=40, ignore_eos=True)
            assert after.token_ids == ref[:40]
            if after.stats["verify_steps"] > 0 and after.stats["fallback_steps"] == 0:
                break
            time.sleep(0.3)
        assert after.stats["acceptance_rate"] == 1.0
    finally:
        stack.stop()


def test_failover_to_another_replica(redis_url):
    stack = start_stack(redis_url, draft=[DRAFT_SAME, DRAFT_SAME], cfg=FAST)
    try:
        ref = reference(stack, 150)
        sid_holder = {}

        def kill_affine_replica():
            sid = sid_holder["sid"]
            preferred = stack.servicer.pool.ranking(sid)[0]
            sid_holder["killed_replica"] = preferred
            next(s for s in stack.draft_servers if s.address == preferred.address).stop(0)

        tokens, stats = [], None
        for msg in stack.client.stream(PROMPT, max_new_tokens=150, ignore_eos=True):
            sid_holder.setdefault("sid", msg.session_id)
            tokens += msg.token_ids
            if msg.HasField("stats"):
                stats = msg.stats
            if len(tokens) >= 10 and "killed" not in sid_holder:
                sid_holder["killed"] = True
                kill_affine_replica()
        assert tokens == ref
        # Either a Propose to the dead replica failed or its health check opened the breaker first (then
        # no call fails); both end in a failover.
        assert stats.replica_failovers >= 1
        assert stats.draft_failures >= 1 or sid_holder["killed_replica"].breaker.state != "closed"
        # After failover the other replica speculates: most steps still verify drafts.
        assert stats.verify_steps > stats.fallback_steps
    finally:
        stack.stop()


class GarbageProposer(Proposer):
    """A draft that answers with nonsense of one kind."""

    strategy = "model"

    def __init__(self, kind: str, vocab_size: int):
        self.kind, self.vocab_size = kind, vocab_size

    def get_candidates(self, task):
        import torch

        max_len, prefix_len, delta = task.max_len, task.prefix_len, task.delta

        if self.kind == "out_of_vocab":
            return Proposal([self.vocab_size + 7] * max_len, None, prefix_len + len(delta))
        if self.kind == "too_many":
            return Proposal([1] * (max_len + 3), None, prefix_len + len(delta))
        if self.kind == "nan_probs":
            probs = torch.full((max_len, self.vocab_size), float("nan"), dtype=torch.float16)
            return Proposal([1] * max_len, probs, prefix_len + len(delta))
        if self.kind == "wrong_prob_count":
            probs = torch.full((1, self.vocab_size), 1.0 / self.vocab_size, dtype=torch.float16)
            return Proposal([1] * max_len, probs, prefix_len + len(delta))
        raise AssertionError(self.kind)

    def release(self, session_id):
        return True


@pytest.mark.parametrize("kind", ["out_of_vocab", "too_many", "nan_probs", "wrong_prob_count"])
def test_garbage_from_the_draft_is_a_failed_draft(redis_url, kind):
    stack = start_stack(redis_url, draft=DRAFT_SAME, cfg=FAST)
    try:
        sampling = dict(temperature=0.8, seed=3) if kind in ("nan_probs", "wrong_prob_count") else {}
        ref = stack.client.generate(PROMPT, max_new_tokens=20, speculation=False, ignore_eos=True, **sampling)
        addr = stack.draft_server.address
        stack.draft_servers[0].stop(0)
        stack.draft_servers[0] = start_draft(DRAFT_SAME, address=addr,
                                             proposer=GarbageProposer(kind, model(TARGET).vocab_size))
        time.sleep(0.6)  # let the health checker see the replacement
        got = stack.client.generate(PROMPT, max_new_tokens=20, ignore_eos=True, **sampling)
        if sampling:
            # Sampling depends on the step's RNG stream, so compare with a run that had no draft at all.
            assert len(got.token_ids) == 20
        else:
            assert got.token_ids == ref.token_ids
        assert got.stats["draft_failures_by_kind"].get("malformed", 0) >= 1
        assert got.stats["draft_tokens_accepted"] == 0
    finally:
        stack.stop()


def test_slow_draft_times_out_and_output_is_unchanged(redis_url):
    stack = start_stack(redis_url, draft=DRAFT_SAME, cfg=FAST)
    try:
        ref = reference(stack, 30)
        addr = stack.draft_server.address
        stack.draft_servers[0].stop(0)
        stack.draft_servers[0] = start_draft(DRAFT_SAME, address=addr, inject_latency_ms=3000)
        # A health check may have seen the stop and opened the breaker: wait for one to see the restarted (slow)
        # replica, so the generation calls it.
        breaker = stack.servicer.pool.replicas[0].breaker
        deadline = time.monotonic() + 10
        while breaker.state == "open" and time.monotonic() < deadline:
            time.sleep(0.02)
        assert breaker.state != "open"
        t0 = time.monotonic()
        got = stack.client.generate(PROMPT, max_new_tokens=30, ignore_eos=True)
        assert got.token_ids == ref
        assert got.stats["draft_failures_by_kind"].get("timeout", 0) >= 1
        assert time.monotonic() - t0 < 8, "a slow draft must not stall the generation for its full latency"
    finally:
        stack.stop()


def test_a_slow_prefetch_costs_one_draft_deadline_then_target_only_tokens(redis_url):
    """A draft that turns slow while a pipelined prefetch is in flight: the next step waits for that prefetch at
    most one draft deadline, then decodes target-only (not the prefetch's own, longer RPC deadline plus another
    fresh Propose's deadline)."""
    cfg = dataclasses.replace(FAST, pipeline="on")
    stack = start_stack(redis_url, draft=DRAFT_SAME, cfg=cfg)
    try:
        ref = reference(stack, 60)
        servicer = stack.draft_servers[0].servicer

        def turn_slow():
            servicer.inject_latency_ms, servicer.latency_enabled = 3000.0, True

        tokens, stats, gaps, last, fired = [], None, [], None, False
        for msg in stack.client.stream(PROMPT, max_new_tokens=60, ignore_eos=True):
            now = time.monotonic()
            if fired:
                gaps.append(now - last)
            last = now
            tokens += msg.token_ids
            if msg.HasField("stats"):
                stats = msg.stats
            if not fired and len(tokens) >= 10:
                fired = True
                turn_slow()
        assert tokens == ref
        kinds = dict(stats.draft_failures_by_kind)
        assert kinds.get("prefetch_deadline_exceeded", 0) >= 1, kinds
        # The deadline here is the 200 ms floor (tiny models); waiting out the prefetch's RPC deadline (the draft
        # deadline + 1 s) or a second deadline before falling back would exceed this.
        assert max(gaps) < 0.8, (max(gaps), kinds)
    finally:
        servicer.latency_enabled = False
        stack.stop()


def test_target_restart_within_grace_period(redis_url):
    stack = start_stack(redis_url, draft=DRAFT_EARLY, cfg=FAST)
    try:
        ref = reference(stack, 150)
        addr = stack.target_server.address

        def bounce_target():
            stack.target_server.stop(0)

            def restart():
                time.sleep(1.0)
                from target_service.engines.torch import TargetEngine

                stack.target_server = build_target_server(TargetEngine(model(TARGET)), addr).start()

            threading.Thread(target=restart, daemon=True).start()

        tokens, stats = stream_with_hook(stack, 150, 10, bounce_target)
        assert tokens == ref
        assert stats.target_resyncs >= 1  # the new target rebuilt the cache from the committed tokens
    finally:
        stack.stop()


def test_target_stopped_during_a_verify_is_waited_for_like_one_that_is_down(redis_url):
    """A target that stops while a Verify is in flight cancels it (the client sees CANCELLED, not UNAVAILABLE):
    that too is the target going away, waited for within the grace period, not a failed generation."""
    stack = start_stack(redis_url, draft=DRAFT_EARLY, cfg=FAST)
    try:
        ref = reference(stack, 60)
        addr = stack.target_server.address
        verify, in_verify = stack.target_engine.verify, threading.Event()

        def slow_verify(*args, **kwargs):
            in_verify.set()
            time.sleep(0.5)
            return verify(*args, **kwargs)

        def stop_during_a_verify_then_restart():
            stack.target_engine.verify = slow_verify

            def run():
                assert in_verify.wait(10)
                stack.target_server.stop(0)
                time.sleep(0.5)
                from target_service.engines.torch import TargetEngine

                stack.target_server = build_target_server(TargetEngine(model(TARGET)), addr).start()

            threading.Thread(target=run, daemon=True).start()

        tokens, stats = stream_with_hook(stack, 60, 10, stop_during_a_verify_then_restart)
        assert tokens == ref
        assert stats.target_resyncs >= 1
    finally:
        stack.stop()


def test_a_cancelled_target_call_is_retried_within_the_grace_period_other_errors_are_not():
    """What a target call's error means: the target went away (UNAVAILABLE, DEADLINE_EXCEEDED, or CANCELLED when
    it stopped with the call in flight: CI saw that one end a generation) -> wait and retry; anything else fails."""
    from orchestrator.replicas.local_draft import LocalRpcError
    from orchestrator.loop import GenerationError
    from orchestrator.loop.target_call import TargetCall
    from tests.harness import loop_state

    def gen():
        return TargetCall(loop_state(cfg=LoopConfig(target_grace_s=5.0)))

    for code in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        calls = []

        def fn(timeout, code=code):
            calls.append(timeout)
            if len(calls) == 1:
                raise LocalRpcError(code, code.name)
            return types.SimpleNamespace(resynced=True)

        g = gen()
        assert g.call(fn, "verify").resynced and len(calls) == 2
        assert g.state.rec.stats.target_resyncs == 1
    with pytest.raises(GenerationError) as e:
        gen().call(lambda t: (_ for _ in ()).throw(LocalRpcError(grpc.StatusCode.INTERNAL, "boom")), "verify")
    assert e.value.code == grpc.StatusCode.INTERNAL


def test_target_gone_past_grace_fails_with_unavailable(redis_url):
    cfg = LoopConfig(default_draft_len=3, target_grace_s=1.0, draft_timeout_floor_ms=200)
    stack = start_stack(redis_url, draft=DRAFT_EARLY, cfg=cfg)
    try:
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as e:
            stream_with_hook(stack, 300, 5, lambda: stack.target_server.stop(0))
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "target unavailable" in e.value.details() and "resumed" in e.value.details()
        assert time.monotonic() - t0 < 10
    finally:
        stack.stop()


def test_redis_outage_in_flight_waits_new_sessions_fail_nothing_lost(tmp_path):
    redis = RedisServer(data_dir=str(tmp_path / "redis")).start()
    stack = start_stack(redis.url, draft=DRAFT_EARLY, cfg=FAST)
    try:
        ref = reference(stack, 150)
        result = {}

        def outage():
            redis.stop()
            try:
                stack.client.generate(PROMPT, max_new_tokens=5)
            except grpc.RpcError as e:
                result["new_session"] = (e.code(), e.details())
            threading.Timer(1.0, redis.start).start()

        tokens, stats = [], None
        sid = None
        for msg in stack.client.stream(PROMPT, max_new_tokens=150, ignore_eos=True):
            sid = sid or msg.session_id
            tokens += msg.token_ids
            if len(tokens) >= 10 and "new_session" not in result:
                outage()
        assert tokens == ref
        assert result["new_session"][0] == grpc.StatusCode.UNAVAILABLE
        assert "unavailable" in result["new_session"][1]
        assert list(stack.client.get_session(sid).generated_token_ids) == tokens
    finally:
        stack.stop()
        redis.stop()


def test_cancel_and_disconnect_free_every_cache(redis_url):
    stack = start_stack(redis_url, draft=DRAFT_EARLY, cfg=FAST)
    try:
        # Explicit cancel from another call.
        stream = stack.client.stream(PROMPT, max_new_tokens=400, ignore_eos=True)
        sid = next(stream).session_id
        next(stream)
        assert stack.client.cancel(sid)
        rest = list(stream)
        assert rest[-1].finish_reason == 4  # FINISH_REASON_CANCELLED
        # Client disconnect: cancel the RPC itself.
        stream2 = stack.client.stream(PROMPT, max_new_tokens=400, ignore_eos=True)
        sid2 = next(stream2).session_id
        next(stream2)
        stream2.cancel()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            if all(s not in stack.target_engine.store and s not in stack.proposer.store for s in (sid, sid2)):
                break
            time.sleep(0.05)
        for s in (sid, sid2):
            assert s not in stack.target_engine.store
            assert s not in stack.proposer.store
            assert stack.client.get_session(s).status == "cancelled"
    finally:
        stack.stop()


def test_back_pressure_resource_exhausted(redis_url):
    stack = start_stack(redis_url, draft=DRAFT_EARLY, cfg=FAST, max_active_sessions=1)
    try:
        first = stack.client.stream(PROMPT, max_new_tokens=400, ignore_eos=True)
        next(first)
        with pytest.raises(grpc.RpcError) as e:
            list(stack.client.stream(PROMPT, max_new_tokens=5))
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        first.cancel()
        time.sleep(0.3)
        assert len(stack.client.generate(PROMPT, max_new_tokens=5, ignore_eos=True).token_ids) == 5
    finally:
        stack.stop()


def test_bearer_tokens_and_session_ownership(redis_url):
    from specdec.client import SpecdecClient

    stack = start_stack(redis_url, draft=DRAFT_EARLY, cfg=FAST, auth_tokens=["alice-token", "bob-token"])
    addr = stack.orchestrator_server.address
    try:
        with pytest.raises(grpc.RpcError) as e:
            stack.client.generate(PROMPT, max_new_tokens=3)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with SpecdecClient(addr, token="wrong") as mallory:
            with pytest.raises(grpc.RpcError) as e:
                mallory.generate(PROMPT, max_new_tokens=3)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with SpecdecClient(addr, token="alice-token") as alice, SpecdecClient(addr, token="bob-token") as bob:
            r = alice.generate(PROMPT, max_new_tokens=5, ignore_eos=True)
            assert len(r.session_id) >= 24  # ~144 random bits
            assert list(alice.get_session(r.session_id).generated_token_ids) == r.token_ids
            for call in (bob.get_session, bob.cancel, lambda s: bob.generate(resume_session_id=s)):
                with pytest.raises(grpc.RpcError) as e:
                    call(r.session_id)
                assert e.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        stack.stop()
