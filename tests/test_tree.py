"""Tree speculation end to end: the tree forward (float 4D mask + position ids) gives each path's chain logits,
only the accepted path's KV survives, the draft's cache is left at the context, and greedy tree speculation
through the real services is token-identical to target-only decoding (with chain fallback and failures)."""

import dataclasses
import threading

import pytest
import torch

from draft_service.proposers.model import ModelProposer
from specdec.core import tree as tree_mod
from specdec.core.kv_cache import CachedLM, SessionCacheStore
from specdec.core.sampling import SamplingParams
from tests.harness import DRAFT_EARLY, DRAFT_OTHER, DRAFT_SAME, INT8_SELF, TARGET, model, start_stack

PARENTS = [-1, -1, 0, 0, 1, 2, 2, 5, -1]  # 3 root children, depth up to 4
TOKENS = [3, 4, 7, 8, 9, 10, 11, 12, 3]   # duplicate sibling token (3) on purpose
GQA = "tiny:vocab=64,layers=2,hidden=64,heads=4,kv_heads=2,seed=5,std=0.3"


def full_logits(loaded, seq):
    with torch.no_grad():
        return loaded.model(input_ids=torch.tensor([seq])).logits[0, :, : loaded.vocab_size].float()


@pytest.mark.parametrize("spec", [TARGET, GQA], ids=["mha", "gqa"])
@pytest.mark.parametrize("cached, new", [(0, 6), (4, 2), (5, 1)], ids=["no-cache", "cache+2", "cache+1"])
def test_tree_forward_logits_equal_chain_forwards_for_every_path(spec, cached, new):
    """Float additive mask [1, 1, n_new, cache_len + n_new] with sdpa: each root-to-leaf path's rows equal a
    plain causal forward of context + path."""
    loaded = model(spec)
    lm = CachedLM(loaded, SessionCacheStore())
    ctx = [1, 5, 9, 12, 5, 9]
    sess = lm.store.get("s")
    if cached:
        lm.extend(sess, ctx[:cached])
    logits = tree_mod.extend_tree(lm, sess, ctx[cached:], TOKENS, PARENTS)
    assert logits.shape == (new + len(TOKENS), loaded.vocab_size)
    assert sess.tokens == ctx and sess.cache.get_seq_length() == len(ctx) + len(TOKENS)
    root = logits[new - 1]
    for path in tree_mod.root_paths(PARENTS):
        want = full_logits(loaded, ctx + [TOKENS[i] for i in path])[len(ctx) - 1:]
        got = torch.stack([root] + [logits[new + i] for i in path])
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # and the new context rows are the ordinary causal ones
    torch.testing.assert_close(logits[:new], full_logits(loaded, ctx)[cached:], rtol=1e-4, atol=1e-4)
    tree_mod.drop_tree_kv(sess)
    assert sess.cache.get_seq_length() == len(ctx)


@pytest.mark.parametrize("path", [[1, 4], [0, 2, 5, 7], [0, 3], [8], []])
def test_keep_tree_path_leaves_an_ordinary_cache(path):
    loaded = model(TARGET)
    lm = CachedLM(loaded, SessionCacheStore())
    ctx = [2, 7, 1, 8]
    sess = lm.store.get("s")
    lm.extend(sess, ctx[:2])
    tree_mod.extend_tree(lm, sess, ctx[2:], TOKENS, PARENTS)
    tree_mod.keep_tree_path(sess, path, TOKENS)
    kept = ctx + [TOKENS[i] for i in path]
    assert sess.tokens == kept and sess.cache.get_seq_length() == len(kept)
    got = lm.extend(sess, [5, 6])
    torch.testing.assert_close(got, full_logits(loaded, kept + [5, 6])[-2:], rtol=1e-4, atol=1e-4)


def test_tree_mask_is_float_and_hides_non_ancestors():
    allowed = tree_mod._tree_allowed(past=3, n_ctx=2, parents=[-1, 0, -1])
    assert allowed.shape == (5, 8)
    assert allowed[4].tolist() == [True] * 5 + [False, False, True]  # node 2: context + itself only
    assert allowed[3].tolist() == [True] * 5 + [True, True, False]   # node 1: its parent 0 and itself
    mask = tree_mod.float_mask(allowed, torch.float32, "cpu")
    assert mask.shape == (1, 1, 5, 8) and mask.dtype == torch.float32
    assert float(mask.max()) == 0.0 and float(mask.min()) == torch.finfo(torch.float32).min


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=1.0, top_k=20)],
                         ids=["greedy", "sampling"])
