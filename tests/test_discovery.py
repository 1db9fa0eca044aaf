"""Draft replicas discovered by DNS (dns:///name:port): every resolved address is a replica of its own, and
replicas that appear or disappear on re-resolution join or leave the pool without a restart."""

from __future__ import annotations

import threading
import time

import pytest

from orchestrator.replicas.clients import TargetClient
from orchestrator.replicas.discovery import Discovery, DnsName, parse_dns, resolve_getaddrinfo
from orchestrator.replicas.draft_pool import OPEN, DraftPool
from orchestrator.replicas.pool import PoolSettings
from orchestrator.settings import LoopConfig, OrchestratorSettings, ServerSettings
from orchestrator.api.server import (Connections, OrchestratorServicer, build_server as build_orchestrator_server,
                                     check_compatible)
from orchestrator.store.session_store import open_store
from specdec.client import SpecdecClient
from specdec.core.kv_cache import SessionCacheStore
from specdec.v1 import common_pb2
from target_service.engines.torch import TargetEngine
from target_service.server import build_server as build_target_server
from tests.harness import DRAFT_SAME, TARGET, model, start_draft, wait_until


class FakeDns:
    """A resolver seam: the test sets what the name resolves to; every lookup is counted."""

    def __init__(self, *addresses: str):
        self.addresses = list(addresses)
        self.fail = False
        self.lookups: list[tuple[str, int]] = []
        self.lock = threading.Lock()

    def __call__(self, host: str, port: int) -> list[str]:
        with self.lock:
            self.lookups.append((host, port))
            if self.fail:
                raise OSError(f"[Errno -2] Name or service not known: {host}")
            return list(self.addresses)


@pytest.mark.parametrize("address,expected", [
    ("dns:///draft:50051", DnsName("draft", 50051)),
    ("dns:///draft-headless.specdec.svc.cluster.local:50051",
     DnsName("draft-headless.specdec.svc.cluster.local", 50051)),
    ("dns:draft:7", DnsName("draft", 7)),
    ("dns:///[::1]:50051", DnsName("::1", 50051)),
])
def test_dns_addresses_parse(address, expected):
    assert parse_dns(address) == expected


@pytest.mark.parametrize("address,message", [
    ("dns:///draft", "needs a host and a port"),
    ("dns:///:50051", "needs a host and a port"),
    ("dns:///draft:99999", "needs a host and a port"),
    ("dns://8.8.8.8/draft:50051", "DNS server in the address is not supported"),
])
def test_bad_dns_addresses_are_refused_with_a_reason(address, message):
    with pytest.raises(ValueError, match=message):
        parse_dns(address)
    with pytest.raises(ValueError, match=message):
        DraftPool([address], resolve=FakeDns())


def test_getaddrinfo_resolves_every_address_once():
    assert resolve_getaddrinfo("127.0.0.1", 50051) == ["127.0.0.1:50051"]
    assert "127.0.0.1:7" in resolve_getaddrinfo("localhost", 7)


def test_a_name_that_stops_resolving_keeps_its_replicas_an_empty_answer_empties_it():
    dns = FakeDns("10.0.0.1:50051", "10.0.0.2:50051")
    d = Discovery(["dns:///draft:50051", "other:1"], resolve=dns)
    assert d.refresh() == ["10.0.0.1:50051", "10.0.0.2:50051", "other:1"]
    assert d.authority["10.0.0.1:50051"] == "draft"
    dns.fail = True  # a DNS hiccup must not drop healthy replicas
    assert d.refresh() == ["10.0.0.1:50051", "10.0.0.2:50051", "other:1"]
    dns.fail, dns.addresses = False, []
    assert d.refresh() == ["other:1"]


def test_plain_addresses_are_left_to_grpc_and_never_resolved():
    dns = FakeDns("10.0.0.9:1")
    pool = DraftPool(["127.0.0.1:1", "draft:50051"], PoolSettings(resolve_interval_s=0.05), resolve=dns)
    try:
        assert [r.address for r in pool.replicas] == ["127.0.0.1:1", "draft:50051"]
        assert pool._resolver is None
        time.sleep(0.2)
        assert dns.lookups == []
    finally:
        pool.close()


