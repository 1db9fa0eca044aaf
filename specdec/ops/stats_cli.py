"""`specdec stats` (a readable summary of the services' Prometheus endpoints) and `specdec outline`.

    specdec stats                               # 127.0.0.1:9464,9465,9466 (or $SPECDEC_METRICS_ENDPOINTS)
    specdec stats 10.0.0.5:9464 http://target:9465/metrics --json
    specdec outline [--address 127.0.0.1:50050] [--json]

`stats` needs no collector: every service started with --metrics-port (or SPECDEC_METRICS_PORT) serves
Prometheus text at /metrics; counters and histograms from several endpoints are added together.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import urllib.error
import urllib.request
from collections import defaultdict

DEFAULT_ENDPOINTS = "127.0.0.1:9464,127.0.0.1:9465,127.0.0.1:9466"


# --------------------------------------------------------------------------------------------
# Scraping and merging
# --------------------------------------------------------------------------------------------


def endpoint_url(spec: str) -> str:
    spec = spec.strip()
    if spec.startswith(":"):
        spec = "127.0.0.1" + spec
    if spec.isdigit():
        spec = f"127.0.0.1:{spec}"
    if "://" not in spec:
        spec = "http://" + spec
    scheme, rest = spec.split("://", 1)
    if "/" not in rest:
        spec = f"{scheme}://{rest}/metrics"
    return spec


def scrape(url: str, timeout: float = 2.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:  # noqa: S310 - an operator-given metrics URL
        return r.read().decode("utf-8", "replace")


_DROP_LABELS = {"otel_scope_name", "otel_scope_version", "otel_scope_schema_url", "le"}


class Merged:
    """Samples from several endpoints, summed per (sample name, labels without scope/le)."""

    def __init__(self):
        self.values: dict[tuple[str, tuple], float] = defaultdict(float)
        self.buckets: dict[tuple[str, tuple], dict[float, float]] = defaultdict(lambda: defaultdict(float))

    def add_text(self, text: str) -> list[dict]:
        """Add one endpoint's exposition; returns its target_info label sets (service names)."""
        from prometheus_client.parser import text_string_to_metric_families

        infos = []
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == "target_info":
                    infos.append(dict(s.labels))
                    continue
                labels = tuple(sorted((k, v) for k, v in s.labels.items() if k not in _DROP_LABELS))
                if s.name.endswith("_bucket") and "le" in s.labels:
                    le = float(s.labels["le"])
                    self.buckets[(s.name[: -len("_bucket")], labels)][le] += s.value
                else:
                    self.values[(s.name, labels)] += s.value
        return infos

    def total(self, name: str, **match) -> float | None:
        found, total = False, 0.0
        for (n, labels), v in self.values.items():
            if n == name and _matches(labels, match):
                found, total = True, total + v
        return total if found else None

    def by_label(self, name: str, label: str, **match) -> dict[str, float]:
        out: dict[str, float] = defaultdict(float)
        for (n, labels), v in self.values.items():
            if n == name and _matches(labels, match):
                out[dict(labels).get(label, "")] += v
        return dict(out)

    def histogram(self, base: str, **match) -> dict | None:
        """count, sum, mean, p50, p95, p99 of a histogram (all label sets matching ``match`` merged)."""
        count = self.total(base + "_count", **match)
        if not count:
            return None
        total = self.total(base + "_sum", **match) or 0.0
        merged: dict[float, float] = defaultdict(float)
        for (n, labels), b in self.buckets.items():
            if n == base and _matches(labels, match):
                for le, c in b.items():
                    merged[le] += c
        bounds = sorted(merged.items())
        out = {"count": int(count), "sum": total, "mean": total / count}
        for q in (0.5, 0.95, 0.99):
            out[f"p{int(q * 100)}"] = _quantile(q, bounds)
        return out


def _matches(labels: tuple, match: dict) -> bool:
    d = dict(labels)
    return all(d.get(k) == v for k, v in match.items())


