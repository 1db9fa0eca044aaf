"""The hybrid drafter: prompt lookup where the context repeats itself, the draft model elsewhere."""

import pytest
import torch

from draft_service.proposers.base import ProposeTask
from draft_service.proposers.hybrid import HybridProposer
from draft_service.proposers.model import ModelProposer
from draft_service.proposers.ngram import NgramProposer
from specdec.core.kv_cache import SessionCacheStore
from specdec.core.sampling import SamplingParams
from tests.harness import DRAFT_EARLY, HYBRID, model, start_stack

GREEDY = SamplingParams()


def _hybrid(max_len=2):
    loaded = model(DRAFT_EARLY)
    return HybridProposer(NgramProposer(vocab_size=loaded.vocab_size), ModelProposer(loaded, SessionCacheStore()),
                          model_max_len=max_len)


def _model_logits(tokens):
    with torch.no_grad():
        return model(DRAFT_EARLY).model(input_ids=torch.tensor([tokens])).logits[0, -1]


def test_lookup_first_then_the_model_which_catches_up():
    h = _hybrid(max_len=2)
    ctx = [5, 6, 7, 8, 9, 5, 6]  # "5 6" occurred before: prompt lookup proposes what followed it
    p = h.get_candidates(ProposeTask("s", 0, ctx, 4, GREEDY, 0, 0))
    assert p.tokens == [7, 8, 9, 5] and p.probs_fp16 is None
    assert p.cached_len == 0  # the model has seen nothing yet: the next request resends everything it lacks
    ctx2 = ctx + [7, 8, 9, 5, 40, 41]  # ...accepted, then new tokens the context has not seen
    p = h.get_candidates(ProposeTask("s", p.cached_len, ctx2, 4, GREEDY, 0, 1))
    assert 1 <= len(p.tokens) <= 2  # no n-gram match for "41": the model drafts, at most model_max_len
    assert p.tokens[0] == int(torch.argmax(_model_logits(ctx2)))  # the model's cache holds the whole context
    assert p.cached_len == len(ctx2)
    assert h.model_proposals == 1 and h.ngram_proposals == 1
    assert h.release("s") and not h.release("s")


def test_an_evicted_model_cache_is_rebuilt_from_the_lookup_side():
    h = _hybrid()
    ctx = [11, 12, 13, 14]
    p = h.get_candidates(ProposeTask("s", 0, ctx, 2, GREEDY, 0, 0))
    h.model.release("s")  # e.g. LRU eviction on the model side only
    p = h.get_candidates(ProposeTask("s", len(ctx), [15], 2, GREEDY, 0, 1))
    assert p.tokens[0] == int(torch.argmax(_model_logits(ctx + [15])))


def test_hybrid_needs_a_positive_model_length():
    with pytest.raises(ValueError):
        _hybrid(max_len=0)


def test_hybrid_sampling_is_exact_and_reproducible(redis_url):
    """Sampled through the services: the same seed gives the same tokens; drafts mix one-hot (lookup) and
    model distributions, which the target's rejection sampling handles per step."""
    s = start_stack(redis_url, draft=HYBRID)
    try:
        prompt = [1, 5, 9, 12, 5, 9]
        a = s.client.generate(prompt, max_new_tokens=40, temperature=0.8, seed=3, ignore_eos=True)
        b = s.client.generate(prompt, max_new_tokens=40, temperature=0.8, seed=3, ignore_eos=True)
        assert a.token_ids == b.token_ids and a.stats["verify_steps"] > 0
    finally:
        s.stop()


def test_top_vocab_head_drafts_only_the_first_ids_and_stays_exact(redis_url):
    """--draft-vocab: the draft's head covers ids < n (logits -inf elsewhere); its argmax over those ids is
    the full head's argmax restricted to them; outputs through the services still equal target-only."""
    from draft_service.proposers.model import TopVocabHead, limit_draft_vocab
    from specdec.models import load_model

    loaded = load_model(DRAFT_EARLY)
    full = loaded.model.get_output_embeddings()
    h = torch.randn(2, 3, full.in_features)
    with torch.no_grad():
        want = full(h)
    assert limit_draft_vocab(loaded, 40)
    head = loaded.model.get_output_embeddings()
    assert isinstance(head, TopVocabHead)
    with torch.no_grad():
        got = head(h)
    assert got.shape == want.shape
    torch.testing.assert_close(got[..., :40], want[..., :40])
    assert torch.isneginf(got[..., 40:]).all()
    assert not limit_draft_vocab(load_model(DRAFT_EARLY), 0)
    assert not limit_draft_vocab(load_model(DRAFT_EARLY), 64)  # the whole vocabulary already

    from tests.harness import start_stack as _start
    from draft_service.proposers.model import ModelProposer

    proposer = ModelProposer(loaded, SessionCacheStore())
    p = proposer.get_candidates(ProposeTask("v", 0, [1, 5, 9, 12], 6, SamplingParams(temperature=1.0), 1, 0))
    assert all(t < 40 for t in p.tokens) and bool((p.probs_fp16[:, 40:] == 0).all())
