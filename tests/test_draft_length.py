"""The per-session draft-length policies (orchestrator/policy/draft_length.py) and the target's forward-cost profile."""

import math

import pytest

from orchestrator.policy.draft_length import (AcceptancePrior, DraftLength, GoodputDraftLength, TargetCost,
                                      Evidence, expected_accepted_length, make_draft_length)

FLAT_TO_6 = [60.0, 70, 70, 70, 70, 70, 80, 90, 100, 110, 120, 130, 140, 150, 160, 170, 180]  # a CPU-like profile


def test_heuristic_grows_on_full_blocks_and_shrinks_on_rejections():
    d = DraftLength(4, 16, adaptive=True)
    d.update(4, 4)
    assert d.k == 6
    d.update(6, 2)
    assert d.k == 5
    fixed = DraftLength(4, 16, adaptive=False)
    fixed.update(4, 4)
    assert fixed.k == 4


def test_goodput_uses_the_flat_part_of_the_verify_cost():
    d = GoodputDraftLength(16, TargetCost(FLAT_TO_6))
    assert d.alpha == pytest.approx(0.5)
    assert d.k == 5  # 6 tokens cost the same as 2: draft up to there, not beyond (the next size costs more)


def test_goodput_follows_acceptance():
    d = GoodputDraftLength(16, TargetCost(FLAT_TO_6))
    for _ in range(10):
        d.update(d.k, d.k)  # everything accepted: longer blocks pay even though they cost more
    assert d.alpha > 0.9 and d.k >= 10
    for _ in range(10):
        d.update(d.k, 0)  # the first draft token always rejected
    assert 1 <= d.k <= 5  # back to the flat part of the cost; the orchestrator-wide acceptance says drafting pays
    for _ in range(1000):
        d.update(d.k, 0)
        if d.k == 0:
            break
    # The 1 -> 2 token step costs 70 vs 60 ms: once acceptance is low everywhere, target-only pays best.
    assert d.k == 0 and d.prior.alpha < 0.15


def test_goodput_pauses_then_probes():
    d = GoodputDraftLength(16, TargetCost([10.0 * n for n in range(1, 18)]))  # cost linear in tokens
    assert d.k == 0  # E(k) <= k + 1 tokens for k + 1 times the cost: speculation never pays
    for _ in range(GoodputDraftLength.PROBE_EVERY - 1):
        d.step_taken()
        assert d.k == 0
    d.step_taken()
    assert d.k >= 1  # probe
    d.update(d.k, 0)
    assert d.k == 0  # the probe failed: paused again


def test_goodput_a_probe_with_nothing_drafted_pauses_again():
    d = GoodputDraftLength(16, TargetCost([10.0 * n for n in range(1, 18)]))
    assert not d.dry()  # paused, not probing: nothing to undo
    for _ in range(GoodputDraftLength.PROBE_EVERY):
        d.step_taken()
    assert d.k >= 1
    assert d.dry() and d.k == 0  # the probe drafted nothing: paused, the next probe PROBE_EVERY steps on
    for _ in range(GoodputDraftLength.PROBE_EVERY - 1):
        d.step_taken()
        assert d.k == 0
    d.step_taken()
    d.update(d.k, d.k)  # this probe was verified: k is the policy's again, no longer a probe's
    assert not d.dry()
    speculating = GoodputDraftLength(16, TargetCost(FLAT_TO_6))
    k = speculating.k
    assert k >= 1 and not speculating.dry() and speculating.k == k  # a dry step of a drafting session keeps k


def test_goodput_weighs_the_draft_cost():
    cheap = GoodputDraftLength(16, TargetCost(FLAT_TO_6))
    slow = GoodputDraftLength(16, TargetCost(FLAT_TO_6))
    for d, per_token in ((cheap, 0.1), (slow, 15.0)):
        for _ in range(5):
            d.draft_cost.observe(wall_ms=1.0 + 4 * per_token, draft_ms=4 * per_token, tokens=4)
            d.update(4, 2)
    assert cheap.alpha == pytest.approx(slow.alpha)
    assert slow.k < cheap.k  # a draft token costing a quarter of a target step is worth fewer drafts


def test_target_cost_scales_with_observed_load():
    cost = TargetCost(FLAT_TO_6)
    assert cost.step_ms(1) == 60.0
    for _ in range(30):
        cost.observe(5, server_ms=140.0)  # a batched forward: twice the profile
        cost.observe_step(143.0, server_ms=140.0)  # and 3 ms of the step outside the target
    assert cost.step_ms(1) == pytest.approx(2 * 60 + 3, rel=0.01)
    assert cost.step_ms(1, calls_per_token=0.25) == pytest.approx(2 * 60 + 0.75, rel=0.01)
    cost.observe(99, server_ms=1.0)  # outside the profile: ignored
    assert cost.step_ms(1) == pytest.approx(123, rel=0.01)


