"""Structured logs, OpenTelemetry traces and metrics, and process lifecycle helpers for every service.

Traces
  Every gRPC server (``ServiceServer``) and client channel (``make_channel``) is traced by what is defined
  here: a client span per call that injects a W3C ``traceparent`` into the call's metadata (``TracedChannel``),
  and a server span per call, the child of the caller's span (a server interceptor). One ``Generate`` is therefore one trace:
  client -> orchestrator -> {draft, target} -> Redis. Streaming RPCs are traced for their whole life.

Metrics
  Instruments are created on first use; the SDK meter provider (see :func:`setup`) always has an
  in-process reader (:func:`snapshot`) and a Prometheus reader (served by :func:`start_metrics_server`
  when ``SPECDEC_METRICS_PORT`` or ``setup(metrics_port=...)`` asks), plus OTLP export when
  ``OTEL_EXPORTER_OTLP_ENDPOINT`` is set. Names follow the OpenTelemetry gen_ai and rpc semantic
  conventions where they exist, ``specdec.*`` otherwise; docs/observability.md lists them.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import functools
import json
import logging
import os
import signal
import sys
import threading
import time
import weakref
from typing import Callable

import grpc
from opentelemetry import context as otel_context
from opentelemetry import metrics, propagate, trace
from opentelemetry.trace import SpanKind, Status, StatusCode

_SERVICE = "specdec"
_STD_ATTRS = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime"}
log = logging.getLogger("specdec.telemetry")


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "service": _SERVICE,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        out.update({k: v for k, v in vars(record).items() if k not in _STD_ATTRS})
        span_ctx = trace.get_current_span().get_span_context()
        if span_ctx.is_valid:
            out["trace_id"] = format(span_ctx.trace_id, "032x")
            out["span_id"] = format(span_ctx.span_id, "016x")
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


# --------------------------------------------------------------------------------------------
# Providers
# --------------------------------------------------------------------------------------------

_providers_lock = threading.RLock()
_tracer_provider = None   # the SDK TracerProvider this process uses
_meter_provider = None    # the SDK MeterProvider this process uses (None if someone else set one)
_memory_reader = None     # InMemoryMetricReader behind snapshot()
_prom_registry = None     # prometheus_client CollectorRegistry fed by the PrometheusMetricReader
_metrics_server = None    # (httpd, thread, port) of the /metrics endpoint


def setup(service_name: str, level: str | None = None, metrics_port: int | str | None = None,
          configure_logging: bool = True) -> None:
    """JSON logs on stderr; SDK trace and meter providers (OTLP export when OTEL_EXPORTER_OTLP_ENDPOINT
    is set); a Prometheus /metrics endpoint when ``metrics_port`` or env SPECDEC_METRICS_PORT is given
    (``PORT`` or ``HOST:PORT``; host defaults to SPECDEC_METRICS_HOST or 0.0.0.0)."""
    global _SERVICE
    _SERVICE = service_name
    if configure_logging:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(JsonFormatter())
        root = logging.getLogger()
        root.handlers[:] = [handler]
        root.setLevel(level or os.environ.get("SPECDEC_LOG_LEVEL", "INFO"))
        for noisy in ("httpx", "urllib3", "filelock"):
            logging.getLogger(noisy).setLevel(logging.WARNING)
    ensure_providers(service_name)
    if metrics_port is None:
        metrics_port = os.environ.get("SPECDEC_METRICS_PORT") or None
    if metrics_port not in (None, ""):
        start_metrics_server(metrics_port)


def ensure_providers(service_name: str | None = None) -> None:
    """Install the SDK tracer and meter providers once per process (idempotent).

    If the process already has an SDK TracerProvider (set by someone else), it is reused so that span
    processors added with :func:`add_span_processor` still see every span."""
    global _tracer_provider, _meter_provider, _memory_reader, _prom_registry
    with _providers_lock:
        if _tracer_provider is not None:
            return
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import InMemoryMetricReader
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider

        import socket

        # OTEL_SERVICE_NAME wins (e.g. to tell deployments apart); the instance id tells replicas apart.
        name = os.environ.get("OTEL_SERVICE_NAME") or service_name or _SERVICE
        resource = Resource.create({"service.name": name, "service.namespace": "specdec",
                                    "service.instance.id": f"{socket.gethostname()}-{os.getpid()}"})
        otlp = bool(os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))

        current = trace.get_tracer_provider()
        if isinstance(current, TracerProvider):
            _tracer_provider = current
        else:
            _tracer_provider = TracerProvider(resource=resource, sampler=_RecordWhenExported())
            if otlp:
                from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
                from opentelemetry.sdk.trace.export import BatchSpanProcessor

                _tracer_provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
            trace.set_tracer_provider(_tracer_provider)

        readers = []
        _memory_reader = InMemoryMetricReader()
        readers.append(_memory_reader)
        try:
            from opentelemetry.exporter.prometheus import PrometheusMetricReader
            from prometheus_client import CollectorRegistry, ProcessCollector

            _prom_registry = CollectorRegistry(auto_describe=True)
            ProcessCollector(registry=_prom_registry)
            readers.append(PrometheusMetricReader(registry=_prom_registry))
        except ImportError:  # pragma: no cover - both are project dependencies
            _prom_registry = None
        if otlp or os.environ.get("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT"):
            from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
            from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

            readers.append(PeriodicExportingMetricReader(OTLPMetricExporter()))
        provider = MeterProvider(resource=resource, metric_readers=readers)
        if isinstance(metrics.get_meter_provider(), MeterProvider):
            log.warning("a MeterProvider was set before specdec's; snapshot() and /metrics see nothing")
            _meter_provider = None
            _memory_reader = None
        else:
            metrics.set_meter_provider(provider)
            _meter_provider = provider


def _span_processors(provider) -> tuple | None:
    """The provider's span processors; None where the SDK keeps them elsewhere than it does today."""
    return getattr(getattr(provider, "_active_span_processor", None), "_span_processors", None)


