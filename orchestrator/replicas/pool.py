"""Replicas of one service behind one interface: periodic health checks, a circuit breaker per replica, rendezvous ranking
for session affinity, DNS discovery. The draft pool (orchestrator/replicas/draft_pool.py) and the target pool
(orchestrator/replicas/target_pool.py) are this with their own clients and placement rules.

A ``dns:///name:port`` address stands for every address the name resolves to (orchestrator/replicas/discovery.py): each is a
replica, and replicas that appear or disappear on re-resolution join or leave the pool; a session on a replica that
left moves as it does when a replica fails.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from orchestrator.replicas.discovery import Discovery, Resolve

log = logging.getLogger("specdec.orchestrator.pool")

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"


class CircuitBreaker:
    """closed -> (failure) -> open for a back-off -> half-open: one probe call -> closed or open again."""

    def __init__(self, open_s: float = 1.0, max_open_s: float = 10.0, failure_threshold: int = 1, on_open=None,
                 kind: str = "draft"):
        self.kind = kind  # whose replica, for the log
        self.on_open = on_open  # called (outside the lock) each time the breaker opens
        self.base_open_s = open_s
        self.max_open_s = max_open_s
        self.failure_threshold = failure_threshold
        self.state = CLOSED
        self.failures = 0
        self.open_s = open_s
        self.opened_at = 0.0
        self._probe_in_flight = False
        self.health_blind = False  # opened by failures a passing health check says nothing about (a slow replica)
        self._lock = threading.Lock()

    def allow(self) -> bool:
        with self._lock:
            if self.state == CLOSED:
                return True
            if self.state == OPEN and time.monotonic() - self.opened_at >= self.open_s:
                self.state = HALF_OPEN
            if self.state == HALF_OPEN and not self._probe_in_flight:
                self._probe_in_flight = True
                return True
            return False

    def success(self) -> None:
        with self._lock:
            self.state, self.failures, self.open_s, self._probe_in_flight = CLOSED, 0, self.base_open_s, False

    def failure(self, health_blind: bool = False) -> None:
        """A failed call. health_blind: a failure a passing health check does not contradict (a timeout, a
        malformed reply: the replica answers health checks all the same), so only the back-off ends it."""
        with self._lock:
            self.failures += 1
            if self.state == HALF_OPEN:
                self.open_s = min(self.max_open_s, self.open_s * 2)  # a failed probe backs off further
            opens = self.state == HALF_OPEN or self.failures >= self.failure_threshold
            if opens:
                self.state, self.opened_at, self._probe_in_flight = OPEN, time.monotonic(), False
                self.health_blind = health_blind
        if opens and self.on_open is not None:
            self.on_open()

    def no_call(self) -> None:
        """The caller allow() let through made no call after all (its block was already prefetched): a half-open
        breaker's probe is still to come, so the next caller may make it (else the replica stayed half-open with a
        probe 'in flight' that never ends, and no session could use it again)."""
        with self._lock:
            self._probe_in_flight = False

    def health_ok(self) -> None:
        """A passing health check shortens an open breaker to half-open (probe on the next call), unless it opened
        on failures health checks cannot see: a slow replica passes them, and probing it at every check would cost
        a session a draft deadline each time."""
        with self._lock:
            if self.state == OPEN and not self.health_blind:
                self.state = HALF_OPEN

    def health_failed(self) -> None:
        with self._lock:
            self.health_blind = False  # the health check sees this fault: its recovery can end the back-off
            opens = self.state != OPEN
            if opens:
                log.warning(f"{self.kind} replica failed its health check; breaker open")
                self.state, self.opened_at, self._probe_in_flight = OPEN, time.monotonic(), False
        if opens and self.on_open is not None:
            self.on_open()


class Replica:
    """One service replica: its client (a channel), breaker and ModelInfo.

    Health is the pool's periodic Health.Check, never a standing Health.Watch stream: a session's own failing call
    is the fastest signal that a replica went away, the checks see it go (within an interval) and come back, and a
    server stopping with several watch streams open can deadlock in grpc's health servicer (its graceful-shutdown
    status push waits on a stream whose callback waits on the servicer's lock)."""

    def __init__(self, address: str, breaker: CircuitBreaker, client):
        self.address = address
        self.client = client
        self.breaker = breaker
        self.health_stub = None if self.client.channel is None else health_pb2_grpc.HealthStub(self.client.channel)
        self.info = None
        self.refused: str | None = None  # set when the replica turned out incompatible; never used then
        self.owns_client = True  # False: the caller built the client and closes it (TargetPool.of_client)

    def check_health(self, timeout: float) -> bool:
        try:
            reply = self.health_stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout)
            ok = reply.status == health_pb2.HealthCheckResponse.SERVING
        except grpc.RpcError:
            ok = False
        (self.breaker.health_ok if ok else self.breaker.health_failed)()
        return ok



