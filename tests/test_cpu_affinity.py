"""--cpu-affinity pins a service's threads; `specdec run` gives the target and each draft CPUs of their own."""

import os
import pathlib
import subprocess
import sys

import pytest

from launcher import cli
from specdec.ops import cpu_affinity
from specdec.ops.cpu_affinity import format_cpu_list, local_stack_plan, parse_cpu_list
from launcher.stack import LocalStack, ServiceProcess, StackConfig
from tests.harness import TARGET

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _thread_affinities(pid: int | str = "self") -> set[str]:
    tasks = pathlib.Path(f"/proc/{pid}/task")
    out = set()
    for t in tasks.iterdir():
        for line in (t / "status").read_text().splitlines():
            if line.startswith("Cpus_allowed_list:"):
                out.add(line.split(":", 1)[1].strip())
    return out


def test_cpu_lists_parse_and_format_like_taskset():
    assert parse_cpu_list("0-3,6") == {0, 1, 2, 3, 6}
    assert parse_cpu_list(" 2 , 4-5 ") == {2, 4, 5}
    assert parse_cpu_list("") == set()
    assert format_cpu_list({0, 1, 2, 5, 7, 8}) == "0-2,5,7-8"
    assert parse_cpu_list(format_cpu_list({3, 9, 10, 11})) == {3, 9, 10, 11}
    for bad in ("a", "3-1", "-2", "1-x", "0-999999999"):
        with pytest.raises(ValueError, match="CPU list"):
            parse_cpu_list(bad)


def test_the_plan_gives_the_target_and_each_draft_cpus_of_their_own():
    assert local_stack_plan(1, 1, {0, 1}) == {"target": {1}, "draft0": {0}}
    assert local_stack_plan(2, 2, set(range(8))) == {"target": {6, 7}, "draft0": {4, 5}, "draft1": {2, 3}}
    assert local_stack_plan(1, 1, {2, 5, 7}) == {"target": {7}, "draft0": {5}}  # a cpuset's own numbers
    assert local_stack_plan(1, 0, {0, 1}) == {"target": {1}}  # drafting inside the orchestrator
    # Too few CPUs to go round: nothing pinned rather than two compute threads on one CPU.
    assert local_stack_plan(1, 1, {0}) is None
    assert local_stack_plan(1, 3, {0, 1}) is None
    assert local_stack_plan(2, 1, {0, 1, 2}) is None


def test_run_pins_by_default_up_and_the_library_do_not(tmp_path, monkeypatch):
    def pin(argv):
        return cli._stack_config(cli.build_parser().parse_args(argv)).pin_cpus

    assert pin(["run"]) == "auto" and pin(["run", "--pin-cpus", "off"]) == "off"
    assert pin(["up"]) == "off" and pin(["up", "--pin-cpus", "auto"]) == "auto"  # a server: many sessions
    assert StackConfig().pin_cpus == "off"  # tests start many stacks at once
    monkeypatch.setattr(cpu_affinity, "allowed_cpus", lambda: {0, 1, 2, 3})
    stack = LocalStack(StackConfig(pin_cpus="auto", draft_strategy="ngram"), str(tmp_path))
    assert stack.cpu_plan == {"target": {3}, "draft0": {2}}
    assert stack._affinity("target") == ["--cpu-affinity", "3"] and stack._affinity("draft0") == ["--cpu-affinity", "2"]
    assert stack.cpu_affinity() == {"target": "3", "draft0": "2"}  # what `specdec run --json` and `up` print
    assert LocalStack(StackConfig(draft_strategy="ngram"), str(tmp_path))._affinity("target") == []
    with pytest.raises(ValueError, match="auto or off"):
        LocalStack(StackConfig(pin_cpus="yes", draft_strategy="ngram"), str(tmp_path))


def test_pinning_covers_threads_started_before_and_after():
    cpu = min(os.sched_getaffinity(0))
    code = f"""
import threading, time, pathlib
from specdec.ops import cpu_affinity
stop = threading.Event()
early = threading.Thread(target=stop.wait); early.start()
assert cpu_affinity.pin_process("{cpu}") == {{{cpu}}}
late = threading.Thread(target=stop.wait); late.start()
lists = set()
for t in pathlib.Path("/proc/self/task").iterdir():
    for line in (t / "status").read_text().splitlines():
        if line.startswith("Cpus_allowed_list:"):
            lists.add(line.split(":", 1)[1].strip())
stop.set()
print(len(list(pathlib.Path("/proc/self/task").iterdir())), sorted(lists))
try:
    cpu_affinity.pin_process("4096")
except ValueError as e:
    print("refused:", e)
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    first, refused = out.stdout.strip().splitlines()
    assert first.endswith(f"['{cpu}']"), first  # every thread, the one started before pinning too
    assert "CPU 4096 is not available" in refused and "allowed:" in refused


def test_a_service_started_with_cpu_affinity_runs_only_there(tmp_path):
    cpu = max(os.sched_getaffinity(0))
    proc = ServiceProcess("target", ["target", "--model", TARGET, "--listen", "127.0.0.1:0", "--device", "cpu",
                                     "--profile-forward", "off", "--cpu-affinity", str(cpu)], tmp_path).start()
    try:
        proc.wait_ready(120)
        assert _thread_affinities(proc.proc.pid) == {str(cpu)}  # grpc's, torch's and the handlers' threads
    finally:
        proc.stop()
    bad = ServiceProcess("bad", ["target", "--model", TARGET, "--listen", "127.0.0.1:0", "--cpu-affinity", "0-4096"],
                         tmp_path).start()
    with pytest.raises(RuntimeError, match="exited") as err:
        bad.wait_ready(60)
    assert "is not available to this process (allowed:" in str(err.value)


def test_where_threads_cannot_be_pinned_run_pins_nothing_and_the_flag_says_why(monkeypatch):
    monkeypatch.setattr(cpu_affinity, "SUPPORTED", False)
    assert local_stack_plan(1, 1) is None  # `specdec run` on macOS: not pinned, not a crash
    assert cpu_affinity.pin_process("") is None
    with pytest.raises(ValueError, match="Linux only"):
        cpu_affinity.pin_process("0")
