"""Why a service cannot start: errors whose message says what to change, and the one wording of 'cannot listen'
(gRPC servers, the metrics endpoint, the stack's port check)."""

from __future__ import annotations

import socket


class StartupError(RuntimeError):
    """A service cannot start as configured; its message says why and what to change (no traceback needed)."""

    exit_code = 1


class ListenError(StartupError):
    """A server could not listen where it was told to (the port is taken, the address is not this host's)."""


def bind_problem(host: str, port: int) -> str | None:
    """Why binding host:port fails right now (e.g. 'Address already in use'), or None if it would not."""
    host = host.strip("[]") or "0.0.0.0"
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC and the metrics server bind
            s.bind((host, port))
    except OSError as e:
        return e.strerror or str(e)
    return None


def listen_error(what: str, address: str, reason: str | None = None,
                 hint: str = "another process holds the port (choose another, or 0 for any free one)") -> ListenError:
    """The error for a server that cannot listen at address: the reason (probed with bind_problem unless given),
    and where the port is taken, the hint."""
    if reason is None:
        host, _, port = address.rpartition(":")
        reason = bind_problem(host, int(port)) if port.isdigit() else "not a host:port address"
    return ListenError(f"cannot listen on {address} for {what}: {reason or 'refused'}"
                       + (f"; {hint}" if reason == "Address already in use" else ""))
