"""The suffix-tree drafter (draft_service/proposers/suffix.py, arctic-inference's SuffixDecodingCache): what it drafts
from, that one principal's text never drafts for another, resyncs, bounds and its token scores. Greedy identity and
the sampling distribution through the services: tests/test_greedy_equivalence.py and
tests/test_sampling_distribution_e2e.py (local-suffix)."""

import pytest

from draft_service.proposers.base import ProposeTask
from draft_service.proposers.suffix import MAX_SCORED_CONTEXT, SuffixLimits, SuffixProposer, token_scores
from specdec.core.kv_cache import CacheMiss
from specdec.core.sampling import SamplingParams

GREEDY = SamplingParams()
PASSAGE = list(range(10, 40))  # a passage in the prompt the reply will quote


def draft(p, sid, prefix_len, delta, principal="", max_len=32):
    return p.get_candidates(ProposeTask(sid, prefix_len, delta, max_len, GREEDY, 0, 0, principal=principal))


def test_a_quoted_passage_is_drafted_and_the_draft_grows_with_the_match():
    p = SuffixProposer(vocab_size=100)
    prompt = [1, 2, *PASSAGE, 3, 4]
    r = draft(p, "s", 0, prompt + PASSAGE[:3])  # the reply has started quoting: 3 tokens matched
    assert r.tokens == PASSAGE[3:6] and r.cached_len == len(prompt) + 3  # at most one token per matched token
    r = draft(p, "s", r.cached_len, PASSAGE[3:12])
    assert r.tokens == PASSAGE[12:24]  # 12 matched: 12 more
    r = draft(p, "s", r.cached_len, PASSAGE[12:24])
    assert r.tokens[:8] == PASSAGE[24:] + [3, 4]  # to the end of the passage and what followed it (and on)
    assert len(r.scores) == len(r.tokens) and all(s > 0 for s in r.scores)
    assert draft(p, "s", r.cached_len, [77, 78]).tokens == []  # text that matches nothing drafts nothing


def test_one_principals_outputs_draft_for_its_later_sessions_and_never_for_another():
    p = SuffixProposer(vocab_size=100)
    reply = [50, 51, 52, 53, 54, 55, 56, 57]
    draft(p, "a1", 0, [1, 2, 3], principal="alice")
    draft(p, "a1", 3, reply, principal="alice")  # alice's reply enters her global tree
    assert p.release("a1") and not p.release("a1")
    prompt = [9, 8, 50, 51, 52, 53]
    assert draft(p, "a2", 0, prompt, principal="alice").tokens == reply[4:8]
    assert draft(p, "b1", 0, prompt, principal="bob").tokens == []
    assert draft(p, "n1", 0, prompt, principal="").tokens == []  # no auth: its own principal, ''


def test_a_released_sessions_last_block_drafts_for_the_principals_next_session():
    p = SuffixProposer(vocab_size=100)
    reply = [50, 51, 52, 53, 54, 55, 56, 57, 58, 59]
    draft(p, "a1", 0, [1, 2, 3], principal="alice")
    draft(p, "a1", 3, reply[:4], principal="alice")  # the drafter was shown the reply's first block only
    p.take_final("a1", 7, reply[4:])  # the last block, handed over with the release
    p.take_final("a1", 99, [1])  # past what it holds: nothing to add, no error
    p.take_final("gone", 0, [1, 2])  # a session it does not hold: nothing
    assert p.release("a1") and not p.release("gone")
    assert draft(p, "a2", 0, [9, 8, 50, 51, 52, 53, 54], principal="alice").tokens == reply[5:10]
    without = SuffixProposer(vocab_size=100)  # the same without the last block: its draft stops where it did
    draft(without, "a1", 0, [1, 2, 3], principal="alice")
    draft(without, "a1", 3, reply[:4], principal="alice")
    without.release("a1")
    assert draft(without, "a2", 0, [9, 8, 50, 51, 52, 53], principal="alice").tokens == []


def test_resyncs_crops_and_misses():
    p = SuffixProposer(vocab_size=100)
    draft(p, "s", 0, [1, 2, 3, 4, 5, 1, 2])
    assert draft(p, "s", 0, [1, 2, 3, 4, 5, 1, 2, 3]).cached_len == 8  # a resend from 0: only the tail is new
    assert draft(p, "s", 8, [4]).tokens == [5, 1, 2, 3, 4][: len(draft(p, "s", 9, []).tokens)]
    r = draft(p, "s", 2, [7, 7, 7])  # the context differs from what the tree holds: its tree starts again
    assert r.cached_len == 5
    with pytest.raises(CacheMiss):
        draft(p, "s", 6, [1])  # beyond what it holds: the client resends from 0
    with pytest.raises(CacheMiss):
        draft(p, "new", 4, [1])


def test_sessions_and_principals_are_bounded():
    p = SuffixProposer(vocab_size=100, limits=SuffixLimits(max_sessions=2, max_principals=2, responses_per_principal=1))
    for i in range(4):
        draft(p, f"s{i}", 0, [1, 2, 3], principal=f"u{i}")
    assert p.num_sessions() == 2 and len(p._caches) == 2
    assert not p.release("s0") and p.release("s3")
    draft(p, "x", 0, [4, 5], principal="u2")
    draft(p, "x", 2, [6, 7, 8, 9], principal="u2")
    draft(p, "y", 0, [1], principal="u2")  # a second response: the first one leaves u2's global tree (FIFO)
    assert len(p._caches["u2"].cached_requests) == 1


def test_token_scores_are_conditional_probabilities_times_the_context_they_continue():
    scores = token_scores([0.5, 0.5, 0.25], match_len=3)
    assert scores == [0.5 * 2**3, 1.0 * 2**4, 0.5 * 2**5]
    assert token_scores([1.0] * 3, match_len=40) == [2.0**MAX_SCORED_CONTEXT] * 3
