"""Tree speculation maths (specdec.core.sampling.verify_tree_*, sample_siblings, specdec.core.tree.build_tree): unit tests,
and an exact-distribution chi-square test of a tree speculative loop (with broken variants that must fail).

The loop uses the toy table models of tests/test_sampling.py (vocabulary 6; the first 3 tokens' exact joint
distribution is enumerated from the target). Seeds are fixed, so each outcome is deterministic; a correct
verifier fails a test at alpha = 1e-3 with probability 1/1000 over seeds.
"""

from __future__ import annotations

import pytest
import torch

from specdec.core import tree as tree_mod
from specdec.core import wire
from specdec.core.sampling import (SamplingParams, TreeVerifyResult, make_generator, sample, sample_siblings,
                              verify_rejection, verify_tree, verify_tree_greedy, verify_tree_rejection, warp_probs)
from tests.stats import chi_square_test, total_variation
from tests.test_sampling import ALPHA, DRAFT, N_TOKENS, TARGET, exact_joint

N_SAMPLES = 3000


# --------------------------------------------------------------------------------------------
# Structure helpers
# --------------------------------------------------------------------------------------------


def test_tree_structure_helpers():
    parents = [-1, -1, 0, 0, 1, 2]
    assert tree_mod.check_parents(parents, 6) == parents
    assert tree_mod.depths(parents) == [0, 0, 1, 1, 1, 2]
    assert tree_mod.children(parents) == [[0, 1], [2, 3], [4], [5], [], [], []]
    assert sorted(tree_mod.root_paths(parents)) == [[0, 2, 5], [0, 3], [1, 4]]
    anc = tree_mod.ancestor_matrix(parents)
    assert anc[5].tolist() == [True, False, True, False, False, True]
    for bad in ([0], [-1, 1], [-2], [-1, 3, 0]):
        with pytest.raises(ValueError, match="parent"):
            tree_mod.check_parents(bad)
    with pytest.raises(ValueError, match="parents for"):
        tree_mod.check_parents([-1], 2)


# --------------------------------------------------------------------------------------------
# Greedy
# --------------------------------------------------------------------------------------------


def one_hot_rows(best, vocab=8):
    rows = torch.zeros(len(best), vocab)
    rows[torch.arange(len(best)), torch.tensor(best)] = 5.0
    return rows


def test_verify_tree_greedy_walks_the_matching_branch():
    # root children: 3 (node 0), 4 (node 1); node 1's children: 5 (node 2), 6 (node 3); node 3's child: 7 (node 4)
    tokens, parents = [3, 4, 5, 6, 7], [-1, -1, 1, 1, 3]
    # target argmax: after root 4; after node 1 -> 6; after node 3 -> 7; after node 4 -> 2 (bonus)
    logits = one_hot_rows([4, 0, 6, 0, 7, 2])
    assert verify_tree_greedy(logits, tokens, parents) == TreeVerifyResult((1, 3, 4), 2)
    assert verify_tree_greedy(logits, tokens, parents).num_accepted == 3
    # mismatch at the root: correction = argmax of row 0
    assert verify_tree_greedy(one_hot_rows([1, 0, 0, 0, 0, 0]), tokens, parents) == TreeVerifyResult((), 1)
    # duplicate siblings: the first match wins
    assert verify_tree_greedy(one_hot_rows([3, 1, 1]), [3, 3], [-1, -1]) == TreeVerifyResult((0,), 1)
    assert verify_tree_greedy(one_hot_rows([2]), [], []) == TreeVerifyResult((), 2)


def test_verify_tree_greedy_chain_equals_chain_verifier():
    from specdec.core.sampling import verify_greedy

    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        logits = torch.randn(5, 4, generator=g)
        draft = torch.randint(0, 4, (4,), generator=g).tolist()
        chain = verify_greedy(logits, draft)
        t = verify_tree_greedy(logits, draft, [-1, 0, 1, 2])
        assert (t.num_accepted, t.next_token) == (chain.num_accepted, chain.next_token)
        assert t.path == tuple(range(chain.num_accepted))


