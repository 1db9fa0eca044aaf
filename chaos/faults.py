"""The faults a scenario injects and heals: kill, hang or slow a draft (or all drafts), kill the target or
the orchestrator, restart Redis."""

from __future__ import annotations

import random
import signal
import threading

from chaos.faults_target import TARGET_FAULTS
from chaos.harness import ChaosHarness
# orchestrator.* is imported here, not at the moment of a fault: its first import pulls in torch (seconds).
from orchestrator.replicas.draft_pool import _rank


class Fault:
    """What a scenario does to the stack: inject() at the seeded moment, heal() after the seeded duration."""

    def __init__(self, h: ChaosHarness, rng: random.Random):
        self.h = h
        self.rng = rng
        self.in_flight = lambda: []  # session ids of the streams running now (set by the scenario)
        self.victims: list[str] = []
        self.victim_addresses: list[str] = []

    min_hold_s = 0.0              # hold the fault at least this long (a partition of several seconds)
    data_loss_allowed = False     # the store loses state: requests may end DATA_LOSS (never a hole, never INTERNAL)

    def stall_bound_ms(self) -> float | None:
        """The longest stall this fault may cause (after it was healed); None: the draft-fault bound or none."""
        return None

    def details(self) -> dict:
        """What the fault measured itself (proxy counters), merged into the result's "fault"."""
        return {}

    @staticmethod
    def checks(res: dict) -> dict[str, bool]:
        """This fault's own checks, on top of the common ones."""
        return {}

    def prepare(self) -> None:
        pass

    def inject(self) -> None:
        raise NotImplementedError

    def heal(self) -> None:
        raise NotImplementedError

    def settle(self, timeout: float) -> bool:
        """Wait until the orchestrator uses the healed service again."""
        return True

    min_requests = 0  # requests a scenario issues at least (beyond ChaosOptions.requests)

    def stream_args(self, rec) -> dict:
        """Overrides of the request's prompt, max_new_tokens and sampling parameters (default: greedy)."""
        return {}

    def judge(self, res: dict, records: list, timeline) -> None:
        """Add the fault's own figures and checks to the result."""


class DraftFault(Fault):
    def _set_victims(self, idx: list[int]) -> list[int]:
        self.idx = idx
        self.victims = [self.h.stack.drafts[i].name for i in idx]
        self.victim_addresses = [self.h.stack.drafts[i].address for i in idx]
        return idx

    def choose_one(self) -> int:
        """At the moment of the fault: a replica that in-flight sessions prefer (rendezvous ranking), so the
        fault hits live streams; the seed picks among them (among all if nothing is in flight)."""
        addrs = [d.address for d in self.h.stack.drafts]
        preferred = sorted({max(range(len(addrs)), key=lambda i: _rank(sid, addrs[i])) for sid in self.in_flight()})
        return self._set_victims([self.rng.choice(preferred or list(range(len(addrs))))])[0]

    def settle(self, timeout: float) -> bool:
        # Closed, not merely half-open: a call to the healed replica succeeded. A half-open breaker can still take a
        # probe that started during the fault and fails after the heal, and open again for seconds: then the
        # post-heal requests never reach the healed replica (a clean-clone run: healed_replica_serving false).
        return self.h.wait_breakers(timeout, ("closed",))


class KillDraft(DraftFault):
    def inject(self):
        self.h.stack.drafts[self.choose_one()].kill()

    def heal(self):
        self.h.restart_draft(self.idx[0])


class KillAllDrafts(DraftFault):
    def prepare(self):
        self._set_victims(list(range(len(self.h.stack.drafts))))

    def inject(self):
        for i in self.idx:  # SIGKILL every process group back to back: all gone at once
            self.h.stack.drafts[i].signal(signal.SIGKILL)
        for i in self.idx:
            self.h.stack.drafts[i].kill()

    def heal(self):
        threads = [threading.Thread(target=self.h.restart_draft, args=(i,)) for i in self.idx]
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)


class HangDraft(DraftFault):
    def inject(self):
        self.h.stack.drafts[self.choose_one()].signal(signal.SIGSTOP)

    def heal(self):
        self.h.stack.drafts[self.idx[0]].signal(signal.SIGCONT)


class SlowDraft(DraftFault):
    def prepare(self):
        restarted = False
        for i in range(len(self.h.stack.drafts)):
            if not self.h.latency_flag[i]:  # restarted by an earlier scenario without the flag
                self.h.restart_draft(i, with_latency_flag=True)
                restarted = True
        if restarted:
            self.h.wait_breakers()

    def inject(self):
        self.h.set_latency(self.choose_one(), True)

    def heal(self):
        self.h.set_latency(self.idx[0], False)


class KillTarget(Fault):
    def prepare(self):
        self.victims = ["target"]
        self.victim_addresses = [self.h.stack.target.address]

    def inject(self):
        self.h.stack.target.kill()

    def heal(self):
        self.h.stack.target.start()
        self.h.stack.target.wait_ready(120)


class KillOrchestrator(Fault):
    def prepare(self):
        self.victims = ["orchestrator"]
        self.victim_addresses = [self.h.stack.address]

    def inject(self):
        self.h.stack.orchestrator.kill()

    def heal(self):
        self.h.stack.start_orchestrator()

    def settle(self, timeout: float) -> bool:
        """Until the new orchestrator speculates again: its first draft calls (a burst of resumed sessions, cold
        draft caches, no measured target step yet) may time out and open breakers for a while."""
        return self.h.wait_speculating(timeout)


class RedisRestart(Fault):
    def prepare(self):
        self.victims = ["redis"]
        self.victim_addresses = [self.h.stack.redis.url]

    def inject(self):
        self.h.stack.redis.stop()  # SIGTERM: Redis writes its AOF and exits; the port is free

    def heal(self):
        self.h.stack.redis.start()


FAULTS = {"kill_draft": KillDraft, "kill_all_drafts": KillAllDrafts, "hang_draft": HangDraft,
          "slow_draft": SlowDraft, "kill_target": KillTarget, "kill_orchestrator": KillOrchestrator,
          "redis_restart": RedisRestart, **TARGET_FAULTS}
