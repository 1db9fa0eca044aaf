"""The session's stream: a stepper thread drafts and verifies; the stream thread stores each block, then sends it.

Block k's Redis commit and its send to the client (a stream message waits for gRPC's send: together ~1.7 ms a step
here) overlap block k+1's draft and verify instead of delaying them. All writes are the stream thread's, each block
stored before the client sees it; on any exit the record is put back to what was last stored (steps the stepper
took past it were neither stored nor sent).
"""

from __future__ import annotations

import contextvars
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Iterator

import grpc

from orchestrator import metrics
from orchestrator.loop.state import (FINISH_CANCELLED, FINISH_EOS, FINISH_LENGTH, FINISH_STOP, Chunk, GenerationError,
                                     LoopState)
from orchestrator.loop.step import Step
from orchestrator.store.session_store import LeaseLost, SessionRecord, StoreUnavailable
from orchestrator.loop.text import TextTracker
from specdec import observability as telemetry

log = logging.getLogger("specdec.orchestrator")

STREAM_AHEAD = 2  # blocks the stepper may be ahead of the stream (stored and sent in order, each before the next)


def commit(state: LoopState, text: TextTracker, new: list[int]) -> tuple[list[int], int]:
    """Apply stop conditions to a block; append what survives to the record; return (kept tokens, finish reason)."""
    rec = state.rec
    kept: list[int] = []
    finish = 0
    for t in new:
        kept.append(t)
        rec.generated.append(t)
        if t in state.stop_ids:
            finish = FINISH_EOS if (t in state.backends.eos_ids and t not in rec.params.stop_token_ids) else FINISH_STOP
        elif len(rec.generated) >= rec.params.max_new_tokens:
            finish = FINISH_LENGTH
        if finish:
            break
    if text.stop and text.find_stop(rec.generated) is not None:
        # Keep tokens up to the one that completed the stop string.
        while len(kept) > 1 and text.find_stop(rec.generated[:-1]) is not None:
            rec.generated.pop()
            kept.pop()
        finish = FINISH_STOP
    return kept, finish


def store_with_grace(state: LoopState, fn):
    """Write to the session store; if it is down, wait up to the grace period (nothing is streamed unstored).
    A write refused because another stream took the session's lease ends this stream (ABORTED): nothing of
    this stream's is written after that moment."""
    deadline = time.monotonic() + state.cfg.store_grace_s
    while True:
        try:
            with telemetry.call_attributes(session_id=state.rec.session_id):
                return fn()
        except LeaseLost as e:
            log.warning("session lease lost; stopping this stream", extra={
                "session_id": state.rec.session_id, "holder": e.holder})
            raise GenerationError(grpc.StatusCode.ABORTED, f"{e}; this stream stopped without writing more "
                                  "(resume the session to continue it where it was stored)") from e
        except StoreUnavailable as e:
            if time.monotonic() >= deadline or state.control.cancel.is_set():
                raise GenerationError(grpc.StatusCode.UNAVAILABLE, f"{e}; the session keeps its last "
                                      "stored state and can be resumed when the store is back") from e
            time.sleep(0.1)