def test_verify_tree_input_errors():
    p = torch.full((3, 4), 0.25)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        verify_tree_greedy(p, [0, 4], [-1, -1])
    with pytest.raises(ValueError, match="parent"):
        verify_tree_greedy(p, [0, 1], [-1, 1])
    with pytest.raises(ValueError, match="shape"):
        verify_tree_greedy(p, [0], [-1])
    with pytest.raises(ValueError, match="shape"):
        verify_tree_rejection(p, torch.full((1, 4), 0.25), [0, 1], [-1, -1], make_generator(0))
    with pytest.raises(ValueError, match="generator"):
        verify_tree(p, [0, 1], [-1, -1], None, SamplingParams(temperature=1.0), None)


# --------------------------------------------------------------------------------------------
# Rejection sampling: small exact cases
# --------------------------------------------------------------------------------------------


def test_p_equal_q_accepts_the_first_sibling():
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(4, 6, generator=g), -1)
    q = torch.stack([p[0], p[0], p[1]])
    for seed in range(100):
        res = verify_tree_rejection(p, q, [2, 3, 1], [-1, -1, 0], make_generator(seed))
        assert res.path[0] == 0 and len(res.path) >= 1


def test_second_sibling_is_tested_against_the_residual():
    # p = [.5, .5, 0]; q = [.5, .5, 0], siblings drawn WITHOUT replacement: x1 = 0 (q1 = q), x2 = 1 (q2 = [0, 1, 0]).
    # Stage 1 accepts 0 always (p == q). Make p = [0, 1, 0]: stage 1 rejects 0 (p(0) = 0), residual
    # norm(max(0, p - q1)) = [0, 1, 0]; stage 2 accepts 1 with min(1, 1/1) = 1. Never a correction.
    p = torch.tensor([[0.0, 1.0, 0.0], [0.2, 0.3, 0.5], [0.2, 0.3, 0.5]])
    q = torch.tensor([[0.5, 0.5, 0.0], [0.0, 1.0, 0.0]])
    for seed in range(50):
        assert verify_tree_rejection(p, q, [0, 1], [-1, -1], make_generator(seed)).path == (1,)


def test_all_rejected_samples_the_final_residual():
    # p = [.6, .4, 0]; deterministic siblings 2 then 0: p(2) = 0 rejects, residual [.6, .4, 0];
    # node 0 accepted w.p. .6, else residual drops 0 -> correction must be 1.
    p = torch.tensor([[0.6, 0.4, 0.0], [1.0, 0.0, 0.0], [1.0, 0.0, 0.0]])
    seen = set()
    for seed in range(200):
        r = verify_tree_rejection(p, None, [2, 0], [-1, -1], make_generator(seed))
        seen.add((r.path, r.next_token))
    assert seen == {((1,), 0), ((), 1)}


def test_chain_tree_matches_chain_rejection_statistics():
    g = torch.Generator().manual_seed(3)
    p = torch.softmax(torch.randn(4, 5, generator=g), -1)
    q = torch.softmax(torch.randn(3, 5, generator=g), -1)
    chain = [verify_rejection(p, q, [1, 2, 3], make_generator(s)).num_accepted for s in range(3000)]
    tree = [verify_tree_rejection(p, q, [1, 2, 3], [-1, 0, 1], make_generator(s)).num_accepted for s in range(3000)]
    # Same acceptance probabilities (the same u's are used), so the counts agree up to float noise.
    assert abs(sum(chain) - sum(tree)) <= 3


def test_sample_siblings_without_and_with_replacement():
    q = torch.tensor([0.5, 0.3, 0.2, 0.0])
    g = make_generator(0)
    for _ in range(50):
        drawn = sample_siblings(q, 5, g)
        toks = [t for t, _, _ in drawn]
        assert len(toks) == 3 and sorted(toks) == [0, 1, 2]  # support has 3 tokens, no repeats
        # each sibling's distribution has the earlier siblings zeroed
        for j, (_, _, row) in enumerate(drawn):
            assert all(float(row[t]) == 0.0 for t in toks[:j])
            assert float(row.sum()) == pytest.approx(1.0)
    iid = sample_siblings(q, 6, g, replace=True)
    assert len(iid) == 6 and all(torch.equal(r, iid[0][2]) for _, _, r in iid)
    # fp16 rounding: each sibling is drawn from exactly the distribution whose payload goes on the wire
    drawn = sample_siblings(q, 2, g, round_fn=wire.to_fp16_distribution)
    assert all(row.dtype == torch.float16 for _, _, row in drawn)


