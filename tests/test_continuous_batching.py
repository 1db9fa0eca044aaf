"""The llama.cpp engine's step loop (continuous batching, target_service/engines/llama_steps.py) and the
DecodeStream RPC on the real SmolLM2 GGUF: every session's next work shares one llama_decode per step, sessions join
and leave a running batch, a prompt is fed in pieces beside running streams, and each session's tokens are exactly
those it gets alone. A batch that mixed up the sessions' rows or positions would change the tokens of these
prompts (each differs from the others), so these tests fail on a broken batch.

These tests need the llama_cpp module (scripts/bootstrap.sh installs llama-cpp-python): without it they FAIL."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from orchestrator.replicas.clients import DecodeCall, TargetClient
from specdec.core.sampling import SamplingParams
from target_service.server import build_server
from tests.harness import wait_until
from tests.test_llamacpp_engine import GREEDY, PROMPTS, make_engine, prompt_ids
from target_service.engines.jobs import DecodeTask, VerifyTask

pytestmark = pytest.mark.smollm2

MORE_PROMPTS = PROMPTS + [
    "Explain in two sentences why the sky is blue.",
    "Name three prime numbers greater than one hundred and say why each is prime.",
]


@pytest.fixture(scope="module")
def engine():
    e = make_engine(max_sessions=6)
    yield e
    e.close()


def alone(engine, sid: str, ids: list[int], n: int) -> list[int]:
    tokens = engine.decode(DecodeTask(sid, 0, ids, n, GREEDY, 0, 0))[0]
    engine.release(sid)
    return tokens


class StepRecorder:
    """Records each engine step's rows per session (seq id -> rows, in the batch's order) by wrapping the engine's
    _decode."""

    def __init__(self, engine):
        self.engine, self.steps = engine, []

    def __enter__(self):
        real = self.engine._decode

        def recording(entries, rollback, group_sizes=None):
            rows: dict[int, int] = {}
            for seq_ids, _, _, _ in entries:
                rows[seq_ids[0]] = rows.get(seq_ids[0], 0) + 1
            self.steps.append(rows)
            return real(entries, rollback, group_sizes)

        self.engine._decode = recording
        return self

    def __exit__(self, *exc):
        del self.engine._decode


def test_a_stream_gives_the_unary_decodes_tokens_in_blocks(engine):
    ids = prompt_ids(engine, PROMPTS[0])
    ref = alone(engine, "ref", ids, 20)
    stream = engine.decode_stream(DecodeTask("s", 0, ids, 20, GREEDY, 0, 0))
    first = stream.take(1, 30)
    assert first.tokens and first.tokens == ref[: len(first.tokens)]
    got = list(first.tokens)
    while True:
        block = stream.take(4, 30)
        assert len(block.tokens) >= 4 or block.finished
        got += block.tokens
        if block.finished:
            break
    assert got == ref and block.cached_len == len(ids) + 19
    engine.release("s")


def test_sessions_join_and_leave_a_running_batch_with_their_own_tokens(engine):
    prompts = [prompt_ids(engine, p) for p in MORE_PROMPTS]
    refs = [alone(engine, f"ref{i}", ids, 24) for i, ids in enumerate(prompts)]
    assert len({tuple(r) for r in refs}) == len(refs)  # distinct: a row mix-up shows
    counts_before = [value for value, _ in engine.step_counts()]
    with StepRecorder(engine) as rec:
        long_stream = engine.decode_stream(DecodeTask("a", 0, prompts[0], 24, GREEDY, 0, 0))
        got_a = list(long_stream.take(3, 60).tokens)  # "a" is generating when the others join
        joined = [engine.decode_stream(DecodeTask(f"j{i}", 0, prompts[i], 24, GREEDY, 0, 0)) for i in (1, 2)]
        leaver = engine.decode_stream(DecodeTask("leaver", 0, prompts[3], 24, GREEDY, 0, 0))
        got_leaver = list(leaver.take(5, 60).tokens)
        leaver.cancel()  # leaves the batch mid-way; the others go on
        outs = []
        for work in (long_stream, *joined):
            tokens = []
            while True:
                block = work.take(1, 60)
                tokens += block.tokens
                if block.finished:
                    break
            outs.append(tokens)
    assert got_a + outs[0] == refs[0]
    assert outs[1:] == [refs[1], refs[2]]
    assert got_leaver == refs[3][: len(got_leaver)]
    shared = [s for s in rec.steps if len(s) >= 3]
    assert shared, "no step held three sessions' rows: the streams did not share llama_decode calls"
    # in increasing sequence id order, which llama.cpp needs to put the sessions' rows in one ubatch
    assert all(list(s) == sorted(s) for s in rec.steps)
    steps, rows, ubatches = (after - before for after, before in
                             zip([value for value, _ in engine.step_counts()], counts_before))
    assert steps == len(rec.steps) and rows == sum(sum(s.values()) for s in rec.steps)
    assert steps <= ubatches < rows  # several sessions' rows shared ubatches
    leaver_seq = None
    with engine._lock:
        assert not engine._busy  # every work retired, the cancelled one too
        leaver_seq = engine._sequences["leaver"].seq_id
    assert all(leaver_seq not in s for s in rec.steps[-3:])  # the cancelled stream left the batch
    for sid in ("a", "j1", "j2", "leaver"):
        engine.release(sid)


def test_sessions_hold_the_lowest_free_sequence_ids(engine):
    """Dense ids keep a step's sessions consecutive (llama.cpp's split into ubatches, see _by_sequence)."""
    with engine._lock:
        held = {seq.seq_id for seq in engine._sequences.values()}
        lowest = [i for i in range(engine.max_sessions + 1) if i not in held][:3]
        ids = [engine._sequence(f"dense{i}").seq_id for i in range(3)]
        assert ids == lowest
        engine._drop("dense1")
        assert engine._sequence("dense3").seq_id == lowest[1]  # the freed hole first, not a higher id
        for sid in ("dense0", "dense2", "dense3"):
            engine._drop(sid)


def test_a_prompt_joins_in_pieces_without_stalling_running_streams(engine):
    from specdec.eval_prompts import PROMPTS as BENCH_PROMPTS

    long_ids = next(prompt_ids(engine, p.text) for p in BENCH_PROMPTS if p.kind == "summary")
    assert len(long_ids) > engine.PREFILL_ROWS_PER_STEP  # two pieces or more
    short = prompt_ids(engine, PROMPTS[1])
    ref_long, ref_short = alone(engine, "rl", long_ids, 8), alone(engine, "rs", short, 40)
    with StepRecorder(engine) as rec:
        running = engine.decode_stream(DecodeTask("run", 0, short, 40, GREEDY, 0, 0))
        running.take(2, 60)
        newcomer = engine.decode_stream(DecodeTask("new", 0, long_ids, 8, GREEDY, 0, 0))
        outs = []
        for work in (newcomer, running):
            tokens = []
            while not (block := work.take(1, 60)).finished:
                tokens += block.tokens
            outs.append(tokens + block.tokens)
    assert outs[0] == ref_long
    assert ref_short[-len(outs[1]):] == outs[1]
    with engine._lock:
        run_seq, new_seq = engine._sequences["run"].seq_id, engine._sequences["new"].seq_id
    prompt_steps = [s for s in rec.steps if s.get(new_seq, 0) > 1]
    assert len(prompt_steps) >= 2  # the prompt came in pieces ...
    assert all(s.get(run_seq) == 1 for s in prompt_steps)  # ... each beside the running stream's token
    assert all(s[new_seq] <= engine.PREFILL_ROWS_PER_STEP for s in prompt_steps)
    for sid in ("run", "new"):
        engine.release(sid)


def test_a_verify_block_joins_a_streams_step_as_it_runs_alone(engine):
    ids_v, ids_s = (prompt_ids(engine, p) for p in PROMPTS)
    ref = alone(engine, "vref", ids_v, 6)
    block = ref[:3] + [(ref[3] + 1) % engine.vocab_size]
    ref_s = alone(engine, "sref", ids_s, 30)
    engine.prefill("v", 0, ids_v)
    stream = engine.decode_stream(DecodeTask("s", 0, ids_s, 30, GREEDY, 0, 0))
    stream.take(2, 60)
    steps_before = engine.steps
    out = engine.verify(VerifyTask("v", len(ids_v), [], block, None, GREEDY, 0, 0))
    assert (out.num_accepted, out.next_token, out.cached_len) == (3, ref[3], len(ids_v) + 3)
    assert out.batch_size == 2 and engine.steps > steps_before  # it shared the stream's step
    tokens = []
    while not (b := stream.take(1, 60)).finished:
        tokens += b.tokens
    assert ref_s[-len(tokens + b.tokens):] == tokens + b.tokens
    for sid in ("v", "s"):
        engine.release(sid)


def test_a_sampled_stream_is_the_unary_decodes_random_stream(engine):
    ids = prompt_ids(engine, PROMPTS[0])
    params = SamplingParams(temperature=0.9, top_k=40)
    unary = engine.decode(DecodeTask("u", 0, ids, 12, params, 7, 3))[0]
    engine.release("u")
    work = engine.decode_stream(DecodeTask("st", 0, ids, 12, params, 7, 3))
    tokens = []
    while not (b := work.take(4, 60)).finished:
        tokens += b.tokens
    assert tokens + b.tokens == unary
    engine.release("st")


@pytest.fixture(scope="module")
def served(engine):
    server = build_server(engine, "127.0.0.1:0").start()
    client = TargetClient(server.address)
    yield engine, client
    client.close()
    server.stop(0)


def test_the_decode_stream_rpc_sends_blocks_equal_to_a_unary_decode(served):
    engine, client = served
    ids = prompt_ids(engine, PROMPTS[1])
    ref = client.decode(DecodeCall("rpc-ref", ids, 0, 30, GREEDY), 60.0)
    client.release("rpc-ref")
    stream = client.decode_stream(DecodeCall("rpc", ids, 0, 30, GREEDY, block_tokens=4, first_block_tokens=1), 60.0)
    blocks = [stream.first]
    while (d := stream.next()) is not None:
        blocks.append(d)
    assert len(blocks[0].tokens) >= 1 and all(len(b.tokens) >= 4 for b in blocks[1:-1])
    assert [t for b in blocks for t in b.tokens] == ref.tokens
    assert blocks[-1].cached_len == ref.cached_len == len(ids) + 29
    client.release("rpc")


def test_a_growing_decode_streams_blocks_double_up_to_max_block_tokens(served):
    """A weak-draft session's stream: its first token, then blocks of 4, 8, then 16 tokens (each block wakes the
    target's stream thread and the orchestrator), never over half the tokens left (the drafter is shown each block
    but the last): the same tokens as one Decode, in about 9 messages, not 17."""
    engine, client = served
    ids = prompt_ids(engine, PROMPTS[1])
    ref = client.decode(DecodeCall("grow-ref", ids, 0, 64, GREEDY), 60.0)
    client.release("grow-ref")
    call = DecodeCall("grow", ids, 0, 64, GREEDY, block_tokens=4, first_block_tokens=1, max_block_tokens=16)
    stream = client.decode_stream(call, 60.0)
    blocks = [stream.first]
    while (d := stream.next()) is not None:
        blocks.append(d)
    sizes = [len(b.tokens) for b in blocks]
    assert sizes[0] >= 1 and sizes[1] >= 4 and sizes[2] >= 8 and sizes[3] >= 16
    assert len(blocks) <= 10 and sizes[-1] <= 8
    assert [t for b in blocks for t in b.tokens] == ref.tokens
    client.release("grow")


def test_a_cancelled_stream_stops_the_engine_decoding_it(served):
    engine, client = served
    ids = prompt_ids(engine, PROMPTS[0])
    stream = client.decode_stream(DecodeCall("cx", ids, 0, 400, GREEDY, block_tokens=1), 60.0)
    assert stream.next() is not None
    stream.cancel()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with engine._lock:
            if not engine._busy and not any(w.session_id == "cx" for w in engine._works):
                break
        time.sleep(0.02)
    with engine._lock:
        cached = len(engine._sequences["cx"].tokens)
    assert cached < len(ids) + 200  # stopped long before its 400 tokens
    time.sleep(0.3)
    with engine._lock:
        assert len(engine._sequences["cx"].tokens) == cached
    client.release("cx")


def test_a_stream_with_a_stale_prefix_is_a_cache_miss_and_a_resend_continues_it(served):
    engine, client = served
    ids = prompt_ids(engine, PROMPTS[0])
    ref = client.decode(DecodeCall("miss-ref", ids, 0, 10, GREEDY), 60.0).tokens
    client.release("miss-ref")
    committed = ids + ref[:4]
    stream = client.decode_stream(DecodeCall("miss", committed, len(committed) - 1, 6, GREEDY, block_tokens=2), 60.0)
    assert stream.resynced  # the target held nothing: the whole context was resent
    tokens = list(stream.first.tokens)
    while (d := stream.next()) is not None:
        tokens += d.tokens
    assert tokens == ref[4:]
    client.release("miss")


def test_decode_stream_bad_input_is_a_clear_error(served):
    engine, client = served
    limit = engine.loaded.max_context
    cases = [
        (DecodeCall("bad", [1, 2], 0, 0, GREEDY), "max_tokens must be in"),
        (DecodeCall("bad", [engine.vocab_size + 5], 0, 4, GREEDY), "outside the vocabulary"),
        (DecodeCall("bad", [1, 2], 0, 4, GREEDY, block_tokens=limit + 1), "block_tokens must be at most"),
        (DecodeCall("bad", [1, 2], 0, 4, GREEDY, block_tokens=4, max_block_tokens=2),
         "max_block_tokens (2) is below block_tokens (4)"),
    ]
    for call, words in cases:
        with pytest.raises(grpc.RpcError) as err:
            client.decode_stream(call, 10.0)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in err.value.details()
    assert not engine._works  # nothing was started for them


def test_random_decode_stream_requests_get_clear_statuses(served):
    """The fuzz of tests/test_fuzz.py against the llama.cpp engine's own DecodeStream (its step loop): random
    well-formed requests, short ones so that the real model answers them quickly, end with a clear status in time,
    and leave no work behind."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from specdec.v1 import common_pb2, target_pb2
    from tests.test_fuzz import block_sizes, delta, sampling, session_ids, u32

    engine, client = served
    channel = grpc.insecure_channel(client.address)
    method = channel.unary_stream("/specdec.v1.TargetService/DecodeStream",
                                  response_deserializer=target_pb2.DecodeResponse.FromString)
    # Mostly well-formed, so that streams run too: each field valid first, then anything.
    blocks = st.one_of(st.integers(0, 8), st.integers(0, 8), block_sizes)
    prompt = st.builds(common_pb2.TokenDelta, tokens=st.lists(st.integers(0, 70), min_size=1, max_size=8))
    requests = st.builds(target_pb2.DecodeRequest, session_id=st.one_of(st.text(min_size=1, max_size=20), session_ids),
                         delta=st.one_of(prompt, delta),
                         sampling=st.one_of(st.just(common_pb2.SamplingParams()), sampling),
                         max_tokens=st.one_of(st.integers(1, 6), st.integers(0, 6), u32),
                         stop_token_ids=st.lists(u32, max_size=3),
                         block_tokens=blocks, first_block_tokens=blocks, max_block_tokens=blocks)

    seen: set[str] = set()

    @settings(max_examples=30, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
    @given(requests)
    def one(msg):
        t0 = time.monotonic()
        try:
            for reply in method(msg.SerializeToString(), timeout=20):
                assert 1 <= len(reply.tokens) <= max(1, msg.max_tokens)
            seen.add("OK")
        except grpc.RpcError as e:
            seen.add(e.code().name)
            assert e.code() not in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL,
                                    grpc.StatusCode.DEADLINE_EXCEEDED), (msg, e.details())
            assert e.details() and len(e.details()) < 500
        assert time.monotonic() - t0 < 10, msg

    one()
    channel.close()
    assert "OK" in seen and "INVALID_ARGUMENT" in seen, seen  # both decoded streams and refusals were tried
    assert wait_until(lambda: not engine._works and not engine._busy, 5.0)
    for sid in list(engine._sequences):  # the fuzz's sessions leave the cache to the tests after this one
        engine.release(sid)


