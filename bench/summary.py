"""Summaries of the measured samples: per configuration, per session count, and the targets the results
are checked against (with why a target was missed)."""

from __future__ import annotations

from dataclasses import dataclass

from bench import analysis
from bench.report import batch_label, cpu_label
from bench.configs import Config, Sample, decode_phase_tps


TARGETS = [
    # key, threshold, description
    ("pipelined_speedup_vs_target_only", 1.5, "specdec speculative pipelined >= 1.5x target-only"),
    ("speedup_vs_hf_assisted", 1.0, "specdec pipelined >= 1.0x in-process HF assisted generation"),
    ("pipelined_faster_than_sequential", 1.0, "pipelined faster than sequential (ratio > 1.0)"),
    ("measured_over_predicted", 0.9, "measured / predicted speedup >= 0.9"),
    ("throughput_8_sessions_vs_1", 2.0, "8 concurrent sessions >= 2x the aggregate throughput of 1"),
    ("system_overhead_share", 0.05, "per-step gRPC + Redis overhead on the critical path < 5% of a target step"),
    ("target_only_vs_llamacpp", 0.97, "specdec target-only >= 0.97x plain llama.cpp on the same cores"),
]
LOWER_IS_BETTER = {"system_overhead_share"}


def _sum_stats(samples: list[Sample]) -> dict:
    keys = ("verify_steps", "draft_tokens_proposed", "draft_tokens_accepted", "decode_steps", "fallback_steps",
            "draft_failures", "draft_ms", "verify_ms", "wall_ms", "pipeline_prefetches", "pipeline_hits",
            "load_shed_steps", "decode_ms", "draft_tokens_trimmed", "prefill_ms", "kv_imports", "rpc_overhead_ms",
            "store_ms", "prefetch_wait_ms", "store_overlapped_ms")
    out = {k: sum(float(s.stats.get(k, 0) or 0) for s in samples) for k in keys}
    kinds: dict[str, float] = {}
    for s in samples:
        for kind, n in (s.stats.get("draft_failures_by_kind") or {}).items():
            kinds[kind] = kinds.get(kind, 0) + float(n)
    out["draft_failures_by_kind"] = kinds
    return out


def summarise_config(cfg: Config, baseline: Config | None, micro: dict, strategy: str,
                     reference_tokens: dict[str, list[int]], engine: str = "torch") -> dict:
    out = _config_identity(cfg)
    if not out["available"]:
        out["reason"] = cfg.reason or "no samples"
        return out
    tokens = sum(len(s.tokens) for s in cfg.samples)
    wall = sum(s.wall_s for s in cfg.samples)
    out.update(samples=len(cfg.samples), tokens=tokens, wall_s=wall, tokens_per_s=tokens / wall if wall else None)
    if cfg.cpu_s and tokens:
        # CPU ms per generated token of each process (the bench process runs the clients and the in-process rows):
        # what a configuration costs the cores, less sensitive than wall time to other jobs on a shared host
        out["cpu_ms_per_token"] = {k: round(1e3 * v / tokens, 3) for k, v in sorted(cfg.cpu_s.items())}
    out.update(_against_target_only(cfg, baseline, out["tokens_per_s"]))
    out["output_matches_target_only"] = _output_matches(cfg, reference_tokens, engine)
    if cfg.kind.startswith("hf-"):
        out.update(_hf_forwards(cfg, tokens))
        return out
    st = _sum_stats(cfg.samples)
    out["service_stats"] = st
    if st["draft_failures"]:  # a draft that errs costs speed, never output: say so rather than report a slow config
        kinds = ", ".join(f"{k} {v:.0f}" for k, v in sorted(st["draft_failures_by_kind"].items()))
        out["warning"] = (f"{st['draft_failures']:.0f} draft failures ({kinds}); {st['fallback_steps']:.0f} steps "
                          "decoded target-only (the services' logs say why)")
    out.update(_per_step(cfg, st, wall * 1e3, micro["target_step_ms"]))
    if cfg.speculative:
        out.update(_speculation(st, micro, strategy, out))
    return out


