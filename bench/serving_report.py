"""The serving benchmark's markdown tables and plot (bench/serving.py writes them next to latest.json)."""

from __future__ import annotations

import pathlib

from bench.llama_server_rows import serving_markdown

TARGET_LABELS = {
    "single_stream_ratio": "speculative >= {t}x target-only output tokens/s at 1 stream",
    "every_level_ratio": "speculative >= {t}x target-only output tokens/s at every concurrency",
    "tpot_p99": "speculative p99 TPOT <= {t}x target-only's at every concurrency",
}


def _f(x, nd=1) -> str:
    return "n/a" if x is None else f"{x:.{nd}f}"


def _pct(x) -> str:
    return "n/a" if x is None else f"{100 * x:.0f}%"


def _pair(row: dict, key: str, nd=0) -> str:
    return f"{_f(row.get(key), nd)} / {_f(row.get('target_only_' + key), nd)}"


def table(rows: list[dict], key: str, header: str) -> list[str]:
    """One markdown table: speculative / target-only side by side per level."""
    out = [f"| {header} | output tokens/s spec / target-only | ratio | requests/s | TTFT p50 (ms) | TTFT p99 (ms) "
           "| TPOT p50 (ms) | TPOT p99 (ms) | ITL p99 (ms) | acceptance | steps speculated | failed requests | same tokens |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        level = _f(r[key], 3) if isinstance(r[key], float) else r[key]
        failed = f"{r['speculative'].get('errors', 0)} / {r['target_only'].get('errors', 0)}"
        same = "n/a" if r.get("same_tokens") is None else "yes" if r["same_tokens"] else "NO"
        out.append(f"| {level} | {_f(r['spec_tokens_per_s'])} / {_f(r['target_only_tokens_per_s'])} "
                   f"| **{_f(r['ratio'], 2)}** | {_pair(r, 'requests_per_s', 2)} | {_pair(r, 'ttft_p50_ms')} "
                   f"| {_pair(r, 'ttft_p99_ms')} | {_pair(r, 'tpot_p50_ms')} | {_pair(r, 'tpot_p99_ms')} "
                   f"| {_pair(r, 'itl_p99_ms')} | {_f(r.get('acceptance_rate'), 2)} "
                   f"| {_pct(r.get('speculated_step_share'))} | {failed} | {same} |")
    return out


def rss_table(levels: list[dict]) -> list[str]:
    names = sorted({k for r in levels for k in r.get("rss_mib_peak", {})})
    out = ["| streams | " + " | ".join(f"{n} RSS (MiB)" for n in names) + " |", "|---" * (len(names) + 1) + "|"]
    for r in levels:
        out.append(f"| {r['concurrency']} | " + " | ".join(_f(r["rss_mib_peak"].get(n), 0) for n in names) + " |")
    return out


def memory_lines(mem: dict) -> list[str]:
    out = [f"## Memory at {mem['concurrency']} streams", ""]
    for mode, m in mem.get("by_mode", {}).items():
        rss = ", ".join(f"{k} {_f(v, 0)} MiB" for k, v in sorted(m.get("rss_mib_peak", {}).items()))
        out.append(f"* {mode}: peak RSS {rss}.")
        for name, kv in sorted(m.get("kv_cache", {}).items()):
            b = mem["bounds"].get(name, {})
            per = kv.get("bytes_per_session")
            out.append(f"  * {name} KV cache: peak {_f(kv['peak_bytes'] / 2 ** 20)} MiB, at most {kv['peak_sessions']} "
                       f"sessions cached, {_f(None if per is None else per / 2 ** 20, 2)} MiB per session; bounds "
                       f"{b.get('max_sessions')} sessions / {b.get('max_cache_mb')} MiB: "
                       f"{'inside' if kv.get('within_bounds') else 'OUTSIDE' if kv.get('within_bounds') is False else 'n/a'}.")
    verdict = {True: "every service stayed inside its configured KV cache bounds",
               False: "a service went OUTSIDE its configured KV cache bounds",
               None: "KV cache not measured (no metrics endpoint answered)"}[mem.get("within_bounds")]
    return out + ["", f"Verdict: {verdict}.", ""]


def markdown(res: dict) -> str:
    s = res["serving"]
    m = s["machine"]
    lines = [f"# specdec serving benchmark ({s['mode']})", "",
             f"Command: `{res.get('command')}`. Machine: {m['cpus']} CPUs, {m['cpu_model']}; load average "
             f"{_f(m['load_average_begin'][0], 2)} at the start, {_f(m['load_average_end'][0], 2)} at the end; "
             f"total {_f(m['total_s'], 0)} s (stack start {_f(m['service_startup_s'], 0)} s).", "",
             f"Stack: {s['stack']['command']}; target {s['stack']['target_model']} on the "
             f"{s['stack'].get('engine', 'torch')} engine ({s['stack'].get('target_threads', 1)} threads), draft "
             f"{s['stack']['draft_strategy']}. {s['settings']['max_new_tokens']} new tokens per request, greedy, "
             f"{len(s['settings']['prompts'])} prompts cycled; {s['settings']['modes']}.", "",
             "## Targets", "", "| target | measured | met | why |", "|---|---|---|---|"]
    for key, t in s["targets"].items():
        met = {True: "met", False: "**not met**", None: "not measured"}[t["met"]]
        lines.append(f"| {TARGET_LABELS.get(key, key).format(t=t['threshold'])} | {_f(t['value'], 2)}"
                     f"{' at ' + str(t['at_concurrency']) + ' streams' if t.get('at_concurrency') else ''} | {met} "
                     f"| {t['why'] or '-'} |")
    lines += ["", f"Lowest ratio over the closed-loop levels: **{_f(s['min_ratio'], 2)}**.", "",
              "## Closed loop (N streams, each sends its next request when the last one ends)", "",
              "Every cell: speculative / target-only.", "", *table(s["levels"], "concurrency", "streams"), ""]
    lines += serving_markdown(s)
    if s["poisson"]:
        lines += ["## Open loop (Poisson arrivals)", "",
                  f"{s['settings']['poisson_requests']} requests per rate, the same seeded schedule for both modes.",
                  "", *table(s["poisson"], "request_rate", "requests/s offered"), ""]
    lines += ["## Peak RSS per level (both modes)", "", *rss_table(s["levels"]), ""]
    lines += memory_lines(s["memory"])
    lines += ["Definitions: " + s["settings"]["definitions"] + ".", ""]
    return "\n".join(lines)


def plot(res: dict, path: str | pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = res["serving"]
    levels = s["levels"]
    n = [r["concurrency"] for r in levels]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 5), dpi=110)
    for ax, spec_key, to_key, ylabel, title in (
            (ax1, "spec_tokens_per_s", "target_only_tokens_per_s", "output tokens/s", "Throughput"),
            (ax2, "tpot_p99_ms", "target_only_tpot_p99_ms", "p99 TPOT (ms)", "p99 time per output token")):
        ax.plot(n, [r[spec_key] for r in levels], "o-", color="tab:red", lw=2, label="speculative (specdec up)")
        ax.plot(n, [r[to_key] for r in levels], "s--", color="tab:gray", lw=2, label="target-only")
        anchor = [(x, (r.get("llama_server") or {}).get(spec_key.replace("spec_", ""))) for x, r in zip(n, levels)]
        if any(y is not None for _, y in anchor):
            ax.plot([x for x, y in anchor if y is not None], [y for _, y in anchor if y is not None], "^:",
                    color="tab:blue", lw=2, label="llama-server -np N")
        ax.set_xscale("log", base=2)
        ax.set_xticks(n)
        ax.set_xticklabels([str(x) for x in n])
        ax.set_xlabel("concurrent streams (closed loop)")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=9)
    for x, y, r in zip(n, [r["spec_tokens_per_s"] for r in levels], levels):
        if r["ratio"] is not None and y is not None:
            ax1.annotate(f"{r['ratio']:.2f}x", (x, y), textcoords="offset points", xytext=(4, 6), fontsize=8,
                         color="tab:red")
    fig.suptitle(f"specdec serving ({s['mode']}): {s['stack']['target_model']}, draft {s['stack']['draft_strategy']}, "
                 f"{s['settings']['max_new_tokens']} tokens/request, greedy", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
