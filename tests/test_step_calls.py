"""What a speculative session's steps ask of the target and the drafter when speculation is off for it (load-shed,
paused by the goodput draft length): the same Decode calls a target-only session makes, and no Propose (no n-gram
lookup) while load-shed. Counted on orchestrator/loop/step.py's Step with a scripted target and drafter."""

from __future__ import annotations

import types

from orchestrator.replicas.clients import DecodeReply, DraftReply, VerifyReply
from orchestrator.policy.draft_length import GoodputDraftLength, TargetCost
from orchestrator.loop.state import Backends, LoopState, Measurements, StreamControl
from orchestrator.loop.step import Step
from orchestrator.store.session_store import SessionRecord
from orchestrator.settings import LoopConfig

FLAT = [60.0, 70, 70, 70, 70, 70, 80, 90, 100, 110, 120, 130, 140, 150, 160, 170, 180]  # drafting pays
LINEAR = [10.0 * n for n in range(1, 18)]  # a forward over n tokens costs n single ones: no draft ever pays
NEW_TOKENS = 24


def run_session(speculation: bool, profile: list[float], active: int = 1, drafts=lambda call: [],
                shed_above: int = 0, strategy: str | None = None, score=0.0, evidence=None,
                accept=lambda block: 0, new_tokens: int = NEW_TOKENS) -> dict:
    """Generate NEW_TOKENS with one Step; `drafts(i)`: the tokens the i-th Propose returns (none: dry), each scored
    `score` (or score(draft)) when given (a scoring drafter, `strategy` its ModelInfo.strategy, `evidence` what scores have meant);
    `accept(block)`: how many of a verified block the target accepts. Returns the sizes of the Decode calls (unary
    ones also in "unary"), the Verify calls' block sizes, the Propose calls and the session's stats."""
    rec = SessionRecord("s", [1, 2, 3], {"max_new_tokens": NEW_TOKENS, "speculation": speculation, "draft_len_limit": 16})
    cfg = LoopConfig(speculation_max_sessions=shed_above)
    measured = Measurements(active_sessions=lambda: active, target_cost=TargetCost(profile), draft_evidence=evidence)
    replica = types.SimpleNamespace(address="local:ngram",
                                    info=types.SimpleNamespace(strategy=strategy) if strategy else None)
    backends = Backends(None, types.SimpleNamespace(replicas=[replica]), None, set(), 100)
    step = Step(LoopState(rec, cfg, backends, measured, StreamControl()))
    calls = {"decode": [], "unary": [], "verify": [], "propose": 0, "streams": []}
    stream = {"left": 0}  # tokens the open decode stream has still to give
    step.draft.pick_replica = lambda: replica

    def propose(replica, k, kv=None):
        tokens = drafts(calls["propose"])[:k]
        calls["propose"] += 1
        if not tokens:
            return None, False
        return DraftReply(tokens, [], len(rec.committed) + len(tokens), 0.1, False,
                          scores=[score(tokens) if callable(score) else score] * len(tokens) if score else []), False

    def decode(n, degraded):
        stream["left"] = 0  # any other call closes the open stream
        step.target.stream = None
        calls["decode"].append(n)
        calls["unary"].append(n)
        return DecodeReply([7] * n, len(rec.committed) + n - 1, 10.0 * n, False)

    def stream_block(total, degraded, grow=False):
        # the target's side of DecodeStream: the first block, then block_tokens doubling up to max_block_tokens
        if stream["left"] <= 0:
            calls["streams"].append(total)
            block, first, grown_to = step.target.stream_plan(grow)
            stream.update(left=total, want=first, block=block, grown_to=max(block, grown_to), first_block=block)
            step.target.stream = object()  # open (what the step asks of TargetCall)
        n = min(stream["want"], stream["left"])
        stream["left"] -= n
        stream["want"] = stream["block"]
        stream["block"] = min(stream["grown_to"], 2 * stream["block"])
        calls["decode"].append(n)
        return DecodeReply([7] * n, len(rec.committed) + n - 1, 10.0 * n, False)

    def block_of(stream):
        return stream["first_block"]

    def verify(reply):
        stream["left"] = 0
        step.target.stream = None
        calls["verify"].append(len(reply.tokens))
        n = accept(reply.tokens)
        return VerifyReply(n, 7, len(rec.committed) + n, 20.0, False)

    step.draft.propose, step.target.decode, step.target.verify = propose, decode, verify
    step.target.stream_block = stream_block
    for _ in range(4 * new_tokens):
        remaining = new_tokens - len(rec.generated)
        if remaining <= 0:
            break
        new, _ = step(remaining)
        rec.generated.extend(new[:remaining])
    return {**calls, "stats": rec.stats, "k": step.draft_len.k}


