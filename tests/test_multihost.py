"""Multi-host: Redis, two targets, three drafts, two orchestrators and the load client, each on its own "host" (a
network namespace, tests/netns.py).

Topology (one run; every name carries this process's id, so parallel runs do not clash)::

    sd-redis-PID    10.213.0.1  ─┐
    sd-target0-PID  10.213.0.2  ─┤
    sd-target1-PID  10.213.0.3  ─┤
    sd-draft0-PID   10.213.0.4  ─┤ eth0 of each: veth pairs to the bridge br0 in sd-net-PID
    sd-draft1-PID   10.213.0.5  ─┤ (the delay is put on the drafts' side: draft -> rest)
    sd-draft2-PID   10.213.0.6  ─┤
    sd-orch0-PID    10.213.0.7  ─┤ each orchestrator: --target t0,t1 --draft d0,d1,d2, the same --redis
    sd-orch1-PID    10.213.0.8  ─┤
    sd-client-PID   10.213.0.9  ─┘ the load client (tests/netns_agent.py): request i starts on orchestrator i % 2

Phases, each a bounded load (REQUESTS greedy requests, ignore_eos) whose tokens must equal the target-only
reference computed at the start of the run (all requests at once, target-only):

1. for each one-way delay in DELAYS_MS between the draft hosts and the rest: acceptance, tokens/s and fallback
   steps are recorded (the per-delay table);
2. host loss mid-generation: REQUESTS long generations stream through both orchestrators at once; every process
   of the target0 host and of the orch0 host is SIGKILLed together. Sessions placed on target0 go on on target1;
   the client resumes the sessions of the dead orchestrator through orch1 (which takes each session once the
   dead one's lease, --session-lease-s, runs out);
3. on the surviving orchestrator and target: every process of every draft host is SIGKILLed (target-only
   decoding), the draft hosts are started again (speculation resumes), then cut off the network (link down:
   draft calls end on their deadline instead of a refused connection).

The table goes to <tmp>/multihost_results.json and is printed. Correctness is asserted, not speed.

The delay is `tc qdisc ... netem delay Xms` on each draft's veth. Where the kernel has no netem qdisc (e.g. a VM
kernel built without sch_netem), a userspace relay on each draft host delays the draft -> rest byte stream by X ms
instead (same direction, same constant one-way delay); the results say which was used ("delay_method").

The services run with --insecure: the namespaces' private subnet is the trusted network (no TLS, no tokens).

Needs root with `ip` and `tc`; otherwise the test is skipped and says why.
"""

from __future__ import annotations

import json
import os
import sys
import time

import pytest

from tests.netns import Agent, Net, Proc, clean_leftovers, kill_namespace_processes, ns_pids, sh, why_not_available

TARGET = "tiny:vocab=64,layers=2,hidden=64,seed=0,std=0.3"
DRAFT = "tiny:vocab=64,layers=1,hidden=64,seed=0,std=0.3"
DELAYS_MS = (0, 5, 20)
REQUESTS = 6
MAX_NEW = 32  # per request in the delay and draft phases
LONG_NEW = 200  # per request in the host-loss phase (and the reference: the phases above compare its prefix)
LEASE_S = 2.0  # --session-lease-s: how long a dead orchestrator's sessions stay fenced
PROMPTS = [[1 + i, 5, 9, 12, 5 + 2 * i, 9, 3 + i] for i in range(REQUESTS)]

TARGETS, DRAFTS, ORCHESTRATORS = ("target0", "target1"), ("draft0", "draft1", "draft2"), ("orch0", "orch1")
HOSTS = {"redis": 1, **{t: 2 + i for i, t in enumerate(TARGETS)}, **{d: 4 + i for i, d in enumerate(DRAFTS)},
         **{o: 7 + i for i, o in enumerate(ORCHESTRATORS)}, "client": 9}
PORTS = {"redis": 6379, "target": 50052, "draft": 50051, "orch": 50050}
DRAFT_INNER_PORT = 50061  # relay mode: the draft service listens here on the draft host's loopback
SERVICE = ["--device", "cpu", "--dtype", "float32", "--threads", "1", "--insecure"]

# Not serial: every check is on tokens, completions and moves, none on speed (a loaded host only makes the
# generations the kills must land in longer); the per-delay tokens/s it prints are indicative in a parallel run,
# docs/deploy.md quotes a run of this file alone.
pytestmark = pytest.mark.multihost


