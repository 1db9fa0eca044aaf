"""Target replicas behind one interface (orchestrator/replicas/pool.py), and each session's place on one of them.

A session is placed on one target replica (TargetSeat): the first in its rendezvous ranking (so a resumed session
finds the replica that still holds its KV cache) whose breaker lets calls through and whose load stays within
LOAD_SLACK x the mean load of those replicas (consistent hashing with bounded loads: affinity, but no replica
takes far more than its share). The session stays there: its calls batch with that replica's other sessions.

When its replica fails (UNAVAILABLE, a connection error, a deadline) the session moves at once to the next usable
one, which rebuilds its cache from the committed tokens (a TokenDelta from 0); only when no replica is left does
the step wait, up to the target grace period, for one to come back (orchestrator/loop/target_call.py).

Every replica must serve the same model: a replica whose ModelInfo names another model, tokenizer, vocabulary or
KV layout is refused (at start: a clear start-up error). Where replicas differ in what they allow, the pool takes
the strictest (shortest context, shortest draft limit) and the slowest replica's cost profile.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

import grpc

from orchestrator.replicas.clients import TargetClient
from orchestrator.replicas.discovery import Resolve
from orchestrator.replicas.pool import OPEN, CircuitBreaker, PoolSettings, Replica, ReplicaPool
from specdec.core.grpc_util import make_channel
from specdec.v1 import common_pb2

log = logging.getLogger("specdec.orchestrator.pool")

LOAD_SLACK = 1.25  # a replica takes a new session while its load is under this x the mean (plus the newcomer)
SAME_MODEL_FIELDS = ("model_name", "tokenizer_fingerprint", "vocab_size", "eos_token_ids", "kv_fingerprint")


class IncompatibleTargets(Exception):
    """Target replicas that do not serve the same model: their tokens would mean different things."""


class TargetsUnreachable(Exception):
    """No target replica answered at start-up."""


def model_mismatch(reference: common_pb2.ModelInfo, info: common_pb2.ModelInfo) -> str | None:
    """Why ``info`` cannot serve the sessions placed under ``reference`` (another model, or a replica that allows
    less than the pool promised), or None."""
    name = _first_difference(reference, info)
    if name is not None:
        mine, theirs = _field(reference, name), _field(info, name)
        return (f"serves another model: {name} {_short(theirs)} where the other targets have {_short(mine)}; "
                "every target replica must serve the same model")
    if info.max_context < reference.max_context:
        return f"its context ({info.max_context}) is shorter than the pool's ({reference.max_context})"
    if info.max_draft_len and (not reference.max_draft_len or info.max_draft_len < reference.max_draft_len):
        return f"it verifies at most {info.max_draft_len} drafts, fewer than the pool's {reference.max_draft_len or 'any'}"
    return None


def _first_difference(a: common_pb2.ModelInfo, b: common_pb2.ModelInfo) -> str | None:
    """The first SAME_MODEL_FIELDS field in which two replicas' ModelInfos differ, or None."""
    return next((name for name in SAME_MODEL_FIELDS if _field(a, name) != _field(b, name)), None)


def _field(info: common_pb2.ModelInfo, name: str):
    value = getattr(info, name)
    return value if isinstance(value, (str, int)) else list(value)


def _short(value) -> str:
    return repr(str(value)[:24])


def merge_infos(infos: list[common_pb2.ModelInfo]) -> common_pb2.ModelInfo:
    """One ModelInfo for replicas of the same model (IncompatibleTargets otherwise): the strictest limits, the
    slowest replica's forward-cost profile. Capacities stay per replica (max_batch, and max_sessions: the fewest
    any replica caches); the pool's own is TargetPool.capacity, their sum."""
    merged = common_pb2.ModelInfo()
    merged.CopyFrom(infos[0])
    for info in infos[1:]:
        name = _first_difference(info, merged)
        if name is not None:
            raise IncompatibleTargets(
                f"target replicas serve different models: {name} {_short(_field(info, name))} vs "
                f"{_short(_field(merged, name))}; every target must serve the same model")
    merged.max_context = min(i.max_context for i in infos)
    merged.max_sessions = min(i.max_sessions for i in infos)  # 0 (one does not say) stays 0: unknown
    limits = [i.max_draft_len for i in infos]
    merged.max_draft_len = 0 if not any(limits) else min(x for x in limits if x)
    profiled = [i for i in infos if len(i.forward_ms)]
    if profiled:
        slowest = max(profiled, key=lambda i: i.forward_ms[0])
        del merged.forward_ms[:]
        merged.forward_ms.extend(slowest.forward_ms)
        merged.max_batch = slowest.max_batch
    return merged


