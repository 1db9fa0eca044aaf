"""The result of one `python -m bench` run as the JSON dict: the headline figures chosen from the summarised rows,
the settings it ran with and the machine it ran on (bench/report.py renders it; docs/benchmark.md explains it)."""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass

from bench import analysis
from bench.configs import _draft_note, session_job_count
from bench.machine import cpu_model
from bench.run_state import BenchRun


@dataclass
class Measured:
    """What a run measured, summarised: one row per configuration and per sessions level, the step costs."""

    rows: list[dict]
    session_rows: list[dict]
    micro: dict
    overheads: dict


def _ok(row: dict):
    return row.get("available") and row.get("tokens_per_s")


def assemble(bench: BenchRun, measured: Measured) -> dict:
    rows, not_measured = measured.rows, bench.not_measured
    head = _headline_row(rows, getattr(bench.args, "headline_fixed", None), not_measured)
    sweep_name, s1, smax = _sessions_headline(measured.session_rows, not_measured)
    res = {
        "benchmark": "specdec",
        "command": None,  # set by main()
        "mode": "quick" if bench.args.quick else "full",
        **_headline_keys(rows, head),
        "throughput_8_sessions_vs_1": analysis.ratio(smax["tokens_per_s"], s1["tokens_per_s"]) if smax and s1 else None,
        "system_overhead_share": head.get("system_overhead_share") if head else None,
        "system_overhead_ms_per_step": head.get("system_overhead_ms_per_step") if head else None,
        "sessions_sweep": sweep_name,
        "max_sessions": smax["sessions"] if smax else None,
        "draft": _draft(bench),
        "flags_available": bench.flags,
        "settings": _settings(bench),
        "machine": _machine(bench),
        "microbench": measured.micro,
        "overheads": measured.overheads,
        "not_measured": not_measured,
        "configs": rows + measured.session_rows,
    }
    return res


def _headline_row(rows: list[dict], fixed: str | None, not_measured: dict) -> dict | None:
    """The llama.cpp engine's default configuration where it ran, else the fastest pipelined, else sequential."""
    by = {r["name"]: r for r in rows}
    pipelined = [r for r in rows if r["kind"] == "specdec-pipelined" and _ok(r)]
    sequential = [r for r in rows if r["kind"] == "specdec-sequential" and _ok(r)]
    if fixed and _ok(by.get(fixed, {})):  # the llama.cpp engine: what `specdec run` runs by default
        return by[fixed]
    if pipelined:
        if fixed:
            not_measured["headline_config"] = (f"{fixed} (`specdec run`'s default) did not run: "
                                               f"{by.get(fixed, {}).get('reason', 'not configured')}; the fastest "
                                               "pipelined configuration stands in")
        return max(pipelined, key=lambda r: r["tokens_per_s"])
    not_measured["pipelined_speedup_vs_target_only"] = next(
        (r.get("reason", "") for r in rows if r["kind"] == "specdec-pipelined"), "no pipelined configuration")
    not_measured["pipelined_faster_than_sequential"] = not_measured["pipelined_speedup_vs_target_only"]
    return max(sequential, key=lambda r: r["tokens_per_s"]) if sequential else None


def _sessions_headline(session_rows: list[dict], not_measured: dict) -> tuple[str | None, dict | None, dict | None]:
    """The sweep the headline quotes (batched where it ran) with its 1-session and largest rows."""
    sweep_name = next((n for n in ("sessions-batched", "sessions-unbatched")
                       if any(r.get("sweep") == n and r.get("available") for r in session_rows)), None)
    sweep = [r for r in session_rows if r.get("sweep") == sweep_name and r.get("available")]
    s1 = next((r for r in sweep if r["sessions"] == 1), None)
    smax = max(sweep, key=lambda r: r["sessions"]) if sweep else None
    if smax is None:
        not_measured["throughput_8_sessions_vs_1"] = next((r.get("reason", "") for r in session_rows), "no sweep ran")
    return sweep_name, s1, smax


