"""Admission control: at most `limit()` generations run (decode on the target) at once; the others wait in a FIFO
queue, each until its turn, its own deadline, the queue timeout, or its cancellation.

A target serves a bounded number of sessions well: those its KV cache keeps and its batched forward takes in
(ModelInfo.max_sessions, max_batch; TargetPool.capacity). Started all at once, more sessions share its cores until
every call passes its deadline and they all fail; queued, the first ones run at full speed and the others start as
they end. The queue itself is bounded by the caller (--max-sessions caps running + queued).

That count is a ceiling, not a promise: a target whose cores other work takes (or a slower machine than its
max_batch assumed) serves fewer sessions within its call deadline. AdaptiveLimit lowers the running limit while
the target's calls come back close to their deadline and raises it again as they speed up, so the first generations
finish and the others wait (or are refused after the queue timeout) instead of all failing together."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Callable

from orchestrator import metrics
from specdec import observability as telemetry

log = logging.getLogger("specdec.orchestrator")

# A waiter wakes at least this often to see a changed limit (replicas joining or leaving the pool).
RECHECK_S = 1.0

# The signal is a target call's wall time as a fraction of the target call deadline: that is what fails (a call past
# its deadline fails its generation); it needs no unloaded profile (per-token step times grow with batching by
# design, and a long prompt's prefill is slow on any machine); and on an ordinary machine it is tiny (milliseconds
# against 30 s), so the limit stays at its ceiling there.
SLOW_FRACTION = 0.25  # a call this close to its deadline: fewer generations at once
FAST_FRACTION = 0.10  # a call this far from it: more, while the limit is in use
# A fresh orchestrator's limit: a burst of requests does not start the whole ceiling before any call was measured
# (every one of them sharing a starved target's cores at once); fast calls raise it to the ceiling within a few calls.
START_LIMIT = 4


class AdaptiveLimit:
    """AIMD on the target's call latency (see SLOW_FRACTION), below a ceiling (the static capacity) and never below 1.

    Per call, as TCP updates its window per acknowledgement: a slow call takes off half the limit divided by the
    generations running, so a round of slow calls (one from each) about halves it, however many run; a fast call
    adds 1/limit (one per round), or 1 (doubling per round) until the first slow call. A fast call raises it only
    while the limit is in use (as many running as it allows): a few fast generations say nothing about more."""

    def __init__(self, start: int = START_LIMIT):
        self.value = float(max(1, start))
        self.probing = True  # slow start: until the first slow call

    def limit(self, ceiling: int) -> int:
        return max(1, min(ceiling, int(self.value)))

    def observe(self, fraction: float, running: int, ceiling: int) -> None:
        """One target call took `fraction` of its deadline (>= 1: it passed it) with `running` generations admitted."""
        self.value = min(self.value, float(max(1, ceiling)))  # a lowered ceiling (a replica left) holds at once
        if fraction >= SLOW_FRACTION:
            self.probing = False
            self.value = max(1.0, self.value * (1.0 - 0.5 / max(1, running)))
        elif fraction <= FAST_FRACTION and running >= int(self.value):
            self.value = min(float(max(1, ceiling)), self.value + (1.0 if self.probing else 1.0 / self.value))


class QueueTimeout(Exception):
    """The generation waited its whole allowance without getting a turn (the server stays busy)."""


class QueueCancelled(Exception):
    """The generation was cancelled while it waited (client cancel, CancelSession)."""


class Ticket:
    """One generation's place: queued, then running until released."""

    def __init__(self, key: str, owner: str):
        self.key, self.owner = key, owner
        self.running = False
        self.cancelled = False
        self.queued_s = 0.0  # how long it waited for its turn


