"""Batched verification: blocks of concurrent sessions verified in one forward pass give the same results."""

import threading

import pytest

import torch

from specdec.core.kv_cache import CachedLM, SessionCacheStore, extend_batch
from tests.harness import DRAFT_EARLY, TARGET, model, start_stack
from target_service.engines.jobs import DecodeTask

pytestmark = pytest.mark.serial  # timing-sensitive: runs after the parallel part, alone (scripts/test.sh)


def run_concurrently(fn, n: int, timeout_s: float = 120) -> list:
    """fn(i) for i in range(n), each in its own thread; their results in order."""
    results = [None] * n

    def run(i):
        results[i] = fn(i)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    return results


def alone_then_together(stack, n: int) -> tuple:
    """One prompt generated alone, then n prompts concurrently; every output must equal target-only decoding.
    Returns (the lone result, the concurrent results)."""
    prompts = [[i + 1, (i * 7) % 60 + 2, (i * 13) % 61 + 1] for i in range(n)]
    refs = [stack.client.generate(p, max_new_tokens=40, speculation=False, ignore_eos=True).token_ids
            for p in prompts]
    alone = stack.client.generate(prompts[0], max_new_tokens=40, ignore_eos=True)
    assert alone.token_ids == refs[0]
    results = run_concurrently(lambda i: stack.client.generate(prompts[i], max_new_tokens=40, ignore_eos=True), n)
    assert [r.token_ids for r in results] == refs
    return alone, results


def test_batched_forward_matches_separate_forwards():
    loaded = model(TARGET)
    lm = CachedLM(loaded, SessionCacheStore())
    contexts = [[1, 5, 9, 12, 5, 9, 3, 4], [2, 3], [7] * 20, []]
    news = [[10, 11, 12], [13], [14, 15, 16, 17, 18], [1, 2, 3, 4, 5, 6, 7]]
    sessions = []
    for i, ctx in enumerate(contexts):
        s = lm.store.get(f"s{i}")
        if ctx:
            lm.extend(s, ctx)
        sessions.append(s)
    out = extend_batch(lm, list(zip(sessions, news)))
    for i, (ctx, new) in enumerate(zip(contexts, news)):
        with torch.no_grad():
            want = loaded.model(input_ids=torch.tensor([ctx + new])).logits[0, -len(new):].float()
        torch.testing.assert_close(out[i], want, rtol=1e-4, atol=1e-4)
        assert sessions[i].tokens == ctx + new and sessions[i].cache.get_seq_length() == len(ctx + new)
    # Each session's cache is its own again: a later single-session step is exact too.
    for i, s in enumerate(sessions):
        got = lm.extend(s, [3])
        with torch.no_grad():
            want = loaded.model(input_ids=torch.tensor([contexts[i] + news[i] + [3]])).logits[0, -1:].float()
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_concurrent_sessions_batched_are_token_identical(redis_url):
    stack = start_stack(redis_url, draft=DRAFT_EARLY, batch_window_ms=20)
    try:
        prompts = [[i + 1, (i * 7) % 60 + 2, (i * 13) % 61 + 1] for i in range(8)]
        refs = [stack.client.generate(p, max_new_tokens=40, speculation=False, ignore_eos=True).token_ids
                for p in prompts]
        batcher = stack.target_engine.batcher
        before = batcher.batches, batcher.batched_jobs  # the sequential references' Decode steps ran alone
        results = run_concurrently(lambda i: stack.client.generate(prompts[i], max_new_tokens=40, max_draft_len=3,
                                                                   ignore_eos=True).token_ids, len(prompts))
        assert results == refs
        batches, jobs = batcher.batches - before[0], batcher.batched_jobs - before[1]
        assert jobs / batches > 1.5, "concurrent verifies should share forward passes"
    finally:
        stack.stop()


def test_batched_forward_keeps_only_the_rows_asked_for():
    loaded = model(TARGET)
    lm = CachedLM(loaded, SessionCacheStore())
    contexts, news, keeps = [[1, 5, 9, 12], [2, 3, 4, 5, 6, 7]], [[10, 11, 12], [13]], [2, 1]
    sessions = []
    for i, ctx in enumerate(contexts):
        s = lm.store.get(f"k{i}")
        lm.extend(s, ctx, keep=1)
        sessions.append(s)
    out = extend_batch(lm, list(zip(sessions, news)), keep=keeps)
    for i, (ctx, new, k) in enumerate(zip(contexts, news, keeps)):
        with torch.no_grad():
            want = loaded.model(input_ids=torch.tensor([ctx + new])).logits[0, -k:].float()
        assert out[i].shape[0] == k
        torch.testing.assert_close(out[i], want, rtol=1e-4, atol=1e-4)
        assert sessions[i].cache.get_seq_length() == len(ctx + new)  # every new token got its KV


