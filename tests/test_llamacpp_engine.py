"""The llama.cpp target engine (target_service/engines/llamacpp.py) on the real SmolLM2 GGUF: speculative greedy
output through the services and the orchestrator equals the same engine's target-only output; a rejected block
leaves the sequence's cache as if it was never drafted; several sessions verify in one llama_decode with the
results each gets alone; sampling keeps the target's distribution; a killed draft degrades to target-only.

These tests need the llama_cpp module (scripts/bootstrap.sh installs llama-cpp-python): without it they FAIL."""

from __future__ import annotations

import json
import threading

import pytest
import torch

from orchestrator.replicas.clients import TargetClient
from specdec.core import sampling
from specdec.models import smollm2_gguf_path
from specdec.core.sampling import SamplingParams
from target_service.engines.jobs import DecodeTask, VerifyTask
from target_service.settings import TargetSettings
from tests.harness import start_stack
from tests.stats import chi_square_test, draws

try:
    import llama_cpp  # noqa: F401

    MISSING = None
except ImportError as e:  # a failure, not a skip: CI must not pass without the engine it ships
    MISSING = f"llama_cpp cannot be imported ({e}); install it with scripts/bootstrap.sh (pip install llama-cpp-python)"

pytestmark = pytest.mark.smollm2

GREEDY = SamplingParams()
PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number.",
    "List the days of the week, one per line, then list them again in reverse order.",
]


def make_engine(**kw):
    if MISSING:
        pytest.fail(MISSING)
    from target_service.engines.llamacpp import LlamaCppEngine

    # 7 sessions of 2048 tokens: 16384 KV cells with the profile's stream
    return LlamaCppEngine(smollm2_gguf_path(), TargetSettings(**{"model": "smollm2", "max_sessions": 7, **kw}))


@pytest.fixture(scope="module")
def engine():
    e = make_engine()
    yield e
    e.close()


@pytest.fixture(scope="module")
def unified_engine():
    """The unified KV cache (one pool of cells for all sessions): what tree verification needs."""
    e = make_engine(llama_kv_unified=True, llama_context=4096)
    yield e
    e.close()


def prompt_ids(engine, text: str) -> list[int]:
    ids = engine.loaded.tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                      add_generation_prompt=True, tokenize=True)
    return [int(t) for t in (ids["input_ids"] if hasattr(ids, "keys") else ids)]


def test_speculative_greedy_equals_the_engines_target_only_decoding(redis_url, engine):
    from specdec.eval_prompts import PROMPTS as EVAL_PROMPTS

    stack = start_stack(redis_url, draft="ngram", target_engine=engine)
    long_prompt = next(p.text for p in EVAL_PROMPTS if p.kind == "summary")  # ~170 tokens: the prompt context's
    try:
        proposed = accepted = 0
        rows_before, reused_before = engine.prompt_context_rows, engine.prompt_reused_rows
        for prompt in [*PROMPTS, long_prompt]:
            ref = stack.client.generate(prompt, max_new_tokens=48, chat=True, speculation=False)
            spec = stack.client.generate(prompt, max_new_tokens=48, chat=True, max_draft_len=4)
            assert spec.token_ids == ref.token_ids
            assert len(ref.text) > 20
            assert spec.stats["verify_steps"] > 0
            proposed += spec.stats["draft_tokens_proposed"]
            accepted += spec.stats["draft_tokens_accepted"]
        assert 0 < accepted < proposed  # both the accept and the reject path ran
        assert TargetClient(stack.target_server.address).info().dtype.startswith("llama.cpp")
        # the orchestrator sent the prompt's length: the long prompt went through the prompt context, and the
        # second time (the same prompt) its rows were the kept ones
        assert engine.prompt_context_rows - rows_before > 100
        assert engine.prompt_reused_rows - reused_before > 100
    finally:
        stack.stop()


def greedy_continuation(engine, sid: str, prefix_len: int, first: int, n: int) -> list[int]:
    tokens, _, _ = engine.decode(DecodeTask(sid, prefix_len, [first], n, GREEDY, 0, 0))
    return tokens


