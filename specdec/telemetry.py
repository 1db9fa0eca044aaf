"""Structured logs, OpenTelemetry traces and metrics, and process lifecycle helpers for every service."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
import threading
import time

from opentelemetry import metrics, trace

_SERVICE = "specdec"
_STD_ATTRS = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime"}


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
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def setup(service_name: str, level: str | None = None) -> None:
    """JSON logs on stderr; OTLP export of traces and metrics when OTEL_EXPORTER_OTLP_ENDPOINT is set."""
    global _SERVICE
    _SERVICE = service_name
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level or os.environ.get("SPECDEC_LOG_LEVEL", "INFO"))
    for noisy in ("httpx", "urllib3", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)

    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider

    resource = Resource.create({"service.name": service_name})
    tracer_provider = TracerProvider(resource=resource)
    readers = []
    if os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        tracer_provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        readers.append(PeriodicExportingMetricReader(OTLPMetricExporter()))
    trace.set_tracer_provider(tracer_provider)
    metrics.set_meter_provider(MeterProvider(resource=resource, metric_readers=readers))
    _init_instruments()


_instruments: dict = {}


def _init_instruments() -> None:
    meter = metrics.get_meter("specdec")
    _instruments["draft_tokens"] = meter.create_counter("specdec.draft.tokens", unit="{token}", description="draft tokens proposed")
    _instruments["accepted_tokens"] = meter.create_counter("specdec.draft.accepted_tokens", unit="{token}", description="draft tokens accepted")
    _instruments["verify_latency"] = meter.create_histogram("specdec.verify.duration", unit="ms", description="target verify forward + sampling")
    _instruments["draft_latency"] = meter.create_histogram("specdec.draft.duration", unit="ms", description="draft propose time")
    _instruments["fallback_steps"] = meter.create_counter("specdec.fallback.steps", unit="{step}", description="target-only steps taken because the draft failed")
    _instruments["generated_tokens"] = meter.create_counter("gen_ai.client.token.usage", unit="{token}", description="tokens generated")


def _instrument(name: str):
    if not _instruments:
        _init_instruments()
    return _instruments[name]


def record_verify(proposed: int, accepted: int, ms: float) -> None:
    _instrument("draft_tokens").add(proposed)
    _instrument("accepted_tokens").add(accepted)
    _instrument("verify_latency").record(ms)


def record_draft(ms: float) -> None:
    _instrument("draft_latency").record(ms)


def record_fallback(steps: int = 1) -> None:
    _instrument("fallback_steps").add(steps)


def record_generated(tokens: int) -> None:
    _instrument("generated_tokens").add(tokens, {"gen_ai.token.type": "output"})


@contextlib.contextmanager
def span(name: str, **attributes):
    tracer = trace.get_tracer("specdec")
    with tracer.start_as_current_span(name, attributes={k: v for k, v in attributes.items() if v is not None}) as s:
        yield s


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
    time.sleep(0.05)
