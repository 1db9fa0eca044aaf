"""Greedy speculative decoding is token-identical to target-only decoding, through real gRPC and Redis."""

import pytest
import torch

from tests.harness import DRAFT_EARLY, DRAFT_OTHER, DRAFT_SAME, HYBRID, INT8_SELF, TARGET, model, start_stack

PROMPTS = [[1, 5, 9, 12, 5, 9], [7] * 3 + [30, 31, 32, 7, 7], list(range(1, 40, 3))]
MAX_NEW = 40


def hf_greedy(prompt, n):
    """Independent reference: transformers' own greedy generate on the target."""
    m = model(TARGET).model
    out = m.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module", params=["ngram", DRAFT_EARLY, DRAFT_SAME, DRAFT_OTHER, HYBRID, "local:ngram",
                                       "local:suffix", INT8_SELF],
                ids=["ngram", "early-layer", "same-model", "unrelated", "hybrid", "local-ngram", "local-suffix",
                     "int8-self"])
def stack(request, redis_url):
    s = start_stack(redis_url, draft=request.param)
    yield s
    s.stop()


def test_target_only_matches_transformers_generate(stack):
    for prompt in PROMPTS:
        got = stack.client.generate(prompt, max_new_tokens=MAX_NEW, speculation=False, ignore_eos=True)
        assert got.token_ids == hf_greedy(prompt, MAX_NEW)
        assert got.stats["verify_steps"] == 0


@pytest.mark.parametrize("draft_len", range(1, 9))
def test_speculative_equals_target_only(stack, draft_len):
    for prompt in PROMPTS:
        ref = stack.client.generate(prompt, max_new_tokens=MAX_NEW, speculation=False, ignore_eos=True)
        spec = stack.client.generate(prompt, max_new_tokens=MAX_NEW, speculation=True, max_draft_len=draft_len,
                                     ignore_eos=True)
        assert spec.token_ids == ref.token_ids, f"draft_len={draft_len} prompt={prompt}"
        assert spec.finish_reason == "length"
        s = spec.stats
        assert s["generated_tokens"] == MAX_NEW
        assert s["fallback_steps"] == 0
        assert s["draft_tokens_accepted"] <= s["draft_tokens_proposed"] <= s["verify_steps"] * draft_len


def test_acceptance_reflects_the_draft(redis_url):
    """Sanity of the statistics: the same model accepts everything, an unrelated one almost nothing."""
    rates = {}
    for name, draft in [("same", DRAFT_SAME), ("other", DRAFT_OTHER)]:
        s = start_stack(redis_url, draft=draft)
        try:
            r = s.client.generate(PROMPTS[0], max_new_tokens=MAX_NEW, max_draft_len=4, ignore_eos=True)
            rates[name] = r.stats
        finally:
            s.stop()
    assert rates["same"]["acceptance_rate"] == 1.0
    assert rates["same"]["mean_accepted_length"] == pytest.approx(5.0, abs=0.6)
    assert rates["other"]["acceptance_rate"] < 0.3


def test_eos_stops_generation_identically(redis_url):
    s = start_stack(redis_url, draft=DRAFT_EARLY)
    try:
        eos_seen = 0
        for seed_prompt in range(1, 30):
            prompt = [seed_prompt, (seed_prompt * 7) % 63 + 1]
            ref = s.client.generate(prompt, max_new_tokens=60, speculation=False)
            spec = s.client.generate(prompt, max_new_tokens=60, max_draft_len=5)
            assert spec.token_ids == ref.token_ids
            assert spec.finish_reason == ref.finish_reason
            if ref.finish_reason == "eos":
                eos_seen += 1
                assert ref.token_ids[-1] == 0 and 0 not in ref.token_ids[:-1]
            if eos_seen >= 3 and seed_prompt >= 10:
                break  # three eos stops (and length stops) checked; each further prompt costs two 60-token generations
        assert eos_seen > 0, "no prompt hit eos; pick other prompts"
    finally:
        s.stop()


@pytest.mark.parametrize("mode", ["on", "auto"])
@pytest.mark.parametrize("draft", ["ngram", DRAFT_EARLY, DRAFT_SAME, HYBRID, "local:ngram", "local:suffix", INT8_SELF],
                         ids=["ngram", "early-layer", "same-model", "hybrid", "local-ngram", "local-suffix",
                              "int8-self"])
