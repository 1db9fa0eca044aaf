"""Structured logs: one JSON object per line on stderr, carrying the service name and the current trace."""

from __future__ import annotations

import json
import logging
import os
import sys

from opentelemetry import trace

from specdec.observability.tracing import session_hash

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
        if isinstance(out.get("session_id"), str) and out["session_id"]:
            # A session id is a bearer capability (whoever has it may resume the session): logs carry the hash
            # spans carry, so a log line and the session's traces are found by the same session_hash(id).
            out["session_id"] = session_hash(out["session_id"])
        span_ctx = trace.get_current_span().get_span_context()
        if span_ctx.is_valid:
            out["trace_id"] = format(span_ctx.trace_id, "032x")
            out["span_id"] = format(span_ctx.span_id, "016x")
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def service_name() -> str:
    """The name this process's logs (and, failing OTEL_SERVICE_NAME, its traces and metrics) carry."""
    return _SERVICE


def configure(service_name: str, level: str | None = None, configure_logging: bool = True) -> None:
    """Name the service; with configure_logging, JSON logs on stderr at level (or SPECDEC_LOG_LEVEL, INFO)."""
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
