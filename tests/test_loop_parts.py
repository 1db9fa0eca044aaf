"""The loop's shared pieces: the one draft-reply check, the typed session record (versioned, legacy records load),
the settings dataclasses that generate each service's flags, and the advertised longest draft."""

from __future__ import annotations

import argparse
import json
import types

import pytest

from orchestrator.loop.validate import draft_reply_problem
from orchestrator.store.records import RECORD_VERSION, GenerationParams, GenerationStats
from orchestrator.store.session_store import MemorySessionStore, RedisSessionStore, SessionRecord
from specdec.core import wire


def _dist(vocab: int, probs: dict[int, float]):
    import torch

    row = torch.zeros(vocab, dtype=torch.float16)
    for t, p in probs.items():
        row[t] = p
    return wire.encode_distribution(row)


def test_one_check_refuses_every_kind_of_malformed_draft_reply():
    ok = dict(vocab_size=10, greedy=False, max_tokens=3)
    good = _dist(10, {1: 0.5, 2: 0.5})
    assert draft_reply_problem([1, 2], [good, good], [0.9, 0.1], **ok) is None
    assert draft_reply_problem([1, 2], [], [], **ok) is None  # no distributions: one-hot drafts
    assert "asked for" in draft_reply_problem([1, 2, 3, 4], [], [], **ok)
    assert "vocabulary" in draft_reply_problem([1, 10], [], [], **ok)
    assert "distributions" in draft_reply_problem([1, 2], [good], [], **ok)
    assert draft_reply_problem([1, 2], [good], [], **{**ok, "greedy": True}) is None  # greedy ignores them
    assert "scores" in draft_reply_problem([1, 2], [], [0.5], **ok)
    assert "scores" in draft_reply_problem([1, 2], [], [0.5, float("nan")], **ok)
    import numpy as np

    from specdec.v1 import common_pb2

    # indices and values of different lengths: what the target's own check refuses
    broken = common_pb2.Distribution(indices=[1, 2], values_fp16=np.float16([0.5]).astype("<f2").tobytes())
    with pytest.raises(ValueError):
        wire.decode_distribution(broken, 10)
    assert "malformed distribution" in draft_reply_problem([1, 2], [good, broken], [], **ok)


def test_one_check_refuses_a_reply_that_is_not_a_tree():
    tree = dict(vocab_size=10, greedy=True, max_tokens=5, max_depth=2)
    assert draft_reply_problem([1, 2, 3], [], [], tree_parents=[-1, 0, -1], **tree) is None
    assert "parent" in draft_reply_problem([1, 2, 3], [], [], tree_parents=[-1, 2, 0], **tree)  # a later parent
    assert "parents for" in draft_reply_problem([1, 2], [], [], tree_parents=[-1], **tree)
    assert "deep" in draft_reply_problem([1, 2, 3], [], [], tree_parents=[-1, 0, 1], **tree)


def test_the_chain_the_prefetch_and_the_tree_use_the_one_check(monkeypatch):
    """A reply the check refuses is a failed draft on the chain's and the tree's path, and an unused block on the
    prefetch's."""
    from orchestrator.loop import draft_call, prefetch
    from orchestrator.loop.draft_call import DraftCall
    from orchestrator.loop.prefetch import PendingPrefetch, Prefetcher
    from tests.harness import loop_state

    calls = []

    def refuse(*args, **kwargs):
        calls.append(kwargs.get("tree_parents"))
        return "refused"

    monkeypatch.setattr(draft_call, "draft_reply_problem", refuse)
    monkeypatch.setattr(prefetch, "draft_reply_problem", refuse)
    state = loop_state()
    draft = DraftCall(state)
    failures = []
    draft.failed = lambda replica, kind, detail: failures.append((kind, detail))
    reply = types.SimpleNamespace(tokens=[1], probs=[], scores=[], cached_len=3, draft_ms=1.0, resynced=False,
                                  tree_parents=None)
    tree_reply = types.SimpleNamespace(**{**vars(reply), "tree_parents": [-1]})
    replica = types.SimpleNamespace(address="d", info=None, client=types.SimpleNamespace(
        propose=lambda call, timeout: tree_reply if call.tree else reply))
    assert draft.propose(replica, 2) == (None, True)
    tree = dict(tree_budget=4, tree_branch=0, tree_branch_below=0.0, tree_max_depth=3)
    assert draft.propose_tree(replica, tree, 2, 3) == (None, True)
    assert failures == [("malformed", "refused")] * 2

    future = types.SimpleNamespace(result=lambda timeout=None: types.SimpleNamespace(
        tokens=[9, 10], probs=[], token_scores=[], cached_len=6, draft_ms=1.0))
    pf = Prefetcher(state, types.SimpleNamespace(timeout_s=lambda k: 0.1))
    pf.pending = PendingPrefetch(future, replica, 3, [4, 9], 3, True)
    assert pf.resolve() is False and pf.prefetched is None
    assert calls == [None, [-1], None]


