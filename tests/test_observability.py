"""Traces across the three services, metrics (in-process and Prometheus), `specdec stats`, the outline."""

from __future__ import annotations

import gc
import json
import time
import urllib.request

import pytest
from google.protobuf.json_format import MessageToDict
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from orchestrator.api.outline import build_outline
from specdec.ops import stats_cli
from specdec import observability as telemetry
from specdec.v1 import orchestrator_pb2 as opb
from tests import harness

pytestmark = pytest.mark.serial  # timing-sensitive: runs after the parallel part, alone (scripts/test.sh)

PROMPT = [3, 14, 15, 9, 26, 5, 35, 8, 9, 7, 9, 3, 2, 3, 8, 4]
GEN_SERVER = "specdec.v1.Orchestrator/Generate"


@pytest.fixture(scope="module")
def spans():
    """An in-memory span exporter on the process's (global) SDK tracer provider."""
    telemetry.ensure_providers("specdec-test")
    exporter = InMemorySpanExporter()
    telemetry.add_span_processor(SimpleSpanProcessor(exporter))
    yield exporter
    exporter.shutdown()  # stops collecting; the processor cannot be removed from the provider


@pytest.fixture(scope="module")
def stack(redis_url, spans):
    # The draft is the target model itself: every draft token is accepted, so acceptance is measurable.
    s = harness.start_stack(redis_url, draft=harness.DRAFT_SAME)
    yield s
    s.stop()


def _generate(stack, n: int = 10, **kw):
    return stack.client.generate(PROMPT, max_new_tokens=n, ignore_eos=True, **kw)


def _wait_for_trace(exporter, timeout: float = 5.0):
    """Finished spans once the client's and the server's Generate spans have ended and every span's parent has
    too (the cache releases run after the stream ends, so their client spans may finish a moment later)."""
    deadline = time.monotonic() + timeout
    while True:
        got = exporter.get_finished_spans()
        kinds = {s.kind for s in got if s.name == GEN_SERVER}
        ids = {s.context.span_id for s in got}
        settled = all(s.parent is None or s.parent.span_id in ids for s in got)
        if ({SpanKind.CLIENT, SpanKind.SERVER} <= kinds and settled) or time.monotonic() > deadline:
            return list(got)
        time.sleep(0.02)


def _ancestors(span, by_id):
    out = []
    while span.parent is not None and span.parent.span_id in by_id:
        span = by_id[span.parent.span_id]
        out.append(span)
    return out


def test_one_generate_is_one_connected_trace(stack, spans):
    spans.clear()
    result = _generate(stack, speculation=True)
    assert len(result.token_ids) == 10
    got = _wait_for_trace(spans)

    assert len({s.context.trace_id for s in got}) == 1, sorted({s.name for s in got})
    by_id = {s.context.span_id: s for s in got}
    roots = [s for s in got if s.parent is None]
    assert [(r.name, r.kind) for r in roots] == [(GEN_SERVER, SpanKind.CLIENT)]
    orphans = [s.name for s in got if s.parent is not None and s.parent.span_id not in by_id]
    assert not orphans, f"spans whose parent is not in the trace: {orphans}"

    def server_spans(name):
        return [s for s in got if s.name == name and s.kind == SpanKind.SERVER]

    (gen_server,) = server_spans(GEN_SERVER)
    assert by_id[gen_server.parent.span_id] is roots[0]
    # Server spans of the draft and the target are children of the orchestrator's client spans, which carry the
    # step's attributes (session, draft length), under its Generate server span.
    sid = result.session_id
    for rpc in ("specdec.v1.DraftService/Propose", "specdec.v1.TargetService/Verify"):
        servers = server_spans(rpc)
        assert servers, f"no {rpc} server span"
        for srv in servers:
            client = by_id[srv.parent.span_id]
            assert (client.name, client.kind) == (rpc, SpanKind.CLIENT)
            # spans carry the session id's hash, not the id (a capability to resume the session)
            assert client.attributes["session_id"] == telemetry.session_hash(sid) and client.attributes["k"] >= 1, \
                dict(client.attributes)
            assert srv.context.trace_id == client.context.trace_id
            chain = [a.name for a in _ancestors(client, by_id)]
            assert chain[0] == "orchestrator.generate" and GEN_SERVER in chain, chain
            assert srv.attributes["rpc.grpc.status_code"] == 0 and srv.status.status_code != StatusCode.ERROR
    # The handlers annotate their call's SERVER span (no child span repeating it).
    for rpc, attr in (("specdec.v1.DraftService/Propose", "draft_tokens"),
                      ("specdec.v1.TargetService/Verify", "draft_tokens")):
        for srv in server_spans(rpc):
            assert srv.attributes["session_id"] and attr in srv.attributes, dict(srv.attributes)
    assert not [s.name for s in got if s.name in ("draft.propose", "target.verify")]
    # The session store's Redis calls are in the same trace, under the Generate server span.
    redis = [s for s in got if s.attributes.get("db.system.name") == "redis"]
    assert redis, f"no Redis spans in {sorted({s.name for s in got})}"
    assert all(gen_server in _ancestors(s, by_id) for s in redis)
    assert all(s.kind == SpanKind.CLIENT for s in redis)