def _config_identity(cfg: Config) -> dict:
    """What a configuration is, whether it ran or not."""
    out = {"name": cfg.name, "kind": cfg.kind, "label": cfg.label, "available": cfg.available and bool(cfg.samples),
           "draft_len": cfg.draft_len if cfg.draft_len is not None else (
               "adaptive" if cfg.speculative else ("hf-schedule" if cfg.kind in ("hf-assisted", "hf-prompt-lookup")
                                                   else None)),
           "pipelined": cfg.pipelined}
    if cfg.settings:
        out["settings"] = cfg.settings
    if cfg.orchestrator:
        out["orchestrator_flags"] = cfg.orchestrator_flags
        out["request_max_draft_len"] = cfg.draft_len or 0
    return out


def _against_target_only(cfg: Config, baseline: Config | None, tokens_per_s: float | None) -> dict:
    """Speedups over the target-only baseline: overall, after the first streamed tokens, and per prompt."""
    base_tps = None
    if baseline is not None and baseline.samples:
        bt = sum(len(s.tokens) for s in baseline.samples)
        bw = sum(s.wall_s for s in baseline.samples)
        base_tps = bt / bw if bw else None
    out = {"speedup_vs_target_only": analysis.ratio(tokens_per_s, base_tps)}
    out["decode_phase_tokens_per_s"] = decode_phase_tps(cfg.samples)
    out["decode_phase_speedup_vs_target_only"] = analysis.ratio(
        out["decode_phase_tokens_per_s"], decode_phase_tps(baseline.samples) if baseline is not None else None)
    # Paired per-(prompt, round) speedups: the spread shows how noisy the shared machine was.
    if baseline is not None:
        by_key = {(s.prompt, s.round): s for s in baseline.samples}
        pairs = []
        for s in cfg.samples:
            b = by_key.get((s.prompt, s.round))
            if b is not None and s.tokens and b.tokens and s.wall_s and b.wall_s:
                pairs.append((len(s.tokens) / s.wall_s) / (len(b.tokens) / b.wall_s))
        out["speedup_per_prompt"] = analysis.spread(pairs)
    return out


def _output_matches(cfg: Config, reference_tokens: dict[str, list[int]], engine: str) -> float | None:
    """The share of samples whose tokens are target-only's, where the row runs on the reference's engine."""
    # Another engine (llama.cpp computes the GGUF's quantized weights in its own kernels) need not match the
    # reference's: the specdec rows run on the services' engine, the HF anchors on torch, the others on llama.cpp.
    row_engine = ("llamacpp" if cfg.kind.startswith("llamacpp-") else "torch" if cfg.kind.startswith("hf-")
                  else engine)
    same_engine = row_engine == engine
    matches = [s.tokens == reference_tokens.get(s.prompt) for s in cfg.samples
               if s.prompt in reference_tokens and same_engine]
    return (sum(matches) / len(matches)) if matches else None


def _hf_forwards(cfg: Config, tokens: int) -> dict:
    """An HF anchor's forwards, counted by hooks: tokens per target forward, approximate acceptance."""
    tf = sum(s.extra.get("target_forwards", 0) for s in cfg.samples)
    df = sum(s.extra.get("draft_forwards", 0) for s in cfg.samples)
    out = {"target_forwards": tf, "mean_accepted_length": tokens / tf if tf else None}  # tokens per target forward
    if cfg.kind == "hf-assisted" and df:
        out["draft_forwards"] = df
        out["acceptance_rate"] = max(0.0, (tokens - tf) / df)
        out["acceptance_note"] = "approx.: (tokens - target forwards) / draft forwards, from forward hooks"
    return out