class _RecordWhenExported:
    """Sampler: a span nobody will export is not built. Until the provider has a span processor (an OTLP
    exporter, a test's in-memory one) spans are dropped at the sampler: measured on a Verify round trip here,
    building and ending the client's and the server's spans cost ~0.2 ms of a ~1.7 ms call with no exporter
    configured (`specdec run`, the benchmark). Trace context still propagates, and a service that exports records
    its spans whatever its caller did (OTEL_TRACES_SAMPLER, when set, decides instead)."""

    def __init__(self):
        from opentelemetry.sdk.trace import sampling

        self._sampling = sampling
        self._exporting = (sampling._get_from_env_or_default() if os.environ.get("OTEL_TRACES_SAMPLER")
                           else sampling.ALWAYS_ON)

    def should_sample(self, parent_context, trace_id, name, kind=None, attributes=None, links=None,
                      trace_state=None):
        processors = _span_processors(_tracer_provider)
        if processors is None or processors:
            return self._exporting.should_sample(parent_context, trace_id, name, kind, attributes, links,
                                                 trace_state)
        parent = trace.get_current_span(parent_context).get_span_context()
        return self._sampling.SamplingResult(self._sampling.Decision.DROP, None,
                                             parent.trace_state if parent.is_valid else None)

    def get_description(self) -> str:
        return f"RecordWhenExported{{{self._exporting.get_description()}}}"


def providers_installed() -> bool:
    """True once this process has specdec's meter provider (so snapshot() has data)."""
    return _memory_reader is not None


def add_metrics_argument(p) -> None:
    """``--metrics-port`` for a service's argparse parser (default: env SPECDEC_METRICS_PORT; unset = off)."""
    p.add_argument("--metrics-port", default=os.environ.get("SPECDEC_METRICS_PORT") or None,
                   help="serve Prometheus metrics at http://HOST:PORT/metrics (PORT or HOST:PORT; "
                        "default $SPECDEC_METRICS_PORT, unset = no endpoint)")


