"""Shared gRPC plumbing: servers with health checking and reflection, channels with sane options."""

from __future__ import annotations

import contextvars
import json
import os
import time
from dataclasses import dataclass
import logging
import threading
from concurrent import futures
from typing import Callable, Iterable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from specdec import observability as telemetry
from specdec.core.startup import ListenError, StartupError, bind_problem, listen_error  # noqa: F401 (re-exported)

log = logging.getLogger("specdec.grpc")

MAX_MESSAGE_BYTES = 8 * 1024 * 1024  # a request past this gets RESOURCE_EXHAUSTED from grpc itself

# Keepalive lets a client notice a dead peer (e.g. a SIGSTOPped draft) without waiting for TCP.
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.enable_retries", 1),
    # Short reconnect backoff so a restarted pod is used again quickly.
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2_000),
]

SERVER_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.http2.max_ping_strikes", 0),
    ("grpc.so_reuseport", 0),
]


def retry_service_config(service_names: Iterable[str]) -> str:
    """Transparent retries of idempotent-safe failures (UNAVAILABLE only) for the given services."""
    return json.dumps(
        {
            "methodConfig": [
                {
                    "name": [{"service": s} for s in service_names],
                    "retryPolicy": {
                        "maxAttempts": 3,
                        "initialBackoff": "0.05s",
                        "maxBackoff": "0.5s",
                        "backoffMultiplier": 2,
                        "retryableStatusCodes": ["UNAVAILABLE"],
                    },
                }
            ]
        }
    )


@dataclass(frozen=True)
class TlsConfig:
    """PEM files. A server with `ca` requires client certificates signed by it (mutual TLS); a client
    verifies servers with `ca` and presents cert/key when given."""

    cert: str | None = None
    key: str | None = None
    ca: str | None = None
    require_client_cert: bool = True

    @staticmethod
    def _read(path: str | None) -> bytes | None:
        if not path:
            return None
        with open(path, "rb") as f:
            return f.read()

    def server_credentials(self) -> grpc.ServerCredentials:
        if not (self.cert and self.key):
            raise ValueError("TLS on a server needs --tls-cert and --tls-key")
        ca = self._read(self.ca)
        return grpc.ssl_server_credentials([(self._read(self.key), self._read(self.cert))], root_certificates=ca,
                                           require_client_auth=bool(ca) and self.require_client_cert)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=self._read(self.ca), private_key=self._read(self.key),
                                            certificate_chain=self._read(self.cert))


_tls: TlsConfig | None = None  # process-wide: one service identity per process


def configure_tls(tls: TlsConfig | None) -> None:
    global _tls
    _tls = tls if tls and (tls.cert or tls.ca) else None


def add_tls_arguments(p) -> None:
    p.add_argument("--tls-cert", default=os.environ.get("SPECDEC_TLS_CERT"), help="PEM certificate (enables TLS)")
    p.add_argument("--tls-key", default=os.environ.get("SPECDEC_TLS_KEY"), help="PEM private key")
    p.add_argument("--tls-ca", default=os.environ.get("SPECDEC_TLS_CA"),
                   help="PEM CA: verify peers with it; servers then require client certificates (mTLS)")
    p.add_argument("--insecure", action="store_true",
                   help="serve without authentication on a non-loopback --listen address (trusted networks only)")


def client_tls_from_env() -> TlsConfig | None:
    """A client's TLS from SPECDEC_TLS_CA (and SPECDEC_TLS_CERT/KEY for mutual TLS); None when unset."""
    ca, cert, key = (os.environ.get(f"SPECDEC_TLS_{n}") or None for n in ("CA", "CERT", "KEY"))
    return TlsConfig(cert, key, ca) if (ca or cert) else None


def tls_from_args(args, require_client_cert: bool = True) -> TlsConfig | None:
    if not (args.tls_cert or args.tls_ca):
        return None
    return TlsConfig(args.tls_cert, args.tls_key, args.tls_ca, require_client_cert)


def make_channel(address: str, service_names: Iterable[str] = (), retries: bool = True,
                 tls: TlsConfig | None = None, authority: str | None = None) -> grpc.Channel:
    """``authority``: the name the server is known by when ``address`` is one of its resolved IPs (the TLS
    certificate is checked against it)."""
    options = list(CHANNEL_OPTIONS)
    if authority:
        options.append(("grpc.default_authority", authority))
    if retries and service_names:
        options.append(("grpc.service_config", retry_service_config(service_names)))
    tls = tls or _tls
    if tls is not None:
        if authority:
            options.append(("grpc.ssl_target_name_override", authority))
        channel = grpc.secure_channel(address, tls.channel_credentials(), options=options)
    else:
        channel = grpc.insecure_channel(address, options=options)
    # Client spans + W3C traceparent propagation (specdec.observability).
    return telemetry.intercept_channel(channel, address)


class HealthServicer(health.HealthServicer):
    """grpc's health service, whose graceful shutdown ends the Health.Watch streams without holding its lock.

    grpc's own pushes NOT_SERVING to every watcher while it holds the servicer's lock, and a watch stream that
    closes meanwhile runs its close callback (which takes that lock) on grpc's thread: with several Watch streams
    open, stop() could hang there. Here the watchers are taken out under the lock and each is sent NOT_SERVING
    and its end outside it; a close callback that comes after finds nothing left to remove."""

    GOODBYE_WAIT_S = 1.0  # the longest a stop waits for the watchers to be told (the server's stop ends the rest)

    def _on_close_callback(self, send_response_callback, service):
        def callback():
            with self._lock:
                self._send_response_callbacks.get(service, set()).discard(send_response_callback)
            send_response_callback(None)

        return callback

    def enter_graceful_shutdown(self) -> None:
        with self._lock:
            if self._gracefully_shutting_down:
                return
            self._gracefully_shutting_down = True
            for service in self._server_status:
                self._server_status[service] = health_pb2.HealthCheckResponse.NOT_SERVING
            watchers = [cb for callbacks in self._send_response_callbacks.values() for cb in callbacks]
            self._send_response_callbacks.clear()
        going = health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.NOT_SERVING)

        def goodbye() -> None:
            for send in watchers:
                send(going)  # blocks until sent: a watcher that reads nothing holds it until stop() cancels its call
                send(None)  # ends the stream: the server's stop() has no call left to wait for

        pushing = threading.Thread(target=goodbye, name="health-goodbye", daemon=True)
        pushing.start()
        pushing.join(self.GOODBYE_WAIT_S)


