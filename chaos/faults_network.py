"""Network and Redis faults: the orchestrator's links to the target and to Redis through a FaultProxy (added
latency, a partition of several seconds, dropped connections), and Redis killed with SIGKILL and restarted with
its AOF (`appendfsync everysec`: up to ~1 s of writes lost) or empty.

A link fault first routes the orchestrator through one proxy per link (it is restarted once, with `--target` and
`--redis` pointing at the proxies: later flags override earlier ones); the proxies stay, passing traffic through,
for the scenarios after it. The Redis-loss scenarios accept requests that end with DATA_LOSS (the orchestrator
refuses to write past lost state), and check that nothing stored has a hole: whatever GetSession returns is a
prefix of the target-only reference and agrees with what the client received.
"""

from __future__ import annotations

import os
import shutil
import signal
import threading
import time

import grpc

from chaos.fault_proxy import FaultProxy
from chaos.faults import Fault
from specdec.client import SpecdecClient

LINK_LATENCY_MS = {"target": 30.0, "redis": 50.0}  # per chunk, in each direction
PARTITION_S = 3.0             # a partition is held at least this long
DROP_EVERY_S = 0.4            # dropped connections: every open connection is reset this often while the fault lasts
STORE_TIMEOUT_S = 2.0         # the store client's socket timeout (orchestrator/store/session_store.py: RedisSessionStore)
RECONNECT_S = 1.0             # a gRPC channel's first reconnect backoff (a connect that failed waits this long)


def route_through_proxies(h) -> dict[str, FaultProxy]:
    """Restart the orchestrator with its target and Redis behind FaultProxies (once per stack)."""
    if not h.proxies:
        s = h.stack
        proxies = {"target": FaultProxy(s.target.address), "redis": FaultProxy(("127.0.0.1", s.redis.port))}
        s.cfg.orchestrator_args += ["--target", proxies["target"].address, "--redis", proxies["redis"].url]
        h.proxies = proxies
        s.orchestrator.stop()
        s.start_orchestrator()
        with SpecdecClient(h.address) as c:
            c.wait_ready(60)
        h.wait_breakers()
    return h.proxies


class TimedFault(Fault):
    """A fault that records when it was injected and healed, and bounds the stall from the baseline's step."""

    def prepare(self) -> None:
        self.injected_at: float | None = None
        self.healed_at: float | None = None

    def inject(self) -> None:
        self.injected_at = time.monotonic()
        self._inject()

    def heal(self) -> None:
        self._heal()
        self.healed_at = time.monotonic()

    def settle(self, timeout: float) -> bool:
        # Speculation resumes once no draft breaker is open (a draft call may have timed out meanwhile on a busy
        # host, the link fault slowing the loop); closed: a call succeeded since.
        return self.h.wait_breakers(timeout, ("closed",))

    def held_ms(self) -> float:
        if self.injected_at is None or self.healed_at is None:
            return 0.0
        return (self.healed_at - self.injected_at) * 1e3

    def steps_ms(self) -> float:
        """M longest fault-free loop steps (the draft faults' M and S): a step that was mid-way when it hit."""
        b = self.h.baseline
        return b["stall_steps"] * b["max_stall_ms"]

    def details(self) -> dict:
        return {"held_ms": round(self.held_ms(), 1)}


class LinkFault(TimedFault):
    link = ""  # "target" or "redis": which of the orchestrator's links the proxy breaks

    def prepare(self) -> None:
        super().prepare()
        self.proxy = route_through_proxies(self.h)[self.link]
        self.victims = [f"orchestrator->{self.link}"]
        self.victim_addresses = [self.proxy.address]
        self._counts = (self.proxy.connections_accepted, self.proxy.connections_dropped)

    def _heal(self) -> None:
        self.proxy.heal()

    def details(self) -> dict:
        return {**super().details(), "link": self.link,
                "connections_accepted": self.proxy.connections_accepted - self._counts[0],
                "connections_dropped": self.proxy.connections_dropped - self._counts[1]}

    @staticmethod
    def checks(res: dict) -> dict[str, bool]:
        c = {"in_flight_never_broken": res["resumes"] == 0,
             "no_internal_error": "INTERNAL" not in res["error_codes"],
             "stall_within_bound": res["max_stall_ms"] <= res["stall_bound_ms"]}
        if res["fault"]["link"] == "target":  # the orchestrator waits for the target: a request never sees it
            c["requests_never_retried"] = res["retried_requests"] == 0
        return c


