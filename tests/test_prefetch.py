"""Pipelining's prefetched blocks are waited for at the start of the next step (the block's Redis commit and
streaming overlap the draft's remaining work), and cancelled when the generation ends first."""

from __future__ import annotations

import types

from orchestrator.generation import Generation


class FakeFuture:
    def __init__(self, reply=None):
        self.reply = reply
        self.cancelled = False

    def done(self):
        return True

    def result(self):
        return self.reply

    def cancel(self):
        self.cancelled = True
        return True


def _gen(pending):
    rec = types.SimpleNamespace(committed=[1, 2, 3, 4, 5], stats={"prefetch_wait_ms": 0.0, "draft_ms": 0.0})
    return types.SimpleNamespace(rec=rec, pending_prefetch=pending, prefetched=None, prefetched_for=None,
                                 step_draft_ms=0.0, vocab_size=100,
                                 params=types.SimpleNamespace(is_greedy=True))


def test_the_next_step_takes_a_prefetch_that_guessed_the_bonus_token():
    replica = types.SimpleNamespace(address="draft:1")
    reply = types.SimpleNamespace(tokens=[9, 10, 11], probs=[], token_scores=[], cached_len=7, draft_ms=3.0)
    # The verified block [4, 9] was accepted whole (3 = committed length before it); the prefetch starts with 9.
    gen = _gen((FakeFuture(reply), replica, [4, 9], 3, True))
    Generation._resolve_prefetch(gen)
    assert gen.pending_prefetch is None
    assert gen.prefetched.tokens == [10, 11] and gen.prefetched_for == (5, "draft:1")
    assert gen.rec.stats["draft_ms"] == 3.0

    for guess, full in ((8, True), (9, False)):  # a wrong bonus guess, or a block not accepted whole: dropped
        gen = _gen((FakeFuture(types.SimpleNamespace(**{**vars(reply), "tokens": [guess, 10]})), replica, [4, 9], 3,
                    full))
        Generation._resolve_prefetch(gen)
        assert gen.prefetched is None and gen.pending_prefetch is None


def test_a_prefetch_still_pending_when_the_generation_ends_is_cancelled():
    for close_early in (False, True):
        future = FakeFuture()
        gen = _gen((future, None, [4], 4, True))
        gen._run = lambda store: iter(["chunk 1", "chunk 2"])
        gen._drop_pending_prefetch = lambda: Generation._drop_pending_prefetch(gen)
        stream = Generation.run(gen, store=None)
        if close_early:  # the client went away after the first chunk
            assert next(stream) == "chunk 1"
            stream.close()
        else:
            assert list(stream) == ["chunk 1", "chunk 2"]
        assert future.cancelled and gen.pending_prefetch is None
