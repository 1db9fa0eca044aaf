"""Target replicas as a pool (orchestrator/replicas/target_pool.py): each session placed on one replica (rendezvous affinity,
bounded load, breakers), moved at once to another when its replica fails, and the output unchanged."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from orchestrator.replicas.pool import OPEN, PoolSettings, rank
from orchestrator.replicas.target_pool import (LOAD_SLACK, IncompatibleTargets, TargetPool, merge_infos, model_mismatch)
from specdec.client import SpecdecClient
from specdec.v1 import common_pb2

TINY = "tiny:vocab=64,layers=2,hidden=64,seed=0,std=0.3"
ADDRESSES = ["127.0.0.1:1", "127.0.0.2:1", "127.0.0.3:1"]  # nothing listens: placement needs no calls


def quiet_pool(addresses=ADDRESSES, **timings) -> TargetPool:
    return TargetPool(list(addresses), PoolSettings(health_interval_s=3600, resolve_interval_s=3600, **timings))


def test_a_session_goes_to_its_rendezvous_replica_and_comes_back_to_it():
    pool = quiet_pool()
    try:
        for i in range(20):
            sid = f"session-{i}"
            seat = pool.seat(sid)
            replica, moved = seat.current()
            assert not moved and replica.address == max(ADDRESSES, key=lambda a: rank(sid, a))
            assert seat.current() == (replica, False)  # it stays
            seat.leave()
            assert replica.sessions == 0
            again = pool.seat(sid)
            assert again.current()[0] is replica  # a resumed session finds the replica holding its cache
            again.leave()
    finally:
        pool.close()


def test_load_is_bounded_so_no_replica_takes_far_more_than_its_share():
    pool = quiet_pool()
    try:
        seats = [pool.seat(f"s{i}") for i in range(90)]
        for seat in seats:
            seat.current()
        loads = [r.sessions for r in pool.replicas]
        assert sum(loads) == 90
        assert max(loads) <= LOAD_SLACK * 90 / 3 + 1, loads
        assert pool.sessions_per_replica() == max(loads)
        for seat in seats:
            seat.leave()
        assert [r.sessions for r in pool.replicas] == [0, 0, 0]
    finally:
        pool.close()


def test_a_failed_replica_is_skipped_and_its_sessions_move_at_once():
    pool = quiet_pool()
    try:
        sid = "moving"
        seat = pool.seat(sid)
        first, _ = seat.current()
        seat.failed(health_blind=False)  # one failure opens a target's breaker
        assert first.breaker.state == OPEN and first.sessions == 1
        second, moved = seat.current()
        assert moved and second is not first and first.sessions == 0 and second.sessions == 1
        assert seat.moves == 1
        assert all(pool.seat(f"n{i}").current()[0] is not first for i in range(30))  # nobody goes to the open one
        for r in pool.replicas:
            if r is not first:
                r.breaker.failure()
        assert seat.current() == (None, False) and not pool.any_available()  # none left: the caller waits
    finally:
        pool.close()


def test_a_refused_replica_takes_no_session():
    pool = quiet_pool()
    try:
        pool.replicas[0].refused = "serves another model"
        assert all(pool.seat(f"s{i}").current()[0] is not pool.replicas[0] for i in range(30))
    finally:
        pool.close()


def info(**fields) -> common_pb2.ModelInfo:
    base = dict(model_name="m", vocab_size=64, tokenizer_fingerprint="tok", max_context=1024, eos_token_ids=[2],
                kv_fingerprint="kv")
    return common_pb2.ModelInfo(**{**base, **fields})


def test_replicas_must_serve_the_same_model_and_the_pool_takes_the_strictest_limits():
    merged = merge_infos([info(max_context=1024, max_draft_len=16, forward_ms=[5, 6], max_batch=8),
                          info(max_context=512, max_draft_len=8, forward_ms=[9, 10], max_batch=4)])
    assert merged.max_context == 512 and merged.max_draft_len == 8
    assert list(merged.forward_ms) == [9, 10] and merged.max_batch == 4  # the slowest replica's profile
    with pytest.raises(IncompatibleTargets, match="tokenizer_fingerprint"):
        merge_infos([info(), info(tokenizer_fingerprint="other")])
    with pytest.raises(IncompatibleTargets, match="model_name"):
        merge_infos([info(), info(model_name="bigger")])
    assert model_mismatch(merged, info(max_context=2048, max_draft_len=8)) is None
    assert "shorter" in model_mismatch(merged, info(max_context=256))
    assert "another model" in model_mismatch(merged, info(eos_token_ids=[3]))


def test_an_orchestrator_refuses_targets_of_different_models_at_start(redis_url):
    from orchestrator.api.server import build_servicer
    from orchestrator.settings import OrchestratorSettings, ServerSettings
    from specdec.core.grpc_util import StartupError
    from tests.harness import model
    from specdec.core.kv_cache import SessionCacheStore
    from target_service.engines.torch import TargetEngine
    from target_service.server import build_server

    other = "tiny:vocab=64,layers=1,hidden=32,seed=1,std=0.3"
    servers = [build_server(TargetEngine(model(spec), SessionCacheStore()), "127.0.0.1:0").start()
               for spec in (TINY, other)]
    try:
        with pytest.raises(StartupError, match="--target: target replicas serve different models"):
            build_servicer(OrchestratorSettings(ServerSettings(
                target=",".join(s.address for s in servers), draft="", redis=redis_url, tokenizer=TINY,
                startup_timeout_s=20)))
    finally:
        for s in servers:
            s.stop(0)


def _listening_pid(parent_pid: int, port: int) -> int:
    """The child of `parent_pid` that listens on TCP `port` (Linux /proc: the socket's inode among its fds)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for row in list(f)[1:]:
                cols = row.split()
                if cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:  # LISTEN
                    inodes.add(cols[9])
    for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
        try:
            with open(f"/proc/{pid}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) != parent_pid:
                    continue
            links = {os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")}
        except OSError:  # a process that ended meanwhile
            continue
        if any(f"socket:[{i}]" in links for i in inodes):
            return pid
    raise AssertionError(f"no child of {parent_pid} listens on port {port}")


@pytest.mark.serial  # the kill must land while the generation runs
def test_up_with_two_targets_reports_both_and_a_generation_whose_target_is_killed_moves_to_the_other(tmp_path):
    """`specdec up --target-replicas 2` reports both targets; a generation whose target is SIGKILLed moves to the
    other without waiting for the grace period (the default --target-grace-s, 30 s). One stack for both checks:
    starting one costs tens of seconds here."""
    grace_s = 30.0
    proc = subprocess.Popen([sys.executable, "-m", "launcher.cli", "up", "--port", "0", "--metrics-base-port", "0",
                             "--target-model", TINY, "--draft-strategy", "local-ngram", "--store", "memory",
                             "--target-replicas", "2", "--log-dir", str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    client = None
    try:
        line = proc.stdout.readline()  # the JSON line, once everything serves
        report = json.loads(line)
        assert len(report["targets"]) == 2 and len(set(report["targets"])) == 2
        assert report["target"] == report["targets"][0]
        client = SpecdecClient(report["orchestrator"], timeout_s=120)
        assert len(client.generate([1, 2, 3], max_new_tokens=8, ignore_eos=True).token_ids) == 8

        prompt, n = [1, 5, 9, 12, 5, 9], 900
        reference = client.generate(prompt, max_new_tokens=n, ignore_eos=True, speculation=False).token_ids
        tokens, killed_at, stats = [], None, None
        for msg in client.stream(prompt, max_new_tokens=n, ignore_eos=True):
            tokens += msg.token_ids
            if msg.HasField("stats"):
                stats = msg.stats
            if killed_at is None and len(tokens) >= 8:
                # One session, nothing else placed: it is on the top of its rendezvous ranking.
                victim = max(report["targets"], key=lambda a: rank(msg.session_id, a))
                assert len(tokens) < n, "the generation ended before the kill"
                os.kill(_listening_pid(proc.pid, int(victim.rsplit(":", 1)[1])), signal.SIGKILL)
                killed_at = time.monotonic()
        finished_in = time.monotonic() - killed_at
        assert tokens == reference
        assert finished_in < grace_s / 3, f"the generation waited {finished_in:.1f} s after the kill"
        assert stats.target_resyncs >= 1  # the other target rebuilt the session's cache from the committed tokens
        # New sessions go to the target that is left.
        assert client.generate(prompt, max_new_tokens=40, ignore_eos=True, speculation=False).token_ids == \
            reference[:40]
    finally:
        if client is not None:
            client.close()
        proc.terminate()
        proc.communicate(timeout=60)


def test_targets_found_by_dns_join_and_leave_and_a_session_on_one_that_left_moves(redis_url):
    """dns:///NAME:PORT for targets: real target services on two loopback addresses behind a fake resolver;
    one appearing is used, one disappearing loses its sessions to the other, mid-generation, tokens unchanged."""
    from orchestrator.api.server import Connections, OrchestratorServicer, build_server as build_orchestrator_server
    from orchestrator.store.session_store import open_store
    from orchestrator.settings import LoopConfig, OrchestratorSettings, ServerSettings
    from specdec.core.kv_cache import SessionCacheStore
    from target_service.engines.torch import TargetEngine
    from target_service.server import build_server as build_target_server
    from tests.harness import model
    from tests.test_discovery import FakeDns, wait_until

    tl = model(TINY)
    engines = [TargetEngine(tl, SessionCacheStore()) for _ in range(2)]
    for engine in engines:  # 20 ms a Decode: the stream is still going when DNS changes
        decode = engine.decode
        engine.decode = lambda *args, decode=decode, **kwargs: (time.sleep(0.02), decode(*args, **kwargs))[1]
    a = build_target_server(engines[0], "127.0.0.1:0").start()
    port = int(a.address.rsplit(":", 1)[1])
    b = build_target_server(engines[1], f"127.0.0.2:{port}").start()  # the same port on another address, as pods
    addr_a, addr_b = f"127.0.0.1:{port}", f"127.0.0.2:{port}"
    dns = FakeDns(addr_a)
    pool = TargetPool([f"dns:///target.test:{port}"], PoolSettings(resolve_interval_s=0.1), resolve=dns)
    servicer = server = client = None
    try:
        target_info = pool.connect(20)
        servicer = OrchestratorServicer(
            OrchestratorSettings(ServerSettings(max_new_tokens_limit=900), LoopConfig(target_grace_s=30)),
            Connections(pool, None, open_store(redis_url), tl.tokenizer, target_info))
        server = build_orchestrator_server(servicer, "127.0.0.1:0").start()
        client = SpecdecClient(server.address, timeout_s=120)
        prompt = [1, 5, 9, 12, 5, 9]
        reference = client.generate(prompt, max_new_tokens=300, ignore_eos=True).token_ids

        dns.addresses = [addr_a, addr_b]  # a replica appears: sessions are placed on it without a restart
        assert wait_until(lambda: [r.address for r in pool.replicas] == [addr_a, addr_b])
        sid = next(f"s{i}" for i in range(100) if max((addr_a, addr_b), key=lambda x: rank(f"s{i}", x)) == addr_b)
        seat = pool.seat(sid)
        assert seat.current()[0].address == addr_b
        seat.leave()

        tokens, state, stats = [], {}, None
        for msg in client.stream(prompt, max_new_tokens=300, ignore_eos=True):
            tokens += msg.token_ids
            if msg.HasField("stats"):
                stats = msg.stats
            if len(tokens) >= 8 and not state:
                on = max((addr_a, addr_b), key=lambda x: rank(msg.session_id, x))  # alone: its top replica
                assert pool.by_address(on).sessions == 1
                state["stayed"] = addr_a if on == addr_b else addr_b
                dns.addresses = [state["stayed"]]  # its replica leaves the pool (still running: DNS says so)
                assert pool.refresh() == [state["stayed"]]
                state["at"], state["tokens"] = time.monotonic(), len(tokens)
        assert state["tokens"] < 300, "the generation ended before its replica left"
        assert tokens == reference
        assert time.monotonic() - state["at"] < 10  # it moved; it did not wait out the 30 s grace period
        assert stats.target_resyncs >= 1 and pool.by_address(state["stayed"]).sessions == 0
    finally:
        if client is not None:
            client.close()
        if servicer is not None:
            servicer.close()
        pool.close()
        for s in (server, a, b):
            if s is not None:
                s.stop(0)


def test_bad_target_addresses_are_refused_with_a_reason():
    import argparse

    from orchestrator.api import server
    from orchestrator.replicas.target_pool import open_targets

    p = argparse.ArgumentParser()
    server.add_arguments(p)
    with pytest.raises(SystemExit, match="--target: .*needs a host and a port"):
        server.serve(p.parse_args(["--target", "127.0.0.1:50052,dns:///target"]))
    with pytest.raises(ValueError, match="at least one target address"):
        open_targets(" , ", 1.0)


def test_a_target_opened_by_a_deadline_is_probed_again_after_its_back_off():
    """A deadline opens the breaker 'health-blind' (a slow target passes health checks): only the back-off ends it,
    and the next placement after it probes the replica."""
    pool = quiet_pool(ADDRESSES[:1], breaker_open_s=0.2)
    try:
        seat = pool.seat("slow")
        replica, _ = seat.current()
        seat.failed(health_blind=True)
        assert seat.current() == (None, False)
        time.sleep(0.3)
        assert seat.current() == (replica, False)  # the same replica again: not a move
        replica.breaker.success()
        assert replica.breaker.state == "closed"
    finally:
        pool.close()
