"""Ragged batches (specdec/models/ragged_batch.py): sessions at different lengths, their new tokens packed into one
sequence and each attending to its own cache, give the logits of a plain full-sequence forward, for every
architecture the module claims to support."""

import pytest
import torch
import transformers
from transformers import DynamicCache

from specdec.models import ragged_batch
from specdec.core.kv_cache import CachedLM, SessionCacheStore, extend_batch
from tests.harness import TARGET, model

SMALL = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             max_position_embeddings=512)


def _build(config):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        m = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    with torch.no_grad():  # transformers' init is small enough to make every logit a near-tie: widen it
        for p in m.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2, generator=torch.Generator().manual_seed(p.numel()))
    return m.eval()


ARCHITECTURES = {
    "llama-mha": lambda: transformers.LlamaConfig(**SMALL, num_key_value_heads=4),
    "llama-gqa": lambda: transformers.LlamaConfig(**SMALL, num_key_value_heads=2),
    "qwen2": lambda: transformers.Qwen2Config(**SMALL, num_key_value_heads=2, use_sliding_window=False),
    "qwen3": lambda: transformers.Qwen3Config(**SMALL, num_key_value_heads=1, head_dim=16),
    "mistral": lambda: transformers.MistralConfig(**SMALL, num_key_value_heads=2, sliding_window=None),
}


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_ragged_rows_match_full_forwards(arch):
    m = _build(ARCHITECTURES[arch]())
    assert ragged_batch.enable(m)
    contexts = [[1, 5, 9, 12, 5, 9, 3, 4], [2, 3], [7] * 40, [], [8, 1]]
    news = [[10, 11, 12], [13], [14, 15, 16, 17, 18], [1, 2, 3, 4, 5, 6, 7], [9] * 20]  # the last: wider than packed
    caches = []
    with torch.no_grad():
        for ctx in contexts:
            cache = DynamicCache()
            if ctx:
                m(input_ids=torch.tensor([ctx]), cache=cache, use_cache=True)
            caches.append(cache)
        keep = [3, 1, 5, 2, 1]
        logits = ragged_batch.forward_rows(m, caches, [len(c) for c in contexts], news, keep, device="cpu")
        for i, (ctx, new) in enumerate(zip(contexts, news)):
            want = m(input_ids=torch.tensor([ctx + new])).logits[0, -keep[i]:]
            torch.testing.assert_close(logits[i], want, rtol=1e-4, atol=1e-4)
            assert caches[i].get_seq_length() == len(ctx + new)
        # The caches are exact: one more packed step, every row one token.
        step = ragged_batch.forward_rows(m, caches, [len(c + n) for c, n in zip(contexts, news)], [[3]] * 5,
                                         [1] * 5, device="cpu")
        for i, (ctx, new) in enumerate(zip(contexts, news)):
            want = m(input_ids=torch.tensor([ctx + new + [3]])).logits[0, -1:]
            torch.testing.assert_close(step[i], want, rtol=1e-4, atol=1e-4)


def test_ordinary_calls_are_plain_sdpa():
    """Switching the attention implementation must not change a forward that is not a ragged batch (tree masks,
    HF generate): same logits as an untouched copy of the model, with and without a padding mask."""
    plain = _build(ARCHITECTURES["llama-gqa"]())
    switched = _build(ARCHITECTURES["llama-gqa"]())
    assert ragged_batch.enable(switched)
    ids = torch.tensor([[5, 6, 7, 8, 9], [0, 0, 1, 2, 3]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]])
    with torch.no_grad():
        torch.testing.assert_close(switched(input_ids=ids, attention_mask=mask).logits,
                                   plain(input_ids=ids, attention_mask=mask).logits)


def test_unsupported_architectures_keep_the_padded_batch():
    sliding = _build(transformers.MistralConfig(**SMALL, num_key_value_heads=2, sliding_window=16))
    assert not ragged_batch.enable(sliding)
    assert sliding.config._attn_implementation == "sdpa"
    gemma = _build(transformers.GemmaConfig(**SMALL, num_key_value_heads=2, head_dim=16))
    assert not ragged_batch.enable(gemma)


@pytest.mark.parametrize("ragged", [True, False], ids=["ragged", "padded"])
def test_batched_extend_matches_single_extends_on_both_paths(ragged):
    """extend_batch through either path: the same logits and caches as one CachedLM.extend per session."""
    import dataclasses

    loaded = dataclasses.replace(model(TARGET), ragged_batch=ragged)
    lm = CachedLM(loaded, SessionCacheStore())
    contexts = [[1, 5, 9, 12, 5, 9, 3, 4], [2, 3], [7] * 20, [4]]
    news = [[10, 11, 12], [13], [14, 15, 16, 17, 18], [1, 2]]
    batched = [lm.store.get(f"b{i}") for i in range(4)]
    single = [lm.store.get(f"s{i}") for i in range(4)]
    for b, s, ctx in zip(batched, single, contexts):
        lm.extend(b, ctx)
        lm.extend(s, ctx)
    got = extend_batch(lm, list(zip(batched, news)), keep=[2, 1, 3, 2])
    for b, s, new, g in zip(batched, single, news, got):
        want = lm.extend(s, new, keep=g.shape[0])
        torch.testing.assert_close(g, want, rtol=1e-4, atol=1e-4)
        assert b.tokens == s.tokens and b.cache.get_seq_length() == len(s.tokens)


@pytest.mark.parametrize("ragged", [True, False], ids=["ragged", "padded"])
def test_a_forward_that_fails_midway_leaves_every_cache_as_it_was(ragged):
    """Layers before a failure have appended their keys: the caches must be cut back to the sessions' tokens,
    or every later step of those sessions attends to garbage."""
    import dataclasses

    loaded = dataclasses.replace(model(TARGET), ragged_batch=ragged)
    lm = CachedLM(loaded, SessionCacheStore())
    sessions = [lm.store.get(f"f{i}") for i in range(3)]
    for i, s in enumerate(sessions):
        lm.extend(s, [1 + i, 2, 3, 4])
    last = loaded.model.model.layers[-1]

    def fail(*args, **kwargs):
        raise RuntimeError("injected failure in the last layer")

    last.forward = fail
    try:
        with pytest.raises(RuntimeError, match="injected"):
            extend_batch(lm, [(s, [5, 6]) for s in sessions])
        with pytest.raises(RuntimeError, match="injected"):
            lm.extend(sessions[0], [7])
    finally:
        del last.forward
    for s in sessions:
        assert [layer.keys.shape[-2] for layer in s.cache.layers] == [len(s.tokens)] * len(s.cache.layers)
    got = extend_batch(lm, [(s, [5, 6]) for s in sessions], keep=[2] * 3)
    for s, g in zip(sessions, got):
        with torch.no_grad():
            want = loaded.model(input_ids=torch.tensor([s.tokens])).logits[0, -2:].float()
        torch.testing.assert_close(g, want, rtol=1e-4, atol=1e-4)