def tracer_provider():
    """The process's SDK TracerProvider (installed on demand)."""
    ensure_providers()
    return _tracer_provider


def add_span_processor(processor) -> None:
    """Add a span processor (e.g. SimpleSpanProcessor(InMemorySpanExporter()) in tests)."""
    tracer_provider().add_span_processor(processor)


def start_metrics_server(port: int | str = 0, host: str | None = None) -> int:
    """Serve Prometheus text format at http://HOST:PORT/metrics; returns the bound port (0 = any free one).
    A second call returns the running server's port."""
    global _metrics_server
    ensure_providers()
    if _prom_registry is None:
        raise RuntimeError("prometheus exporter unavailable (opentelemetry-exporter-prometheus not installed)")
    with _providers_lock:
        if _metrics_server is not None:
            return _metrics_server[2]
        spec = str(port)
        if ":" in spec:
            host, spec = spec.rsplit(":", 1)
        host = host or os.environ.get("SPECDEC_METRICS_HOST", "0.0.0.0")
        from prometheus_client import start_http_server

        try:
            httpd, thread = start_http_server(int(spec), addr=host, registry=_prom_registry)
        except OSError as e:
            from specdec.grpc_util import listen_error

            raise listen_error("metrics", f"{host}:{spec}", e.strerror or str(e),
                               "another process holds the port (choose another, or 0 for none)") from e
        bound = httpd.server_address[1]
        _metrics_server = (httpd, thread, bound)
        log.info("metrics endpoint", extra={"address": f"{host}:{bound}", "path": "/metrics"})
        return bound


def prometheus_registry():
    """The registry the Prometheus endpoints serve (None without the exporter), e.g. for an HTTP API's /metrics."""
    ensure_providers()
    return _prom_registry


def metrics_port() -> int | None:
    return _metrics_server[2] if _metrics_server else None


def stop_metrics_server() -> None:
    global _metrics_server
    with _providers_lock:
        if _metrics_server is not None:
            httpd, thread, _ = _metrics_server
            httpd.shutdown()
            httpd.server_close()
            _metrics_server = None


def snapshot() -> dict:
    """Current metric values of this process: {name: {"unit", "kind", "value", "points": [...]}}.

    ``value`` sums the points (counters, gauges) or is the total observation count (histograms, which
    also carry ``sum``). Each point has its ``attributes`` and ``value`` or ``count``/``sum``/``min``/
    ``max``/``bucket_counts``/``explicit_bounds``."""
    ensure_providers()
    if _memory_reader is None:
        return {}
    data = _memory_reader.get_metrics_data()
    out: dict = {}
    if data is None:
        return out
    for rm in data.resource_metrics:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                entry = out.setdefault(m.name, {"unit": m.unit, "description": m.description,
                                                "kind": type(m.data).__name__.lower(), "points": []})
                for p in m.data.data_points:
                    attrs = dict(p.attributes or {})
                    if hasattr(p, "bucket_counts"):
                        entry["points"].append({"attributes": attrs, "count": p.count, "sum": p.sum, "min": p.min,
                                                "max": p.max, "bucket_counts": list(p.bucket_counts),
                                                "explicit_bounds": list(p.explicit_bounds)})
                    else:
                        entry["points"].append({"attributes": attrs, "value": p.value})
    for entry in out.values():
        pts = entry["points"]
        if entry["kind"] == "histogram":
            entry["value"] = sum(p["count"] for p in pts)
            entry["sum"] = sum(p["sum"] for p in pts)
        else:
            entry["value"] = sum(p["value"] for p in pts)
    return out


def metric_value(snap: dict, name: str, **attributes) -> float:
    """Sum (or histogram count) of ``name`` in a snapshot over the points matching ``attributes``."""
    entry = snap.get(name)
    if not entry:
        return 0
    total = 0
    for p in entry["points"]:
        if all(p["attributes"].get(k) == v for k, v in attributes.items()):
            total += p.get("count", p.get("value", 0))
    return total