def test_a_stream_ends_cleanly_before_its_deadline(served):
    """A stream longer than its deadline allows ends after a block, before the deadline, so the caller opens the
    next one instead of seeing DEADLINE_EXCEEDED (which would count against a busy target)."""
    engine, client = served
    ids = prompt_ids(engine, PROMPTS[1])
    client.prefill("dl", ids, 0, 60.0)  # the stream's time goes to decoding, even on a loaded machine
    stream = client.decode_stream(DecodeCall("dl", ids, len(ids), 1500, GREEDY, block_tokens=2), 6.0)
    n = len(stream.first.tokens)
    while (d := stream.next()) is not None:
        n += len(d.tokens)
    assert 1 < n < 1500
    client.release("dl")


def test_concurrent_unary_calls_still_share_steps():
    """Unary Decode calls from several threads (the orchestrator's degraded path) join each other's steps."""
    e = make_engine(max_sessions=4)
    try:
        ids = [prompt_ids(e, p) for p in MORE_PROMPTS[:3]]
        solo = [alone(e, f"solo{i}", p, 10) for i, p in enumerate(ids)]
        works_before, steps_before = e.step_works, e.steps
        results: dict[int, list[int]] = {}
        threads = [threading.Thread(target=lambda i=i: results.__setitem__(
            i, e.decode(DecodeTask(f"c{i}", 0, ids[i], 10, GREEDY, 0, 0))[0])) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert [results[i] for i in range(3)] == solo
        assert e.step_works - works_before > e.steps - steps_before  # some step held several sessions
    finally:
        e.close()


def test_reset_prompt_cache_drops_the_kept_prompts_over_grpc(served):
    """ResetPromptCache (what the serving benchmark calls before each pass) empties the prompt cache: the same
    prompt is then computed again, not reused."""
    from specdec.eval_prompts import PROMPTS as EVAL_PROMPTS, encode

    engine, client = served
    ids = encode(next(p for p in EVAL_PROMPTS if p.kind == "summary"), engine.loaded.tokenizer)
    engine.prefill("kept", 0, ids[:-1], prompt_len=len(ids))
    engine.release("kept")
    assert client.reset_prompt_cache() >= 1
    assert client.reset_prompt_cache() == 0
    computed, reused = engine.prompt_rows_computed(), engine.prompt_rows_reused()
    engine.prefill("again", 0, ids[:-1], prompt_len=len(ids))
    engine.release("again")
    assert (engine.prompt_rows_computed() - computed, engine.prompt_rows_reused() - reused) == (len(ids) - 1, 0)


def test_ubatch_count_follows_llama_cpps_split_over_streams():
    """llama_batch_allocr::split_equal (sequential): a run of consecutive, increasing sequence ids a ubatch, the
    same rows from each; what the engine counts in step_ubatches."""
    from target_service.engines.llama_steps import ubatch_count

    assert ubatch_count([]) == 0
    assert ubatch_count([(0, 1), (1, 1), (2, 1)]) == 1
    assert ubatch_count([(2, 1), (1, 1), (0, 1)]) == 3  # descending: one each
    assert ubatch_count([(0, 1), (2, 1), (4, 1)]) == 3  # gaps: one each
    assert ubatch_count([(0, 1), (1, 1), (3, 1), (4, 1)]) == 2
    assert ubatch_count([(0, 1), (1, 5), (2, 1)]) == 2  # 3 x 1 row, then the block's other 4
    assert ubatch_count([(0, 2), (1, 3), (2, 5)]) == 3
