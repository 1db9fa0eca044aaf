"""Orchestrator-side metrics (OpenTelemetry API; exported by whatever telemetry.setup configured)."""

from __future__ import annotations

from functools import lru_cache

from opentelemetry import metrics

from specdec.observability import CollectedCounts

# Per-position acceptance is reported when a reader collects: a step would otherwise make up to 2 x k counter
# calls on its critical path.
_proposed_at = CollectedCounts("position")
_accepted_at = CollectedCounts("position")


@lru_cache(maxsize=1)
def _instruments():
    meter = metrics.get_meter("specdec.orchestrator")
    return {
        "failures": meter.create_counter("specdec.draft.failures", unit="{failure}",
                                         description="draft calls that failed, by kind"),
        "accepted_at": meter.create_observable_counter(
            "specdec.draft.accepted_by_position", callbacks=[_accepted_at.observe], unit="{token}",
            description="draft tokens accepted, by position in the block"),
        "proposed_at": meter.create_observable_counter(
            "specdec.draft.proposed_by_position", callbacks=[_proposed_at.observe], unit="{token}",
            description="draft tokens proposed, by position in the block"),
        "failovers": meter.create_counter("specdec.draft.replica_failovers", unit="{failover}",
                                          description="sessions moved to another draft replica"),
        "degraded": meter.create_counter("specdec.degraded.duration", unit="s",
                                         description="wall time spent decoding target-only because drafts failed"),
        "load_shed": meter.create_counter("specdec.speculation.load_shed_steps", unit="{step}",
                                          description="steps decoded target-only because too many sessions were "
                                                      "generating (--speculation-max-sessions)"),
        "trimmed": meter.create_counter("specdec.draft.tokens_trimmed", unit="{token}",
                                        description="drafted tokens not verified: their scores said verifying them "
                                                    "would not pay (goodput draft length)"),
        "queue_wait": meter.create_histogram("specdec.admission.queue_wait", unit="s",
                                             description="time a generation waited in the admission queue before "
                                                         "it started, or before it timed out or was cancelled"),
        "paused": meter.create_counter("specdec.speculation.paused_steps", unit="{step}",
                                       description="steps decoded target-only because no draft length paid "
                                                   "(goodput draft length)"),
    }


def record_draft_failure(kind: str) -> None:
    _instruments()["failures"].add(1, {"kind": kind})


def record_acceptance(proposed: int, accepted: int) -> None:
    _instruments()
    _proposed_at.add_positions(proposed)
    _accepted_at.add_positions(accepted)


def record_failover() -> None:
    _instruments()["failovers"].add(1)


def record_degraded(seconds: float) -> None:
    _instruments()["degraded"].add(seconds)


def record_load_shed() -> None:
    _instruments()["load_shed"].add(1)


def record_trimmed(tokens: int) -> None:
    _instruments()["trimmed"].add(tokens)


def record_paused() -> None:
    _instruments()["paused"].add(1)


def record_queue_wait(seconds: float) -> None:
    _instruments()["queue_wait"].record(seconds)