def test_draft_tree_is_consistent_and_cache_returns_to_context(params):
    loaded = model(DRAFT_EARLY)
    proposer = ModelProposer(loaded, SessionCacheStore())
    ctx = [1, 5, 9, 12, 5, 9]
    shape = tree_mod.TreeShape(budget=14, branch=3, branch_below=1.0)
    t = proposer.get_tree("s", 0, ctx, shape, params, seed=1, step=0)
    sess = proposer.store.get("s")
    assert sess.tokens == ctx and sess.cache.get_seq_length() == len(ctx) and t.cached_len == len(ctx)
    assert len(t.tokens) == 14 and tree_mod.check_parents(t.parents, 14) == t.parents
    assert t.forwards >= 2  # it actually ran tree forwards
    kids = tree_mod.children(t.parents)
    for node in [-1] + list(range(len(t.tokens))):
        if not kids[node + 1]:
            continue
        path, a = [], node
        while a >= 0:
            path.append(t.tokens[a])
            a = t.parents[a]
        logits = full_logits(loaded, ctx + path[::-1])[-1]
        sibs = [t.tokens[c] for c in kids[node + 1]]
        assert len(set(sibs)) == len(sibs)  # no duplicate siblings
        if params.is_greedy:
            assert sibs == torch.topk(logits, len(sibs)).indices.tolist()
        else:
            from specdec.core import wire
            from specdec.core.sampling import warp_probs

            q = wire.fp16_to_distribution(wire.to_fp16_distribution(warp_probs(logits, params))[0])
            first = wire.fp16_to_distribution(t.probs_fp16[kids[node + 1][0]])
            torch.testing.assert_close(first, q, rtol=2e-3, atol=2e-3)
    # the next request continues from the context (+ the accepted tokens) as for a chain
    again = proposer.get_tree("s", len(ctx), [t.tokens[0]], shape, params, seed=1, step=1)
    assert again.cached_len == len(ctx) + 1


# --------------------------------------------------------------------------------------------
# Through the real services
# --------------------------------------------------------------------------------------------

PROMPTS = [[1, 5, 9, 12, 5, 9], [7] * 3 + [30, 31, 32, 7, 7], list(range(1, 40, 3))]
MAX_NEW = 40


def tree_cfg(budget, **kw):
    from orchestrator.settings import LoopConfig

    return LoopConfig(tree_budget=budget, draft_timeout_floor_ms=5000, **kw)


@pytest.fixture(scope="module", params=[DRAFT_EARLY, DRAFT_SAME, DRAFT_OTHER, "ngram", INT8_SELF],
                ids=["early-layer", "same-model", "unrelated", "ngram", "int8-chains-only"])
def stack(request, redis_url):
    s = start_stack(redis_url, draft=request.param, cfg=tree_cfg(4))
    yield s
    s.stop()


@pytest.mark.parametrize("budget, branch, below", [(1, 2, 0.75), (3, 2, 0.75), (6, 3, 1.0), (12, 2, 0.5),
                                                   (16, 4, 0.9)])
def test_greedy_tree_equals_target_only(stack, budget, branch, below):
    stack.servicer.cfg = dataclasses.replace(stack.servicer.cfg, tree_budget=budget, tree_branch=branch,
                                             tree_branch_below=below)
    for prompt in PROMPTS:
        ref = stack.client.generate(prompt, max_new_tokens=MAX_NEW, speculation=False, ignore_eos=True)
        got = stack.client.generate(prompt, max_new_tokens=MAX_NEW, ignore_eos=True)
        assert got.token_ids == ref.token_ids, (budget, prompt)
        s = got.stats
        assert s["generated_tokens"] == MAX_NEW and s["fallback_steps"] == 0 and s["draft_failures"] == 0
        assert s["draft_tokens_accepted"] <= s["draft_tokens_proposed"] <= s["verify_steps"] * budget


def test_tree_acceptance_statistics(redis_url):
    """The same model as draft: a chain-shaped tree (never branch) accepts everything, like a chain."""
    s = start_stack(redis_url, draft=DRAFT_SAME, cfg=tree_cfg(4, tree_branch=1))
    try:
        r = s.client.generate(PROMPTS[0], max_new_tokens=MAX_NEW, ignore_eos=True)
        assert r.stats["acceptance_rate"] == 1.0
        assert r.stats["mean_accepted_length"] == pytest.approx(5.0, abs=0.6)
    finally:
        s.stop()


def test_eos_and_sampling_in_tree_mode(redis_url):
    s = start_stack(redis_url, draft=DRAFT_EARLY, cfg=tree_cfg(6))
    try:
        eos_seen = 0
        for i in range(1, 16):
            prompt = [i, (i * 7) % 63 + 1]
            ref = s.client.generate(prompt, max_new_tokens=60, speculation=False)
            got = s.client.generate(prompt, max_new_tokens=60)
            assert got.token_ids == ref.token_ids and got.finish_reason == ref.finish_reason
            eos_seen += ref.finish_reason == "eos"
        assert eos_seen > 0
        a = s.client.generate(PROMPTS[0], max_new_tokens=30, temperature=0.8, seed=11, ignore_eos=True)
        b = s.client.generate(PROMPTS[0], max_new_tokens=30, temperature=0.8, seed=11, ignore_eos=True)
        assert a.token_ids == b.token_ids and len(a.token_ids) == 30
        assert a.stats["draft_tokens_accepted"] > 0 and a.stats["fallback_steps"] == 0
    finally:
        s.stop()


