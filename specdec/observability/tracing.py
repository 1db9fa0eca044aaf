"""Traces: spans for code blocks and Redis calls, a client span per gRPC call that injects a W3C
``traceparent`` (``TracedChannel``), and a server span per call, the child of the caller's (a server
interceptor). One ``Generate`` is one trace: client -> orchestrator -> {draft, target} -> Redis."""

from __future__ import annotations

import contextlib
import contextvars
import functools
import hashlib
import threading
import time
from typing import Callable

import grpc
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from specdec.observability.metrics import _OUTPUT, _gen_ai_attrs, _instrument, _instruments


_tracer = trace.get_tracer("specdec")  # a proxy until a provider is set; cheap to keep


@functools.lru_cache(maxsize=4096)
def session_hash(session_id: str) -> str:
    """What spans carry instead of a session id (the id is a bearer capability: whoever has it may resume the
    session). Find a session's traces by searching session_id=session_hash(id)."""
    return hashlib.sha256(session_id.encode()).hexdigest()[:16]


def _attributes(attributes: dict) -> dict:
    out = {k: v for k, v in attributes.items() if v is not None}
    if out.get("session_id"):
        out["session_id"] = session_hash(out["session_id"])
    return out


@contextlib.contextmanager
def span(name: str, **attributes):
    with _tracer.start_as_current_span(name, attributes=_attributes(attributes)) as s:
        yield s


_call_attrs: contextvars.ContextVar = contextvars.ContextVar("specdec_call_attributes", default=None)


@contextlib.contextmanager
def call_attributes(**attributes):
    """Attributes for the CLIENT spans of the calls made inside this block (gRPC calls and ``traced`` store
    calls): the orchestrator's step (session_id, k, ...) goes on the call's own span instead of an INTERNAL step
    span wrapping a single call. Not metric attributes (a session id would make unbounded series)."""
    token = _call_attrs.set(_attributes(attributes))
    try:
        yield
    finally:
        _call_attrs.reset(token)


def annotate(**attributes):
    """Set attributes on the current span (a service handler's: its RPC's SERVER span) and return it. A handler
    annotates its call's span rather than opening a child span that would only repeat it: every span costs the
    critical path of a speculative step tens of microseconds per process."""
    s = trace.get_current_span()
    s.set_attributes(_attributes(attributes))
    return s


REDIS = {"db.system.name": "redis"}


