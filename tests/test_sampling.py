"""Tests for specdec.core.sampling: unit tests, plus a statistical end-to-end check that a speculative
decoding loop built on verify() reproduces the target's distribution (and that the check can fail)."""

from __future__ import annotations

import math
from typing import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec.core.sampling import (
    SamplingParams,
    VerifyResult,
    expected_accepted_length,
    make_generator,
    sample,
    speculative_speedup,
    verify,
    verify_greedy,
    verify_rejection,
    warp_probs,
)
from tests.stats import chi_square_test, total_variation

T1 = SamplingParams(temperature=1.0)


def logits_of(probs) -> torch.Tensor:
    return torch.tensor(probs, dtype=torch.float64).log().float()


# --------------------------------------------------------------------------------------------
# SamplingParams
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(temperature=-0.1), "temperature must be a finite number >= 0"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(temperature=float("inf")), "temperature"),
        (dict(temperature="1"), "temperature"),
        (dict(temperature=1.0, top_k=-1), "top_k must be a whole number >= 0"),
        (dict(temperature=1.0, top_k=2.5), "top_k"),
        (dict(temperature=1.0, top_p=0.0), r"top_p must be a number in \(0, 1\]"),
        (dict(temperature=1.0, top_p=1.5), "top_p"),
        (dict(temperature=1.0, top_p=-0.2), "top_p"),
        (dict(temperature=1.0, top_p=float("nan")), "top_p"),
    ],
)
def test_validate_rejects_with_readable_message(kwargs, match):
    params = SamplingParams(**kwargs)
    with pytest.raises(ValueError, match=match):
        params.validate()
    # warp_probs and verify must not silently accept bad params either.
    with pytest.raises(ValueError, match=match):
        warp_probs(torch.zeros(4), params)


@pytest.mark.parametrize(
    "params",
    [SamplingParams(), SamplingParams(0.7, 5, 0.9), SamplingParams(2.0, 0, 1.0), SamplingParams(1, 1, 1)],
)
def test_validate_accepts_good_params(params):
    params.validate()


def test_is_greedy():
    assert SamplingParams().is_greedy
    assert SamplingParams(temperature=0.0, top_k=3).is_greedy
    assert not SamplingParams(temperature=0.5).is_greedy


# --------------------------------------------------------------------------------------------
# warp_probs
# --------------------------------------------------------------------------------------------


def test_greedy_tokens_is_torch_argmax_ties_included():
    from specdec.core.sampling import greedy_tokens

    g = torch.Generator().manual_seed(3)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for _ in range(50):
            x = torch.randint(0, 3, (4, 997), generator=g).to(dtype)  # many ties for the maximum
            assert torch.equal(greedy_tokens(x), torch.argmax(x, dim=-1))
            assert int(greedy_tokens(x[0])) == int(torch.argmax(x[0]))


def test_greedy_verify_of_numpy_rows_is_the_tensors_ties_included():
    """An engine's numpy logits (llama.cpp's buffer) are verified greedily as they are: the same tokens as the
    same rows as a tensor, the first maximum on ties."""
    from specdec.core.sampling import greedy_tokens, verify

    g = torch.Generator().manual_seed(5)
    params = SamplingParams()
    for _ in range(50):
        x = torch.randint(0, 3, (4, 997), generator=g).to(torch.float32)  # many ties for the maximum
        assert greedy_tokens(x.numpy()).tolist() == torch.argmax(x, dim=-1).tolist()
        best = torch.argmax(x, dim=-1).tolist()
        for draft in ([], best[:1], best[:2] + [(best[2] + 1) % 997], best[:3]):
            rows = x[: len(draft) + 1]
            assert verify(rows.numpy(), draft, None, params, None) == verify(rows, draft, None, params, None)


