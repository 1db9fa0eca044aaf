"""bench/policy_replay.py: the offline replay of draft-length policies is what the orchestrator really does."""

import pytest

from bench import policy_replay
from bench.policy_replay import Position, positions, replay
from draft_service.proposers.ngram import NgramProposer
from tests.harness import start_stack

FLAT = [10.0, 11, 11, 11, 11, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]


def test_positions_are_the_drafts_matched_prefixes():
    reply = [7, 8, 9, 7, 8, 4]
    table = positions([1, 2], reply, lambda ctx, n: ([7, 8, 9][:n], [3.0, 2.0, 1.0][:n]))  # the same draft
    assert table[0] == Position(3, 3, (3.0, 2.0, 1.0)) and table[3].matched == 2 and table[1].matched == 0
    assert table[5].drafted == 3 and table[5].matched == 0


def test_replay_commits_accepted_plus_one_and_costs_the_block():
    perfect = [[Position(10, 10)] * 12]  # every draft accepted
    tokens, cost, verifies, plain = replay(perfect, 3, FLAT)
    assert tokens == 12 and plain == 0
    assert verifies == 3 and cost == 3 * FLAT[3]  # 4 + 4 + 4 tokens, each a forward over 4
    nothing = [[Position(0, 0)] * 5]  # no draft anywhere: one target token per step
    assert replay(nothing, 3, FLAT) == (5, 5 * FLAT[0], 0, 5)
    # the last step drafts no more than the tokens left allow
    assert replay([[Position(10, 10)] * 6], 4, FLAT) == (6, FLAT[4] + FLAT[0], 1, 1)


def test_replay_of_a_paused_policy_decodes_a_chunk_and_probes():
    class Paused:
        k = 0
        probes = 0

        def step_taken(self):
            Paused.probes += 1

        def update(self, proposed, accepted):
            raise AssertionError("a paused policy drafts nothing")

    tokens, cost, verifies, plain = replay([[Position(5, 5)] * 10], Paused, FLAT, fallback_chunk=4)
    assert (tokens, verifies, plain) == (10, 0, 10) and Paused.probes == 3  # chunks of 4, 4, 2


@pytest.mark.parametrize("k", [1, 3, 5])
def test_replay_matches_the_real_loop_step_for_step(redis_url, k):
    """The real services (n-gram draft service, fixed draft length k, greedy) take exactly the verify steps and
    accept exactly the drafts that the replay of the target's own reply predicts."""
    s = start_stack(redis_url, draft="ngram")
    try:
        prompt = [1, 5, 9, 12, 5, 9, 12, 5, 9, 30, 31, 5, 9, 12, 40]
        got = s.client.generate(prompt, max_new_tokens=60, max_draft_len=k, ignore_eos=True)
        vocab = s.target_engine.loaded.vocab_size
    finally:
        s.stop()
    table = positions(prompt, got.token_ids, NgramProposer(vocab_size=vocab).lookup_scored)
    tokens, _, verifies, plain = replay([table], k, FLAT)
    st = got.stats
    assert tokens == st["generated_tokens"] == 60
    assert verifies == st["verify_steps"] > 0
    assert st["draft_tokens_accepted"] == 60 - plain - verifies  # each verify commits accepted + 1
    assert st["draft_tokens_accepted"] > 0


def test_compare_ranks_policies_on_the_same_tables():
    burst = [Position(10, 10)] * 20 + [Position(10, 0)] * 20  # a copied passage, then free text
    rows = policy_replay.compare([burst, burst], FLAT)
    by = {r["policy"]: r for r in rows}
    assert by["target-only"]["speedup_vs_target_only"] == 1.0
    assert by["fixed k=5"]["speedup_vs_target_only"] > by["fixed k=1"]["speedup_vs_target_only"] > 0
    assert all(r["tokens"] == 80 for r in rows)
    assert "goodput + draft scores (default adaptive)" in by and "heuristic (transformers: +2 / -1)" in by