class traced:
    """A span around a block or a function: ``with traced("x"):`` or ``@traced("redis.commit", REDIS)``.

    Attributes with a ``db.system.name`` make a CLIENT span (a call out of the process)."""

    def __init__(self, name: str, attributes: dict | None = None, kind: SpanKind | None = None):
        self.name = name
        self.attributes = dict(attributes or {})
        self.kind = kind or (SpanKind.CLIENT if "db.system.name" in self.attributes else SpanKind.INTERNAL)
        self._local = threading.local()

    def _cm(self):
        extra = _call_attrs.get()
        return _tracer.start_as_current_span(self.name, kind=self.kind,
                                             attributes={**self.attributes, **extra} if extra else self.attributes)

    def __call__(self, fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            with self._cm():
                return fn(*args, **kwargs)

        return wrapper

    def __enter__(self):
        cm = self._cm()
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        stack.append(cm)
        return cm.__enter__()

    def __exit__(self, *exc):
        return self._local.stack.pop().__exit__(*exc)


# Server spans with these statuses are errors (OTel rpc semantic conventions); a client sees any non-OK.
_SERVER_ERROR_CODES = {"UNKNOWN", "DEADLINE_EXCEEDED", "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS"}
_UNTRACED_SERVICES = ("grpc.health.v1.Health", "grpc.reflection.")


def _split_method(full_method: str) -> tuple[str, str]:
    service, _, method = full_method.lstrip("/").rpartition("/")
    return service, method


def _rpc_attrs(full_method: str) -> dict:
    service, method = _split_method(full_method)
    return {"rpc.system": "grpc", "rpc.service": service, "rpc.method": method}


def _untraced(full_method: str) -> bool:
    return full_method.lstrip("/").startswith(_UNTRACED_SERVICES)


class _MetadataGetter:
    def get(self, carrier, key):
        v = carrier.get(key)
        return None if v is None else [v]

    def keys(self, carrier):
        return list(carrier)


_getter = _MetadataGetter()


class _ClientCalls:
    """A CLIENT span per call, its context injected as W3C traceparent metadata, and the call's duration.

    Wraps each multicallable once, when a stub is built: grpc's own client interceptors build a new multicallable
    (and register its method) on every call, measurably more per call on a speculative step's critical path."""

    def __init__(self, address: str):
        host, _, port = address.rpartition(":")
        self.peer = {"server.address": host or address}
        if port.isdigit():
            self.peer["server.port"] = int(port)

    def info(self, method):
        """(span name, span attributes, metric attributes) of a method, or None when it is not traced."""
        name = method if isinstance(method, str) else method.decode()
        if _untraced(name):
            return None
        attrs = _rpc_attrs(name)
        return name.lstrip("/"), {**attrs, **self.peer}, attrs

    @staticmethod
    def start(info, metadata):
        name, span_attrs, attrs = info
        extra = _call_attrs.get()
        s = _tracer.start_span(name, kind=SpanKind.CLIENT, attributes={**span_attrs, **extra} if extra else span_attrs)
        carrier: dict = {}
        propagate.inject(carrier, context=trace.set_span_in_context(s))
        return s, [*(metadata or ()), *carrier.items()], time.perf_counter()

    @staticmethod
    def end(info, s, t0, code, exc=None) -> None:
        status = code.name if code is not None else "UNKNOWN"
        s.set_attribute("rpc.grpc.status_code", code.value[0] if code is not None else 2)
        if status != "OK":
            s.set_status(Status(StatusCode.ERROR, status))
            if exc is not None and not isinstance(exc, grpc.RpcError):
                s.record_exception(exc)
        s.end()
        _instrument("rpc_client").record(time.perf_counter() - t0, _with_status(info[2], status))

    @classmethod
    def end_when_done(cls, info, s, t0, call) -> None:
        """End the span when a future or a stream completes (once: grpc calls a done callback once)."""
        def done(fut):
            try:
                code = fut.code()
            except Exception:  # noqa: BLE001
                code = None
            cls.end(info, s, t0, code)

        try:
            call.add_done_callback(done)
        except Exception:  # noqa: BLE001 - not a future: end now
            s.end()


def _blocking(calls, info, raw):
    def invoke(request, timeout=None, metadata=None, credentials=None, wait_for_ready=None, compression=None):
        s, md, t0 = calls.start(info, metadata)
        try:
            out = raw(request, timeout=timeout, metadata=md, credentials=credentials, wait_for_ready=wait_for_ready,
                      compression=compression)
        except grpc.RpcError as e:
            calls.end(info, s, t0, e.code() if hasattr(e, "code") else None)
            raise
        except BaseException as e:
            calls.end(info, s, t0, None, e)
            raise
        calls.end(info, s, t0, grpc.StatusCode.OK)
        return out

    return invoke


def _started(calls, info, raw):
    def invoke(request, timeout=None, metadata=None, credentials=None, wait_for_ready=None, compression=None):
        s, md, t0 = calls.start(info, metadata)
        try:
            call = raw(request, timeout=timeout, metadata=md, credentials=credentials, wait_for_ready=wait_for_ready,
                       compression=compression)
        except BaseException as e:
            calls.end(info, s, t0, None, e)
            raise
        calls.end_when_done(info, s, t0, call)
        return call

    return invoke


class _TracedUnary:
    """A unary-request or stream-request multicallable with a span per call (blocking, with_call, future)."""

    def __init__(self, calls, info, raw):
        self._call = _blocking(calls, info, raw)
        self.with_call = _blocking(calls, info, raw.with_call)
        self.future = _started(calls, info, raw.future)

    def __call__(self, *args, **kwargs):
        return self._call(*args, **kwargs)


class _TracedStream:
    """A response-streaming multicallable: the span lasts the stream's life."""

    def __init__(self, calls, info, raw):
        self._invoke = _started(calls, info, raw)

    def __call__(self, *args, **kwargs):
        return self._invoke(*args, **kwargs)


class TracedChannel(grpc.Channel):
    """A channel whose calls are traced (see _ClientCalls); everything else is the wrapped channel's."""

    def __init__(self, channel: grpc.Channel, address: str = ""):
        self._channel = channel
        self._calls = _ClientCalls(address)

    def _wrap(self, kind, raw, method):
        info = self._calls.info(method)
        return raw if info is None else kind(self._calls, info, raw)

    def unary_unary(self, method, request_serializer=None, response_deserializer=None, _registered_method=False):
        raw = self._channel.unary_unary(method, request_serializer, response_deserializer, _registered_method)
        return self._wrap(_TracedUnary, raw, method)

    def stream_unary(self, method, request_serializer=None, response_deserializer=None, _registered_method=False):
        raw = self._channel.stream_unary(method, request_serializer, response_deserializer, _registered_method)
        return self._wrap(_TracedUnary, raw, method)

    def unary_stream(self, method, request_serializer=None, response_deserializer=None, _registered_method=False):
        raw = self._channel.unary_stream(method, request_serializer, response_deserializer, _registered_method)
        return self._wrap(_TracedStream, raw, method)

    def stream_stream(self, method, request_serializer=None, response_deserializer=None, _registered_method=False):
        raw = self._channel.stream_stream(method, request_serializer, response_deserializer, _registered_method)
        return self._wrap(_TracedStream, raw, method)

    def subscribe(self, callback, try_to_connect=False):
        self._channel.subscribe(callback, try_to_connect=try_to_connect)

    def unsubscribe(self, callback):
        self._channel.unsubscribe(callback)

    def close(self):
        self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc_val, exc_tb):
        self._channel.close()
        return False