def test_greedy_is_one_hot_at_first_max():
    logits = torch.tensor([[0.1, 3.0, 3.0, -1.0], [5.0, 1.0, 5.0, 0.0]])
    out = warp_probs(logits, SamplingParams())
    assert out.dtype == torch.float32
    assert torch.equal(out, torch.tensor([[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]))


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_only_is_softmax_of_scaled_logits(temperature):
    logits = torch.tensor([1.0, 2.0, -0.5, 0.0, 3.0])
    out = warp_probs(logits, SamplingParams(temperature=temperature))
    torch.testing.assert_close(out, torch.softmax(logits / temperature, -1))


def test_tiny_temperature_does_not_overflow():
    out = warp_probs(torch.tensor([1000.0, 999.0, -1000.0]), SamplingParams(temperature=1e-30))
    assert torch.equal(out, torch.tensor([1.0, 0.0, 0.0]))


def test_any_float_dtype_gives_float32():
    logits = torch.tensor([1.0, 2.0, 3.0])
    for dtype in (torch.bfloat16, torch.float16, torch.float64):
        out = warp_probs(logits.to(dtype), T1)
        assert out.dtype == torch.float32
        torch.testing.assert_close(out, torch.softmax(logits, -1), atol=1e-2, rtol=0)


def test_top_k_keeps_k_largest_renormalised():
    probs = [0.1, 0.4, 0.2, 0.3]
    out = warp_probs(logits_of(probs), SamplingParams(temperature=1.0, top_k=2))
    torch.testing.assert_close(out, torch.tensor([0.0, 4 / 7, 0.0, 3 / 7]))


def test_top_k_keeps_ties_and_large_k_is_disabled():
    logits = torch.tensor([2.0, 1.0, 1.0, 0.0])
    out = warp_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert (out > 0).tolist() == [True, True, True, False]  # ties with the k-th value survive
    full = warp_probs(logits, SamplingParams(temperature=1.0, top_k=10))
    torch.testing.assert_close(full, torch.softmax(logits, -1))


def test_top_p_exact_boundary_with_uniform_probs():
    # Uniform over 4 tokens: every cumulative sum (0.25, 0.5, 0.75, 1) is exact in float32.
    logits = torch.zeros(4)
    keep = lambda p: warp_probs(logits, SamplingParams(temperature=1.0, top_p=p)).tolist()
    # Cumulative prob reaching exactly top_p stops the nucleus; ties go to the lower token id.
    assert keep(0.5) == [0.5, 0.5, 0.0, 0.0]
    assert keep(0.5 + 1e-6) == pytest.approx([1 / 3, 1 / 3, 1 / 3, 0.0])
    assert keep(0.25) == [1.0, 0.0, 0.0, 0.0]
    assert keep(1.0) == [0.25] * 4


def test_top_p_keeps_smallest_prefix_and_at_least_one():
    probs = [0.05, 0.5, 0.3, 0.15]
    warp = lambda p: warp_probs(logits_of(probs), SamplingParams(temperature=1.0, top_p=p))
    torch.testing.assert_close(warp(1e-9), torch.tensor([0.0, 1.0, 0.0, 0.0]))
    torch.testing.assert_close(warp(0.5 - 1e-3), torch.tensor([0.0, 1.0, 0.0, 0.0]))
    torch.testing.assert_close(warp(0.5 + 1e-3), torch.tensor([0.0, 0.625, 0.375, 0.0]))
    torch.testing.assert_close(warp(0.8 + 1e-3), torch.tensor([0.0, 0.5, 0.3, 0.15]) / 0.95)
    torch.testing.assert_close(warp(1.0), torch.tensor(probs))


def test_order_is_temperature_then_top_k_then_top_p():
    probs = [0.4, 0.3, 0.2, 0.1]
    # After top-k=2 the kept mass is renormalised to [4/7, 3/7]; 4/7 >= 0.5 so top-p keeps one
    # token. Applying top-p first (on the original 0.4 < 0.5) would keep two.
    out = warp_probs(logits_of(probs), SamplingParams(temperature=1.0, top_k=2, top_p=0.5))
    torch.testing.assert_close(out, torch.tensor([1.0, 0.0, 0.0, 0.0]))
    # Temperature comes before the nucleus: at T=1 token 0 alone has 0.6 >= 0.5; T=4 flattens it
    # to ~0.40, so two tokens are needed.
    flat = lambda t: warp_probs(logits_of([0.6, 0.3, 0.1]), SamplingParams(temperature=t, top_p=0.5))
    assert (flat(1.0) > 0).tolist() == [True, False, False]
    assert (flat(4.0) > 0).tolist() == [True, True, False]


def test_warp_is_batched_over_leading_dims():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 7, generator=g) * 3
    params = SamplingParams(temperature=0.8, top_k=5, top_p=0.7)
    out = warp_probs(logits, params)
    assert out.shape == (2, 3, 7)
    for i in range(2):
        for j in range(3):
            torch.testing.assert_close(out[i, j], warp_probs(logits[i, j], params))
    assert torch.equal(out, warp_probs(logits, params))  # deterministic


