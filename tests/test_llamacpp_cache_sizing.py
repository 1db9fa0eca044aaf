"""The llama.cpp target's KV cache is sized from the sessions the stack admits (target_service/engines/llama_cache.py):
a stream for each of --max-sessions sessions by default, a memory budget (--max-cache-mb) that shortens session
contexts before it drops sessions and says so in one warning, llama.cpp's sequence limit; `specdec run/up` pass
the orchestrator's session count to the target and turn on the unified cache for tree speculation.

On the real SmolLM2 GGUF: these tests need the llama_cpp module (a failure without it, as test_llamacpp_engine)."""

from __future__ import annotations

import argparse
import logging

import pytest

from target_service.engines.llama_cache import plan_cache
from tests.test_llamacpp_engine import GREEDY, MISSING, prompt_ids
from target_service.engines.jobs import VerifyTask

pytestmark = pytest.mark.smollm2

CELL = 23040  # SmolLM2-135M's KV for one token in float16: 2 x 2 bytes x 30 layers x 3 KV heads x 64
# the engine's: float16 keys and q8_0 values (34 bytes per 32), (2 + 34 / 32) bytes x 30 layers x 3 KV heads x 64
ENGINE_CELL = 17640


def target_engine(*argv: str):
    """The engine `specdec serve target --engine llamacpp ARGV` builds."""
    if MISSING:
        pytest.fail(MISSING)
    from specdec.core.settings import from_args
    from target_service.engines.select import build_engine
    from target_service.server import add_arguments
    from target_service.settings import TargetSettings

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return build_engine(from_args(TargetSettings, parser.parse_args(["--model", "smollm2", "--engine", "llamacpp",
                                                                     *argv])))


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "specdec.target.llamacpp" and r.levelno == logging.WARNING]


def test_the_default_cache_keeps_every_session_asked_for(caplog):
    """--max-sessions 12 with the other flags at their defaults: twelve streams of 2048 tokens (and the profile's),
    twelve sessions cached without an eviction, no warning; the thirteenth evicts the least recently used."""
    caplog.set_level(logging.INFO, "specdec.target.llamacpp")
    engine = target_engine("--max-sessions", "12")
    try:
        assert engine.kv_bytes_per_token == ENGINE_CELL
        assert (engine.prompt_slots, engine.keep_prompts) == (16, True)
        assert (engine.max_sessions, engine.loaded.max_context, engine.context_tokens) == (12, 2048, 13 * 2048)
        assert warnings_of(caplog) == []
        for i in range(12):
            engine.prefill(f"s{i}", 0, [1, 2, 3 + i])
        assert engine.cached_sessions() == 12 and engine.evictions == 0
        engine.prefill("s12", 0, [1, 2])
        assert engine.evictions == 1 and "s0" not in engine and "s1" in engine
    finally:
        engine.close()


def test_a_tight_budget_shortens_contexts_before_it_drops_sessions_and_warns(caplog):
    caplog.set_level(logging.WARNING, "specdec.target.llamacpp")
    # 352 MiB, 45 of them the prompt context's stream (2048 float16 cells), 307 = 18176 cells (whole 256-cell units):
    # 13 streams of 2048 do not fit, 13 of 1280 do: every session kept, each shorter
    engine = target_engine("--max-sessions", "12", "--max-cache-mb", "352")
    try:
        assert (engine.max_sessions, engine.loaded.max_context, engine.context_tokens) == (12, 1280, 13 * 1280)
        [warning] = warnings_of(caplog)
        assert "12 sessions of 2048 tokens asked" in warning and "hold 12 sessions of 1280 tokens" in warning
        assert "--max-cache-mb 307 holds 18176 cells of 17.2 KiB" in warning
        assert "45 MiB of --max-cache-mb 352 hold the prompt context" in warning
    finally:
        engine.close()
    caplog.clear()
    # 196 MiB, 151 of them 8960 cells: not even 13 streams of 1024 (the floor): 8 streams of 1024, 7 sessions
    engine = target_engine("--max-sessions", "12", "--max-cache-mb", "196")
    try:
        assert (engine.max_sessions, engine.loaded.max_context, engine.context_tokens) == (7, 1024, 8 * 1024)
        [warning] = warnings_of(caplog)
        assert "hold 7 sessions of 1024 tokens" in warning and "--max-cache-mb 151 holds" in warning
    finally:
        engine.close()


def test_the_prompt_cache_keeps_prompts_within_a_quarter_of_the_budget_or_none():
    """16 kept prompts by default (45 MiB streams within 1024 of the 4096 MiB); a tight budget keeps one stream, the
    prompt being computed; --llama-prompt-cache 0 keeps it only while the prompt is computed."""
    from specdec.eval_prompts import PROMPTS, encode

    engine = target_engine("--max-sessions", "2", "--llama-prompt-cache", "0")
    try:
        assert (engine.prompt_slots, engine.keep_prompts) == (1, False)
        ids = encode(next(p for p in PROMPTS if p.kind == "summary"), engine.loaded.tokenizer)  # > 64 tokens
        for sid in ("a", "b"):
            engine.prefill(sid, 0, ids[:-1], prompt_len=len(ids))
            assert not any(engine._prompt_slots)  # nothing kept
        assert engine.prompt_rows_computed() == 2 * (len(ids) - 1) and engine.prompt_rows_reused() == 0
    finally:
        engine.close()
    engine = target_engine("--max-sessions", "2", "--max-cache-mb", "352")
    try:
        assert engine.prompt_slots == 1  # 88 MiB: a quarter holds one stream
    finally:
        engine.close()