def test_degraded_decode_is_traced_and_counted(redis_url, spans):
    s = harness.start_stack(redis_url, draft="ngram")
    try:
        # A draft that answers its health checks but fails every Propose (a stopped one fails a health check, which
        # opens its breaker, and may never be called).
        def broken(*args, **kwargs):
            raise RuntimeError("draft broke")

        s.draft_server.servicer.proposer.get_candidates = broken
        before = telemetry.snapshot()
        spans.clear()
        result = _generate(s, n=6, speculation=True)
        assert len(result.token_ids) == 6 and result.stats["fallback_steps"] >= 1
        got = _wait_for_trace(spans)
        assert len({x.context.trace_id for x in got}) == 1
        degraded = [x for x in got if x.name == "specdec.v1.TargetService/Decode" and x.kind == SpanKind.CLIENT
                    and x.attributes.get("degraded")]
        assert degraded, sorted({x.name for x in got})
        failed = [x for x in got if x.name == "specdec.v1.DraftService/Propose" and x.kind == SpanKind.CLIENT]
        assert failed and all(x.status.status_code == StatusCode.ERROR for x in failed)
        after = telemetry.snapshot()
        assert (telemetry.metric_value(after, "specdec.fallback.steps")
                - telemetry.metric_value(before, "specdec.fallback.steps")) >= 1

        # The outline does not hang on the dead draft, says so, and caches the answer.
        s.draft_server.stop(0)
        t0 = time.monotonic()
        outline = build_outline(s.servicer)
        assert time.monotonic() - t0 < 3
        assert outline["draftStrategy"]["status"].startswith("unreachable")
        assert outline["models"]["draft"]["status"].startswith("unreachable")
        t0 = time.monotonic()
        build_outline(s.servicer)
        assert time.monotonic() - t0 < 0.3
    finally:
        s.stop()


def test_metrics_snapshot_has_acceptance_and_latency(stack):
    before = telemetry.snapshot()
    result = _generate(stack, n=12, speculation=True)
    time.sleep(0.2)  # the server-side request metrics are recorded as the stream ends
    after = telemetry.snapshot()

    def delta(name, **attrs):
        return telemetry.metric_value(after, name, **attrs) - telemetry.metric_value(before, name, **attrs)

    assert delta("specdec.draft.accepted_tokens") == result.stats["draft_tokens_accepted"] > 0
    assert delta("specdec.draft.tokens") == result.stats["draft_tokens_proposed"]
    assert delta("specdec.verify.duration") == result.stats["verify_steps"] > 0  # histogram count
    assert after["specdec.verify.duration"]["unit"] == "s" and after["specdec.verify.duration"]["sum"] > 0
    assert delta("specdec.draft.duration") >= result.stats["verify_steps"]
    assert delta("specdec.generated_tokens") == 12
    assert delta("gen_ai.client.token.usage", **{"gen_ai.token.type": "output"}) == 1
    out = [p for p in after["gen_ai.client.token.usage"]["points"]
           if p["attributes"].get("gen_ai.token.type") == "output"]
    assert sum(p["sum"] for p in out) >= 12
    assert delta("gen_ai.server.request.duration") == 1
    assert delta("gen_ai.server.time_to_first_token") == 1
    assert delta("gen_ai.server.time_per_output_token") == 1
    assert delta("rpc.server.call.duration", **{"rpc.method": "Verify", "rpc.grpc.status_code": "OK"}) > 0
    assert delta("rpc.client.call.duration", **{"rpc.method": "Propose", "rpc.grpc.status_code": "OK"}) > 0
    assert delta("specdec.draft.accepted_by_position") == result.stats["draft_tokens_accepted"]
    assert telemetry.metric_value(after, "specdec.sessions.active") == telemetry.metric_value(before, "specdec.sessions.active")
    assert 0 < after["specdec.draft.acceptance_rate"]["value"] <= 1