def test_goodput_costs_verify_and_decode_calls_by_their_own_measurements():
    """A target whose Verify calls run at 2.1x their profiled forward while its Decode steps run at 1.1x: with
    one ratio shared by both, speculating at a per-token acceptance of 0.8 would look better than target-only;
    each kind costed by its own measurements, it does not. With Verify at 1.1x too, speculation pays."""
    prof = [8.8, 15.2, 17.7, 22.0, 27.2, 29.6, 33.0, 36.0]  # llama.cpp forwards of 1..8 tokens on a 2-core EPYC

    def policy(verify_ratio: float) -> GoodputDraftLength:
        cost = TargetCost(prof)
        for _ in range(40):
            cost.observe(3, server_ms=verify_ratio * prof[2])
            cost.observe(1, server_ms=4 * 1.1 * prof[0], calls=4, decode=True)
            cost.observe_step(2.5 + 20.0, server_ms=20.0)
        d = GoodputDraftLength(7, cost, AcceptancePrior(), decode_chunk=4)
        for _ in range(40):
            d.update(5, 4)  # per-token acceptance ~0.8
        return d

    assert policy(1.1).k >= 1  # a Verify costing what its profile says: speculation pays
    slow = policy(2.1)
    assert slow.cost.step_ms(1, decode=True) == pytest.approx(1.1 * 8.8 + 2.5, rel=0.01)
    assert slow.cost.step_ms(3) == pytest.approx(2.1 * 17.7 + 2.5, rel=0.01)
    assert slow.k == 0  # its own measurements say target-only is faster


def test_goodput_stops_speculating_when_the_step_overhead_outweighs_it():
    """Target-only decoding pays the orchestrator's per-step time once per Decode call of several tokens, a
    speculative step once per ~1.5 tokens: with 8 sessions batched and ~50 ms of each step spent outside the
    target (as measured on the 2-core host), no draft length pays at an acceptance of 0.5; with one session's ~5 ms
    speculation still does."""
    prof = [61.0, 66.8, 70.3, 69.3, 72.0, 73.9, 85.0, 96.1, 100.0, 104.0, 108.0, 109.0, 115.0, 120.0, 126.0,
            132.0, 141.6]  # one-sequence forwards of 1..17 tokens on this CPU with the native kernel
    sessions = [1]

    def policy(overhead_ms: float) -> GoodputDraftLength:
        cost = TargetCost(prof, max_batch=16, sessions=lambda: sessions[0])
        for _ in range(40):
            cost.observe_step(overhead_ms + 60.0, server_ms=60.0)
        prior = AcceptancePrior()
        d = GoodputDraftLength(16, cost, prior, decode_chunk=4)
        for _ in range(40):
            d.update(4, 1)  # per-token acceptance 0.5: one accepted, then a rejection
        return d

    sessions[0] = 1
    assert policy(5.0).k >= 1
    sessions[0] = 8
    assert policy(50.0).k == 0
    streamed, per_call = policy(50.0), policy(50.0)
    per_call.streamed, per_call.decode_chunk = False, 1  # target-only charged the whole overhead per token
    gain = [d.tokens_per_ms(1, 8) / d.tokens_per_ms(0, 8) for d in (streamed, per_call)]
    assert gain[1] > 1.2 * gain[0]  # would make speculation look far better than it is


def test_goodput_needs_a_profile_else_heuristic():
    assert isinstance(make_draft_length(4, 16, True, "goodput", Evidence(TargetCost(FLAT_TO_6))), GoodputDraftLength)
    assert isinstance(make_draft_length(4, 16, True, "goodput", Evidence(None)), DraftLength)
    assert isinstance(make_draft_length(4, 16, True, "heuristic", Evidence(TargetCost(FLAT_TO_6))), DraftLength)
    fixed = make_draft_length(4, 16, False, "goodput", Evidence(TargetCost(FLAT_TO_6)))
    assert isinstance(fixed, DraftLength) and not fixed.adaptive
    assert GoodputDraftLength(16, TargetCost(FLAT_TO_6[:3])).max_len == 2  # never beyond the profile


def test_target_profile_is_measured_and_non_decreasing():
    from specdec.core.kv_cache import SessionCacheStore
    from target_service.engines.torch import TargetEngine
    from tests.harness import TARGET, model

    engine = TargetEngine(model(TARGET), SessionCacheStore())
    prof = engine.profile_forward_ms(17, reps=2)
    assert len(prof) == 17 and all(x > 0 for x in prof)
    assert all(b >= a for a, b in zip(prof, prof[1:]))
    assert len(engine.store) == 0  # the scratch session is not a session


def test_a_short_run_of_rejections_does_not_pause_a_good_drafter():
    """The estimate is shrunk towards every session's acceptance: n-gram matches come in bursts."""
    from orchestrator.policy.draft_length import AcceptancePrior

    prior = AcceptancePrior()
    for _ in range(100):
        prior.update(5, 3)  # other sessions: 3 of 5 accepted per block
    d = GoodputDraftLength(16, TargetCost(FLAT_TO_6), prior)
    alone = GoodputDraftLength(16, TargetCost(FLAT_TO_6), AcceptancePrior())
    for _ in range(5):
        d.update(max(d.k, 1), 0)
        alone.update(max(alone.k, 1), 0)
    assert d.k >= 4 and alone.k == 0


def test_goodput_costs_a_block_as_part_of_a_batch():
    """With n sessions on a batching target, a block of t tokens rides in a forward over about n * t tokens:
    drafts get dearer with load, and under enough load target-only pays best."""
    prof = [60.0] + [70.0] * 5 + [70.0 + 5 * (n - 6) for n in range(7, 69)]  # flat to 6 tokens, then linear
    sessions = [1]
    cost = TargetCost(prof, max_batch=16, sessions=lambda: sessions[0])
    alone = GoodputDraftLength(16, cost)
    assert alone.k == 5
    sessions[0] = 8
    busy = GoodputDraftLength(16, cost)
    assert busy.k == 0
    assert cost.step_ms(3, rows=30) > cost.step_ms(3, rows=25) > cost.forward(68)  # extrapolated past the profile
    unbatched = GoodputDraftLength(16, TargetCost(prof, max_batch=1, sessions=lambda: 8))
    assert unbatched.k == 5  # an unbatched target serves sessions one forward at a time: no batch to share


