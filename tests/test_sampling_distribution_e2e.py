"""Speculative sampling through the real services reproduces the target's distribution.

Tiny models with an 8-token vocabulary; the exact joint distribution of the first 3 generated tokens is
enumerated from the target (512 outcomes), and N speculative samples (different seeds) are compared
with a chi-square test at alpha = 1e-3: with a correct system this fails at random once in 1000 runs;
the seeds are fixed, so the outcome is deterministic. A deliberately broken verifier must fail it.
"""

import itertools
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from specdec.core import sampling
from specdec.core.sampling import SamplingParams
from tests.harness import model, start_stack
from tests.stats import chi_square_test, draws

TARGET = "tiny:vocab=8,layers=2,hidden=32,seed=3,std=0.3"
DRAFT = "tiny:vocab=8,layers=1,hidden=32,seed=3,std=0.3"  # the target's first layer
PROMPT = [1, 2, 3]
N_TOKENS = 3
# The plain path gets the most samples; the paths built on it (pipelined, hybrid, tree) fewer; a broken verifier
# fails with far fewer (accept-all: p = 4e-58 at 300 draws; a tree verifier without the residual update:
# p = 3e-9 at 600, measured once). These draws cost ~25-65 ms each (the whole in-process stack per generation),
# so the default suite stops at what catches those; SPECDEC_STAT_SCALE multiplies them all for a heavier run.
N_SAMPLES = draws(2500)
N_PATH_SAMPLES = draws(1000)
N_BROKEN_SAMPLES = draws(400)
N_POLICY_SAMPLES = draws(700)  # the goodput draft length: only k's choice differs from the plain path
ALPHA = 1e-3
PARAMS = dict(temperature=1.0, top_k=6, top_p=0.95)


def exact_target_distribution(params: SamplingParams, prompt: list[int] = PROMPT) -> dict:
    m = model(TARGET).model
    seqs = list(itertools.product(range(8), repeat=N_TOKENS))
    ids = torch.tensor([prompt + list(s) for s in seqs])
    with torch.no_grad():
        logits = m(input_ids=ids).logits[:, len(prompt) - 1 : -1, :]
    probs = sampling.warp_probs(logits, params)  # [512, 3, 8]
    out = {}
    for i, s in enumerate(seqs):
        p = 1.0
        for j, t in enumerate(s):
            p *= float(probs[i, j, t])
        if p > 0:
            out[s] = p
    return out


def draw(stack, n: int, draft_len: int = 2, extra_tokens: int = 0, prompt: list[int] = PROMPT):
    """n samples of the first N_TOKENS tokens (generating `extra_tokens` more lets later steps run)."""
    samples, proposed, accepted = [], 0, 0
    draw.pipeline_hits = 0
    for seed in range(n):
        r = stack.client.generate(prompt, max_new_tokens=N_TOKENS + extra_tokens, seed=seed, ignore_eos=True,
                                  max_draft_len=draft_len, **PARAMS)
        samples.append(tuple(r.token_ids[:N_TOKENS]))
        proposed += r.stats["draft_tokens_proposed"]
        accepted += r.stats["draft_tokens_accepted"]
        draw.pipeline_hits += r.stats["pipeline_hits"]
    return samples, accepted / max(1, proposed)


@pytest.fixture(scope="module")
def stack(redis_url):
    s = start_stack(redis_url, target=TARGET, draft=DRAFT)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def expected():
    return exact_target_distribution(SamplingParams(**PARAMS))


def test_speculative_sampling_matches_target_distribution(stack, expected):
    samples, acceptance = draw(stack, N_SAMPLES)
    assert 0.05 < acceptance < 0.95, "the draft must be accepted sometimes and rejected sometimes"
    _, p_value = chi_square_test(samples, expected)
    assert p_value > ALPHA, f"speculative samples differ from the target distribution (p={p_value:.2e})"


def test_pipelined_speculative_sampling_matches_target_distribution(redis_url, expected):
    """Pipelining drafts the next block before verification: a used prefetch must not bias the output."""
    from orchestrator.settings import LoopConfig

    s = start_stack(redis_url, target=TARGET, draft=DRAFT, cfg=LoopConfig(pipeline="on", draft_timeout_floor_ms=5000))
    try:
        samples, acceptance = draw(s, N_PATH_SAMPLES, draft_len=1, extra_tokens=1)
    finally:
        s.stop()
    assert draw.pipeline_hits > N_PATH_SAMPLES // 10, "prefetched blocks must actually be used for this to test anything"
    assert 0.05 < acceptance < 0.95, "the draft must be accepted sometimes and rejected sometimes"
    _, p_value = chi_square_test(samples, expected)
    assert p_value > ALPHA, f"speculative samples differ from the target distribution (p={p_value:.2e})"


