"""Linux network namespaces as "hosts" for tests (tests/test_multihost.py): a bridge, one namespace per host joined
to it by a veth pair, processes started inside them. Needs root and iproute2.

Every name carries the test process's id, so parallel runs do not clash, and a later run deletes what a crashed
one left. The subnet exists only inside these namespaces: nothing is added to the root namespace (no veth end,
no address, no route), so test traffic cannot leave them.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
SUBNET = "10.213.0"
NS_RE = re.compile(r"^sd-([a-z]+[0-9]*)-(\d+)$")


def sh(*args: str, check: bool = True, timeout: float = 20) -> subprocess.CompletedProcess:
    out = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout)
    if check and out.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed ({out.returncode}): {out.stderr.strip()}")
    return out


def why_not_available() -> str | None:
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
    """SIGKILL every process in the namespace (the host dies; its namespace and address stay)."""
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
    """The namespaces, the bridge and the veths of one run: host `role` is namespace sd-ROLE-TAG with address
    SUBNET.N on its eth0 (N: the role's number in `hosts`), joined to the bridge br0 in sd-net-TAG."""

    def __init__(self, tag: str, hosts: dict[str, int]):
        self.tag = tag
        self.hosts = hosts
        self.hub = f"sd-net-{tag}"
        self.ns = {role: f"sd-{role}-{tag}" for role in hosts}

    def ip(self, role: str) -> str:
        return f"{SUBNET}.{self.hosts[role]}"

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

    def names(self) -> list[str]:
        return [*self.ns.values(), self.hub]

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

    def link(self, role: str, up: bool) -> None:
        sh("ip", "-n", self.ns[role], "link", "set", "eth0", "up" if up else "down")


def _env() -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)}
    env.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)  # no collector in these namespaces
    return env


class Proc:
    """A process started inside a namespace; ready when it prints its ready line on stdout."""

    def __init__(self, name: str, ns: str, argv: list[str], log_dir: pathlib.Path, ready_prefix: str | None):
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        with open(self.log_path, "ab") as log:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(["ip", "netns", "exec", ns, *argv], stdout=subprocess.PIPE, stderr=log,
                                         env=_env(), cwd=ROOT, start_new_session=True)
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
    """A load client living in a namespace (tests/netns_agent.py): one JSON request per line on stdin, one JSON
    reply per line on stdout."""

    def __init__(self, ns: str, log_dir: pathlib.Path):
        self.log_path = log_dir / "agent.log"
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-m", "tests.netns_agent",
                                          "agent"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                                         env=_env(), cwd=ROOT, text=True, start_new_session=True)

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