def test_rejected_block_leaves_the_cache_as_a_fresh_session(engine):
    ids = prompt_ids(engine, PROMPTS[0])
    engine.prefill("fresh", 0, ids)
    expected = engine.decode(DecodeTask("fresh", len(ids), [], 12, GREEDY, 0, 0))[0]
    # A block whose first token is wrong: nothing accepted, 4 drafted positions must leave the sequence.
    wrong = (expected[0] + 1) % engine.vocab_size
    engine.prefill("crop", 0, ids)
    out = engine.verify(VerifyTask("crop", len(ids), [], [wrong, 5, 6, 7], None, GREEDY, 0, 0))
    assert (out.num_accepted, out.next_token, out.cached_len) == (0, expected[0], len(ids))
    seq_id = engine._sequences["crop"].seq_id
    assert llama_cpp.llama_memory_seq_pos_max(engine._mem, seq_id) == len(ids) - 1
    # Two right tokens then a wrong one: two accepted, the rest cropped.
    block = [*expected[1:3], (expected[3] + 1) % engine.vocab_size, 9]
    out = engine.verify(VerifyTask("crop", len(ids), [expected[0]], block, None, GREEDY, 0, 1))
    assert (out.num_accepted, out.next_token, out.cached_len) == (2, expected[3], len(ids) + 3)
    assert llama_cpp.llama_memory_seq_pos_max(engine._mem, seq_id) == len(ids) + 2
    rest = greedy_continuation(engine, "crop", out.cached_len, out.next_token, 8)
    assert expected[:4] + rest == expected
    for sid in ("fresh", "crop"):
        assert engine.release(sid)
    assert "crop" not in engine and not engine.release("crop")


def test_two_sessions_verify_in_one_decode_as_they_do_alone(engine):
    prompts = [prompt_ids(engine, p) for p in PROMPTS]
    alone = []
    for i, ids in enumerate(prompts):
        engine.prefill(f"alone{i}", 0, ids)
        ref = engine.decode(DecodeTask(f"alone{i}", len(ids), [], 6, GREEDY, 0, 0))[0]
        block = ref[:2] + [(ref[2] + 1) % engine.vocab_size]  # 2 accepted, then a correction
        alone.append((ids, ref, block))
    jobs = []
    for i, (ids, _, block) in enumerate(alone):
        engine.prefill(f"both{i}", 0, ids[:-3])  # the rest arrives with the block, as a Verify's delta
        jobs.append(VerifyTask(f"both{i}", len(ids) - 3, ids[-3:], block, None, GREEDY).job())
    calls = []
    decode = engine._decode
    engine._decode = lambda entries, *a: calls.append(len({e[0] for e in entries})) or decode(entries, *a)
    try:
        engine.verify_many(jobs)
    finally:
        del engine._decode
    assert calls == [2]  # one llama_decode for both sessions' rows
    for job, (ids, ref, _) in zip(jobs, alone):
        out = job.outcome()
        assert (out.num_accepted, out.next_token, out.batch_size) == (2, ref[2], 2)
        assert out.cached_len == len(ids) + 2
        rest = greedy_continuation(engine, job.task.session_id, out.cached_len, out.next_token, 3)
        assert ref[:3] + rest == ref
    for sid in ("alone0", "alone1", "both0", "both1"):
        engine.release(sid)


def test_concurrent_sessions_share_the_engines_steps():
    batched = make_engine(batch_window_ms=5.0, max_batch=4)
    try:
        ids = [prompt_ids(batched, p) for p in PROMPTS]
        solo = [batched.decode(DecodeTask(f"solo{i}", 0, p, 10, GREEDY, 0, 0))[0] for i, p in enumerate(ids)]
        results: dict[int, list[int]] = {}

        def run(i):
            results[i] = batched.decode(DecodeTask(f"pair{i}", 0, ids[i], 10, GREEDY, 0, 0))[0]

        steps, works = batched.steps, batched.step_works
        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert [results[0], results[1]] == solo
        assert batched.step_works - works > batched.steps - steps  # some llama_decode held both sessions
    finally:
        batched.close()