@pytest.fixture
def net():
    reason = why_not_available()
    if reason:
        print(f"SKIP multihost: {reason}", file=sys.stderr)
        pytest.skip(f"multi-host test needs root + iproute2 network namespaces: {reason}")
    clean_leftovers()
    n = Net(str(os.getpid()), HOSTS)
    try:
        n.create()
        yield n
    finally:
        n.destroy()
        assert not any(ns in sh("ip", "netns", "list").stdout.split() for ns in n.names())


def _summary(results: list[dict], n: int) -> dict:
    tokens = sum(len(r["token_ids"]) for r in results)
    wall = sum(r["wall_s"] for r in results)
    stat = lambda k: sum(int(r["stats"].get(k, 0) or 0) for r in results)  # noqa: E731
    proposed, accepted, steps = stat("draft_tokens_proposed"), stat("draft_tokens_accepted"), stat("verify_steps")
    return {
        "requests": len(results),
        "completed": sum(r["finish_reason"] == "length" and len(r["token_ids"]) == n for r in results),
        "tokens": tokens,
        "tokens_per_s": round(tokens / wall, 1) if wall else 0.0,
        "acceptance_rate": round(accepted / proposed, 3) if proposed else None,
        "mean_accepted_length": round((accepted + steps) / steps, 2) if steps else None,
        "verify_steps": steps,
        "fallback_steps": stat("fallback_steps"),
        "draft_failures": stat("draft_failures"),
        "resumes": sum(r.get("resumes", 0) for r in results),
        "wall_s": round(wall, 2),
        "wall_s_each": [round(r["wall_s"], 2) for r in results],
    }


class Cluster:
    """The services of one run, started in their namespaces."""

    def __init__(self, net: Net, tmp_path):
        self.net, self.tmp = net, tmp_path
        self.logs = tmp_path / "logs"
        self.logs.mkdir()
        netem, self.netem_error = net.netem_available()
        self.method = "netem" if netem else "relay"
        self.control = tmp_path / "relay_delay_ms"  # every relay reads the delay here
        self.control.write_text("0")
        self.procs: list[Proc] = []
        self.agent: Agent | None = None

    def address(self, role: str) -> str:
        return f"{self.net.ip(role)}:{PORTS[role.rstrip('0123456789')]}"

    def start(self, name: str, role: str, argv: list[str], ready: str | None = "SPECDEC_READY") -> Proc:
        p = Proc(name, self.net.ns[role], argv, self.logs, ready)
        self.procs.append(p)
        return p

    def serve(self, role: str, *args: str) -> Proc:
        return self.start(role, role, [sys.executable, "-m", "launcher.cli", "serve", *args])

    def start_draft_host(self, role: str) -> list[Proc]:
        started = []
        if self.method == "relay":
            listen = f"127.0.0.1:{DRAFT_INNER_PORT}"
            started.append(self.start(f"relay-{role}", role, [sys.executable, "-m", "tests.netns_agent", "relay",
                                                              self.address(role), listen, str(self.control)],
                                      "RELAY_READY"))
        else:
            listen = self.address(role)
        started.append(self.serve(role, "draft", "--strategy", "model", "--model", DRAFT, "--listen", listen,
                                  *SERVICE))
        return started

    def set_delay(self, delay_ms: float) -> None:
        if self.method == "netem":
            for d in DRAFTS:
                self.net.set_netem(d, delay_ms)
        else:
            self.control.write_text(str(delay_ms))
            time.sleep(0.2)  # the relays re-read their control file every 50 ms

    def up(self) -> None:
        from specdec.ops.redis_server import redis_server_binary

        self.start("redis", "redis", [redis_server_binary(), "--port", str(PORTS["redis"]), "--bind",
                                      self.net.ip("redis"), "--save", "", "--appendonly", "no", "--protected-mode",
                                      "no", "--dir", str(self.tmp)], None)  # ready when the agent's PING answers
        targets = [self.serve(t, "target", "--model", TARGET, "--listen", self.address(t), *SERVICE) for t in TARGETS]
        drafts = [p for d in DRAFTS for p in self.start_draft_host(d)]
        self.agent = Agent(self.net.ns["client"], self.logs)
        self.redis_url = f"redis://{self.address('redis')}/0"
        assert self.agent.call(op="wait_redis", url=self.redis_url, timeout_s=20)["ok"], "redis unreachable"
        for p in targets + drafts:
            p.wait_ready(180)
        orchestrators = [self.serve(o, "orchestrator", "--listen", self.address(o),
                                    "--target", ",".join(self.address(t) for t in TARGETS),
                                    "--draft", ",".join(self.address(d) for d in DRAFTS),
                                    "--redis", self.redis_url, "--draft-len", "4", "--session-lease-s", str(LEASE_S),
                                    "--insecure") for o in ORCHESTRATORS]
        for p in orchestrators:
            p.wait_ready(180)
        self.orchestrators = [self.address(o) for o in ORCHESTRATORS]

    def load(self, speculation: bool | None, n: int = MAX_NEW, together: bool = False) -> list[dict]:
        """REQUESTS generations, request i through orchestrator i % 2: one after another, or all at once."""
        request = dict(addresses=self.orchestrators, prompts=PROMPTS, max_new_tokens=n, speculation=speculation,
                       rpc_timeout_s=120)
        if together:
            self.agent.call(op="start", **request)
            reply = self.agent.call(op="collect", timeout_s=200, timeout=240)
        else:
            reply = self.agent.call(op="generate", timeout=240, **request)
        assert not reply.get("error"), f"generation failed: {reply['error']}\n{self.tails()}"
        return reply["results"]

    def log_events(self, name: str, msg: str, **fields) -> int:
        """How many structured (JSON) log lines of process `name` have this message and these fields."""
        count = 0
        for line in next(p for p in self.procs if p.name == name).log_path.read_text(errors="replace").splitlines():
            try:
                event = json.loads(line)
            except ValueError:
                continue
            count += event.get("msg") == msg and all(event.get(k) == v for k, v in fields.items())
        return count

    def tails(self) -> str:
        return "\n".join(f"--- {p.name}:\n{p.tail(12)}" for p in self.procs if p.name.startswith("orch"))

    def kill_host(self, role: str) -> list[int]:
        """SIGKILL every process of a host (its namespace and address stay: connections are refused)."""
        pids = kill_namespace_processes(self.net.ns[role])
        for p in self.procs:
            if p.proc.args[3] == self.net.ns[role]:
                p.proc.wait(10)
        assert not ns_pids(self.net.ns[role])
        return pids

    def stop(self) -> None:
        if self.agent is not None:
            self.agent.stop()
        for p in reversed(self.procs):
            p.stop()