def _quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """Prometheus histogram_quantile over cumulative (le, count) buckets, linear within a bucket."""
    if not buckets:
        return None
    total = buckets[-1][1]
    if total <= 0:
        return None
    rank = q * total
    prev_le, prev_c = 0.0, 0.0
    for le, c in buckets:
        if c >= rank:
            if math.isinf(le):
                return prev_le  # past the last finite bound: its value is the best we know
            if c == prev_c:
                return le
            return prev_le + (le - prev_le) * (rank - prev_c) / (c - prev_c)
        prev_le, prev_c = le, c
    return prev_le


# --------------------------------------------------------------------------------------------
# The summary
# --------------------------------------------------------------------------------------------


def _ms(h: dict | None) -> dict | None:
    if h is None:
        return None
    return {"count": h["count"], **{k: (None if h[k] is None else round(h[k] * 1e3, 3))
                                    for k in ("mean", "p50", "p95", "p99")}}


def _s(h: dict | None) -> dict | None:
    if h is None:
        return None
    return {"count": h["count"], **{k: (None if h[k] is None else round(h[k], 4)) for k in ("mean", "p50", "p95", "p99")}}


def summarize(m: Merged) -> dict:
    proposed = m.total("specdec_draft_tokens_total")
    accepted = m.total("specdec_draft_accepted_tokens_total")
    verify = m.histogram("specdec_verify_duration_seconds")
    steps = verify["count"] if verify else None
    acceptance = {
        "rate": round(accepted / proposed, 4) if proposed else None,
        "draftTokensProposed": int(proposed or 0),
        "draftTokensAccepted": int(accepted or 0),
        "verifySteps": int(steps or 0),
        "meanAcceptedLength": round(((accepted or 0) + steps) / steps, 4) if steps else None,
    }
    pos_p = m.by_label("specdec_draft_proposed_by_position_total", "position")
    pos_a = m.by_label("specdec_draft_accepted_by_position_total", "position")
    by_position = []
    for pos in sorted(pos_p, key=lambda p: int(p) if p.isdigit() else 0):
        p = pos_p[pos]
        a = pos_a.get(pos, 0.0)
        by_position.append({"position": int(pos) + 1 if pos.isdigit() else pos, "proposed": int(p),
                            "accepted": int(a), "rate": round(a / p, 4) if p else None})
    rtt = {}
    for method in ("Propose", "Verify", "Decode"):
        h = _ms(m.histogram("rpc_client_call_duration_seconds", rpc_method=method, rpc_grpc_status_code="OK"))
        if h:
            rtt[method] = h
    usage = m.by_label("gen_ai_client_token_usage_sum", "gen_ai_token_type")
    requests = m.histogram("gen_ai_server_request_duration_seconds")
    errors = m.by_label("gen_ai_server_request_duration_seconds_count", "error_type")
    errors.pop("", None)
    kv_bytes = m.by_label("specdec_kv_cache_size_bytes", "specdec_component")
    kv_sessions = m.by_label("specdec_kv_cache_sessions", "specdec_component")
    return {
        "requests": {
            "count": requests["count"] if requests else 0,
            "errors": {k: int(v) for k, v in errors.items()},
            "durationS": _s(requests),
            "timeToFirstTokenS": _s(m.histogram("gen_ai_server_time_to_first_token_seconds")),
            "timePerOutputTokenMs": _ms(m.histogram("gen_ai_server_time_per_output_token_seconds")),
            "inputTokens": int(usage.get("input", 0)),
            "outputTokens": int(usage.get("output", 0)),
        },
        "generatedTokens": int(m.total("specdec_generated_tokens_total") or 0),
        "activeSessions": int(m.total("specdec_sessions_active") or 0),
        "acceptance": acceptance,
        "acceptanceByPosition": by_position,
        "draftLatencyMs": _ms(m.histogram("specdec_draft_duration_seconds")),
        "verifyLatencyMs": _ms(verify),
        "roundTripMs": rtt,
        "fallbackSteps": int(m.total("specdec_fallback_steps_total") or 0),
        "draftFailures": {k: int(v) for k, v in m.by_label("specdec_draft_failures_total", "kind").items()},
        "replicaFailovers": int(m.total("specdec_draft_replica_failovers_total") or 0),
        "kvCache": {c or "unlabelled": {"bytes": int(b), "sessions": int(kv_sessions.get(c, 0))}
                    for c, b in kv_bytes.items()},
    }