class ServiceServer:
    """A grpc.Server with health checking and reflection, serving one or more services."""

    def __init__(self, address: str, max_workers: int = 16, tls: TlsConfig | None = None):
        self.server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grpc"),
            options=SERVER_OPTIONS,
            maximum_concurrent_rpcs=max_workers * 4,
            interceptors=[telemetry.server_interceptor()],  # server spans from the caller's traceparent
        )
        self.health = HealthServicer(experimental_non_blocking=True)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self._service_names = [health.SERVICE_NAME, reflection.SERVICE_NAME]
        tls = tls or _tls
        try:
            if tls is not None:
                self.port = self.server.add_secure_port(address, tls.server_credentials())
            else:
                self.port = self.server.add_insecure_port(address)
        except RuntimeError:  # grpc's own message names no reason
            self.port = 0
        if self.port == 0:
            raise listen_error("gRPC", address)
        host = address.rsplit(":", 1)[0]
        self.address = f"{host}:{self.port}"

    def add(self, register: Callable[[object, grpc.Server], None], servicer: object, full_name: str) -> None:
        register(servicer, self.server)
        self._service_names.append(full_name)

    def start(self) -> "ServiceServer":
        reflection.enable_server_reflection(self._service_names, self.server)
        self.server.start()
        for name in self._service_names:
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        log.info("serving", extra={"address": self.address, "services": self._service_names})
        return self

    def stop(self, grace: float | None = 1.0) -> None:
        self.health.enter_graceful_shutdown()
        self.server.stop(grace).wait(timeout=(grace or 0) + 5)

    def wait(self) -> None:
        self.server.wait_for_termination()


def check_health(address: str, timeout: float = 1.0, service: str = "") -> bool:
    channel = make_channel(address)
    try:
        stub = health_pb2_grpc.HealthStub(channel)
        reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        return reply.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False
    finally:
        channel.close()


class RpcAbort(Exception):
    """Raised inside service code to end an RPC with a given status and a readable message."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


# The running RPC's deadline (time.monotonic()), set by handle_errors for the service code under it: work queued
# behind others checks it before it starts, so a call its client has given up on is not computed.
_CALL_DEADLINE: contextvars.ContextVar[float | None] = contextvars.ContextVar("call_deadline", default=None)


def call_deadline() -> float | None:
    """When the client of the RPC this thread serves stops waiting (time.monotonic()); None outside an RPC or
    without a deadline."""
    return _CALL_DEADLINE.get()


def _abort_for(error: BaseException, context, name: str) -> None:
    """Abort the call with the status that fits a service exception (re-raises an RpcError as it is)."""
    from specdec.core.kv_cache import CacheMiss, ContextTooLong

    if isinstance(error, RpcAbort):
        context.abort(error.code, error.message)
    elif isinstance(error, CacheMiss):
        context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(error))
    elif isinstance(error, ContextTooLong):
        context.abort(grpc.StatusCode.OUT_OF_RANGE, str(error))
    elif isinstance(error, ValueError):
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
    elif isinstance(error, MemoryError):
        context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "out of memory")
    elif isinstance(error, TimeoutError):  # queued work that did not start or finish before the call's deadline
        context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(error) or "deadline exceeded")
    elif isinstance(error, grpc.RpcError) and hasattr(error, "code"):
        raise error
    else:  # last line of defence for a server
        log.error("unhandled error in %s", name, exc_info=error)
        context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(error).__name__}: {error}")


def _deadline_of(context) -> float | None:
    remaining = context.time_remaining() if hasattr(context, "time_remaining") else None
    return time.monotonic() + remaining if remaining is not None and remaining < 1e8 else None


def handle_errors(method):
    """Map service exceptions to gRPC statuses with readable messages; never leak a traceback to the client."""
    import functools

    @functools.wraps(method)
    def wrapper(self, request, context):
        token = _CALL_DEADLINE.set(_deadline_of(context))
        try:
            return method(self, request, context)
        except Exception as e:  # noqa: BLE001 - mapped to a status
            _abort_for(e, context, method.__name__)
        finally:
            _CALL_DEADLINE.reset(token)

    return wrapper


def handle_stream_errors(method):
    """handle_errors for a server-streaming method (a generator): the messages it yielded reach the client, then
    the error's status."""
    import functools

    @functools.wraps(method)
    def wrapper(self, request, context):
        token = _CALL_DEADLINE.set(_deadline_of(context))
        try:
            yield from method(self, request, context)
        except Exception as e:  # noqa: BLE001 - mapped to a status
            _abort_for(e, context, method.__name__)
        finally:
            try:
                _CALL_DEADLINE.reset(token)
            except ValueError:  # closed from another context (the call ended): nothing to restore there
                pass

    return wrapper


def require_session_id(session_id: str) -> str:
    if not session_id:
        raise RpcAbort(grpc.StatusCode.INVALID_ARGUMENT, "session_id is required")
    if len(session_id) > 128:
        raise RpcAbort(grpc.StatusCode.INVALID_ARGUMENT, "session_id is longer than 128 characters")
    return session_id