def test_multihost_delays_draft_loss_and_host_loss(net, tmp_path, capsys):
    t_start = time.monotonic()
    c = Cluster(net, tmp_path)
    try:
        c.up()
        startup_s = time.monotonic() - t_start
        reference = c.load(speculation=False, n=LONG_NEW, together=True)
        ref_long = [r["token_ids"] for r in reference]
        assert all(len(t) == LONG_NEW for t in ref_long), [len(t) for t in ref_long]
        ref = [t[:MAX_NEW] for t in ref_long]  # greedy, ignore_eos: a shorter generation is a prefix
        table = {"delay_method": c.method, "netem_error": c.netem_error or None, "startup_s": round(startup_s, 1),
                 "requests_per_phase": REQUESTS, "max_new_tokens": MAX_NEW, "draft_len": 4,
                 "target_only": _summary(reference, LONG_NEW), "delays": []}

        def phase(key: str, label: str, **extra) -> dict:
            results = c.load(speculation=True)
            row = {"phase": label, **extra, **_summary(results, MAX_NEW)}
            row["identical_tokens"] = [r["token_ids"] for r in results] == ref
            assert row["identical_tokens"], f"{label}: speculative tokens differ from target-only"
            assert row["completed"] == REQUESTS, row
            if key == "delays":
                table["delays"].append(row)
            else:
                table[key] = row
            return row

        for delay in DELAYS_MS:
            c.set_delay(delay)
            rtt = c.agent.call(op="ping", address=c.address("draft0"), n=7)
            phase("delays", f"delay {delay} ms", delay_ms=delay, draft_health_rtt_ms=rtt.get("median_ms"))
        c.set_delay(0)

        # A target host and an orchestrator host die mid-generation; the rest runs on the survivors.
        table["host_loss"] = host_loss(c, ref_long)
        c.orchestrators = [c.address("orch1")]

        # Every draft host dies: SIGKILL every process in their namespaces.
        killed = sum(len(c.kill_host(d)) for d in DRAFTS)
        row = phase("draft_killed", "draft hosts killed (SIGKILL)", killed_pids=killed)
        assert row["verify_steps"] == 0 and row["fallback_steps"] > 0, row  # it really ran without a draft
        # They come back: speculation resumes after the orchestrators' cool-down.
        for p in [p for d in DRAFTS for p in c.start_draft_host(d)]:
            p.wait_ready(180)
        time.sleep(2.5)  # > the orchestrator's draft cool-down / breaker open time (1 s by default)
        phase("draft_restarted", "draft hosts restarted")
        # They drop off the network (links down; processes alive): packets are silently lost, so draft calls end
        # on their deadline instead of a refused connection.
        for d in DRAFTS:
            c.net.link(d, up=False)
        phase("draft_unreachable", "draft hosts unreachable (eth0 down)")

        table["total_s"] = round(time.monotonic() - t_start, 1)
    except BaseException:
        for p in c.procs:
            if p.proc.poll() is not None and p.proc.returncode not in (0, -9):
                print(f"--- {p.name} exited {p.proc.returncode}:\n{p.tail()}", file=sys.stderr)
        raise
    finally:
        c.stop()

    out = tmp_path / "multihost_results.json"
    out.write_text(json.dumps(table, indent=2))
    with capsys.disabled():
        print(f"\nmulti-host results ({out}):")
        print(format_table(table))


