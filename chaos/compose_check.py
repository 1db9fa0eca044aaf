"""The compose deployment under a real Docker engine, checked from the host (scripts/compose_check.sh runs it).

    python -m chaos.compose_check [--project specdec] [--compose-file deploy/docker-compose.yml ...]

Brings the stack up (images already built), then through the published ports only (TLS + bearer tokens):
greedy generations over gRPC and the OpenAI HTTP API identical to target-only decoding; `docker kill` of the draft
containers mid-stream (the stream completes token-identical on the target alone, and speculation resumes when
`--scale draft=3` brings drafts back, found by DNS, with the orchestrator never restarted); with two targets,
`docker kill` of the busy one mid-stream (the session moves at once, no grace-period wait); `docker restart` of
Redis under streams (each completes identical or ends DATA_LOSS with what it got a true prefix); `down -v` leaves
nothing. Each check prints one line; the exit status is 1 when any failed. Timings of start-up and each fault too.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

import grpc

from specdec.client import SpecdecClient
from specdec.core.grpc_util import TlsConfig

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
LONG_TOKENS = 320     # a fault stream: long enough that the fault lands mid-stream
SHORT_TOKENS = 48
STALL_BOUND_S = 10.0  # the orchestrator's target grace is 30 s: a move that waited it would show here


class CheckFailed(AssertionError):
    pass


@dataclass
class Report:
    failures: list[str] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)

    def check(self, ok: bool, what: str) -> bool:
        print(f"[{'PASS' if ok else 'FAIL'}] {what}", flush=True)
        if not ok:
            self.failures.append(what)
        return ok

    def time(self, name: str, seconds: float) -> None:
        self.timings[name] = round(seconds, 1)
        print(f"[TIME] {name}: {seconds:.1f} s", flush=True)


class Stack:
    """docker-compose and docker, for one compose project."""

    def __init__(self, project: str, files: list[str], compose: str = "docker-compose"):
        self.project, self.files, self.compose_cmd = project, files, compose.split()
        self.scale: dict[str, int] = {"draft": 2, "target": 1}

    def compose(self, *args: str, timeout: float = 900) -> str:
        cmd = [*self.compose_cmd, "-p", self.project]
        for f in self.files:
            cmd += ["-f", f]
        # docker-compose 1.29 gives up on an engine call after COMPOSE_HTTP_TIMEOUT (60 s): a loaded host's health
        # polls and stops take longer.
        return _run([*cmd, *args], timeout, env={**os.environ, "COMPOSE_HTTP_TIMEOUT": os.environ.get(
            "COMPOSE_HTTP_TIMEOUT", "900")})

    def up(self, **scale: int) -> None:
        """`up -d` with every scale so far (compose scales a service back to its default when not told)."""
        self.scale.update(scale)
        flags = [a for name, n in sorted(self.scale.items()) for a in ("--scale", f"{name}={n}")]
        self.compose("up", "-d", "--no-build", *flags)

    def containers(self, service: str, running: bool = True) -> list[str]:
        args = ["docker", "ps", "-q", "--no-trunc", "--filter", f"label=com.docker.compose.project={self.project}",
                "--filter", f"label=com.docker.compose.service={service}"]
        if not running:
            args.insert(2, "-a")
        return _run(args).split()

    def inspect(self, container: str, fmt: str) -> str:
        return _run(["docker", "inspect", "-f", fmt, container]).strip()

    def healthy(self, service: str, count: int, timeout_s: float = 300) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            ids = self.containers(service)
            states = [self.inspect(c, "{{.State.Health.Status}}") for c in ids]
            if sum(s == "healthy" for s in states) >= count:
                return
            time.sleep(1)
        raise CheckFailed(f"{service}: {count} healthy replicas not reached in {timeout_s:.0f} s")


def _run(cmd: list[str], timeout: float = 120, env: dict | None = None) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if done.returncode != 0:
        raise CheckFailed(f"{' '.join(cmd)} failed ({done.returncode}): {done.stderr.strip()[-1500:]}")
    return done.stdout


def cpu_seconds(container: str) -> float:
    """The container's CPU time so far (cgroup v1 or v2), to tell which replica serves a stream."""
    for path, scale in ((f"/sys/fs/cgroup/cpuacct/docker/{container}/cpuacct.usage", 1e-9),
                        (f"/sys/fs/cgroup/cpu,cpuacct/docker/{container}/cpuacct.usage", 1e-9),
                        (f"/sys/fs/cgroup/system.slice/docker-{container}.scope/cpu.stat", 1e-6)):
            if os.path.exists(path):
                text = open(path).read()
                value = text.split()[1] if text.startswith("usage_usec") else text
                return float(value) * scale
    raise CheckFailed(f"no cgroup CPU accounting found for container {container[:12]}")


