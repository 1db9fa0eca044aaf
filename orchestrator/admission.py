"""Admission control: at most `limit()` generations run (decode on the target) at once; the others wait in a FIFO
queue, each until its turn, its own deadline, the queue timeout, or its cancellation.

A target serves a bounded number of sessions well: those its KV cache keeps and its batched forward takes in
(ModelInfo.max_sessions, max_batch; TargetPool.capacity). Started all at once, more sessions share its cores until
every call passes its deadline and they all fail; queued, the first ones run at full speed and the others start as
they end. The queue itself is bounded by the caller (--max-sessions caps running + queued)."""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Callable

from orchestrator import metrics
from specdec import observability as telemetry

# A waiter wakes at least this often to see a changed limit (replicas joining or leaving the pool).
RECHECK_S = 1.0


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
    def __init__(self, limit: Callable[[], int], timeout_s: float, max_queued: int):
        self.limit = limit  # generations that may run at once now (at least 1 is used)
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

    def running(self) -> int:
        return self._running

    def queued(self) -> int:
        return len(self._queue)

    def _limit(self) -> int:
        try:
            return max(1, int(self.limit()))
        except Exception:  # noqa: BLE001 - a broken capacity source must not stop admission
            return 1

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
            if not self._queue and self._running < self._limit():
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
                if self._queue and self._queue[0] is ticket and self._running < self._limit():
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
