"""What both target engines share to batch their work: the verify batcher, and target-only decoding as verify
steps so that a Decode joins the same batches. Neither engine owns it (torch.py and llamacpp.py both import it)."""

from __future__ import annotations

import queue
import threading
import time

from specdec import observability as telemetry
from specdec.core import sampling
from specdec.core.grpc_util import call_deadline
from target_service.engines.jobs import DecodeTask, VerifyJob, VerifyOutcome, VerifyTask


class VerifyBatcher:
    """Collects Verify calls (and the single-token steps of Decode calls) from concurrent sessions for up to
    `window_ms` and runs them as one forward pass, so aggregate throughput grows with concurrency. A call waits
    at most the window, not at all while no other session has submitted work in the last ACTIVE_S, and the
    batch closes early once every such recently active session has a job in it (so a generous window costs
    nothing when the sessions arrive close together).

    The window stretches to `wait_fraction` of the recent forward time: a job that misses this batch waits for
    the whole forward anyway, and then costs a forward of its own, so under load (sessions out of step, the
    target busy) waiting part of a forward for them fills the batch (8 SmolLM2 sessions on this CPU, one run
    each: 4.2 rows per forward and 38 tokens/s with only a 5 ms window, 7.8 rows and 58 tokens/s waiting up to
    half a forward).

    `engine` is whatever computes a list of jobs in one forward: its verify_many(jobs) fills each job's result or
    error (both engines in target_service/engines/)."""

    ACTIVE_S = 1.0  # a session that submitted within this long is expected to submit again soon

    def __init__(self, engine, window_ms: float, max_batch: int = 16, max_queue: int = 256,
                 wait_fraction: float = 0.5):
        self.engine = engine
        self.window_s = window_ms / 1e3
        self.wait_fraction = wait_fraction
        self.forward_s = 0.0  # moving average of the batched forwards' durations
        self.max_batch = max_batch
        self.queue: queue.Queue[VerifyJob] = queue.Queue(maxsize=max_queue)
        self.batches = 0
        self.batched_jobs = 0
        self._last_seen: dict[str, float] = {}  # session -> last submit (bounded by ACTIVE_S)
        self._seen_lock = threading.Lock()
        self._forward_lock = threading.Lock()  # one batch computes at a time: the batcher's or a lone caller's
        threading.Thread(target=self._loop, name="verify-batcher", daemon=True).start()

    def submit(self, job: VerifyJob, timeout: float = 60.0) -> VerifyOutcome:
        """Queue the job and wait for its batch: at most `timeout`, or until the calling RPC's deadline, after which
        the batcher skips the job instead of computing work nobody waits for (retries would pile up behind it)."""
        deadline = call_deadline()
        job.deadline = min(deadline, time.monotonic() + timeout) if deadline is not None else None
        wait = timeout if job.deadline is None else max(0.0, job.deadline - time.monotonic())
        if self._run_alone(job):
            return job.outcome()
        try:
            self.queue.put(job, timeout=1.0)
        except queue.Full:
            raise MemoryError("verify queue is full") from None
        if not job.done.wait(wait):
            raise TimeoutError("the target was busy: this step did not get its turn before the call's deadline")
        return job.outcome()

    def _run_alone(self, job: VerifyJob) -> bool:
        """Run a lone session's job in the caller's thread: no hand-off to the batcher thread and back, two thread
        wake-ups a token that cost a 2-thread llama.cpp target about a fifth of its single-session speed.
        False (queue it) while another session is active, jobs are queued or a batch is computing."""
        if self._active(job.task.session_id, time.monotonic()) != {job.task.session_id} or not self.queue.empty():
            return False
        if not self._forward_lock.acquire(blocking=False):
            return False
        try:
            self._run([job])
        finally:
            self._forward_lock.release()
        return True

    def _run(self, jobs: list[VerifyJob]) -> None:
        telemetry.record_batch(len(jobs))
        t0 = time.perf_counter()
        try:
            self.engine.verify_many(jobs)
        finally:
            took = time.perf_counter() - t0
            self.forward_s = took if not self.forward_s else 0.8 * self.forward_s + 0.2 * took
            for job in jobs:
                job.done.set()
        self.batches += 1
        self.batched_jobs += len(jobs)

    @staticmethod
    def _expired(jobs: list[VerifyJob]) -> list[VerifyJob]:
        """The jobs whose callers stopped waiting: failed, not computed."""
        now = time.monotonic()
        late = [j for j in jobs if j.deadline is not None and j.deadline <= now]
        for j in late:
            j.error = TimeoutError("the call's deadline passed before its batch ran")
            j.done.set()
        return late

    def _active(self, session_id: str, now: float) -> set[str]:
        """The sessions that submitted work lately (this one included): the batch waits for them, and a lone
        session does not wait at all."""
        with self._seen_lock:
            self._last_seen[session_id] = now
            stale = [sid for sid, t in self._last_seen.items() if now - t > self.ACTIVE_S]
            for sid in stale:
                del self._last_seen[sid]
            return set(self._last_seen)

    def forget(self, session_id: str) -> None:
        """A released (finished) session submits nothing more: the next lone session must not wait for it."""
        with self._seen_lock:
            self._last_seen.pop(session_id, None)

    def _loop(self) -> None:
        while True:
            jobs = [self.queue.get()]
            now = time.monotonic()
            waiting_for = self._active(jobs[0].task.session_id, now) - {jobs[0].task.session_id}
            window = max(self.window_s, self.wait_fraction * self.forward_s)
            deadline = now + (window if waiting_for else 0.0)
            while len(jobs) < self.max_batch:
                if not waiting_for and self.queue.empty():
                    break  # every recently active session is in: no point waiting out the window
                remaining = deadline - time.monotonic()
                try:
                    jobs.append(self.queue.get(timeout=max(0.0, remaining)) if remaining > 0 else self.queue.get_nowait())
                except queue.Empty:
                    break
                with self._seen_lock:
                    self._last_seen[jobs[-1].task.session_id] = time.monotonic()
                waiting_for.discard(jobs[-1].task.session_id)
            with self._forward_lock:  # a lone caller's job may be computing: expiry is judged after it
                late = self._expired(jobs)
                jobs = [j for j in jobs if j not in late]
                if jobs:
                    self._run(jobs)


def decode_as_verify_steps(submit, task: DecodeTask, gen=None, t0=None, session=None,
                           on_token=None) -> tuple[list[int], int, float]:
    """Target-only decoding as single-token steps, each a VerifyJob of an empty draft given to `submit` (the next
    token is the 'bonus' token), so concurrent sessions decode in one forward pass, alongside other sessions'
    Verify blocks. Same tokens, and the same random stream, as sampling each step's last row directly.
    `session`: the session object every step uses (VerifyJob.session). `on_token(token, cached_len)`: told each
    token as it comes; False stops the decoding (a stream's consumer went away)."""
    t0 = time.perf_counter() if t0 is None else t0
    if gen is None and not task.params.is_greedy:
        gen = sampling.make_generator(task.seed, task.step, "decode")
    out: list[int] = []
    cached, delta = task.prefix_len, task.delta
    for _ in range(task.max_tokens):
        step = VerifyTask(task.session_id, cached, list(delta), [], None, task.params, task.seed, task.step)
        res = submit(VerifyJob(step, generator=gen, session=session))
        out.append(res.next_token)
        cached, delta = res.cached_len, [res.next_token]
        wanted = on_token is None or on_token(res.next_token, cached) is not False
        if res.next_token in task.stop_token_ids or not wanted:
            break
    return out, cached, (time.perf_counter() - t0) * 1e3