def test_each_resolved_address_is_a_replica_and_replicas_join_and_leave(monkeypatch):
    dns = FakeDns("127.0.0.1:1", "127.0.0.2:1")
    pool = DraftPool(["dns:///draft:1"], PoolSettings(resolve_interval_s=3600, health_interval_s=3600), resolve=dns)
    try:
        first, second = pool.replicas
        assert (first.address, second.address) == ("127.0.0.1:1", "127.0.0.2:1")
        assert first.client.channel is not second.client.channel  # a channel, a health stub, a breaker each
        assert first.breaker is not second.breaker
        second.breaker.failure()
        second.breaker.failure()
        assert second.breaker.state == OPEN

        dns.addresses = ["127.0.0.2:1", "127.0.0.3:1"]
        assert pool.refresh() == ["127.0.0.2:1", "127.0.0.3:1"]
        second_now, third = pool.replicas
        assert second_now is second and second.breaker.state == OPEN  # one that stays keeps its breaker
        assert third.address == "127.0.0.3:1"
        assert pool.by_address("127.0.0.1:1") is None
        # Whoever still holds the replica that left sees it down; no session is placed on it again.
        assert first.breaker.state == OPEN
        assert all(pool.ranking(f"s{i}")[0].address != "127.0.0.1:1" for i in range(50))
        # Its channel outlives the grace period only: calls under way on it end normally, then it is closed.
        assert first.client.channel is not None
        closed = []
        monkeypatch.setattr(first.client, "close", lambda: closed.append(first.address))
        monkeypatch.setattr(DraftPool, "RETIRE_GRACE_S", 0.0)
        pool.refresh()
        assert closed == ["127.0.0.1:1"] and pool._retired == []
    finally:
        pool.close()


def test_a_pool_whose_name_does_not_resolve_yet_starts_empty_and_fills_when_it_does():
    """Kubernetes: the orchestrator may start before any draft pod is ready (the headless name has no records)."""
    dns = FakeDns("127.0.0.1:1")
    dns.fail = True
    pool = DraftPool(["dns:///draft:1"], PoolSettings(resolve_interval_s=0.05, health_interval_s=3600), resolve=dns)
    try:
        assert pool.replicas == [] and pool.pick("s") is None and not pool.any_available()  # target-only for now
        dns.fail = False
        assert wait_until(lambda: [r.address for r in pool.replicas] == ["127.0.0.1:1"])
        assert pool.ranking("s") == pool.replicas  # sessions are placed on it (it is unreachable here)
    finally:
        pool.close()


def test_rendezvous_affinity_moves_only_the_sessions_of_a_replica_that_left():
    dns = FakeDns("127.0.0.1:1", "127.0.0.2:1", "127.0.0.3:1")
    pool = DraftPool(["dns:///draft:1"], PoolSettings(resolve_interval_s=3600, health_interval_s=3600), resolve=dns)
    try:
        sessions = [f"session-{i}" for i in range(60)]
        before = {s: pool.ranking(s)[0].address for s in sessions}
        dns.addresses = ["127.0.0.1:1", "127.0.0.3:1"]
        pool.refresh()
        after = {s: pool.ranking(s)[0].address for s in sessions}
        moved = {s for s in sessions if before[s] != after[s]}
        assert moved == {s for s in sessions if before[s] == "127.0.0.2:1"} and moved
    finally:
        pool.close()


def test_the_name_is_resolved_again_periodically():
    dns = FakeDns("127.0.0.1:1")
    pool = DraftPool(["dns:///draft:1"], PoolSettings(resolve_interval_s=0.05, health_interval_s=3600), resolve=dns)
    try:
        dns.addresses = ["127.0.0.1:1", "127.0.0.2:1"]
        assert wait_until(lambda: len(pool.replicas) == 2)
        dns.addresses = ["127.0.0.2:1"]
        assert wait_until(lambda: [r.address for r in pool.replicas] == ["127.0.0.2:1"])
    finally:
        pool.close()


def test_a_replica_failing_triggers_a_resolution_before_the_interval():
    dns = FakeDns("127.0.0.1:1")
    pool = DraftPool(["dns:///draft:1"], PoolSettings(resolve_interval_s=3600, health_interval_s=3600, breaker_failures=1),
                     resolve=dns)
    try:
        time.sleep(0.1)
        lookups = len(dns.lookups)
        dns.addresses = ["127.0.0.1:1", "127.0.0.2:1"]
        pool.replicas[0].breaker.failure()  # a failed call opens the breaker
        assert wait_until(lambda: len(pool.replicas) == 2, timeout_s=5.0)
        assert len(dns.lookups) > lookups
    finally:
        pool.close()


def test_bad_resolve_interval_and_dns_address_flags_are_refused():
    import argparse

    from orchestrator.api import server

    p = argparse.ArgumentParser()
    server.add_arguments(p)
    with pytest.raises(SystemExit, match="--resolve-interval-s must be positive"):
        server.serve(p.parse_args(["--resolve-interval-s", "0"]))
    with pytest.raises(SystemExit, match="--draft: .*needs a host and a port"):
        server.serve(p.parse_args(["--draft", "dns:///draft"]))


def test_with_tls_a_resolved_replica_is_checked_against_the_dns_name(tmp_path):
    """The certificate names the service (draft.test), not its pods' IPs: the channel to a resolved IP checks it
    against the name it was resolved from; a plain channel to the IP is refused."""
    import grpc

    from orchestrator.replicas.clients import DraftClient
    from specdec.core import grpc_util
    from tests.test_tls import make_pki

    grpc_util.configure_tls(make_pki(tmp_path, san="DNS:draft.test"))
    server = pool = None
    try:
        server = start_draft("ngram", "127.0.0.1:0")
        port = int(server.address.rsplit(":", 1)[1])
        pool = DraftPool([f"dns:///draft.test:{port}"], PoolSettings(health_interval_s=3600, resolve_interval_s=3600),
                         resolve=FakeDns(f"127.0.0.1:{port}"))
        assert pool.replicas[0].client.info(timeout=10).strategy == "ngram"
        plain = DraftClient(f"127.0.0.1:{port}")
        with pytest.raises(grpc.RpcError):
            plain.stub.GetInfo(common_pb2.GetInfoRequest(), timeout=3)
        plain.close()
    finally:
        if pool is not None:
            pool.close()
        if server is not None:
            server.stop(0)
        grpc_util.configure_tls(None)


