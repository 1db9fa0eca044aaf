"""Batched verification: blocks of concurrent sessions verified in one forward pass give the same results."""

import threading

import torch

from specdec.kv_cache import CachedLM, SessionCacheStore, extend_batch
from tests.harness import DRAFT_EARLY, TARGET, model, start_stack


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
        results = [None] * len(prompts)

        def run(i):
            results[i] = stack.client.generate(prompts[i], max_new_tokens=40, max_draft_len=3,
                                               ignore_eos=True).token_ids

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert results == refs
        batcher = stack.target_engine.batcher
        assert batcher.batched_jobs / batcher.batches > 1.5, "concurrent verifies should share forward passes"
    finally:
        stack.stop()