@settings(max_examples=60, deadline=None)
@given(
    logits=st.lists(st.floats(-20, 20), min_size=1, max_size=12),
    temperature=st.sampled_from([0.0, 0.3, 1.0, 3.0]),
    top_k=st.integers(0, 14),
    top_p=st.sampled_from([1e-6, 0.3, 0.9, 1.0]),
)
def test_warp_properties(logits, temperature, top_k, top_p):
    x = torch.tensor(logits)
    out = warp_probs(x, SamplingParams(temperature, top_k, top_p))
    assert out.shape == x.shape and bool((out >= 0).all())
    assert float(out.sum()) == pytest.approx(1.0, abs=1e-5)
    assert out[int(torch.argmax(x))] > 0  # the most likely token is never filtered out
    if top_k and temperature:
        kth = torch.topk(x, min(top_k, len(logits))).values[-1]
        assert bool((out[x < kth] == 0).all())


# --------------------------------------------------------------------------------------------
# make_generator / sample
# --------------------------------------------------------------------------------------------


def test_make_generator_reproducible_and_independent_streams():
    draws = lambda *a: torch.rand(4, generator=make_generator(*a)).tolist()
    assert draws(7, 3, "target") == draws(7, 3, "target")
    distinct = [draws(7, 3, "target"), draws(7, 3, "draft"), draws(7, 4, "target"), draws(8, 3, "target")]
    assert len({tuple(d) for d in distinct}) == len(distinct)
    g = make_generator(7, 3, "target")
    assert g.device.type == "cpu" and 0 <= g.initial_seed() < 2**63


def test_make_generator_seed_is_stable_across_versions():
    # Resumed sessions rely on this derivation never changing: blake2b(repr((seed, *stream))).
    import hashlib

    digest = hashlib.blake2b(repr((0, 1, "target")).encode(), digest_size=8).digest()
    expected = int.from_bytes(digest, "big") & (2**63 - 1)
    assert make_generator(0, 1, "target").initial_seed() == expected


def test_sample_shapes_and_support():
    probs = torch.tensor([0.0, 0.7, 0.3, 0.0])
    g = make_generator(1)
    s = sample(probs, g)
    assert s.shape == () and s.dtype == torch.long
    batch = sample(probs.expand(500, 4), g)
    assert batch.shape == (500,) and batch.dtype == torch.long
    assert set(batch.tolist()) == {1, 2}
    assert sample(probs.expand(50, 4), make_generator(5)).tolist() == sample(
        probs.expand(50, 4), make_generator(5)
    ).tolist()


# --------------------------------------------------------------------------------------------
# verify_greedy
# --------------------------------------------------------------------------------------------


def one_hot_rows(tokens, vocab=5, hot=4.0):
    rows = torch.zeros(len(tokens), vocab)
    rows[torch.arange(len(tokens)), torch.tensor(tokens)] = hot
    return rows


def test_verify_greedy_all_accepted_gives_bonus():
    logits = one_hot_rows([1, 2, 3, 4])
    assert verify_greedy(logits, [1, 2, 3]) == VerifyResult(3, 4)
    assert verify_greedy(logits, torch.tensor([1, 2, 3])) == VerifyResult(3, 4)


def test_verify_greedy_first_mismatch():
    logits = one_hot_rows([1, 2, 3, 4])
    assert verify_greedy(logits, [1, 0, 3]) == VerifyResult(1, 2)
    assert verify_greedy(logits, [0, 2, 3]) == VerifyResult(0, 1)


def test_verify_greedy_k0_and_errors():
    assert verify_greedy(one_hot_rows([3]), []) == VerifyResult(0, 3)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        verify_greedy(one_hot_rows([1, 2]), [5])
    with pytest.raises(ValueError, match="shape"):
        verify_greedy(one_hot_rows([1, 2]), [1, 2])


# --------------------------------------------------------------------------------------------
# verify_rejection
# --------------------------------------------------------------------------------------------


def test_p_equal_q_always_accepts():
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(4, 6, generator=g), -1)
    for seed in range(200):
        res = verify_rejection(p, p[:3].clone(), [0, 5, 2], make_generator(seed))
        assert res.num_accepted == 3