@dataclass(frozen=True)
class PoolSettings:
    """How a pool watches its replicas: a breaker's back-off (open_s, doubling after a failed probe up to
    max_open_s) and the consecutive failures that open it (None: the pool's own, BREAKER_FAILURES), the health
    checks' interval and timeout, and how often ``dns:///`` names are resolved again."""

    breaker_open_s: float = 1.0
    breaker_max_open_s: float = 10.0
    breaker_failures: int | None = None
    health_interval_s: float = 0.5
    health_timeout_s: float = 1.0
    resolve_interval_s: float = 5.0


def rank(session_id: str, address: str) -> int:
    """A session's rendezvous score for a replica: the highest-scoring replica holds its cache. Only the replicas that
    leave or join move sessions, and every orchestrator computes the same ranking without sharing state."""
    return int.from_bytes(hashlib.blake2b(f"{session_id}|{address}".encode(), digest_size=8).digest(), "big")


class ReplicaPool:
    """The replicas a list of addresses stands for, kept healthy-checked and re-resolved. Subclasses build the
    replicas (``_new_replica``) and say what they are (``KIND``, for logs and thread names)."""

    KIND = "replica"
    BREAKER_FAILURES = 2  # consecutive failed calls that open a replica's breaker, unless the settings say
    # A replica that left the pool keeps its channel this long: calls already under way on it (a prefetch, a
    # release) end normally instead of being cancelled.
    RETIRE_GRACE_S = 30.0

    def __init__(self, addresses: list[str], settings: PoolSettings = PoolSettings(), on_info=None,
                 resolve: Resolve | None = None):
        """``resolve(host, port)``: the addresses of a ``dns:///`` entry (default: getaddrinfo), asked again every
        ``settings.resolve_interval_s`` and soon after a replica's breaker opens. ``on_info(replica, info)``: called
        the first time a replica answers GetInfo; raising keeps the replica out (``refused``)."""
        if not addresses:
            raise ValueError(f"a {self.KIND} pool needs at least one address")
        if not settings.resolve_interval_s > 0:
            raise ValueError(f"the {self.KIND} re-resolve interval must be positive, got {settings.resolve_interval_s}")
        self.settings = settings
        self.discovery = Discovery(addresses, resolve)
        failures = self.BREAKER_FAILURES if settings.breaker_failures is None else settings.breaker_failures
        self._breaker_args = (settings.breaker_open_s, settings.breaker_max_open_s, failures)
        self._resolve_soon = threading.Event()
        self._lock = threading.Lock()  # guards the membership swap and the retired channels against close()
        self._refresh_lock = threading.Lock()
        self._retired: list[tuple[float, Replica]] = []
        self.replicas = [self._replica(a) for a in self.discovery.refresh()]  # replaced whole, never changed in place
        self.health_interval_s = settings.health_interval_s
        self.health_timeout_s = settings.health_timeout_s
        self.resolve_interval_s = settings.resolve_interval_s
        self.on_info = on_info
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._health_loop, name=f"{self.KIND}-health", daemon=True)
        self._thread.start()
        self._resolver = None
        if self.discovery.dynamic:
            self._resolver = threading.Thread(target=self._resolve_loop, name=f"{self.KIND}-resolve", daemon=True)
            self._resolver.start()

    def _replica(self, address: str) -> Replica:
        open_s, max_open_s, failures = self._breaker_args
        breaker = CircuitBreaker(open_s, max_open_s, failures, kind=self.KIND)
        replica = self._new_replica(address, breaker, self.discovery.authority.get(address))

        def on_open() -> None:
            self._recheck(replica)
            if self.discovery.dynamic:
                self._resolve_soon.set()

        breaker.on_open = on_open
        return replica

    def _recheck(self, replica: Replica) -> None:
        """The replica went away (its breaker opened, or a health check failed): whatever answers at its address
        next may be another server (restarted with another model or tokenizer), so it gets no session until its
        ModelInfo has been asked for and checked again (on_info, at the next passing health check)."""
        if self.on_info is not None and not isinstance(replica, self._always_checked):
            replica.info, replica.refused = None, None

    _always_checked: tuple = ()  # replica classes that cannot change under their address (in-process drafters)

    def eligible(self, replica: Replica) -> bool:
        """Not refused, and its ModelInfo checked (in a pool that checks them)."""
        return replica.refused is None and (replica.info is not None or self.on_info is None)

    def _new_replica(self, address: str, breaker: CircuitBreaker, authority: str | None) -> Replica:
        """The replica at ``address``; ``authority``: the DNS name it was resolved from (TLS checks that name)."""
        raise NotImplementedError

    def _resolve_loop(self) -> None:
        min_gap_s = min(self.resolve_interval_s, 1.0)  # after failures: soon, but not in a tight loop
        while not self._stop.is_set():
            self._resolve_soon.wait(self.resolve_interval_s)
            if self._stop.is_set():
                return
            self._resolve_soon.clear()
            try:
                self.refresh()
            except Exception:  # noqa: BLE001 - a resolver bug must not end discovery for good
                log.exception(f"{self.KIND} re-resolution failed")
            self._stop.wait(min_gap_s)

    def refresh(self) -> list[str]:
        """Resolve the DNS entries again and make the replicas match: new addresses join (their info is asked
        for first, so an incompatible replica is refused before a session uses it), gone ones leave."""
        with self._refresh_lock:  # one refresh at a time (the resolver thread, a caller)
            addresses = self.discovery.refresh()
            current = {r.address: r for r in self.replicas}
            joined = [self._replica(a) for a in addresses if a not in current]
            for r in joined:  # outside _lock: close() is not held up by a replica slow to answer
                self._ask_info(r)
            with self._lock:
                if self._stop.is_set():
                    for r in joined:
                        r.client.close()
                    return addresses
                self._close_retired()
                if list(current) == addresses:
                    return addresses
                by_address = {**current, **{r.address: r for r in joined}}
                self.replicas = [by_address[a] for a in addresses]
                left = [r for a, r in current.items() if a not in addresses]
                for r in left:
                    r.breaker.on_open = None
                    r.breaker.health_failed()  # anyone still holding it treats it as down
                    self._retired.append((time.monotonic(), r))
            log.info(f"{self.KIND} replicas changed", extra={
                "joined": [r.address for r in joined], "left": [r.address for r in left], "replicas": addresses})
        return addresses

    def _close_retired(self, everything: bool = False) -> None:
        now, keep = time.monotonic(), []
        for since, r in self._retired:
            if everything or now - since >= self.RETIRE_GRACE_S:
                r.client.close()
            else:
                keep.append((since, r))
        self._retired = keep

    def _ask_info(self, r: Replica) -> None:
        if r.info is not None or self.on_info is None or self._stop.is_set():
            return
        try:
            r.info = r.client.info(timeout=self.health_timeout_s * 3)
            self.on_info(r, r.info)
        except grpc.RpcError:
            r.info = None
        except ValueError:  # the channel was closed: shutting down
            r.info = None
        except Exception as e:  # noqa: BLE001 - e.g. an incompatible replica: keep it out
            log.error(f"{self.KIND} replica refused", extra={"replica": r.address, "reason": str(e)})
            r.refused = str(e)

    def _health_loop(self) -> None:
        while not self._stop.wait(self.health_interval_s):
            for r in self.replicas:
                if r.check_health(self.health_timeout_s):
                    self._ask_info(r)
                else:
                    self._recheck(r)

    def ranking(self, session_id: str) -> list[Replica]:
        return sorted(self.replicas, key=lambda r: rank(session_id, r.address), reverse=True)

    def any_available(self) -> bool:
        return any(self.eligible(r) and r.breaker.state != OPEN for r in self.replicas)

    def by_address(self, address: str) -> Replica | None:
        return next((r for r in self.replicas if r.address == address), None)

    def release(self, session_id: str, final_delta=None) -> None:
        """Fire-and-forget on every replica (a session may have moved); nobody waits on a dead one. final_delta
        (a TokenDelta): the tokens committed after those the drafter was shown, which it takes in first."""
        extra = {} if final_delta is None else {"final_delta": final_delta}  # draft replicas only
        for r in self.replicas:
            r.client.release_async(session_id, timeout=0.5, **extra)

    def close(self) -> None:
        self._stop.set()
        self._resolve_soon.set()
        with self._lock:
            for r in self.replicas:
                if r.owns_client:
                    r.client.close()
            self._close_retired(everything=True)