class TargetReplica(Replica):
    def __init__(self, address: str, breaker: CircuitBreaker, client: TargetClient):
        super().__init__(address, breaker, client)
        self.sessions = 0  # sessions placed here now (TargetPool's lock)


class TargetPool(ReplicaPool):
    KIND = "target"

    BREAKER_FAILURES = 1  # a session does not try a failed target twice while another is healthy

    def __init__(self, addresses: list[str], settings: PoolSettings = PoolSettings(), on_info=None,
                 resolve: Resolve | None = None, clients: dict[str, TargetClient] | None = None):
        """``clients``: clients built by the caller, by address (used as they are, and left open on close)."""
        self._clients = dict(clients or {})
        self._load_lock = threading.Lock()
        super().__init__(addresses, settings, on_info, resolve)

    @classmethod
    def of_client(cls, client: TargetClient, settings: PoolSettings = PoolSettings()) -> "TargetPool":
        """A pool of the one target ``client`` talks to."""
        return cls([client.address], settings, clients={client.address: client})

    def _new_replica(self, address: str, breaker: CircuitBreaker, authority: str | None) -> TargetReplica:
        given = self._clients.get(address)
        if given is not None:
            replica = TargetReplica(address, breaker, given)
            replica.owns_client = False
            return replica
        channel = make_channel(address, authority=authority) if authority else None
        return TargetReplica(address, breaker, TargetClient(address, channel))

    # -- start-up ---------------------------------------------------------------------------------------

    def connect(self, timeout_s: float, others_s: float = 10.0) -> common_pb2.ModelInfo:
        """Ask every replica for its ModelInfo (waiting up to ``timeout_s`` for the first answer, then up to
        ``others_s`` for the rest) and return the pool's (merge_infos). Replicas that do not answer yet join when
        healthy; replicas of another model raise IncompatibleTargets; none answering raises the last RpcError."""
        deadline = time.monotonic() + timeout_s
        while not self.replicas and time.monotonic() < deadline:  # a DNS name with no records yet
            time.sleep(min(0.5, self.resolve_interval_s))
            self.refresh()
        if not self.replicas:
            raise TargetsUnreachable(f"the target addresses resolved to nothing within {timeout_s:g} s")
        executor = ThreadPoolExecutor(max_workers=len(self.replicas), thread_name_prefix="target-info")
        futures = {executor.submit(r.client.info, timeout_s): r for r in self.replicas}
        pending, answered, errors, first_at = set(futures), [], [], 0.0
        try:
            while pending:
                end = deadline if not answered else min(deadline, first_at + others_s)
                done, pending = wait(pending, timeout=max(0.0, end - time.monotonic()), return_when=FIRST_COMPLETED)
                if not done:
                    break
                for f in done:
                    try:
                        futures[f].info = f.result()
                    except grpc.RpcError as e:
                        errors.append(f"{futures[f].address}: {e.code().name}")
                        continue
                    if not answered:
                        first_at = time.monotonic()
                    answered.append(futures[f])
        finally:
            executor.shutdown(wait=False, cancel_futures=True)
        if not answered:
            raise TargetsUnreachable(f"no target answered within {timeout_s:g} s ({', '.join(errors) or 'no reply'})")
        merged = merge_infos([r.info for r in answered])
        for r in self.replicas:
            if r not in answered:
                r.info = None  # asked again when healthy, and checked against the pool's (on_info)
                log.warning("target replica not reachable at start-up; it joins when healthy",
                            extra={"replica": r.address})
        return merged

    # -- placement --------------------------------------------------------------------------------------

    def usable(self, replica: TargetReplica) -> bool:
        return self.eligible(replica) and replica.breaker.state != OPEN

    def any_available(self) -> bool:
        return any(self.usable(r) for r in self.replicas)

    def place(self, session_id: str) -> TargetReplica | None:
        """A replica for the session (see the module docstring), counted as holding it; None: none usable now. A
        replica whose breaker's back-off is over takes the session as its probe."""
        ranked = [r for r in self.ranking(session_id) if self.eligible(r)]
        with self._load_lock:
            live = [r for r in ranked if r.breaker.state != OPEN]
            bound = math.ceil(LOAD_SLACK * (sum(r.sessions for r in live) + 1) / max(1, len(live)))
            for within_bound in (True, False):
                for r in ranked:
                    if (not within_bound or r.sessions < bound) and r.breaker.allow():
                        r.sessions += 1
                        return r
        return None

    def leave(self, replica: TargetReplica) -> None:
        with self._load_lock:
            replica.sessions = max(0, replica.sessions - 1)

    def sessions_per_replica(self) -> int:
        """The most sessions any replica holds now: how many one target forward batches (TargetCost)."""
        return max((r.sessions for r in self.replicas), default=0)

    def capacity(self, fallback: common_pb2.ModelInfo) -> int:
        """Generations the pool serves well at once (the orchestrator's --max-running auto): per replica, the
        sessions it caches (ModelInfo.max_sessions), no more than one batched forward takes (max_batch, when it
        batches), summed over the replicas not refused; `fallback` (the pool's ModelInfo) stands in for a replica
        not asked yet. More sessions at once only share its cores (or evict each other's caches) until their calls
        pass their deadlines. 0: a replica does not say (a target older than max_sessions)."""
        total = 0
        for r in list(self.replicas):
            if r.refused is not None:
                continue
            info = r.info or fallback
            if not info.max_sessions:
                return 0
            total += min(info.max_sessions, info.max_batch) if info.max_batch > 1 else info.max_sessions
        return total

    def seat(self, session_id: str) -> "TargetSeat":
        return TargetSeat(self, session_id)

    def info(self, timeout: float = 5.0) -> common_pb2.ModelInfo:
        """GetInfo of a usable replica (a readiness check): the last one's error when none answers."""
        error: Exception = TargetsUnreachable("no target replica")
        for r in sorted(self.replicas, key=lambda r: not self.usable(r)):
            try:
                return r.client.info(timeout=timeout)
            except grpc.RpcError as e:
                error = e
        raise error

    @property
    def first(self) -> TargetClient | None:
        return self.replicas[0].client if self.replicas else None