def _decode(engine, sid, ctx, n, temperature):
    from specdec.core.sampling import SamplingParams

    return engine.decode(DecodeTask(sid, 0, ctx, n, SamplingParams(temperature=temperature), 7, 3))


def test_batched_decode_is_the_unbatched_decode():
    """A Decode through the batcher (single-token steps) returns the same tokens, cache length and random
    stream as the plain loop, greedy and sampled."""
    from target_service.engines.torch import TargetEngine

    loaded = model(TARGET)
    plain = TargetEngine(loaded, SessionCacheStore())
    batched = TargetEngine(loaded, SessionCacheStore(), batch_window_ms=2)
    ctx = [3, 9, 27, 17, 51, 25]
    for temperature in (0.0, 1.0):
        want = _decode(plain, f"p{temperature}", ctx, 12, temperature)
        got = _decode(batched, f"b{temperature}", ctx, 12, temperature)
        assert got[:2] == want[:2]
        # continuing from the returned cache position works the same way in both
        tokens, cached = want[0], want[1]
        from specdec.core.sampling import SamplingParams

        params = SamplingParams(temperature)
        more_plain = plain.decode(DecodeTask(f"p{temperature}", cached, [tokens[-1]], 3, params, 7, 4))
        more_batched = batched.decode(DecodeTask(f"b{temperature}", cached, [tokens[-1]], 3, params, 7, 4))
        assert more_plain[:2] == more_batched[:2]


def test_concurrent_decodes_share_forward_passes():
    from target_service.engines.torch import TargetEngine

    loaded = model(TARGET)
    plain = TargetEngine(loaded, SessionCacheStore())
    batched = TargetEngine(loaded, SessionCacheStore(), batch_window_ms=20)
    contexts = [[i + 1, (i * 7) % 60 + 2, (i * 13) % 61 + 1] for i in range(6)]
    refs = [_decode(plain, f"r{i}", c, 16, 0.0)[0] for i, c in enumerate(contexts)]
    results = run_concurrently(lambda i: _decode(batched, f"c{i}", contexts[i], 16, 0.0)[0], len(contexts))
    assert results == refs
    assert batched.batcher.batched_jobs / batched.batcher.batches > 1.5


def test_speculation_turns_off_above_the_session_limit(redis_url):
    """--speculation-max-sessions: with more sessions generating than the limit, steps decode target-only
    (counted as load_shed_steps); a lone session still speculates; outputs equal target-only either way."""
    from orchestrator.settings import LoopConfig

    cfg = LoopConfig(default_draft_len=3, draft_timeout_floor_ms=5000, speculation_max_sessions=1)
    stack = start_stack(redis_url, draft=DRAFT_EARLY, cfg=cfg, batch_window_ms=5)
    try:
        alone, results = alone_then_together(stack, 4)
        assert alone.stats["load_shed_steps"] == 0 and alone.stats["verify_steps"] > 0
        assert sum(r.stats["load_shed_steps"] for r in results) > 0
        assert all(r.stats["decode_ms"] > 0 for r in results if r.stats["decode_steps"])
    finally:
        stack.stop()