def _per_step(cfg: Config, st: dict, client_ms: float, t_step: float) -> dict:
    """Where a step's time went (the orchestrator's stats per step) and the gRPC + Redis share of a target step."""
    steps = st["verify_steps"] + st["decode_steps"]
    if not steps:
        return {}
    # Older services carry no decode_ms: then the overhead is exact only where every step was a verify.
    exact = not cfg.pipelined and (not st["decode_steps"] or st["decode_ms"] > 0)
    out = {"per_step_ms": {
        "client_wall": client_ms / steps,
        "target_verify": st["verify_ms"] / st["verify_steps"] if st["verify_steps"] else None,
        "target_decode": st["decode_ms"] / st["decode_steps"] if st["decode_steps"] else None,
        "draft_propose": st["draft_ms"] / st["verify_steps"] if st["verify_steps"] else None,
        "rpc_and_orchestrator_overhead": ((st["wall_ms"] - st["draft_ms"] - st["verify_ms"] - st["decode_ms"]
                                           - st["prefill_ms"])
                                          / steps if exact else None),
        "store_and_stream_overhead": (client_ms - st["wall_ms"]) / steps,
        "rpc_overhead": st["rpc_overhead_ms"] / steps,
        "redis_commit": st["store_ms"] / steps,
        "redis_commit_critical": (st["store_ms"] - st["store_overlapped_ms"]) / steps,
        "prefetch_wait": st["prefetch_wait_ms"] / steps,
        "note": PER_STEP_NOTE,
    }}
    if st["rpc_overhead_ms"] or st["store_ms"]:
        out["system_overhead_ms_per_step"] = (st["rpc_overhead_ms"] + st["store_ms"]
                                              - st["store_overlapped_ms"]) / steps
        out["system_overhead_share"] = out["system_overhead_ms_per_step"] / t_step if t_step else None
    if cfg.pipelined:
        out["pipeline"] = {"prefetches": st["pipeline_prefetches"], "hits": st["pipeline_hits"],
                           "verify_steps": st["verify_steps"]}
    return out


PER_STEP_NOTE = (
    "rpc_and_orchestrator_overhead = (orchestrator step time - draft_ms - verify_ms - decode_ms - "
    "prefill_ms) "
    "per step, where not pipelined (draft and verify overlap); store_and_stream = client wall - "
    "orchestrator step time (Redis commit, streaming, session setup); rpc_overhead = the orchestrator's "
    "rpc_overhead_ms stat per step: for each call the loop waited for (Verify, Decode, a Propose not "
    "prefetched and not carrying the prompt's KV, which is prefill_ms) its round trip minus the "
    "service's reported time; redis_commit = its store_ms stat (the per-step commit), "
    "redis_commit_critical = the part of it the steps waited for (a block is committed and sent "
    "while the orchestrator's stepper thread runs the next step; store_ms - store_overlapped_ms); "
    "prefetch_wait = time a step waited for the previous step's prefetched block")