_status_attrs: dict = {}  # (rpc attributes, status) -> the metric's attributes: built once, not per call


def _with_status(attrs: dict, status: str) -> dict:
    key = (attrs["rpc.service"], attrs["rpc.method"], status)
    out = _status_attrs.get(key)
    if out is None:
        out = {**attrs, "rpc.grpc.status_code": status}
        if len(_status_attrs) < 1024:
            _status_attrs[key] = out
    return out


def intercept_channel(channel, address: str = ""):
    return TracedChannel(channel, address)


class _GenerateObserver:
    """gen_ai request metrics and the active-session count for one Orchestrator.Generate stream."""

    def __init__(self):
        self.t0 = time.perf_counter()
        self.first = None
        self.output = 0
        self.prompt = None
        _instrument("active_sessions").add(1)

    def on_message(self, msg) -> None:
        n = len(msg.token_ids)
        if n:
            if self.first is None:
                self.first = time.perf_counter()
                _instruments["ttft"].record(self.first - self.t0, _gen_ai_attrs)
            self.output += n
        if msg.HasField("stats"):
            self.prompt = msg.stats.prompt_tokens

    def on_end(self, code_name: str) -> None:
        _instruments["active_sessions"].add(-1)
        now = time.perf_counter()
        attrs = dict(_gen_ai_attrs)
        if code_name != "OK":
            attrs["error.type"] = code_name
        _instruments["request_duration"].record(now - self.t0, attrs)
        if code_name != "OK":
            return
        if self.prompt is not None:
            _instruments["token_usage"].record(self.prompt, {**_gen_ai_attrs, "gen_ai.token.type": "input"})
        _instruments["token_usage"].record(self.output, {**_gen_ai_attrs, **_OUTPUT})
        if self.first is not None and self.output > 1:
            _instruments["tpot"].record((now - self.first) / (self.output - 1), _gen_ai_attrs)


# Full method -> factory of a per-stream observer with on_message(msg) and on_end(status name).
STREAM_OBSERVERS: dict[str, Callable[[], object]] = {"/specdec.v1.Orchestrator/Generate": _GenerateObserver}


def _code_name(context) -> str:
    try:
        code = context.code()
    except Exception:  # noqa: BLE001
        code = None
    if code is None:
        return "OK"
    return code.name if hasattr(code, "name") else str(code)