def test_sampled_verification_keeps_the_target_distribution(engine):
    """One drafted token from a deliberately wrong q: the token the step emits (the draft if accepted, else
    the correction) is distributed as the target's own warped distribution p; chi-square at alpha 1e-3."""
    params = SamplingParams(temperature=1.0, top_k=6)
    ids = prompt_ids(engine, "Name a colour.")
    engine.prefill("p", 0, ids)
    with engine._lock:
        seq = engine._sequence("p")
        row = engine._forward([(seq, engine._sync(seq, len(ids), []), 1)])[0]
    p = sampling.warp_probs(torch.from_numpy(row[0]), params)
    top = torch.topk(p, 6).indices.tolist()
    q = torch.zeros(engine.vocab_size)
    q[top[-3:]] = 0.25  # the target's least likely three, over-weighted
    q[(max(top) + 1) % engine.vocab_size] = 0.25  # and one token the target never emits
    n = draws(600)
    samples = []
    for seed in range(n):
        drafted = int(sampling.sample(q, sampling.make_generator(seed, "draft")))
        out = engine.verify(VerifyTask("p", len(ids), [], [drafted], q[None], params, seed, 0))
        samples.append(drafted if out.num_accepted else out.next_token)
    expected = {t: float(p[t]) for t in top}
    _, p_value = chi_square_test(samples, expected)
    assert p_value > 1e-3
    # The test has power: an accept-all verifier emits q's tokens.
    accept_all = [int(sampling.sample(q, sampling.make_generator(seed, "draft"))) for seed in range(200)]
    assert chi_square_test(accept_all, expected)[1] < 1e-3
    engine.release("p")


@pytest.mark.serial
def test_draft_killed_mid_generation_degrades_to_the_engines_target_only(redis_url, engine):
    stack = start_stack(redis_url, draft="ngram", target_engine=engine)
    try:
        prompt = PROMPTS[1]
        ref = stack.client.generate(prompt, max_new_tokens=40, chat=True, speculation=False).token_ids
        tokens, stats, killed = [], None, False
        for msg in stack.client.stream(prompt, max_new_tokens=40, chat=True, max_draft_len=4):
            tokens += msg.token_ids
            if msg.HasField("stats"):
                stats = msg.stats
            if not killed and len(tokens) >= 8:
                killed = True
                stack.draft_servers[0].stop(0)
        assert tokens == ref
        assert stats.fallback_steps > 0 and stats.fallback_tokens > 0
    finally:
        stack.stop()


def test_tree_verification_keeps_the_accepted_path_only(unified_engine):
    engine = unified_engine
    ids = prompt_ids(engine, PROMPTS[1])
    engine.prefill("ref", 0, ids)
    ref = engine.decode(DecodeTask("ref", len(ids), [], 8, GREEDY, 0, 0))[0]
    wrong = [(t + 1) % engine.vocab_size for t in ref]
    # Root children: a wrong token (with a child) and the right one; under the right one: a wrong and the right
    # next token, which has a right child (a leaf) and a wrong sibling branch of two.
    tokens = [wrong[0], ref[0], wrong[1], wrong[1], ref[1], ref[2], wrong[2], wrong[3]]
    parents = [-1, -1, 0, 1, 1, 4, 4, 6]
    engine.prefill("tree", 0, ids)
    out = engine.verify(VerifyTask("tree", len(ids), [], tokens, None, GREEDY, 0, 0, tree_parents=parents))
    assert (out.accepted_nodes, out.next_token, out.cached_len) == ((1, 4, 5), ref[3], len(ids) + 3)
    seq_id = engine._sequences["tree"].seq_id
    assert llama_cpp.llama_memory_seq_pos_max(engine._mem, seq_id) == len(ids) + 2
    for scratch in engine._scratch_ids[:5]:  # the scratch sequences are gone
        assert llama_cpp.llama_memory_seq_pos_max(engine._mem, scratch) == -1
    assert ref[:4] + greedy_continuation(engine, "tree", out.cached_len, out.next_token, 4) == ref
    engine.release("ref")
    engine.release("tree")