def test_q_zero_rejects():
    p = torch.full((2, 3), 1 / 3)
    q = torch.tensor([[0.5, 0.5, 0.0]])
    for seed in range(50):
        assert verify_rejection(p, q, [2], make_generator(seed)).num_accepted == 0


def test_residual_is_max_p_minus_q():
    # p = [.5, .5, 0], q = [1, 0, 0], draft 0: accept with prob .5; residual max(0, p - q) is
    # one-hot at 1, so a rejection must correct to 1 (resampling from p would give 0 half the time).
    p = torch.tensor([[0.5, 0.5, 0.0], [0.0, 0.0, 1.0]])
    q = torch.tensor([[1.0, 0.0, 0.0]])
    results = [verify_rejection(p, q, [0], make_generator(s)) for s in range(200)]
    assert {r for r in results} == {VerifyResult(0, 1), VerifyResult(1, 2)}


def test_zero_residual_falls_back_to_p():
    # q(x) == 0 with p == q: rejected, residual is all zero -> sample p itself.
    p = torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    assert verify_rejection(p, p[:1].clone(), [0], make_generator(0)) == VerifyResult(0, 1)


def test_all_accepted_samples_bonus_from_last_row():
    p = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    assert verify_rejection(p, p[:2].clone(), [1, 2], make_generator(3)) == VerifyResult(2, 0)


def test_deterministic_drafter():
    p = torch.tensor([[0.0, 1.0, 0.0], [0.2, 0.0, 0.8], [0.0, 0.0, 1.0]])
    assert verify_rejection(p, None, [1, 2], make_generator(0)).num_accepted >= 1  # p(1)=1
    for s in range(50):
        # p_1(1) == 0: reject at 1; residual drops the drafted token -> 0 or 2, never 1.
        r = verify_rejection(p, None, [1, 1], make_generator(s))
        assert r.num_accepted == 1 and r.next_token in (0, 2)


def test_rejection_k0_and_reproducible():
    p = torch.tensor([[0.0, 0.0, 1.0]])
    assert verify_rejection(p, None, [], make_generator(0)) == VerifyResult(0, 2)
    assert verify_rejection(p, torch.empty(0, 3), [], make_generator(0)) == VerifyResult(0, 2)
    g = torch.Generator().manual_seed(1)
    pp = torch.softmax(torch.randn(4, 6, generator=g), -1)
    qq = torch.softmax(torch.randn(3, 6, generator=g), -1)
    runs = [[verify_rejection(pp, qq, [1, 2, 3], make_generator(s, "t")) for s in range(30)] for _ in "ab"]
    assert runs[0] == runs[1]


def test_rejection_input_errors():
    p = torch.full((3, 4), 0.25)
    q = torch.full((2, 4), 0.25)
    g = make_generator(0)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        verify_rejection(p, q, [0, 4], g)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        verify_rejection(p, None, [-1, 0], g)
    with pytest.raises(ValueError, match="NaN"):
        verify_rejection(p, torch.tensor([[0.25] * 4, [float("nan")] * 4]), [0, 1], g)
    with pytest.raises(ValueError, match="shape"):
        verify_rejection(p, q[:1], [0, 1], g)
    with pytest.raises(ValueError, match="shape"):
        verify_rejection(p, q, [0], g)
    with pytest.raises(ValueError, match="integers"):
        verify_rejection(p, q, [0.5, 1], g)


def test_verify_dispatch():
    logits = torch.tensor([[2.0, 0.0, 1.0], [0.0, 3.0, 1.0]])
    assert verify(logits, [0], None, SamplingParams(), None) == VerifyResult(1, 1)
    with pytest.raises(ValueError, match="generator"):
        verify(logits, [0], None, T1, None)
    params = SamplingParams(temperature=0.7, top_k=2)
    q = torch.tensor([[0.2, 0.5, 0.3]])
    for s in range(20):
        assert verify(logits, [1], q, params, make_generator(s)) == verify_rejection(
            warp_probs(logits, params), q, [1], make_generator(s)
        )



