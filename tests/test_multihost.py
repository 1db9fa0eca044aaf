"""Multi-host: Redis, target, draft and orchestrator each on its own "host" (a network namespace).

Topology (one run; every name carries this process's id, so parallel runs do not clash)::

    sd-redis-PID  10.213.0.1  eth0 ─┐
    sd-target-PID 10.213.0.2  eth0 ─┤ veth pairs to the bridge br0 in sd-net-PID
    sd-draft-PID  10.213.0.3  eth0 ─┤ (the delay is put on the draft's eth0: draft -> rest)
    sd-orch-PID   10.213.0.4  eth0 ─┘ (the load client runs here too)

The 10.213.0.0/24 subnet exists only inside these namespaces: nothing is added to the root namespace
(no veth end, no address, no route), so test traffic cannot leave them.

For each one-way delay in DELAYS_MS between the draft host and the rest, a bounded load (REQUESTS greedy
requests of MAX_NEW tokens, ignore_eos) runs through SpecdecClient; acceptance, tokens/s and fallback
steps are recorded. Then every process of the draft host is SIGKILLed and the same load must still
complete with tokens identical to the target-only reference computed at the start of the run; the
draft host is started again (speculation resumes), then cut off the network (link down: calls end on
their deadline instead of a refused connection), and the tokens must again be identical. The
per-delay table goes to <tmp>/multihost_results.json and is printed. Correctness is asserted, not speed.

The delay is `tc qdisc ... netem delay Xms` on the draft's veth. Where the kernel has no netem qdisc
(e.g. a VM kernel built without sch_netem), a userspace relay in the draft namespace delays the
draft -> rest byte stream by X ms instead (same direction, same constant one-way delay); the results
say which was used ("delay_method").

The services run with --insecure: the namespaces' private subnet is the trusted network (no TLS, no tokens).

Needs root with `ip` and `tc`; otherwise the test is skipped and says why.
"""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
TARGET = "tiny:vocab=64,layers=2,hidden=64,seed=0,std=0.3"
DRAFT = "tiny:vocab=64,layers=1,hidden=64,seed=0,std=0.3"
DELAYS_MS = (0, 1, 5, 20)
REQUESTS = 6
MAX_NEW = 32
PROMPTS = [[1 + i, 5, 9, 12, 5 + 2 * i, 9, 3 + i] for i in range(REQUESTS)]

SUBNET = "10.213.0"
HOSTS = {"redis": 1, "target": 2, "draft": 3, "orch": 4}
PORTS = {"redis": 6379, "target": 50052, "draft": 50051, "orch": 50050}
DRAFT_INNER_PORT = 50061  # relay mode: the draft service listens here on the draft host's loopback
NS_RE = re.compile(r"^sd-(net|redis|target|draft|orch)-(\d+)$")

pytestmark = [pytest.mark.multihost, pytest.mark.serial]  # serial: timing-sensitive (scripts/test.sh)


# --------------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------------


def sh(*args: str, check: bool = True, timeout: float = 20) -> subprocess.CompletedProcess:
    out = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout)
    if check and out.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed ({out.returncode}): {out.stderr.strip()}")
    return out


def _why_not_available() -> str | None:
    if not sys.platform.startswith("linux"):
        return f"network namespaces need Linux (this is {sys.platform})"
    if os.geteuid() != 0:
        return f"needs root for ip netns / veth / tc (running as uid {os.geteuid()})"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed"
    probe = f"sd-probe-{os.getpid()}"
    out = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if out.returncode != 0:
        return f"cannot create a network namespace as root (`ip netns add` said: {out.stderr.strip()})"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def ns_pids(ns: str) -> list[int]:
    out = sh("ip", "netns", "pids", ns, check=False)
    return [int(p) for p in out.stdout.split()] if out.returncode == 0 else []


def kill_namespace_processes(ns: str) -> list[int]:
    pids = ns_pids(ns)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return pids


