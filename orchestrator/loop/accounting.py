"""After a verify: the one place that counts it (session stats, the orchestrator's acceptance window, metrics) and
tells the draft-length policy and the target-step timer. Chains and trees both report here."""

from __future__ import annotations

from orchestrator import metrics
from orchestrator.policy.draft_length import AdaptiveLength
from orchestrator.loop.state import LoopState
from specdec import observability as telemetry


def record_verify(state: LoopState, draft_len: AdaptiveLength, proposed: int, accepted: int, verify_ms: float,
                  scores: list[float] = ()) -> None:
    """`proposed` draft tokens were verified in `verify_ms` (the target's own time) and `accepted` of them kept;
    `scores`: the drafter's score per proposed token (chains; a tree's nodes have none)."""
    stats = state.stats
    stats.verify_steps += 1
    stats.draft_tokens_proposed += proposed
    stats.draft_tokens_accepted += accepted
    stats.verify_ms += verify_ms
    draft_len.update(proposed, accepted)
    draft_len.observe_evidence(list(scores), proposed, accepted)
    if state.measured.window is not None:
        state.measured.window.add(proposed, accepted)
    metrics.record_acceptance(proposed, accepted)
    state.measured.target_step.observe(verify_ms)


def record_decode(state: LoopState, tokens: int, decode_ms: float, degraded: bool) -> None:
    """A target-only Decode call produced `tokens` tokens in `decode_ms`."""
    stats = state.stats
    stats.decode_steps += 1
    stats.decode_ms += decode_ms
    if degraded:
        stats.fallback_steps += 1
        stats.fallback_tokens += tokens
        telemetry.record_fallback()
    state.measured.target_step.observe(decode_ms / max(1, tokens))