def test_expected_accepted_length_and_speedup():
    assert expected_accepted_length(0.5, 3) == pytest.approx((1 - 0.5**4) / 0.5)
    assert expected_accepted_length(1.0, 4) == 5.0
    assert expected_accepted_length(0.0, 4) == 1.0
    assert expected_accepted_length(0.7, 0) == 1.0
    assert speculative_speedup(0.8, 4, 0.1) == pytest.approx((1 - 0.8**5) / (0.2 * 1.4))
    assert speculative_speedup(1.0, 4, 0.25) == pytest.approx(2.5)
    assert speculative_speedup(1 - 1e-12, 4, 0.25) == pytest.approx(2.5)
    with pytest.raises(ValueError):
        expected_accepted_length(1.5, 3)
    with pytest.raises(ValueError):
        speculative_speedup(0.5, -1, 0.1)
    with pytest.raises(ValueError):
        speculative_speedup(0.5, 3, -0.1)


# --------------------------------------------------------------------------------------------
# tests/stats.py itself
# --------------------------------------------------------------------------------------------


def test_stats_helpers():
    expected = {"a": 0.5, "b": 0.3, "c": 0.199, "rare": 0.001}
    good = ["a"] * 500 + ["b"] * 300 + ["c"] * 200
    stat, p = chi_square_test(good, expected)
    assert p > 0.5 and stat >= 0
    assert total_variation(good, expected) == pytest.approx(0.001)
    bad = ["a"] * 600 + ["b"] * 300 + ["c"] * 100
    assert chi_square_test(bad, expected)[1] < 1e-6
    # Samples outside `expected` land in "other" (expected mass 1 - sum) ...
    partial = {"a": 0.5, "b": 0.3}
    assert chi_square_test(good, partial)[1] > 0.5
    assert total_variation(good, partial) == pytest.approx(0.0)
    assert chi_square_test(["a"] * 600 + ["b"] * 300 + ["zzz"] * 100, partial)[1] < 1e-6
    # ... and outcomes the expected distribution says are impossible are an instant failure.
    assert chi_square_test(["a", "b", "x"], {"a": 0.5, "b": 0.5}) == (math.inf, 0.0)
    assert total_variation(["x"] * 10, {"a": 1.0}) == 1.0


# --------------------------------------------------------------------------------------------
# Statistical end-to-end test: speculative loop vs. the exact target distribution
# --------------------------------------------------------------------------------------------

# Each passing test below has a false-alarm probability of ALPHA (1 in 1000) for a random seed.
# The seeds are fixed, so the outcome is deterministic: a failure means the maths (or the random
# stream) changed, not bad luck. The broken-verifier tests show the same harness detects bugs.
ALPHA = 1e-3
VOCAB = 6
N_TOKENS = 3
N_SAMPLES = 6000

VerifyFn = Callable[
    [torch.Tensor, list, "torch.Tensor | None", SamplingParams, torch.Generator], VerifyResult
]


class TableLM:
    """A toy language model: context tuple -> logits over VOCAB, from a fixed seeded random table,
    optionally mixed with another TableLM's logits (a draft that is right only some of the time)."""

    def __init__(self, seed: int, scale: float, like: "TableLM | None" = None, like_weight: float = 0.0):
        self.seed, self.scale, self.like, self.like_weight = seed, scale, like, like_weight
        self._logits: dict[tuple, torch.Tensor] = {}
        self._probs: dict[tuple, torch.Tensor] = {}

    def logits(self, ctx: tuple) -> torch.Tensor:
        if ctx not in self._logits:
            key = sum((t + 1) * (VOCAB + 1) ** i for i, t in enumerate(ctx))  # unique per ctx
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + key)
            logits = torch.randn(VOCAB, generator=g) * self.scale
            if self.like is not None:
                logits = logits + self.like_weight * self.like.logits(ctx)
            self._logits[ctx] = logits
        return self._logits[ctx]

    def probs(self, ctx: tuple, params: SamplingParams) -> torch.Tensor:
        if (ctx, params) not in self._probs:
            self._probs[(ctx, params)] = warp_probs(self.logits(ctx), params)
        return self._probs[(ctx, params)]


TARGET = TableLM(seed=1, scale=1.5)
# Partly follows the target, partly its own noise: deliberately different (acceptance ~0.5), so
# both the accept and the residual paths are exercised a lot.
DRAFT = TableLM(seed=2, scale=1.5, like=TARGET, like_weight=1.0)