def test_register_gauge():
    class Cache:
        def nbytes(self):
            return 4096

    cache = Cache()
    unregister = telemetry.register_gauge("specdec.test.gauge", lambda: 7, "By", "test", {"c": "fn"})
    telemetry.register_gauge("specdec.test.gauge", cache.nbytes, "By", "test", {"c": "method"})
    telemetry.register_gauge("specdec.test.gauge", lambda: [(1, {"k": "a"}), (2, {"k": "b"})], attributes={"c": "many"})
    telemetry.register_gauge("specdec.test.gauge", lambda: 1 / 0, attributes={"c": "broken"})
    snap = telemetry.snapshot()
    assert telemetry.metric_value(snap, "specdec.test.gauge", c="fn") == 7
    assert telemetry.metric_value(snap, "specdec.test.gauge", c="method") == 4096
    assert telemetry.metric_value(snap, "specdec.test.gauge", c="many", k="b") == 2
    unregister()
    del cache
    gc.collect()
    snap = telemetry.snapshot()
    assert telemetry.metric_value(snap, "specdec.test.gauge", c="fn") == 0
    assert telemetry.metric_value(snap, "specdec.test.gauge", c="method") == 0  # held weakly: gone with its object


def test_prometheus_endpoint_and_stats_command(stack, capsys):
    _generate(stack, n=8, speculation=True)
    time.sleep(0.2)
    port = telemetry.start_metrics_server(0, "127.0.0.1")
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        for name in ("specdec_draft_accepted_tokens_total", "specdec_draft_tokens_total",
                     "specdec_verify_duration_seconds_bucket", "specdec_draft_duration_seconds_count",
                     "specdec_generated_tokens_total", "specdec_sessions_active", "specdec_draft_acceptance_rate",
                     "specdec_draft_accepted_by_position_total", "gen_ai_client_token_usage_bucket",
                     "gen_ai_server_request_duration_seconds_count", "gen_ai_server_time_per_output_token_seconds_sum",
                     "rpc_server_call_duration_seconds_count", "rpc_client_call_duration_seconds_count"):
            assert name in text, name

        # One live endpoint and one dead one: the summary comes from the live one, exit status 0.
        assert stats_cli.main([f"127.0.0.1:{port}", "127.0.0.1:1", "--json", "--timeout", "1"]) == 0
        summary = json.loads(capsys.readouterr().out)
        assert [e["ok"] for e in summary["endpoints"]] == [True, False]
        assert "specdec-test" in summary["endpoints"][0]["services"]
        assert 0 < summary["acceptance"]["rate"] <= 1 and summary["acceptance"]["verifySteps"] > 0
        assert summary["verifyLatencyMs"]["count"] > 0 and summary["verifyLatencyMs"]["p50"] is not None
        assert summary["draftLatencyMs"]["count"] > 0
        assert summary["acceptanceByPosition"][0]["position"] == 1 and summary["acceptanceByPosition"][0]["rate"] > 0
        assert summary["requests"]["count"] >= 1 and summary["requests"]["outputTokens"] >= 8
        assert summary["generatedTokens"] >= 8 and "Verify" in summary["roundTripMs"]

        assert stats_cli.main([f"127.0.0.1:{port}"]) == 0
        out = capsys.readouterr().out
        assert "acceptance rate" in out and "verify latency" in out and "by position" in out
    finally:
        telemetry.stop_metrics_server()
    assert stats_cli.main(["127.0.0.1:1", "--timeout", "0.5"]) == 1


REQUIRED = ("draftStrategy", "verification", "acceptanceRate", "failureMode", "tradeOff", "components", "models")


def _check_outline(outline: dict) -> None:
    for key in REQUIRED:
        assert outline.get(key), key
    ds = outline["draftStrategy"]
    assert ds["kind"] == "model" and ds["structure"] in ("chain", "tree") and ds["drafter"]
    assert ds["draftLength"]["policy"] and ds["draftLength"]["default"] == 4
    assert ds["status"] == "reachable"
    v = outline["verification"]
    assert "greedy" in v["scheme"] and "rejection" in v["scheme"] and "target service" in v["runsOn"]
    assert "logits never leave" in v["network"]
    acc = outline["acceptanceRate"]
    assert acc["value"] == 1.0 and acc["windowSteps"] == 1000 and acc["stepsObserved"] > 0
    assert outline["failureMode"]["draftFailure"] and outline["tradeOff"]["summary"]
    assert outline["tradeOff"]["measured"]["tokensPerVerifyStep"] > 1
    assert outline["models"]["target"]["name"] == harness.TARGET
    assert outline["models"]["draft"]["name"] == harness.DRAFT_SAME
    assert outline["components"]["sessionStore"]["kind"] == "redis"


def test_build_outline_after_generation(stack):
    _generate(stack, n=8, speculation=True)
    outline = build_outline(stack.servicer)
    _check_outline(outline)
    json.dumps(outline)  # plain JSON values only (it goes into a protobuf Struct)