def test_tree_speculation_through_the_services_equals_target_only(redis_url, unified_engine):
    engine = unified_engine
    from orchestrator.settings import LoopConfig

    cfg = LoopConfig(default_draft_len=4, draft_timeout_floor_ms=5000, tree_budget=8)
    stack = start_stack(redis_url, draft="ngram", target_engine=engine, cfg=cfg)
    try:
        for prompt in PROMPTS:
            ref = stack.client.generate(prompt, max_new_tokens=40, chat=True, speculation=False)
            spec = stack.client.generate(prompt, max_new_tokens=40, chat=True)
            assert spec.token_ids == ref.token_ids
            assert spec.stats["verify_steps"] > 0
    finally:
        stack.stop()


def test_tree_on_the_per_session_streams_is_a_clear_error(engine):
    ids = prompt_ids(engine, PROMPTS[0])
    engine.prefill("tree-streams", 0, ids)
    with pytest.raises(ValueError, match="unified KV cache"):
        engine.verify(VerifyTask("tree-streams", len(ids), [], [1, 2, 3], None, GREEDY, 0, 0, tree_parents=[-1, -1, 0]))
    assert engine.decode(DecodeTask("tree-streams", len(ids), [], 2, GREEDY, 0, 0))[2] >= 0  # the session still works
    engine.release("tree-streams")


def decode_with_churn(engine, ids: list[int], steps: int, chunk: int) -> list[int]:
    """Greedy decode of a session while other sessions come, grow, get cropped and leave between its chunks,
    so that in a shared pool its new cells land in holes others left."""
    others = [prompt_ids(engine, p * 3) for p in PROMPTS + ["Name three rivers in Africa and their lengths."]]
    for k, other in enumerate(others):
        engine.prefill(f"churn{k}", 0, other[:30 + 10 * k])
    engine.release("churn1")  # a hole the session's first cells fill
    engine.prefill("a", 0, ids[:-1])
    out, cached, delta = [], len(ids) - 1, [ids[-1]]
    for i in range(0, steps, chunk):
        tokens, cached, _ = engine.decode(DecodeTask("a", cached, delta, chunk, GREEDY, 0, i))
        out += tokens
        delta = [tokens[-1]]
        other = others[i // chunk % len(others)]
        sid = f"churn{i // chunk % len(others)}"
        engine.prefill(sid, 0, other[:5 + (7 * i) % len(other)])  # grows it, or crops it back
        if i // chunk % 3 == 2:
            engine.release(sid)
    for k in range(len(others)):
        engine.release(f"churn{k}")
    engine.release("a")
    return out


def test_greedy_tokens_do_not_depend_on_the_other_sessions_in_the_cache():
    """Batch invariance: a session decodes the same tokens alone and among sessions that come and go (on the
    unified KV cache, kv_unified=True, its tokens differ here: the attention sums its cells in another order)."""
    engine = make_engine()
    try:
        ids = prompt_ids(engine, "Explain in detail how a hash table handles collisions, with examples.")
        engine.prefill("a", 0, ids[:-1])
        alone = engine.decode(DecodeTask("a", len(ids) - 1, [ids[-1]], 40, GREEDY, 0, 0))[0]
        engine.release("a")
        assert decode_with_churn(engine, ids, 40, 4) == alone
    finally:
        engine.close()


def test_engine_choice():
    from target_service.engines.select import choose_engine

    assert choose_engine("torch", "smollm2", "cpu")[0] == "torch"
    backend, why = choose_engine("auto", "tiny:vocab=64", "cpu")
    assert backend == "torch" and "not a GGUF" in why
    with pytest.raises(ValueError, match="not a GGUF"):
        choose_engine("llamacpp", "tiny:vocab=64", "cpu")
    with pytest.raises(ValueError, match="unknown engine"):
        choose_engine("vllm", "smollm2", "cpu")
    if MISSING:
        pytest.fail(MISSING)
    assert choose_engine("auto", "smollm2", "cpu")[0] == "llamacpp"
    assert choose_engine("auto", str(smollm2_gguf_path()), "auto")[0] == "llamacpp"


def test_serve_target_arguments_build_the_chosen_engine():
    import argparse

    from target_service.engines.torch import TargetEngine
    from specdec.core.settings import from_args
    from target_service.engines.select import build_engine
    from target_service.server import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)

    def settings(argv: list[str]) -> TargetSettings:
        return from_args(TargetSettings, parser.parse_args(argv))

    tiny = ["--model", "tiny:vocab=64,layers=1,hidden=32", "--device", "cpu"]
    assert isinstance(build_engine(settings(tiny)), TargetEngine)  # the default engine
    assert isinstance(build_engine(settings([*tiny, "--engine", "auto"])), TargetEngine)  # not a GGUF
    with pytest.raises(SystemExit, match="--engine llamacpp cannot serve this target: .* is not a GGUF"):
        build_engine(settings([*tiny, "--engine", "llamacpp"]))
    if MISSING:
        pytest.fail(MISSING)
    from target_service.engines.llamacpp import LlamaCppEngine

    engine = build_engine(settings(["--model", "smollm2", "--engine", "llamacpp", "--max-sessions", "3",
                                    "--llama-context", "8192", "--llama-session-context", "1024"]))
    try:
        assert isinstance(engine, LlamaCppEngine)
        # a stream of 1024 cells for each of the 3 sessions and the profile
        assert (engine.max_sessions, engine.context_tokens, engine.loaded.max_context) == (3, 4096, 1024)
        for i in range(4):  # a fourth session evicts the least recently used
            engine.prefill(f"s{i}", 0, [1, 2, 3])
        assert engine.cached_sessions() == 3 and "s0" not in engine and engine.evictions == 1
        assert engine.cache_bytes() == 3 * 3 * engine.kv_bytes_per_token
    finally:
        engine.close()