# --------------------------------------------------------------------------------------------
# Metric instruments
# --------------------------------------------------------------------------------------------

# Bucket boundaries (seconds / tokens) from the gen_ai semantic conventions where they define them.
_LATENCY_S = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)
_REQUEST_S = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92)
_TTFT_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
_TPOT_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
_TOKENS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576)

_instruments: dict = {}
_instruments_lock = threading.Lock()
_OUTPUT = {"gen_ai.token.type": "output"}

# Acceptance over the last verify steps this process saw (the target service records them).
_ACCEPT_WINDOW = 1000
_accept_window: collections.deque = collections.deque(maxlen=_ACCEPT_WINDOW)


def _init_instruments() -> None:
    with _instruments_lock:
        if _instruments:
            return
        m = metrics.get_meter("specdec")
        i = {}
        # target service: verification
        # Observable: no metric call on a verify's path for these two.
        i["draft_tokens"] = m.create_observable_counter(
            "specdec.draft.tokens", callbacks=[_verify_proposed.observe], unit="{token}",
            description="draft tokens sent to verification")
        i["accepted_tokens"] = m.create_observable_counter(
            "specdec.draft.accepted_tokens", callbacks=[_verify_accepted.observe], unit="{token}",
            description="draft tokens accepted by the target")
        i["verify_latency"] = m.create_histogram(
            "specdec.verify.duration", unit="s", description="target verify: one forward over the draft block + acceptance",
            explicit_bucket_boundaries_advisory=_LATENCY_S)
        m.create_observable_gauge(
            "specdec.draft.acceptance_rate", callbacks=[_observe_acceptance], unit="1",
            description=f"accepted / proposed draft tokens over the last {_ACCEPT_WINDOW} verify steps of this process")
        i["batch_rows"] = m.create_histogram(
            "specdec.target.batch_rows", unit="{session}",
            description="sessions verified or decoded in one batched target forward (--batch-window-ms)",
            explicit_bucket_boundaries_advisory=[1, 2, 3, 4, 6, 8, 12, 16])
        # draft service
        i["draft_latency"] = m.create_histogram(
            "specdec.draft.duration", unit="s", description="draft propose time inside the draft service",
            explicit_bucket_boundaries_advisory=_LATENCY_S)
        i["draft_batch_steps"] = m.create_histogram(
            "specdec.draft.batch_steps", unit="{session}",
            description="sessions' draft steps run in one batched draft forward (draft_service/draft_batcher.py)",
            explicit_bucket_boundaries_advisory=[1, 2, 3, 4, 6, 8, 12, 16])
        # orchestrator
        i["fallback_steps"] = m.create_counter(
            "specdec.fallback.steps", unit="{step}", description="target-only steps taken because the draft failed")
        i["generated_tokens"] = m.create_counter(
            "specdec.generated_tokens", unit="{token}", description="tokens committed to sessions")
        i["active_sessions"] = m.create_up_down_counter(
            "specdec.sessions.active", unit="{session}", description="Generate streams in progress")
        i["token_usage"] = m.create_histogram(
            "gen_ai.client.token.usage", unit="{token}",
            description="input and output tokens per Generate request (gen_ai.token.type)",
            explicit_bucket_boundaries_advisory=_TOKENS)
        i["request_duration"] = m.create_histogram(
            "gen_ai.server.request.duration", unit="s", description="Generate request duration, first byte to last",
            explicit_bucket_boundaries_advisory=_REQUEST_S)
        i["ttft"] = m.create_histogram(
            "gen_ai.server.time_to_first_token", unit="s", description="time to the first generated token",
            explicit_bucket_boundaries_advisory=_TTFT_S)
        i["tpot"] = m.create_histogram(
            "gen_ai.server.time_per_output_token", unit="s",
            description="time per output token after the first, per successful request",
            explicit_bucket_boundaries_advisory=_TPOT_S)
        # every service: RPCs
        i["rpc_server"] = m.create_histogram(
            "rpc.server.call.duration", unit="s", description="gRPC server call duration",
            explicit_bucket_boundaries_advisory=_LATENCY_S)
        i["rpc_client"] = m.create_histogram(
            "rpc.client.call.duration", unit="s", description="gRPC client call duration (includes the network)",
            explicit_bucket_boundaries_advisory=_LATENCY_S)
        _instruments.update(i)