def test_the_plan_keeps_to_llama_cpps_sequence_limit_and_the_budget_floor():
    import llama_cpp

    limit = int(llama_cpp.llama_max_parallel_sequences())
    assert limit == 256  # the installed llama.cpp's LLAMA_MAX_SEQ, which the engine passes to plan_cache
    plenty = 1 << 20
    streams = plan_cache(300, 2048, cell_bytes=CELL, budget_mib=plenty, max_sequences=limit)
    assert (streams.sessions, streams.session_context) == (255, 2048) and "256 sequences" in streams.shortfall
    # the unified cache's tree scratch sequences (64) and the profile's are not sessions'
    unified = plan_cache(300, 2048, cell_bytes=CELL, budget_mib=plenty, max_sequences=limit, reserved_sequences=65,
                         unified=True)
    assert (unified.sessions, unified.cells) == (191, 192 * 2048)
    # the defaults hold: 64 SmolLM2 sessions of 2048 tokens in 4096 MiB, nothing to warn about
    default = plan_cache(64, 2048, cell_bytes=CELL, budget_mib=4096)
    assert (default.sessions, default.session_context, default.cells, default.shortfall) == (64, 2048, 65 * 2048, "")
    # contexts shrink to the floor (1024) only; a smaller asked context is its own floor
    assert plan_cache(64, 2048, cell_bytes=CELL, budget_mib=2048).session_context == 1280
    small = plan_cache(64, 512, cell_bytes=CELL, budget_mib=100)  # 4352 cells: 8 streams of 512
    assert (small.sessions, small.session_context, small.cells) == (7, 512, 8 * 512)
    assert plan_cache(3, 300, cell_bytes=CELL, budget_mib=4096).session_context == 512  # llama.cpp's 256-cell unit
    with pytest.raises(ValueError, match="cannot hold one session"):
        plan_cache(4, 2048, cell_bytes=CELL, budget_mib=10)


def test_run_and_up_size_the_targets_cache_from_the_orchestrators_sessions(tmp_path):
    from launcher import cli
    from launcher.stack import LocalStack, StackConfig

    def stack(**kw) -> LocalStack:
        return LocalStack(StackConfig(**kw), str(tmp_path))

    if MISSING:
        pytest.fail(MISSING)
    run = cli._stack_config(cli.build_parser().parse_args(["run"]))
    up = cli._stack_config(cli.build_parser().parse_args(["up"]))
    assert (run.max_sessions, up.max_sessions, up.tree_budget) == (1, 64, 0)  # `run` generates once
    flags = cli._stack_config(cli.build_parser().parse_args(["up", "--max-sessions", "12", "--tree-budget", "8"]))
    assert (flags.max_sessions, flags.tree_budget) == (12, 8)
    llama = stack(engine="llamacpp", max_sessions=12)
    assert llama.target_cache_args() == ["--max-sessions", "12"]
    # a compute-bound llama.cpp target decodes target-only once two sessions generate
    assert llama._sessions() == ["--max-sessions", "12", "--speculation-max-sessions", "1"]
    assert stack(engine="torch", max_sessions=12)._sessions() == ["--max-sessions", "12"]
    trees = stack(engine="llamacpp", max_sessions=12, tree_budget=8)
    assert trees.target_cache_args() == ["--max-sessions", "12", "--llama-kv-unified"]
    assert trees._sessions() == ["--max-sessions", "12", "--speculation-max-sessions", "1", "--tree-budget", "8"]
    # the orchestrator's own arguments come last on its command line and win: the target follows them
    overridden = stack(engine="llamacpp", orchestrator_args=["--max-sessions", "5", "--tree-budget=6"])
    assert overridden.target_cache_args() == ["--max-sessions", "5", "--llama-kv-unified"]
    assert stack(engine="torch", tree_budget=8).target_cache_args() == ["--max-sessions", "64"]  # torch does trees


def test_a_tree_budget_on_a_llamacpp_stack_starts_a_target_that_verifies_trees(tmp_path):
    """The target arguments `specdec up --max-sessions 3 --tree-budget 8` give a llama.cpp target: a tree Verify
    works (without the unified cache it is INVALID_ARGUMENT)."""
    from launcher.stack import LocalStack, StackConfig

    if MISSING:
        pytest.fail(MISSING)
    stack = LocalStack(StackConfig(engine="llamacpp", max_sessions=3, tree_budget=8), str(tmp_path))
    engine = target_engine(*stack.target_cache_args())
    try:
        assert engine.kv_unified and engine.max_sessions == 3
        ids = prompt_ids(engine, "Count from one to ten.")
        engine.prefill("tree", 0, ids)
        tree = VerifyTask("tree", len(ids), [], [1, 2, 3], None, GREEDY, 0, 0, tree_parents=[-1, -1, 0])
        outcome = engine.verify(tree)
        assert outcome.num_accepted >= 0 and outcome.cached_len >= len(ids)
    finally:
        engine.close()