def test_run_and_up_pick_the_llamacpp_engine_and_a_drafter_that_needs_no_target_kv(tmp_path):
    """`specdec run|up` default to --engine auto: llama.cpp for the GGUF where it is installed, with the n-gram
    drafter in the orchestrator (the int8 self-draft's prompt KV comes only from the torch engine); the library's
    StackConfig keeps torch and its int8 draft."""
    from launcher import cli
    from launcher.stack import LocalStack, StackConfig
    from specdec.core.grpc_util import StartupError
    from specdec.core.strategies import LOCAL_DRAFTS, LOCAL_SUFFIX, QUANTIZED
    from specdec.ops.cpu_affinity import allowed_cpus

    for command in ("run", "up"):
        assert cli._stack_config(cli.build_parser().parse_args([command])).engine == "auto"
    if MISSING:
        pytest.fail(MISSING)
    auto = LocalStack(StackConfig(engine="auto"), str(tmp_path))
    assert (auto.engine, auto.draft_strategy) == ("llamacpp", LOCAL_SUFFIX)
    # no draft process: the target computes on the cores a draft replica would have had
    assert auto.target_threads == min(len(allowed_cpus()), 2)
    library = LocalStack(StackConfig(), str(tmp_path))
    assert (library.engine, library.target_threads) == ("torch", 1)
    assert library.draft_strategy not in LOCAL_DRAFTS
    forced = LocalStack(StackConfig(engine="llamacpp", draft_strategy=QUANTIZED), str(tmp_path))
    assert (forced.engine, forced.draft_strategy, forced.target_threads) == ("llamacpp", QUANTIZED, 1)
    tiny = LocalStack(StackConfig(engine="auto", target_model="tiny:vocab=64,layers=1,hidden=32"), str(tmp_path))
    assert tiny.engine == "torch"  # not a GGUF: torch, as before
    with pytest.raises(StartupError, match="--engine llamacpp cannot serve this target: .* is not a GGUF"):
        LocalStack(StackConfig(engine="llamacpp", target_model="tiny:vocab=64,layers=1,hidden=32"), str(tmp_path))


