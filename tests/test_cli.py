"""`specdec run` / `specdec up` start the stack with the speculation settings the benchmark measured best."""

import pytest

from specdec import cli
from specdec.stack import LocalStack, StackConfig


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


def test_the_stack_passes_the_settings_to_the_services(tmp_path):
    stack = LocalStack(StackConfig(adaptive_draft_len=True, pipeline="auto", batch_window_ms=5.0), str(tmp_path))
    assert stack._speculation() == ["--pipeline", "auto", "--adaptive-draft-len"]
    assert stack._batching() == ["--batch-window-ms", "5.0"]
    library_default = LocalStack(StackConfig(), str(tmp_path))  # tests and chaos runs: fixed g, no pipelining
    assert library_default._speculation() == ["--pipeline", "off"] and library_default._batching() == []
    with pytest.raises(ValueError, match="off, on or auto"):
        LocalStack(StackConfig(pipeline="yes"), str(tmp_path))._speculation()