def speculative_samples(
    verify_fn: VerifyFn,
    params: SamplingParams,
    k: int,
    *,
    deterministic_draft: bool = False,
    n_samples: int = N_SAMPLES,
    seed: int = 0,
    target: TableLM = TARGET,
    draft: TableLM = DRAFT,
) -> list[tuple]:
    """Run the speculative loop n_samples times from an empty context; return the first
    N_TOKENS committed tokens of each run."""
    g_draft, g_target = make_generator(seed, "draft"), make_generator(seed, "target")
    out = []
    for _ in range(n_samples):
        ctx: tuple = ()
        while len(ctx) < N_TOKENS:
            drafted, q_rows = [], []
            for _ in range(k):
                q = draft.probs(ctx + tuple(drafted), params)
                # A deterministic drafter (like prompt lookup) proposes a function of the context.
                x = int(torch.argmax(q)) if deterministic_draft else int(sample(q, g_draft))
                drafted.append(x)
                q_rows.append(q)
            target_logits = torch.stack([target.logits(ctx + tuple(drafted[:i])) for i in range(k + 1)])
            draft_probs = None if deterministic_draft else torch.stack(q_rows)
            res = verify_fn(target_logits, drafted, draft_probs, params, g_target)
            ctx = ctx + tuple(drafted[: res.num_accepted]) + (res.next_token,)
        out.append(ctx[:N_TOKENS])
    return out


def exact_joint(params: SamplingParams, target: TableLM = TARGET) -> dict[tuple, float]:
    """Exact distribution of the first N_TOKENS tokens sampled autoregressively from the target."""
    dist = {(): 1.0}
    for _ in range(N_TOKENS):
        nxt = {}
        for ctx, p_ctx in dist.items():
            for x, p_x in enumerate(target.probs(ctx, params).double().tolist()):
                if p_x > 0:
                    nxt[ctx + (x,)] = p_ctx * p_x
        dist = nxt
    return dist


def broken_accept_all(target_logits, draft_tokens, draft_probs, params, generator):
    p = warp_probs(target_logits, params)
    return VerifyResult(len(draft_tokens), int(sample(p[len(draft_tokens)], generator)))


def broken_resample_from_p(target_logits, draft_tokens, draft_probs, params, generator):
    # Correct acceptance test, but the correction is drawn from p instead of max(0, p - q).
    p = warp_probs(target_logits, params)
    for i, x in enumerate(draft_tokens):
        q_x = 1.0 if draft_probs is None else float(draft_probs[i, x])
        if float(torch.rand((), generator=generator)) * q_x > float(p[i, x]):
            return VerifyResult(i, int(sample(p[i], generator)))
    return VerifyResult(len(draft_tokens), int(sample(p[len(draft_tokens)], generator)))


SPEC_CASES = {
    "t1-k3": (SamplingParams(temperature=1.0), 3, False),
    "warped-k2": (SamplingParams(temperature=1.8, top_k=5, top_p=0.8), 2, False),
    "deterministic-draft-k3": (SamplingParams(temperature=1.2, top_p=0.95), 3, True),
}


@pytest.mark.parametrize("case", list(SPEC_CASES))
def test_speculative_loop_matches_target_distribution(case):
    params, k, deterministic = SPEC_CASES[case]
    samples = speculative_samples(verify, params, k, deterministic_draft=deterministic)
    expected = exact_joint(params)
    stat, p_value = chi_square_test(samples, expected)
    assert p_value >= ALPHA, f"{case}: chi2={stat:.1f} p={p_value:.2e}"
    assert total_variation(samples, expected) < 0.1


def test_speculative_loop_greedy_is_target_argmax_path():
    params = SamplingParams()
    (greedy_path,) = exact_joint(params)  # greedy: a single outcome with probability 1
    assert set(speculative_samples(verify, params, 3, n_samples=20)) == {greedy_path}


@pytest.mark.parametrize(
    "broken, case",
    [
        (broken_accept_all, "t1-k3"),
        (broken_resample_from_p, "t1-k3"),
        (broken_resample_from_p, "deterministic-draft-k3"),
    ],
    ids=["accept-all", "resample-from-p", "resample-from-p-deterministic-draft"],
)
def test_broken_verifier_fails_the_chi_square_test(broken, case):
    params, k, deterministic = SPEC_CASES[case]
    samples = speculative_samples(broken, params, k, deterministic_draft=deterministic)
    _, p_value = chi_square_test(samples, exact_joint(params))
    assert p_value < ALPHA
