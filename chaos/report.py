"""`python -m chaos.report results.jsonl`: the results table (markdown) from `python -m chaos --json` output."""

from __future__ import annotations

import json
import sys

COLUMNS = [
    ("scenario", "scenario"),
    ("requests", "requests"),
    ("completed", "completed"),
    ("failed", "failed"),
    ("mismatched_tokens", "mismatched"),
    ("store_mismatches", "store≠client"),
    ("fallback_steps", "fallback steps"),
    ("verify_steps", "verify steps"),
    ("replica_failovers", "failovers"),
    ("draft_failures_by_kind", "draft failures"),
    ("target_resyncs", "target resyncs"),
    ("resumes", "resumes"),
    ("retried_requests", "retried"),
    ("speculation_resumed", "spec. resumed"),
    ("max_stall_ms", "max stall ms"),
    ("stall_bound_ms", "bound ms"),
    ("outage_s", "outage s"),
    ("p50_latency_ms", "p50 ms"),
    ("p95_latency_ms", "p95 ms"),
    ("duration_s", "duration s"),
    ("ok", "ok"),
]


def _cell(res: dict, key: str) -> str:
    if key == "outage_s":
        v = (res.get("fault") or {}).get("outage_s")
    else:
        v = res.get(key)
    if v is None:
        return "–"
    if isinstance(v, dict):
        return ", ".join(f"{k} {n}" for k, n in sorted(v.items())) or "0"
    if isinstance(v, bool):
        return "yes" if v else "**no**"
    return str(v)


def markdown(results: list[dict]) -> str:
    lines = ["| " + " | ".join(h for _, h in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in results:
        lines.append("| " + " | ".join(_cell(r, k) for k, _ in COLUMNS) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    text = open(argv[0]).read() if argv else sys.stdin.read()
    results = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
    print(markdown(results))
    if results and results[0].get("baseline"):
        b = results[0]["baseline"]
        print(f"\nBaseline (fault-free, same load): target step {b['target_step_ms']} ms, loop step p50 "
              f"{b['step_p50_ms']} ms / p95 {b['step_p95_ms']} ms, draft deadline {b['draft_deadline_ms']} ms, "
              f"stall bound {b['stall_bound_ms']} ms, acceptance {b['acceptance_rate']}.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