def test_build_tree_greedy_branches_only_where_uncertain():
    confident = torch.tensor([5.0, 0.0, 0.0, 0.0])
    flat = torch.tensor([0.3, 0.2, 0.1, 0.0])

    def expand(nodes, t):
        return torch.stack([flat if t.tokens[i] == 0 else confident for i in nodes])

    shape = tree_mod.TreeShape(budget=7, branch=3, branch_below=0.9)
    t = tree_mod.build_tree(confident, expand, shape, SamplingParams(), None)
    # root is confident -> one child (0); after 0 the draft is flat -> 3 children (0, 1, 2), ...
    assert t.parents[:4] == [-1, 0, 0, 0] and t.tokens[:4] == [0, 0, 1, 2]
    assert len(t.tokens) == 7 and t.probs_fp16 is None
    assert max(tree_mod.depths(t.parents)) < 7
    with pytest.raises(ValueError):
        tree_mod.TreeShape(budget=0).validate()


# --------------------------------------------------------------------------------------------
# Exact-distribution test of a tree speculative loop
# --------------------------------------------------------------------------------------------


def _path_tokens(t, node) -> tuple:
    out = []
    while node >= 0:
        out.append(t.tokens[node])
        node = t.parents[node]
    return tuple(out[::-1])


def build_with_tree_builder(ctx, params, g_draft, shape, round_fn):
    """The draft service's builder (siblings without replacement, path-probability frontier)."""
    def expand(nodes, t):
        return torch.stack([DRAFT.logits(ctx + _path_tokens(t, i)) for i in nodes])

    t = tree_mod.build_tree(DRAFT.logits(ctx), expand, shape, params, g_draft, round_fn)
    probs = None if t.probs_fp16 is None else wire.fp16_to_distribution(t.probs_fp16) if round_fn else t.probs_fp16
    return t.tokens, t.parents, probs


def build_iid(ctx, params, g_draft, widths=(3, 2)):
    """Siblings drawn i.i.d. (with replacement) from q: `widths[d]` children per node at depth d."""
    tokens, parents, rows = [], [], []
    frontier = [(-1, ctx)]
    for w in widths:
        nxt = []
        for node, c in frontier:
            q = DRAFT.probs(c, params)
            for x, _, row in sample_siblings(q, w, g_draft, replace=True):
                tokens.append(x)
                parents.append(node)
                rows.append(row)
                nxt.append((len(tokens) - 1, c + (x,)))
        frontier = nxt
    return tokens, parents, torch.stack(rows)


def build_deterministic(ctx, params, g_draft, widths=(3, 2)):
    """Deterministic siblings: the draft's top tokens (q is one-hot; draft_probs None)."""
    tokens, parents = [], []
    frontier = [(-1, ctx)]
    for w in widths:
        nxt = []
        for node, c in frontier:
            for x in torch.topk(DRAFT.probs(c, params), w).indices.tolist():
                tokens.append(x)
                parents.append(node)
                nxt.append((len(tokens) - 1, c + (x,)))
        frontier = nxt
    return tokens, parents, None


def tree_samples(build, params, verify_fn=verify_tree, n_samples=N_SAMPLES, seed=0):
    g_draft, g_target = make_generator(seed, "draft"), make_generator(seed, "target")
    out, accepted, steps = [], 0, 0
    for _ in range(n_samples):
        ctx: tuple = ()
        while len(ctx) < N_TOKENS:
            tokens, parents, probs = build(ctx, params, g_draft)
            paths = {}
            rows = [TARGET.logits(ctx)]
            for i in range(len(tokens)):
                p = parents[i]
                paths[i] = (paths[p] if p >= 0 else ()) + (tokens[i],)
                rows.append(TARGET.logits(ctx + paths[i]))
            res = verify_fn(torch.stack(rows), tokens, parents, probs, params, g_target)
            ctx = ctx + tuple(tokens[i] for i in res.path) + (res.next_token,)
            accepted += len(res.path)
            steps += 1
        out.append(ctx[:N_TOKENS])
    tree_samples.mean_accepted = accepted / steps
    return out


