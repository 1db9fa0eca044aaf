"""Metric instruments (gen_ai and rpc semantic conventions where they exist, ``specdec.*`` otherwise;
docs/observability.md lists them): created on first use, recorded by the services."""

from __future__ import annotations

import collections
import logging
import threading
import weakref
from typing import Callable

from opentelemetry import metrics

log = logging.getLogger("specdec.observability")


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