def test_specdec_run_on_the_llamacpp_engine_end_to_end(tmp_path, engine):
    """`specdec run --engine llamacpp` serves the GGUF on llama.cpp; its speculative output equals the engine's
    own target-only decoding (greedy)."""
    import subprocess
    import sys

    prompt = "List the numbers from one to twelve, separated by commas."
    cmd = [sys.executable, "-m", "launcher.cli", "run", "--engine", "llamacpp", "--prompt", prompt,
           "--max-new-tokens", "40", "--json", "--store", "memory", "--log-dir", str(tmp_path),
           # one llama.cpp thread: on a test host shared with other jobs, 2 threads wait at llama.cpp's barriers
           "--threads", "1", "--draft-replicas", "0"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (out["engine"], out["draft_strategy"]) == ("llamacpp", "local-suffix")
    assert "target engine: llamacpp" in (tmp_path / "target.log").read_text()
    ids = prompt_ids(engine, prompt)
    engine.prefill("run-reference", 0, ids)
    try:
        reference = engine.decode(DecodeTask("run-reference", len(ids), [], 40, GREEDY, 0, 0))[0]
    finally:
        engine.release("run-reference")
    assert 0 < len(out["token_ids"]) and out["token_ids"] == reference[: len(out["token_ids"])]


@pytest.mark.serial  # times forwards
def test_the_engines_forward_profile_drives_the_goodput_draft_length(engine):
    """The profile the llama.cpp engine reports in GetInfo is what the orchestrator's goodput policy chooses k
    from: it grows with the block (llama.cpp's CPU kernels are compute-bound), so a poorly accepted drafter gets
    k = 0 (target-only) and a nearly always accepted one still drafts."""
    from orchestrator.policy.draft_length import GoodputDraftLength, TargetCost

    profile = engine.profile_forward_ms(5)
    assert len(profile) == 5 and profile[0] > 0
    assert all(b >= a for a, b in zip(profile, profile[1:])) and profile[4] > 1.5 * profile[0], profile

    def chosen_k(accepted_of_4: int) -> int:
        policy = GoodputDraftLength(4, TargetCost(profile))
        for _ in range(200):
            policy.update(4, accepted_of_4)
        return policy.k

    assert chosen_k(0) == 0  # no k pays: target-only (probing again every few steps)
    assert chosen_k(4) >= 1, profile  # nearly every token accepted: a block still beats its cost


def test_every_llama_decode_runs_on_the_engines_one_compute_thread(engine):
    """llama.cpp's OpenMP build keeps a spinning worker team per calling thread: calls arriving on many gRPC
    handler threads must still decode on one thread."""
    seen = set()
    real = engine._ll

    class Recording:
        def __getattr__(self, name):
            return getattr(real, name)

        def llama_decode(self, ctx, batch):
            seen.add(threading.current_thread().name)
            return real.llama_decode(ctx, batch)

    engine._ll = Recording()
    try:
        ids = engine.loaded.tokenizer.encode(PROMPTS[0])
        callers = [threading.Thread(target=engine.prefill, args=(f"compute-thread-{i}", 0, ids), name=f"handler-{i}")
                   for i in range(3)]
        for t in callers:
            t.start()
        for t in callers:
            t.join(60)
    finally:
        engine._ll = real
        for i in range(3):
            engine.release(f"compute-thread-{i}")
    assert len(seen) == 1 and next(iter(seen)).startswith("llama-compute")


def test_a_new_session_never_evicts_one_in_the_same_batch():
    """More new sessions in one batch than the engine has streams: the ones that fit verify as they would alone,
    the rest get a clear error; none takes a batch-mate's sequence (that would merge two sessions' tokens)."""
    small = make_engine(max_sessions=2)
    try:
        ids = prompt_ids(small, PROMPTS[0])
        small.prefill("ref", 0, ids)
        ref = small.decode(DecodeTask("ref", len(ids), [], 2, GREEDY, 0, 0))[0]
        small.release("ref")
        jobs = [VerifyTask(f"new{i}", 0, ids, ref[:1], None, GREEDY).job() for i in range(3)]
        small.verify_many(jobs)
        outs = [j.outcome() for j in jobs[:2]]
        assert [(o.num_accepted, o.next_token, o.cached_len) for o in outs] == [(1, ref[1], len(ids) + 1)] * 2
        with pytest.raises(MemoryError, match="KV streams"):
            jobs[2].outcome()
        assert small.cached_sessions() == 2 and "new2" not in small
    finally:
        small.close()


def test_a_prompt_batched_with_others_is_computed_as_it_is_alone():
    """llama.cpp's numerics depend on how a sequence's tokens are split across llama_decode calls (a 150-token
    prompt cut in two ends with logits up to 0.9 away): a prompt sharing a batch with other sessions' prompts past
    the batch size must not be cut where it would not be alone."""
    import numpy as np
    from specdec.eval_prompts import PROMPTS as BENCH_PROMPTS

    small = make_engine(max_sessions=5)
    try:
        summaries = [prompt_ids(small, p.text) for p in BENCH_PROMPTS if p.kind == "summary"]
        target, others = summaries[0], summaries[1:4]
        assert sum(map(len, summaries[:4])) > small.batch_tokens

        def last_logits(rows):
            with small._lock:
                out = small._forward([(small._sequence(sid), ids, 1) for sid, ids in rows])
            for sid, _ in rows:
                small.release(sid)
            return out

        alone = last_logits([("t", target)])[0]
        rows = [(f"o{i}", ids) for i, ids in enumerate(others)]
        assert np.array_equal(last_logits(rows + [("t", target)])[-1], alone)
        assert np.array_equal(last_logits([("t", target)] + rows)[0], alone)
        # with other sessions' short steps (llama.cpp would split the call into ubatches of 1 token a session)
        assert np.array_equal(last_logits([("s0", others[0][:1]), ("t", target), ("s1", others[1][:3])])[1], alone)
    finally:
        small.close()


def test_a_decode_call_runs_on_the_compute_thread_and_greedy_as_the_argmax_of_each_step(engine):
    """A target-only Decode's steps never leave the step loop's thread (no hand-off per token: each cost two thread
    wake-ups) and take each step's logits row from llama.cpp's buffer without copying it; its greedy tokens are
    still those of sampling.greedy_tokens over each step's own forward."""
    import numpy as np

    ids = prompt_ids(engine, PROMPTS[1])
    n = 6
    with engine._lock:  # the reference: one forward a token, its logits copied, torch's argmax
        seq = engine._sequence("argmax-ref")
        last, ref = engine._forward([(seq, ids, 1)])[0], []
        for _ in range(n):
            ref.append(int(sampling.greedy_tokens(torch.from_numpy(last))[-1]))
            last = engine._forward([(seq, ref[-1:], 1)])[0]
    engine.release("argmax-ref")

    calls, rows, threads = [], [], set()
    real_call, real_decode = engine._on_compute, engine._decode

    def counting_call(fn, *args):  # a hand-off: a call from another thread onto the compute thread
        if threading.current_thread().name != "llama-compute":
            calls.append(fn)
        return real_call(fn, *args)

    def recording_decode(entries, *args):
        out = real_decode(entries, *args)
        threads.add(threading.current_thread().name)
        buffer = np.ctypeslib.as_array(engine._ll.llama_get_logits(engine._ctx), shape=(1, engine.vocab_size))
        assert np.shares_memory(out, buffer), "a step's logits row was copied"
        rows.append(len(out))
        return out

    engine.prefill("argmax", 0, ids[:-1])
    engine._on_compute, engine._decode = counting_call, recording_decode
    try:
        tokens, cached, _ = engine.decode(DecodeTask("argmax", len(ids) - 1, ids[-1:], n, GREEDY, 0, 0))
    finally:
        del engine._on_compute, engine._decode
        engine.release("argmax")
    assert tokens == ref and cached == len(ids) + n - 1
    assert not calls and rows == [1] * n and threads == {"llama-compute"}


def test_a_stream_keeps_its_sequence_while_another_session_wants_one():
    """Every stream in use (one session here) and another session arriving between a decode stream's steps: the
    stream keeps its sequence (the newcomer is refused) instead of losing it and ending in a cache-miss."""
    e = make_engine(max_sessions=1)
    try:
        ids = prompt_ids(e, PROMPTS[0])
        ref = e.decode(DecodeTask("ref", 0, ids, 12, GREEDY, 0, 0))[0]
        assert e.release("ref")
        stream = e.decode_stream(DecodeTask("a", 0, ids, 12, GREEDY, 0, 0))
        tokens = list(stream.take(2, 60).tokens)
        with pytest.raises(MemoryError, match="work in flight"):
            e.prefill("intruder", 0, ids[:5])
        while not (block := stream.take(1, 60)).finished:
            tokens += block.tokens
        assert tokens + block.tokens == ref and block.cached_len == len(ids) + 11
        assert "a" in e and "intruder" not in e and not e._busy
    finally:
        e.close()