class LinkLatency(LinkFault):
    def _inject(self) -> None:
        self.proxy.set_latency(LINK_LATENCY_MS[self.link])

    def stall_bound_ms(self) -> float:
        # Every call on the link takes a round trip more (2 x latency); a step makes at most two in a row (a
        # prefill and a verify, or a commit retried), on top of the slowest fault-free steps.
        return round(self.steps_ms() + 4 * LINK_LATENCY_MS[self.link], 1)

    def details(self) -> dict:
        return {**super().details(), "latency_ms": LINK_LATENCY_MS[self.link]}

    @staticmethod
    def checks(res: dict) -> dict[str, bool]:
        # exercised: some step in the window took at least one delayed round trip
        return {**LinkFault.checks(res),
                "fault_exercised": res["max_stall_in_fault_window_ms"] >= 2 * res["fault"]["latency_ms"]}


class LinkPartition(LinkFault):
    min_hold_s = PARTITION_S

    def _inject(self) -> None:
        self.proxy.partition()

    def stall_bound_ms(self) -> float:
        # The calls wait (the target's: its 30 s deadline; the store's: socket timeouts, retried within the store
        # grace) and go through at the heal; a store call that timed out just before it may wait out two more
        # timeouts (its retry by the Redis client included).
        extra = 2 * STORE_TIMEOUT_S * 1e3 if self.link == "redis" else 0.0
        return round(self.held_ms() + extra + self.steps_ms(), 1)

    @staticmethod
    def checks(res: dict) -> dict[str, bool]:
        # exercised: streams stood still for most of the partition (and resumed: everything completed)
        return {**LinkFault.checks(res),
                "fault_exercised": res["max_stall_in_fault_window_ms"] >= 0.8 * res["fault"]["held_ms"]}


class LinkDrop(LinkFault):
    def _inject(self) -> None:
        self._stop = threading.Event()
        self.proxy.drop_connections()
        self._dropper = threading.Thread(target=self._keep_dropping, daemon=True)
        self._dropper.start()

    def _keep_dropping(self) -> None:
        while not self._stop.wait(DROP_EVERY_S):
            self.proxy.drop_connections()

    def _heal(self) -> None:
        self._stop.set()
        self._dropper.join(5)
        super()._heal()

    def stall_bound_ms(self) -> float:
        # A call cut off is retried on a new connection: a reconnect (its backoff, if a connect failed) or a store
        # timeout, for every reset while the fault lasts at worst, plus the slowest fault-free steps.
        drops = 1 + self.held_ms() / 1e3 / DROP_EVERY_S
        per_drop = STORE_TIMEOUT_S if self.link == "redis" else RECONNECT_S
        return round(min(self.held_ms() + per_drop * 1e3, drops * per_drop * 1e3) + self.steps_ms(), 1)

    @staticmethod
    def checks(res: dict) -> dict[str, bool]:
        return {**LinkFault.checks(res), "fault_exercised": res["fault"]["connections_dropped"] > 0}


def _link(base: type, link: str) -> type:
    return type(f"{link.title()}{base.__name__}", (base,), {"link": link})