def test_profile_smoothing_does_not_carry_a_spike_to_every_larger_size():
    from target_service.engines.profile import _isotonic

    assert _isotonic([60, 70, 200, 70]) == pytest.approx([60, 70, 135, 135])  # the violators pooled
    fitted = _isotonic([60, 70, 200, 70, 71, 72, 73, 74, 75, 76, 200, 210, 220])
    assert all(b >= a for a, b in zip(fitted, fitted[1:]))
    assert fitted[-1] == 220 and fitted[5] < 100  # a running maximum would hold 200 from the third size on


def test_profile_shape_survives_a_slow_spell():
    """A shared machine's speed drifts (here every forward is 1x to 2x slower, varying over a dozen calls):
    the ratios between sizes stay intact, since each size is timed between two 1-token forwards. (The fastest
    of three runs per size, the previous method, is off by up to 30% here.)"""
    from target_service.engines.profile import measure_profile

    true = {n: 60.0 + 4.0 * (n - 1) for n in range(1, 18)}
    calls = []

    def forward_ms(n):
        calls.append(n)
        return true[n] * (1.5 + 0.5 * math.sin(len(calls) / 4))

    prof = measure_profile(forward_ms, 17, reps=3)
    assert len(prof) == 17
    for n in (2, 4, 6, 8, 17):  # measured sizes (interpolated ones are linear here anyway)
        assert prof[n - 1] / prof[0] == pytest.approx(true[n] / true[1], rel=0.05)
    assert measure_profile(lambda n: 50.0, 1) == [50.0]


class SimulatedCpuEngine:
    """A 2-thread CPU engine's forwards on simulated clocks (deterministic): a forward over n tokens computes
    8 + 4 (n - 1) ms on both threads. While `loaded(call)`, other processes hold the cores: each forward also waits
    60 ms at its barriers for a core, during which one thread spins and the other is off the CPU. That fixed cost
    per forward is how a loaded machine flattens a profile's ratios."""

    THREADS = 2

    def __init__(self, loaded, stall_ms: float = 60.0):
        self.loaded, self.stall_ms, self.calls, self.cpu_s = loaded, stall_ms, 0, 0.0

    @staticmethod
    def compute_ms(n: int) -> float:
        return 8.0 + 4.0 * (n - 1)

    def forward_ms(self, n: int) -> float:
        self.calls += 1
        compute = self.compute_ms(n)
        stall = self.stall_ms if self.loaded(self.calls) else 0.0
        self.cpu_s += (self.THREADS * compute + stall) / 1e3
        return compute + stall

    def cpu_clock(self) -> float:
        return self.cpu_s


def _profile_warnings(caplog) -> list:
    return [r for r in caplog.records if r.name == "specdec.target" and r.getMessage().startswith("forward cost")]


def _guarded(engine, max_tokens=32):
    from target_service.engines.profile import cpu_engine_profile

    return cpu_engine_profile(engine.forward_ms, max_tokens, reps=3, threads=engine.THREADS,
                              cpu_clock=engine.cpu_clock)


def test_a_quiet_cpu_profile_is_kept_as_measured(caplog):
    caplog.set_level("WARNING", "specdec.target")
    engine = SimulatedCpuEngine(lambda call: False)
    prof = _guarded(engine)
    for n in (2, 8, 17, 32):
        assert prof[n - 1] / prof[0] == pytest.approx(engine.compute_ms(n) / engine.compute_ms(1), rel=0.01)
    assert _profile_warnings(caplog) == []


def test_a_profile_taken_under_load_is_measured_again(caplog):
    """Loaded while the first profile runs: its ratios are flat (a 32-token forward at 2.8 single steps against
    16.5 quiet) and its CPU share low, so it is measured again; the second, quiet one is kept."""
    from target_service.engines.profile import measure_profile

    counter = SimulatedCpuEngine(lambda call: False)
    measure_profile(counter.forward_ms, 32, reps=3)
    calls_per_profile = counter.calls
    loaded_first = SimulatedCpuEngine(lambda call: call <= calls_per_profile)
    flat = measure_profile(SimulatedCpuEngine(lambda call: True).forward_ms, 32, reps=3)
    assert flat[31] / flat[0] < 3.0  # the harm: what an unguarded profile reports under this load

    caplog.set_level("WARNING", "specdec.target")
    prof = _guarded(loaded_first)
    quiet_ratio = SimulatedCpuEngine.compute_ms(32) / SimulatedCpuEngine.compute_ms(1)
    assert quiet_ratio > 16 and prof[31] / prof[0] == pytest.approx(quiet_ratio, rel=0.01)
    (warning,) = _profile_warnings(caplog)
    assert warning.action == "re-measure" and warning.attempt == 1 and warning.cpu_share < 0.75
    assert "CPU time" in warning.reason