def _fmt_lat(h: dict | None, unit: str) -> str:
    if not h:
        return "-"
    parts = [f"{k} {h[k]:.3g} {unit}" for k in ("mean", "p50", "p95") if h.get(k) is not None]
    return ", ".join(parts) + f"  (n={h['count']})"


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 1024:.1f} KiB"


def render(summary: dict, endpoints: list[dict]) -> str:
    lines = []
    ok = [e for e in endpoints if e["ok"]]
    lines.append(f"specdec stats: {len(ok)}/{len(endpoints)} endpoints")
    for e in endpoints:
        what = ", ".join(e.get("services") or []) or ("-" if e["ok"] else "")
        lines.append(f"  {e['url']}: {'ok ' + what if e['ok'] else 'unreachable (' + e['error'] + ')'}")
    r, a = summary["requests"], summary["acceptance"]
    lines.append("")
    lines.append(f"requests              {r['count']}" + (f"  errors {r['errors']}" if r["errors"] else ""))
    if r["durationS"]:
        lines.append(f"  duration            {_fmt_lat(r['durationS'], 's')}")
    if r["timeToFirstTokenS"]:
        lines.append(f"  time to first token {_fmt_lat(r['timeToFirstTokenS'], 's')}")
    if r["timePerOutputTokenMs"]:
        lines.append(f"  time per out token  {_fmt_lat(r['timePerOutputTokenMs'], 'ms')}")
    lines.append(f"  tokens in / out     {r['inputTokens']} / {r['outputTokens']}")
    lines.append(f"generated tokens      {summary['generatedTokens']}")
    lines.append(f"active sessions       {summary['activeSessions']}")
    rate = "-" if a["rate"] is None else f"{a['rate']:.3f}"
    mal = "-" if a["meanAcceptedLength"] is None else f"{a['meanAcceptedLength']:.2f}"
    lines.append(f"acceptance rate       {rate}  ({a['draftTokensAccepted']}/{a['draftTokensProposed']} draft tokens, "
                 f"{a['verifySteps']} verify steps, {mal} tokens/step)")
    if summary["acceptanceByPosition"]:
        cells = [f"{p['position']}: {p['rate']:.2f}" for p in summary["acceptanceByPosition"] if p["rate"] is not None]
        lines.append(f"  by position         {'  '.join(cells)}")
    lines.append(f"draft latency         {_fmt_lat(summary['draftLatencyMs'], 'ms')}")
    lines.append(f"verify latency        {_fmt_lat(summary['verifyLatencyMs'], 'ms')}")
    for method, h in summary["roundTripMs"].items():
        lines.append(f"  {method + ' round trip':<20}{_fmt_lat(h, 'ms')}")
    lines.append(f"fallback steps        {summary['fallbackSteps']}")
    if summary["draftFailures"]:
        lines.append(f"draft failures        {summary['draftFailures']}")
    if summary["replicaFailovers"]:
        lines.append(f"replica failovers     {summary['replicaFailovers']}")
    for comp, kv in summary["kvCache"].items():
        lines.append(f"KV cache ({comp}){' ' * max(1, 12 - len(comp))}{_mib(kv['bytes'])}, {kv['sessions']} sessions")
    return "\n".join(lines)