def _instrument(name: str):
    inst = _instruments.get(name)
    if inst is None:
        _init_instruments()
        inst = _instruments[name]
    return inst


def _observe_acceptance(options):
    from opentelemetry.metrics import Observation

    steps = list(_accept_window)
    proposed = sum(p for p, _ in steps)
    if proposed:
        yield Observation(sum(a for _, a in steps) / proposed)


class CollectedCounts:
    """Counts kept in the process and reported only when a metrics reader collects (an observable counter's
    callback), so adding to them on a hot path costs a lock and an add, not a metric call (about 15 us).

    Without ``label`` it holds one total; with it, one count per index, each observed as ``{label: index}``.
    """

    def __init__(self, label: str | None = None):
        self._label = label
        self._counts = [0]
        self._lock = threading.Lock()

    def add(self, n: int) -> None:
        with self._lock:
            self._counts[0] += n

    def add_positions(self, n: int) -> None:
        """One more at each of the indexes ``0 .. n - 1``."""
        with self._lock:
            if len(self._counts) < n:
                self._counts.extend([0] * (n - len(self._counts)))
            for i in range(n):
                self._counts[i] += 1

    def observe(self, options):
        from opentelemetry.metrics import Observation

        with self._lock:
            counts = list(self._counts)
        if self._label is None:
            return [Observation(counts[0])]
        return [Observation(n, {self._label: i}) for i, n in enumerate(counts)]


# Draft tokens proposed and accepted over this process's verify steps, all time.
_verify_proposed = CollectedCounts()
_verify_accepted = CollectedCounts()


def record_verify(proposed: int, accepted: int, ms: float) -> None:
    """One verify step: ``proposed`` draft tokens, the first ``accepted`` of them accepted, in ``ms``."""
    _instrument("verify_latency").record(ms / 1e3)
    _verify_proposed.add(proposed)
    _verify_accepted.add(accepted)
    _accept_window.append((proposed, accepted))


def record_batch(rows: int) -> None:
    """One batched target forward over ``rows`` sessions' jobs."""
    _instrument("batch_rows").record(rows)


def record_draft_batch(steps: int) -> None:
    """One batched draft forward over ``steps`` sessions' steps."""
    _instrument("draft_batch_steps").record(steps)


def record_draft(ms: float) -> None:
    _instrument("draft_latency").record(ms / 1e3)


def record_fallback(steps: int = 1) -> None:
    _instrument("fallback_steps").add(steps)


def record_generated(tokens: int) -> None:
    if tokens:
        _instrument("generated_tokens").add(tokens)


_gen_ai_attrs = {"gen_ai.operation.name": "text_completion", "gen_ai.provider.name": "specdec"}


def set_gen_ai_model(model_name: str) -> None:
    """Tag the gen_ai.* request metrics with gen_ai.request.model (the orchestrator's target model)."""
    _gen_ai_attrs["gen_ai.request.model"] = model_name


class _Gauge:
    def __init__(self, name: str, unit: str, description: str):
        self.callbacks: list = []  # (getter, attributes)
        self.lock = threading.Lock()
        metrics.get_meter("specdec").create_observable_gauge(name, callbacks=[self._observe], unit=unit,
                                                             description=description)

    def _observe(self, options):
        from opentelemetry.metrics import Observation

        with self.lock:
            entries = list(self.callbacks)
        dead = []
        for entry in entries:
            getter, attrs = entry
            fn = getter()
            if fn is None:
                dead.append(entry)
                continue
            try:
                value = fn()
            except Exception:  # noqa: BLE001 - a broken callback must not break the export
                log.debug("gauge callback failed", exc_info=True)
                continue
            if value is None:
                continue
            if isinstance(value, (int, float)):
                yield Observation(value, attrs)
            else:  # iterable of (value, attributes)
                for v, a in value:
                    yield Observation(v, {**(attrs or {}), **(a or {})})
        if dead:
            with self.lock:
                self.callbacks = [e for e in self.callbacks if e not in dead]


