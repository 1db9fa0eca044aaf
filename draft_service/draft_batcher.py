"""Batched draft steps: concurrent sessions' draft tokens through one forward pass.

A draft proposes token by token, each step a forward over one row that streams every weight. Several sessions
proposing at once would each stream the weights on their own, one after the other; here their steps meet in one
forward over all their rows (the int8 draft's decoder stack takes rows of several sessions,
specdec/models/csrc/int8_llama.cpp), as the target batches its verifies (target_service/engines/batching.py VerifyBatcher).
Measured with SmolLM2's int8 draft: one row ~14 ms, eight rows ~52 ms (an AVX2 CPU, float32 activations);
with int16 activations on an AVX-512 VNNI AMD EPYC its layers take ~3.4 ms at one row, ~6.3 ms at eight.

No batching thread: the first caller to find no forward running leads (collects the waiting steps, runs the
forward, hands out the results) and the others wait for it; a lone session runs its own step at once. The leader
waits up to `wait_ms` for sessions that are inside a proposal (`member`) but have not submitted their next step
yet (between two steps a session only picks its token): without that wait the sessions fall out of step and every
forward carries one row. A prefill is fed in chunks of half of `max_rows` (LeanCachedLM.extend), so the other
sessions' steps share its forwards instead of waiting out a whole prompt (chunked prefill).
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from specdec import observability as telemetry


@dataclass(eq=False)  # steps are told apart by identity, never by their tensors
class _Step:
    session_id: str
    feed: Any  # what forward_rows takes for this session (tokens, cache, keep)
    rows: int
    logits: torch.Tensor | None = None
    error: BaseException | None = None
    done: bool = False


@dataclass
class BatchStats:
    forwards: int = 0
    steps: int = 0  # session steps fed
    rows: int = 0
    by_size: dict[int, int] = field(default_factory=dict)  # steps per forward -> forwards


class DraftStepBatcher:
    def __init__(self, forward_rows: Callable[[list[Any]], list[torch.Tensor]], max_rows: int = 64,
                 wait_ms: float = 2.0):
        if max_rows < 1:
            raise ValueError("max_rows must be at least 1")
        self.forward_rows = forward_rows
        self.max_rows = max_rows
        self.wait_s = wait_ms / 1e3
        self.stats = BatchStats()
        self._cond = threading.Condition()
        self._pending: list[_Step] = []
        self._members: dict[str, int] = {}  # session -> open proposals (bounded by the draft's sessions)
        self._busy = False  # a leader is collecting or running a forward

    @contextlib.contextmanager
    def member(self, session_id: str):
        """Marks a proposal in progress: leaders wait (briefly) for its steps."""
        with self._cond:
            self._members[session_id] = self._members.get(session_id, 0) + 1
        try:
            yield
        finally:
            with self._cond:
                if self._members[session_id] <= 1:
                    del self._members[session_id]
                else:
                    self._members[session_id] -= 1
                self._cond.notify_all()  # a leader may be waiting for this session

    def run(self, session_id: str, feed: Any, rows: int) -> torch.Tensor:
        """One session's step (at most max_rows rows): its logits, computed in a forward with whatever other
        sessions' steps are waiting."""
        step = _Step(session_id, feed, rows)
        with self._cond:
            self._pending.append(step)
            self._cond.notify_all()
            while not step.done:
                if self._busy:
                    self._cond.wait()
                    continue
                self._lead()
        if step.error is not None:
            raise step.error
        return step.logits

    def _lead(self) -> None:
        """Called holding the lock with no forward running: collect a batch, run it unlocked, publish results."""
        self._busy = True
        try:
            deadline = time.monotonic() + self.wait_s
            while True:
                missing = set(self._members) - {s.session_id for s in self._pending}
                remaining = deadline - time.monotonic()
                if not missing or remaining <= 0 or self._rows_pending() >= self.max_rows:
                    break
                self._cond.wait(remaining)
            batch, rows, seen = [], 0, set()
            for step in self._pending:  # oldest first; one step per session; the first always fits
                if step.session_id in seen or (batch and rows + step.rows > self.max_rows):
                    continue
                batch.append(step)
                rows += step.rows
                seen.add(step.session_id)
            self._pending = [s for s in self._pending if s not in batch]
            self._cond.release()
            try:
                try:
                    outs = self.forward_rows([s.feed for s in batch])
                    for s, logits in zip(batch, outs):
                        s.logits = logits
                except BaseException as e:  # noqa: BLE001 - every step of a failed forward gets the error
                    for s in batch:
                        s.error = e
            finally:
                self._cond.acquire()
            for s in batch:
                s.done = True
            st = self.stats
            st.forwards += 1
            st.steps += len(batch)
            st.rows += rows
            st.by_size[len(batch)] = st.by_size.get(len(batch), 0) + 1
            telemetry.record_draft_batch(len(batch))
        finally:
            self._busy = False
            self._cond.notify_all()

    def _rows_pending(self) -> int:
        return sum(s.rows for s in self._pending)