class Stream:
    def __init__(self, state: LoopState, step: Step, text: TextTracker):
        self.state, self.step, self.text = state, step, text
        self._stored: SessionRecord | None = None
        self._handoff_wait_ms = 0.0
        self._lock = threading.Lock()  # the store timers: written by both threads

    def run(self, store) -> Iterator[Chunk]:
        """The session's blocks, each stored before it is yielded."""
        handoff: queue.Queue = queue.Queue(maxsize=STREAM_AHEAD)
        stop = threading.Event()  # this stream ended: the stepper stops after its current step
        self._stored = self._snapshot()
        stepper = threading.Thread(target=contextvars.copy_context().run, args=(self._stepper, handoff, stop),
                                   name=f"stepper-{self.state.rec.session_id[:16]}", daemon=True)
        stepper.start()
        try:
            while True:
                try:
                    item = handoff.get(timeout=1.0)
                except queue.Empty:
                    if stepper.is_alive() or not handoff.empty():
                        continue
                    raise GenerationError(grpc.StatusCode.INTERNAL, "the generation loop ended without a result")
                if item is None:
                    return
                if isinstance(item, BaseException):
                    raise item
                chunk, snap, kept = item
                self._write_block(store, snap, kept)
                yield chunk
        finally:
            stop.set()
            stepper.join()
            self._restore_stored()

    def _snapshot(self) -> SessionRecord:
        """A copy of the record for the store (the stepper goes on changing the live one)."""
        rec = self.state.rec
        return dataclasses.replace(rec, generated=list(rec.generated), stats=rec.stats.copy())

    def _write_block(self, store, snap: SessionRecord, kept: list[int]) -> None:
        t_store = time.perf_counter()
        lease = self.state.control.lease
        if store_with_grace(self.state, lambda: store.commit(snap, kept, lease)):  # stored before the client sees it
            self.state.control.cancel.set()  # CancelSession reached another orchestrator: the stepper stops
        self._stored = snap
        store_ms = (time.perf_counter() - t_store) * 1e3
        with self._lock:
            stats = self.state.stats
            stats.store_ms += store_ms
            # The stepper went on meanwhile, except while it waited for room in the handoff: that part is critical.
            stats.store_overlapped_ms = max(0.0, stats.store_ms - self._handoff_wait_ms)

    def _restore_stored(self) -> None:
        """Put the record back to the stored snapshot, keeping the store timers (real time spent)."""
        stored, rec = self._stored, self.state.rec
        if len(rec.generated) == len(stored.generated) and rec.step == stored.step and rec.status == stored.status:
            return
        store_ms, overlapped_ms = rec.stats.store_ms, rec.stats.store_overlapped_ms
        for f in dataclasses.fields(rec):  # what a step changes: everything but the session's identity and request
            if f.name not in ("session_id", "prompt_ids", "params"):
                setattr(rec, f.name, getattr(stored, f.name))
        rec.stats = stored.stats.copy()
        rec.stats.store_ms, rec.stats.store_overlapped_ms = store_ms, overlapped_ms
        self.step.prefetch.drop()

    def _stepper(self, handoff: queue.Queue, stop: threading.Event) -> None:
        def hand_over(item) -> bool:
            t0 = time.perf_counter()
            while not stop.is_set():
                try:
                    handoff.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            waited = (time.perf_counter() - t0) * 1e3
            if waited > 0.05:
                with self._lock:
                    self._handoff_wait_ms += waited
            return not stop.is_set()

        try:
            for chunk, kept in self.steps(stop):
                if not hand_over((chunk, self._snapshot(), kept)):
                    return
            hand_over(None)
        except BaseException as e:  # noqa: BLE001 - the stream raises it after the blocks before it
            hand_over(e)
        finally:
            self.step.prefetch.drop()
            self.step.target.close_stream()  # the target stops decoding for this stream

    def steps(self, stop: threading.Event) -> Iterator[tuple[Chunk, list[int]]]:
        """Step until the session finishes, is cancelled or the stream stops: (chunk to send, tokens to store)."""
        state, rec = self.state, self.state.rec
        while rec.status == "running" and not stop.is_set():
            t0 = time.perf_counter()
            if state.control.cancel.is_set():
                rec.status, rec.finish_reason = "cancelled", FINISH_CANCELLED
                yield Chunk([], self.text.delta(rec.generated, True), len(rec.generated), FINISH_CANCELLED), []
                return
            offset = len(rec.generated)
            state.step_server_ms, state.step_draft_ms = None, 0.0
            prefill_ms = rec.stats.prefill_ms
            new, degraded = self.step(rec.params.max_new_tokens - offset)
            kept, finish = commit(state, self.text, new)
            rec.step += 1
            if finish:
                rec.status, rec.finish_reason = "finished", finish
            self._count_step((time.perf_counter() - t0) * 1e3, degraded, prefill_ms)
            telemetry.record_generated(len(kept))
            stop_at = self.text.find_stop(rec.generated) if finish == FINISH_STOP else None
            yield Chunk(kept, self.text.delta(rec.generated, bool(finish), stop_at), offset, finish), kept

    def _count_step(self, step_ms: float, degraded: bool, prefill_ms_before: float) -> None:
        state, stats = self.state, self.state.stats
        stats.wall_ms += step_ms
        if degraded:
            stats.degraded_ms += step_ms
            metrics.record_degraded(step_ms / 1e3)
        # A step that also prefilled (a new session's prompt, its KV for the draft: tens of ms) is not what a
        # decoding step costs: counted in the per-step overhead it made longer drafts look cheap.
        cost = state.measured.target_cost
        if cost is not None and state.step_server_ms is not None and stats.prefill_ms == prefill_ms_before:
            cost.observe_step(step_ms - state.step_draft_ms, state.step_server_ms)