def test_a_load_shed_session_decodes_as_a_target_only_session_does():
    target_only = run_session(False, FLAT)
    shed = run_session(True, FLAT, active=4, shed_above=1, drafts=lambda i: [5, 6, 7])
    # one decode stream for the whole generation: its first token at once, then blocks of stream_block_tokens
    assert target_only["decode"] == [1, 16, 7] and target_only["propose"] == 0
    assert target_only["streams"] == [NEW_TOKENS]
    assert shed["stats"].load_shed_steps == 6
    assert shed["decode"] == [4] * 6 and shed["verify"] == []  # target-only tokens, fallback_chunk a step
    assert shed["propose"] == 0  # no n-gram lookup while load-shed


def test_a_paused_session_whose_probe_finds_no_draft_pauses_again():
    """Goodput pauses (k = 0) and probes every PROBE_EVERY steps. A probe the drafter has nothing for used to
    take the dry ramp (1, then 2 tokens per Decode, a Propose every step from then on): three calls for the
    7 tokens target-only decodes in two. Now it decodes the target-only chunk and stays paused."""
    target_only = run_session(False, LINEAR)
    paused = run_session(True, LINEAR)  # the drafter never has anything
    probes = GoodputDraftLength.PROBE_EVERY + 1  # steps between two probes, the probe included
    assert paused["stats"].speculation_paused_steps > 0
    assert paused["decode"] == [4] * 6 and sum(target_only["decode"]) == NEW_TOKENS  # its blocks: its steps
    assert paused["propose"] == len(paused["decode"]) // probes  # one lookup per probe, not one per step
    # between two probes, one decode stream of the paused steps' tokens (none decoded past the next probe)
    assert paused["streams"][0] == 4 * GoodputDraftLength.PROBE_EVERY
    assert paused["k"] == 0 or len(paused["decode"]) % probes == GoodputDraftLength.PROBE_EVERY


def test_a_probe_that_drafts_is_verified_and_a_speculating_session_keeps_its_dry_ramp():
    # The probe has a draft: it is verified (and rejected here), and the session pauses again.
    paused = run_session(True, LINEAR, drafts=lambda i: [5, 6])
    assert len(paused["verify"]) >= 1 and paused["verify"][0] >= 1
    assert paused["stats"].speculation_paused_steps > 0
    # A session that speculates (drafting pays) and finds no draft decodes 1, 2, then 4 tokens per call.
    dry = run_session(True, FLAT)
    assert dry["decode"][:3] == [1, 2, 4] and dry["propose"] == len(dry["decode"]) - 1  # not the last token


def _evidence(weak: float, strong: float):
    from orchestrator.policy.draft_length import DraftEvidence

    ev = DraftEvidence()
    for _ in range(100):
        ev.update([weak] * 3, verified=3, accepted=0)  # short weak matches: rejected
        ev.update([strong] * 16, verified=16, accepted=16)  # long confident matches: a quotation, accepted
    return ev


def llamacpp_profile() -> list[float]:
    from tests.test_draft_length import llamacpp_curve

    return llamacpp_curve()


def test_a_free_drafters_weak_drafts_decode_on_the_stream_as_a_target_only_session_does():
    """The suffix drafter drafts at every block (microseconds); a draft that does not pay is not verified, and the
    session's tokens come from one decode stream exactly as a target-only session's do: no Decode call, no Verify."""
    target_only = run_session(False, llamacpp_profile())
    weak = run_session(True, llamacpp_profile(), strategy="suffix", score=2.0**2, drafts=lambda i: [5, 6, 7],
                       evidence=_evidence(2.0**2, 2.0**18))
    assert weak["verify"] == [] and weak["unary"] == []
    # its first token at once, then blocks growing while nothing pays
    assert weak["decode"] == [1, 4, 8, 11]
    assert weak["streams"] == target_only["streams"] == [NEW_TOKENS]
    assert weak["propose"] == 4  # one lookup per block of the stream
    dry = run_session(True, llamacpp_profile(), strategy="suffix", evidence=_evidence(2.0**2, 2.0**18))
    assert dry["unary"] == [] and dry["streams"] == [NEW_TOKENS]  # no match at all: the stream as well