_gauges: dict[str, _Gauge] = {}
_gauges_lock = threading.Lock()


def register_gauge(name: str, callback: Callable[[], object], unit: str = "", description: str = "",
                   attributes: dict | None = None) -> Callable[[], None]:
    """Report ``callback()`` as observable gauge ``name`` at every collection; returns an unregister function.

    The callback returns a number, None (no value now) or an iterable of (value, attributes). Several
    callbacks may share a name (e.g. the target's and the draft's KV cache in one process): give each
    distinct ``attributes``. A bound method is held weakly (it goes away with its object)."""
    with _gauges_lock:
        gauge = _gauges.get(name)
        if gauge is None:
            gauge = _gauges[name] = _Gauge(name, unit, description)
    if hasattr(callback, "__self__") and hasattr(callback, "__func__"):
        getter = weakref.WeakMethod(callback)
    else:
        getter = (lambda cb: (lambda: cb))(callback)
    entry = (getter, dict(attributes or {}))
    with gauge.lock:
        gauge.callbacks.append(entry)

    def unregister() -> None:
        with gauge.lock:
            gauge.callbacks = [e for e in gauge.callbacks if e is not entry]

    return unregister


# --------------------------------------------------------------------------------------------
# Spans
# --------------------------------------------------------------------------------------------

_tracer = trace.get_tracer("specdec")  # a proxy until a provider is set; cheap to keep


@contextlib.contextmanager
def span(name: str, **attributes):
    with _tracer.start_as_current_span(name, attributes={k: v for k, v in attributes.items() if v is not None}) as s:
        yield s


_call_attrs: contextvars.ContextVar = contextvars.ContextVar("specdec_call_attributes", default=None)


@contextlib.contextmanager
def call_attributes(**attributes):
    """Attributes for the CLIENT spans of the calls made inside this block (gRPC calls and ``traced`` store
    calls): the orchestrator's step (session_id, k, ...) goes on the call's own span instead of an INTERNAL step
    span wrapping a single call. Not metric attributes (a session id would make unbounded series)."""
    token = _call_attrs.set({k: v for k, v in attributes.items() if v is not None})
    try:
        yield
    finally:
        _call_attrs.reset(token)


def annotate(**attributes):
    """Set attributes on the current span (a service handler's: its RPC's SERVER span) and return it. A handler
    annotates its call's span rather than opening a child span that would only repeat it: every span costs the
    critical path of a speculative step tens of microseconds per process."""
    s = trace.get_current_span()
    s.set_attributes({k: v for k, v in attributes.items() if v is not None})
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


# --------------------------------------------------------------------------------------------
# gRPC tracing: W3C trace context through metadata, a span and a duration per call
# --------------------------------------------------------------------------------------------

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