def busiest(containers: list[str], window_s: float = 1.0) -> str:
    before = {c: cpu_seconds(c) for c in containers}
    time.sleep(window_s)
    return max(containers, key=lambda c: cpu_seconds(c) - before[c])


class Stream(threading.Thread):
    """One gRPC generation in the background: its chunks with arrival times, its end."""

    def __init__(self, client: SpecdecClient, prompt: str, max_new_tokens: int):
        super().__init__(daemon=True)
        self.client, self.prompt, self.max_new_tokens = client, prompt, max_new_tokens
        self.tokens: list[int] = []
        self.arrivals: list[float] = []
        self.contiguous = True
        self.stats: dict = {}
        self.error: grpc.RpcError | None = None

    def run(self) -> None:
        def on_message(msg) -> None:
            if msg.token_ids:
                self.contiguous &= msg.offset == len(self.tokens)
                self.tokens.extend(msg.token_ids)
                self.arrivals.append(time.monotonic())
        try:
            result = self.client.generate(self.prompt, on_message=on_message, max_new_tokens=self.max_new_tokens,
                                          ignore_eos=True)
            self.stats = result.stats
        except grpc.RpcError as e:
            self.error = e

    def wait_tokens(self, n: int, timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        while len(self.tokens) < n and self.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        if len(self.tokens) < n:
            raise CheckFailed(f"stream got {len(self.tokens)} tokens, expected {n} before the fault "
                              f"({self.error.code().name if self.error else 'no error'})")

    def max_gap_s(self) -> float:
        return max((b - a for a, b in zip(self.arrivals, self.arrivals[1:])), default=0.0)

    def code(self) -> str:
        return self.error.code().name if self.error else "OK"


def _refusal(client: SpecdecClient) -> str:
    """The status a short generation gets from `client` ("no error" if it is served); closes the client."""
    try:
        client.generate(PROMPTS[0], max_new_tokens=2)
        return "no error"
    except grpc.RpcError as e:
        return e.code().name
    finally:
        client.close()


class ComposeCheck:
    def __init__(self, stack: Stack, report: Report, grpc_port: int, http_port: int, workdir: str):
        self.stack, self.report = stack, report
        self.grpc_address, self.http_url = f"127.0.0.1:{grpc_port}", f"http://127.0.0.1:{http_port}"
        self.workdir = workdir
        self.reference: dict[tuple[str, int], list[int]] = {}

    # --- start-up and the client's credentials, from the running stack ---------------------------------------------

    def start(self) -> None:
        t0 = time.monotonic()
        self.stack.up()  # compose waits for each health-gated dependency; the orchestrator is last
        self.stack.healthy("orchestrator", 1)
        self.report.time("start-up (up -d until the orchestrator is healthy)", time.monotonic() - t0)
        orch = self.stack.containers("orchestrator")[0]
        ca = os.path.join(self.workdir, "ca.pem")
        _run(["docker", "cp", f"{orch}:/tls/ca.pem", ca])
        self.token = _run(["docker", "exec", orch, "cat", "/secrets/auth_tokens"]).split()[0]
        self.client = SpecdecClient(self.grpc_address, timeout_s=300, token=self.token, tls=TlsConfig(ca=ca))
        self.orchestrator = (orch, self.stack.inspect(orch, "{{.State.StartedAt}}"))

    def orchestrator_never_restarted(self) -> bool:
        orch, started = self.orchestrator
        return (self.stack.containers("orchestrator") == [orch]
                and self.stack.inspect(orch, "{{.State.StartedAt}} {{.RestartCount}}") == f"{started} 0")

    def target_only(self, prompt: str, max_new_tokens: int) -> list[int]:
        key = (prompt, max_new_tokens)
        if key not in self.reference:
            result = self.client.generate(prompt, max_new_tokens=max_new_tokens, ignore_eos=True, speculation=False)
            self.reference[key] = result.token_ids
        return self.reference[key]

    # --- the public API ----------------------------------------------------------------------------------------------

    def security(self) -> None:
        refused = _refusal(SpecdecClient(self.grpc_address, timeout_s=10, token=self.token))
        self.report.check(refused == "UNAVAILABLE", f"gRPC without TLS is refused ({refused})")
        refused = _refusal(SpecdecClient(self.grpc_address, timeout_s=10, tls=self.client_tls()))
        self.report.check(refused == "UNAUTHENTICATED", f"gRPC over TLS without a token is refused ({refused})")
        status = self.http("GET", "/v1/models", token=None)[0]
        self.report.check(status == 401, f"HTTP /v1/models without a token: {status}")

    def client_tls(self) -> TlsConfig:
        return TlsConfig(ca=os.path.join(self.workdir, "ca.pem"))

    def http(self, method: str, path: str, body: dict | None = None, token: str | None = "default") -> tuple[int, dict]:
        headers = {"Content-Type": "application/json"}
        if token:
            headers["Authorization"] = f"Bearer {self.token if token == 'default' else token}"
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(self.http_url + path, data=data, headers=headers, method=method)
        try:
            with urllib.request.urlopen(request, timeout=300) as reply:
                return reply.status, json.loads(reply.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"{}")

    def generations(self) -> None:
        """Greedy, speculative, through the published ports: identical to target-only decoding."""
        from openai import OpenAI

        openai = OpenAI(base_url=self.http_url + "/v1", api_key=self.token, timeout=300)
        model = self.http("GET", "/v1/models")[1]["data"][0]["id"]
        for prompt in PROMPTS:
            want = self.target_only(prompt, SHORT_TOKENS)
            got = self.client.generate(prompt, max_new_tokens=SHORT_TOKENS, ignore_eos=True)
            s = got.stats
            self.report.check(got.token_ids == want and s["verify_steps"] > 0 and s["draft_tokens_accepted"] > 0,
                              f"gRPC (TLS + token) {prompt!r}: {len(want)} tokens identical to target-only: "
                              f"{got.token_ids == want}; speculated: {s['verify_steps']} verify steps, "
                              f"{s['draft_tokens_accepted']}/{s['draft_tokens_proposed']} drafted tokens accepted")
            reply = openai.completions.create(model=model, prompt=prompt, max_tokens=SHORT_TOKENS, temperature=0,
                                              extra_body={"ignore_eos": True})
            extra = reply.model_extra.get("specdec") or {}
            ids = extra.get("token_ids")
            self.report.check(ids == want and extra.get("num_drafts", 0) > 0,
                              f"HTTP /v1/completions (openai client, token) {prompt!r}: token ids identical to "
                              f"target-only: {ids == want}; {extra.get('num_drafts')} verify steps")

    # --- faults ------------------------------------------------------------------------------------------------------

    def stream_through(self, prompt: str, fault, label: str) -> Stream:
        """A long stream with `fault()` run once it is going; checks it completed token-identical."""
        want = self.target_only(prompt, LONG_TOKENS)
        stream = Stream(self.client, prompt, LONG_TOKENS)
        stream.start()
        stream.wait_tokens(24)
        at = len(stream.tokens)
        t0 = time.monotonic()
        fault()
        self.report.time(f"{label}: the fault itself", time.monotonic() - t0)
        stream.join(timeout=600)
        self.report.check(stream.code() == "OK" and stream.tokens == want and stream.contiguous,
                          f"{label}: the stream (fault at token {at}) completed ({stream.code()}), "
                          f"{len(stream.tokens)} tokens identical to target-only: {stream.tokens == want}, "
                          f"longest gap between blocks {stream.max_gap_s():.2f} s")
        return stream

    def draft_kill(self) -> None:
        drafts = self.stack.containers("draft")
        self.report.check(len(drafts) == 2, f"two draft replicas run ({len(drafts)})")

        def kill_drafts() -> None:
            first = busiest(drafts)  # the replica serving the stream first, then the rest: no draft is left
            for container in [first] + [c for c in drafts if c != first]:
                _run(["docker", "kill", container])
                time.sleep(0.5)

        stream = self.stream_through(PROMPTS[1], kill_drafts, "docker kill of every draft container mid-stream")
        s = stream.stats
        self.report.check(s.get("fallback_steps", 0) > 0 and s.get("draft_failures", 0) > 0,
                          f"the stream fell back to target-only: {s.get('fallback_steps')} fallback steps, "
                          f"{s.get('draft_failures')} draft failures ({s.get('draft_failures_by_kind')}), "
                          f"{s.get('replica_failovers')} replica failovers")
        alone = self.client.generate(PROMPTS[2], max_new_tokens=SHORT_TOKENS, ignore_eos=True)
        self.report.check(alone.token_ids == self.target_only(PROMPTS[2], SHORT_TOKENS),
                          f"with no draft running: a new generation is identical to target-only "
                          f"({alone.stats.get('fallback_steps')} fallback steps)")
        t0 = time.monotonic()
        self.stack.up(draft=3)
        self.stack.healthy("draft", 3)
        self.report.time("up -d --scale draft=3 until 3 drafts are healthy", time.monotonic() - t0)
        self.speculation_resumes(t0)

    def speculation_resumes(self, t0: float, timeout_s: float = 120) -> None:
        want = self.target_only(PROMPTS[0], SHORT_TOKENS)
        deadline, result = time.monotonic() + timeout_s, None
        while time.monotonic() < deadline:
            result = self.client.generate(PROMPTS[0], max_new_tokens=SHORT_TOKENS, ignore_eos=True)
            s = result.stats
            if s.get("fallback_steps", 0) == 0 and s.get("draft_tokens_accepted", 0) > 0:
                break
            time.sleep(1)
        s = result.stats
        self.report.time("drafts back until a generation speculates again", time.monotonic() - t0)
        drafts = self.http("GET", "/v1/models")[1]["data"][0]["specdec"]["drafts"]
        self.report.check(result.token_ids == want and s.get("fallback_steps", 0) == 0
                          and s.get("draft_tokens_accepted", 0) > 0,
                          f"speculation resumed: identical tokens, {s.get('verify_steps')} verify steps, "
                          f"{s.get('fallback_steps')} fallback steps; the orchestrator lists {len(drafts)} drafts")
        self.report.check(len(drafts) == 3, f"the 3 draft replicas were found by DNS ({[d['address'] for d in drafts]})")
        self.report.check(self.orchestrator_never_restarted(), "the orchestrator container was never restarted")

    def target_kill(self) -> None:
        t0 = time.monotonic()
        self.stack.up(target=2)
        self.stack.healthy("target", 2)
        time.sleep(6)  # the orchestrator re-resolves `target` every 5 s
        self.report.time("up -d --scale target=2 until both targets are healthy (+6 s DNS refresh)",
                         time.monotonic() - t0)
        targets = self.stack.containers("target")
        victim: list[str] = []

        def kill_busy_target() -> None:
            victim.append(busiest(targets))
            _run(["docker", "kill", victim[0]])

        stream = self.stream_through(PROMPTS[2], kill_busy_target, "docker kill of the busy target (2 targets)")
        s = stream.stats
        self.report.check(s.get("target_resyncs", 0) > 0 and stream.max_gap_s() < STALL_BOUND_S,
                          f"the session moved to the other target: {s.get('target_resyncs')} target resyncs, "
                          f"longest gap {stream.max_gap_s():.2f} s (< {STALL_BOUND_S:.0f} s; the grace period is 30 s)")
        after = self.client.generate(PROMPTS[0], max_new_tokens=SHORT_TOKENS, ignore_eos=True)
        self.report.check(after.token_ids == self.target_only(PROMPTS[0], SHORT_TOKENS),
                          "on the remaining target: a new generation is identical to target-only")
        self.report.check(self.orchestrator_never_restarted(), "the orchestrator container was never restarted")

    def redis_restart(self) -> None:
        redis = self.stack.containers("redis")[0]
        streams = [Stream(self.client, prompt, LONG_TOKENS) for prompt in PROMPTS]
        wants = [self.target_only(prompt, LONG_TOKENS) for prompt in PROMPTS]
        for stream in streams:
            stream.start()
        for stream in streams:
            stream.wait_tokens(16)
        t0 = time.monotonic()
        _run(["docker", "restart", redis])
        self.report.time("docker restart of the Redis container", time.monotonic() - t0)
        for stream, want in zip(streams, wants):
            stream.join(timeout=600)
            code, n = stream.code(), len(stream.tokens)
            prefix = stream.tokens == want[:n] and stream.contiguous
            ok = prefix and (code == "OK" and n == len(want) or code == "DATA_LOSS")
            self.report.check(ok, f"Redis restarted under a stream ({stream.prompt!r}): ended {code} after {n} "
                                  f"tokens, identical to target-only and without a hole: {prefix}")
        self.stack.healthy("redis", 1)
        after = self.client.generate(PROMPTS[1], max_new_tokens=SHORT_TOKENS, ignore_eos=True)
        self.report.check(after.token_ids == self.target_only(PROMPTS[1], SHORT_TOKENS),
                          "after the Redis restart: a new generation is identical to target-only")
        aof = _run(["docker", "exec", redis, "sh", "-c", "ls /data /data/appendonlydir 2>/dev/null"]).split()
        self.report.check(any(name.endswith(".aof") or name == "appendonlydir" for name in aof),
                          f"Redis keeps its append-only file in the redis-data volume ({' '.join(aof)})")

    def down(self) -> None:
        t0 = time.monotonic()
        self.stack.compose("down", "-v", "--remove-orphans", "--timeout", "20")
        self.report.time("down -v", time.monotonic() - t0)
        left = _run(["docker", "ps", "-aq", "--filter", f"label=com.docker.compose.project={self.stack.project}"]).split()
        volumes = _run(["docker", "volume", "ls", "-q", "--filter",
                        f"label=com.docker.compose.project={self.stack.project}"]).split()
        networks = _run(["docker", "network", "ls", "-q", "--filter",
                         f"label=com.docker.compose.project={self.stack.project}"]).split()
        self.report.check(not (left or volumes or networks),
                          f"down -v left nothing: {len(left)} containers, {len(volumes)} volumes, "
                          f"{len(networks)} networks")


def stop_times(stack: Stack, report: Report) -> None:
    """SIGTERM (docker stop): every specdec service exits within a few seconds, not at the grace period's kill."""
    for service in ("orchestrator", "draft", "target"):
        container = stack.containers(service)[0]
        t0 = time.monotonic()
        _run(["docker", "stop", "--time", "15", container], timeout=60)
        took = time.monotonic() - t0
        code = stack.inspect(container, "{{.State.ExitCode}}")
        report.check(took < 10 and code != "137", f"docker stop {service}: exited {code} in {took:.1f} s (SIGTERM, "
                                                  f"not the SIGKILL at 15 s)")


def json_logs(stack: Stack, report: Report) -> None:
    container = stack.containers("orchestrator")[0]
    done = subprocess.run(["docker", "logs", "--tail", "20", container], capture_output=True, text=True, timeout=30)
    lines = [ln for ln in (done.stdout + done.stderr).splitlines() if ln.strip()]
    parsed, other = 0, []
    for line in lines:
        try:
            parsed += isinstance(json.loads(line), dict)
        except ValueError:
            other.append(line)
    # Not logs: the start-up protocol lines on stdout (SPECDEC_READY ADDRESS, SPECDEC_HTTP URL) that launchers read.
    stray = [ln for ln in other if not re.match(r"SPECDEC_[A-Z]+ \S+$", ln)]
    report.check(parsed > 0 and not stray, f"orchestrator logs are JSON lines ({parsed} of the last {len(lines)}; "
                                           f"{len(other) - len(stray)} start-up protocol lines; other: {stray[:2]})")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m chaos.compose_check", description=__doc__.splitlines()[0])
    p.add_argument("--project", default="specdec")
    p.add_argument("--compose-file", action="append", default=None,
                   help="repeatable (default deploy/docker-compose.yml + deploy/docker-compose.noregistry.yml)")
    p.add_argument("--compose", default="docker-compose", help="the compose command ('docker compose' for v2)")
    p.add_argument("--grpc-port", type=int, default=int(os.environ.get("ORCHESTRATOR_PORT", 50050)))
    p.add_argument("--http-port", type=int, default=int(os.environ.get("HTTP_PORT", 8000)))
    p.add_argument("--keep", action="store_true", help="leave the stack up (no down -v) for a look")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    files = args.compose_file or ["deploy/docker-compose.yml", "deploy/docker-compose.noregistry.yml"]
    stack, report = Stack(args.project, files, args.compose), Report()
    with tempfile.TemporaryDirectory(prefix="specdec-compose-") as workdir:
        check = ComposeCheck(stack, report, args.grpc_port, args.http_port, workdir)
        try:
            check.start()
            json_logs(stack, report)
            check.security()
            check.generations()
            for fault in (check.draft_kill, check.target_kill, check.redis_restart):
                t0 = time.monotonic()
                fault()
                report.time(f"{fault.__name__} (all of it)", time.monotonic() - t0)
            stop_times(stack, report)
        except (CheckFailed, grpc.RpcError, OSError, subprocess.TimeoutExpired) as e:
            report.check(False, f"stopped: {type(e).__name__}: {e}")
        finally:
            if not args.keep:
                try:
                    check.down()
                except CheckFailed as e:
                    report.check(False, str(e))
    print(json.dumps({"ok": not report.failures, "failures": report.failures, "timings_s": report.timings}))
    return 0 if not report.failures else 1


if __name__ == "__main__":
    sys.exit(main())
