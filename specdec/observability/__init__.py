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

Submodules: ``logs`` (JSON logs), ``providers`` (SDK providers, :func:`setup`, snapshot, /metrics),
``metrics`` (instruments), ``tracing`` (spans, gRPC client and server tracing) and ``signals`` (readiness,
graceful stop); their public names are re-exported here.
"""

from __future__ import annotations

from specdec.observability.logs import JsonFormatter
from specdec.observability.metrics import (CollectedCounts, record_batch, record_draft, record_draft_batch,
                                           record_fallback, record_generated, record_verify, register_gauge,
                                           set_gen_ai_model)
from specdec.observability.providers import (add_metrics_argument, add_span_processor, ensure_providers, force_flush,
                                             metric_value, metrics_host, metrics_port, prometheus_registry, providers_installed, setup, snapshot,
                                             start_metrics_server, stop_metrics_server, tracer_provider)
from specdec.observability.signals import ready, wait_for_signal
from specdec.observability.tracing import (REDIS, STREAM_OBSERVERS, TracedChannel, annotate, call_attributes,
                                           intercept_channel, server_interceptor, session_hash, span, traced)

__all__ = [
    "CollectedCounts", "JsonFormatter", "REDIS", "STREAM_OBSERVERS", "TracedChannel", "add_metrics_argument",
    "add_span_processor", "annotate", "call_attributes", "ensure_providers", "force_flush", "intercept_channel",
    "metric_value", "metrics_host", "metrics_port", "prometheus_registry", "providers_installed", "ready", "record_batch", "record_draft",
    "record_draft_batch", "record_fallback", "record_generated", "record_verify", "register_gauge",
    "server_interceptor", "session_hash", "set_gen_ai_model", "setup", "snapshot", "span", "start_metrics_server",
    "stop_metrics_server", "tracer_provider", "traced", "wait_for_signal",
]
