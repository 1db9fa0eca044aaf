"""Tree speculative sampling through the real services reproduces the target's distribution.

Same set-up as tests/test_sampling_distribution_e2e.py (vocabulary-8 tiny models, exact joint distribution of
the first 3 generated tokens, chi-square at alpha = 1e-3 with fixed seeds), with the orchestrator in tree mode
(always branching, so siblings after the first are verified against the residual all the time). A verifier
that does not update the residual between siblings must fail it.
"""

import pytest

from specdec.core import sampling
from tests.harness import start_stack
from tests.stats import chi_square_test, draws
from tests.test_sampling_distribution_e2e import ALPHA, DRAFT, N_PATH_SAMPLES, TARGET, draw
from tests.test_sampling_distribution_e2e import expected  # noqa: F401 - fixture
from tests.test_tree_sampling import broken_no_residual_update


@pytest.fixture(scope="module")
def tree_stack(redis_url):
    from orchestrator.settings import LoopConfig

    cfg = LoopConfig(tree_budget=5, tree_branch=2, tree_branch_below=1.0, draft_timeout_floor_ms=5000)
    s = start_stack(redis_url, target=TARGET, draft=DRAFT, cfg=cfg)
    yield s
    s.stop()


def test_tree_speculative_sampling_matches_target_distribution(tree_stack, expected, monkeypatch):  # noqa: F811
    real = sampling.verify_tree
    later_sibling = [0]

    def spy(target_logits, tokens, parents, draft_probs, params, generator):
        res = real(target_logits, tokens, parents, draft_probs, params, generator)
        kids = [[i for i, p in enumerate(parents) if p == node] for node in [-1, *res.path]]
        later_sibling[0] += any(node != sibs[0] for node, sibs in zip(res.path, kids))
        return res

    monkeypatch.setattr("target_service.engines.torch_tree.sampling.verify_tree", spy)
    samples, acceptance = draw(tree_stack, N_PATH_SAMPLES)
    assert 0.05 < acceptance < 0.95, "the tree must be accepted sometimes and rejected sometimes"
    assert later_sibling[0] > N_PATH_SAMPLES // 20, "second siblings must get accepted for this to test anything"
    _, p_value = chi_square_test(samples, expected)
    assert p_value > ALPHA, f"tree speculative samples differ from the target distribution (p={p_value:.2e})"


def test_broken_tree_verifier_fails_the_test(tree_stack, expected, monkeypatch):  # noqa: F811
    """Testing every sibling against the original p (no residual update) is biased: the test must catch it."""
    monkeypatch.setattr("target_service.engines.torch_tree.sampling.verify_tree", broken_no_residual_update)
    samples, _ = draw(tree_stack, draws(600))  # p = 3e-9 at 600 draws, measured once
    _, p_value = chi_square_test(samples, expected)
    assert p_value < ALPHA, f"a broken tree verifier passed the distribution test (p={p_value:.3f})"


# The last two tokens (1, 2) occurred three times, followed by 3, 4 and 5: the n-gram drafter's tree has three
# deterministic siblings at the root (and one-hot q, so a rejected sibling leaves the residual max(p - 0, ...)
# renormalised without it).
NGRAM_PROMPT = [1, 2, 3, 1, 2, 4, 1, 2, 5, 1, 2]


def test_ngram_tree_sampling_matches_target_distribution(redis_url, monkeypatch):
    from orchestrator.settings import LoopConfig
    from specdec.core.sampling import SamplingParams
    from tests.test_sampling_distribution_e2e import PARAMS, exact_target_distribution

    real = sampling.verify_tree
    seen = {"trees": 0, "branching": 0, "later_sibling": 0}

    def spy(target_logits, tokens, parents, draft_probs, params, generator):
        assert draft_probs is None, "n-gram drafts are deterministic: no q goes on the wire"
        res = real(target_logits, tokens, parents, draft_probs, params, generator)
        kids = [[i for i, p in enumerate(parents) if p == node] for node in [-1, *res.path]]
        seen["trees"] += 1
        seen["branching"] += len(kids[0]) > 1
        seen["later_sibling"] += any(node != sibs[0] for node, sibs in zip(res.path, kids))
        return res

    monkeypatch.setattr("target_service.engines.torch_tree.sampling.verify_tree", spy)
    n = draws(700)  # more than the broken tree verifier test needs to reject a biased verifier (600)
    s = start_stack(redis_url, target=TARGET, draft="ngram", cfg=LoopConfig(tree_budget=6, draft_timeout_floor_ms=5000))
    try:
        samples, acceptance = draw(s, n, prompt=NGRAM_PROMPT)
    finally:
        s.stop()
    assert seen["branching"] > n // 2, "the n-gram drafter must branch where the context's matches disagree"
    assert seen["later_sibling"] > n // 20, "second siblings must get accepted for this to test anything"
    assert 0.05 < acceptance < 0.95
    _, p_value = chi_square_test(samples, exact_target_distribution(SamplingParams(**PARAMS), NGRAM_PROMPT))
    assert p_value > ALPHA, f"n-gram tree samples differ from the target distribution (p={p_value:.2e})"
