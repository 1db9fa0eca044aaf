"""kill_target_pool: two target replicas; the one most streams are on is SIGKILLed under load. Sessions on it move at
once to the other (their caches rebuilt from the committed tokens), so no stream waits for the target grace period:
the longest stall stays far below it. The killed target is then restarted on its address and rejoins the pool."""

from __future__ import annotations

import dataclasses

from chaos.faults import Fault
from chaos.harness import ChaosOptions
# orchestrator.* is imported here, not at the moment of a fault: its first import pulls in torch (seconds).
from orchestrator.replicas.pool import rank

POOL_TARGETS = 2


class KillTargetPool(Fault):
    def prepare(self):
        targets = self.h.stack.targets
        if len(targets) < POOL_TARGETS:
            raise RuntimeError(f"kill_target_pool needs {POOL_TARGETS} target replicas, the stack has {len(targets)}")
        self.victim = None

    def inject(self):
        targets = self.h.stack.targets
        # The target most in-flight streams are on now (rendezvous: with even loads, each session's top replica).
        on = {t.address: 0 for t in targets}
        for sid in self.in_flight():
            on[max(on, key=lambda a: rank(sid, a))] += 1
        self.victim = max(targets, key=lambda t: (on[t.address], self.rng.random()))
        self.victims = [self.victim.name]
        self.victim_addresses = [self.victim.address]
        self.victim.kill()  # SIGKILL

    def heal(self):
        self.victim.start()  # on the same address: the orchestrator's pool takes it back once healthy
        self.victim.wait_ready(120)


POOL_FAULTS = {"kill_target_pool": KillTargetPool}


def options_for(name: str, opts: ChaosOptions) -> ChaosOptions:
    """The stack a scenario needs: two target replicas for the pool's."""
    if name in POOL_FAULTS and opts.target_replicas < POOL_TARGETS:
        return dataclasses.replace(opts, target_replicas=POOL_TARGETS)
    return opts


def pool_checks(res: dict) -> dict[str, bool]:
    """No stream broke, a target was lost under load, and no stream waited for the grace period: the longest stall
    is under a third of it (a session waiting for the killed target would stall the whole outage)."""
    grace_ms = res["config"]["target_grace_s"] * 1e3
    return {"streams_never_broken": res["resumes"] == 0 and res["retried_requests"] == 0,
            "fault_exercised": res["target_resyncs"] > 0,
            "no_grace_wait": res["max_stall_ms"] < grace_ms / 3}
