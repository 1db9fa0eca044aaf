"""The orchestrator's deadline for a Propose call: scaled to the block it asks for and to a first call's prefill."""

from orchestrator.policy.draft_length import DraftCost
from orchestrator.loop.draft_call import DraftCall
from orchestrator.store.session_store import SessionRecord
from orchestrator.settings import LoopConfig
from tests.harness import loop_state


def _gen(step_ms: float, committed: int, draft_pos: int, cost: DraftCost) -> DraftCall:
    rec = SessionRecord("s", list(range(committed)), {}, draft_pos=draft_pos)
    return DraftCall(loop_state(rec, LoopConfig(), draft_cost=cost, target_step=type("Step", (), {"ms": step_ms})()))


def test_deadline_allows_a_block_of_a_measured_draft_model():
    cost = DraftCost()
    assert _gen(50.0, 200, 190, cost).timeout_s(8) == 5.0  # nothing measured yet: the first-call deadline
    cost.observe(wall_ms=62.0, draft_ms=60.0, tokens=4)  # 15 ms a token
    assert abs(_gen(50.0, 200, 190, cost).timeout_s(8) - 2 * 8 * 15 / 1e3) < 1e-9
    cost.timed_out(4000.0, tokens=8)  # now 500 ms a token: slower than the target, capped at a step a token
    assert abs(_gen(50.0, 200, 190, cost).timeout_s(8) - 2 * 8 * 50 / 1e3) < 1e-9


def test_first_call_deadline_follows_the_measured_prefill_rate():
    cost = DraftCost()
    cost.observe(wall_ms=62.0, draft_ms=60.0, tokens=4)
    unmeasured = _gen(50.0, 150, 0, cost).timeout_s(4)
    assert unmeasured == LoopConfig().draft_first_call_timeout_ms / 1e3  # generous until a prefill was seen
    cost.observe_prefill(draft_ms=900.0, context_tokens=150, tokens=4)  # 5.6 ms per context token
    budget = 2 * max(50.0, 4 * 15.0)
    expect = max(budget * (1 + 300 / 128), budget + 2 * 300 * cost.prefill_token_ms.value) / 1e3
    assert abs(_gen(50.0, 300, 0, cost).timeout_s(4) - expect) < 1e-9  # twice the context: about twice


def test_under_load_the_deadline_allows_what_a_target_only_token_costs_now():
    """A target-only token waits for a forward batched with the other sessions' blocks: a draft token is no help
    only when it is slower than that, not than a lone Decode step measured at a quiet time."""
    from orchestrator.policy.draft_length import TargetCost

    cost = DraftCost()
    cost.observe(wall_ms=2002.0, draft_ms=2000.0, tokens=8, sessions=8)  # 250 ms a token per call, 8 sessions
    gen = _gen(50.0, 200, 190, cost)
    gen.state.measured.active_sessions = lambda: 8
    assert abs(gen.timeout_s(8) - 2 * 8 * 50 / 1e3) < 1e-9  # capped at the quiet 50 ms step
    prof = [60.0] + [70.0] * 5 + [70.0 + 5 * (n - 6) for n in range(7, 69)]
    gen.state.measured.target_cost = TargetCost(prof, max_batch=16, sessions=lambda: 8)
    for _ in range(30):
        gen.state.measured.target_cost.observe(7, server_ms=gen.state.measured.target_cost.forward(56))
    step = gen.state.measured.target_cost.step_ms(1, 8)
    assert step > 200.0
    assert abs(gen.timeout_s(8) - 2 * 8 * min(step, 250.0) / 1e3) < 1e-9


def test_a_timeout_lengthens_the_next_deadline_once_not_per_session():
    """A cost learned under other load (here: a prefill rate far too low for a lone session) must not time out
    every later call: a timeout raises the estimate to what the call was allowed, and concurrent timeouts with
    the same deadline do not compound."""
    cost = DraftCost()
    cost.observe(wall_ms=42.0, draft_ms=40.0, tokens=4)  # 10 ms a token
    cost.observe_prefill(draft_ms=140.0, context_tokens=100, tokens=4)  # 1 ms per context token: too cheap
    first = _gen(50.0, 300, 0, cost).timeout_s(4)
    for _ in range(8):  # eight sessions' first calls time out at once
        cost.timed_out(first * 1e3, tokens=4, context_tokens=300)
    assert cost.prefill_token_ms.value == first * 1e3 / 304 and cost.token_ms.value == 10.0
    assert _gen(50.0, 300, 0, cost).timeout_s(4) > 1.5 * first
    block = _gen(50.0, 200, 190, cost).timeout_s(4)
    for _ in range(8):
        cost.timed_out(block * 1e3, tokens=4)
    assert cost.token_ms.value == block * 1e3 / 4  # twice what set the deadline, whatever the number of timeouts
    cost.observe(wall_ms=42.0, draft_ms=40.0, tokens=4)  # calls that finish pull the estimate back
    assert cost.token_ms.value < block * 1e3 / 4
