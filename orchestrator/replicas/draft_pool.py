"""Draft replicas behind one interface (orchestrator/replicas/pool.py): health checking, a circuit breaker per
replica, session affinity.

A session sticks to the replica that holds its KV cache (rendezvous hashing, so affinity survives orchestrator
restarts without shared state); when that replica is unhealthy the session fails over to the next one in its
ranking, which rebuilds the cache from the committed tokens (a TokenDelta from 0). With every replica down the
session decodes target-only.
"""

from __future__ import annotations

from orchestrator.replicas.clients import DraftClient
from orchestrator.replicas.discovery import Resolve
from orchestrator.replicas.pool import (CLOSED, HALF_OPEN, OPEN, CircuitBreaker, PoolSettings, Replica, ReplicaPool,
                                        rank)
from specdec.core.grpc_util import make_channel

__all__ = ["CLOSED", "HALF_OPEN", "OPEN", "CircuitBreaker", "DraftPool", "DraftReplica", "LocalDraftReplica", "PoolSettings",
           "_rank"]

_rank = rank  # the name chaos/ and older callers import


class DraftReplica(Replica):
    def __init__(self, address: str, breaker: CircuitBreaker, client: DraftClient | None = None):
        super().__init__(address, breaker, client or DraftClient(address))


class LocalDraftReplica(DraftReplica):
    """An in-process drafter (orchestrator/replicas/local_draft.py): healthy for as long as the orchestrator runs."""

    def __init__(self, client, breaker: CircuitBreaker):
        super().__init__(client.address, breaker, client)
        self.info = client.info()

    def check_health(self, timeout: float) -> bool:
        return True


class DraftPool(ReplicaPool):
    KIND = "draft"
    _always_checked = (LocalDraftReplica,)

    def __init__(self, addresses: list[str], settings: PoolSettings = PoolSettings(), on_info=None,
                 resolve: Resolve | None = None, local_client=None):
        """``local_client(address)``: builds the client of an in-process drafter (addresses ``local:...``); the other
        arguments as ReplicaPool's."""
        self._local_client = local_client
        super().__init__(addresses, settings, on_info, resolve)

    def _new_replica(self, address: str, breaker: CircuitBreaker, authority: str | None) -> DraftReplica:
        from orchestrator.replicas.local_draft import is_local

        if is_local(address):
            if self._local_client is None:
                raise ValueError(f"{address!r}: this draft pool cannot build in-process drafters")
            return LocalDraftReplica(self._local_client(address), breaker)
        channel = make_channel(address, authority=authority) if authority else None
        return DraftReplica(address, breaker, DraftClient(address, channel) if channel else None)

    def max_draft_len(self) -> int:
        """The longest draft every replica that has reported takes (ModelInfo.max_draft_len; 0: none says): part
        of a request's draft ceiling, resolved at admission (orchestrator/api/limits.py)."""
        limits = [r.info.max_draft_len for r in list(self.replicas) if r.info is not None and r.info.max_draft_len]
        return min(limits, default=0)

    def pick(self, session_id: str) -> DraftReplica | None:
        """The session's preferred replica whose breaker lets a call through, else None (degrade)."""
        for r in self.ranking(session_id):
            if self.eligible(r) and r.breaker.allow():
                return r
        return None