def test_a_profile_loaded_throughout_falls_back_to_a_conservative_curve(caplog):
    """Every attempt loaded: the profile is raised to the conservative curve (1 + 0.7 steps per extra token), so
    the goodput policy no longer takes long blocks for cheap."""
    from target_service.engines.profile import FALLBACK_STEP_SLOPE, measure_profile

    caplog.set_level("WARNING", "specdec.target")
    flat = measure_profile(SimulatedCpuEngine(lambda call: True).forward_ms, 32, reps=3)
    prof = _guarded(SimulatedCpuEngine(lambda call: True))
    assert all(b >= a for a, b in zip(prof, prof[1:]))
    for n in range(1, 33):
        assert prof[n - 1] >= flat[n - 1] - 1e-6
        assert prof[n - 1] / prof[0] >= 1 + FALLBACK_STEP_SLOPE * (n - 1) - 1e-3
    messages = [(r.getMessage(), getattr(r, "action", None)) for r in _profile_warnings(caplog)]
    assert messages == [("forward cost profile implausible", "re-measure"),
                        ("forward cost profile implausible", "conservative curve"),
                        ("forward cost profile: conservative curve", None)]
    prior = AcceptancePrior()
    for _ in range(100):
        prior.update(10, 9)  # drafts that are nearly always accepted
    assert GoodputDraftLength(31, TargetCost(flat), prior).k > GoodputDraftLength(31, TargetCost(prof), prior).k


def test_a_slow_failed_profile_is_not_measured_again(caplog):
    """A profile that took over RETRY_WITHIN_MS (here 92 forwards each waiting 400 ms for a core: a CPU quota's
    share of a core) goes straight to the conservative curve: start-up does not pay for it twice."""
    from target_service.engines.profile import FALLBACK_STEP_SLOPE

    caplog.set_level("WARNING", "specdec.target")
    engine = SimulatedCpuEngine(lambda call: True, stall_ms=400.0)
    prof = _guarded(engine)
    calls_per_profile = engine.calls
    assert calls_per_profile == 92  # one profile's forwards: (3 + 1 warm-up) x (1 + 2 x 11 sizes)
    assert prof[31] / prof[0] >= 1 + FALLBACK_STEP_SLOPE * 31 - 1e-3
    first = _profile_warnings(caplog)[0]
    assert first.action == "conservative curve" and first.attempt == 1 and first.profile_s > 15


def test_a_flat_cpu_profile_is_implausible_even_with_the_cores_to_itself(caplog):
    """Full CPU share, but a 32-token forward at the cost of one: no CPU computes that, so the curve is raised."""
    from target_service.engines.profile import cpu_engine_profile, implausible

    assert implausible([10.0] * 32, 1.0) is not None
    assert implausible([10.0] * 7, 1.0) is None  # too short to judge the shape
    assert implausible([10.0 * (1 + 0.5 * i) for i in range(32)], 0.95) is None
    clock = [0.0]

    def flat_forward_ms(n):
        clock[0] += 2 * 10.0 / 1e3
        return 10.0

    caplog.set_level("WARNING", "specdec.target")
    prof = cpu_engine_profile(flat_forward_ms, 32, reps=1, threads=2, cpu_clock=lambda: clock[0])
    assert prof[31] / prof[0] == pytest.approx(1 + 0.7 * 31, rel=0.01)
    assert "single steps" in _profile_warnings(caplog)[0].reason


def test_draft_evidence_learns_what_each_order_of_magnitude_of_score_means():
    from orchestrator.policy.draft_length import DraftEvidence

    ev = DraftEvidence()
    assert ev.acceptance(700.0) == 0.5  # nothing seen: Beta(1, 1)
    assert DraftEvidence.bucket(512.0) == 3 and DraftEvidence.bucket(511.0) == 2 and DraftEvidence.bucket(0.0) == -3
    for _ in range(50):
        ev.update([4096.0, 4096.0, 4096.0], verified=3, accepted=3)  # strong evidence: always accepted
        ev.update([10.0, 10.0], verified=2, accepted=0)                # weak evidence: rejected at once
    assert ev.acceptance(5000.0) > 0.95 and ev.acceptance(20.0) < 0.05
    before = ev.acceptance(0.3)
    ev.update([4096.0, 0.3, 0.3], verified=3, accepted=0)  # only the first token was tested
    assert ev.acceptance(0.3) == before


def test_goodput_verifies_only_the_scored_prefix_that_pays():
    from orchestrator.policy.draft_length import DraftEvidence

    ev = DraftEvidence()
    for _ in range(100):
        ev.update([5000.0] * 4, verified=4, accepted=4)
        ev.update([600.0, 600.0, 9.0], verified=3, accepted=2)
        ev.update([9.0, 9.0], verified=2, accepted=0)
    steep = [60.0 + 10 * n for n in range(17)]  # every verified token costs a sixth of a step
    d = GoodputDraftLength(16, TargetCost(steep), evidence=ev)
    assert d.request_len(3) == 3  # until the drafter has sent scores, ask for k
    assert d.verify_len([5000.0] * 8, limit=16) >= 7  # sure tokens: long blocks pay despite the cost
    assert d.request_len(3) == GoodputDraftLength.EVIDENCE_REQUEST  # now ask for more, and trim
    assert d.verify_len([600.0, 600.0, 9.0, 9.0], limit=16) == 2  # the weak tail is not worth verifying
    assert d.verify_len([9.0, 9.0, 9.0], limit=16) == 1           # none is, but drafting at all is k's call
    assert d.verify_len([5000.0] * 8, limit=3) == 3               # never past the tokens left to generate
    plain = GoodputDraftLength(16, TargetCost(steep))            # no evidence: the whole draft, as drafted
    assert plain.verify_len([9.0] * 5, limit=16) == 5 and plain.request_len(3) == 3
    fixed = DraftLength(4, 16, adaptive=False)
    assert fixed.request_len(4) == 4 and fixed.verify_len([9.0] * 4, limit=16) == 4