def delete_namespace(ns: str) -> None:
    kill_namespace_processes(ns)
    sh("ip", "netns", "del", ns, check=False)


def clean_leftovers() -> list[str]:
    """Delete namespaces of earlier runs whose pytest process is gone (a crashed or killed run)."""
    removed = []
    for line in sh("ip", "netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        m = NS_RE.match(name)
        if not m:
            continue
        owner = int(m.group(2))
        if owner != os.getpid() and pathlib.Path(f"/proc/{owner}").exists():
            continue  # a live parallel run owns it
        delete_namespace(name)
        removed.append(name)
    return removed


class Net:
    """The namespaces, the bridge and the veths of one run."""

    def __init__(self, tag: str):
        self.tag = tag
        self.hub = f"sd-net-{tag}"
        self.ns = {role: f"sd-{role}-{tag}" for role in HOSTS}

    def ip(self, role: str) -> str:
        return f"{SUBNET}.{HOSTS[role]}"

    def create(self) -> None:
        sh("ip", "netns", "add", self.hub)
        sh("ip", "-n", self.hub, "link", "set", "lo", "up")
        sh("ip", "-n", self.hub, "link", "add", "br0", "type", "bridge")
        sh("ip", "-n", self.hub, "link", "set", "br0", "up")
        for role, ns in self.ns.items():
            sh("ip", "netns", "add", ns)
            sh("ip", "-n", ns, "link", "set", "lo", "up")
            # Both ends are created inside the namespaces: nothing appears in the root namespace.
            sh("ip", "-n", self.hub, "link", "add", f"h-{role}", "type", "veth", "peer", "name", "eth0",
               "netns", ns)
            sh("ip", "-n", self.hub, "link", "set", f"h-{role}", "master", "br0")
            sh("ip", "-n", self.hub, "link", "set", f"h-{role}", "up")
            sh("ip", "-n", ns, "addr", "add", f"{self.ip(role)}/24", "dev", "eth0")
            sh("ip", "-n", ns, "link", "set", "eth0", "up")

    def destroy(self) -> None:
        for ns in [*self.ns.values(), self.hub]:
            delete_namespace(ns)

    def netem_available(self) -> tuple[bool, str]:
        out = sh("ip", "netns", "exec", self.hub, "tc", "qdisc", "add", "dev", "lo", "root", "netem", "delay", "0ms",
                 check=False)
        if out.returncode == 0:
            sh("ip", "netns", "exec", self.hub, "tc", "qdisc", "del", "dev", "lo", "root", check=False)
            return True, ""
        return False, out.stderr.strip()

    def set_netem(self, role: str, delay_ms: float) -> None:
        sh("ip", "netns", "exec", self.ns[role], "tc", "qdisc", "replace", "dev", "eth0", "root", "netem", "delay",
           f"{delay_ms}ms")


class Proc:
    """A process started inside a namespace; ready when it prints its ready line on stdout."""

    def __init__(self, name: str, ns: str, argv: list[str], log_dir: pathlib.Path, ready_prefix: str | None):
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)}
        env.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)  # no collector in these namespaces
        self.proc = subprocess.Popen(["ip", "netns", "exec", ns, *argv], stdout=subprocess.PIPE,
                                     stderr=open(self.log_path, "ab"), env=env, cwd=ROOT, start_new_session=True)
        self.ready_line: str | None = None
        self._ready = threading.Event()
        self._prefix = ready_prefix
        if ready_prefix is None:
            self._ready.set()
        threading.Thread(target=self._watch, daemon=True).start()

    def _watch(self) -> None:
        for raw in iter(self.proc.stdout.readline, b""):
            line = raw.decode(errors="replace").strip()
            if self._prefix and line.startswith(self._prefix) and not self._ready.is_set():
                self.ready_line = line
                self._ready.set()

    def wait_ready(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._ready.wait(0.1):
                return self.ready_line or ""
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.tail()}")
        raise TimeoutError(f"{self.name} not ready after {timeout:.0f} s:\n{self.tail()}")

    def tail(self, n: int = 25) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass


class Agent:
    """A load client living in a namespace: one JSON request per line on stdin, one JSON reply per line."""

    def __init__(self, ns: str, log_dir: pathlib.Path):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, str(pathlib.Path(__file__)), "agent"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=open(log_dir / "agent.log", "ab"), env=env, cwd=ROOT, text=True,
                                     start_new_session=True)
        self.log_path = log_dir / "agent.log"

    def call(self, timeout: float = 60.0, **request) -> dict:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        box: list[str] = []
        reader = threading.Thread(target=lambda: box.append(self.proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(timeout)
        if not box or not box[0]:
            raise RuntimeError(f"agent gave no answer to {request.get('op')} within {timeout} s:\n"
                               f"{self.log_path.read_text(errors='replace')[-3000:]}")
        return json.loads(box[0])

    def stop(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(10)


# --------------------------------------------------------------------------------------------------
# the test
# --------------------------------------------------------------------------------------------------


@pytest.fixture
def net():
    reason = _why_not_available()
    if reason:
        print(f"SKIP multihost: {reason}", file=sys.stderr)
        pytest.skip(f"multi-host test needs root + iproute2 network namespaces: {reason}")
    clean_leftovers()
    n = Net(str(os.getpid()))
    try:
        n.create()
        yield n
    finally:
        n.destroy()
        assert not any(ns in sh("ip", "netns", "list").stdout.split() for ns in [*n.ns.values(), n.hub])


def _summary(results: list[dict]) -> dict:
    tokens = sum(len(r["token_ids"]) for r in results)
    wall = sum(r["wall_s"] for r in results)
    stat = lambda k: sum(int(r["stats"].get(k, 0) or 0) for r in results)  # noqa: E731
    proposed, accepted, steps = stat("draft_tokens_proposed"), stat("draft_tokens_accepted"), stat("verify_steps")
    return {
        "requests": len(results),
        "completed": sum(r["finish_reason"] == "length" and len(r["token_ids"]) == MAX_NEW for r in results),
        "tokens": tokens,
        "tokens_per_s": round(tokens / wall, 1) if wall else 0.0,
        "acceptance_rate": round(accepted / proposed, 3) if proposed else None,
        "mean_accepted_length": round((accepted + steps) / steps, 2) if steps else None,
        "verify_steps": steps,
        "fallback_steps": stat("fallback_steps"),
        "draft_failures": stat("draft_failures"),
        "wall_s": round(wall, 2),
        "wall_s_each": [round(r["wall_s"], 2) for r in results],
    }


def test_multihost_delays_and_draft_host_loss(net, tmp_path, capsys):
    t_start = time.monotonic()
    logs = tmp_path / "logs"
    logs.mkdir()
    netem, netem_error = net.netem_available()
    method = "netem" if netem else "relay"
    py = sys.executable
    from specdec.ops.redis_server import redis_server_binary

    procs: list[Proc] = []
    agent = None
    control = tmp_path / "relay_delay_ms"
    control.write_text("0")

    def start_draft_host() -> list[Proc]:
        started = []
        if method == "relay":
            listen = f"127.0.0.1:{DRAFT_INNER_PORT}"
            started.append(Proc("relay", net.ns["draft"],
                                [py, str(pathlib.Path(__file__)), "relay", f"{net.ip('draft')}:{PORTS['draft']}",
                                 listen, str(control)], logs, "RELAY_READY"))
        else:
            listen = f"{net.ip('draft')}:{PORTS['draft']}"
        started.append(Proc("draft", net.ns["draft"],
                            [py, "-m", "launcher.cli", "serve", "draft", "--strategy", "model", "--model", DRAFT,
                             "--listen", listen, "--device", "cpu", "--dtype", "float32", "--threads", "1",
                             "--insecure"],
                            logs, "SPECDEC_READY"))
        procs.extend(started)
        return started

    try:
        redis = Proc("redis", net.ns["redis"],
                     [redis_server_binary(), "--port", str(PORTS["redis"]), "--bind", net.ip("redis"), "--save", "",
                      "--appendonly", "no", "--protected-mode", "no", "--dir", str(tmp_path)],
                     logs, None)  # ready when the agent's PING answers
        procs.append(redis)
        target = Proc("target", net.ns["target"],
                      [py, "-m", "launcher.cli", "serve", "target", "--model", TARGET,
                       "--listen", f"{net.ip('target')}:{PORTS['target']}", "--device", "cpu", "--dtype", "float32",
                       "--threads", "1", "--insecure"], logs, "SPECDEC_READY")
        procs.append(target)
        draft_host = start_draft_host()
        agent = Agent(net.ns["orch"], logs)
        redis_url = f"redis://{net.ip('redis')}:{PORTS['redis']}/0"
        assert agent.call(op="wait_redis", url=redis_url, timeout_s=20)["ok"], "redis unreachable across namespaces"
        target.wait_ready(120)
        for p in draft_host:
            p.wait_ready(120)
        orch = Proc("orchestrator", net.ns["orch"],
                    [py, "-m", "launcher.cli", "serve", "orchestrator",
                     "--listen", f"{net.ip('orch')}:{PORTS['orch']}",
                     "--target", f"{net.ip('target')}:{PORTS['target']}",
                     "--draft", f"{net.ip('draft')}:{PORTS['draft']}",
                     "--redis", redis_url, "--draft-len", "4", "--insecure"], logs, "SPECDEC_READY")
        procs.append(orch)
        orch.wait_ready(120)
        address = f"{net.ip('orch')}:{PORTS['orch']}"
        draft_address = f"{net.ip('draft')}:{PORTS['draft']}"
        startup_s = time.monotonic() - t_start

        def load(speculation: bool | None) -> list[dict]:
            reply = agent.call(op="generate", address=address, prompts=PROMPTS, max_new_tokens=MAX_NEW,
                               speculation=speculation, rpc_timeout_s=120, timeout=150)
            assert not reply.get("error"), f"generation failed: {reply['error']}\norchestrator log:\n{orch.tail()}"
            return reply["results"]

        reference = load(speculation=False)
        ref_tokens = [r["token_ids"] for r in reference]
        assert all(len(t) == MAX_NEW for t in ref_tokens), [len(t) for t in ref_tokens]
        table = {"delay_method": method, "netem_error": netem_error or None, "startup_s": round(startup_s, 1),
                 "requests_per_phase": REQUESTS, "max_new_tokens": MAX_NEW, "draft_len": 4,
                 "target_only": _summary(reference), "delays": []}

        for delay in DELAYS_MS:
            if method == "netem":
                net.set_netem("draft", delay)
            else:
                control.write_text(str(delay))
                time.sleep(0.2)  # the relay re-reads its control file every 50 ms
            rtt = agent.call(op="ping", address=draft_address, n=7)
            results = load(speculation=True)
            row = {"delay_ms": delay, "draft_health_rtt_ms": rtt.get("median_ms"), **_summary(results)}
            row["identical_tokens"] = [r["token_ids"] for r in results] == ref_tokens
            table["delays"].append(row)
            assert row["identical_tokens"], f"delay {delay} ms: speculative tokens differ from target-only"
            assert row["completed"] == REQUESTS, row
        if method == "netem":
            net.set_netem("draft", 0)
        else:
            control.write_text("0")

        # The draft host dies: SIGKILL every process in its namespace (the namespace and its address stay,
        # so connections are refused rather than timing out).
        killed = kill_namespace_processes(net.ns["draft"])
        for p in draft_host:
            p.proc.wait(10)
        assert not ns_pids(net.ns["draft"])
        results = load(speculation=True)
        row = {"phase": "draft host killed (SIGKILL)", "killed_pids": len(killed), **_summary(results)}
        row["identical_tokens"] = [r["token_ids"] for r in results] == ref_tokens
        table["draft_killed"] = row
        assert row["identical_tokens"], "after the draft host died, tokens differ from the target-only reference"
        assert row["completed"] == REQUESTS, row
        assert row["verify_steps"] == 0 and row["fallback_steps"] > 0, row  # it really ran without the draft

        # The draft host comes back: speculation should resume after the orchestrator's cool-down.
        for p in start_draft_host():
            p.wait_ready(120)
        time.sleep(2.5)  # > the orchestrator's draft cool-down / breaker open time (1 s by default)
        results = load(speculation=True)
        row = {"phase": "draft host restarted", **_summary(results)}
        row["identical_tokens"] = [r["token_ids"] for r in results] == ref_tokens
        table["draft_restarted"] = row
        assert row["identical_tokens"] and row["completed"] == REQUESTS, row

        # The draft host drops off the network (its link goes down; processes stay alive): packets are
        # silently lost, so draft calls end on their deadline instead of a refused connection.
        sh("ip", "-n", net.ns["draft"], "link", "set", "eth0", "down")
        results = load(speculation=True)
        row = {"phase": "draft host unreachable (eth0 down)", **_summary(results)}
        row["identical_tokens"] = [r["token_ids"] for r in results] == ref_tokens
        table["draft_unreachable"] = row
        assert row["identical_tokens"], "with the draft host unreachable, tokens differ from the reference"
        assert row["completed"] == REQUESTS, row
        table["total_s"] = round(time.monotonic() - t_start, 1)
    except BaseException:
        for p in procs:
            if p.proc.poll() is not None and p.proc.returncode not in (0, -9):
                print(f"--- {p.name} exited {p.proc.returncode}:\n{p.tail()}", file=sys.stderr)
        raise
    finally:
        if agent is not None:
            agent.stop()
        for p in reversed(procs):
            p.stop()

    out = tmp_path / "multihost_results.json"
    out.write_text(json.dumps(table, indent=2))
    with capsys.disabled():
        print(f"\nmulti-host results ({out}):")
        print(format_table(table))


def format_table(table: dict) -> str:
    cols = ["delay_ms", "draft_health_rtt_ms", "acceptance_rate", "mean_accepted_length", "tokens_per_s",
            "verify_steps", "fallback_steps", "draft_failures", "completed", "identical_tokens"]
    rows = [cols] + [[str(r.get(c)) for c in cols] for r in table["delays"]]
    for key in ("target_only", "draft_killed", "draft_restarted", "draft_unreachable"):
        if key in table:
            r = table[key]
            rows.append([key] + [str(r.get(c, "")) for c in cols[1:]])
    widths = [max(len(r[i]) for r in rows) for i in range(len(cols))]
    lines = ["  ".join(v.ljust(w) for v, w in zip(r, widths)) for r in rows]
    lines.append(f"delay method: {table['delay_method']}"
                 + (f" (netem unavailable: {table['netem_error']})" if table.get("netem_error") else "")
                 + f"; startup {table['startup_s']} s; total {table.get('total_s')} s")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------
# helper processes (run inside the namespaces): `python tests/test_multihost.py agent|relay ...`
# --------------------------------------------------------------------------------------------------


def _agent_main() -> int:
    """Load client in the orchestrator's namespace (the test process stays in the root namespace)."""
    import grpc

    sys.path.insert(0, str(ROOT))
    from specdec.client import SpecdecClient

    for line in sys.stdin:
        req = json.loads(line)
        try:
            if req["op"] == "wait_redis":
                import redis

                deadline, ok = time.monotonic() + req["timeout_s"], False
                while time.monotonic() < deadline and not ok:
                    try:
                        ok = bool(redis.Redis.from_url(req["url"], socket_timeout=1).ping())
                    except Exception:  # noqa: BLE001
                        time.sleep(0.1)
                reply = {"ok": ok}
            elif req["op"] == "ping":
                from grpc_health.v1 import health_pb2, health_pb2_grpc

                channel = grpc.insecure_channel(req["address"])
                stub = health_pb2_grpc.HealthStub(channel)
                stub.Check(health_pb2.HealthCheckRequest(), timeout=5, wait_for_ready=True)  # connect first
                times = []
                for _ in range(req["n"]):
                    t0 = time.perf_counter()
                    stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
                    times.append((time.perf_counter() - t0) * 1e3)
                channel.close()
                reply = {"median_ms": round(statistics.median(times), 2)}
            elif req["op"] == "generate":
                results = []
                with SpecdecClient(req["address"], timeout_s=req["rpc_timeout_s"]) as client:
                    client.wait_ready(30)
                    for prompt in req["prompts"]:
                        r = client.generate(prompt, max_new_tokens=req["max_new_tokens"], ignore_eos=True,
                                            temperature=0.0, speculation=req["speculation"])
                        results.append({"token_ids": r.token_ids, "finish_reason": r.finish_reason,
                                        "stats": r.stats, "wall_s": r.wall_s})
                reply = {"results": results}
            else:
                reply = {"error": f"unknown op {req['op']}"}
        except grpc.RpcError as e:
            reply = {"error": f"{e.code().name}: {e.details()}"}
        except Exception as e:  # noqa: BLE001
            reply = {"error": f"{type(e).__name__}: {e}"}
        print(json.dumps(reply, default=str), flush=True)
    return 0


def _relay_main(listen: str, upstream: str, control: str) -> int:
    """TCP relay on the draft host: bytes from the draft to the rest are held for the current delay
    (read from the control file, in ms), in order, like netem on the draft's egress."""
    lhost, lport = listen.rsplit(":", 1)
    uhost, uport = upstream.rsplit(":", 1)
    delay = [0.0]

    async def poll_control():
        while True:
            try:
                delay[0] = float(pathlib.Path(control).read_text().strip() or 0) / 1e3
            except (OSError, ValueError):
                pass
            await asyncio.sleep(0.05)

    async def pump(reader, writer, delayed: bool):
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        async def sender():
            try:
                while True:
                    due, data = await queue.get()
                    if data is None:
                        break
                    wait = due - loop.time()
                    if wait > 0:
                        await asyncio.sleep(wait)
                    writer.write(data)
                    await writer.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                writer.close()

        task = asyncio.create_task(sender())
        try:
            while True:
                data = await reader.read(65536)
                if not data:
                    break
                queue.put_nowait((loop.time() + (delay[0] if delayed else 0.0), data))
        except (ConnectionError, OSError):
            pass
        finally:
            queue.put_nowait((0.0, None))
            await task

    async def handle(client_reader, client_writer):
        try:
            up_reader, up_writer = await asyncio.open_connection(uhost, int(uport))
        except OSError:
            client_writer.close()
            return
        await asyncio.gather(pump(client_reader, up_writer, delayed=False),
                             pump(up_reader, client_writer, delayed=True))

    async def main():
        asyncio.create_task(poll_control())
        server = await asyncio.start_server(handle, lhost, int(lport))
        print(f"RELAY_READY {listen} -> {upstream}", flush=True)
        async with server:
            await server.serve_forever()

    asyncio.run(main())
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["agent"]:
        raise SystemExit(_agent_main())
    if sys.argv[1:2] == ["relay"]:
        raise SystemExit(_relay_main(*sys.argv[2:5]))
    raise SystemExit(f"usage: {sys.argv[0]} agent | relay LISTEN UPSTREAM CONTROL_FILE")
