"""The llama.cpp engine's units of work and how one engine step is composed (continuous batching, as llama-server's
slots): every session with work in flight contributes its next rows to ONE llama_decode per step.

* a decode stream (target-only decoding, `DecodeWork`) contributes one row per step, its last sampled token, for
  as long as it runs: no call per token, no batching window;
* a verify block (`VerifyWork`) contributes its context delta and its k drafts: k + 1 rows of the budget;
* a prefill (`PrefillWork`), or the long delta of a new or resynced session's first call, is fed in pieces of at
  most SPLIT_SAFE_ROWS rows when it runs alone, of PREFILL_ROWS_PER_STEP while other sessions are decoding, so a
  prompt does not stall the running streams; the prompt's own rows (the work's prompt_rows) go to the prompt
  context in a llama_decode of their own, one session's prompt at a time (llama_prompt.py).

A session's rows in one step never exceed SPLIT_SAFE_ROWS (llama.cpp's per-sequence numerics are then those of
feeding them one by one), so a session's tokens, KV and logits are the same whichever sessions share its steps."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

from specdec.core import sampling
from specdec.core.kv_cache import ContextTooLong
from target_service.engines.jobs import DecodeTask, VerifyJob, VerifyOutcome
from target_service.engines.llama_prompt import prompt_piece

SPLIT_SAFE_ROWS = 512  # see llamacpp.py: a session's rows per llama_decode up to this many are split-invariant

log = logging.getLogger("specdec.target.llamacpp")


def _by_sequence(seq_ids: list[int]) -> list[int]:
    """The order of a batch's groups by sequence id. With per-session KV streams llama.cpp splits a batch into
    ubatches of consecutive, increasing sequence ids only (llama_batch_allocr::split_equal, sequential): 8
    sessions' single rows fed in any other order take up to 8 ubatches, and cost what 8 steps do (9.1x one row on
    the 2-core AMD EPYC against 4.4x in id order)."""
    return sorted(range(len(seq_ids)), key=seq_ids.__getitem__)


def ubatch_count(groups: list[tuple[int, int]]) -> int:
    """The ubatches llama.cpp makes of one llama_decode over per-session KV streams, from its (sequence id, rows)
    groups in batch order (llama_batch_allocr::split_equal, sequential): each takes a run of consecutive,
    increasing ids that still have rows, the same number of rows from each (the fewest any has left)."""
    left = [[seq_id, rows] for seq_id, rows in groups if rows > 0]
    count = 0
    while left:
        run = [left[0]]
        for group in left[1:]:
            if group[0] == run[-1][0] + 1:
                run.append(group)
        take = min(rows for _, rows in run)
        for group in run:
            group[1] -= take
        left = [group for group in left if group[1] > 0]
        count += 1
    return count


def _chunk_bounds(group_sizes: list[int], cap: int) -> list[tuple[int, int]]:
    """[lo, hi) of each llama_decode call for consecutive groups of rows (a session's rows each). llama.cpp's CPU
    numerics depended with a float16 cache on how a long run of a sequence's tokens is split into ubatches (166 fed
    at once, up to 2.8 away from one by one); a session's blocks of up to SPLIT_SAFE_ROWS rows are bitwise the same
    fed whole or one by one (with the q8_0 values, any split up to the batch size). So groups that
    short are packed up to `cap` rows, and a longer group (a prompt, a resync's whole context) gets calls of its
    own of SPLIT_SAFE_ROWS rows: a session's cache is then a function of its tokens alone, whichever calls
    brought them (a context resent after an eviction or a move to another target is rebuilt bit for bit)."""
    bounds: list[tuple[int, int]] = []
    piece = min(cap, SPLIT_SAFE_ROWS)
    lo = pos = 0
    for n in group_sizes:
        alone = n > piece
        if pos > lo and (alone or pos - lo + n > cap):
            bounds.append((lo, pos))
            lo = pos
        if alone:
            bounds += [(pos + a, pos + min(n, a + piece)) for a in range(0, n, piece)]
            lo = pos + n
        pos += n
    if pos > lo:
        bounds.append((lo, pos))
    return bounds


class Work:
    """One session's piece of work in the step loop. The loop admits it (gives it the session's sequence and syncs
    the context: `rows` are then the tokens to feed, the last `n_logits` of them wanted as logits rows), feeds
    `next_piece()` step by step, and hands the final piece's logits to `finish_piece`, which either ends the work
    or refills `rows` (a stream's next token)."""

    def __init__(self, session_id: str, prefix_len: int, delta: list[int], deadline: float | None,
                 prompt_len: int = 0):
        self.session_id, self.prefix_len, self.delta, self.deadline = session_id, prefix_len, list(delta), deadline
        self.prompt_len = prompt_len  # the context's first prompt_len tokens are the session's prompt (0: not said)
        self.seq = None  # the engine's _Sequence once admitted
        self.rows: list[int] = []
        self.prompt_rows = 0  # the first rows of `rows` that the prompt context computes (llama_prompt.py)
        self.n_logits = 0
        self.cancelled = False
        self.started = time.perf_counter()

    def extra_rows(self) -> list[int]:
        """Rows fed after the synced context (a verify's drafts)."""
        return []

    def admit(self, seq, new: list[int]) -> None:
        self.seq, self.rows = seq, new + self.extra_rows()

    def next_piece(self, limit: int = SPLIT_SAFE_ROWS) -> tuple[list[int], int] | None:
        """(tokens to feed this step, logits rows wanted at their end): at most min(limit, SPLIT_SAFE_ROWS) rows, any
        split of which gives the same KV and logits; the final piece holds every wanted row. None: no piece fits."""
        limit = min(limit, SPLIT_SAFE_ROWS)
        if len(self.rows) <= limit:
            return self.rows, self.n_logits
        if limit < max(1, self.n_logits):
            return None  # the rows left after this piece must still hold the wanted ones
        return self.rows[: len(self.rows) - limit * ((len(self.rows) - 1) // limit)], 0

    def fed(self, n: int) -> None:
        del self.rows[:n]

    def finish_piece(self, engine, logits) -> bool:
        """The final piece's logits rows (float32 [n_logits, vocab]); True when the work is done."""
        raise NotImplementedError

    def fail(self, error: BaseException) -> None:
        raise NotImplementedError

    @property
    def done(self) -> bool:
        raise NotImplementedError


class PrefillWork(Work):
    """Append the delta to the session's cache; the result is the cached length."""

    def __init__(self, session_id, prefix_len, delta, deadline, prompt_len: int = 0):
        super().__init__(session_id, prefix_len, delta, deadline, prompt_len)
        self.event = threading.Event()
        self.cached_len = 0
        self.error: BaseException | None = None

    def finish_piece(self, engine, logits) -> bool:
        self.cached_len = len(self.seq.tokens)
        self.event.set()
        return True

    def fail(self, error):
        self.error = error
        self.event.set()

    @property
    def done(self):
        return self.event.is_set()

    def result(self, timeout: float | None) -> int:
        if not self.event.wait(timeout):
            self.cancelled = True
            raise TimeoutError("the target was busy: this prefill did not finish before the call's deadline")
        if self.error is not None:
            raise self.error
        return self.cached_len


class VerifyWork(Work):
    """A chain draft block: its k + 1 rows judged by specdec.core.sampling.verify; rejected positions leave the
    cache. The outcome goes to the VerifyJob."""

    def __init__(self, job: VerifyJob):
        super().__init__(job.task.session_id, job.task.prefix_len, job.task.delta, job.deadline, job.task.prompt_len)
        self.job = job
        self.n_logits = len(job.task.draft_tokens) + 1
        self.context_len = 0

    def extra_rows(self):
        return list(self.job.task.draft_tokens)

    def admit(self, seq, new):
        super().admit(seq, new)
        self.context_len = len(seq.tokens) + len(new)

    def finish_piece(self, engine, logits) -> bool:
        job, seq = self.job, self.seq
        task = job.task
        try:
            gen = job.generator
            if gen is None and not task.params.is_greedy:
                gen = sampling.make_generator(task.seed, task.step, "verify")
            rows = logits if task.params.is_greedy else _torch_rows(logits)
            result = sampling.verify(rows, task.draft_tokens, task.draft_probs, task.params, gen)
            engine._crop(seq, self.context_len + result.num_accepted)  # the next token has no KV yet
            job.result = VerifyOutcome(result.num_accepted, int(result.next_token), len(seq.tokens),
                                       (time.perf_counter() - self.started) * 1e3, engine.last_step_sessions)
        except Exception as e:  # noqa: BLE001 - reported to this job's caller
            engine._crop(seq, min(self.context_len, len(seq.tokens)))  # drop the unverified drafts
            job.error = e
        job.done.set()
        return True

    def fail(self, error):
        self.job.error = error
        self.job.done.set()

    @property
    def done(self):
        return self.job.done.is_set()


def _torch_rows(logits):
    import torch

    return torch.from_numpy(logits)


@dataclass
class Block:
    """What a decode stream has produced since its consumer last took a block."""
    tokens: list[int]
    cached_len: int
    decode_ms: float
    finished: bool


class DecodeWork(Work):
    """Target-only decoding of up to max_tokens tokens, one row a step, until a stop token, max_tokens, a cancel or
    an error. The tokens are those of single-token verify steps (an empty draft's 'bonus' token) with one random
    stream for the whole call, so they equal the unary Decode's and the speculative path's. A consumer takes them in
    blocks (take()) while the engine goes on decoding."""

    def __init__(self, task: DecodeTask, deadline: float | None):
        super().__init__(task.session_id, task.prefix_len, task.delta, deadline, task.prompt_len)
        self.n_logits, self.max_tokens, self.params = 1, task.max_tokens, task.params
        self.stop_token_ids = task.stop_token_ids
        self.gen = None if task.params.is_greedy else sampling.make_generator(task.seed, task.step, "decode")
        self.produced: list[int] = []  # every token so far
        self.taken = 0  # tokens handed to the consumer
        self.cached_len = task.prefix_len
        self.error: BaseException | None = None
        self.finished = False
        self.last_token_at = self.last_take_at = time.perf_counter()
        self.want = 1  # tokens the consumer waits for (it is woken when that many are ready, or at the end)
        self.cond = threading.Condition()

    def finish_piece(self, engine, logits) -> bool:
        if self.params.is_greedy:
            token = int(logits[-1].argmax())  # the empty draft's bonus row: sampling.verify's greedy choice
        else:
            token = int(sampling.verify(_torch_rows(logits), [], None, self.params, self.gen).next_token)
        finished = self.push(token, len(self.seq.tokens))  # the new token has no KV yet
        if not finished:
            self.rows = [token]
        return finished

    def push(self, token: int, cached_len: int) -> bool:
        """Add a produced token; True when it ends the stream (a stop token or max_tokens)."""
        finished = token in self.stop_token_ids or len(self.produced) + 1 >= self.max_tokens
        with self.cond:
            self.produced.append(token)
            self.cached_len = cached_len
            self.last_token_at = time.perf_counter()
            self.finished = finished
            if finished or len(self.produced) - self.taken >= self.want:
                self.cond.notify_all()
        return finished

    def fail(self, error):
        with self.cond:
            self.error, self.finished = error, True
            self.cond.notify_all()

    def cancel(self) -> None:
        """The consumer stopped listening: the loop drops the work at its next step (the session keeps what was fed)."""
        self.cancelled = True

    @property
    def done(self):
        return self.finished

    def take(self, min_tokens: int, timeout: float | None) -> Block:
        """Wait until min_tokens new tokens are ready (or the work ended) and take all that are; raises the work's
        error once its tokens before it are taken, TimeoutError after `timeout` seconds without them."""
        end = None if timeout is None else time.monotonic() + timeout
        with self.cond:
            self.want = max(1, min_tokens)
            while not self.finished and len(self.produced) - self.taken < self.want:
                left = None if end is None else end - time.monotonic()
                if left is not None and left <= 0:
                    if len(self.produced) > self.taken:
                        break  # fewer than asked: what there is
                    raise TimeoutError("the target produced no tokens before the call's deadline")
                self.cond.wait(left)
            tokens = self.produced[self.taken:]
            if not tokens and self.error is not None:
                raise self.error
            self.taken = len(self.produced)
            ms = max(0.0, (self.last_token_at - self.last_take_at) * 1e3)
            self.last_take_at = time.perf_counter()
            return Block(tokens, self.cached_len, ms, self.finished and self.error is None)


@dataclass
class CallWork:
    """A function run on the loop thread between steps (a tree verify, the profile, a test's raw llama_decode)."""
    fn: object
    args: tuple
    result: object = None
    error: BaseException | None = None
    event: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        try:
            self.result = self.fn(*self.args)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            self.error = e
        self.event.set()

    def wait(self):
        self.event.wait()
        if self.error is not None:
            raise self.error
        return self.result


class StepLoop:
    """The step loop of target_service.engines.llamacpp.LlamaCppEngine (which provides the sessions' sequences,
    _sync, _decode, _crop and the queues): one thread, one llama_decode per step over every session's next rows."""

    PREFILL_ROWS_PER_STEP = 96  # prompt rows a step takes while other sessions generate (alone: SPLIT_SAFE_ROWS)

    def _step_loop(self) -> None:
        self._compute_ident = threading.get_ident()
        while True:
            with self._work_cond:
                while not self._works and not self._calls and not self._closing:
                    self._work_cond.wait()
                calls, self._calls = self._calls, []
                works = list(self._works)
                closing = self._closing
            if closing:
                error = RuntimeError("the llama.cpp engine closed")
                for call in calls:
                    call.error = error
                    call.event.set()
                for work in works:
                    work.fail(error)
                return
            for call in calls:
                call.run()
            if works:
                self._step(works)

    def step_counts(self) -> list[tuple[int, dict]]:
        """The step loop's llama_decode steps, the rows they fed and the ubatches llama.cpp made of them, since
        start (a gauge: rows per ubatch is what batching gets)."""
        return [(self.steps, {"count": "steps"}), (self.step_rows, {"count": "rows"}),
                (self.step_ubatches, {"count": "ubatches"})]

    def _step(self, works: list[Work]) -> None:
        """One engine step: admit new works, compose the batch, one llama_decode, hand each work its rows."""
        try:
            with self._lock:
                chosen, prompt = self._compose(works, time.monotonic())
                if prompt:
                    self._run_prompt_piece(*prompt)
                if chosen:
                    self._run_step(chosen)
                for work in works:
                    if work.cancelled and not work.done:
                        work.fail(TimeoutError("the call ended before its work was done"))
                    if work.done and work.seq is not None:
                        self._busy.discard(work.session_id)
                        work.seq = None
                if self._prompt_owner is not None and self._prompt_owner.done:
                    self._prompt_release()  # a cancelled prompt's rows fed so far stay valid
        except BaseException as e:  # noqa: BLE001 - a bug here must fail the works, not the loop
            log.exception("llama.cpp engine step failed")
            self._prompt_reset()
            for work in works:
                if not work.done:
                    work.fail(e)
                if work.seq is not None:
                    self._busy.discard(work.session_id)
                    work.seq = None
        with self._work_cond:
            self._works = [w for w in self._works if not w.done]

    def _admit(self, work: Work, now: float) -> bool:
        """Give the work its session's sequence and sync its context; False (the work failed or ended) otherwise."""
        if work.deadline is not None and now >= work.deadline:
            work.fail(TimeoutError("the target was busy: this call's deadline passed before its turn"))
            return False
        try:
            seq = self._sequence(work.session_id, keep=self._busy)
            if isinstance(work, PrefillWork) and not work.delta and work.prefix_len == len(seq.tokens):
                work.seq = seq
                work.finish_piece(self, None)  # nothing to feed
                return False
            new = self._sync(seq, work.prefix_len, work.delta)
            new, prompt_rows = self._prompt_rows(seq, new, work.prompt_len, work.n_logits > 0)
        except Exception as e:  # noqa: BLE001 - reported to this work's caller only
            work.fail(e)
            return False
        work.admit(seq, new)
        work.prompt_rows = prompt_rows
        self._busy.add(work.session_id)
        return True

    def _compose(self, works: list[Work], now: float):
        """The step's batch, (work, tokens, logits rows wanted) each, and its prompt-context piece, (work, rows) or
        None. Each session's earliest unfinished work; first the pieces that end in logits (streams' tokens, verify
        blocks) within the token budget, then prompt pieces, fewer of them while others generate. Sessions beyond
        step_sessions, in a rotating order, wait a step. A work whose first rows are the prompt context's
        (llama_prompt.py) feeds those there first, one session's prompt at a time."""
        ready, seen = [], set()
        for work in works:
            if work.done or work.session_id in seen:
                continue
            seen.add(work.session_id)
            if work.cancelled or (work.seq is None and not self._admit(work, now)):
                continue
            ready.append(work)
        prompting = [w for w in ready if w.prompt_rows]
        ready = [w for w in ready if not w.prompt_rows]
        prompt = None
        if prompting:
            owner = next((w for w in prompting if w is self._prompt_owner), prompting[0])
            if owner is not self._prompt_owner:
                self._prompt_claim(owner)  # may find some or all of its rows in a kept prompt
            limit = self.batch_tokens if not ready and len(prompting) == 1 else self.PREFILL_ROWS_PER_STEP
            rows = prompt_piece(owner.prompt_rows, limit, self.batch_tokens) if owner.prompt_rows else 0
            prompt = (owner, rows)
        return self._compose_main(ready), prompt

    def _compose_main(self, ready: list[Work]) -> list[tuple[Work, list[int], int]]:
        """The main context's batch of the ready works (see _compose)."""
        if not ready:
            return []
        k = self.steps % len(ready)
        ready = ready[k:] + ready[:k]
        chosen, budget = [], self.batch_tokens
        cap = budget if len(ready) == 1 else self.PREFILL_ROWS_PER_STEP  # a session's rows while others generate
        for final_pass in (True, False):
            prompt_budget = budget if not chosen else min(budget, cap)
            for work in ready:
                if len(chosen) >= self.step_sessions:
                    break
                if any(work is taken for taken, _, _ in chosen):
                    continue
                next_piece = work.next_piece(min(cap, budget if final_pass else prompt_budget))
                if next_piece is None:
                    continue
                piece, n_logits = next_piece
                final = len(piece) == len(work.rows)
                if final != final_pass or len(piece) > (budget if final else prompt_budget):
                    continue
                if len(work.seq.tokens) + len(piece) > self.loaded.max_context:
                    work.fail(ContextTooLong(f"context of {len(work.seq.tokens) + len(piece)} tokens exceeds the "
                                             f"limit of {self.loaded.max_context}"))
                    continue
                chosen.append((work, piece, n_logits if final else 0))
                budget -= len(piece)
                if not final:
                    prompt_budget -= len(piece)
        return chosen

    def _run_prompt_piece(self, work: Work, n: int) -> None:
        """Feed the work's next n prompt rows to the prompt context (the work holds it: _compose claimed it); after
        its last, move them to the session's sequence (a Prefill with nothing after the prompt then ends)."""
        piece = work.rows[:n]
        try:
            if piece:
                self._decode_prompt(piece, len(self._prompt_tokens))
                self._prompt_tokens.extend(piece)
                self.prompt_context_rows += n
                work.fed(n)
                work.prompt_rows -= n
            if work.prompt_rows:
                return
            self._move_prompt(work.seq.seq_id)
            work.seq.tokens.extend(self._prompt_tokens)
        except Exception as e:  # noqa: BLE001 - the forward failed: this work fails, its slot is emptied
            self._prompt_reset()
            work.fail(e)
            return
        finally:
            if not work.prompt_rows or work.done:
                self._prompt_release()
        if not work.rows:
            try:
                work.finish_piece(self, None)
            except Exception as e:  # noqa: BLE001 - reported to this work's caller
                work.fail(e)

    def _run_step(self, chosen: list[tuple[Work, list[int], int]]) -> None:
        chosen = [chosen[i] for i in _by_sequence([work.seq.seq_id for work, _, _ in chosen])]
        entries, rollback = [], []
        for work, piece, n_logits in chosen:
            start = len(work.seq.tokens)
            entries += [((work.seq.seq_id,), t, start + i, i >= len(piece) - n_logits) for i, t in enumerate(piece)]
            rollback.append((work.seq.seq_id, start))
        try:
            self._make_room(len(entries), keep=self._busy)
            logits = self._decode(entries, rollback, [len(piece) for _, piece, _ in chosen])
        except Exception as e:  # noqa: BLE001 - the forward failed: every work in it fails
            for work, _, _ in chosen:
                work.fail(e)
            return
        self.steps += 1
        self.step_works += len(chosen)
        self.step_rows += len(entries)
        self.step_ubatches += (1 if self.kv_unified else
                               ubatch_count([(work.seq.seq_id, len(piece)) for work, piece, _ in chosen]))
        self.last_step_sessions = len(chosen)
        at = 0
        for work, piece, n_logits in chosen:
            work.seq.tokens.extend(piece)
            work.fed(len(piece))
            if work.rows and not n_logits:
                continue  # a prompt piece: more to feed
            rows, at = logits[at:at + n_logits], at + n_logits
            try:
                work.finish_piece(self, rows)
            except Exception as e:  # noqa: BLE001 - reported to this work's caller
                work.fail(e)