class Admission:
    def __init__(self, limit: Callable[[], int], timeout_s: float, max_queued: int, adaptive: bool = True):
        self.limit = limit  # the most generations that may run at once now (at least 1 is used): the ceiling
        self.adaptive = AdaptiveLimit() if adaptive else None  # below it, what the target's latency allows
        self.timeout_s = timeout_s
        self.max_queued = max_queued
        self._cond = threading.Condition()
        self._queue: deque[Ticket] = deque()
        self._running = 0
        # Bound methods: held weakly, so a closed orchestrator's admission stops reporting with it.
        telemetry.register_gauge("specdec.admission.queued", self.queued, "{generation}",
                                 "generations waiting in the admission queue")
        telemetry.register_gauge("specdec.admission.running", self.running, "{generation}",
                                 "generations admitted and running")
        telemetry.register_gauge("specdec.admission.limit", self.current_limit, "{generation}",
                                 "generations allowed to run at once now (lowered while the target's calls near "
                                 "their deadline)")

    def running(self) -> int:
        return self._running

    def queued(self) -> int:
        return len(self._queue)

    def _ceiling(self) -> int:
        try:
            return max(1, int(self.limit()))
        except Exception:  # noqa: BLE001 - a broken capacity source must not stop admission
            return 1

    def current_limit(self) -> int:
        """Generations that may run at once now: the ceiling, or below it what the target's latency allows."""
        ceiling = self._ceiling()
        return ceiling if self.adaptive is None else self.adaptive.limit(ceiling)

    def observe(self, latency_s: float, deadline_s: float) -> None:
        """A target call took `latency_s` of its `deadline_s` (latency_s >= deadline_s: it passed it)."""
        if self.adaptive is None or not deadline_s > 0:
            return
        with self._cond:
            ceiling = self._ceiling()
            before = self.adaptive.limit(ceiling)
            self.adaptive.observe(latency_s / deadline_s, self._running, ceiling)
            after = self.adaptive.limit(ceiling)
            if after > before:
                self._cond.notify_all()  # the queue's head may start now
            running = self._running
        if after != before:
            log.info("admission limit " + ("raised" if after > before else "lowered"),
                     extra={"limit": after, "previous": before, "ceiling": ceiling, "running": running,
                            "call_s": round(latency_s, 3), "deadline_s": deadline_s})

    def ticket(self, key: str, owner: str = "") -> Ticket:
        """A ticket for `key` (a session id) of `owner`; give it to admit(), and cancel() may find it by key."""
        return Ticket(key, owner)

    def admit(self, ticket: Ticket, wait_s: float | None = None, on_queued: Callable[[], None] | None = None) -> float:
        """Block until `ticket` may run; returns the seconds it waited. Waits at most the queue timeout, or `wait_s`
        (the caller's deadline) if shorter: then QueueTimeout, with a message a person understands.
        QueueCancelled when cancel() took it out meanwhile. `on_queued()` runs (outside the lock) if it must wait."""
        allowance = self.timeout_s if wait_s is None else max(0.0, min(self.timeout_s, wait_s))
        t0 = time.monotonic()
        with self._cond:
            if ticket.cancelled:
                raise QueueCancelled(f"generation {ticket.key} was cancelled before it started")
            if not self._queue and self._running < self.current_limit():
                return self._start(ticket, None)
            if len(self._queue) >= self.max_queued:
                raise QueueTimeout(self._busy(0.0))
            self._queue.append(ticket)
        if on_queued is not None:
            on_queued()
        with self._cond:
            while True:
                if ticket.cancelled:
                    self._waited(t0)
                    raise QueueCancelled(f"generation {ticket.key} was cancelled while it waited to start")
                if self._queue and self._queue[0] is ticket and self._running < self.current_limit():
                    self._queue.popleft()
                    self._cond.notify_all()  # the next one may fit too (a raised limit)
                    return self._start(ticket, t0)
                left = allowance - (time.monotonic() - t0)
                if left <= 0:
                    self._queue.remove(ticket)
                    self._cond.notify_all()  # the one behind may be first now
                    waited = self._waited(t0)
                    raise QueueTimeout(self._busy(waited))
                self._cond.wait(min(left, RECHECK_S))

    def _start(self, ticket: Ticket, queued_since: float | None) -> float:
        ticket.running = True
        self._running += 1
        ticket.queued_s = 0.0 if queued_since is None else time.monotonic() - queued_since
        metrics.record_queue_wait(ticket.queued_s)
        return ticket.queued_s

    def _waited(self, t0: float) -> float:
        waited = time.monotonic() - t0
        metrics.record_queue_wait(waited)
        return waited

    def _busy(self, waited_s: float) -> str:
        return (f"server busy: {self._running} generations running, {len(self._queue)} queued; waited "
                f"{waited_s:.1f} s (the queue timeout is {self.timeout_s:g} s); retry later")

    def release(self, ticket: Ticket) -> None:
        """The generation ended (a running ticket frees its slot; a queued or refused one does nothing)."""
        with self._cond:
            if ticket.running:
                ticket.running = False
                self._running -= 1
                self._cond.notify_all()

    def cancel(self, key: str, owner: str | None = None) -> bool:
        """Take the queued generation `key` (of `owner`, when given) out of the queue; False if none waits."""
        with self._cond:
            for ticket in self._queue:
                if ticket.key == key and (owner is None or ticket.owner == owner):
                    return self._cancel(ticket)
        return False

    def cancel_ticket(self, ticket: Ticket) -> None:
        """Cancel this one request's wait (its client went away); nothing once it runs."""
        with self._cond:
            if not ticket.running:
                self._cancel(ticket)

    def _cancel(self, ticket: Ticket) -> bool:
        ticket.cancelled = True
        queued = ticket in self._queue
        if queued:
            self._queue.remove(ticket)
        self._cond.notify_all()
        return queued
