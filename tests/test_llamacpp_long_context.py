"""Greedy exactness of the llama.cpp engine on a long context (the benchmark's rag prompt, 1416 tokens), at the
2 threads the benchmark's target runs with.

llama.cpp's CPU flash attention picks its kernel by the shape of the ubatch: one query row of one sequence over
512 or more KV cells splits the keys into one chunk per thread (each with its own float16 accumulator, merged at
the end), 64 or more rows of a sequence run in tiles, any other shape runs each row over all keys in one pass. With
float16 keys and values a target-only step (one row alone) and the same row inside a verify block, or beside other
sessions' rows, then differed by up to 1.06 in the logits, and the rag prompt's greedy output flipped at its 26th
token (a top-2 margin of 0.014). The engine's main context keeps q8_0 values (target_service/engines/llamacpp.py,
KV_BYTES_PER_VALUE), which takes every shape through the one-pass kernel: the rows below must be bitwise equal,
however they are batched. A prompt (its length sent with the delta) is computed in the tiled kernel of the prompt
context (target_service/engines/llama_prompt.py) in calls of at least 64 rows: its cache must not depend on how
the prompt was cut into calls.

These tests need the llama_cpp module (scripts/bootstrap.sh installs llama-cpp-python): without it they FAIL."""

from __future__ import annotations

import numpy as np
import pytest

from specdec.core.sampling import SamplingParams
from specdec.eval_prompts import PROMPTS, encode
from specdec.models import smollm2_gguf_path
from target_service.engines.jobs import DecodeTask, VerifyTask
from target_service.settings import TargetSettings
from tests.test_llamacpp_engine import MISSING

pytestmark = pytest.mark.smollm2

GREEDY = SamplingParams()
THREADS = 2  # the split into per-thread chunks needs more than one thread (1 thread: one chunk, no difference)


@pytest.fixture(scope="module")
def engine():
    if MISSING:
        pytest.fail(MISSING)
    from target_service.engines.llamacpp import LlamaCppEngine

    patch = pytest.MonkeyPatch()
    patch.setattr(LlamaCppEngine, "DEFAULT_WAIT_S", 600.0)  # 1416-token prefills on a loaded CI machine
    e = LlamaCppEngine(smollm2_gguf_path(), TargetSettings(model="smollm2", threads=THREADS, max_sessions=6))
    yield e
    e.close()
    patch.undo()


@pytest.fixture(scope="module")
def rag_ids(engine):
    ids = encode(next(p for p in PROMPTS if p.kind == "rag"), engine.loaded.tokenizer)
    assert len(ids) > 1024  # far past the 512 KV cells where llama.cpp's single-row kernel changes
    return ids


def rows_of(engine, feeds):
    """One llama_decode per step: feeds[i] = [(session, tokens, logits rows wanted), ...]; each step's logits."""
    def run():
        with engine._lock:
            out = []
            for step in feeds:
                rows = [(engine._sequence(sid, keep={s for s, _, _ in step}), toks, n) for sid, toks, n in step]
                out.append([np.array(x) for x in engine._forward(rows)])
            return out

    return engine._on_compute(run)


def test_a_row_alone_in_a_block_and_beside_other_sessions_gives_bitwise_the_same_logits(engine, rag_ids):
    """Target-only steps (one row per llama_decode) against the same tokens as one verify block, and against the
    same single rows sharing each llama_decode with three other sessions' rows, on the 1416-token context."""
    sessions = ("alone", "block", "crowded", "other0", "other1", "other2")
    for sid in sessions[:3]:
        engine.prefill(sid, 0, rag_ids[:-1], prompt_len=len(rag_ids))
    for i, p in enumerate(PROMPTS[:3]):
        engine.prefill(f"other{i}", 0, encode(p, engine.loaded.tokenizer)[:40])
    try:
        fed, alone = [rag_ids[-1]], []
        for _ in range(6):  # greedy target-only steps
            alone.append(rows_of(engine, [[("alone", fed[-1:], 1)]])[0][0][-1])
            fed.append(int(alone[-1].argmax()))
        fed, alone = fed[:-1], np.stack(alone)
        block = rows_of(engine, [[("block", fed, len(fed))]])[0][0]
        crowded = np.concatenate([step[0] for step in rows_of(
            engine, [[("crowded", [t], 1)] + [(f"other{i}", [t], 1) for i in range(3)] for t in fed])])
        gap_block, gap_crowded = np.abs(alone - block).max(), np.abs(alone - crowded).max()
        assert np.array_equal(block, alone), f"a verify block's rows differ from single steps by up to {gap_block}"
        assert np.array_equal(crowded, alone), f"rows beside other sessions differ by up to {gap_crowded}"
    finally:
        for sid in sessions:
            engine.release(sid)


