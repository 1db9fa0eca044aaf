"""The process's OpenTelemetry SDK providers (traces, metrics), the in-process metric snapshot and the
Prometheus /metrics endpoint; :func:`setup` configures all of it for a service."""

from __future__ import annotations

import contextlib
import logging
import os
import threading

from opentelemetry import metrics, trace

from specdec.observability.logs import configure as configure_logs, service_name as default_service_name

log = logging.getLogger("specdec.observability")


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
    (``PORT`` or ``HOST:PORT``; host defaults to SPECDEC_METRICS_HOST or 127.0.0.1)."""
    configure_logs(service_name, level, configure_logging)
    ensure_providers(service_name)
    if metrics_port is None:
        metrics_port = os.environ.get("SPECDEC_METRICS_PORT") or None
    if metrics_port not in (None, ""):
        start_metrics_server(metrics_port)


def otlp_credentials(signal: str):
    """TLS for an https:// OTLP endpoint with the service's own identity, as its gRPC: the collector verified with
    SPECDEC_TLS_CA, SPECDEC_TLS_CERT/KEY presented (mutual TLS). None (the exporter's own defaults and
    OTEL_EXPORTER_OTLP_* variables) for a plaintext endpoint, without SPECDEC_TLS_CA, or with
    OTEL_EXPORTER_OTLP_CERTIFICATE set."""
    endpoint = os.environ.get(f"OTEL_EXPORTER_OTLP_{signal}_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "")
    ca = os.environ.get("SPECDEC_TLS_CA")
    if not endpoint.startswith("https://") or not ca or os.environ.get("OTEL_EXPORTER_OTLP_CERTIFICATE"):
        return None
    import grpc

    def read(path):
        if not path:
            return None
        with open(path, "rb") as f:
            return f.read()

    return grpc.ssl_channel_credentials(read(ca), read(os.environ.get("SPECDEC_TLS_KEY")),
                                        read(os.environ.get("SPECDEC_TLS_CERT")))


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
        name = os.environ.get("OTEL_SERVICE_NAME") or service_name or default_service_name()
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

                _tracer_provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(
                    credentials=otlp_credentials("TRACES"))))
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

            readers.append(PeriodicExportingMetricReader(OTLPMetricExporter(credentials=otlp_credentials("METRICS"))))
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


def metrics_host() -> str:
    """Where /metrics listens unless told: loopback, since the endpoint has no authentication."""
    return os.environ.get("SPECDEC_METRICS_HOST", "127.0.0.1")


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
        host = host or metrics_host()
        from prometheus_client import start_http_server

        try:
            httpd, thread = start_http_server(int(spec), addr=host, registry=_prom_registry)
        except OSError as e:
            from specdec.core.startup import listen_error

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


def force_flush(timeout_ms: int = 2000) -> None:
    """Export what the SDK providers still buffer (before the process exits); errors are not the caller's."""
    for provider in (_tracer_provider, _meter_provider):
        if provider is not None:
            with contextlib.suppress(Exception):
                provider.force_flush(timeout_ms)
