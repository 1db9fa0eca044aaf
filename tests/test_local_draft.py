"""`--draft local:ngram`: the n-gram drafter inside the orchestrator (orchestrator/replicas/local_draft.py).

Greedy identity with target-only decoding is covered with every other drafter in tests/test_greedy_equivalence.py
(plain and pipelined); here: it really drafts in process, the orchestrator's start-up wires it, bad addresses
are clear errors, and it serves next to remote replicas in one pool."""

import grpc
import pytest

from orchestrator.replicas.draft_pool import LocalDraftReplica
from orchestrator.replicas.local_draft import LocalRpcError, build_local_client
from tests.harness import DRAFT_EARLY, TARGET, model, start_stack

PROMPT = [1, 5, 9, 12, 5, 9, 12, 5, 9]


def test_local_ngram_drafts_in_process(redis_url):
    s = start_stack(redis_url, draft="local:ngram")
    try:
        assert s.draft_servers == [] and isinstance(s.servicer.pool.replicas[0], LocalDraftReplica)
        ref = s.client.generate(PROMPT, max_new_tokens=32, speculation=False, ignore_eos=True)
        got = s.client.generate(PROMPT, max_new_tokens=32, ignore_eos=True, max_draft_len=4)
        assert got.token_ids == ref.token_ids
        assert got.stats["verify_steps"] > 0 and got.stats["draft_tokens_proposed"] > 0
        assert got.stats["draft_failures"] == 0 and got.stats["fallback_steps"] == 0
        proposer = s.servicer.pool.replicas[0].client.servicer.proposer
        assert proposer.num_sessions() == 0  # released when the request finished
    finally:
        s.stop()


def test_local_and_remote_replicas_share_a_pool(redis_url):
    s = start_stack(redis_url, draft=["local:ngram", DRAFT_EARLY])
    try:
        kinds = {type(r).__name__ for r in s.servicer.pool.replicas}
        assert kinds == {"LocalDraftReplica", "DraftReplica"}
        for i in range(6):  # sessions spread over both replicas by rendezvous hashing
            prompt = PROMPT[: 3 + i]
            ref = s.client.generate(prompt, max_new_tokens=16, speculation=False, ignore_eos=True)
            assert s.client.generate(prompt, max_new_tokens=16, ignore_eos=True).token_ids == ref.token_ids
    finally:
        s.stop()


def test_unknown_local_drafter_is_a_clear_error():
    loaded = model(TARGET)
    with pytest.raises(ValueError, match="model drafts run as draft services"):
        build_local_client("local:smollm2-draft", loaded.tokenizer, loaded.name, loaded.vocab_size, "none")


def test_local_errors_carry_grpc_codes():
    """The in-process servicer's aborts arrive as RpcErrors with the service's own code and message."""
    from specdec.v1 import draft_pb2

    loaded = model(TARGET)
    client = build_local_client("local:ngram", loaded.tokenizer, loaded.name, loaded.vocab_size, "none")
    with pytest.raises(LocalRpcError) as e:
        client.stub.Propose(draft_pb2.ProposeRequest(session_id="s", max_draft_len=0))
    assert isinstance(e.value, grpc.RpcError) and e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "max_draft_len" in e.value.details()
    future = client.stub.Propose.future(draft_pb2.ProposeRequest(session_id="", max_draft_len=2))
    assert future.exception().code() == grpc.StatusCode.INVALID_ARGUMENT


def test_orchestrator_start_up_builds_the_local_drafter(redis_url):
    from orchestrator.api.server import build_servicer
    from orchestrator.settings import OrchestratorSettings, ServerSettings
    from specdec.core.kv_cache import SessionCacheStore
    from target_service.engines.torch import TargetEngine
    from target_service.server import build_server as build_target_server

    target = build_target_server(TargetEngine(model(TARGET), SessionCacheStore()), "127.0.0.1:0").start()
    try:
        servicer = build_servicer(OrchestratorSettings(ServerSettings(
            target=target.address, draft="local:ngram", redis=redis_url, tokenizer=TARGET, local_datastore="none")))
        replica = servicer.pool.replicas[0]
        assert isinstance(replica, LocalDraftReplica) and replica.info.strategy == "ngram"
        assert replica.info.tokenizer_fingerprint == model(TARGET).fingerprint
        servicer.pool.close()
        with pytest.raises(ValueError, match="local:model"):
            build_servicer(OrchestratorSettings(ServerSettings(target=target.address, draft="local:model",
                                                               redis=redis_url, tokenizer=TARGET)))
    finally:
        target.stop(0)


def test_dry_n_gram_steps_decode_more_tokens_per_call(redis_url, monkeypatch):
    """While the drafter proposes nothing, the target decodes 1, 2, then --fallback-chunk tokens a call instead of
    one Decode round trip per token; greedy output stays target-only's."""
    from orchestrator.replicas.clients import TargetClient

    asked = []
    decode = TargetClient.decode

    def counting(self, call, *a, **kw):
        asked.append(call.max_tokens)
        return decode(self, call, *a, **kw)

    s = start_stack(redis_url, draft="local:ngram")
    try:
        prompt = list(range(3, 40))  # no n-gram repeats to look up
        ref = s.client.generate(prompt, max_new_tokens=40, speculation=False, ignore_eos=True)
        monkeypatch.setattr(TargetClient, "decode", counting)
        got = s.client.generate(prompt, max_new_tokens=40, ignore_eos=True, max_draft_len=4)
        assert got.token_ids == ref.token_ids
        assert max(asked) > 1 and len(asked) < 40 - got.stats["draft_tokens_accepted"]
    finally:
        s.stop()


def test_the_reply_s_last_block_reaches_the_suffix_drafter_at_release(redis_url):
    """Drafting happens before a step, so the step that ends a reply is never shown to the drafter; the release hands
    it over (ReleaseRequest.final_delta), and the principal's tree holds the whole reply."""
    import time

    s = start_stack(redis_url, draft="local:suffix")
    try:
        proposer = s.servicer.pool.replicas[0].client.servicer.proposer
        finals = []
        take_final = proposer.take_final
        proposer.take_final = lambda sid, pos, delta: (finals.append((pos, list(delta))), take_final(sid, pos, delta))
        got = s.client.generate(PROMPT, max_new_tokens=24, ignore_eos=True)
        deadline = time.monotonic() + 10
        while proposer.num_sessions() and time.monotonic() < deadline:
            time.sleep(0.02)  # the release runs after the stream's last message
        assert proposer.num_sessions() == 0 and len(finals) == 1
        committed = PROMPT + got.token_ids
        pos, delta = finals[0]
        assert delta and pos + len(delta) == len(committed) and delta == committed[pos:]
        assert pos < len(committed)  # the drafter had not been shown the end
    finally:
        s.stop()
