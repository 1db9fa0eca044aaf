"""`specdec up` / `run` pass the orchestrator's admission settings (--max-running, --queue-timeout-s) through
LocalStack, and a batching llama.cpp target sizes its KV streams for the sessions admission runs at once, not for
every admitted one."""

import grpc
import pytest

from launcher import cli
from launcher.stack import LLAMACPP_SPARE_STREAMS, LocalStack, StackConfig
from orchestrator.settings import ServerSettings
from tests.harness import TARGET


def _stack_config(argv):
    return cli._stack_config(cli.build_parser().parse_args(argv))


def test_up_and_run_take_the_admission_flags_with_the_orchestrators_defaults():
    for command in ("up", "run"):
        cfg = _stack_config([command])
        assert (cfg.max_running, cfg.queue_timeout_s) == (ServerSettings.max_running, ServerSettings.queue_timeout_s)
        cfg = _stack_config([command, "--max-running", "4", "--queue-timeout-s", "2.5"])
        assert (cfg.max_running, cfg.queue_timeout_s) == ("4", 2.5)
    for bad in (["--max-running", "0"], ["--max-running", "many"], ["--queue-timeout-s", "0"],
                ["--queue-timeout-s", "soon"]):
        with pytest.raises(SystemExit):
            _stack_config(["up", *bad])


def test_the_orchestrators_command_line_carries_them(tmp_path):
    stack = LocalStack(StackConfig(max_running="3", queue_timeout_s=7.5), str(tmp_path))
    args = stack._admission()
    assert args[args.index("--max-running") + 1] == "3" and args[args.index("--queue-timeout-s") + 1] == "7.5"
    assert StackConfig().max_running == "auto"  # the orchestrator's own default


def test_a_batching_llamacpp_target_keeps_streams_for_the_running_sessions(tmp_path):
    def streams(**kw) -> int:
        stack = LocalStack(StackConfig(**{"engine": "llamacpp", "batch_window_ms": 5.0, **kw}), str(tmp_path))
        assert stack.target_cache_args()[:2] == ["--max-sessions", str(stack.target_sessions())]
        return stack.target_sessions()

    from target_service.settings import TargetSettings

    batch = TargetSettings.max_batch
    assert streams() == batch + LLAMACPP_SPARE_STREAMS  # `up`: 64 admitted, auto admission runs one batch
    assert streams(target_replicas=2) == 2 * batch + LLAMACPP_SPARE_STREAMS  # all of them on a survivor
    assert streams(target_args=["--max-batch", "4"]) == 4 + LLAMACPP_SPARE_STREAMS
    assert streams(max_running="3") == 3 + LLAMACPP_SPARE_STREAMS
    assert streams(orchestrator_args=["--max-running=2"]) == 2 + LLAMACPP_SPARE_STREAMS  # those win
    assert streams(max_sessions=10) == 10  # never more than admitted
    assert streams(batch_window_ms=0.0) == 64  # no batching: auto admission runs as many as the target keeps
    assert streams(engine="torch") == 64  # its caches grow as they fill: one for every admitted session
    up = LocalStack(_stack_config(["up", "--engine", "llamacpp"]), str(tmp_path))
    assert up.target_sessions() == batch + LLAMACPP_SPARE_STREAMS
    run = LocalStack(_stack_config(["run", "--engine", "llamacpp"]), str(tmp_path))
    assert run.target_sessions() == 1


@pytest.mark.serial  # the queued generation must time out while the first one still runs
def test_the_started_orchestrator_runs_one_and_refuses_the_next_after_the_queue_timeout(tmp_path):
    from specdec.client import SpecdecClient

    cfg = StackConfig(target_model=TARGET, draft_strategy="local-ngram", store="memory", device="cpu",
                      dtype="float32", max_running="1", queue_timeout_s=0.5)
    stack = LocalStack(cfg, str(tmp_path)).start(timeout=120)
    try:
        cmdline = open(f"/proc/{stack.orchestrator.proc.pid}/cmdline", "rb").read().split(b"\0")
        assert cmdline[cmdline.index(b"--max-running") + 1] == b"1"
        assert cmdline[cmdline.index(b"--queue-timeout-s") + 1] == b"0.5"
        with SpecdecClient(stack.address) as client:
            holder = client.stream([1, 5, 9], max_new_tokens=1000, ignore_eos=True, speculation=False)
            next(iter(holder))  # it runs
            with pytest.raises(grpc.RpcError) as refused:
                client.generate([1, 5, 9], max_new_tokens=4)
            holder.cancel()
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "1 generations running, 0 queued; waited 0.5 s" in refused.value.details()
    finally:
        stack.stop()
