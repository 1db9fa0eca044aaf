"""The target model's work: prefill, verify a draft block in one forward pass, and target-only decoding."""

from __future__ import annotations

import threading
import time

import torch

from specdec.core import sampling, wire
from specdec.core.grpc_util import call_deadline
from specdec.core.kv_cache import CachedLM, SessionCacheStore, SessionKV, extend_batch
from specdec.core.settings import MAX_DRAFT_LEN
from specdec.models import LoadedModel
from target_service.engines.batching import VerifyBatcher, decode_as_verify_steps
from target_service.engines.jobs import DecodeTask, VerifyJob, VerifyOutcome, VerifyTask
from target_service.engines.profile import measure_profile


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

    def prefill(self, session_id: str, prefix_len: int, delta: list[int], prompt_len: int = 0) -> int:
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

    def verify(self, task: VerifyTask) -> VerifyOutcome:
        job = task.job()
        if self.batcher is not None:
            return self.batcher.submit(job)
        self.verify_many([job])
        return job.outcome()

    def verify_many(self, jobs: list["VerifyJob"]) -> None:
        """Verify blocks of several sessions with ONE forward pass; each job gets its outcome or its error."""
        trees = [job for job in jobs if job.task.tree_parents is not None]
        if trees:  # a token tree has its own mask: one forward per tree (see target_service/engines/torch_tree.py)
            from target_service.engines.torch_tree import verify_tree_job

            for job in trees:
                verify_tree_job(self, job)
            jobs = [job for job in jobs if job.task.tree_parents is None]
            if not jobs:
                return
        seen, first, later = set(), [], []
        for job in jobs:  # two blocks of one session cannot share a forward: the second goes next
            (later if job.task.session_id in seen else first).append(job)
            seen.add(job.task.session_id)
        self._verify_batch(first)
        if later:
            self.verify_many(later)

    def _verify_batch(self, jobs: list["VerifyJob"]) -> None:
        t0 = time.perf_counter()
        ready, locked = [], []
        for job in jobs:
            sess = job.session if job.session is not None else self.store.get(job.task.session_id)
            sess.lock.acquire()
            locked.append((sess, job))
            try:
                new = self.lm.sync(sess, job.task.prefix_len, job.task.delta)
                ready.append((sess, job, new, len(sess.tokens) + len(new)))
            except Exception as e:  # noqa: BLE001 - reported to that job's caller only
                job.error = e
        try:
            if ready:
                all_logits = extend_batch(self.lm, [(sess, new + job.task.draft_tokens) for sess, job, new, _ in ready],
                                          keep=[len(job.task.draft_tokens) + 1 for _, job, _, _ in ready])
                for (sess, job, new, context_len), logits in zip(ready, all_logits):
                    try:
                        # Row i predicts draft token i; the last row predicts the bonus token.
                        task, gen = job.task, job.generator
                        if gen is None and not task.params.is_greedy:
                            gen = sampling.make_generator(task.seed, task.step, "verify")
                        result = sampling.verify(logits, task.draft_tokens, task.draft_probs, task.params, gen)
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

    def decode(self, task: DecodeTask, on_token=None) -> tuple[list[int], int, float]:
        """Target-only decoding; on_token as decode_as_verify_steps's (the DecodeStream RPC's blocks)."""
        t0 = time.perf_counter()
        params = task.params
        gen = None if params.is_greedy else sampling.make_generator(task.seed, task.step, "decode")
        # One session object for the whole call, batched steps included: another session's call may evict this one
        # from the store between the prefill and the steps (a full cache), and the steps must still find the
        # prefilled tokens.
        sess = self.store.get(task.session_id)
        if len(task.delta) > 1:
            # A prompt (or a resync): prefilled one at a time like a speculative session's (prefill()), not as a
            # long row in a batch every decoding session waits for.
            task = task.moved(self._prefill_session(sess, task.prefix_len, task.delta[:-1]), task.delta[-1:])
        if self.batcher is not None:
            return decode_as_verify_steps(self.batcher.submit, task, gen, t0, session=sess, on_token=on_token)
        with sess.lock:
            new = self.lm.sync(sess, task.prefix_len, task.delta)
            out: list[int] = []
            for _ in range(task.max_tokens):
                last = self.lm.extend(sess, new, keep=1)[-1]
                if params.is_greedy:
                    token = int(sampling.greedy_tokens(last))
                else:
                    token = int(sampling.sample(sampling.warp_probs(last, params), gen))
                out.append(token)
                new = [token]
                wanted = on_token is None or on_token(token, len(sess.tokens)) is not False
                if token in task.stop_token_ids or not wanted:
                    break
            self.store.update_size(sess)
            return out, len(sess.tokens), (time.perf_counter() - t0) * 1e3

    def cache_bytes(self) -> int:
        return self.store.total_bytes()

    def cached_sessions(self) -> int:
        return len(self.store)

    def forget_prompts(self) -> int:
        return 0  # no prompt is kept beyond its session's cache

    def release(self, session_id: str) -> bool:
        if self.batcher is not None:
            self.batcher.forget(session_id)
        return self.lm.release(session_id)
