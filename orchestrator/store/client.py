"""The Redis client behind the session store: one server (``redis://``) or a Sentinel-managed master
(``redis+sentinel://``), and how many replicas a write waits for.

    redis://[:PASSWORD@]HOST:PORT/DB[?wait_replicas=N|auto&wait_timeout_ms=MS]
    redis+sentinel://[:PASSWORD@]HOST:PORT[,HOST:PORT...]/MASTER_NAME[/DB][?wait_replicas=...&wait_timeout_ms=...]

The Sentinel client asks the sentinels where the master is and asks again after a connection fails, so after
a failover the store follows the promoted replica. A committed block is acknowledged to the client only after
``WAIT`` saw it on ``wait_replicas`` replicas (``auto``, the Sentinel default: every replica the sentinels
see alive, counted once a second; 0, the plain default: none), so a failover to a replica loses no
acknowledged block. A WAIT that comes back short counts as an outage (the caller retries the idempotent
write) unless the replicas it missed are gone; with Sentinel also when the master moved meanwhile (a
write the demoted master took is discarded when it resyncs). The password is the master's (PASSWORD); the
sentinels are asked without one.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from urllib.parse import parse_qs, unquote, urlencode, urlsplit, urlunsplit

SENTINEL_SCHEMES = ("redis+sentinel", "rediss+sentinel")
SENTINEL_PORT = 26379
REPLICA_COUNT_TTL_S = 1.0


class StoreUrlError(ValueError):
    """The session store URL cannot be used; the message says what is wrong with it."""


@dataclass
class StoreClient:
    client: object            # redis.Redis (a Sentinel master's, or one server's)
    replicas: "ReplicaWait"


class ReplicaWait:
    """How many replicas a write waits for: a fixed number, or (auto) those alive now: as the sentinels see
    them, or without Sentinel those the master has online."""

    def __init__(self, client, wanted: int | str, timeout_ms: int, sentinel=None, service: str = ""):
        self.client, self.wanted, self.timeout_ms = client, wanted, timeout_ms
        self.sentinel, self.service = sentinel, service
        self._online, self._checked = 0, float("-inf")
        self._lock = threading.Lock()

    def expected(self) -> int:
        if self.wanted != "auto":
            return self.wanted
        if time.monotonic() - self._checked > REPLICA_COUNT_TTL_S:
            self.refresh()
        return self._online

    def refresh(self) -> int:
        """Count the master's online replicas now (auto), e.g. after a WAIT that came back short."""
        if self.wanted != "auto":
            return self.wanted
        if self.sentinel is not None:
            online = len(self.sentinel.discover_slaves(self.service))
        else:
            info = self.client.info("replication")
            online = sum(1 for k, v in info.items()
                         if k.startswith("slave") and isinstance(v, dict) and v.get("state") == "online")
        with self._lock:
            self._online, self._checked = online, time.monotonic()
        return online

    def short(self, acked: int) -> bool:
        """Whether a write whose WAIT reached `acked` replicas is not durable: a replica that should have it is
        still alive, or (Sentinel) the server that took it is no longer the master."""
        if self.sentinel is not None and self.sentinel.discover_master(self.service) != \
                self.client.connection_pool.master_address:
            self.client.connection_pool.disconnect()  # the next connection goes to the promoted master
            return True
        return self.refresh() > acked


def _wait_option(query: dict, default: int | str) -> tuple[int | str, int]:
    raw = query.pop("wait_replicas", [str(default)])[0]
    if raw != "auto" and not (raw.isdigit() and int(raw) <= 16):
        raise StoreUrlError(f"wait_replicas must be 'auto' or 0..16, got {raw!r}")
    timeout = query.pop("wait_timeout_ms", ["1000"])[0]
    if not (timeout.isdigit() and 0 < int(timeout) <= 60_000):
        raise StoreUrlError(f"wait_timeout_ms must be 1..60000, got {timeout!r}")
    return (raw if raw == "auto" else int(raw)), int(timeout)


def _sentinel_hosts(netloc: str) -> list[tuple[str, int]]:
    hosts = []
    for item in netloc.rpartition("@")[2].split(","):
        item = item.strip()
        if item.startswith("["):  # [IPv6]:port
            host, _, port = item[1:].partition("]")
            port = port.removeprefix(":")
        else:
            host, _, port = item.partition(":")
        if not host or (port and not port.isdigit()):
            raise StoreUrlError(f"sentinel address {item!r} is not HOST:PORT")
        hosts.append((host, int(port) if port else SENTINEL_PORT))
    return hosts


def connect(url: str, socket_timeout_s: float = 2.0) -> StoreClient:
    import redis

    try:
        parts = urlsplit(url)
        query = parse_qs(parts.query)
        password = unquote(parts.password) if parts.password else None
        username = unquote(parts.username) if parts.username else None
    except ValueError as e:
        raise StoreUrlError(f"not a URL: {e}") from None
    timeouts = dict(socket_timeout=socket_timeout_s, socket_connect_timeout=socket_timeout_s)
    if parts.scheme in SENTINEL_SCHEMES:
        from redis.sentinel import Sentinel

        wanted, timeout_ms = _wait_option(query, "auto")
        path = [p for p in parts.path.split("/") if p]
        if not path or len(path) > 2 or (len(path) == 2 and not path[1].isdigit()):
            raise StoreUrlError("a sentinel URL is redis+sentinel://HOST:PORT[,HOST:PORT]/MASTER_NAME[/DB]")
        if query:
            raise StoreUrlError(f"unknown option(s) {', '.join(sorted(query))} in the sentinel URL")
        sentinel = Sentinel(_sentinel_hosts(parts.netloc), sentinel_kwargs=dict(timeouts), **timeouts)
        client = sentinel.master_for(path[0], db=int(path[1]) if len(path) == 2 else 0, password=password,
                                     username=username, ssl=parts.scheme.startswith("rediss"),
                                     health_check_interval=30, **timeouts)
        return StoreClient(client, ReplicaWait(client, wanted, timeout_ms, sentinel, path[0]))
    else:
        wanted, timeout_ms = _wait_option(query, 0)
        plain = urlunsplit(parts._replace(query=urlencode(query, doseq=True)))
        client = redis.Redis.from_url(plain, health_check_interval=30, **timeouts)
    return StoreClient(client, ReplicaWait(client, wanted, timeout_ms))