def _speculation(st: dict, micro: dict, strategy: str, row: dict) -> dict:
    """A speculative row's acceptance, draft cost and the paper's predicted speedup beside the measured one
    (`row`: the row so far, its measured speedups)."""
    v = st["verify_steps"]
    proposed, accepted = st["draft_tokens_proposed"], st["draft_tokens_accepted"]
    if not v or not proposed:
        return {"reason_no_prediction": "no verify steps (nothing was drafted)"}
    t_step = micro["target_step_ms"]
    g_mean = proposed / v
    mal = (accepted + v) / v
    out = {"acceptance_rate": accepted / proposed, "mean_accepted_length": mal,
           "mean_draft_len": g_mean,  # tokens verified per step: a scored draft's trimmed tail is not counted
           "trimmed_per_verify": st["draft_tokens_trimmed"] / v}
    alpha = analysis.alpha_from_accepted_length(mal, g_mean)
    out["alpha"] = alpha
    draft_ms_per_token = st["draft_ms"] / proposed
    out["draft_ms_per_token"] = draft_ms_per_token
    if strategy == "model" and micro.get("c") is not None:
        c, c_src = micro["c"], "microbenchmark: draft step / target step, in-process, same threads"
    else:
        c, c_src = draft_ms_per_token / t_step, "service stats draft_ms per proposed token / microbenchmarked target step"
    out["cost_ratio_c"] = c
    out["cost_ratio_source"] = c_src
    out["cost_ratio_c_services"] = draft_ms_per_token / (st["verify_ms"] / v) if st["verify_ms"] else None
    pred = analysis.predicted_speedup_with_plain_steps(alpha, g_mean, c, int(v), int(st["decode_steps"]))
    out["predicted_speedup"] = pred
    vc = analysis.interpolate_cost(micro.get("verify_cost_vs_step") or {}, g_mean + 1)
    if vc is not None:
        # The same model with the verify cost this CPU really has (a g+1-token forward is not free here).
        out["verify_cost_vs_step"] = vc
        out["predicted_speedup_measured_verify_cost"] = analysis.predicted_speedup_with_plain_steps(
            alpha, g_mean, c, int(v), int(st["decode_steps"]), verify_cost=vc)
        out["measured_over_predicted_measured_verify_cost"] = analysis.ratio(
            row["speedup_vs_target_only"], out["predicted_speedup_measured_verify_cost"])
    out["predicted_model"] = ("leviathan" if not st["decode_steps"] else
                              "leviathan, plus plain target steps where nothing was drafted")
    out["measured_over_predicted"] = analysis.ratio(row["speedup_vs_target_only"], pred)
    out["measured_over_predicted_decode_phase"] = analysis.ratio(row["decode_phase_speedup_vs_target_only"], pred)
    return out


@dataclass(frozen=True)
class SessionSweep:
    """One concurrent-sessions sweep: the headline configuration run by N client threads against a target."""

    name: str                          # sessions-batched or sessions-unbatched
    target: str                        # which target it ran against (target-batched or target)
    batched: bool                      # the target batches verification (--batch-window-ms)
    head_cfg: Config
    orchestrator_flags: list[str]
    batch_window_ms: float | None = None
    batch_wait_fraction: float | None = None


def summarise_sessions(sweep: SessionSweep, levels: dict[int, list[tuple[float, list[Sample]]]],
                       cpu: dict[int, list[dict[str, float]]] | None = None) -> list[dict]:
    """One row per session count. cpu: per session count, the CPU seconds each process used in each run:
    reported as busy cores (CPU seconds / wall seconds), the processes that did work."""
    rows = []
    base = None
    for n in sorted(levels):
        runs = levels[n]
        if not runs:
            continue
        row = _sessions_row(sweep, n, runs)
        if n == min(levels):
            base = row["tokens_per_s"]
        row["throughput_vs_1_session"] = analysis.ratio(row["tokens_per_s"], base)
        st = _sum_stats([s for _, samples in runs for s in samples])
        row.update(_session_figures(runs, st), service_stats=st)
        used: dict[str, float] = {}
        for d in (cpu or {}).get(n, []):
            for k, v in d.items():
                used[k] = used.get(k, 0.0) + v
        wall = row["wall_s"]
        row["cpu_cores_busy"] = {k: v / wall for k, v in sorted(used.items()) if wall and v / wall >= 0.01} or None
        rows.append(row)
    return rows