@pytest.mark.parametrize("kind", ["raises", "bad_parent", "out_of_vocab", "too_many"])
def test_failing_tree_draft_falls_back_to_target_only(redis_url, kind):
    from draft_service.proposers.tree import TreeProposal

    s = start_stack(redis_url, draft=DRAFT_SAME, cfg=tree_cfg(4))
    try:
        vocab = model(TARGET).vocab_size

        def bad(session_id, prefix_len, delta, shape, params, seed, step):
            n = prefix_len + len(delta)
            if kind == "raises":
                raise RuntimeError("draft exploded")
            if kind == "bad_parent":
                return TreeProposal([1, 2], [-1, 5], None, n)
            if kind == "out_of_vocab":
                return TreeProposal([vocab + 3], [-1], None, n)
            return TreeProposal([1] * (shape.budget + 2), [-1] * (shape.budget + 2), None, n)

        s.proposer.get_tree = bad
        ref = s.client.generate(PROMPTS[0], max_new_tokens=20, speculation=False, ignore_eos=True)
        got = s.client.generate(PROMPTS[0], max_new_tokens=20, ignore_eos=True)
        assert got.token_ids == ref.token_ids
        assert got.stats["draft_failures"] >= 1 and got.stats["fallback_steps"] >= 1
        assert got.stats["draft_tokens_accepted"] == 0
    finally:
        s.stop()


def test_tree_verify_through_the_batcher_with_concurrent_sessions(redis_url):
    s = start_stack(redis_url, draft=DRAFT_EARLY, cfg=tree_cfg(5), batch_window_ms=10)
    try:
        prompts = [[i + 1, (i * 7) % 60 + 2, (i * 13) % 61 + 1] for i in range(4)]
        refs = [s.client.generate(p, max_new_tokens=30, speculation=False, ignore_eos=True).token_ids for p in prompts]
        out = [None] * len(prompts)

        def run(i):
            out[i] = s.client.generate(prompts[i], max_new_tokens=30, ignore_eos=True).token_ids

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert out == refs
    finally:
        s.stop()


def test_tree_flags_reach_the_loop_config():
    import argparse

    from orchestrator.api import server

    p = argparse.ArgumentParser()
    server.add_arguments(p)
    args = p.parse_args(["--tree-budget", "6", "--tree-branch", "3", "--tree-branch-below", "0.5"])
    assert (args.tree_budget, args.tree_branch, args.tree_branch_below) == (6, 3, 0.5)
    assert p.parse_args([]).tree_budget == 0  # chain by default


def test_a_draft_that_drafts_chains_only_says_so_and_answers_tree_requests_with_a_chain():
    """The int8 draft's lean forward has no tree mask: a tree request gets a chain (verified as one) instead of an
    error that would make every step of a tree-mode session fall back to target-only decoding."""
    from specdec.v1 import draft_pb2
    from tests.harness import make_proposer, start_draft

    proposer, _ = make_proposer(INT8_SELF)
    assert proposer.drafts_trees is False and make_proposer(DRAFT_EARLY)[0].drafts_trees is True
    server = start_draft(INT8_SELF)
    try:
        import grpc

        from specdec.v1 import common_pb2, draft_pb2_grpc

        stub = draft_pb2_grpc.DraftServiceStub(grpc.insecure_channel(server.address))
        info = stub.GetInfo(common_pb2.GetInfoRequest(), timeout=10)
        assert info.drafts_trees is False
        reply = stub.Propose(draft_pb2.ProposeRequest(session_id="s", delta=common_pb2.TokenDelta(tokens=[1, 5, 9]),
                                                      max_draft_len=4, tree_budget=6), timeout=30)
        assert len(reply.tokens) == 4 and not reply.tree.tokens
    finally:
        server.stop()


def test_the_outline_names_a_draft_that_drafts_chains_only(redis_url):
    from orchestrator.api.outline import build_outline

    s = start_stack(redis_url, draft=INT8_SELF, cfg=tree_cfg(4))
    try:
        outline = build_outline(s.servicer)["draftStrategy"]
        assert outline["structure"] == "tree" and "drafts chains only" in outline["chainsOnly"]
    finally:
        s.stop()
    s = start_stack(redis_url, draft=DRAFT_EARLY, cfg=tree_cfg(4))
    try:
        assert "chainsOnly" not in build_outline(s.servicer)["draftStrategy"]
    finally:
        s.stop()