def test_draft_cost_is_shared_and_keeps_prefill_apart():
    from orchestrator.policy.draft_length import DraftCost

    shared = DraftCost()
    first = GoodputDraftLength(16, TargetCost(FLAT_TO_6), draft_cost=shared)
    shared.observe(wall_ms=62.0, draft_ms=60.0, tokens=4)  # 15 ms a drafted token, 2 ms a call
    shared.observe_prefill(draft_ms=900.0, context_tokens=150, tokens=4)  # 60 ms of it drafting: 5.6 ms a token
    assert shared.token_ms.value == pytest.approx(15.0) and shared.call_ms.value == pytest.approx(2.0)
    assert shared.prefill_token_ms.value == pytest.approx(840.0 / 150)
    second = GoodputDraftLength(16, TargetCost(FLAT_TO_6), draft_cost=shared)  # a new session knows the cost
    free = GoodputDraftLength(16, TargetCost(FLAT_TO_6))
    expected_ms = FLAT_TO_6[4] + 2.0 + 4 * 15.0  # verify 5 tokens + the call + 4 drafted tokens
    assert second.tokens_per_ms(4) == pytest.approx(free.tokens_per_ms(4) * FLAT_TO_6[4] / expected_ms)


def test_draft_cost_measured_under_load_is_kept_per_session():
    from orchestrator.policy.draft_length import DraftCost

    cost = DraftCost()
    cost.observe(wall_ms=482.0, draft_ms=480.0, tokens=4, sessions=8)  # 8 sessions share the draft: 120 ms a token
    assert cost.per_token(8) == pytest.approx(120.0)
    assert cost.per_token(1) == pytest.approx(15.0)  # a lone session later is costed at its own share
    busy = GoodputDraftLength(16, TargetCost(FLAT_TO_6, max_batch=16, sessions=lambda: 8), draft_cost=cost)
    alone = GoodputDraftLength(16, TargetCost(FLAT_TO_6, max_batch=16, sessions=lambda: 1), draft_cost=cost)
    for d in (busy, alone):
        d.own.successes, d.own.failures = 30.0, 1.0
    assert alone.best() > 0 and busy.best() < alone.best()


def test_a_session_decoding_target_only_still_waits_for_the_other_sessions_blocks():
    """Under load a paused session's single token rides in a forward over the others' blocks: costing it as n
    single tokens made target-only look cheap, and paused sessions got one token per long batched forward."""
    prof = [60.0] + [70.0] * 5 + [70.0 + 5 * (n - 6) for n in range(7, 69)]
    cost = TargetCost(prof, max_batch=16, sessions=lambda: 8)
    assert cost.step_ms(1, rows=8) == pytest.approx(cost.forward(8))  # nothing observed: all rows alike
    for _ in range(30):
        cost.observe(7, server_ms=cost.forward(8 * 7))  # the target's calls carry blocks of 7 tokens
    assert cost.block.value == pytest.approx(7.0)
    assert cost.load.value == pytest.approx(1.0, rel=0.01)  # observed as it was profiled: a forward over 7 * 8
    assert cost.step_ms(1, rows=8) == pytest.approx(cost.forward(1 + 7 * 7), rel=0.01)
    assert cost.step_ms(7, rows=8) == pytest.approx(cost.forward(8 * 7), rel=0.01)
    busy = GoodputDraftLength(16, cost)
    busy.own.successes, busy.own.failures = 30.0, 1.0
    assert busy.best() > 0  # its own block adds little to a forward the others fill anyway


def test_goodput_counts_the_drafting_a_prefetch_hides():
    """Pipelined, the next block is drafted while this one is verified: when the block is wholly accepted that
    drafting cost nothing, so a draft as slow as the target still pays."""
    from orchestrator.policy.draft_length import DraftCost

    draft = DraftCost()
    draft.observe(wall_ms=242.0, draft_ms=240.0, tokens=4)  # 60 ms a token: as slow as a target step
    serial = GoodputDraftLength(16, TargetCost(FLAT_TO_6), draft_cost=draft)
    piped = GoodputDraftLength(16, TargetCost(FLAT_TO_6), draft_cost=draft)
    piped.pipelined = True
    for d in (serial, piped):
        d.own.successes, d.own.failures = 60.0, 1.0
    a = serial.alpha
    expected = expected_accepted_length(a, 4)
    assert serial.tokens_per_ms(4) == pytest.approx(expected / (FLAT_TO_6[4] + 2.0 + 4 * 60.0))
    saved = a ** 5 * min(4 * 60.0, FLAT_TO_6[4])  # block and bonus guess accepted: the verify's length hidden
    assert piped.tokens_per_ms(4) == pytest.approx(expected / (FLAT_TO_6[4] + 2.0 + 4 * 60.0 - saved))
    assert piped.best() > serial.best()


def test_draft_cost_is_kept_per_session_count_where_measured():
    """A batching draft serves 8 sessions' steps in shared forwards: ~50 ms a token each, not 8 x 14."""
    from orchestrator.policy.draft_length import DraftCost

    cost = DraftCost()
    cost.observe(wall_ms=58.0, draft_ms=56.0, tokens=4, sessions=1)  # 14 ms a token alone
    cost.observe(wall_ms=202.0, draft_ms=200.0, tokens=4, sessions=8)  # 50 ms a token among 8
    assert cost.per_token(1) == pytest.approx(14.0)
    assert cost.per_token(8) == pytest.approx(50.0)
    share = cost.token_ms.value  # unmeasured loads: n times the per-session share (a serial draft's cost)
    assert cost.per_token(4) == pytest.approx(4 * share)
    cost.timed_out(400.0, tokens=4, sessions=8)  # a timeout at 8 raises the estimate at 8, not at 1
    assert cost.per_token(8) == pytest.approx(100.0) and cost.per_token(1) == pytest.approx(14.0)