# --- end to end: real draft services on two loopback addresses behind a fake resolver -------------------------


class DnsStack:
    def __init__(self, redis_url: str, dns: FakeDns, drafts: dict):
        tl = model(TARGET)
        self.target_server = build_target_server(TargetEngine(tl, SessionCacheStore(max_sessions=64)),
                                                 "127.0.0.1:0").start()
        self.drafts = drafts
        target = TargetClient(self.target_server.address)
        target_info = target.info()
        self.pool = DraftPool(["dns:///draft.test:%d" % dns.port], PoolSettings(resolve_interval_s=0.1), resolve=dns,
                              on_info=lambda replica, info: check_compatible(target_info, info))
        cfg = LoopConfig(default_draft_len=3, draft_timeout_floor_ms=5000)
        self.servicer = OrchestratorServicer(
            OrchestratorSettings(ServerSettings(max_new_tokens_limit=512), cfg),
            Connections(target, self.pool, open_store(redis_url), tl.tokenizer, target_info))
        self.server = build_orchestrator_server(self.servicer, "127.0.0.1:0").start()
        self.client = SpecdecClient(self.server.address, timeout_s=120)

    def stop(self):
        self.client.close()
        self.servicer.close()
        self.pool.close()
        for s in (self.server, *self.drafts.values(), self.target_server):
            s.stop(0)


def counting(draft_server) -> list:
    """Count the Propose calls a draft server answers."""
    calls = []
    proposer = draft_server.servicer.proposer
    inner = proposer.get_candidates

    def get_candidates(task):
        calls.append(task.session_id)
        return inner(task)

    proposer.get_candidates = get_candidates
    return calls


@pytest.mark.serial
def test_replicas_found_by_dns_join_and_leave_a_running_orchestrator_tokens_unchanged(redis_url):
    prompt = [1, 5, 9, 12, 5, 9]
    # Each Propose takes 30 ms more: the stream is still generating when the test changes what DNS says.
    a = start_draft(DRAFT_SAME, "127.0.0.1:0", inject_latency_ms=30)
    port = int(a.address.rsplit(":", 1)[1])
    b = start_draft(DRAFT_SAME, f"127.0.0.2:{port}", inject_latency_ms=30)  # the same port on another loopback address, as pods have
    addr_a, addr_b = f"127.0.0.1:{port}", f"127.0.0.2:{port}"
    calls = {addr_a: counting(a), addr_b: counting(b)}
    dns = FakeDns(addr_a)
    dns.port = port
    stack = DnsStack(redis_url, dns, {addr_a: a, addr_b: b})
    try:
        assert [r.address for r in stack.pool.replicas] == [addr_a]
        ref = stack.client.generate(prompt, max_new_tokens=120, speculation=False, ignore_eos=True).token_ids

        # A replica that appears in DNS is used without a restart.
        dns.addresses = [addr_a, addr_b]
        assert wait_until(lambda: len(stack.pool.replicas) == 2)
        for _ in range(20):  # rendezvous hashing: about half the new sessions prefer the new replica
            out = stack.client.generate(prompt, max_new_tokens=120, ignore_eos=True)
            assert out.token_ids == ref
            if calls[addr_b]:
                break
        assert calls[addr_b], "no session used the replica that joined"

        # A replica that disappears from DNS (still running: only discovery says it left) loses its sessions to
        # the other, mid-generation, and the output is the target-only output all the same.
        tokens, stats, state = [], None, {}
        for msg in stack.client.stream(prompt, max_new_tokens=120, ignore_eos=True):
            tokens += msg.token_ids
            if msg.HasField("stats"):
                stats = msg.stats
            if len(tokens) >= 10 and not state:
                state["left"] = stack.pool.ranking(msg.session_id)[0].address
                state["stayed"] = next(x for x in (addr_a, addr_b) if x != state["left"])
                dns.addresses = [state["stayed"]]
                assert wait_until(lambda: [r.address for r in stack.pool.replicas] == [state["stayed"]])
                time.sleep(0.3)  # a call already under way when it left may still arrive; none starts later
                state["calls_then"] = len(calls[state["left"]])
                state["session"] = msg.session_id
        assert tokens == ref
        assert stats.replica_failovers >= 1
        assert stats.verify_steps > stats.fallback_steps  # the replica that stayed went on drafting
        assert len(calls[state["left"]]) == state["calls_then"]  # nothing more went to the one that left
        assert state["session"] in calls[state["stayed"]]
    finally:
        stack.stop()