def test_the_outlines_speedup_estimate_costs_a_drafted_token_not_a_whole_draft_call():
    """10 verify steps of 4 drafted tokens, all accepted; a Propose round trip of 8 ms (2 ms a token) against a
    20 ms Verify: with the Verify as the target step, c = 0.1 and (1 - a^5) / ((1 - a)(4c + 1)) = 5 / 1.4.
    Costing the whole call as one drafted token (c = 0.4, as the outline once did) would estimate 5 / 2.6. With a
    profiled 10 ms target step, c = 0.2 and the Verify costs 2 steps: 5 / 2.8."""
    from orchestrator.api.outline import estimate_speedup

    acceptance = {"value": 1.0, "stepsObserved": 10, "draftTokensProposed": 40}
    measured = {"draftRoundTripMs": 8.0, "verifyRoundTripMs": 20.0}
    est = estimate_speedup(acceptance, measured)
    assert est["estimate"]["draftLength"] == 4 and est["estimate"]["draftCostRatio"] == 0.1
    assert est["estimatedSpeedup"] == round(5 / 1.4, 3)
    half = estimate_speedup({**acceptance, "value": 0.5}, measured)
    assert half["estimatedSpeedup"] == round((1 - 0.5 ** 5) / 0.5 / 1.4, 3)
    profiled = estimate_speedup(acceptance, measured, target_step_ms=10.0)
    assert profiled["estimate"]["verifyCostRatio"] == 2.0 and profiled["estimatedSpeedup"] == round(5 / 2.8, 3)
    assert estimate_speedup({**acceptance, "stepsObserved": 0}, measured) == {}


def test_get_outline_rpc_and_command(stack, capsys):
    _generate(stack, n=6, speculation=True)
    reply = stack.client.stub.GetOutline(opb.GetOutlineRequest(), timeout=10, metadata=stack.client.metadata)
    _check_outline(MessageToDict(reply.outline))

    assert stats_cli.outline_main(["--address", stack.client.address, "--json"]) == 0
    outline = json.loads(capsys.readouterr().out)
    _check_outline(outline)
    assert isinstance(outline["acceptanceRate"]["windowSteps"], int)

    assert stats_cli.outline_main(["--address", stack.client.address]) == 0
    text = capsys.readouterr().out
    assert "draftStrategy:" in text and "acceptanceRate:" in text


def test_spans_are_built_only_where_they_are_exported():
    """A process without a span processor drops spans at the sampler (they cost the speculative step's round
    trips for nothing) but still propagates the trace; once one is added, every span is recorded, even under a
    caller that did not record its own."""
    import subprocess
    import sys

    code = """
from opentelemetry import propagate
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from specdec import observability as telemetry
telemetry.ensure_providers("t")
with telemetry.span("unexported") as s:
    carrier = {}
    propagate.inject(carrier)
    print(s.is_recording(), s.get_span_context().is_valid, carrier["traceparent"].split("-")[1])
exporter = InMemorySpanExporter()
telemetry.add_span_processor(SimpleSpanProcessor(exporter))
parent = propagate.extract(carrier)
with telemetry.tracer_provider().get_tracer("t").start_as_current_span("child", context=parent) as s:
    print(s.is_recording())
print([(x.name, format(x.context.trace_id, "032x")) for x in exporter.get_finished_spans()])
"""
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("OTEL_")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    first, second, spans = out.stdout.strip().splitlines()
    recording, valid, trace_id = first.split()
    assert (recording, valid) == ("False", "True")  # not built, yet a real trace context to pass on
    assert second == "True"
    assert spans == str([("child", trace_id)])  # the exporting side joins the caller's trace


def test_logs_carry_the_session_hash_and_the_client_keeps_the_id():
    """A session id is a bearer capability: a structured log line carries session_hash(id), as spans do, never the
    id; the client's own output (GenerationResult.to_json, what `specdec generate --json` prints) keeps the id."""
    import logging

    from specdec.client import GenerationResult
    from specdec.observability.logs import JsonFormatter

    sid = "0123456789abcdef-raw-session-id"
    record = logging.LogRecord("specdec.orchestrator", logging.WARNING, __file__, 1, "draft failover", (), None)
    record.session_id = sid
    record.replica = "127.0.0.1:1"
    line = JsonFormatter().format(record)
    assert sid not in line
    assert json.loads(line)["session_id"] == telemetry.session_hash(sid)
    assert json.loads(line)["replica"] == "127.0.0.1:1"
    assert GenerationResult(session_id=sid, text="", token_ids=[], finish_reason="length", stats={}).to_json()[
        "session_id"] == sid