class RedisKill(TimedFault):
    """SIGKILL Redis (no AOF flush, no clean shutdown), restart it on its port with what its AOF holds."""

    data_loss_allowed = True
    wipe = False

    def prepare(self) -> None:
        super().prepare()
        self.victims = ["redis"]
        self.victim_addresses = [self.h.stack.redis.url]
        self.sessions_lost = self.sessions_truncated = 0

    def _inject(self) -> None:
        redis = self.h.stack.redis
        redis.proc.send_signal(signal.SIGKILL)
        redis.proc.wait(10)
        redis.proc = None

    def _heal(self) -> None:
        redis = self.h.stack.redis
        if self.wipe:  # restarted EMPTY: as a new server with no persistence would be
            for name in ("appendonlydir", "appendonly.aof", "dump.rdb"):
                path = os.path.join(redis.data_dir, name)
                if os.path.isdir(path):
                    shutil.rmtree(path)
                elif os.path.exists(path):
                    os.remove(path)
        redis.start()

    def stall_bound_ms(self) -> float:
        # The outage (kill to restarted), the store timeouts a call may still be waiting out (a call and the Redis
        # client's own retry of it), the slowest fault-free steps.
        return round(self.held_ms() + 2 * STORE_TIMEOUT_S * 1e3 + self.steps_ms(), 1)

    def details(self) -> dict:
        return {**super().details(), "wiped": self.wipe, "sessions_lost": self.sessions_lost,
                "sessions_truncated": self.sessions_truncated}

    @staticmethod
    def checks(res: dict) -> dict[str, bool]:
        return {"no_internal_error": "INTERNAL" not in res["error_codes"],
                "stall_within_bound": res["max_stall_ms"] <= res["stall_bound_ms"],
                # exercised: streams were in flight (they stood still, or ended DATA_LOSS)
                "fault_exercised": res["ended_data_loss"] > 0
                or res["max_stall_in_fault_window_ms"] >= 0.5 * res["fault"]["held_ms"]}


class RedisEmptyRestart(RedisKill):
    wipe = True


def stored_after_loss(stored: list[int] | None, received: list[int], reference: list[int],
                      must_be_whole: bool) -> str:
    """The verdict on one session's stored tokens after the store lost data: "lost" (gone: None), "truncated" (its
    tail lost), "exact", or "bad": a hole (not a prefix of the target-only reference), tokens that differ from what
    the client received, or less than it received where the session must be whole (it completed after the store
    came back)."""
    if stored is None:
        return "bad" if must_be_whole else "lost"
    n = min(len(stored), len(received))
    if stored != reference[: len(stored)] or stored[:n] != received[:n]:
        return "bad"
    if stored == received:
        return "exact"
    return "bad" if must_be_whole else "truncated"


def store_check_after_loss(fault: TimedFault, records) -> tuple[int, list[str]]:
    """GetSession of every session after the store lost data (stored_after_loss): a session is gone (NOT_FOUND or
    DATA_LOSS) or short only if it ended before the store came back or ended DATA_LOSS."""
    healed = fault.healed_at or float("inf")
    bad, notes = 0, []
    with SpecdecClient(fault.h.address) as c:
        for r in records:
            if not r.session_id:
                continue
            try:
                stored = list(c.get_session(r.session_id, timeout_s=10).generated_token_ids)
            except grpc.RpcError as e:
                if e.code() not in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.DATA_LOSS):
                    bad += 1
                    notes.append(f"request {r.index}: GetSession {e.code().name}: {e.details()}")
                    continue
                stored = None
            verdict = stored_after_loss(stored, r.tokens, fault.h.references[r.prompt_index],
                                        must_be_whole=r.completed and r.end >= healed)
            fault.sessions_lost += verdict == "lost"
            fault.sessions_truncated += verdict == "truncated"
            if verdict == "bad":
                bad += 1
                notes.append(f"request {r.index} ({r.session_id}, {'completed' if r.completed else r.error}): "
                             f"received {len(r.tokens)} tokens, stored "
                             f"{'none' if stored is None else len(stored)}")
    return bad, notes


NETWORK_FAULTS = {
    "target_latency": _link(LinkLatency, "target"),
    "target_partition": _link(LinkPartition, "target"),
    "target_conn_drop": _link(LinkDrop, "target"),
    "redis_latency": _link(LinkLatency, "redis"),
    "redis_partition": _link(LinkPartition, "redis"),
    "redis_conn_drop": _link(LinkDrop, "redis"),
    "redis_sigkill": RedisKill,
    "redis_empty_restart": RedisEmptyRestart,
}