def test_pipelined_speculation_equals_target_only(redis_url, draft, mode):
    from orchestrator.settings import LoopConfig

    # min gain 0: auto prefetches after every fully accepted block, so both modes exercise the prefetch path here.
    # k = 6 is the longest draft allowed: its prefetch asks for the bonus guess + 5.
    cfg = LoopConfig(pipeline=mode, pipeline_min_gain_ms=0.0, draft_timeout_floor_ms=5000, max_draft_len=6)
    s = start_stack(redis_url, draft=draft, cfg=cfg)
    try:
        hits = 0
        for k in (1, 3, 6):
            for prompt in PROMPTS:
                ref = s.client.generate(prompt, max_new_tokens=MAX_NEW, speculation=False, ignore_eos=True)
                got = s.client.generate(prompt, max_new_tokens=MAX_NEW, max_draft_len=k, ignore_eos=True)
                assert got.token_ids == ref.token_ids, (k, prompt)
                assert got.stats["pipeline_prefetches"] > 0
                hits += got.stats["pipeline_hits"]
        if draft in (DRAFT_SAME, INT8_SELF):
            assert hits > 0  # a perfect draft's guesses of the bonus token are right: prefetches get used
    finally:
        s.stop()


def test_pipelined_sampling_is_reproducible_and_valid(redis_url):
    from orchestrator.settings import LoopConfig

    s = start_stack(redis_url, draft=DRAFT_EARLY, cfg=LoopConfig(pipeline="on", draft_timeout_floor_ms=5000))
    try:
        a = s.client.generate(PROMPTS[0], max_new_tokens=30, temperature=0.8, seed=11, ignore_eos=True)
        b = s.client.generate(PROMPTS[0], max_new_tokens=30, temperature=0.8, seed=11, ignore_eos=True)
        assert a.token_ids == b.token_ids and len(a.token_ids) == 30
    finally:
        s.stop()


def test_min_confidence_and_adaptive_length_keep_output(redis_url):
    from orchestrator.settings import LoopConfig

    cfg = LoopConfig(default_draft_len=4, adaptive_draft_len=True, draft_min_confidence=0.6,
                     draft_timeout_floor_ms=5000)
    s = start_stack(redis_url, draft=DRAFT_EARLY, cfg=cfg)
    try:
        for prompt in PROMPTS:
            ref = s.client.generate(prompt, max_new_tokens=MAX_NEW, speculation=False, ignore_eos=True)
            got = s.client.generate(prompt, max_new_tokens=MAX_NEW, ignore_eos=True)
            assert got.token_ids == ref.token_ids
            # Low-confidence drafts stop early: fewer tokens proposed per verify than the fixed length.
            assert got.stats["draft_tokens_proposed"] < 4 * got.stats["verify_steps"]
    finally:
        s.stop()


@pytest.mark.parametrize("draft", [DRAFT_SAME, DRAFT_OTHER, "local:ngram", "local:suffix"],
                         ids=["same-model", "unrelated", "local-ngram", "local-suffix"])
def test_goodput_draft_length_keeps_output_and_follows_acceptance(redis_url, draft):
    """The goodput policy (the target's measured forward profile) changes only how much is drafted."""
    from orchestrator.settings import LoopConfig
    from orchestrator.api.outline import build_outline

    cfg = LoopConfig(default_draft_len=4, adaptive_draft_len=True, draft_timeout_floor_ms=5000)
    s = start_stack(redis_url, draft=draft, cfg=cfg, forward_ms="measure")
    try:
        assert s.servicer.measured.target_cost is not None
        assert "goodput" in build_outline(s.servicer)["draftStrategy"]["draftLength"]["policy"]
        for prompt in PROMPTS:
            ref = s.client.generate(prompt, max_new_tokens=MAX_NEW, speculation=False, ignore_eos=True)
            got = s.client.generate(prompt, max_new_tokens=MAX_NEW, ignore_eos=True)
            assert got.token_ids == ref.token_ids
            st = got.stats
            if draft == DRAFT_SAME:
                # Everything drafted is accepted; how much is drafted depends on measured costs (a draft as big
                # as the target may rightly pause speculation), so the choice itself is unit-tested.
                assert st["draft_tokens_accepted"] == st["draft_tokens_proposed"]
    finally:
        s.stop()