# The llama.cpp engine's measured curve on this project's 2-core CPU (the shipped GGUF, logits at every position):
# a block of n tokens costs this many single steps (1, 2, 3, 4, 5, 6, 8, 16, 32, 64 measured; linear between).
LLAMACPP_STEPS = {1: 1.0, 2: 1.6, 3: 2.14, 4: 2.69, 5: 3.53, 6: 3.95, 8: 4.7, 16: 10.1, 32: 17.8, 64: 29.1}


def llamacpp_curve(step_ms: float = 10.0) -> list[float]:
    known = sorted(LLAMACPP_STEPS)
    out = []
    for n in range(1, 65):
        lo = max(k for k in known if k <= n)
        hi = min(k for k in known if k >= n)
        f = 0.0 if hi == lo else (n - lo) / (hi - lo)
        out.append(step_ms * (LLAMACPP_STEPS[lo] + f * (LLAMACPP_STEPS[hi] - LLAMACPP_STEPS[lo])))
    return out


def test_a_free_drafter_drafts_every_step_asks_for_long_blocks_and_skips_blocks_that_do_not_pay():
    from orchestrator.policy.draft_length import DraftEvidence

    ev = DraftEvidence()
    for _ in range(200):
        ev.update([2.0**18] * 32, verified=32, accepted=32)  # long matches: a quotation, always accepted
        ev.update([2.0**2, 2.0**2], verified=2, accepted=0)   # a 2-token match: rejected
    d = GoodputDraftLength(63, TargetCost(llamacpp_curve()), evidence=ev)
    d.use_free_drafter(True)
    assert d.k >= 1 and d.request_len(1) == 63  # drafting costs nothing: always, the longest block it may
    for _ in range(30):  # a session whose blocks all fail would pause a costly drafter; a free one keeps drafting
        d.update(proposed=4, accepted=0)
    assert d.k >= 1
    assert d.verify_len([2.0**18] * 63, limit=63) >= 31  # a sure quotation: one long block on the real curve
    assert d.verify_len([2.0**2] * 5, limit=63) == 0  # a weak match: target-only decoding beats any prefix of it
    assert d.verify_len([2.0**9] * 5, limit=63) >= 1  # an untested kind of match is tried before it is priced
    costly = GoodputDraftLength(63, TargetCost(llamacpp_curve()), evidence=ev)  # not free: at least one token
    assert costly.verify_len([2.0**2] * 5, limit=63) == 1
    assert costly.request_len(1) == GoodputDraftLength.EVIDENCE_REQUEST


def test_the_longest_block_that_pays_follows_the_curve_and_the_acceptance():
    """Expected tokens per verify cost on the llama.cpp curve: ~0.97 per token pays best at 8 tokens (4.7 steps),
    a near-certain copy at the longest block."""
    from orchestrator.policy.draft_length import DraftEvidence

    def policy(accepted: int, of: int) -> GoodputDraftLength:
        ev = DraftEvidence()
        for _ in range(400):
            ev.update([2.0**18] * of, verified=of, accepted=accepted)
        d = GoodputDraftLength(63, TargetCost(llamacpp_curve()), evidence=ev)
        d.use_free_drafter(True)
        return d

    assert 4 <= policy(30, 32).verify_len([2.0**18] * 63, limit=63) <= 16
    assert policy(63, 63).verify_len([2.0**18] * 63, limit=63) == 63


def test_target_only_is_priced_on_the_decode_stream_without_a_calls_overhead():
    """Target-only tokens come from the session's decode stream (no call per block): each costs the target's own
    step; a Decode call per 4 tokens would add a quarter of the per-call overhead to each."""
    cost = TargetCost(llamacpp_curve())
    for _ in range(40):
        cost.observe_step(12.0 + 20.0, server_ms=20.0)  # 12 ms of each step outside the target
    d = GoodputDraftLength(63, cost, decode_chunk=4)
    assert d.tokens_per_ms(0) == pytest.approx(1 / 10.0)
    d.streamed = False
    assert d.tokens_per_ms(0) == pytest.approx(1 / (10.0 + 12.0 / 4))


def test_closing_an_open_stream_for_a_verify_is_priced():
    """With the decode stream open a Verify also costs the stream's token in flight and the call that reopens it:
    a short block that pays over a Verify chain does not pay for that, a long sure one still does."""
    from orchestrator.policy.draft_length import DraftEvidence

    ev = DraftEvidence()
    for _ in range(200):
        for accepted in (3, 3, 3, 2):  # medium matches: 11 of 12 tokens accepted
            ev.update([2.0**9] * 3, verified=3, accepted=accepted)
        ev.update([2.0**18] * 32, verified=32, accepted=32)  # a quotation
    cost = TargetCost(llamacpp_curve())
    for _ in range(40):
        cost.observe_step(2.0 + 20.0, server_ms=20.0)  # 2 ms of RPC and Python a step
    d = GoodputDraftLength(63, cost, evidence=ev)
    d.use_free_drafter(True)
    assert d.verify_len([2.0**9] * 3, limit=63) >= 1  # after a Verify (no stream open): the block pays
    d.stream_open = True
    assert d.switch_ms() == pytest.approx(10.0 + 2.0)
    assert d.verify_len([2.0**9] * 3, limit=63) == 0  # streaming: not worth closing the stream for
    assert d.verify_len([2.0**18] * 32, limit=63) == 32  # a long sure quotation is
    for _ in range(40):  # verifies that closed a stream waited 4 ms for its step in flight beyond their forward
        cost.observe_switch(3, server_ms=cost.forward(3) + 4.0)
    assert d.switch_ms() == pytest.approx(4.0 + 2.0)
    assert cost.load.value is None  # kept apart from what a verify's forward costs