def test_auto_pipelining_prefetches_only_when_it_pays():
    """auto: prefetch when full-block rate x Propose round trip beats the minimum gain. A free drafter (n-gram,
    ~1 ms round trips) never pays; a slow draft that is usually fully accepted does; a rejection stops it; so
    does sharing the draft with more sessions than --pipeline-max-sessions."""
    import types

    from orchestrator.loop import StepTimer
    from orchestrator.loop.prefetch import Prefetcher
    from orchestrator.settings import LoopConfig
    from specdec.v1 import common_pb2
    from tests.harness import loop_state

    load = types.SimpleNamespace(sessions=1)
    state = loop_state(cfg=LoopConfig(pipeline="auto", pipeline_min_gain_ms=1.0), active_sessions=lambda: load.sessions)
    gen = Prefetcher(state, types.SimpleNamespace(propose_time=StepTimer()))
    ngram = types.SimpleNamespace(info=common_pb2.ModelInfo(strategy="ngram"))
    model_draft = types.SimpleNamespace(info=common_pb2.ModelInfo(strategy="quantized"))
    gen.draft.propose_time.observe(0.4)
    pays = Prefetcher.pays
    assert not pays(gen, ngram)                # cheap drafter: nothing to hide
    gen.draft.propose_time, gen.full_block_rate = StepTimer(), 0.7
    gen.draft.propose_time.observe(20.0)
    assert pays(gen, ngram)                    # 14 ms expected saving
    gen.full_block_rate = 0.03
    assert not pays(gen, ngram)                # blocks are rarely fully accepted: prefetches are wasted
    gen.full_block_rate, gen.last_block_full = 0.7, False
    assert not pays(gen, ngram)                # right after a rejection: waiting for a stale one would cost
    assert pays(gen, model_draft)              # a model draft's stale prefetch is cancelled: start it anyway
    assert not pays(gen, types.SimpleNamespace(info=None))  # a replica not yet known: as a free drafter
    # More sessions than --pipeline-max-sessions (2): their blocks fill the draft's time; no prefetching, and the
    # goodput draft length is told so (pipelines); --pipeline on prefetches whatever the load
    assert gen.pipelines(model_draft)
    load.sessions = 3
    assert not pays(gen, model_draft) and not gen.pipelines(model_draft)
    state.cfg.pipeline_max_sessions = 0  # no limit
    assert pays(gen, model_draft) and gen.pipelines(model_draft)
    state.cfg.pipeline_max_sessions, state.cfg.pipeline = 2, "on"
    assert gen.pipelines(model_draft)


@pytest.mark.parametrize("ragged", [False, True], ids=["padded", "packed"])
def test_a_prefill_in_the_batch_pads_no_row(ragged):
    """A long input (a new session's prompt) must not make every other row feed that many tokens: the padded
    batch runs it on its own; the packed batch carries it in the same forward without padding anyone."""
    import dataclasses

    from specdec.core.kv_cache import MAX_BATCHED_NEW_TOKENS

    loaded = dataclasses.replace(model(TARGET), ragged_batch=ragged)
    lm = CachedLM(loaded, SessionCacheStore())
    shapes = []
    forward = loaded.model.forward

    def recording(*a, **kw):
        shapes.append(tuple(kw["input_ids"].shape))
        return forward(*a, **kw)

    sessions = []
    for i in range(3):
        s = lm.store.get(f"p{i}")
        lm.extend(s, [1 + i, 2, 3, 4, 5])
        sessions.append(s)
    prompt = list(range(1, MAX_BATCHED_NEW_TOKENS + 10))
    news = [[7], [8, 9, 10], [11], prompt]
    sessions.append(lm.store.get("p-new"))
    loaded.model.forward = recording
    try:
        out = extend_batch(lm, list(zip(sessions, news)), keep=[1, 3, 1, 1])
    finally:
        loaded.model.forward = forward
    if ragged:
        assert shapes == [(1, 5 + len(prompt))]  # one forward, 5 tokens + the prompt
    else:
        assert sorted(shapes) == [(1, len(prompt)), (3, 3)]  # the prompt alone; the rest as one batch of width 3
    for s, new, got in zip(sessions, news, out):
        with torch.no_grad():
            want = loaded.model(input_ids=torch.tensor([s.tokens])).logits[0, -got.shape[0]:].float()
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_a_lone_session_does_not_wait_for_the_batch_window():
    """With no other session active, the batcher runs a job at once instead of waiting the window out
    (a 1 s window here: four waited-out steps would take over 4 s)."""
    import time

    from target_service.engines.torch import TargetEngine

    engine = TargetEngine(model(TARGET), SessionCacheStore(), batch_window_ms=1000)
    t0 = time.monotonic()
    tokens = _decode(engine, "alone", [3, 9, 27], 4, 0.0)[0]
    assert len(tokens) == 4 and time.monotonic() - t0 < 2.0


def test_a_released_session_does_not_make_the_next_one_wait():
    """A session that just finished (released) is not 'active': the next lone session runs at once. Without the
    release it counts as active for the batcher's ACTIVE_S and the next session waits the window (1 s here)."""
    import time

    from target_service.engines.torch import TargetEngine

    engine = TargetEngine(model(TARGET), SessionCacheStore(), batch_window_ms=1000)
    _decode(engine, "first", [3, 9, 27], 2, 0.0)
    engine.release("first")
    t0 = time.monotonic()
    assert len(_decode(engine, "second", [3, 9, 27], 2, 0.0)[0]) == 2
    assert time.monotonic() - t0 < 0.9
    t0 = time.monotonic()
    _decode(engine, "third", [3, 9, 27], 1, 0.0)  # "second" was not released: still active, so this one waits
    assert time.monotonic() - t0 >= 0.9