def _headline_keys(rows: list[dict], head: dict | None) -> dict:
    """The headline configuration's figures and its ratios to the anchors and to the best sequential one."""
    by = {r["name"]: r for r in rows}
    sequential = [r for r in rows if r["kind"] == "specdec-sequential" and _ok(r)]
    best_seq = max(sequential, key=lambda r: r["tokens_per_s"]) if sequential else None
    hf_anchor = by.get("hf-assisted") if _ok(by.get("hf-assisted", {})) else by.get("hf-prompt-lookup")
    if hf_anchor is not None and not _ok(hf_anchor):
        hf_anchor = None
    head_tps = head["tokens_per_s"] if head else None
    pipelined_head = bool(head and head["kind"] == "specdec-pipelined")
    same_policy = None
    if pipelined_head:
        # pipelined adaptive (on or auto) vs sequential adaptive; pipelined g=N vs sequential g=N
        twin = by.get(head["name"].replace("-pipe-auto-", "-seq-").replace("-pipe-", "-seq-"))
        same_policy = analysis.ratio(head_tps, twin.get("tokens_per_s")) if twin and _ok(twin) else None
    get = (lambda key: head.get(key)) if head else (lambda key: None)
    return {
        "headline_config": head["name"] if head else None,
        "headline_is_pipelined": pipelined_head,
        "speedup_vs_target_only": get("speedup_vs_target_only"),
        "speedup_vs_hf_assisted": analysis.ratio(head_tps, hf_anchor["tokens_per_s"]) if head and hf_anchor else None,
        "hf_anchor": hf_anchor["name"] if hf_anchor else None,
        "speedup_vs_hf_prompt_lookup": analysis.ratio(head_tps, by.get("hf-prompt-lookup", {}).get("tokens_per_s"))
        if head else None,
        "speedup_vs_hf_target_only": analysis.ratio(head_tps, by.get("hf-target-only", {}).get("tokens_per_s"))
        if head else None,
        "pipelined_vs_sequential": (analysis.ratio(head_tps, best_seq["tokens_per_s"])
                                    if pipelined_head and best_seq else None),
        "best_sequential_config": best_seq["name"] if best_seq else None,
        "pipelined_vs_sequential_same_policy": same_policy,
        **{key: get(key) for key in ("acceptance_rate", "alpha", "mean_accepted_length", "predicted_speedup",
                                     "measured_over_predicted", "decode_phase_speedup_vs_target_only",
                                     "measured_over_predicted_decode_phase")},
        "tokens_per_s": head_tps,
        "target_only_tokens_per_s": by["specdec-target-only"].get("tokens_per_s"),
    }


def _draft(bench: BenchRun) -> dict:
    args, strategy, draft = bench.args, bench.strategy, bench.draft
    return {"strategy": strategy,
            "model": None if draft is None else draft.name if strategy == "quantized" else args.draft_model,
            "note": _draft_note(args, strategy)}


def _settings(bench: BenchRun) -> dict:
    """What the run ran with: the prompts, lengths, rounds, sessions, batching and how it timed."""
    args, prompts, ids = bench.args, bench.prompts, bench.ids
    return {"target_model": args.target_model, "max_new_tokens": args.max_new_tokens,
            "prompts": [{"name": p.name, "kind": p.kind, "prompt_tokens": len(ids[p.name])} for p in prompts],
            "rounds": args.rounds, "draft_lens": args.draft_lens, "sessions": args.sessions,
            "session_jobs": {n: session_job_count(args, n, min(args.session_prompts, len(prompts)))
                             for n in args.sessions},
            "session_prompts": [p.name for p in prompts[: max(1, min(args.session_prompts, len(prompts)))]],
            "batch_window_ms": args.batch_window_ms
            if bench.flags["target --batch-window-ms"] else None,
            "batch_wait_fraction": args.batch_wait_fraction, "threads": args.threads,
            "target_threads": getattr(args, "target_threads", args.threads),
            "decoding": "greedy (temperature 0)", "chat_template": True, "warmup_tokens": args.warmup_tokens,
            "timing": "client wall time per generation (request sent -> final message), prefill included; "
                      "tokens/s = all generated tokens / all wall time of a configuration",
            "interleaving": "every prompt runs every configuration back to back, the order rotated by one "
                            "per prompt; session counts alternate order per round"}


def _machine(bench: BenchRun) -> dict:
    import torch
    import transformers

    return {"cpus": os.cpu_count(), "cpu_model": cpu_model(), "cpu_flags": torch.backends.cpu.get_cpu_capability(),
            "platform": platform.platform(), "python": platform.python_version(),
            "torch": torch.__version__, "transformers": transformers.__version__,
            "device": str(getattr(bench.draft, "device", None) or bench.args.device)}
