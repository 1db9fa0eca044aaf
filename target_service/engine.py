"""The target model's work: prefill, verify a draft block in one forward pass, and target-only decoding."""

from __future__ import annotations

import queue
import statistics
import threading
import time

import torch

from specdec.core import sampling
from specdec import observability as telemetry
from specdec.core import wire
from specdec.core.grpc_util import call_deadline
from specdec.core.kv_cache import CachedLM, SessionCacheStore, SessionKV, extend_batch
from specdec.models import LoadedModel
from specdec.core.sampling import SamplingParams
from target_service.jobs import VerifyJob, VerifyOutcome
from specdec.core.settings import MAX_DRAFT_LEN


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
    half a forward)."""

    ACTIVE_S = 1.0  # a session that submitted within this long is expected to submit again soon

    def __init__(self, engine: "TargetEngine", window_ms: float, max_batch: int = 16, max_queue: int = 256,
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
        if self._active(job.session_id, time.monotonic()) != {job.session_id} or not self.queue.empty():
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
            waiting_for = self._active(jobs[0].session_id, now) - {jobs[0].session_id}
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
                    self._last_seen[jobs[-1].session_id] = time.monotonic()
                waiting_for.discard(jobs[-1].session_id)
            with self._forward_lock:  # a lone caller's job may be computing: expiry is judged after it
                late = self._expired(jobs)
                jobs = [j for j in jobs if j not in late]
                if jobs:
                    self._run(jobs)


def _isotonic(values: list[float]) -> list[float]:
    """The non-decreasing sequence closest to `values` in least squares (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [mean, count]
    for v in values:
        blocks.append([v, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            m2, c2 = blocks.pop()
            m1, c1 = blocks.pop()
            blocks.append([(m1 * c1 + m2 * c2) / (c1 + c2), c1 + c2])
    return [m for m, c in blocks for _ in range(int(c))]


PROFILE_SIZES = (2, 3, 4, 5, 6, 8, 11, 14, 17, 24, 32, 48, 64, 96, 128)  # measured; sizes between interpolated


def measure_profile(forward_ms, max_tokens: int, reps: int = 3) -> list[float]:
    """forward_ms(n) times one forward over n tokens; returns the cost of n = 1 .. max_tokens.

    Each size n > 1 is timed between two 1-token forwards and costed as its ratio to their mean: a shared
    machine's slow spells last longer than three forwards, so the ratios (the profile's shape, which is what a
    draft length is chosen by) survive them where the fastest of a few runs per size did not (measured on an AVX2
    CPU, four profiles in a row: a 6-token forward at 1.42-1.56 steps this way, 1.21-1.58 by the fastest run).
    The median ratio over `reps` rounds times the median 1-token time gives milliseconds; the result is made
    non-decreasing by isotonic regression (more tokens never cost less; one outlier is pooled with its
    neighbours rather than carried to every larger size)."""
    grid = sorted({n for n in PROFILE_SIZES if n < max_tokens} | ({max_tokens} if max_tokens > 1 else set()))
    ratios: dict[int, list[float]] = {n: [] for n in grid}
    ones: list[float] = []
    for rep in range(reps + 1):  # repetition 0 warms up
        before = forward_ms(1)
        if rep:
            ones.append(before)
        order = grid[rep % len(grid):] + grid[: rep % len(grid)] if grid else []  # rotated: drift hits all alike
        for n in order:
            t = forward_ms(n)
            after = forward_ms(1)
            if rep:
                ratios[n].append(t / ((before + after) / 2))
                ones.append(after)
            before = after
    one = statistics.median(ones)
    measured = [1, *grid]
    fitted = dict(zip(measured, (one * r for r in _isotonic([1.0, *(statistics.median(ratios[n]) for n in grid)]))))
    out = []
    for n in range(1, max_tokens + 1):
        if n in fitted:
            v = fitted[n]
        else:  # between two measured sizes
            lo = max(g for g in measured if g < n)
            hi = min(g for g in measured if g > n)
            v = fitted[lo] + (fitted[hi] - fitted[lo]) * (n - lo) / (hi - lo)
        out.append(round(v, 3))
    return out


def decode_as_verify_steps(submit, session_id, prefix_len, delta, max_tokens, params, seed, step,
                           stop_token_ids=frozenset(), gen=None, t0=None, session=None,
                           on_token=None) -> tuple[list[int], int, float]:
    """Target-only decoding as single-token steps, each a VerifyJob of an empty draft given to `submit` (the next
    token is the 'bonus' token), so concurrent sessions decode in one forward pass, alongside other sessions'
    Verify blocks. Same tokens, and the same random stream, as sampling each step's last row directly.
    `session`: the session object every step uses (VerifyJob.session). `on_token(token, cached_len)`: told each
    token as it comes; False stops the decoding (a stream's consumer went away)."""
    t0 = time.perf_counter() if t0 is None else t0
    if gen is None and not params.is_greedy:
        gen = sampling.make_generator(seed, step, "decode")
    out: list[int] = []
    cached = prefix_len
    for _ in range(max_tokens):
        res = submit(VerifyJob(session_id, cached, list(delta), [], None, params, seed, step, generator=gen,
                               session=session))
        out.append(res.next_token)
        cached, delta = res.cached_len, [res.next_token]
        wanted = on_token is None or on_token(res.next_token, cached) is not False
        if res.next_token in stop_token_ids or not wanted:
            break
    return out, cached, (time.perf_counter() - t0) * 1e3


class TargetEngine:
    def __init__(self, loaded: LoadedModel, store: SessionCacheStore | None = None, max_draft_len: int = MAX_DRAFT_LEN,
                 batch_window_ms: float = 0.0, max_batch: int = 16, batch_wait_fraction: float = 0.5):
        self.loaded = loaded
        self.store = store if store is not None else SessionCacheStore()
        self.lm = CachedLM(loaded, self.store)
        self.max_draft_len = max_draft_len
        self.batcher = (VerifyBatcher(self, batch_window_ms, max_batch, wait_fraction=batch_wait_fraction)
                        if batch_window_ms > 0 else None)
        self.forward_ms: list[float] = []  # profile_forward_ms's result, when the service measured it
        self.max_batch = max_batch if self.batcher is not None else 1
        self._prefill_gate = threading.Lock()  # prefills run one at a time (prefill())

    @property
    def vocab_size(self) -> int:
        return self.loaded.vocab_size

    @property
    def max_sessions(self) -> int:
        return self.store.max_sessions

    def profile_forward_ms(self, max_tokens: int, context: int = 32, reps: int = 3) -> list[float]:
        """Milliseconds of one cached forward over n = 1 .. max_tokens new tokens (a verify of n - 1 drafts, or a
        batch's rows together) after `context` tokens: what a longer draft costs the target (measure_profile)."""
        sess = SessionKV("\x00profile")
        vocab = self.loaded.vocab_size
        self.lm.extend(sess, [(7 * i + 1) % vocab for i in range(context)], keep=1)

        def forward_ms(n: int) -> float:
            t0 = time.perf_counter()
            self.lm.extend(sess, [(3 * j + 2) % vocab for j in range(n)], keep=n)
            dt = (time.perf_counter() - t0) * 1e3
            self.lm.crop(sess, context)
            return dt

        return measure_profile(forward_ms, max_tokens, reps)

    def prefill(self, session_id: str, prefix_len: int, delta: list[int]) -> int:
        """One prefill at a time, in arrival order: concurrent prefills share the cores and all finish late (32 at
        once on 2 loaded cores all passed the orchestrator's 30 s deadline, so every session failed); one after
        another, the first are served at once. A prefill whose caller stopped waiting is skipped."""
        return self._prefill_session(self.store.get(session_id), prefix_len, delta)

    def _prefill_session(self, sess: SessionKV, prefix_len: int, delta: list[int]) -> int:
        with self._prefill_gate, sess.lock:
            deadline = call_deadline()
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError("the target was busy: this prefill did not start before the call's deadline")
            if delta or prefix_len < len(sess.tokens):
                new = self.lm.sync(sess, prefix_len, delta)
                self.lm.extend(sess, new, keep=1)
            self.store.update_size(sess)
            return len(sess.tokens)

    def export_kv(self, session_id: str, max_bytes: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The session's cached keys and values, [layers, kv_heads, positions, head_dim] each, as float16 copies
        (the wire's type, converted layer by layer: no full-precision copy of a long prompt's cache): all its
        positions, or the first ones that fit in max_bytes; None when not one fits or the cache is not a plain
        per-layer one."""
        sess = self.store.get(session_id)
        with sess.lock:
            layers = getattr(sess.cache, "layers", None)
            if not sess.tokens or not layers or any(getattr(layer, "keys", None) is None for layer in layers):
                return None
            _, heads, _, dim = layers[0].keys.shape
            n = min(len(sess.tokens), max_bytes // wire.kv_nbytes(len(layers), heads, 1, dim))
            if n < 1:
                return None
            keys = torch.stack([layer.keys[0, :, :n].to(torch.float16) for layer in layers])
            values = torch.stack([layer.values[0, :, :n].to(torch.float16) for layer in layers])
            return keys, values

    def verify(self, session_id: str, prefix_len: int, delta: list[int], draft_tokens: list[int],
               draft_probs: torch.Tensor | None, params: SamplingParams, seed: int, step: int,
               tree_parents: list[int] | None = None) -> VerifyOutcome:
        job = VerifyJob(session_id, prefix_len, delta, list(draft_tokens), draft_probs, params, seed, step,
                        None if tree_parents is None else list(tree_parents))
        if self.batcher is not None:
            return self.batcher.submit(job)
        self.verify_many([job])
        return job.outcome()

    def verify_many(self, jobs: list["VerifyJob"]) -> None:
        """Verify blocks of several sessions with ONE forward pass; each job gets its outcome or its error."""
        trees = [job for job in jobs if job.tree_parents is not None]
        if trees:  # a token tree has its own mask: one forward per tree (see target_service/tree.py)
            from target_service.tree import verify_tree_job

            for job in trees:
                verify_tree_job(self, job)
            jobs = [job for job in jobs if job.tree_parents is None]
            if not jobs:
                return
        seen, first, later = set(), [], []
        for job in jobs:  # two blocks of one session cannot share a forward: the second goes next
            (later if job.session_id in seen else first).append(job)
            seen.add(job.session_id)
        self._verify_batch(first)
        if later:
            self.verify_many(later)

    def _verify_batch(self, jobs: list["VerifyJob"]) -> None:
        t0 = time.perf_counter()
        ready, locked = [], []
        for job in jobs:
            sess = job.session if job.session is not None else self.store.get(job.session_id)
            sess.lock.acquire()
            locked.append((sess, job))
            try:
                new = self.lm.sync(sess, job.prefix_len, job.delta)
                ready.append((sess, job, new, len(sess.tokens) + len(new)))
            except Exception as e:  # noqa: BLE001 - reported to that job's caller only
                job.error = e
        try:
            if ready:
                all_logits = extend_batch(self.lm, [(sess, new + job.draft_tokens) for sess, job, new, _ in ready],
                                          keep=[len(job.draft_tokens) + 1 for _, job, _, _ in ready])
                for (sess, job, new, context_len), logits in zip(ready, all_logits):
                    try:
                        # Row i predicts draft token i; the last row predicts the bonus token.
                        gen = job.generator
                        if gen is None and not job.params.is_greedy:
                            gen = sampling.make_generator(job.seed, job.step, "verify")
                        result = sampling.verify(logits, job.draft_tokens, job.draft_probs, job.params, gen)
                        # Keep KV of the context and the accepted drafts; the next token has no KV yet.
                        self.lm.crop(sess, context_len + result.num_accepted)
                        self.store.update_size(sess)
                        job.result = VerifyOutcome(result.num_accepted, int(result.next_token), len(sess.tokens),
                                                   (time.perf_counter() - t0) * 1e3, len(ready))
                    except Exception as e:  # noqa: BLE001
                        self.lm.crop(sess, context_len)  # drop the unverified drafts
                        job.error = e
        except Exception as e:  # noqa: BLE001 - the forward itself failed: every job in it fails
            for sess, job, _, context_len in ready:
                if job.result is None and job.error is None:
                    job.error = e
                self.lm.crop(sess, min(context_len, len(sess.tokens)))
        finally:
            for sess, _ in locked:
                sess.lock.release()

    def decode(
        self,
        session_id: str,
        prefix_len: int,
        delta: list[int],
        max_tokens: int,
        params: SamplingParams,
        seed: int,
        step: int,
        stop_token_ids: set[int] = frozenset(),
        on_token=None,
    ) -> tuple[list[int], int, float]:
        """Target-only decoding; on_token as decode_as_verify_steps's (the DecodeStream RPC's blocks)."""
        t0 = time.perf_counter()
        gen = None if params.is_greedy else sampling.make_generator(seed, step, "decode")
        # One session object for the whole call, batched steps included: another session's call may evict this one
        # from the store between the prefill and the steps (a full cache), and the steps must still find the
        # prefilled tokens.
        sess = self.store.get(session_id)
        if len(delta) > 1:
            # A prompt (or a resync): prefilled one at a time like a speculative session's (prefill()), not as a
            # long row in a batch every decoding session waits for.
            prefix_len, delta = self._prefill_session(sess, prefix_len, delta[:-1]), delta[-1:]
        if self.batcher is not None:
            return decode_as_verify_steps(self.batcher.submit, sess.session_id, prefix_len, delta, max_tokens, params,
                                          seed, step, stop_token_ids, gen, t0, session=sess, on_token=on_token)
        with sess.lock:
            new = self.lm.sync(sess, prefix_len, delta)
            out: list[int] = []
            for _ in range(max_tokens):
                last = self.lm.extend(sess, new, keep=1)[-1]
                if params.is_greedy:
                    token = int(sampling.greedy_tokens(last))
                else:
                    token = int(sampling.sample(sampling.warp_probs(last, params), gen))
                out.append(token)
                new = [token]
                wanted = on_token is None or on_token(token, len(sess.tokens)) is not False
                if token in stop_token_ids or not wanted:
                    break
            self.store.update_size(sess)
            return out, len(sess.tokens), (time.perf_counter() - t0) * 1e3

    def cache_bytes(self) -> int:
        return self.store.total_bytes()

    def cached_sessions(self) -> int:
        return len(self.store)

    def release(self, session_id: str) -> bool:
        if self.batcher is not None:
            self.batcher.forget(session_id)
        return self.lm.release(session_id)
