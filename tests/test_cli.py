"""`specdec run` / `specdec up` start the stack with the speculation settings the benchmark measured best."""

import json

import pytest

from launcher import cli
from launcher.stack import LocalStack, StackConfig


def _stack_config(argv):
    return cli._stack_config(cli.build_parser().parse_args(argv))


def test_run_and_up_default_to_adaptive_pipelined_speculation():
    run, up = _stack_config(["run"]), _stack_config(["up"])
    for cfg in (run, up):
        assert cfg.adaptive_draft_len is True and cfg.pipeline == "auto" and cfg.draft_len == 4
    assert run.batch_window_ms == 0.0  # one session: nothing to wait for
    assert up.batch_window_ms == 5.0   # a server for many clients, as deploy/docker-compose.yml


def test_stack_flags_override_the_defaults():
    cfg = _stack_config(["run", "--no-adaptive-draft-len", "--pipeline", "off", "--draft-len", "6",
                         "--batch-window-ms", "2.5"])
    assert (cfg.adaptive_draft_len, cfg.pipeline, cfg.draft_len, cfg.batch_window_ms) == (False, "off", 6, 2.5)
    with pytest.raises(SystemExit):
        _stack_config(["run", "--pipeline", "sometimes"])


def test_the_stack_and_the_cli_take_their_defaults_from_the_orchestrators_settings():
    """One default per setting: `specdec serve orchestrator`, StackConfig and `specdec run|up` agree."""
    import argparse

    from orchestrator.api import server
    from orchestrator.settings import LoopConfig

    p = argparse.ArgumentParser()
    server.add_arguments(p)
    serve = p.parse_args([])
    for cfg in (StackConfig(), _stack_config(["run"]), _stack_config(["up"])):
        assert cfg.draft_len == serve.default_draft_len == LoopConfig().default_draft_len
        assert cfg.adaptive_draft_len is serve.adaptive_draft_len is LoopConfig().adaptive_draft_len is True
    assert StackConfig().pipeline == serve.pipeline == LoopConfig().pipeline


def test_the_stack_passes_the_settings_to_the_services(tmp_path):
    stack = LocalStack(StackConfig(adaptive_draft_len=True, pipeline="auto", batch_window_ms=5.0), str(tmp_path))
    assert stack._speculation() == ["--pipeline", "auto", "--adaptive-draft-len"]
    assert stack._batching() == ["--batch-window-ms", "5.0"]
    library_default = LocalStack(StackConfig(), str(tmp_path))  # the orchestrator's defaults: adaptive g, no pipelining
    assert library_default._speculation() == ["--pipeline", "off", "--adaptive-draft-len"]
    assert library_default._batching() == []
    fixed = LocalStack(StackConfig(adaptive_draft_len=False), str(tmp_path))  # chaos runs count steps: fixed g
    assert fixed._speculation() == ["--pipeline", "off", "--no-adaptive-draft-len"]
    with pytest.raises(ValueError, match="off, on or auto"):
        LocalStack(StackConfig(pipeline="yes"), str(tmp_path))._speculation()


# ------------------------------------------------------------------------------------------------
# `specdec generate` against a running orchestrator: clean errors, Ctrl-C, resuming a session
# ------------------------------------------------------------------------------------------------

PROMPT = "t1 t5 t9 t12 t5 t9"


@pytest.fixture(scope="module")
def orchestrator(redis_url):
    from tests.harness import start_stack

    stack = start_stack(redis_url)
    yield stack
    stack.stop()