def test_goodput_pauses_speculation_when_no_draft_length_pays(redis_url):
    """A target whose forward cost grows linearly with the tokens (a compute-bound, fully loaded target): an
    unrelated draft never pays, so the session decodes target-only, probing the draft now and then."""
    from orchestrator.settings import LoopConfig

    cfg = LoopConfig(default_draft_len=4, adaptive_draft_len=True, draft_timeout_floor_ms=5000)
    from specdec import observability as telemetry

    telemetry.ensure_providers("specdec-test")  # the process-wide providers, named as tests/test_observability.py does
    s = start_stack(redis_url, draft=DRAFT_OTHER, cfg=cfg, forward_ms=[10.0 * n for n in range(1, 18)])
    try:
        ref = s.client.generate(PROMPTS[2], max_new_tokens=MAX_NEW, speculation=False, ignore_eos=True)
        before = telemetry.snapshot()
        got = s.client.generate(PROMPTS[2], max_new_tokens=MAX_NEW, ignore_eos=True)
        after = telemetry.snapshot()
        assert got.token_ids == ref.token_ids
        st = got.stats
        assert st["speculation_paused_steps"] > 0 and st["decode_steps"] > st["verify_steps"]
        paused = (telemetry.metric_value(after, "specdec.speculation.paused_steps")
                  - telemetry.metric_value(before, "specdec.speculation.paused_steps"))
        assert paused == st["speculation_paused_steps"]
    finally:
        s.stop()


@pytest.mark.parametrize("draft", ["ngram", "local:ngram"], ids=["ngram-service", "local-ngram"])
def test_scored_ngram_drafts_are_trimmed_and_output_unchanged(redis_url, draft):
    """The n-gram drafter scores its tokens; the goodput policy asks for longer drafts and verifies only the prefix
    its learned evidence says pays (a target where every verified token costs a sixth of a step). Trimming
    changes what is verified, never the output."""
    from orchestrator.settings import LoopConfig

    from orchestrator.api.outline import build_outline
    from specdec import observability as telemetry

    cfg = LoopConfig(default_draft_len=4, adaptive_draft_len=True, draft_timeout_floor_ms=5000)
    s = start_stack(redis_url, draft=draft, cfg=cfg, forward_ms=[60.0 + 10 * n for n in range(17)])
    before = telemetry.snapshot()
    try:
        assert "only the prefix that pays is verified" in build_outline(s.servicer)["draftStrategy"]["draftLength"]["policy"]
        totals = {"draft_tokens_trimmed": 0, "verify_steps": 0, "draft_tokens_accepted": 0}
        for _ in range(3):  # the evidence is learned across sessions
            for prompt in PROMPTS:
                ref = s.client.generate(prompt, max_new_tokens=MAX_NEW, speculation=False, ignore_eos=True)
                got = s.client.generate(prompt, max_new_tokens=MAX_NEW, ignore_eos=True)
                assert got.token_ids == ref.token_ids
                for key in totals:
                    totals[key] += got.stats[key]
        assert s.servicer.measured.draft_evidence._accepted  # scores reached the orchestrator and were learned from
        trimmed = (telemetry.metric_value(telemetry.snapshot(), "specdec.draft.tokens_trimmed")
                   - telemetry.metric_value(before, "specdec.draft.tokens_trimmed"))
    finally:
        s.stop()
    assert trimmed == totals["draft_tokens_trimmed"]
    assert totals["verify_steps"] > 0 and totals["draft_tokens_accepted"] > 0
    assert totals["draft_tokens_trimmed"] > 0