def _sessions_row(sweep: SessionSweep, n: int, runs: list[tuple[float, list[Sample]]]) -> dict:
    """The row's identity and totals, in the order the result file lists them."""
    tokens = sum(len(s.tokens) for _, samples in runs for s in samples)
    wall = sum(w for w, _ in runs)
    return {"name": f"{sweep.name}-{n}", "kind": "sessions", "sweep": sweep.name, "sessions": n, "available": True,
            "batched_verification": sweep.batched, "batch_window_ms": sweep.batch_window_ms,
            "batch_wait_fraction": sweep.batch_wait_fraction,
            "configuration": sweep.head_cfg.name, "orchestrator_flags": sweep.orchestrator_flags,
            "request_max_draft_len": sweep.head_cfg.draft_len or 0, "target": sweep.target,
            "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall if wall else None}


def _session_figures(runs: list[tuple[float, list[Sample]]], st: dict) -> dict:
    """Per-session speed, acceptance and the mix of steps, from the samples and the summed stats."""
    steps = st["decode_steps"] + st["verify_steps"]
    return {"mean_session_tokens_per_s": (sum(len(s.tokens) / s.wall_s for _, ss in runs for s in ss if s.wall_s)
                                          / max(1, sum(len(ss) for _, ss in runs))),
            "acceptance_rate": (st["draft_tokens_accepted"] / st["draft_tokens_proposed"]
                                if st["draft_tokens_proposed"] else None),
            "mean_accepted_length": ((st["draft_tokens_accepted"] + st["verify_steps"]) / st["verify_steps"]
                                     if st["verify_steps"] else None),
            "target_verify_ms_per_step": st["verify_ms"] / st["verify_steps"] if st["verify_steps"] else None,
            "plain_decode_step_fraction": st["decode_steps"] / steps if steps else None,
            "load_shed_step_fraction": st["load_shed_steps"] / steps if steps else None}


def ratio_or_none(a: dict, b: dict, key: str = "target_verify_ms_per_step") -> float | None:
    return analysis.ratio(a.get(key), b.get(key))


def _fmt(x, nd=2):
    return "n/a" if x is None else f"{x:.{nd}f}"


def evaluate_targets(res: dict) -> dict:
    cfgs = {c["name"]: c for c in res["configs"]}
    head = cfgs.get(res.get("headline_config") or "", {})
    out = {}
    for key, thr, desc in TARGETS:
        value = res.get(key if key != "pipelined_speedup_vs_target_only" else "speedup_vs_target_only")
        if key == "pipelined_faster_than_sequential":
            value = res.get("pipelined_vs_sequential")
        entry = {"target": desc, "threshold": thr, "value": value}
        if value is None:
            entry["met"] = None
            fallback = (head.get("reason_no_prediction") if key == "measured_over_predicted" else None) or \
                "the configuration is not available"
            entry["why"] = "not measured: " + res.get("not_measured", {}).get(key, fallback)
        elif key == "pipelined_faster_than_sequential":
            entry["met"] = value > thr
        elif key in LOWER_IS_BETTER:
            entry["met"] = value < thr
        else:
            entry["met"] = value >= thr
        if entry["met"] is False or (entry["met"] and key in ("pipelined_speedup_vs_target_only",
                                                              "system_overhead_share")):
            entry["why"] = _why(key, value, thr, head, cfgs, res)
        if entry["met"] is True and "why" not in entry:
            entry["why"] = f"met: {_fmt(value)} vs {thr}"
        out[key] = entry
    return out


def _why(key: str, value: float, thr: float, head: dict, cfgs: dict, res: dict) -> str:
    """Why a target was met or missed, with the measurements that say so ("" for a target without one)."""
    explain = _WHY.get(key)
    return explain(value, thr, head, cfgs, res) if explain else ""


def _system_overhead(res: dict) -> str:
    """The microbenchmarked RPC + Redis overhead per step against a target step, as a phrase."""
    ov = res.get("overheads", {})
    mb = res.get("microbench", {})
    return (f"RPC + Redis overhead per step ~{_fmt(ov.get('per_step_system_overhead_ms'), 1)} ms (Verify "
            f"{_fmt(ov.get('target_verify_rpc_overhead_ms'))} + Propose {_fmt(ov.get('draft_propose_rpc_overhead_ms'))}"
            f" + Redis {_fmt(ov.get('redis_commit_ms'))}) vs a target step of {_fmt(mb.get('target_step_ms'), 1)} ms")


def _prediction(head: dict, res: dict) -> tuple[float | None, float | None, str]:
    """The headline's predicted speedups (the paper's model; the same with the verify cost measured on this CPU) and
    the system overhead as a phrase: what the speedup explanations weigh the measured speedup against."""
    return head.get("predicted_speedup"), head.get("predicted_speedup_measured_verify_cost"), _system_overhead(res)


def _verify_block(head: dict) -> str:
    """The headline's mean verify block in tokens (mean draft length + 1), formatted."""
    return _fmt((head.get("mean_draft_len") or 0) + 1, 1)


def _why_speedup(value: float, thr: float, head: dict, cfgs: dict, res: dict) -> str:
    """The headline's speedup against the paper's prediction."""
    hp, hpv, sysov = _prediction(head, res)
    verb = "met" if value >= thr else "not met"
    parts = [f"{verb}: {head.get('name')} runs {_fmt(head.get('tokens_per_s'))} tok/s = {_fmt(value)}x target-only"]
    if hp is not None:
        parts.append(f"the paper's model predicts {_fmt(hp)}x at the measured acceptance "
                     f"(accepted/proposed {_fmt(head.get('acceptance_rate'))}, alpha {_fmt(head.get('alpha'))}, "
                     f"mean accepted length {_fmt(head.get('mean_accepted_length'))}, mean g "
                     f"{_fmt(head.get('mean_draft_len'))}, c {head.get('cost_ratio_c') or 0:.3g})")
        if hpv is not None:
            parts.append(f"{_fmt(hpv)}x with the verify cost measured on this CPU (a "
                         f"{_verify_block(head)}-token forward = "
                         f"{_fmt(head.get('verify_cost_vs_step'))} target steps)")
        if value < thr and hp < thr:
            parts.append(f"so even with free verification and no system overhead this drafter could not reach "
                         f"{thr}x: the acceptance rate / draft length is the limit")
        elif value < thr:
            parts.append(f"the system reaches {_fmt(value / hp)} of the paper's prediction; {sysov}")
    return "; ".join(parts)


def _why_hf_assisted(value: float, thr: float, head: dict, cfgs: dict, res: dict) -> str:
    """The headline against HF's in-process assisted generation."""
    sysov = _system_overhead(res)
    anchor = cfgs.get(res.get("hf_anchor") or "", {})
    return (f"not met: {_fmt(head.get('tokens_per_s'))} tok/s vs {anchor.get('name')} "
            f"{_fmt(anchor.get('tokens_per_s'))} tok/s in one process (no RPC, no serialisation, no Redis); "
            f"{sysov}; HF commits {_fmt(anchor.get('mean_accepted_length'))} tokens per target forward, specdec "
            f"{_fmt(head.get('mean_accepted_length'))} per verify")


def _why_pipelined(value: float, thr: float, head: dict, cfgs: dict, res: dict) -> str:
    """Pipelined against the best sequential configuration."""
    seq = cfgs.get(res.get("best_sequential_config") or "", {})
    return (f"not met: {head.get('name')} {_fmt(head.get('tokens_per_s'))} tok/s vs best sequential "
            f"{seq.get('name')} {_fmt(seq.get('tokens_per_s'))} tok/s (same draft-length policy: "
            f"{_fmt(res.get('pipelined_vs_sequential_same_policy'))}x); pipelining hides the draft time, here "
            f"{_fmt(head.get('draft_ms_per_token'), 3)} ms per draft token (c = {head.get('cost_ratio_c') or 0:.3g}), "
            f"and on {res['machine']['cpus']} shared CPU cores draft and target compete for the same cores")


def _why_predicted(value: float, thr: float, head: dict, cfgs: dict, res: dict) -> str:
    """Where the measured speedup falls short of the prediction."""
    hp, hpv, sysov = _prediction(head, res)
    return (f"not met: measured {_fmt(head.get('speedup_vs_target_only'))}x vs predicted {_fmt(hp)}x. The paper's "
            f"model takes a verify of g+1 tokens to cost one target step; on this CPU a "
            f"{_verify_block(head)}-token forward costs "
            f"{_fmt(head.get('verify_cost_vs_step'))} steps, which alone predicts {_fmt(hpv)}x (measured/that = "
            f"{_fmt(head.get('measured_over_predicted_measured_verify_cost'))}); the prompt prefill (the same work "
            f"in both, outside the paper's model) is in the wall time: after the first streamed tokens the "
            f"speedup is {_fmt(head.get('decode_phase_speedup_vs_target_only'))}x, "
            f"{_fmt(head.get('measured_over_predicted_decode_phase'))} of the prediction; the rest: {sysov}, plus the "
            f"orchestrator's own Python per step and the shared machine (load average "
            f"{_fmt(res['machine'].get('load_average_begin', [None])[0])} -> "
            f"{_fmt(res['machine'].get('load_average_end', [None])[0])} on {res['machine']['cpus']} cores)")


def _why_overhead(value: float, thr: float, head: dict, cfgs: dict, res: dict) -> str:
    """The gRPC + Redis time a step waited for, against a target step."""
    ov = res.get("overheads", {})
    mb = res.get("microbench", {})
    per = head.get("per_step_ms") or {}
    sysov = _system_overhead(res)
    seq = cfgs.get(res.get("best_sequential_config") or "", {})
    seq_share = seq.get("system_overhead_share")
    base = cfgs.get("specdec-target-only", {})
    base_share = base.get("system_overhead_share")
    base_steps = (base.get("service_stats") or {}).get("decode_steps")
    base_tokens = base["tokens"] / base_steps if base_steps and base.get("tokens") else None
    bare = ov.get("grpc_bare_after_forward_ms")
    floor = (f"; a bare gRPC call (no service code) around the target's forward of a verify block costs "
             f"{_fmt(bare, 2)} ms in the benchmark process, {_fmt(100 * bare / mb['target_step_ms'], 1)}% of a "
             f"target step before any service code runs" if bare is not None and mb.get("target_step_ms") else "")
    return (f"{'met' if value < thr else 'not met'}: {head.get('name')} waited "
            f"{_fmt((per.get('rpc_overhead') or 0), 2)} ms per step on gRPC beyond the services' own time and "
            f"{_fmt(per.get('redis_commit_critical'), 2)} ms on its Redis commit (of "
            f"{_fmt(per.get('redis_commit'), 2)} ms; the rest ran while the next step did), against "
            f"a target step of "
            f"{_fmt(mb.get('target_step_ms'), 1)} ms ({_fmt(100 * value, 1)}%; measured in its own run, the "
            f"orchestrator's rpc_overhead_ms and store_ms stats). Pipelined, a prefetched block's Propose overlaps "
            f"the verify (prefetch hits {(head.get('pipeline') or {}).get('hits')} of "
            f"{(head.get('pipeline') or {}).get('verify_steps')} verify steps); "
            f"sequential ({seq.get('name')}) pays both round trips: {_fmt(100 * seq_share, 1) if seq_share else 'n/a'}%"
            f", target-only decoding {_fmt(100 * base_share, 1) if base_share else 'n/a'}% (a step there is one Decode "
            f"call of {_fmt(base_tokens, 1)} tokens and one commit: {_fmt(100 * base_share / base_tokens, 1) if base_share and base_tokens else 'n/a'}% "
            f"of its forwards); the microbenchmark: {sysov}{floor}")


def _why_sessions(value: float, thr: float, head: dict, cfgs: dict, res: dict) -> str:
    """The sessions sweep's aggregate against one session."""
    rows = [c for c in res["configs"] if c.get("kind") == "sessions" and c.get("sweep") == res.get("sessions_sweep")]
    r1 = next((r for r in rows if r["sessions"] == 1), {})
    r8 = max(rows, key=lambda r: r["sessions"]) if rows else {}
    return (f"not met: {_fmt(r8.get('tokens_per_s'))} tok/s aggregate at {r8.get('sessions')} sessions vs "
            f"{_fmt(r1.get('tokens_per_s'))} at 1 ({res['machine']['cpus']} CPU cores, shared with other work; "
            + (f"the llama.cpp target runs {res.get('target_threads')} threads); batched verification "
               if res.get("engine") == "llamacpp" else
               f"each model service runs {res['settings']['threads']} torch thread); batched verification ")
            + f"{'on (' + batch_label(r8) + ')' if r8.get('batched_verification') else 'not available'}; "
            f"target verify per step grew from {_fmt(r1.get('target_verify_ms_per_step'))} to "
            f"{_fmt(r8.get('target_verify_ms_per_step'))} ms ({_fmt(ratio_or_none(r8, r1))}x for "
            f"{r8.get('sessions')}x the sessions); {_fmt(100 * (r8.get('plain_decode_step_fraction') or 0), 0)}% of "
            "the steps were target-only Decode calls (nothing drafted, speculation paused by the goodput draft "
            "length or shed by the load switch; the target batches their single-token steps too)"
            + _cpu_why(r1, r8, res["machine"]["cpus"]))


def _why_llamacpp(value: float, thr: float, head: dict, cfgs: dict, res: dict) -> str:
    """Target-only decoding against plain llama.cpp, per token."""
    b = (res.get("overheads") or {}).get("target_only_ms_per_token") or {}
    return (f"not met: {_fmt(res.get('target_only_tokens_per_s'))} vs {_fmt(res.get('llamacpp_tokens_per_s'))} "
            f"tok/s; per token {_fmt(b.get('client_wall'))} ms, of which the engine "
            f"{_fmt(b.get('target_engine'))}, target round trips waited beyond it "
            f"{_fmt(b.get('target_rpc_beyond_engine'))}, Redis commits waited {_fmt(b.get('redis_commit_critical'))},"
            f" the rest {_fmt(b.get('orchestrator_and_client_rest'))} (plain llama.cpp {_fmt(b.get('llamacpp'))})"
            + _cpu_per_token(b))


def _cpu_per_token(b: dict) -> str:
    """Each process's CPU ms per token during target-only decoding, against plain llama.cpp's."""
    cpu = b.get("cpu_ms_per_token")
    if not cpu:
        return ""
    parts = ", ".join(f"{name} {_fmt(ms)}" for name, ms in cpu.items() if ms)
    return f"; CPU ms a token: {parts} (plain llama.cpp {_fmt(b.get('llamacpp_cpu_ms_per_token'))})"


_WHY = {  # target key -> why it was met or missed
    "pipelined_speedup_vs_target_only": _why_speedup,
    "speedup_vs_hf_assisted": _why_hf_assisted,
    "pipelined_faster_than_sequential": _why_pipelined,
    "measured_over_predicted": _why_predicted,
    "system_overhead_share": _why_overhead,
    "throughput_8_sessions_vs_1": _why_sessions,
    "target_only_vs_llamacpp": _why_llamacpp,
}


def _cpu_why(r1: dict, r8: dict, cpus: int) -> str:
    """How much of the machine one session already keeps busy: concurrency cannot add more than the rest."""
    b1, b8 = r1.get("cpu_cores_busy"), r8.get("cpu_cores_busy")
    if not b1 or not b8:
        return ""
    t1, t8 = sum(b1.values()), sum(b8.values())
    return (f"; CPU: at 1 session the processes kept {t1:.2f} of the {cpus} cores busy "
            f"({cpu_label(b1, total=False)}), at {r8.get('sessions')} sessions {t8:.2f} "
            f"({cpu_label(b8, total=False)}): one speculative session already uses "
            f"{100 * t1 / cpus:.0f}% of the machine (its draft computes while the target verifies), so more sessions "
            f"can only make each core's work cheaper per token (batched forwards), not add cores; the aggregate grew "
            f"{_fmt(analysis.ratio(r8.get('tokens_per_s'), r1.get('tokens_per_s')))}x on "
            f"{_fmt(t8 / t1 if t1 else None)}x the CPU")
