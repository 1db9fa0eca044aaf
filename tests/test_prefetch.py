"""Pipelining's prefetched blocks are waited for at the start of the next step (the block's bookkeeping and its
handoff to the stream overlap the draft's remaining work), and cancelled when the generation ends first."""

from __future__ import annotations

import types

import grpc

from orchestrator.loop.prefetch import PendingPrefetch, Prefetcher
from orchestrator.store.session_store import SessionRecord
from tests.harness import loop_state


class FakeFuture:
    def __init__(self, reply=None):
        self.reply = reply
        self.cancelled = False

    def done(self):
        return True

    def result(self, timeout=None):
        return self.reply

    def cancel(self):
        self.cancelled = True
        return True


def _pending(future, replica, verified, committed_len, full):
    return PendingPrefetch(future, replica, 5, verified, committed_len, full)


def _gen(pending):
    """A Prefetcher of a session with 5 committed tokens, greedy, whose draft deadline is 0.1 s."""
    state = loop_state(SessionRecord("s", [1, 2, 3], {}, generated=[4, 5]), vocab_size=100)
    gen = Prefetcher(state, types.SimpleNamespace(timeout_s=lambda k: 0.1))
    gen.pending = None if pending is None else _pending(*pending)
    gen.rec, gen.draft_cost = state.rec, state.measured.draft_cost
    return gen


def test_the_next_step_takes_a_prefetch_that_guessed_the_bonus_token():
    replica = types.SimpleNamespace(address="draft:1")
    reply = types.SimpleNamespace(tokens=[9, 10, 11], probs=[], token_scores=[], cached_len=7, draft_ms=3.0)
    # The verified block [4, 9] was accepted whole (3 = committed length before it); the prefetch starts with 9.
    gen = _gen((FakeFuture(reply), replica, [4, 9], 3, True))
    gen.resolve()
    assert gen.pending is None
    assert gen.prefetched.tokens == [10, 11] and gen.prefetched_for == (5, "draft:1")
    assert gen.rec.stats.draft_ms == 3.0

    for guess, full in ((8, True), (9, False)):  # a wrong bonus guess, or a block not accepted whole: dropped
        gen = _gen((FakeFuture(types.SimpleNamespace(**{**vars(reply), "tokens": [guess, 10]})), replica, [4, 9], 3,
                    full))
        gen.resolve()
        assert gen.prefetched is None and gen.pending is None


class _Store:
    def __init__(self):
        self.commits = []

    def commit(self, rec, kept, lease=""):
        self.commits.append(list(kept))
        return False


def _streaming_gen(pending, blocks):
    """A stream whose steps are `blocks` (each committed as it is), with `pending` as its prefetch."""
    from orchestrator.loop import Chunk
    from orchestrator.loop.stream import Stream

    state = loop_state(SessionRecord("s", [1, 2], {}, stats={"store_ms": 0.0, "store_overlapped_ms": 0.0}))
    prefetcher = Prefetcher(state, draft=None)
    prefetcher.pending = _pending(*pending)
    closed_streams = []
    target = types.SimpleNamespace(close_stream=lambda: closed_streams.append(True))
    gen = Stream(state, types.SimpleNamespace(prefetch=prefetcher, target=target), text=None)
    gen.closed_streams = closed_streams
    gen.rec, gen.prefetcher = state.rec, prefetcher

    def steps(stop):
        for i, block in enumerate(blocks):
            gen.rec.generated.extend(block)
            gen.rec.step += 1
            if i == len(blocks) - 1:
                gen.rec.status = "finished"
            yield Chunk(block, "", i), block

    gen.steps = steps
    return gen


def test_a_prefetch_still_pending_when_the_generation_ends_is_cancelled():
    for close_early in (False, True):
        future, store = FakeFuture(), _Store()
        gen = _streaming_gen((future, None, [4], 4, True), [[7], [8]])
        stream = gen.run(store=store)
        if close_early:  # the client went away after the first chunk
            assert next(stream).tokens == [7]
            stream.close()
            assert gen.rec.generated == [7] and gen.rec.step == 1  # as stored: the rest was neither stored nor sent
        else:
            assert [c.tokens for c in stream] == [[7], [8]]
            assert store.commits == [[7], [8]] and gen.rec.status == "finished"
        assert future.cancelled and gen.prefetcher.pending is None


def test_a_prefetched_block_measures_the_drafts_time_per_token():
    """With every block prefetched no Propose is measured; the draft deadline still needs a per-token time."""
    reply = types.SimpleNamespace(tokens=[9, 10, 11, 12], probs=[], token_scores=[], cached_len=7, draft_ms=8.0)
    gen = _gen((FakeFuture(reply), types.SimpleNamespace(address="draft:1"), [4, 9], 3, True))
    assert gen.draft_cost.deadline_per_token() is None
    assert gen.resolve() is False
    assert gen.draft_cost.deadline_per_token() == 2.0 and gen.draft_cost.deadline_per_token(sessions=2) == 4.0
    # not the cost a draft length weighs (drafted alongside a verify): Propose calls measure that
    assert gen.draft_cost.token_ms.value is None
    gen.draft_cost.observe(wall_ms=5.0, draft_ms=3.0, tokens=3)
    assert gen.draft_cost.deadline_per_token() == 1.0


class LateFuture(FakeFuture):
    """A prefetch still running when the next step starts (a draft that turned slow)."""

    def __init__(self):
        super().__init__()
        self.waited = None

    def done(self):
        return False

    def result(self, timeout=None):
        self.waited = timeout
        raise grpc.FutureTimeoutError()


def test_a_late_prefetch_is_waited_for_one_draft_deadline_then_cancelled_as_a_draft_failure():
    future, failed = LateFuture(), []
    gen = _gen((future, types.SimpleNamespace(address="draft:1"), [4, 9], 3, True))
    gen.draft.failed = lambda replica, kind, detail: failed.append(kind)
    assert gen.resolve() is True  # the step then decodes target-only
    assert future.waited == 0.1 and future.cancelled
    assert failed == ["prefetch_deadline_exceeded"] and gen.prefetched is None
