"""bench/stream_policy_replay.py: the replay of the goodput policy and the suffix drafter over the serving path's
costs, on made-up replies (no model): every token is accounted for once, a reply that quotes its prompt is
verified in blocks in every mode, and one that never repeats costs what target-only decoding does."""

from bench import stream_policy_replay as replay
from orchestrator.policy.draft_length import DraftEvidence

MODES = ("hybrid", "stream", "unary", "onstream", "onstream-hold")
PASSAGE = [(i * 37) % 900 + 5 for i in range(120)]  # a "text" of distinct tokens


def test_a_quoting_reply_is_verified_in_blocks_in_every_mode():
    ids, reply = PASSAGE, PASSAGE[:80]  # a quotation of the prompt
    for mode in MODES:
        r = replay.run(mode, ids, reply, DraftEvidence())
        assert r["verifies"] >= 1 and r["accepted"] >= 40, mode
        assert r["ms"] < replay.target_only_ms(ids, reply), mode  # long quoted blocks beat one step a token


def test_tokens_are_counted_once_and_a_reply_that_never_repeats_streams():
    ids, reply = PASSAGE[:40], [1000 + i for i in range(48)]  # nothing to match
    for mode in ("hybrid", "stream", "onstream", "onstream-hold"):
        r = replay.run(mode, ids, reply, DraftEvidence())
        assert r["verifies"] == 0 and r["streamed"] == len(reply) - 1, mode
        assert 0.95 < replay.target_only_ms(ids, reply) / r["ms"] <= 1.0, mode  # a few more block wake-ups
    mixed = [3] + PASSAGE[:30] + [1000 + i for i in range(30)]
    for mode in MODES:
        r = replay.run(mode, PASSAGE, mixed, DraftEvidence())
        assert r["streamed"] + r["decoded"] + r["accepted"] + r["verifies"] == len(mixed) - 1, mode


def test_stream_blocks_grow_as_the_target_serves_them():
    blocks = replay.StreamBlocks()
    assert [blocks.take(100) for _ in range(6)] == [4, 4, 8, 16, 16, 16]
    assert blocks.take(3) == 3  # the tokens left
