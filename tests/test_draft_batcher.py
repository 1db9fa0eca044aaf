"""Batched draft steps: several sessions' rows through one int8 forward (draft_service/draft_batcher.py), the
same logits and tokens as each session on its own."""

import contextlib
import threading
import time

import pytest
import torch

from draft_service.proposers.base import ProposeTask
from draft_service.draft_batcher import DraftStepBatcher
from draft_service.int8_draft import LeanCachedLM, int8_draft
from draft_service.proposers.model import ModelProposer
from specdec.core.kv_cache import SessionCacheStore, SessionKV
from specdec.models import load_model
from specdec.core.sampling import SamplingParams

GQA = "tiny:vocab=96,layers=2,hidden=64,heads=4,kv_heads=2,seed=3,std=0.3"
GREEDY = SamplingParams(0.0, 0, 1.0)


def _lean(batch_rows: int = 0) -> LeanCachedLM:
    loaded = load_model(GQA, device="cpu", dtype="float32", prepack="off")
    lm = int8_draft(loaded, SessionCacheStore(), batch_rows=batch_rows)
    assert isinstance(lm, LeanCachedLM) and lm.lean.native is not None  # the native stack is built here
    return lm


def _tokens(n: int, seed: int) -> list[int]:
    return [int(t) for t in torch.randint(0, 96, (n,), generator=torch.Generator().manual_seed(seed))]


def test_one_forward_over_several_sessions_matches_each_session_alone():
    lm = _lean()
    lean = lm.lean
    prompts = [_tokens(n, seed) for seed, n in enumerate((5, 17, 1, 30))]
    alone, batched = [lean.new_cache() for _ in prompts], [lean.new_cache() for _ in prompts]
    for p, a, b in zip(prompts, alone, batched):  # different context lengths
        lean(p, a, 1)
        lean(p, b, 1)
    feeds = [[7], [8, 9, 10], [11], [12, 13]]  # decode steps and blocks, mixed
    want = [lean(f, c, len(f)) for f, c in zip(feeds, alone)]
    got = lean.forward_rows([(f, c, len(f)) for f, c in zip(feeds, batched)])
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
    assert [c.length for c in batched] == [c.length for c in alone]
    for a, b in zip(alone, batched):  # the keys and values went to each session's own buffer
        torch.testing.assert_close(b.keys[:, :, : b.length], a.keys[:, :, : a.length], atol=1e-5, rtol=1e-5)
    # keep: only the last rows of each feed reach the head
    got = lean.forward_rows([([1, 2, 3], batched[0], 1), ([4], batched[1], 1)])
    assert [g.shape[0] for g in got] == [1, 1]
    with pytest.raises(ValueError, match="once"):
        lean.forward_rows([([1], batched[0], 1), ([2], batched[0], 1)])


def test_a_prefill_fed_in_chunks_gives_the_same_logits():
    whole, chunked = _lean(), _lean(batch_rows=8)  # chunks of 4 rows: room for others' steps beside them
    prompt = _tokens(19, 5)
    a, b = SessionKV("a"), SessionKV("b")
    torch.testing.assert_close(chunked.extend(b, prompt, keep=2), whole.extend(a, prompt, keep=2),
                               atol=1e-5, rtol=1e-5)
    assert b.cache.length == a.cache.length == 19 and b.tokens == a.tokens
    assert chunked.batcher.stats.forwards == 5  # 4 + 4 + 4 + 4 + 3 rows


def test_concurrent_proposals_share_forwards_and_draft_the_same_tokens():
    prompts = [_tokens(8 + 3 * i, 10 + i) for i in range(6)]

    def propose_all(proposer, parallel: bool) -> dict[str, list[int]]:
        out = {}

        def one(i):
            sid = f"s{i}"
            first = proposer.get_candidates(ProposeTask(sid, 0, prompts[i], 6, GREEDY, 0, 0))
            second = proposer.get_candidates(ProposeTask(sid, first.cached_len, first.tokens[-1:], 6, GREEDY, 0, 1))
            out[sid] = first.tokens + second.tokens

        if parallel:
            # The six sessions are in flight together, as the orchestrator's are: each one's steps are awaited by
            # the batch leader from the start. Without that a tiny model's whole proposal can fit in one thread's
            # GIL slice, and on a loaded machine (CI) the threads ran one after the other: no forward to share.
            with contextlib.ExitStack() as in_flight:
                for i in range(len(prompts)):
                    in_flight.enter_context(proposer.lm.batcher.member(f"s{i}"))
                threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join(60)
        else:
            for i in range(len(prompts)):
                one(i)
        return out

    alone = _lean()
    lm = _lean(batch_rows=32)
    want = propose_all(ModelProposer(alone.loaded, alone.store, alone), parallel=False)
    got = propose_all(ModelProposer(lm.loaded, lm.store, lm), parallel=True)
    assert got == want and all(len(t) == 12 for t in got.values())
    stats = lm.batcher.stats
    # per session and block: its intake (prompt / last token), then 5 drafts; the three prompts longer than a
    # 16-row chunk (half of batch_rows) go in two steps
    assert stats.steps == 6 * 12 + 3
    assert max(stats.by_size) >= 2 and stats.forwards < stats.steps  # steps met in forwards


class _Recorder:
    def __init__(self, delay_s: float = 0.0, fail: bool = False):
        self.batches: list[list[str]] = []
        self.delay_s, self.fail = delay_s, fail

    def __call__(self, feeds):
        self.batches.append([f for f in feeds])
        time.sleep(self.delay_s)
        if self.fail:
            raise RuntimeError("forward failed")
        return [torch.full((1, 2), float(len(f))) for f in feeds]


def test_a_lone_session_does_not_wait_and_members_are_waited_for():
    rec = _Recorder()
    batcher = DraftStepBatcher(rec, max_rows=8, wait_ms=2000)
    t0 = time.monotonic()
    batcher.run("a", "a", 1)
    assert time.monotonic() - t0 < 1.0  # nobody else is proposing: no wait

    results = {}
    both_in = threading.Barrier(2)

    def member(sid, delay):
        with batcher.member(sid):
            both_in.wait(10)
            time.sleep(delay)
            results[sid] = batcher.run(sid, sid, 1)

    threads = [threading.Thread(target=member, args=(sid, d)) for sid, d in (("x", 0.0), ("y", 0.2))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert sorted(rec.batches[-1]) == ["x", "y"]  # x's leader waited for y, a member that was about to step
    assert set(results) == {"x", "y"}


def test_a_member_that_leaves_releases_the_leader_and_a_failed_forward_fails_every_step():
    rec = _Recorder(fail=True)
    batcher = DraftStepBatcher(rec, max_rows=8, wait_ms=5000)
    done = threading.Event()

    def idle_member():
        with batcher.member("idle"):
            done.wait(10)

    t = threading.Thread(target=idle_member)
    t.start()
    time.sleep(0.05)
    t0 = time.monotonic()
    threading.Timer(0.2, done.set).start()
    with pytest.raises(RuntimeError, match="forward failed"):
        batcher.run("a", "a", 1)
    assert 0.1 < time.monotonic() - t0 < 4.0  # waited for the member until it left, not the whole window
    t.join(10)


def test_rows_per_forward_are_bounded():
    rec = _Recorder(delay_s=0.05)
    batcher = DraftStepBatcher(rec, max_rows=4, wait_ms=0)
    threads = [threading.Thread(target=batcher.run, args=(f"s{i}", "abc", 3)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert all(len(b) * 3 <= 4 for b in rec.batches)  # one 3-row step per forward
    assert batcher.stats.rows == 12 and batcher.stats.forwards == 4