def test_a_long_context_makes_every_token_of_a_block_dearer_and_long_blocks_pay_less():
    """The profile is measured after a short context; after 1.5k tokens each token also pays its attention over
    them (~9 ms a token after a short prompt, ~37 ms after 1.4k on llama.cpp here). Measured by Decode steps per
    context bucket, that extra is added per token of a block: a block at ~0.88 acceptance that pays after a
    short prompt does not after a long one, where only a near-certain copy still beats the stream."""
    from orchestrator.policy.draft_length import DraftEvidence

    cost = TargetCost(llamacpp_curve())
    for _ in range(40):
        cost.observe(1, server_ms=4 * 10.0, calls=4, decode=True, context=100)
        cost.observe(1, server_ms=4 * 40.0, calls=4, decode=True, context=1500)
    assert cost.attention_ms(100) == 0.0 and cost.attention_ms(1500) == pytest.approx(30.0)
    assert cost.decode_load.value == pytest.approx(1.0)  # the context's share is not taken for load
    assert cost.stream_token_ms(context=1500) == pytest.approx(40.0)
    assert cost.step_ms(8, calls_per_token=0.0, context=1500) == pytest.approx(cost.forward(8) + 8 * 30.0)
    ev = DraftEvidence()
    for _ in range(200):
        for accepted in (8, 3, 3):  # 14 accepted, 2 rejected: ~0.88 a token
            ev.update([2.0**9] * 8, verified=8, accepted=accepted)
        ev.update([2.0**18] * 32, verified=32, accepted=32)
    d = GoodputDraftLength(63, cost, evidence=ev)
    d.use_free_drafter(True)
    assert d.verify_len([2.0**9] * 8, limit=63) >= 1  # after a short prompt it pays
    d.context = 1500
    assert d.verify_len([2.0**9] * 8, limit=63) == 0
    assert d.verify_len([2.0**18] * 32, limit=63) >= 4


def test_an_untested_match_starts_from_the_tested_weaker_ones_and_is_explored_only_without_a_stream_to_close():
    from orchestrator.policy.draft_length import DraftEvidence

    ev = DraftEvidence()
    for _ in range(50):
        ev.update([2.0**9] * 8, verified=8, accepted=8)  # bucket 3: ~always accepted
    assert ev.monotone_acceptance(2.0**18, tested=4.0) >= ev.acceptance(2.0**9) > 0.9  # untested, above it
    assert ev.monotone_acceptance(2.0**3, tested=4.0) == ev.acceptance(2.0**3) == 0.5  # untested, below it
    cost = TargetCost(llamacpp_curve())
    for _ in range(40):
        cost.observe_step(2.0 + 20.0, server_ms=20.0)
    d = GoodputDraftLength(63, cost, evidence=ev)
    d.use_free_drafter(True)
    assert d.verify_len([2.0**3] * 3, limit=63) >= 1  # untested and no stream open: tried for a Verify's cost
    d.context = 1500
    assert d.verify_len([2.0**3] * 3, limit=63) == 0  # nor where a token's cost at this context is not measured
    d.context = 0
    d.stream_open = True
    assert d.verify_len([2.0**3] * 3, limit=63) == 0  # not worth closing the stream to test
    assert d.verify_len([2.0**18] * 16, limit=63) >= 8  # priced from bucket 3's record: a long block pays


def _free_drafter_sure_of(block: int, decode_calls: int, context: int = 0):
    """(TargetCost, goodput policy) of a free drafter whose top-score blocks of `block` tokens were all accepted,
    after `decode_calls` 4-token Decode calls of 10 ms a token on the llama.cpp curve with 2 ms of step overhead."""
    from orchestrator.policy.draft_length import DraftEvidence

    ev = DraftEvidence()
    for _ in range(50):
        ev.update([2.0**18] * block, verified=block, accepted=block)
    cost = TargetCost(llamacpp_curve())
    for _ in range(decode_calls):
        cost.observe_step(2.0 + 20.0, server_ms=20.0)
        cost.observe(1, server_ms=4 * 10.0, calls=4, decode=True, context=context)
    d = GoodputDraftLength(63, cost, evidence=ev)
    d.use_free_drafter(True)
    return cost, d


def test_a_verify_at_a_context_whose_token_cost_is_unmeasured_does_not_teach_load():
    """At a long context the Decode steps have not reached yet, a token's attention over it is unknown (rag's first
    step after a 1.4k-token prompt): a Verify there is not learned as load, which would price every later Verify
    by it (here 4x) while no Verify runs to correct it."""
    cost, d = _free_drafter_sure_of(32, decode_calls=40, context=100)
    assert d.verify_len([2.0**18] * 32, limit=63) >= 8  # a sure quotation after a short prompt
    cost.observe(9, server_ms=9 * 40.0, context=1500)  # a Verify at an unmeasured context: mostly attention
    assert cost.load.value is None
    assert d.verify_len([2.0**18] * 32, limit=63) >= 8  # later quotations after short prompts still pay
    cost.observe(1, server_ms=4 * 40.0, calls=4, decode=True, context=1500)  # the stream reaches it
    cost.observe(9, server_ms=cost.forward(9) + 9 * 30.0, context=1500)
    assert cost.load.value == pytest.approx(1.0)  # the attention's share is not load


