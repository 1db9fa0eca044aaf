"""Markdown table and PNG plot of a benchmark result (the JSON dict of bench.runner.run)."""

from __future__ import annotations

import pathlib


def cpu_label(busy: dict | None, total: bool = True) -> str:
    """Busy cores per process, busiest first."""
    if not busy:
        return "n/a"
    label = ", ".join(f"{k} {v:.2f}" for k, v in sorted(busy.items(), key=lambda kv: -kv[1]))
    return label + (f" (total {sum(busy.values()):.2f})" if total else "")


def batch_label(row: dict) -> str:
    """The batching target's flags, as a sessions row records them."""
    label = f"--batch-window-ms {row['batch_window_ms']:g}"
    if row.get("batch_wait_fraction") is not None:
        label += f" --batch-wait-fraction {row['batch_wait_fraction']:g}"
    return label


def _f(x, nd=2, suffix=""):
    if x is None:
        return "n/a"
    if isinstance(x, str):
        return x
    return f"{x:.{nd}f}{suffix}"


def _g(x) -> str:
    return "n/a" if x is None else f"{x:.3g}"


def _spread(sp) -> str:
    if not sp:
        return ""
    return f" ({sp['min']:.2f}-{sp['max']:.2f})"


def category_table(cats: dict | None, head: str | None) -> list[str]:
    """The by_category block as a markdown section (nothing for a result file without one)."""
    if not cats:
        return []
    lines = ["", "## By category", "",
             f"The headline configuration ({head}) per prompt category, beside specdec target-only, plain llama.cpp on "
             "the same cores and llama.cpp with prompt lookup, from the same interleaved run.", "",
             "| category | speculative tok/s | target-only | llama.cpp | llama.cpp prompt lookup | accept rate | "
             "mean acc. len | vs target-only | vs llama.cpp | greedy = target-only |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for kind, c in cats.items():
        same = {True: "yes", False: "**no**", None: "n/a"}[c.get("greedy_identical_to_target_only")]
        lines.append(f"| {kind} | {_f(c.get('speculative_tokens_per_s'), 1)} | {_f(c.get('target_only_tokens_per_s'), 1)}"
                     f" | {_f(c.get('llamacpp_tokens_per_s'), 1)} | {_f(c.get('llamacpp_prompt_lookup_tokens_per_s'), 1)}"
                     f" | {_f(c.get('acceptance_rate'))} | {_f(c.get('mean_accepted_length'))} | "
                     f"{_f(c.get('speedup_vs_target_only'))} | {_f(c.get('speedup_vs_llamacpp'))} | {same} |")
    return lines


def markdown(res: dict) -> str:
    from bench.http_bench import markdown_lines

    lines = _setup_lines(res) + _headline_lines(res) + category_table(res.get("by_category"), res.get("headline_config"))
    lines += _targets_lines(res) + _single_session_lines(res) + _single_session_notes(res) + _sessions_lines(res)
    lines += _per_step_cost_lines(res) + _per_step_table(res) + markdown_lines(res)
    return "\n".join(lines)


def _setup_lines(res: dict) -> list[str]:
    """The title, the command and what ran on which machine."""
    s = res["settings"]
    m = res["machine"]
    lines = [f"# specdec benchmark ({res['mode']})", ""]
    lines += [f"Command: `{res.get('command') or 'python -m bench'}`", ""]
    draft = res["draft"]
    engine = (f"- target engine: **{res['engine']}** ({res.get('engine_reason')}), {res.get('target_threads')} "
              f"thread(s)" if res.get("engine") else None)  # older result files carry no engine
    lines += [*([engine] if engine else []),
              f"- target `{s['target_model']}`; draft: {draft['strategy']}"
              + (f" `{draft['model']}`" if draft.get("model") else "")
              + (f" ({draft['note']})" if draft.get("note") else ""),
              f"- {len(s['prompts'])} prompts ({', '.join(p['name'] for p in s['prompts'])}), chat template, greedy, "
              f"max_new_tokens {s['max_new_tokens']}, {s['rounds']} round(s), interleaved; {s['threads']} torch "
              f"thread per model service and in the benchmark process",
              f"- machine: {m['cpus']} CPUs"
              + (f" ({m['cpu_model']}, torch's CPU capability {m.get('cpu_flags')})" if m.get("cpu_model") else "")
              + f", load average {_f(m.get('load_average_begin', [None])[0])} at start / "
              f"{_f(m.get('load_average_end', [None])[0])} at end; torch {m['torch']}, transformers {m['transformers']}; "
              f"total {_f(m.get('total_s'), 0)} s"
              + (" (" + ", ".join(f"{k.replace('_', ' ')} {v:.0f} s" for k, v in m["phases_s"].items()) + ")"
                 if m.get("phases_s") else ""),
              *(["- CPU affinity: " + "; ".join(
                  f"{k}: " + (", ".join(f"{n} on CPU {c}" for n, c in v.items()) if isinstance(v, dict) else v)
                  for k, v in m["cpu_affinity"].items())] if isinstance(m.get("cpu_affinity"), dict) else []),
              "- optional service flags: " + ", ".join(f"`{k}` {'yes' if v else 'no'}"
                                                        for k, v in res["flags_available"].items()
                                                        if isinstance(v, bool)), ""]
    return lines


def _headline_lines(res: dict) -> list[str]:
    """The headline configuration's figures."""
    lines = []
    lines += ["## Headline", "",
              f"Headline configuration: **{res.get('headline_config')}**"
              + ("" if res.get("headline_is_pipelined") else " (no pipelined configuration available; best speculative)"),
              "", "| metric | value |", "|---|---|"]
    for key, label in [("tokens_per_s", "tokens/s"), ("speedup_vs_target_only", "speedup vs specdec target-only"),
                       ("speedup_vs_hf_assisted", f"speedup vs HF anchor ({res.get('hf_anchor')})"),
                       ("speedup_vs_hf_target_only", "speedup vs HF target-only (in-process)"),
                       ("pipelined_vs_sequential", f"pipelined vs best sequential ({res.get('best_sequential_config')})"),
                       ("pipelined_vs_sequential_same_policy", "pipelined vs sequential, same draft-length policy"),
                       ("acceptance_rate", "acceptance rate (accepted / proposed)"),
                       ("alpha", "per-token acceptance alpha (from mean accepted length)"),
                       ("mean_accepted_length", "mean accepted length (tokens per verify)"),
                       ("predicted_speedup", "predicted speedup"),
                       ("measured_over_predicted", "measured / predicted"),
                       ("decode_phase_speedup_vs_target_only",
                        "speedup vs target-only after the first streamed tokens (prefill left out)"),
                       ("measured_over_predicted_decode_phase", "measured / predicted, after the first streamed tokens"),
                       ("throughput_8_sessions_vs_1",
                        f"aggregate throughput {res.get('max_sessions')} sessions vs 1 ({res.get('sessions_sweep')})"),
                       ("system_overhead_share", "gRPC + Redis overhead per step on the critical path / target step"),
                       ("speedup_vs_llama_server", "speedup vs llama-server -np 1 (HTTP, one stream)"),
                       ("speedup_vs_llama_server_ngram", "speedup vs llama-server -np 1 --spec-type ngram-simple")]:
        lines.append(f"| {label} | {_f(res.get(key), 3 if key == 'alpha' else 2)} |")
    return lines


def _targets_lines(res: dict) -> list[str]:
    """Each target with its value and whether it was met."""
    lines = []
    lines += ["", "## Targets", "", "| target | value | met | measurement / why |", "|---|---|---|---|"]
    for t in res["targets"].values():
        met = {True: "yes", False: "**no**", None: "not measured"}[t["met"]]
        lines.append(f"| {t['target']} | {_f(t['value'])} | {met} | {t.get('why', '').replace('|', '/')} |")
    return lines


def _single_session_lines(res: dict) -> list[str]:
    """The single-session configurations' table."""
    lines = []
    lines += ["", "## Single-session configurations", "",
              "Speedups are tokens/s over specdec target-only, from the same run; the range in brackets is the "
              "min-max of the paired per-prompt ratios. Predicted = (1 - a^(g+1)) / ((1 - a)(g c + 1)) with "
              "a = alpha and g = mean proposed draft length (the paper's model: a verify costs one target step). "
              "'Predicted, CPU verify' replaces that 1 by the measured cost of a (g+1)-token forward in target "
              "steps.", "",
              "| configuration | g | tokens/s | speedup | accept rate | alpha | mean acc. len | c | predicted | "
              "measured/predicted | predicted, CPU verify | measured/predicted, CPU verify | output = target-only |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in res["configs"]:
        if c.get("kind") == "sessions":
            continue
        if not c.get("available"):
            lines.append(f"| {c['label']} | {_f(c.get('draft_len'))} | not available: {c.get('reason', '')} "
                         "| | | | | | | | | | |")
            continue
        g = c.get("draft_len")
        g = f"{g} ({c['mean_draft_len']:.2f})" if c.get("mean_draft_len") is not None else _f(g)
        lines.append(
            f"| {c['label']} | {g} | {_f(c.get('tokens_per_s'))} | {_f(c.get('speedup_vs_target_only'))}"
            f"{_spread(c.get('speedup_per_prompt'))} | {_f(c.get('acceptance_rate'))} | {_f(c.get('alpha'), 3)} | "
            f"{_f(c.get('mean_accepted_length'))} | {_g(c.get('cost_ratio_c'))} | {_f(c.get('predicted_speedup'))} | "
            f"{_f(c.get('measured_over_predicted'))} | {_f(c.get('predicted_speedup_measured_verify_cost'))} | "
            f"{_f(c.get('measured_over_predicted_measured_verify_cost'))} | {_f(c.get('output_matches_target_only'))} |")
    return lines


def _single_session_notes(res: dict) -> list[str]:
    """Notes under that table: warnings, prefetches, trimmed drafts, the HF anchors' settings."""
    lines = []
    warned = [c for c in res["configs"] if c.get("warning")]
    if warned:
        lines += [""] + [f"- **{c['label']}**: {c['warning']}" for c in warned]
    pipes = [c for c in res["configs"] if c.get("pipeline")]
    if pipes:
        lines += [""] + [f"- {c['label']}: {c['pipeline']['prefetches']:.0f} blocks prefetched, "
                         f"{c['pipeline']['hits']:.0f} used, over {c['pipeline']['verify_steps']:.0f} verify steps"
                         for c in pipes]
    trimmed = [c for c in res["configs"] if c.get("trimmed_per_verify")]
    if trimmed:
        lines += [""] + [f"- {c['label']}: {c['mean_draft_len']:.2f} tokens verified per step, "
                         f"{c['trimmed_per_verify']:.2f} more drafted and trimmed (their scores said verifying "
                         "them would not pay)" for c in trimmed]
    hf = [c for c in res["configs"] if c.get("settings")]
    if hf:
        lines += [""] + [f"- {c['label']}: " + ", ".join(f"{k}={v}" for k, v in c["settings"].items() if k != "note")
                         + (f" ({c['settings']['note']})" if c["settings"].get("note") else "") for c in hf]
        lines += ["- HF rows: mean accepted length = tokens per target forward (forward hooks); HF assisted acceptance "
                  "is approximate (tokens - target forwards) / draft forwards"]
    return lines


def _sessions_lines(res: dict) -> list[str]:
    """The concurrent sessions sweeps' table and what ran them."""
    lines = []
    sess = [c for c in res["configs"] if c.get("kind") == "sessions"]
    if sess:
        lines += ["", "## Concurrent sessions", "",
                  "Generations per session count and round (" + ", ".join(
                      f"{n}: {j}" for n, j in res['settings']['session_jobs'].items()) + ") cycle through "
                  + ", ".join(res['settings']['session_prompts']) + " and are drained by N client threads "
                  "(closed loop); aggregate tokens/s = all tokens / wall time of the whole batch.", "",
                  "| sweep | sessions | aggregate tokens/s | vs 1 session | mean per-session tokens/s | accept rate | "
                  "target verify ms/step | steps target-only by load switch | CPU cores busy |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in sess:
            if not r.get("available"):
                lines.append(f"| {r['sweep']} | not available: {r.get('reason', '')} | | | | | | | |")
                continue
            lines.append(f"| {r['sweep']}{' (' + batch_label(r) + ')' if r.get('batched_verification') else ''} "
                         f"| {r['sessions']} | {_f(r['tokens_per_s'])} | {_f(r['throughput_vs_1_session'])} | "
                         f"{_f(r['mean_session_tokens_per_s'])} | {_f(r.get('acceptance_rate'))} | "
                         f"{_f(r.get('target_verify_ms_per_step'), 1)} | {_f(r.get('load_shed_step_fraction'))} | "
                         f"{cpu_label(r.get('cpu_cores_busy'))} |")
        seen = {}
        for r in sess:
            if r.get("available") and r["sweep"] not in seen:
                seen[r["sweep"]] = " ".join(r.get("orchestrator_flags") or [])
        lines += [""] + [f"- {sweep} orchestrator: `{flags}`" for sweep, flags in seen.items()]
        lines.append("- CPU cores busy: CPU seconds (user + system, all threads) each process used during the level, "
                     "over its wall time (the machine has " + str(res["machine"]["cpus"]) + "); the clients are "
                     "the benchmark process itself")
    return lines


def _per_step_cost_lines(res: dict) -> list[str]:
    """The measured per-step costs: model steps, gRPC and Redis overheads."""
    lines = []
    mb, ov = res["microbench"], res["overheads"]
    lines += ["", "## Per-step costs", "",
              f"- target decode step (1 token, in-process): {_f(mb['target_step_ms'], 1)} ms; draft step: "
              f"{_f(mb.get('draft_step_ms'), 2)} ms; c = {_g(mb.get('c'))}",
              "- target forward over n tokens vs one step: " + ", ".join(
                  f"n={k}: {_f(v, 1)} ms ({_f(mb['verify_cost_vs_step'][k])}x)" for k, v in mb["target_block_ms"].items()),
              f"- loopback gRPC: empty unary round trip {_f(ov.get('grpc_unary_roundtrip_ms'), 2)} ms; Verify "
              f"{_f(ov.get('target_verify_rpc_ms'), 1)} ms of which the target reports {_f(ov.get('target_verify_service_ms'), 1)}"
              f" ms (overhead {_f(ov.get('target_verify_rpc_overhead_ms'), 2)} ms); Decode(1) overhead "
              f"{_f(ov.get('target_decode_rpc_overhead_ms'), 2)} ms; Propose {_f(ov.get('draft_propose_rpc_ms'), 1)} ms of "
              f"which the draft reports {_f(ov.get('draft_propose_service_ms'), 2)} ms (overhead "
              f"{_f(ov.get('draft_propose_rpc_overhead_ms'), 2)} ms); Redis per-step commit {_f(ov.get('redis_commit_ms'), 2)} ms",
              *([f"- a bare gRPC call in the benchmark process (no service code) costs {_f(ov['grpc_bare_ms'], 2)} ms beyond "
                 f"its handler's time, {_f(ov['grpc_bare_after_wait_ms'], 2)} ms when the handler first sleeps a target step "
                 f"({_f(ov.get('grpc_wait_ms'), 0)} ms): the difference is this host waking the threads that waited, and each "
                 "Verify and Propose above pays it"
                 + (f"; {_f(ov['grpc_bare_after_forward_ms'], 2)} ms when the handler runs a verify's forward of the target "
                    f"model (the floor of a Python gRPC round trip around a verify here, "
                    f"{_f(100 * ov['grpc_bare_after_forward_ms'] / mb['target_step_ms'], 1)}% of a target step)"
                    if ov.get("grpc_bare_after_forward_ms") is not None else "")]
                if ov.get("grpc_bare_after_wait_ms") is not None else []),
              f"- so a speculative step pays about {_f(ov.get('per_step_system_overhead_ms'), 1)} ms of RPC + Redis "
              f"overhead against a target step of {_f(mb['target_step_ms'], 1)} ms "
              f"({_f(100 * (ov.get('per_step_system_overhead_ms') or 0) / mb['target_step_ms'], 1)}%); with the "
              f"drafter in the orchestrator (`--draft local:ngram`: no Propose round trip) "
              f"{_f(ov.get('per_step_system_overhead_local_draft_ms'), 1)} ms "
              f"({_f(100 * (ov.get('per_step_system_overhead_local_draft_ms') or 0) / mb['target_step_ms'], 1)}%)", ""]
    return lines


def _per_step_table(res: dict) -> list[str]:
    """Each configuration's step time split into its parts, from the orchestrator's stats."""
    lines = []
    lines += ["| configuration | client ms/step | target verify ms/step | draft ms/step | RPC + orchestrator overhead "
              "ms/step | store + stream ms/step | gRPC overhead on the critical path ms/step | Redis commit ms/step "
              "| prefetch wait ms/step | gRPC + Redis / target step |", "|---|---|---|---|---|---|---|---|---|---|"]
    for c in res["configs"]:
        p = c.get("per_step_ms")
        if p:
            share = c.get("system_overhead_share")
            lines.append(f"| {c['name']} | {_f(p['client_wall'], 1)} | {_f(p['target_verify'], 1)} | "
                         f"{_f(p['draft_propose'], 1)} | {_f(p['rpc_and_orchestrator_overhead'], 1)} | "
                         f"{_f(p['store_and_stream_overhead'], 1)} | {_f(p.get('rpc_overhead'), 2)} | "
                         f"{_f(p.get('redis_commit'), 2)} ({_f(p.get('redis_commit_critical'), 2)}) | {_f(p.get('prefetch_wait'), 2)} | "
                         f"{_f(100 * share, 1) + '%' if share is not None else 'n/a'} |")
    lines += ["", "Per configuration, from the orchestrator's stats: RPC + orchestrator overhead = orchestrator step "
              "time minus the draft and target time the services report (n/a where the step mix includes target "
              "Decode steps, whose time the stats do not carry, and for pipelined configurations, where draft and "
              "verify overlap); store + stream = "
              "client wall minus orchestrator step time (Redis commit, streaming, session setup). gRPC overhead on "
              "the critical path = per call the loop waited for (Verify, Decode, a Propose that was not prefetched; a "
              "Propose carrying the prompt's KV counts as prefill) "
              "its round trip minus the time the service reports (`rpc_overhead_ms`); a prefetched Propose overlaps "
              "the verify and is not in it, the time a step still waited for one after its verify is the prefetch "
              "wait column (`prefetch_wait_ms`); Redis commit = `store_ms`, in brackets the part the steps waited for "
              "(`store_ms - store_overlapped_ms`, the critical path's: a block is committed while the next step "
              "runs); the share divides gRPC + that Redis part by the target step above.", ""]
    return lines


def plot(res: dict, path: str | pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfgs = [c for c in res["configs"] if c.get("available")]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 7), dpi=110)
    _speedup_panel(ax1, cfgs)
    _sessions_panel(ax2, cfgs)
    fig.suptitle(f"specdec benchmark ({res['mode']}), {res['settings']['max_new_tokens']} tokens/prompt, "
                 f"{len(res['settings']['prompts'])} prompts, greedy\ntarget {res['settings']['target_model']}; draft "
                 f"{res['draft']['strategy']}" + (f" {res['draft']['model']}" if res['draft'].get('model') else ""),
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _speedup_panel(ax, cfgs: list[dict]) -> None:
    """Speedup over target-only against the draft length, measured and predicted, the anchors as lines."""

    def fixed(kind):
        pts = sorted((c["draft_len"], c) for c in cfgs if c["kind"] == kind and isinstance(c.get("draft_len"), int))
        return [g for g, _ in pts], [c for _, c in pts]

    gs, seq = fixed("specdec-sequential")
    if gs:
        ax.plot(gs, [c["speedup_vs_target_only"] for c in seq], "o-", color="tab:blue", lw=2, ms=7,
                 label="specdec sequential (measured)")
        pred = [c.get("predicted_speedup") for c in seq]
        if any(p is not None for p in pred):
            ax.plot(gs, pred, "o--", color="tab:blue", alpha=0.45, label="sequential, predicted")
    gp, pipe = fixed("specdec-pipelined")
    if gp:
        ax.plot(gp, [c["speedup_vs_target_only"] for c in pipe], "s-", color="tab:red", lw=2, ms=7,
                 label="specdec pipelined (measured)")
    styles = {"specdec-seq-adaptive": ("tab:blue", ":", "sequential adaptive"),
              "specdec-pipe-adaptive": ("tab:red", ":", "pipelined adaptive"),
              "specdec-pipe-auto-adaptive": ("tab:pink", ":", "pipelined (auto) adaptive"),
              "hf-assisted": ("tab:green", "-.", "HF assisted (in-process)"),
              "hf-prompt-lookup": ("tab:olive", "-.", "HF prompt lookup (in-process)"),
              "hf-target-only": ("tab:gray", "--", "HF target-only (in-process)")}
    for c in cfgs:
        if c["name"] in styles and c.get("speedup_vs_target_only") is not None:
            color, ls, label = styles[c["name"]]
            ax.axhline(c["speedup_vs_target_only"], color=color, ls=ls, lw=1.6,
                        label=f"{label}: {c['speedup_vs_target_only']:.2f}x")
    ax.axhline(1.0, color="black", lw=1, label="specdec target-only = 1")
    ax.axhline(1.5, color="black", lw=0.8, ls=(0, (1, 3)), label="target 1.5x")
    xs = sorted(set(gs) | set(gp))
    if xs:
        ax.set_xticks(xs)
    ax.set_xlabel("draft length g (tokens per step)")
    ax.set_ylabel("speedup over specdec target-only (tokens/s ratio)")
    ax.set_title("Speedup against draft length (1 session)")
    ax.grid(alpha=0.3)
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2, frameon=False)


def _sessions_panel(ax, cfgs: list[dict]) -> None:
    """Aggregate tokens/s against concurrent sessions, per sweep, beside linear scaling and the 2x target."""
    sweeps: dict[str, list] = {}
    for c in cfgs:
        if c.get("kind") == "sessions":
            sweeps.setdefault(c["sweep"], []).append(c)
    colors = {"sessions-batched": "tab:purple", "sessions-unbatched": "tab:orange"}
    for si, (name, rows) in enumerate(sweeps.items()):
        rows.sort(key=lambda r: r["sessions"])
        n = [r["sessions"] for r in rows]
        tps = [r["tokens_per_s"] for r in rows]
        label = name + (f" ({batch_label(rows[0])})" if rows[0].get("batched_verification") else "")
        ax.plot(n, tps, "o-", color=colors.get(name), lw=2, ms=7, label=label)
        for x, y, r in zip(n, tps, rows):
            ax.annotate(f"{r['throughput_vs_1_session']:.2f}x", (x, y), textcoords="offset points",
                         xytext=(5, 7 if si == 0 else -14), fontsize=8.5, color=colors.get(name))
        ax.plot(n, [tps[0] * k / n[0] for k in n], ":", color=colors.get(name), alpha=0.5,
                 label=f"{name}: linear scaling")
        ax.plot([n[-1]], [2 * tps[0]], "x", color=colors.get(name), ms=9, mew=2, label=f"{name}: target 2x of 1")
    if sweeps:
        ax.set_xscale("log", base=2)
        allx = sorted({r["sessions"] for rows in sweeps.values() for r in rows})
        ax.set_xticks(allx)
        ax.set_xticklabels([str(x) for x in allx])
        top = max(r["tokens_per_s"] for rows in sweeps.values() for r in rows)
        ax.set_ylim(0, max(top, 2 * min(rows[0]["tokens_per_s"] for rows in sweeps.values())) * 1.25)
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2, frameon=False)
    else:
        ax.text(0.5, 0.5, "no sessions sweep", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("concurrent sessions")
    ax.set_ylabel("aggregate tokens/s")
    ax.set_title("Throughput against sessions")
    ax.grid(alpha=0.3)