def test_params_and_stats_round_trip_with_their_version(redis_url):
    params = GenerationParams(temperature=0.7, top_k=5, top_p=0.9, seed=3, max_new_tokens=12, stop=["\n"],
                              stop_token_ids=[7], speculation=False, max_draft_len=2, ignore_eos=True, owner="p")
    stats = GenerationStats(verify_steps=3, draft_ms=1.5, draft_failures_by_kind={"timeout": 2})
    assert json.loads(params.to_json())["version"] == RECORD_VERSION
    assert GenerationParams.from_json(params.to_json()) == params
    assert GenerationStats.from_json(stats.to_json()) == stats
    for store in (RedisSessionStore(redis_url), MemorySessionStore()):
        store.create(SessionRecord("typed", [1, 2], params, stats=stats))
        back = store.load("typed")
        assert back.params == params and back.stats == stats
        assert isinstance(back.params, GenerationParams) and isinstance(back.stats, GenerationStats)
        store.delete("typed")


def test_a_record_stored_before_the_version_still_loads(redis_url):
    """The old layout: params and stats as plain JSON dicts without a version (stats keys only once counted)."""
    from orchestrator.store.session_store import KEY_PREFIX, pack_tokens

    store = RedisSessionStore(redis_url)
    legacy_params = dict(temperature=0.0, top_k=0, top_p=1.0, seed=0, max_new_tokens=8, stop=[], stop_token_ids=[],
                         speculation=True, max_draft_len=0, ignore_eos=False, owner="")
    store.client.hset(KEY_PREFIX + "legacy", mapping={
        "prompt": pack_tokens([1, 2]), "params": json.dumps(legacy_params), "status": "running",
        "finish_reason": 0, "target_pos": 1, "draft_pos": 0, "step": 2,
        "stats": json.dumps({"verify_steps": 2, "draft_ms": 3.0, "draft_failures_by_kind": {"malformed": 1}})})
    store.client.set(KEY_PREFIX + "legacy:gen", pack_tokens([5, 6]))
    rec = store.load("legacy")
    assert rec.params == GenerationParams(max_new_tokens=8) and rec.params.owner == ""
    assert rec.stats.verify_steps == 2 and rec.stats.draft_ms == 3.0 and rec.stats.fallback_steps == 0
    assert rec.stats.draft_failures_by_kind == {"malformed": 1}
    assert rec.generated == [5, 6]
    store.delete("legacy")


def test_a_record_from_a_newer_orchestrator_is_refused_with_a_clear_error():
    with pytest.raises(ValueError, match="newer orchestrator"):
        GenerationParams.from_dict({"version": RECORD_VERSION + 1, "max_new_tokens": 3})


def test_settings_generate_each_services_flags_from_one_definition():
    from dataclasses import dataclass

    from specdec.core.settings import add_arguments, from_args, setting

    @dataclass
    class S:
        name: str = setting("x", "a name")
        count: int = setting(2, "how many", flag="--n")
        mode: str = setting("a", "a mode", choices=("a", "b"))
        on: bool = setting(False, "a switch")
        hidden: float = setting(1.5, cli=False)

    p = argparse.ArgumentParser()
    add_arguments(p, S)
    assert from_args(S, p.parse_args([])) == S()
    assert from_args(S, p.parse_args(["--n", "5", "--mode", "b", "--on"])) == S(count=5, mode="b", on=True)
    assert "--hidden" not in p._option_string_actions
    with pytest.raises(SystemExit):
        p.parse_args(["--mode", "c"])