def test_greedy_verification_on_the_rag_prompt_equals_target_only_decoding(engine, rag_ids):
    """The defect the benchmark showed: 32 target-only tokens of the rag prompt, and the same positions decided by
    verify calls with 4-token drafts, every other block with a wrong third token (a rejection, its KV cropped)."""
    n = 32
    reference = engine.decode(DecodeTask("ref", 0, rag_ids, n, GREEDY, prompt_len=len(rag_ids)))[0]
    engine.release("ref")
    out: list[int] = []
    cached = 0
    context = list(rag_ids)
    block = 0
    while len(out) < n:
        draft = list(reference[len(out):len(out) + 4])
        if block % 2 and len(draft) > 2:
            draft[2] = (draft[2] + 1) % engine.vocab_size
        outcome = engine.verify(VerifyTask("spec", cached, context[cached:], draft, None, GREEDY, 0, block,
                                           prompt_len=len(rag_ids)))
        new = draft[:outcome.num_accepted] + [outcome.next_token]
        out += new
        context += new
        cached = outcome.cached_len
        block += 1
    engine.release("spec")
    assert out[:n] == list(reference)


def feed_prompt(engine, sid: str, tokens: list[int], piece: int) -> None:
    """The prompt through the prompt context in calls of `piece` rows (the last ones cut as prompt_piece does),
    then moved to the session's sequence: what the step loop does with other piece sizes."""
    from target_service.engines.llama_prompt import prompt_piece

    def run():
        with engine._lock:
            seq = engine._sequence(sid)
            engine._prompt_reset()  # the slot computes the whole prompt
            at = 0
            while at < len(tokens):
                n = prompt_piece(len(tokens) - at, piece, engine.batch_tokens)
                engine._decode_prompt(tokens[at:at + n], at)
                engine._prompt_tokens.extend(tokens[at:at + n])
                at += n
            engine._move_prompt(seq.seq_id)
            seq.tokens.extend(tokens)
            engine._prompt_reset()

    engine._on_compute(run)


def greedy_rows(engine, sid: str, first: int, n: int) -> np.ndarray:
    """n greedy target-only steps from `first`: each step's logits row."""
    fed, rows = [first], []
    for _ in range(n):
        rows.append(rows_of(engine, [[(sid, fed[-1:], 1)]])[0][0][-1])
        fed.append(int(rows[-1].argmax()))
    return np.stack(rows)


def test_the_prompt_context_gives_the_same_cache_whatever_calls_brought_the_prompt(engine, rag_ids):
    """The rag prompt through the prompt context in calls of 64, 96 and 512 rows (and the step loop's own), then
    4 greedy steps in the main context: bitwise the same logits each way."""
    prompt, ways = rag_ids[:-1], {}
    engine.forget_prompts()
    engine.prefill("loop", 0, prompt, prompt_len=len(rag_ids))
    ways["loop"] = greedy_rows(engine, "loop", rag_ids[-1], 4)
    engine.release("loop")
    for piece in (64, 96, 512):
        feed_prompt(engine, f"p{piece}", prompt, piece)
        ways[piece] = greedy_rows(engine, f"p{piece}", rag_ids[-1], 4)
        engine.release(f"p{piece}")
    for way, rows in ways.items():
        gap = np.abs(rows - ways["loop"]).max()
        assert np.array_equal(rows, ways["loop"]), f"prompt calls of {way} rows differ by up to {gap}"


def test_a_resent_context_is_rebuilt_bit_for_bit_after_the_prompt_context(engine, rag_ids):
    """A session decoded 6 tokens after the rag prompt (prompt context, then main steps), then resent whole from 0
    (prompt + generated, as after an eviction): its next steps equal the uninterrupted session's bitwise."""
    n = len(rag_ids)
    engine.forget_prompts()
    tokens = engine.decode(DecodeTask("first", 0, rag_ids, 6, GREEDY, prompt_len=n))[0]
    context = list(rag_ids) + tokens[:-1]
    onward = greedy_rows(engine, "first", tokens[-1], 3)
    engine.release("first")
    engine.forget_prompts()
    engine.prefill("again", 0, context, prompt_len=n)
    resent = greedy_rows(engine, "again", tokens[-1], 3)
    engine.release("again")
    assert np.array_equal(onward, resent), f"the resent context differs by up to {np.abs(onward - resent).max()}"