def test_a_weak_draft_streams_blocks_grow_to_a_target_only_streams():
    """Each block wakes the target's stream thread, the orchestrator, Redis and the client on the cores the target
    computes on: while the drafter keeps finding nothing that pays, a speculative session's blocks double from
    fallback_chunk to stream_block_tokens, and from then on it gets its tokens as a target-only session does."""
    n = 80
    target_only = run_session(False, llamacpp_profile(), new_tokens=n)
    weak = run_session(True, llamacpp_profile(), strategy="suffix", score=2.0**2, drafts=lambda i: [5, 6, 7],
                       evidence=_evidence(2.0**2, 2.0**18), new_tokens=n)
    assert target_only["decode"] == [1, 16, 16, 16, 16, 15]
    assert weak["decode"] == [1, 4, 8, 16, 16, 16, 16, 3] and weak["verify"] == [] and weak["unary"] == []
    assert len(weak["decode"]) <= len(target_only["decode"]) + 2  # two more wake-ups in 80 tokens, not 15
    assert weak["propose"] == len(weak["decode"])  # the drafter looks at every block's step


def test_a_streaming_session_switches_to_a_verify_when_its_drafter_finds_a_strong_match():
    """Blocks of the stream until a long confident match turns up; its Verify closes the stream; the weak steps
    right after it decode 1, then 2 tokens (a copy often goes on after a word or two, and then needs no stream
    closed), and the session takes the rest from a new stream."""
    out = run_session(True, llamacpp_profile(), strategy="suffix", evidence=_evidence(2.0**2, 2.0**18),
                      drafts=lambda i: [5] * 8 if i == 2 else [5, 6, 7],  # the third lookup finds a quotation
                      score=lambda draft: 2.0**18 if len(draft) == 8 else 2.0**2, accept=len)
    assert out["verify"] == [8] and out["unary"] == [1, 2]
    # blocks of 1 and 4 tokens, 8 accepted + the bonus, 1 + 2; the new stream starts at short blocks again
    assert out["streams"] == [NEW_TOKENS, NEW_TOKENS - 1 - 4 - 9 - 3]
    assert out["decode"][-2:] == [4, 3]


def _opened_stream(speculation: bool, generated: list[int], grow: bool = False, **cfg) -> tuple[int, ...]:
    """(block_tokens, first_block_tokens[, max_block_tokens when grow]) of the DecodeStream a session's TargetCall
    opens."""
    from orchestrator.loop.target_call import TargetCall

    rec = SessionRecord("s", [1, 2, 3], {"max_new_tokens": NEW_TOKENS, "speculation": speculation,
                                         "draft_len_limit": 16})
    rec.generated = list(generated)
    replica = types.SimpleNamespace(address="local:ngram", info=None)
    backends = Backends(None, types.SimpleNamespace(replicas=[replica]), None, set(), 100)
    state = LoopState(rec, LoopConfig(**cfg), backends, Measurements(), StreamControl())
    target, opened = TargetCall(state), []

    class Client:
        def decode_stream(self, call, timeout, wait_for_ready):
            opened.append((call.block_tokens, call.first_block_tokens) + ((call.max_block_tokens,) if grow else ()))
            return types.SimpleNamespace(first=DecodeReply([7], len(rec.committed), 1.0, False))

    target.client = Client()
    target.call = lambda fn, what: fn(1.0)
    target.stream_block(NEW_TOKENS, degraded=False, grow=grow)
    return opened[0]


def test_a_target_only_stream_sends_its_first_token_at_once_then_large_blocks():
    """Each block of a decode stream wakes the target's stream thread, the orchestrator, Redis and the client: a
    target-only generation takes its tokens in blocks of stream_block_tokens after a first block of one token
    (TTFT), a paused speculative session in blocks of fallback_chunk (each block one of its policy's steps)."""
    assert _opened_stream(False, []) == (16, 1)
    assert _opened_stream(False, [], stream_block_tokens=8) == (8, 1)
    assert _opened_stream(False, [5, 6]) == (16, 16)  # a stream reopened mid-generation: no early first block
    assert _opened_stream(True, []) == (4, 4)  # paused by the draft length: its steps
    assert _opened_stream(True, [], fallback_chunk=2, stream_block_tokens=8) == (2, 2)
    # a weak-draft stream: the first token at once, then blocks from fallback_chunk growing to stream_block_tokens
    assert _opened_stream(True, [], grow=True) == (4, 1, 16)
    assert _opened_stream(True, [5, 6], grow=True) == (4, 4, 16)  # after a Verify: short blocks again