def test_the_batch_closes_once_every_active_session_is_in():
    """Two active sessions decoding together: each batch closes as soon as both have a job in it, instead of
    waiting out the window (1 s here: two waited-out steps would take over 2 s); both rows share forwards."""
    import threading
    import time

    from target_service.engines.torch import TargetEngine

    engine = TargetEngine(model(TARGET), SessionCacheStore(), batch_window_ms=1000)
    # Both sessions count as active from the start, as sessions already decoding do: the batcher learns of a
    # session at its first step, and on a loaded machine "b"'s prefill outlasted all 3 of "a"'s steps (run alone),
    # so "b"'s first step waited out the window for "a" and no forward carried both. No session goes stale here.
    engine.batcher.ACTIVE_S = 60.0
    for sid in ("a", "b"):
        engine.batcher._active(sid, time.monotonic())
    results = {}

    def run(sid, ctx):
        results[sid] = _decode(engine, sid, ctx, 3, 0.0)[0]

    threads = [threading.Thread(target=run, args=(sid, ctx)) for sid, ctx in (("a", [3, 9, 27]), ("b", [4, 8]))]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert time.monotonic() - t0 < 2.0
    assert len(results["a"]) == 3 and len(results["b"]) == 3
    assert engine.batcher.batched_jobs > engine.batcher.batches  # some forwards carried both sessions
    assert results["a"] == _decode(TargetEngine(model(TARGET), SessionCacheStore()), "a", [3, 9, 27], 3, 0.0)[0]


def test_goodput_drafts_less_as_the_batch_grows(redis_url):
    """The goodput draft length costs a block as part of a forward over every generating session's tokens: on a
    target whose forward cost grows with the batch's tokens, 8 concurrent sessions draft less per step than a
    lone one (or pause drafting), and every output still equals target-only decoding."""
    from orchestrator.settings import LoopConfig

    prof = [60.0] + [70.0] * 5 + [70.0 + 5 * (n - 6) for n in range(7, 69)]  # CPU-like: flat to 6 tokens
    cfg = LoopConfig(default_draft_len=4, adaptive_draft_len=True, draft_timeout_floor_ms=5000)
    stack = start_stack(redis_url, draft=DRAFT_EARLY, cfg=cfg, batch_window_ms=5, forward_ms=prof)
    try:
        alone, results = alone_then_together(stack, 8)

        def drafted_per_step(stats_list):
            steps = sum(s["verify_steps"] + s["speculation_paused_steps"] for s in stats_list)
            return sum(s["draft_tokens_proposed"] for s in stats_list) / max(1, steps)

        assert drafted_per_step([r.stats for r in results]) < 0.7 * drafted_per_step([alone.stats])
    finally:
        stack.stop()


def _batches_of_a_late_pair(wait_fraction: float) -> list[list[str]]:
    """Sessions a and b (both active) submit 100 ms apart to a batcher whose forwards take 400 ms and whose fixed
    window is 5 ms; returns the forwards' session lists. (Wide margins: scheduling jitter on a busy machine.)"""
    import time

    from specdec.core.sampling import SamplingParams
    from target_service.engines.batching import VerifyBatcher
    from target_service.engines.jobs import VerifyOutcome, VerifyTask

    class SlowEngine:
        def __init__(self):
            self.batches: list[list[str]] = []

        def verify_many(self, jobs):
            time.sleep(0.4)
            self.batches.append(sorted(job.task.session_id for job in jobs))
            for job in jobs:
                job.result = VerifyOutcome(0, 1, 1, 400.0, len(jobs))

    engine = SlowEngine()
    batcher = VerifyBatcher(engine, window_ms=5, wait_fraction=wait_fraction)

    def submit(sid):
        return batcher.submit(VerifyTask(sid, 0, [1], [], None, SamplingParams()).job())

    submit("a"), submit("b")  # each alone: both active now, and the forward time is known

    def late(i):
        time.sleep(0.1 * i)
        return submit("ab"[i])

    run_concurrently(late, 2)
    return engine.batches[2:]


def test_the_batch_waits_part_of_a_forward_for_active_sessions():
    """A job that misses a batch waits for the whole forward anyway: under load the batch waits for recently
    active sessions up to wait_fraction of the recent forward time (here 0.5 x 400 ms), beyond the fixed window."""
    assert _batches_of_a_late_pair(0.5) == [["a", "b"]]
    assert _batches_of_a_late_pair(0.0) == [["a"], ["b"]]  # the 5 ms window alone: two forwards