@pytest.mark.heavy
def test_the_main_context_is_split_invariant_over_the_whole_rag_prompt(engine, rag_ids):
    """Without a prompt length the prompt goes through the main context: fed in calls of 512 and of 63 rows (the
    step loop's biggest and a size under the tiled kernel's 64) it gives bitwise the same cache at 2 threads."""
    ways = {}
    for piece in (512, 63):
        sid = f"main{piece}"
        rows_of(engine, [[(sid, rag_ids[a:min(a + piece, len(rag_ids) - 1)], 0)]
                         for a in range(0, len(rag_ids) - 1, piece)])
        ways[piece] = greedy_rows(engine, sid, rag_ids[-1], 3)
        engine.release(sid)
    assert np.array_equal(ways[512], ways[63]), f"differ by up to {np.abs(ways[512] - ways[63]).max()}"


def test_a_prompt_fed_beside_a_decoding_stream_gives_the_cache_it_gets_alone(engine, rag_ids):
    """The rag prompt through the prompt context alone (512-row calls), and again while another session decodes
    (PREFILL_ROWS_PER_STEP-row calls between the stream's steps): bitwise the same logits in the steps after it."""
    n = len(rag_ids)
    engine.forget_prompts()
    engine.prefill("solo", 0, rag_ids[:-1], prompt_len=n)
    alone = greedy_rows(engine, "solo", rag_ids[-1], 3)
    engine.release("solo")
    engine.forget_prompts()  # computed again, beside the stream
    stream = engine.decode_stream(DecodeTask("busy", 0, rag_ids[:40], 300, GREEDY))
    stream.take(1, 600.0)  # decoding before the prompt arrives
    try:
        engine.prefill("beside", 0, rag_ids[:-1], prompt_len=n)
        steps_beside = len(stream.produced)
    finally:
        stream.cancel()
    beside = greedy_rows(engine, "beside", rag_ids[-1], 3)
    for sid in ("beside", "busy"):
        engine.release(sid)
    assert steps_beside > 1, "the stream did not decode beside the prompt"
    assert np.array_equal(alone, beside), f"differ by up to {np.abs(alone - beside).max()}"


def test_a_kept_prompt_gives_a_prompt_that_starts_with_it_its_rows_bit_for_bit(engine, rag_ids):
    """The rag prompt computed whole; then its first 700 tokens as a prompt of their own, kept in the prompt
    context, and the whole prompt again: it computes only the rows after the kept ones; and once more: all its rows
    are kept. The greedy steps after it are bitwise those after the whole computation."""
    n = len(rag_ids)
    engine.forget_prompts()
    engine.prefill("whole", 0, rag_ids[:-1], prompt_len=n)
    whole = greedy_rows(engine, "whole", rag_ids[-1], 4)
    engine.release("whole")
    engine.forget_prompts()
    head = rag_ids[:700]
    engine.prefill("head", 0, head[:-1], prompt_len=len(head))  # its region: the first 699 rows
    engine.release("head")
    for sid, kept in (("grown", 699), ("repeat", n - 1)):
        computed, reused = engine.prompt_context_rows, engine.prompt_reused_rows
        engine.prefill(sid, 0, rag_ids[:-1], prompt_len=n)
        assert (engine.prompt_reused_rows - reused, engine.prompt_context_rows - computed) == (kept, n - 1 - kept)
        rows = greedy_rows(engine, sid, rag_ids[-1], 4)
        engine.release(sid)
        assert np.array_equal(rows, whole), f"{sid}: differs by up to {np.abs(rows - whole).max()}"


def test_a_prompt_reuses_a_kept_prefix_only_where_its_rest_stays_tiled():
    from target_service.engines.llama_prompt import PROMPT_TILE_ROWS, reused_prefix

    region = list(range(300))
    assert reused_prefix(region, region) == 300  # wholly kept: nothing to compute
    assert reused_prefix(region + [7, 8], region) == 300
    assert reused_prefix(region[:200], region) == 200
    assert reused_prefix(region[:290], region) == 300 - PROMPT_TILE_ROWS  # 10 rows left would not be tiled
    assert reused_prefix([9] + region[1:], region) == 0
    assert reused_prefix([], region) == 0