def open_targets(addresses: str, startup_timeout_s: float,
                 settings: PoolSettings = PoolSettings()) -> tuple[TargetPool, common_pb2.ModelInfo]:
    """The pool of the comma-separated target ``addresses`` and its ModelInfo (TargetPool.connect); a replica that
    joins later must serve the same model (model_mismatch). Raises ValueError (no address), TargetsUnreachable or
    IncompatibleTargets, the pool closed."""
    listed = [a.strip() for a in addresses.split(",") if a.strip()]
    if not listed:
        raise ValueError("give at least one target address")
    reference: dict = {}

    def check(replica, info) -> None:
        problem = model_mismatch(reference["info"], info) if "info" in reference else None
        if problem:
            raise IncompatibleTargets(f"target {replica.address} {problem}")

    pool = TargetPool(listed, settings, on_info=check)
    try:
        reference["info"] = pool.connect(startup_timeout_s)
    except BaseException:
        pool.close()
        raise
    return pool, reference["info"]


class TargetSeat:
    """One session's place in the pool: the replica it is on, moved when that one fails."""

    def __init__(self, pool: TargetPool, session_id: str):
        self.pool, self.session_id = pool, session_id
        self.replica: TargetReplica | None = None
        self.last: TargetReplica | None = None  # the replica the session was last on (it may hold its cache)
        self.moves = 0  # times the session went on from one replica to another

    def current(self) -> tuple[TargetReplica | None, bool]:
        """(the session's replica, whether the session just moved to it from another: its cache must be rebuilt
        there); (None, False) while no replica is usable."""
        r = self.replica
        if r is not None and r.breaker.state != OPEN and self.pool.eligible(r) and r in self.pool.replicas:
            return r, False  # a half-open breaker: this session holds its probe
        self.leave()
        self.replica = self.pool.place(self.session_id)
        moved = self.replica is not None and self.last is not None and self.replica is not self.last
        if moved:
            self.moves += 1
            log.warning("session moved to another target", extra={
                "session_id": self.session_id, "from": self.last.address, "to": self.replica.address})
            self.last.client.release_async(self.session_id, timeout=0.5)  # should it come back
        if self.replica is not None:
            self.last = self.replica
        return self.replica, moved

    def failed(self, health_blind: bool) -> None:
        """The session's call failed as a target going away does: open the replica's breaker (its other sessions
        leave it too, at their next call)."""
        if self.replica is not None:
            self.replica.breaker.failure(health_blind=health_blind)

    def leave(self) -> None:
        if self.replica is not None:
            self.pool.leave(self.replica)
            self.replica = None