def test_same_seed_is_reproducible(stack):
    a = [stack.client.generate(PROMPT, max_new_tokens=8, seed=s, ignore_eos=True, **PARAMS).token_ids for s in range(5)]
    b = [stack.client.generate(PROMPT, max_new_tokens=8, seed=s, ignore_eos=True, **PARAMS).token_ids for s in range(5)]
    assert a == b
    assert len({tuple(x) for x in a}) > 1


def test_broken_verifier_fails_the_test(stack, expected, monkeypatch):
    """Accepting every draft token returns the draft's distribution: the test must catch it."""

    def accept_all(target_logits, draft_tokens, draft_probs, params, generator):
        probs = sampling.warp_probs(target_logits[-1], params)
        return sampling.VerifyResult(len(draft_tokens), int(sampling.sample(probs, generator)))

    monkeypatch.setattr("target_service.engines.torch.sampling.verify", accept_all)
    samples, _ = draw(stack, N_BROKEN_SAMPLES)
    _, p_value = chi_square_test(samples, expected)
    assert p_value < ALPHA, f"a broken verifier passed the distribution test (p={p_value:.3f})"


def test_int8_self_draft_sampling_matches_target_distribution(redis_url):
    """SmolLM2's default drafter: the target's own weights in int8 on the lean forward, taking the target's
    prompt KV (a prompt long enough for the hand-over). Its q (float16 on the wire) is close to p: ~99% of drafts
    are accepted here, so this mainly checks that the q it samples from is the q it sends (a mismatch biases every
    accepted token); the residual path has the plain test above."""
    from orchestrator.loop.handover import PARALLEL_PREFILL_MIN_TOKENS

    prompt = [1, 2, 3, 4, 5, 6, 7, 0] * 3  # past the hand-over threshold
    assert len(prompt) - 1 >= PARALLEL_PREFILL_MIN_TOKENS
    expected = exact_target_distribution(SamplingParams(**PARAMS), prompt)
    s = start_stack(redis_url, target=TARGET, draft="int8:" + TARGET)
    try:
        proposer = s.draft_servers[0].servicer.proposer
        assert type(proposer.lm).__name__ == "LeanCachedLM", "the lean int8 forward must be what is tested"
        samples, acceptance = draw(s, N_PATH_SAMPLES, draft_len=2, extra_tokens=1, prompt=prompt)
        imports = s.client.generate(prompt, max_new_tokens=2, seed=0, ignore_eos=True, **PARAMS).stats["kv_imports"]
    finally:
        s.stop()
    assert imports == 1, "the draft must take the target's prompt KV, as deployed"
    assert 0.05 < acceptance < 0.995, f"the draft must be rejected sometimes (acceptance {acceptance:.3f})"
    _, p_value = chi_square_test(samples, expected)
    assert p_value > ALPHA, f"speculative samples differ from the target distribution (p={p_value:.2e})"


def test_hybrid_drafter_sampling_matches_target_distribution(redis_url, expected):
    """Prompt-lookup steps (one-hot q) and model steps (the draft's q) mixed in one generation."""
    s = start_stack(redis_url, target=TARGET, draft="hybrid:" + DRAFT)
    try:
        samples, acceptance = draw(s, N_PATH_SAMPLES, draft_len=2, extra_tokens=1)
        proposer = s.draft_servers[0].servicer.proposer
        used = proposer.ngram_proposals, proposer.model_proposals
    finally:
        s.stop()
    assert min(used) > N_PATH_SAMPLES // 10, f"both kinds of drafts must be used for this to test anything: {used}"
    assert 0.05 < acceptance < 0.95
    _, p_value = chi_square_test(samples, expected)
    assert p_value > ALPHA, f"speculative samples differ from the target distribution (p={p_value:.2e})"