def server_interceptor():
    """A grpc server interceptor: a SERVER span per call, the child of the caller's traceparent."""
    class ServerInterceptor(grpc.ServerInterceptor):
        def __init__(self):
            self._wrapped: dict = {}  # method -> (its handler, the traced handler): wrapped once, not per call

        def intercept_service(self, continuation, handler_call_details):
            handler = continuation(handler_call_details)
            method = handler_call_details.method
            cached = self._wrapped.get(method)
            if cached is not None and cached[0] is handler:
                return cached[1]
            traced = handler if handler is None or _untraced(method) else self._wrap(method, handler)
            if handler is not None and len(self._wrapped) < 1024:  # registered methods only: a finite set
                self._wrapped[method] = (handler, traced)
            return traced

        def _wrap(self, method, handler):
            attrs = _rpc_attrs(method)
            name = method.lstrip("/")
            observer_factory = STREAM_OBSERVERS.get(method)
            fields = propagate.get_global_textmap().fields

            def start(context):
                carrier = {}
                for md in context.invocation_metadata() or ():
                    carrier[md.key] = md.value
                parent = propagate.extract(carrier, getter=_getter) if not fields.isdisjoint(carrier) else None
                s = _tracer.start_span(name, context=parent, kind=SpanKind.SERVER, attributes=attrs)
                return s, trace.set_span_in_context(s, parent), time.perf_counter()

            def finish(s, t0, context, exc=None, cancelled=False):
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
                _instrument("rpc_server").record(time.perf_counter() - t0, _with_status(attrs, code))
                return code

            def wrap_unary(behavior):
                def wrapper(request, context):
                    s, ctx, t0 = start(context)
                    token = otel_context.attach(ctx)
                    try:
                        result = behavior(request, context)
                    except BaseException as e:
                        otel_context.detach(token)
                        finish(s, t0, context, e)
                        raise
                    otel_context.detach(token)
                    finish(s, t0, context)
                    return result

                return wrapper

            def wrap_stream(behavior):
                def wrapper(request, context):
                    s, ctx, t0 = start(context)
                    observer = observer_factory() if observer_factory else None
                    lock = threading.Lock()
                    state = {"done": False}

                    def end(exc=None, cancelled=False):
                        with lock:
                            if state["done"]:
                                return
                            state["done"] = True
                        code = finish(s, t0, context, exc, cancelled)
                        if observer is not None:
                            observer.on_end(code)

                    # The handler generator runs in its own contextvars.Context, so the span context
                    # (and the handler's own spans) survive across yields, whatever thread resumes it.
                    run_ctx = contextvars.copy_context()
                    run_ctx.run(otel_context.attach, ctx)
                    # A cancelled stream is never resumed: end the span when the RPC terminates.
                    context.add_callback(lambda: end(cancelled=True))
                    it = None
                    try:
                        it = run_ctx.run(lambda: iter(behavior(request, context)))
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
                    end()

                return wrapper

            def wrap_stream_unary(behavior):
                return wrap_unary(behavior)

            if handler.request_streaming and handler.response_streaming:
                return grpc.stream_stream_rpc_method_handler(
                    wrap_stream(handler.stream_stream), handler.request_deserializer, handler.response_serializer)
            if handler.request_streaming:
                return grpc.stream_unary_rpc_method_handler(
                    wrap_stream_unary(handler.stream_unary), handler.request_deserializer, handler.response_serializer)
            if handler.response_streaming:
                return grpc.unary_stream_rpc_method_handler(
                    wrap_stream(handler.unary_stream), handler.request_deserializer, handler.response_serializer)
            return grpc.unary_unary_rpc_method_handler(
                wrap_unary(handler.unary_unary), handler.request_deserializer, handler.response_serializer)

    return ServerInterceptor()


# --------------------------------------------------------------------------------------------
# Process lifecycle
# --------------------------------------------------------------------------------------------


def ready(address: str) -> None:
    """Tell a parent launcher (specdec up, tests) that the service listens, on stdout."""
    print(f"SPECDEC_READY {address}", flush=True)


def wait_for_signal(server, grace: float = 2.0) -> None:
    """Block until SIGTERM/SIGINT, then stop the server gracefully."""
    stop = threading.Event()

    def _handler(signum, frame):
        stop.set()

    signal.signal(signal.SIGTERM, _handler)
    signal.signal(signal.SIGINT, _handler)
    while not stop.is_set():
        stop.wait(0.5)
    logging.getLogger("specdec").info("shutting down")
    server.stop(grace)
    if _tracer_provider is not None:
        with contextlib.suppress(Exception):
            _tracer_provider.force_flush(2000)
    if _meter_provider is not None:
        with contextlib.suppress(Exception):
            _meter_provider.force_flush(2000)
    time.sleep(0.05)