def test_each_servers_add_arguments_still_builds_its_flags():
    """docs/configuration.md is generated by calling each server's add_arguments on a fresh parser."""
    from draft_service import server as draft
    from orchestrator.api import server as orchestrator
    from target_service import server as target

    # --max-draft-len 0: the engine's own (target) or the strategy's own (draft) limit
    for module, flag, default in ((orchestrator, "--draft-len", 4), (target, "--max-draft-len", 0),
                                  (draft, "--max-draft-len", 0)):
        p = argparse.ArgumentParser()
        module.add_arguments(p)
        assert p._option_string_actions[flag].default == default


def test_a_request_is_admitted_with_the_smallest_of_the_advertised_draft_limits():
    """The draft ceiling is resolved once, at admission (orchestrator/api/limits.py), into GenerationParams; the
    loop's step reads it and nothing downstream clamps it again."""
    from orchestrator.api.limits import RequestLimits, check_request, resolve_resumed, smallest_limit
    from orchestrator.loop.state import Backends, LoopState, Measurements, StreamControl
    from orchestrator.loop.step import Step
    from orchestrator.settings import LoopConfig
    from specdec.core.grpc_util import RpcAbort
    from specdec.v1 import orchestrator_pb2 as opb

    def admitted(request: int = 0, server: int = 16, target: int = 0, drafts: int = 0):
        limits = RequestLimits(max_new_tokens=64, max_draft_len=smallest_limit(server, target, drafts),
                               vocab_size=100, max_context=512, max_prompt_tokens=512)
        req = opb.GenerateRequest(token_ids=opb.TokenIds(ids=[1, 2]), max_new_tokens=8, max_draft_len=request)
        return check_request(req, limits, tokenizer=None)[1]

    def step(**kw) -> Step:
        rec = SessionRecord("s", [1, 2], admitted(**kw))
        cfg = LoopConfig(default_draft_len=6, max_draft_len=kw.get("server", 16), adaptive_draft_len=False)
        return Step(LoopState(rec, cfg, Backends(None, None, None, set(), 100), Measurements(), StreamControl()))

    assert admitted().draft_len_limit == 16                  # nothing else advertised: the orchestrator's limit
    assert admitted(target=3).draft_len_limit == 3           # the target verifies at most 3
    assert admitted(target=8, drafts=5).draft_len_limit == 5  # the drafts take at most 5
    assert admitted(request=2, target=8).draft_len_limit == 8  # a request's own length is fixed, within it
    with pytest.raises(RpcAbort, match="max_draft_len 9 exceeds the limit of 8"):
        admitted(request=9, target=8)
    assert step().draft_len.k == 6 and step(target=3).draft_len.k == 3 and step(request=2).draft_len.k == 2
    assert step(server=5).draft_len.k == 5
    resumed = admitted(request=12)  # stored when the services took 12; the target it resumes on takes 4
    resolve_resumed(resumed, RequestLimits(64, 4, 100, 512, 512))
    assert (resumed.max_draft_len, resumed.draft_len_limit) == (4, 4)
    with pytest.raises(ValueError, match="resolved when it is admitted"):
        LoopState(SessionRecord("s", [1, 2], {}), LoopConfig(), Backends(None, None, None, set(), 100),
                  Measurements(), StreamControl())


def test_services_advertise_the_longest_draft_they_take(redis_url):
    from tests.harness import start_stack

    s = start_stack(redis_url, draft="ngram")
    try:
        assert s.servicer.target_info.max_draft_len == s.target_engine.max_draft_len == 16
        assert s.servicer.pool.replicas[0].info.max_draft_len == 16
        assert s.servicer.request_limits().max_draft_len == 16
    finally:
        s.stop()
