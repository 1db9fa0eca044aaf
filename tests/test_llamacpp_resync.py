"""A session whose llama.cpp cache is lost (evicted, or its target replica gone) is resynced: the orchestrator resends
the committed context from position 0 (orchestrator/replicas/clients.py, _call_with_resync) with the prompt's length,
and the target prefills it as one group: the prompt in its prompt context (target_service/engines/llama_prompt.py),
the generated tokens in the main context. llama.cpp's CPU numerics depend on how many of a sequence's rows one
llama_decode computes, so the engine feeds a long group in pieces of SPLIT_SAFE_ROWS rows, whose results equal
feeding the rows one by one (target_service/engines/llamacpp.py, _chunk_bounds). These tests decode greedily uninterrupted and again with the
cache dropped at several points (a real LRU eviction, and a move to a second engine), and require the same tokens
and bitwise the same logits at every step (the context fed at once gave logits up to 1.2 away and a different
greedy token on the code prompt).

These tests need the llama_cpp module (scripts/bootstrap.sh installs llama-cpp-python): without it they FAIL."""

from __future__ import annotations

import numpy as np
import pytest

from specdec.core.kv_cache import CacheMiss
from specdec.core.sampling import SamplingParams
from specdec.models import smollm2_gguf_path
from tests.test_llamacpp_engine import MISSING, prompt_ids
from target_service.engines.jobs import VerifyTask
from target_service.settings import TargetSettings

pytestmark = pytest.mark.smollm2

GREEDY = SamplingParams()
# (prompt kind, new tokens, generated tokens when the cache is evicted, ... when the session moves to another target)
FAST = ("summary", 16, (1, 6), 11)  # resent contexts of 167 to 177 rows (they were fed at once before)
CASES = [pytest.param(*FAST, id="summary-fast"),
         *(pytest.param(kind, 40, (5, 21), 33, id=kind, marks=pytest.mark.heavy)
           for kind in ("chat", "code", "summary"))]


def make_engine(**kw):
    if MISSING:
        pytest.fail(MISSING)
    from target_service.engines.llamacpp import LlamaCppEngine

    # one session's stream: any other session evicts it
    return LlamaCppEngine(smollm2_gguf_path(), TargetSettings(model="smollm2", max_sessions=1,
                                                              llama_session_context=512, **kw))


class Spy:
    """The last logits row of every llama_decode step an engine runs that wants logits (through its real verify
    path; one session here)."""

    def __init__(self, monkeypatch, *engines):
        self.rows: list[np.ndarray] = []
        for engine in engines:
            decode = engine._decode

            def spy(entries, *args, decode=decode):
                out = decode(entries, *args)
                if len(out):  # not a prompt piece
                    self.rows.append(out[-1].copy())
                return out

            monkeypatch.setattr(engine, "_decode", spy)


def step(engine, session: str, committed: list[int], pos: int, prompt_len: int) -> tuple[int, bool]:
    """One target-only step as the orchestrator's Verify of an empty block: send committed[pos:], and after a
    cache miss the whole context from 0, with the prompt's length. The next token and whether it resynced."""
    try:
        task = VerifyTask(session, pos, committed[pos:], [], None, GREEDY, 0, 0, prompt_len=prompt_len)
        return engine.verify(task).next_token, False
    except CacheMiss:
        task = VerifyTask(session, 0, committed, [], None, GREEDY, 0, 0, prompt_len=prompt_len)
        return engine.verify(task).next_token, True


def generate(engines, prompt: list[int], new_tokens: int, evict_at=(), move_at=None):
    """Greedy tokens, decoded on engines[0] until `move_at` generated tokens, then on engines[1]; before the
    steps in `evict_at` another session takes the one KV stream. Returns the tokens and the resyncs."""
    committed, pos, resyncs = list(prompt), 0, 0
    engine = engines[0]
    for i in range(new_tokens):
        if i in evict_at:
            engine.prefill("intruder", 0, prompt[:8])
            assert "s" not in engine
        if i == move_at:
            engine = engines[1]
        token, resynced = step(engine, "s", committed, pos, len(prompt))
        resyncs += resynced
        pos = len(committed)  # the token's KV is written by the next step
        committed.append(token)
    for e in engines:
        e.release("s")
    return committed[len(prompt):], resyncs


@pytest.fixture(scope="module")
def engines():
    pair = [make_engine(), make_engine()]
    yield pair
    for e in pair:
        e.close()


@pytest.mark.parametrize("kind, new_tokens, evict_at, move_at", CASES)
def test_a_resynced_session_decodes_bitwise_as_the_uninterrupted_one(engines, monkeypatch, kind, new_tokens,
                                                                     evict_at, move_at):
    from specdec.eval_prompts import PROMPTS

    prompt = prompt_ids(engines[0], next(p.text for p in PROMPTS if p.kind == kind))
    spy = Spy(monkeypatch, *engines)
    tokens, resyncs = generate(engines, prompt, new_tokens)
    reference, spy.rows = spy.rows, []
    assert resyncs == 0 and len(reference) == new_tokens
    resumed, resyncs = generate(engines, prompt, new_tokens, evict_at, move_at)
    assert resyncs == len(evict_at) + 1
    # The stronger check: every step's logits bitwise, after each resync and every step that follows.
    assert resumed == tokens
    assert len(spy.rows) == new_tokens
    drift = [float(np.abs(a - b).max()) for a, b in zip(reference, spy.rows)]
    assert max(drift) == 0.0, f"logits after a resync differ by up to {max(drift)}"


def test_no_call_computes_more_than_the_split_safe_rows_of_one_session():
    from target_service.engines.llamacpp import SPLIT_SAFE_ROWS, _chunk_bounds

    groups = [1, 200, 3, 48, 49, 5, 512, 2, 700, 4]
    bounds = _chunk_bounds(groups, 512)
    starts = np.cumsum([0, *groups])
    assert bounds[0][0] == 0 and bounds[-1][1] == starts[-1]
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))  # in order, nothing left out
    for lo, hi in bounds:
        sessions = [(max(lo, s), min(hi, e)) for s, e in zip(starts, starts[1:]) if s < hi and e > lo]
        assert all(e - s <= SPLIT_SAFE_ROWS for s, e in sessions)
        assert hi - lo <= 512
    assert len(_chunk_bounds([200], 32)) == 7  # a batch smaller than the safe rows still bounds each call
