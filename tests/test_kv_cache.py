"""Session KV caches: rollback by cropping is exact, the bound evicts, evicted sessions rebuild transparently."""

import threading

import pytest
import torch

from specdec.core.kv_cache import CacheMiss, CachedLM, SessionCacheStore
from tests.harness import DRAFT_EARLY, TARGET, model, start_stack
from target_service.engines.jobs import DecodeTask


def fresh_logits(loaded, tokens):
    with torch.no_grad():
        return loaded.model(input_ids=torch.tensor([tokens])).logits[0].float()


def test_rollback_gives_same_logits_as_fresh_forward():
    loaded = model(TARGET)
    lm = CachedLM(loaded, SessionCacheStore())
    sess = lm.store.get("s")
    context = [1, 5, 9, 12]
    lm.extend(sess, context)
    lm.extend(sess, [40, 41, 42, 43])  # a draft block
    lm.crop(sess, len(context) + 1)  # one draft token accepted
    assert sess.tokens == context + [40]
    got = lm.extend(sess, [7, 8])
    want = fresh_logits(loaded, context + [40, 7, 8])[-2:]
    # float32 reassociation between a chunked and a single forward: ~1e-5
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_sync_recomputes_nothing_it_holds_and_reports_a_miss():
    loaded = model(TARGET)
    lm = CachedLM(loaded, SessionCacheStore())
    sess = lm.store.get("s")
    lm.extend(sess, [1, 2, 3])
    assert lm.sync(sess, 3, [4]) == [4]          # only the delta is fed
    assert lm.sync(sess, 3, []) == [3]           # empty delta: re-feed the last token for its logits
    assert sess.tokens == [1, 2]
    try:
        lm.sync(sess, 10, [4])
    except CacheMiss as e:
        assert e.have == 2 and e.need == 10
    else:
        raise AssertionError("expected a cache miss")


def test_bound_by_sessions_and_bytes_evicts_lru():
    loaded = model(TARGET)
    store = SessionCacheStore(max_sessions=2)
    lm = CachedLM(loaded, store)
    for sid in ["a", "b", "c"]:
        sess = store.get(sid)
        lm.extend(sess, [1, 2, 3])
        store.update_size(sess)
    assert "a" not in store and "b" in store and "c" in store and store.evictions == 1
    per_session = store.get("c").nbytes
    assert per_session > 0
    small = SessionCacheStore(max_sessions=10, max_bytes=int(per_session * 1.5))
    lm2 = CachedLM(loaded, small)
    for sid in ["x", "y"]:
        sess = small.get(sid)
        lm2.extend(sess, [1, 2, 3])
        small.update_size(sess)
    assert len(small) == 1 and "y" in small
    assert small.total_bytes() <= small.max_bytes


def test_evicted_sessions_are_rebuilt_transparently(redis_url):
    """Caches for one session only, two interleaved generations: every step misses and resyncs, output unchanged.
    (--max-running auto would run one at a time on a one-session target: two are let in to oversubscribe it.)"""
    stack = start_stack(redis_url, draft=DRAFT_EARLY, target_sessions=1, draft_sessions=1, max_running=2)
    try:
        prompts = [[1, 5, 9, 12], [3, 3, 20, 21]]
        refs = [stack.client.generate(p, max_new_tokens=150, speculation=False, ignore_eos=True).token_ids
                for p in prompts]
        results = [None, None]

        def run(i):
            try:
                results[i] = stack.client.generate(prompts[i], max_new_tokens=150, max_draft_len=3,
                                                   ignore_eos=True).token_ids
            except Exception as e:  # shown by the assert below rather than lost in a thread
                results[i] = repr(e)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)
        assert not any(t.is_alive() for t in threads), "a generation did not finish in 180 s"
        assert results == refs
        assert stack.target_engine.store.evictions > 0
        assert len(stack.target_engine.store) <= 1
    finally:
        stack.stop()


@pytest.mark.parametrize("window_ms", [0.0, 5.0])
def test_decode_keeps_its_prefill_when_another_session_evicts_it_meanwhile(window_ms):
    """A full target cache: another session's call evicts this one between a Decode's prefill and its steps. The
    call still decodes from the tokens it prefilled (it holds its session, batched steps too) instead of failing
    with a cache-miss."""
    from specdec.core.sampling import SamplingParams
    from target_service.engines.torch import TargetEngine

    engine = TargetEngine(model(TARGET), SessionCacheStore(max_sessions=1), batch_window_ms=window_ms)
    greedy = SamplingParams(temperature=0.0)
    prompt = [1, 5, 9, 12, 7, 3]
    ref, _, _ = engine.decode(DecodeTask("ref", 0, prompt, 8, greedy, 0, 0))

    update_size = engine.store.update_size
    calls = []

    def update_then_intrude(sess):  # the prefill's last act, then another session arrives
        update_size(sess)
        calls.append(sess.session_id)
        if len(calls) == 1:
            engine.store.get("intruder")

    engine.store.update_size = update_then_intrude
    tokens, cached, _ = engine.decode(DecodeTask("a", 0, prompt, 8, greedy, 0, 0))
    assert "a" not in engine.store and engine.store.evictions >= 1
    assert tokens == ref and cached == len(prompt) + len(ref) - 1
