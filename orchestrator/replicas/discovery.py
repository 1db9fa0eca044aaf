"""Replicas found by DNS: ``dns:///draft:50051`` stands for every address the name resolves to (drafts and
targets alike: orchestrator/replicas/pool.py).

gRPC's own resolver would give one channel to one of those addresses (pick_first): the pool would see one
replica however many run. Here the name is resolved with getaddrinfo, each address becomes a replica of its
own (channel, health, breaker, rendezvous rank), and the name is resolved again periodically and after
failures, so replicas that come (``docker compose --scale``, a Kubernetes headless Service scaled up) or go
are picked up without a restart. Plain addresses (``host:port``) are left to gRPC as before.
"""

from __future__ import annotations

import logging
import socket
from dataclasses import dataclass
from typing import Callable

log = logging.getLogger("specdec.orchestrator.discovery")

DNS_SCHEME = "dns:"

# (host, port) -> the addresses it stands for now, each "ip:port"; raises OSError when it cannot resolve.
Resolve = Callable[[str, int], list[str]]


@dataclass(frozen=True)
class DnsName:
    host: str
    port: int

    def __str__(self) -> str:
        return f"dns:///{self.host}:{self.port}"


def is_dns(address: str) -> bool:
    return address.startswith(DNS_SCHEME)


def parse_dns(address: str) -> DnsName:
    """``dns:///host:port`` (gRPC's form; an authority, i.e. a DNS server, is not supported) -> DnsName."""
    rest = address[len(DNS_SCHEME):]
    if rest.startswith("//"):
        authority, sep, rest = rest[2:].partition("/")
        if authority or not sep:
            raise ValueError(f"{address!r}: use dns:///host:port (a DNS server in the address is not supported)")
    host, sep, port = rest.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{address!r}: a DNS address needs a host and a port, e.g. dns:///draft:50051")
    return DnsName(host, int(port))


def join_host_port(ip: str, port: int) -> str:
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


def resolve_getaddrinfo(host: str, port: int) -> list[str]:
    """Every address host has now (IPv4 and IPv6), sorted, each once."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({join_host_port(info[4][0], port) for info in infos})


class Discovery:
    """The replica addresses a list of addresses stands for; ``refresh()`` resolves the DNS names again.

    A name that fails to resolve keeps the addresses it had (a DNS hiccup must not drop healthy replicas; the
    health checks and breakers deal with replicas that are really gone). A resolver that answers with no
    addresses empties it."""

    def __init__(self, addresses: list[str], resolve: Resolve | None = None):
        self.resolve = resolve or resolve_getaddrinfo
        self.specs: list[str | DnsName] = [parse_dns(a) if is_dns(a) else a for a in addresses]
        self._resolved: dict[DnsName, list[str]] = {}
        self.authority: dict[str, str] = {}  # resolved address -> the DNS name it came from (TLS name checks)

    @property
    def dynamic(self) -> bool:
        return any(isinstance(s, DnsName) for s in self.specs)

    def refresh(self) -> list[str]:
        """Resolve every DNS name again; the addresses they and the plain entries stand for, in order, each once."""
        for spec in self.specs:
            if not isinstance(spec, DnsName):
                continue
            try:
                found = list(self.resolve(spec.host, spec.port))
            except OSError as e:
                log.warning("address did not resolve; keeping its replicas",
                            extra={"address": str(spec), "error": str(e), "kept": len(self._resolved.get(spec, []))})
                continue
            if found != self._resolved.get(spec):
                log.info("replicas resolved", extra={"address": str(spec), "replicas": found})
            self._resolved[spec] = found
            for a in found:
                self.authority[a] = spec.host
        return self.addresses()

    def addresses(self) -> list[str]:
        out: list[str] = []
        for spec in self.specs:
            for a in (self._resolved.get(spec, []) if isinstance(spec, DnsName) else [spec]):
                if a not in out:
                    out.append(a)
        return out