T1 = SamplingParams(temperature=1.0)
WARPED = SamplingParams(temperature=1.8, top_k=5, top_p=0.8)
BRANCHY = tree_mod.TreeShape(budget=6, branch=3, branch_below=1.0, width=2)  # always branch
MIXED = tree_mod.TreeShape(budget=5, branch=2, branch_below=0.45)

CASES = {
    "wor-branchy": (lambda c, p, g: build_with_tree_builder(c, p, g, BRANCHY, None), T1),
    "wor-mixed-fp16-warped": (lambda c, p, g: build_with_tree_builder(c, p, g, MIXED, wire.to_fp16_distribution),
                              WARPED),
    "iid": (build_iid, T1),
    "deterministic": (build_deterministic, SamplingParams(temperature=1.2, top_p=0.95)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_tree_speculative_loop_matches_target_distribution(case):
    build, params = CASES[case]
    samples = tree_samples(build, params)
    assert tree_samples.mean_accepted > 0.3, "the tree must get accepted tokens for this to test anything"
    expected = exact_joint(params)
    stat, p_value = chi_square_test(samples, expected)
    assert p_value >= ALPHA, f"{case}: chi2={stat:.1f} p={p_value:.2e}"
    assert total_variation(samples, expected) < 0.1


def test_tree_greedy_loop_is_the_target_argmax_path():
    params = SamplingParams()
    (greedy_path,) = exact_joint(params)
    build = lambda c, p, g: build_with_tree_builder(c, p, g, BRANCHY, None)
    assert set(tree_samples(build, params, n_samples=20)) == {greedy_path}


# -- broken variants: each must FAIL the same test ---------------------------------------------


def broken_no_residual_update(target_logits, tokens, parents, draft_probs, params, generator):
    """Every sibling is tested against the ORIGINAL p (the residual is not updated between siblings);
    only the final correction uses a residual (that of the last sibling)."""
    p_all = warp_probs(target_logits, params).double()
    kids = tree_mod.children(parents)
    u = torch.rand(len(tokens), generator=generator, dtype=torch.float64).tolist()
    path, node = [], -1
    while True:
        sibs = kids[node + 1]
        p = p_all[node + 1]
        if not sibs:
            return TreeVerifyResult(tuple(path), int(sample(p, generator)))
        for c in sibs:
            q = draft_probs[c].double() if draft_probs is not None else torch.nn.functional.one_hot(
                torch.tensor(tokens[c]), p.shape[-1]).double()
            if q[tokens[c]] > 0 and u[c] * q[tokens[c]] <= p[tokens[c]]:
                break
        else:
            r = (p - q).clamp_min(0)
            return TreeVerifyResult(tuple(path), int(sample(r / r.sum() if r.sum() > 0 else p, generator)))
        path.append(c)
        node = c


def broken_first_q_for_all_siblings(target_logits, tokens, parents, draft_probs, params, generator):
    """Treats siblings drawn without replacement as i.i.d.: every sibling verified with the first one's q."""
    fixed = draft_probs.clone()
    for sibs in tree_mod.children(parents):
        for c in sibs[1:]:
            fixed[c] = draft_probs[sibs[0]]
    return verify_tree(target_logits, tokens, parents, fixed, params, generator)


@pytest.mark.parametrize("broken, case", [
    (broken_no_residual_update, "wor-branchy"),
    (broken_no_residual_update, "iid"),
    (broken_no_residual_update, "deterministic"),
    (broken_first_q_for_all_siblings, "wor-branchy"),
], ids=["no-residual-update-wor", "no-residual-update-iid", "no-residual-update-deterministic",
        "wor-verified-as-iid"])
def test_broken_tree_verifier_fails_the_chi_square_test(broken, case):
    build, params = CASES[case]
    samples = tree_samples(build, params, verify_fn=broken, n_samples=N_SAMPLES // 2)  # fails by far
    _, p_value = chi_square_test(samples, exact_joint(params))
    assert p_value < ALPHA, f"a broken tree verifier passed (p={p_value:.3f})"