def host_loss(c: Cluster, ref_long: list[list[int]]) -> dict:
    """Long generations through both orchestrators at once; a target host and an orchestrator host die together
    mid-generation. Every generation must still complete with the reference's tokens."""
    c.agent.call(op="start", addresses=c.orchestrators, prompts=PROMPTS, max_new_tokens=LONG_NEW, speculation=True,
                 rpc_timeout_s=120)
    deadline = time.monotonic() + 60
    while True:  # every generation has started streaming (none can have ended yet: LONG_NEW is far off)
        progress = c.agent.call(op="progress")["tokens"]
        if min(progress) >= 2 or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    assert min(progress) >= 2, f"generations did not start streaming within 60 s: {progress}\n{c.tails()}"
    t_kill = time.monotonic()
    killed = {role: len(c.kill_host(role)) for role in ("target0", "orch0")}
    reply = c.agent.call(op="collect", timeout_s=150, timeout=180)
    assert not reply.get("error"), f"host loss: {reply['error']}\n{c.tails()}"
    results = reply["results"]
    row = {"phase": "target0 + orch0 hosts killed mid-generation", "killed_pids": killed,
           "tokens_at_kill": progress, "recovery_s": round(time.monotonic() - t_kill, 1),
           **_summary(results, LONG_NEW)}
    row["identical_tokens"] = [r["token_ids"] for r in results] == ref_long
    row["served_by"] = [r["served_by"] for r in results]
    assert row["identical_tokens"], "after the host loss, tokens differ from the target-only reference"
    assert row["completed"] == REQUESTS, row
    # The dead orchestrator's sessions that were still streaming went on through the other one.
    dead, live = c.orchestrators
    for i, r in enumerate(results):
        if r["served_by"][0] == dead and progress[i] < LONG_NEW:
            assert r["resumes"] >= 1 and r["served_by"][-1] == live, (i, r["served_by"], r["errors"])
    assert row["resumes"] >= 1, row
    # Sessions on the dead target went on on the other one (the orchestrator logs each move).
    row["target_moves"] = c.log_events("orch1", "session moved to another target", **{"from": c.address("target0")})
    assert row["target_moves"] >= 1, f"no session moved off the killed target: {row}\n{c.tails()}"
    return row


def format_table(table: dict) -> str:
    cols = ["delay_ms", "draft_health_rtt_ms", "acceptance_rate", "mean_accepted_length", "tokens_per_s",
            "verify_steps", "fallback_steps", "draft_failures", "resumes", "completed", "identical_tokens"]
    rows = [cols] + [[str(r.get(c)) for c in cols] for r in table["delays"]]
    for key in ("target_only", "draft_killed", "draft_restarted", "draft_unreachable", "host_loss"):
        if key in table:
            r = table[key]
            rows.append([key] + [str(r.get(c, "")) for c in cols[1:]])
    widths = [max(len(r[i]) for r in rows) for i in range(len(cols))]
    lines = ["  ".join(v.ljust(w) for v, w in zip(r, widths)) for r in rows]
    if "host_loss" in table:
        lines.append(f"host loss: tokens at the kill {table['host_loss']['tokens_at_kill']}, recovery "
                     f"{table['host_loss']['recovery_s']} s, {table['host_loss']['target_moves']} sessions moved "
                     f"off the dead target, served by {table['host_loss']['served_by']}")
    lines.append(f"delay method: {table['delay_method']}"
                 + (f" (netem unavailable: {table['netem_error']})" if table.get("netem_error") else "")
                 + f"; startup {table['startup_s']} s; total {table.get('total_s')} s")
    return "\n".join(lines)