def test_a_stale_verify_ratio_relaxes_toward_what_decode_steps_measure():
    """One Verify slowed by a passing spell of load (4x its profile) must not price every later block out for good:
    after TargetCost.STALE_AFTER Decode observations with no Verify, the Verify ratio moves toward the Decode ratio,
    and a sure long draft pays again. Verifies that keep coming keep their own ratio (a real premium stays)."""
    cost, d = _free_drafter_sure_of(8, decode_calls=10)
    assert d.verify_len([2.0**18] * 8, limit=63) >= 4
    cost.observe(9, server_ms=4 * cost.forward(9))  # the spike
    assert cost.load.value == pytest.approx(4.0)
    assert d.verify_len([2.0**18] * 8, limit=63) == 0  # priced out
    for _ in range(TargetCost.STALE_AFTER):
        cost.observe(1, server_ms=4 * 10.0, calls=4, decode=True)
    assert cost.load.value == pytest.approx(4.0)  # not stale yet
    for _ in range(30):
        cost.observe(1, server_ms=4 * 10.0, calls=4, decode=True)
    assert cost.load.value == pytest.approx(cost.decode_load.value, rel=0.01)
    assert d.verify_len([2.0**18] * 8, limit=63) >= 4  # tried again

    premium = TargetCost(llamacpp_curve())
    for _ in range(40):  # a Verify every few Decode observations: its own 2x ratio stands
        premium.observe(5, server_ms=2 * premium.forward(5))
        for _ in range(TargetCost.STALE_AFTER):
            premium.observe(1, server_ms=4 * premium.forward(1), calls=4, decode=True)
    assert premium.load.value == pytest.approx(2.0, rel=0.01)


def test_a_block_in_a_shared_step_is_priced_by_the_delay_its_rows_give_every_session():
    """On a batching target each extra row of one session's block lengthens the step every session in it waits
    for: 8 sessions decoding in one forward over 8 rows (4.7 single steps on the llama.cpp curve), a session whose
    drafts are accepted at ~0.75 per token gains ~3 tokens with 4 more rows, while those rows delay 8 sessions'
    tokens. Priced as its own step alone (the curve's marginal rows look cheap next to 8 rows) it drafts and the
    batch commits fewer tokens per ms; priced by its delay to all it decodes target-only. One session, or a sure
    copy, still drafts."""
    sessions = [8]
    cost = TargetCost(llamacpp_curve(), max_batch=16, sessions=lambda: sessions[0])
    for _ in range(30):
        cost.observe(1, server_ms=cost.forward(8), decode=True)  # the other sessions decode one token a step

    def policy(successes: float, failures: float) -> GoodputDraftLength:
        d = GoodputDraftLength(16, cost)
        d.own.successes, d.own.failures = successes, failures
        d.prior.successes, d.prior.failures = successes, failures
        return d

    def batch_tokens_per_ms(k: int, alpha: float) -> float:  # the whole step: 7 sessions' tokens and this one's
        return (7 + expected_accepted_length(alpha, k)) / cost.forward(8 + k)

    weak = policy(30.0, 10.0)  # per-token acceptance 0.75
    assert batch_tokens_per_ms(4, 0.75) < batch_tokens_per_ms(0, 0.75)  # drafting would slow the batch
    assert weak.best() == 0
    # Past 8 rows a row costs more than the average row of 8 here (4.7 -> 10.1 steps at 16): not even a sure copy
    # beats the batch's own rate; where the curve is flat at the batch's size, extra rows delay nobody.
    assert policy(400.0, 1.0).best() == 0
    flat = GoodputDraftLength(16, TargetCost([60.0] + [70.0] * 39, max_batch=16, sessions=lambda: 8))
    flat.own.successes, flat.own.failures = 30.0, 10.0
    assert flat.best() >= 1
    sessions[0] = 1
    assert policy(30.0, 10.0).best() >= 1  # alone, its block delays nobody else


def test_the_delay_to_sessions_that_speculate_costs_all_the_tokens_they_commit_per_step():
    """Where the other sessions verify blocks too, each ms a block adds delays several tokens of each of them: on
    a linear curve (what a loaded start-up profile falls back to), the others verifying blocks of 5, the draft
    length goodput picks is the one that commits the most tokens per ms for the whole batch (charged as one token
    per other session, it drafted 13 where 2 is best at acceptance ~0.97, 7 where 1 is at ~0.92)."""
    linear = [9.5] + [9.5 + 6.6 * n for n in range(1, 64)]
    for failures in (1.0, 2.5, 5.0, 10.0):
        cost = TargetCost(linear, max_batch=16, sessions=lambda: 8)
        for _ in range(30):
            cost.observe(5, server_ms=cost.forward(40))  # the others' Verify blocks: 5 tokens each
        d = GoodputDraftLength(16, cost)
        d.own.successes, d.own.failures = 30.0, failures
        d.prior.successes, d.prior.failures = 30.0, failures
        others = expected_accepted_length(d.prior.alpha, 4)  # tokens each other session commits per step

        def batch_tokens_per_ms(k: int) -> float:
            return (7 * others + expected_accepted_length(d.alpha, k)) / cost.forward(1 + 7 * 5 + k)

        best_for_batch = max(range(17), key=batch_tokens_per_ms)
        assert abs(d.best() - best_for_batch) <= 1, (failures, d.best(), best_for_batch)