class _TracedMethod:
    """One registered method's server-side tracing: a SERVER span per call, the child of the caller's
    traceparent, its status and duration recorded when the call ends."""

    def __init__(self, method: str):
        self.attrs = _rpc_attrs(method)
        self.name = method.lstrip("/")
        self.observer_factory = STREAM_OBSERVERS.get(method)
        self.fields = propagate.get_global_textmap().fields

    def start(self, context):
        carrier = {}
        for md in context.invocation_metadata() or ():
            carrier[md.key] = md.value
        parent = propagate.extract(carrier, getter=_getter) if not self.fields.isdisjoint(carrier) else None
        s = _tracer.start_span(self.name, context=parent, kind=SpanKind.SERVER, attributes=self.attrs)
        return s, trace.set_span_in_context(s, parent), time.perf_counter()

    def finish(self, s, t0, context, exc=None, cancelled=False):
        code = _code_name(context)
        if code == "OK" and exc is not None:
            code = "UNKNOWN"  # an exception grpc will turn into UNKNOWN
        elif code == "OK" and cancelled:
            code = "CANCELLED"
        s.set_attribute("rpc.grpc.status_code", getattr(grpc.StatusCode, code).value[0]
                        if hasattr(grpc.StatusCode, code) else 2)
        if code in _SERVER_ERROR_CODES:
            s.set_status(Status(StatusCode.ERROR, code))
            if exc is not None and type(exc) is not Exception:  # a bare Exception is grpc's abort
                s.record_exception(exc)
        s.end()
        _instrument("rpc_server").record(time.perf_counter() - t0, _with_status(self.attrs, code))
        return code

    def unary(self, behavior):
        def wrapper(request, context):
            s, ctx, t0 = self.start(context)
            token = otel_context.attach(ctx)
            try:
                result = behavior(request, context)
            except BaseException as e:
                otel_context.detach(token)
                self.finish(s, t0, context, e)
                raise
            otel_context.detach(token)
            self.finish(s, t0, context)
            return result

        return wrapper

    def stream(self, behavior):
        def wrapper(request, context):
            s, ctx, t0 = self.start(context)
            observer = self.observer_factory() if self.observer_factory else None
            lock = threading.Lock()
            state = {"done": False}

            def end(exc=None, cancelled=False):
                with lock:
                    if state["done"]:
                        return
                    state["done"] = True
                code = self.finish(s, t0, context, exc, cancelled)
                if observer is not None:
                    observer.on_end(code)

            # The handler generator runs in its own contextvars.Context, so the span context
            # (and the handler's own spans) survive across yields, whatever thread resumes it.
            run_ctx = contextvars.copy_context()
            run_ctx.run(otel_context.attach, ctx)
            # A cancelled stream is never resumed: end the span when the RPC terminates.
            context.add_callback(lambda: end(cancelled=True))
            yield from _traced_messages(run_ctx, lambda: behavior(request, context), observer, end)
            end()

        return wrapper

    def handler(self, handler):
        """The method's handler with each call traced."""
        if handler.request_streaming and handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(
                self.stream(handler.stream_stream), handler.request_deserializer, handler.response_serializer)
        if handler.request_streaming:
            return grpc.stream_unary_rpc_method_handler(
                self.unary(handler.stream_unary), handler.request_deserializer, handler.response_serializer)
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(
                self.stream(handler.unary_stream), handler.request_deserializer, handler.response_serializer)
        return grpc.unary_unary_rpc_method_handler(
            self.unary(handler.unary_unary), handler.request_deserializer, handler.response_serializer)


def _traced_messages(run_ctx, call, observer, end):
    """A streaming handler's messages, each produced inside `run_ctx`; `end(exc | cancelled)` when it stops early."""
    it = None
    try:
        it = run_ctx.run(lambda: iter(call()))
        while True:
            try:
                msg = run_ctx.run(next, it)
            except StopIteration:
                break
            if observer is not None:
                observer.on_message(msg)
            yield msg
    except GeneratorExit:
        end(cancelled=True)
        raise
    except BaseException as e:
        end(e)
        raise
    finally:
        close = getattr(it, "close", None)
        if close is not None:
            with contextlib.suppress(Exception):
                run_ctx.run(close)


class _ServerInterceptor(grpc.ServerInterceptor):
    def __init__(self):
        self._wrapped: dict = {}  # method -> (its handler, the traced handler): wrapped once, not per call

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        method = handler_call_details.method
        cached = self._wrapped.get(method)
        if cached is not None and cached[0] is handler:
            return cached[1]
        traced = handler if handler is None or _untraced(method) else _TracedMethod(method).handler(handler)
        if handler is not None and len(self._wrapped) < 1024:  # registered methods only: a finite set
            self._wrapped[method] = (handler, traced)
        return traced


def server_interceptor():
    """A grpc server interceptor: a SERVER span per call, the child of the caller's traceparent."""
    return _ServerInterceptor()