@pytest.mark.parametrize("draft", [DRAFT_EARLY, "local:ngram", INT8_SELF], ids=["remote-draft", "local-ngram", "int8-self"])
def test_a_long_prompt_is_prefilled_by_target_and_draft_at_once(redis_url, draft):
    """A new session whose prompt the draft must prefill: the target prefills it in parallel (one Prefill call; the
    first Verify then carries only the last token and the drafts). The in-process n-gram drafter has nothing to
    prefill, so it does not. The target's int8 copy takes the target's KV instead of prefilling (one Prefill call
    first, its KV in the first Propose). Outputs stay those of target-only decoding."""
    prompt = [(7 * i) % 60 + 1 for i in range(40)]
    s = start_stack(redis_url, draft=draft)
    try:
        ref = s.client.generate(prompt, max_new_tokens=24, speculation=False, ignore_eos=True)
        spec = s.client.generate(prompt, max_new_tokens=24, max_draft_len=4, ignore_eos=True)
        assert spec.token_ids == ref.token_ids
        assert spec.stats["parallel_prefills"] == (1 if draft == DRAFT_EARLY else 0)
        assert spec.stats["kv_imports"] == (1 if draft == INT8_SELF else 0)
        assert (spec.stats["prefill_ms"] > 0) == (draft == INT8_SELF)  # the step waited for the target's Prefill
        assert spec.stats["target_resyncs"] == 0 and spec.stats["draft_failures"] == 0
        assert spec.stats["draft_tokens_accepted"] > 0
        if draft == INT8_SELF:  # --draft-prefill own: the int8 copy prefills itself, beside the target
            s.servicer.cfg.draft_prefill = "own"
            own = s.client.generate(prompt, max_new_tokens=24, max_draft_len=4, ignore_eos=True)
            assert own.token_ids == ref.token_ids
            assert (own.stats["kv_imports"], own.stats["parallel_prefills"]) == (0, 1)
    finally:
        s.stop()


def test_suffix_drafts_long_blocks_where_the_reply_repeats_and_none_that_do_not_pay(redis_url):
    """The suffix drafter with the goodput policy. A request repeated by the same caller (an agent's retry, a
    regenerated answer): its reply is in the caller's global tree, so on a target whose forward costs ~nothing per
    extra token the repeat is drafted in blocks as long as the target takes. On a target whose forward cost grows
    with every token (no block pays) it stops verifying blocks once their scores have been tried, and decodes
    target-only. The output is target-only's either way."""
    from orchestrator.settings import LoopConfig

    cfg = LoopConfig(default_draft_len=4, adaptive_draft_len=True, draft_timeout_floor_ms=5000)
    cheap = start_stack(redis_url, draft="local:suffix", cfg=cfg, forward_ms=[10.0 + 0.01 * n for n in range(64)])
    try:
        for prompt in PROMPTS:
            ref = cheap.client.generate(prompt, max_new_tokens=MAX_NEW, speculation=False, ignore_eos=True)
            first = cheap.client.generate(prompt, max_new_tokens=MAX_NEW, ignore_eos=True)
            again = cheap.client.generate(prompt, max_new_tokens=MAX_NEW, ignore_eos=True)
            assert first.token_ids == ref.token_ids and again.token_ids == ref.token_ids
            st = again.stats
            # the earlier reply is drafted (its first tokens may come from the decode stream, until the match is
            # long enough to pay for closing it)
            assert st["draft_tokens_accepted"] >= MAX_NEW // 3, st
            # in blocks that double with the match (1, 2, 4, 8, 16 tokens ...)
            assert st["draft_tokens_proposed"] / st["verify_steps"] > 4, st
    finally:
        cheap.stop()
    dear = start_stack(redis_url, draft="local:suffix", cfg=cfg, forward_ms=[10.0 * n for n in range(1, 65)])
    try:
        verified = []
        for r in range(12):  # new prompts: the drafter's matches are chance ones; the evidence is learned across them
            prompt = [(7 * r + 5 * i) % 62 + 1 for i in range(8)]
            ref = dear.client.generate(prompt, max_new_tokens=MAX_NEW, speculation=False, ignore_eos=True)
            got = dear.client.generate(prompt, max_new_tokens=MAX_NEW, ignore_eos=True)
            assert got.token_ids == ref.token_ids
            verified.append(got.stats["verify_steps"])
        assert sum(verified[-4:]) <= 1, verified  # blocks that do not pay are no longer verified
    finally:
        dear.stop()