def test_goodput_draft_length_sampling_matches_target_distribution(redis_url, expected, monkeypatch):
    """The goodput policy picks each step's k from earlier verify outcomes (this session's and all sessions'):
    the choice must not bias the output. Its cost inputs are fixed here instead of measured (a loaded machine
    measured a draft so slow that it paused drafting on 697 of 712 steps): the target's costs are its profile,
    and the draft's per-token cost cycles through cheap to prohibitive, so the real policy drafts long, short
    and not at all, step by step, on any machine."""
    from orchestrator.policy.draft_length import DraftCost, GoodputDraftLength, TargetCost
    from orchestrator.settings import LoopConfig

    for cls, names in ((TargetCost, ("observe", "observe_step")),
                       (DraftCost, ("observe", "observe_prefill", "observe_prefetch", "timed_out"))):
        for name in names:
            monkeypatch.setattr(cls, name, lambda self, *a, **kw: None)
    draft_ms = itertools.cycle([0.0, 3.0, 10.0, 25.0, 500.0])  # per drafted token
    current = [0.0]
    monkeypatch.setattr(DraftCost, "per_token", lambda self, sessions=1: current[0])
    chosen, lock = [], threading.Lock()
    best = GoodputDraftLength.best

    def varied_best(self):
        with lock:
            current[0] = next(draft_ms)
            chosen.append(best(self))
            return chosen[-1]

    monkeypatch.setattr(GoodputDraftLength, "best", varied_best)
    prof = [60.0] + [70.0] * 5 + [70.0 + 5 * (n - 6) for n in range(7, 18)]
    cfg = LoopConfig(adaptive_draft_len=True, draft_timeout_floor_ms=5000)
    s = start_stack(redis_url, target=TARGET, draft=DRAFT, cfg=cfg, forward_ms=prof)

    def sample(seed: int) -> tuple:
        r = s.client.generate(PROMPT, max_new_tokens=N_TOKENS + 2, seed=seed, ignore_eos=True, **PARAMS)
        return tuple(r.token_ids[:N_TOKENS])

    try:
        # Four generations at once: sessions share the acceptance prior, so each k also follows other sessions.
        with ThreadPoolExecutor(4) as pool:
            samples = list(pool.map(sample, range(N_POLICY_SAMPLES)))
    finally:
        s.stop()
    lengths = {k: chosen.count(k) for k in set(chosen)}
    assert len(lengths) > 1 and sorted(lengths.values())[-2] >= 10, \
        f"the policy must choose different draft lengths for this to test anything: {lengths}"
    _, p_value = chi_square_test(samples, expected)
    assert p_value > ALPHA, f"speculative samples differ from the target distribution (p={p_value:.2e})"


def test_scored_ngram_drafts_trimmed_by_goodput_keep_the_target_distribution(redis_url):
    """The n-gram drafter (one-hot q) with the goodput policy trimming each draft by its scores: how much is
    verified depends on the draft and on earlier outcomes, never on the verifier's coins of this block, so the
    output must stay the target's distribution."""
    from orchestrator.settings import LoopConfig

    # The prompt holds the target's own greedy continuation of PROMPT, then PROMPT again: the n-gram drafter
    # proposes likely tokens, so drafts are accepted often enough to be drafted, scored and trimmed.
    greedy = model(TARGET).model.generate(torch.tensor([PROMPT]), max_new_tokens=6, do_sample=False,
                                          eos_token_id=None, pad_token_id=0)[0].tolist()
    prompt = greedy + PROMPT
    cfg = LoopConfig(adaptive_draft_len=True, draft_timeout_floor_ms=5000)
    s = start_stack(redis_url, target=TARGET, draft="local:ngram", cfg=cfg, forward_ms=[60.0 + 10 * n for n in range(17)])
    try:
        samples, trimmed, verified = [], 0, 0
        for seed in range(N_POLICY_SAMPLES):
            r = s.client.generate(prompt, max_new_tokens=N_TOKENS + 2, seed=seed, ignore_eos=True, **PARAMS)
            samples.append(tuple(r.token_ids[:N_TOKENS]))
            trimmed += r.stats["draft_tokens_trimmed"]
            verified += r.stats["verify_steps"]
    finally:
        s.stop()
    assert trimmed > 0 and verified > 0, "the drafts must be trimmed for this to test anything"
    _, p_value = chi_square_test(samples, exact_target_distribution(SamplingParams(**PARAMS), prompt))
    assert p_value > ALPHA, f"speculative samples differ from the target distribution (p={p_value:.2e})"