def collect(endpoints: list[str], timeout: float = 2.0) -> tuple[dict, list[dict]]:
    merged = Merged()
    report = []
    for spec in endpoints:
        url = endpoint_url(spec)
        try:
            infos = merged.add_text(scrape(url, timeout))
        except (urllib.error.URLError, OSError, ValueError) as e:
            reason = getattr(e, "reason", e)
            report.append({"url": url, "ok": False, "error": str(reason)})
            continue
        services = sorted({i.get("service_name", "") for i in infos if i.get("service_name")})
        report.append({"url": url, "ok": True, "services": services})
    return summarize(merged), report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="specdec stats", description="Summarize specdec services' /metrics endpoints.")
    add_stats_arguments(p)
    return run_stats(p.parse_args(argv))


def add_stats_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("endpoints", nargs="*",
                   help="HOST:PORT or URL of /metrics endpoints (default: $SPECDEC_METRICS_ENDPOINTS or "
                        f"{DEFAULT_ENDPOINTS})")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--timeout", type=float, default=2.0, help="seconds per endpoint")


def run_stats(args) -> int:
    specs: list[str] = []
    for e in args.endpoints or [os.environ.get("SPECDEC_METRICS_ENDPOINTS") or DEFAULT_ENDPOINTS]:
        specs.extend(x for x in e.split(",") if x.strip())
    summary, report = collect(specs, args.timeout)
    if args.json:
        print(json.dumps({"endpoints": report, **summary}))
    else:
        print(render(summary, report))
    if not any(e["ok"] for e in report):
        print("no metrics endpoint answered (start services with --metrics-port or SPECDEC_METRICS_PORT)",
              file=sys.stderr)
        return 1
    return 0


# --------------------------------------------------------------------------------------------
# specdec outline
# --------------------------------------------------------------------------------------------


def _ints(x):
    if isinstance(x, float) and x.is_integer() and abs(x) < 2**53:
        return int(x)
    if isinstance(x, dict):
        return {k: _ints(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_ints(v) for v in x]
    return x


def fetch_outline(address: str, timeout: float = 5.0, token: str | None = None) -> dict:
    """The orchestrator's GetOutline as a plain dict (Struct numbers that are whole become ints)."""
    from google.protobuf.json_format import MessageToDict

    from specdec.client import SpecdecClient
    from specdec.core.grpc_util import client_tls_from_env
    from specdec.v1 import orchestrator_pb2 as opb

    with SpecdecClient(address, token=token, tls=client_tls_from_env()) as client:
        reply = client.stub.GetOutline(opb.GetOutlineRequest(), timeout=timeout, metadata=client.metadata)
    return _ints(MessageToDict(reply.outline))


def _render_outline(d, indent: int = 0) -> list[str]:
    lines = []
    pad = "  " * indent
    for k, v in d.items():
        if isinstance(v, dict):
            lines.append(f"{pad}{k}:")
            lines.extend(_render_outline(v, indent + 1))
        elif isinstance(v, list) and v and isinstance(v[0], dict):
            lines.append(f"{pad}{k}:")
            for item in v:
                sub = _render_outline(item, indent + 2)
                if sub:
                    sub[0] = "  " * (indent + 1) + "- " + sub[0].lstrip()
                lines.extend(sub)
        else:
            lines.append(f"{pad}{k}: {json.dumps(v) if not isinstance(v, str) else v}")
    return lines


def add_outline_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--address", default="127.0.0.1:50050", help="orchestrator address")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--timeout", type=float, default=5.0)


def run_outline(args) -> int:
    import grpc

    try:
        outline = fetch_outline(args.address, args.timeout, os.environ.get("SPECDEC_TOKEN"))
    except grpc.RpcError as e:
        print(f"GetOutline at {args.address} failed: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(outline, indent=2))
    else:
        print("\n".join(_render_outline(outline)))
    return 0


def outline_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="specdec outline", description="Print the running system's design outline.")
    add_outline_arguments(p)
    return run_outline(p.parse_args(argv))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