def _generate(capsys, *argv):
    rc = cli.main(["generate", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_a_refused_request_is_one_line_and_exit_status_2(orchestrator, capsys):
    rc, out, err = _generate(capsys, PROMPT, "--address", orchestrator.orchestrator_server.address, "--max-new-tokens", "0")
    assert rc == 2 and "Traceback" not in err
    assert err.strip() == "specdec generate: INVALID_ARGUMENT: max_new_tokens must be at least 1"
    rc, out, err = _generate(capsys, PROMPT, "--address", orchestrator.orchestrator_server.address, "--temperature", "-1",
                             "--json")
    assert rc == 2 and json.loads(out) == {"error": {"code": "INVALID_ARGUMENT",
                                                     "message": "temperature must be a finite number >= 0, got -1.0"}}


def test_no_orchestrator_says_where_it_looked(capsys):
    address = f"127.0.0.1:{_free_port()}"
    rc, out, err = _generate(capsys, PROMPT, "--address", address)
    assert rc == 1 and "Traceback" not in err
    assert err.startswith("specdec generate: UNAVAILABLE: ")
    assert f"is an orchestrator running at {address}?" in err


def test_an_unknown_session_cannot_be_resumed(orchestrator, capsys):
    rc, out, err = _generate(capsys, "--resume", "no-such-session", "--address", orchestrator.orchestrator_server.address)
    assert rc == 1 and err.strip() == "specdec generate: NOT_FOUND: unknown session id 'no-such-session'"
    for argv in ([PROMPT, "--resume", "x"], [], [PROMPT, "--resume-from", "3"], ["--resume", "x", "--resume-from", "-1"],
                 [PROMPT, "--timeout", "0"]):
        with pytest.raises(SystemExit, match="specdec generate: "):
            cli.main(["generate", *argv, "--address", orchestrator.orchestrator_server.address])


def test_generate_prints_the_text_and_resume_replays_it(orchestrator, capsys):
    rc, out, err = _generate(capsys, PROMPT, "--address", orchestrator.orchestrator_server.address, "--no-chat", "--ignore-eos",
                             "--max-new-tokens", "12", "--json")
    first = json.loads(out)
    assert rc == 0 and len(first["token_ids"]) == 12 and first["finish_reason"] == "length"
    rc, out, err = _generate(capsys, f"--resume={first['session_id']}", "--resume-from", "5",
                             "--address", orchestrator.orchestrator_server.address, "--json")
    assert rc == 0 and json.loads(out)["token_ids"] == first["token_ids"][5:]
    rc, out, err = _generate(capsys, f"--resume={first['session_id']}", "--address", orchestrator.orchestrator_server.address)
    assert rc == 0 and out == first["text"] + "\n" and "-- 12 tokens, finish=length" in err


def test_a_prompt_from_standard_input(orchestrator, capsys, monkeypatch):
    import io

    argv = ["--address", orchestrator.orchestrator_server.address, "--no-chat", "--ignore-eos", "--max-new-tokens",
            "8", "--json"]
    rc, out, err = _generate(capsys, PROMPT, *argv)
    monkeypatch.setattr("sys.stdin", io.StringIO(PROMPT))
    rc2, out2, err2 = _generate(capsys, "-", *argv)
    assert rc == rc2 == 0 and json.loads(out2)["token_ids"] == json.loads(out)["token_ids"]


@pytest.mark.serial  # a signal sent while tokens stream
def test_the_printed_resume_command_parses_for_a_session_id_that_starts_with_a_dash():
    """Session ids are base64url: one in 64 starts with '-', which `--resume ID` would read as an option."""
    import types

    from launcher.cli import _resume_hint, build_parser

    args = types.SimpleNamespace(command="generate", address="127.0.0.1:1",
                                 progress={"session_id": "-L3s1CqIdakFsHM_hMX0qKwe", "next_token": 5})
    command = _resume_hint(args).split("continue it with: specdec ", 1)[1].split()
    parsed = build_parser().parse_args(command)
    assert (parsed.resume, parsed.resume_from, parsed.address) == ("-L3s1CqIdakFsHM_hMX0qKwe", 5, "127.0.0.1:1")


def test_ctrl_c_stops_the_stream_and_the_printed_command_resumes_it(orchestrator):
    """Ctrl-C mid-stream: exit 130 with the command that continues the session; running it yields exactly the
    tokens the interrupted stream had not delivered (against an uninterrupted target-only reference)."""
    import os
    import re
    import signal
    import subprocess
    import sys

    n = 500
    address = orchestrator.orchestrator_server.address
    reference = orchestrator.client.generate(PROMPT, max_new_tokens=n, ignore_eos=True, speculation=False).token_ids
    proc = subprocess.Popen([sys.executable, "-m", "launcher.cli", "generate", PROMPT, "--address", address,
                             "--no-chat", "--ignore-eos", "--max-new-tokens", str(n)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert os.read(proc.stdout.fileno(), 64), "no text streamed"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    err = err.decode()
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "specdec generate: CANCELLED: stopped (Ctrl-C)" in err
    hint = re.search(r"continue it with: specdec (generate --address \S+ --resume=(\S+) --resume-from (\d+))", err)
    assert hint, err
    received = int(hint.group(3))
    assert 0 < received < n, "interrupted too late to test a resume"
    rc = subprocess.run([sys.executable, "-m", "launcher.cli", *hint.group(1).split(), "--json"],
                        capture_output=True, text=True, timeout=120)
    assert rc.returncode == 0, rc.stderr
    rest = json.loads(rc.stdout)
    assert rest["token_ids"] == reference[received:] and rest["finish_reason"] == "length"


def _free_port() -> int:
    from specdec.ops.redis_server import free_port

    return free_port()


@pytest.fixture
def busy_port():
    """A loopback port another process (here: a socket of this one) listens on."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def test_a_taken_port_is_named_with_its_reason(busy_port):
    from specdec.core.grpc_util import ListenError, ServiceServer

    with pytest.raises(ListenError, match=f"cannot listen on 127.0.0.1:{busy_port} for gRPC: Address already in use"):
        ServiceServer(f"127.0.0.1:{busy_port}")


def test_up_refuses_a_taken_port_before_loading_any_model(busy_port, tmp_path):
    from specdec.core.grpc_util import ListenError

    stack = LocalStack(StackConfig(orchestrator_port=busy_port, metrics_base_port=0), str(tmp_path))
    with pytest.raises(ListenError, match="another `specdec up`"):
        stack.start()
    assert stack.services() == []  # nothing was started
    with pytest.raises(SystemExit, match=f"specdec up: cannot listen on 127.0.0.1:{busy_port} for the orchestrator"):
        cli.main(["up", "--port", str(busy_port), "--metrics-base-port", "0", "--log-dir", str(tmp_path)])


def test_a_service_that_cannot_start_says_why_in_one_line(busy_port):
    """`serve target` with its metrics port taken, `serve orchestrator` with no target: exit 1, one line."""
    import subprocess
    import sys

    from tests.harness import TARGET

    runs = [(["target", "--model", TARGET, "--listen", "127.0.0.1:0", "--metrics-port", f"127.0.0.1:{busy_port}"],
             f"specdec serve target: cannot listen on 127.0.0.1:{busy_port} for metrics: Address already in use"),
            (["orchestrator", "--listen", "127.0.0.1:0", "--target", f"127.0.0.1:{busy_port}",
              "--startup-timeout-s", "1"],
             f"specdec serve orchestrator: the target at 127.0.0.1:{busy_port} did not answer within 1 s")]
    for argv, message in runs:
        out = subprocess.run([sys.executable, "-m", "launcher.cli", "serve", *argv], capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 1 and message in out.stderr and "Traceback" not in out.stderr, out.stderr[-2000:]


def test_a_starting_service_reports_what_it_last_logged(tmp_path):
    import pathlib

    from launcher.stack import ServiceProcess

    svc = ServiceProcess("target", ["target"], pathlib.Path(tmp_path))
    assert svc.status() == "starting"  # no log yet
    svc.log_path.write_text('{"ts": 1, "level": "info", "msg": "converting x.gguf (one-time)"}\n')
    assert svc.status() == "converting x.gguf (one-time)"
    with open(svc.log_path, "a") as f:
        f.write("Loading weights:   0%|  | 0/272\rLoading weights:  63%|######  | 172/272\r")
    assert svc.status() == "Loading weights:  63%|######  | 172/272"
    with open(svc.log_path, "a") as f:
        f.write("\n" + '{"msg": "serving", "address": "127.0.0.1:1"}\n\n')
    assert svc.status() == "serving"


def test_the_startup_report_rewrites_one_line_on_a_terminal_and_prints_changes_elsewhere():
    import io

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    plain = io.StringIO()
    report = cli._StartupReport(plain)
    report([("target", "starting"), ("draft0", "starting")])
    report([("target", "loading"), ("draft0", "starting")])
    report.done()
    assert plain.getvalue() == "  target: starting\n  draft0: starting\n  target: loading\n"
    term = Terminal()
    report = cli._StartupReport(term)
    report([("target", "loading")])
    report([("target", "ready at 127.0.0.1:1")])
    report.done()
    frames = term.getvalue().split("\r\033[K")
    assert frames[0] == "" and frames[1].endswith("target: loading") and frames[-1] == ""
    assert "\n" not in term.getvalue()


@pytest.mark.serial  # a signal sent while services start
def _specdec_up(model: str, log_dir):
    """`specdec up` in a child process: tiny models whose seed names this test's services among the machine's."""
    import subprocess
    import sys

    return subprocess.Popen([sys.executable, "-m", "launcher.cli", "up", "--port", "0", "--metrics-base-port", "0",
                             "--http-port", "0",
                             "--target-model", model, "--draft-strategy", "model", "--draft-model", model,
                             "--log-dir", str(log_dir)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_ctrl_c_while_the_stack_starts_stops_everything_it_started(tmp_path):
    import signal
    import subprocess
    import time

    import os

    # The seed names this run's services among the machine's processes (other runs of this test may be going on).
    model = f"tiny:vocab=64,layers=1,hidden=32,seed={os.getpid()}"
    proc = _specdec_up(model, tmp_path)
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "target.log").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130 and "Traceback" not in err, err[-2000:]
    assert err.strip().endswith(("specdec: interrupted", "specdec up: interrupted"))
    left = subprocess.run(["pgrep", "-a", "-f", f"model {model}"], capture_output=True, text=True).stdout.splitlines()
    assert left == [], "services still running after Ctrl-C"


@pytest.mark.parametrize("moment", ["target.log", "orchestrator.log", "serving"])
def test_sigterm_to_up_at_any_moment_stops_everything_it_started(tmp_path, moment):
    """SIGTERM (what a process manager sends), not only Ctrl-C: while the services load, while the orchestrator
    starts, or once the stack serves, `specdec up` stops every process it started."""
    import os
    import signal
    import subprocess
    import time

    model = f"tiny:vocab=64,layers=1,hidden=32,seed={os.getpid() + 1000 + len(moment)}"
    proc = _specdec_up(model, tmp_path)
    try:
        deadline = time.monotonic() + 120
        if moment == "serving":
            line = proc.stdout.readline()  # the stack's addresses, printed once it serves
            assert line.startswith("{"), proc.stderr.read()[-2000:]
        else:
            while not (tmp_path / moment).exists() and time.monotonic() < deadline:
                time.sleep(0.02)
            assert (tmp_path / moment).exists()
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert "Traceback" not in err, err[-2000:]
    if moment == "serving":
        assert proc.returncode == 0, err[-2000:]
    else:  # the start unwound, as after Ctrl-C (the orchestrator may have become ready just before the signal)
        assert proc.returncode in (143, 0), err[-2000:]
        assert proc.returncode == 0 or err.strip().endswith("specdec: terminated"), err[-2000:]
    left = subprocess.run(["pgrep", "-a", "-f", f"model {model}"], capture_output=True, text=True).stdout.splitlines()
    left += subprocess.run(["pgrep", "-a", "-f", f"--dir {tmp_path}"], capture_output=True, text=True).stdout.splitlines()
    assert left == [], f"services (or Redis) still running after SIGTERM: {left}"


def test_run_without_the_distilled_draft_says_how_to_get_one(tmp_path, monkeypatch):
    """--draft-strategy model/hybrid need `specdec distill`'s output: refused before any service starts."""
    from specdec.core.grpc_util import StartupError

    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "empty-cache"))
    stack = LocalStack(StackConfig(draft_strategy="hybrid", metrics_base_port=0), str(tmp_path))
    with pytest.raises(StartupError, match="run `specdec distill` first"):
        stack.start()
    assert stack.services() == [] and stack.redis is None
    quantized = LocalStack(StackConfig(draft_strategy="quantized", metrics_base_port=0), str(tmp_path))
    quantized._check_draft_model()  # the int8 draft is the target's own weights: no distilled draft needed


@pytest.mark.parametrize("victim", ["redis-server", "target"])
def test_an_interrupt_the_moment_a_process_starts_still_stops_it(tmp_path, monkeypatch, victim):
    """Ctrl-C lands right after a service's (or Redis') process was created, before its starter returned: the stack
    has recorded it anyway, and stops it on the way out."""
    import os
    import signal
    import subprocess
    import time

    real_popen = subprocess.Popen
    started = []

    def popen(args, **kwargs):
        proc = real_popen(args, **kwargs)
        started.append(proc)
        if victim in " ".join(map(str, args)):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)  # Python runs the SIGINT handler here, inside Popen as its caller sees it
        return proc

    monkeypatch.setattr(subprocess, "Popen", popen)
    model = "tiny:vocab=64,layers=1,hidden=32,seed=24"
    stack = LocalStack(StackConfig(target_model=model, draft_strategy="model", draft_model=model,
                                   metrics_base_port=0), str(tmp_path))
    try:
        with pytest.raises(KeyboardInterrupt):
            stack.start(timeout=60)
        assert started and started[-1].args and victim in " ".join(map(str, started[-1].args))
        for proc in started:
            assert proc.wait(10) is not None, f"{proc.args[:4]} still running after the interrupt"
    finally:
        for proc in started:
            if proc.poll() is None:
                proc.kill()
                proc.wait(5)
