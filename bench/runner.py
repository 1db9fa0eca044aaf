"""Run every configuration side by side on the same prompts and machine, and summarise.

Flow: resolve the target's engine, the draft strategy and the target's threads as `specdec run` does
(--engine auto: llama.cpp for the GGUF target on a CPU, drafting with n-gram prompt lookup in the orchestrator);
load the target (and draft) in this process for the Hugging Face anchors; start the specdec services; measure the per-step overheads (gRPC round trip, Redis commit) and the
model step times; warm every configuration up once; then time all single-session configurations
interleaved prompt by prompt (the order rotates every prompt, so slow drift of a shared machine is
spread over all of them); then the concurrency sweep, its session counts also rotated per round.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import pathlib
import platform
import sys
import time

from bench import analysis
from specdec.eval_prompts import CATEGORIES, Prompt, encode, select
from bench.configs import (RUN_DEFAULT, _draft_note, build_configs, headline, orchestrator_specs,
                           session_job_count, sessions_sweep_flags)
from bench.categories import by_category
from bench.llama_server import add_cli_option as add_llama_server_option
from bench.llama_server_rows import llama_server_configs, runner_keys as llama_server_keys
from bench.llamacpp_rows import PLAIN, PROMPT_LOOKUP, headline_vs_llamacpp, llamacpp_configs, llamacpp_session
from bench.measure import (_run_one, measure_overheads, microbench, run_sessions_level, target_only_breakdown,
                           verify_forward)
from bench.summary import evaluate_targets, summarise_config, summarise_sessions

log = logging.getLogger("bench")


RESULTS_DIR = pathlib.Path(__file__).resolve().parent / "results"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true",
                   help="a short run: one prompt of each category, 48 tokens, g = 4, no tree, HF target-only or "
                        "--pipeline on")
    p.add_argument("--json", action="store_true", help="print the result JSON on stdout")
    p.add_argument("--serving", action="store_true",
                   help="the serving benchmark instead (bench/serving.py: closed-loop 1..64 streams and Poisson "
                        "arrivals, speculative against target-only; `python -m bench --serving --help`)")
    p.add_argument("--target-model", default="smollm2")
    p.add_argument("--draft-model", default="smollm2-draft")
    p.add_argument("--engine", choices=["auto", "llamacpp", "torch"], default="auto",
                   help="the target's engine, resolved as `specdec run` resolves it (auto: llama.cpp for a GGUF "
                        "target on a CPU where llama-cpp-python is installed, drafting with n-gram prompt lookup in "
                        "the orchestrator and the target on the draft's cores; else torch). --engine torch: the "
                        "PyTorch engine with its own default draft")
    p.add_argument("--draft-strategy", choices=["auto", "model", "ngram", "hybrid", "local-ngram", "local-suffix",
                                                "quantized"],
                   default="auto", help="auto: as `specdec run` picks it for the engine (docs/engines.md)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="per prompt (default 96; quick 48)")
    p.add_argument("--num-prompts", type=int, default=None,
                   help="prompts from specdec/eval_prompts.py, round-robin over the categories (default 2 per "
                        "category; quick 1 per category)")
    p.add_argument("--rounds", type=int, default=None, help="repeats of the interleaved sweep (default 2; quick 1)")
    p.add_argument("--draft-lens", default=None, help="fixed draft lengths (default 2,3,4,6; quick 4)")
    p.add_argument("--pipelined-sweep", action=argparse.BooleanOptionalAction, default=None,
                   help="also run pipelined at each fixed draft length (default: on; off in quick mode)")
    p.add_argument("--tree", action=argparse.BooleanOptionalAction, default=None,
                   help="also run tree speculation at the largest draft length's node budget (default: on; off in "
                        "quick mode)")
    p.add_argument("--pipe-on", action=argparse.BooleanOptionalAction, default=None,
                   help="also run --pipeline on (prefetch every block; default: on; off in quick mode, where "
                        "--pipeline auto stands for pipelining)")
    p.add_argument("--hf-target-only", action=argparse.BooleanOptionalAction, default=None,
                   help="also run HF generate without a draft, the in-process baseline (default: on; off in quick "
                        "mode)")
    p.add_argument("--heuristic", action=argparse.BooleanOptionalAction, default=None,
                   help="also run the adaptive draft length with transformers' heuristic schedule "
                        "(--draft-len-policy heuristic) next to the goodput policy (default: on; off in quick mode)")
    p.add_argument("--sessions", default="1,2,4,8", help="concurrent sessions for the throughput sweep")
    p.add_argument("--session-jobs", type=int, default=0,
                   help="at least this many generations per session count and round (default 0: the least common "
                        "multiple of the session count and the sweep's prompt count, so every client thread gets "
                        "the same number of generations and every prompt runs equally often)")
    p.add_argument("--session-gens-per-client", type=int, default=2,
                   help="at least this many generations per client thread: with one each, the aggregate measures "
                        "mostly the ramp-up (every prompt prefilled at once) and the tail, not concurrent decoding")
    p.add_argument("--session-prompts", type=int, default=4, help="prompts the sessions sweep cycles through")
    p.add_argument("--unbatched-sweep", action=argparse.BooleanOptionalAction, default=None,
                   help="also sweep sessions without --batch-window-ms (default: on; off in quick mode "
                        "when batching is available)")
    p.add_argument("--batch-window-ms", type=float, default=5.0, help="target --batch-window-ms for the sessions sweep")
    p.add_argument("--batch-wait-fraction", type=float, default=0.5,
                   help="target --batch-wait-fraction for the sessions sweep (where the checkout has it)")
    p.add_argument("--draft-vocab", type=int, default=8192,
                   help="the draft model proposes only ids below N (draft --draft-vocab; 0 = all)")
    p.add_argument("--speculation-max-sessions", type=int, default=0,
                   help="the batched sessions sweep's orchestrator decodes target-only above this many generating "
                        "sessions (default 0 = no fixed switch: the goodput draft length costs each block as part "
                        "of the batch and stops drafting when that does not pay)")
    p.add_argument("--prompt-lookup-num-tokens", type=int, default=10, help="HF prompt-lookup anchor")
    p.add_argument("--warmup-tokens", type=int, default=16)
    p.add_argument("--threads", type=int, default=1,
                   help="threads per model service and torch threads in this process (a llama.cpp target drafting "
                        "in the orchestrator also gets the draft's, as `specdec run` gives it)")
    p.add_argument("--pin-cpus", choices=["auto", "off"], default="auto",
                   help="auto: the target and the draft services on CPUs of their own, as `specdec run` starts them "
                        "(specdec/ops/cpu_affinity.py); off: the OS scheduler places them")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--out-dir", default=None,
                   help="where latest.json / latest.md / latest.png go (default: bench/results/quick or /full)")
    p.add_argument("--log-dir", default=None, help="service logs (default: a temp dir)")
    p.add_argument("--no-progress", action="store_true")
    add_llama_server_option(p)
    a = p.parse_args(argv)
    if a.serving:
        p.error("--serving has options of its own: `python -m bench --serving --help` (bench/serving.py)")
    q = a.quick
    a.out_dir = a.out_dir or str(RESULTS_DIR / ("quick" if q else "full"))  # one current result set per mode
    a.max_new_tokens = a.max_new_tokens or (48 if q else 96)
    a.num_prompts = a.num_prompts or len(CATEGORIES) * (1 if q else 2)
    a.rounds = a.rounds or (1 if q else 2)
    a.draft_lens = [int(x) for x in (a.draft_lens or ("4" if q else "2,3,4,6")).split(",") if x.strip()]
    a.sessions = sorted({int(x) for x in a.sessions.split(",") if x.strip()})
    if a.pipelined_sweep is None:
        a.pipelined_sweep = not q
    # Quick mode keeps what the targets need (under 3 minutes here); the full run adds the rest.
    a.tree = (not q) if a.tree is None else a.tree
    a.pipe_on = (not q) if a.pipe_on is None else a.pipe_on
    a.hf_target_only = (not q) if a.hf_target_only is None else a.hf_target_only
    a.heuristic = (not q) if a.heuristic is None else a.heuristic
    return a


def run(args: argparse.Namespace) -> dict:
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    import torch
    from tqdm import tqdm

    from bench import http_bench
    from bench.services import BenchServices, available_flags
    from specdec.client import SpecdecClient
    from specdec.ops.cpu_affinity import describe as describe_cpu_plan
    from specdec.models import load_model
    from specdec.core.strategies import MODEL_STRATEGIES, QUANTIZED

    import warnings

    import transformers

    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", message=r".*past_key_values.*deprecated.*")
    torch.set_num_threads(args.threads)
    t_begin = time.time()
    load_begin = os.getloadavg()
    phases: dict[str, float] = {}  # where the run's wall time went, to keep --quick under 3 minutes
    mark = [time.perf_counter()]

    def phase(name: str) -> None:
        now = time.perf_counter()
        phases[name] = round(phases.get(name, 0.0) + now - mark[0], 1)
        mark[0] = now

    flags = available_flags()
    if not flags["target --batch-wait-fraction"]:
        args.batch_wait_fraction = None  # an older checkout's target: its batches wait the window only
    services = BenchServices(args.target_model, args.draft_model, args.draft_strategy, threads=args.threads,
                             device=args.device, dtype=args.dtype, adaptive=flags["orchestrator --adaptive-draft-len"],
                             engine=args.engine,
                             batch_window_ms=args.batch_window_ms if flags["target --batch-window-ms"] else None,
                             batch_wait_fraction=args.batch_wait_fraction,
                             draft_vocab=args.draft_vocab,
                             pin_cpus=args.pin_cpus == "auto" and flags["target --cpu-affinity"],
                             log_dir=args.log_dir)
    strategy = services.strategy  # resolved with the engine, as `specdec run` does
    services.orchestrators = orchestrator_specs(args, flags, strategy, services.engine)
    args.target_threads = services.target_threads
    # llama.cpp: the headline is what `specdec run` runs by default; torch: the fastest pipelined configuration
    args.headline_fixed = RUN_DEFAULT if services.engine == "llamacpp" else None
    t0 = time.perf_counter()
    services.launch()  # the services load their models while this process loads its own (HF anchors)
    try:
        target = load_model(args.target_model, device=args.device, dtype=args.dtype)
        draft = None
        if strategy == QUANTIZED:  # the same int8 weights, on transformers' forward (HF's assisted generation)
            from specdec.models.cpu_kernels import quantize_linears

            draft = load_model(args.target_model, device=args.device, dtype=args.dtype, prepack="off")
            draft.name = f"{draft.name}[int8]"
            quantize_linears(draft.model)
        elif strategy in MODEL_STRATEGIES:
            draft = load_model(args.draft_model, device=args.device, dtype=args.dtype)
        if draft is not None and strategy != QUANTIZED:  # the anchors use the same draft as the service
            from draft_service.proposers.model import limit_draft_vocab

            limit_draft_vocab(draft, args.draft_vocab)
        tiny_vocab = target.vocab_size if args.target_model.strip().lower().startswith("tiny") else None
        prompts: list[Prompt] = select(args.num_prompts)
        ids = {p.name: encode(p, target.tokenizer, chat=True, tiny_vocab=tiny_vocab) for p in prompts}
    except BaseException:
        services.stop()
        raise
    phase("load_models")
    not_measured: dict[str, str] = {}
    close_anchors: list = []
    progress = None
    session_rows: list[dict] = []
    try:
        services.wait()
        startup_s = time.perf_counter() - t0  # launch to ready, the models loaded here meanwhile
        phase("service_startup")
        anchors, close_anchors = llamacpp_configs(args, target.eos_token_ids)
        servers, close_servers = llama_server_configs(args, services.target_threads, list(ids.values()))
        anchors, close_anchors = anchors + servers, close_anchors + close_servers
        cfgs = build_configs(args, services, target, draft, flags) + anchors
        live = [c for c in cfgs if c.available]
        first = ids[prompts[0].name]
        session, close_session = (llamacpp_session(args.target_model, services.target_threads, first)
                                  if services.engine == "llamacpp" else (None, None))
        try:  # the target step of the engine that serves: torch in this process, or the GGUF through llama_decode
            micro = microbench(target, draft, first, args.draft_lens, target_session=session, engine=services.engine)
            phase("microbench")
            overheads = measure_overheads(services, first, k=max(args.draft_lens), step_ms=micro["target_step_ms"],
                                          forward=verify_forward(target, first, max(args.draft_lens) + 1, session))
        finally:
            if close_session is not None:
                close_session()
        phase("overheads")

        batched = "target-batched" in services.addresses
        if not batched:
            not_measured["batched"] = "the target has no --batch-window-ms flag in this checkout"
        unbatched = args.unbatched_sweep if args.unbatched_sweep is not None else (not args.quick or not batched)
        n_sweeps = int(batched) + int(unbatched)
        sweep_prompts = prompts[: max(1, min(args.session_prompts, len(prompts)))]

        def jobs_for(n: int) -> list[tuple[str, list[int]]]:
            count = session_job_count(args, n, len(sweep_prompts))
            return [(sweep_prompts[i % len(sweep_prompts)].name, ids[sweep_prompts[i % len(sweep_prompts)].name])
                    for i in range(count)]

        n_single = len(live) * (1 + args.rounds * len(prompts))
        n_sessions = n_sweeps * (1 + args.rounds * len(args.sessions))
        progress = tqdm(total=n_single + n_sessions, file=sys.stderr, disable=args.no_progress, desc="bench",
                        unit="run", dynamic_ncols=True)
        for cfg in live:  # warm-up: every configuration once, untimed
            progress.set_postfix_str(f"warm-up {cfg.name}")
            _run_one(cfg, first, args.warmup_tokens, prompts[0].name, -1)
            progress.update(1)
        phase("warmup")
        for r in range(args.rounds):
            for pi, prompt in enumerate(prompts):
                k = (r * len(prompts) + pi) % len(live)
                for cfg in live[k:] + live[:k]:
                    if not cfg.available:
                        progress.update(1)
                        continue
                    progress.set_postfix_str(f"round {r + 1} {prompt.name} {cfg.name}")
                    s = _run_one(cfg, ids[prompt.name], args.max_new_tokens, prompt.name, r)
                    if s is not None:
                        cfg.samples.append(s)
                    progress.update(1)

        phase("single_session_configs")
        http = http_bench.run_in_bench(services, cfgs, [(p.name, ids[p.name]) for p in prompts], args, not_measured)
        phase("http_vs_grpc")
        pinned = describe_cpu_plan(services.cpu_plan)
        services.unpin()  # the sweeps run as `specdec up`: many sessions' gRPC work needs the other CPU too
        # The sessions sweeps run the headline configuration: the fastest pipelined one (else the fastest
        # speculative one) with its orchestrator flags and draft length.
        head_cfg = headline(cfgs, args.headline_fixed)
        sweeps = []
        if head_cfg is not None:
            if batched:
                extra = [*head_cfg.orchestrator_extra, *sessions_sweep_flags(args, flags)]
                twin = f"{head_cfg.orchestrator}-batched"
                if twin not in services.addresses:  # started already for a pipelined headline
                    services.add_orchestrators({twin: ("target-batched", extra)})
                sweeps.append(("sessions-batched", services.addresses[twin], True, "target-batched"))
            if unbatched:
                sweeps.append(("sessions-unbatched", services.addresses[head_cfg.orchestrator], False, "target"))
        else:
            not_measured["throughput_8_sessions_vs_1"] = "no speculative configuration ran"
        n_max = max(args.sessions)
        for name, addr, is_batched, tkind in sweeps:
            clients = [SpecdecClient(addr) for _ in range(n_max)]
            levels: dict[int, list] = {n: [] for n in args.sessions}
            cpu: dict[int, list[dict[str, float]]] = {n: [] for n in args.sessions}  # CPU seconds per process
            g = head_cfg.draft_len or 0
            try:
                progress.set_postfix_str(f"warm-up {name}")
                run_sessions_level(n_max, jobs_for(n_max)[:n_max], args.warmup_tokens, clients, g)
                progress.update(1)
                for r in range(args.rounds):
                    order = args.sessions if r % 2 == 0 else list(reversed(args.sessions))
                    for n in order:
                        progress.set_postfix_str(f"round {r + 1} {name} x{n}")
                        cpu0 = services.cpu_seconds()
                        wall, samples = run_sessions_level(n, jobs_for(n), args.max_new_tokens, clients, g)
                        cpu1 = services.cpu_seconds()
                        for s in samples:
                            s.round = r
                        levels[n].append((wall, samples))
                        cpu[n].append({k: cpu1[k] - cpu0[k] for k in cpu1 if k in cpu0})
                        progress.update(1)
                session_rows += summarise_sessions(name, tkind, levels, is_batched, head_cfg,
                                                   services.orchestrator_flags(extra if is_batched
                                                                               else head_cfg.orchestrator_extra),
                                                   args.batch_window_ms if is_batched else None,
                                                   args.batch_wait_fraction if is_batched else None, cpu)
            except Exception as e:  # noqa: BLE001
                log.error("%s failed: %s", name, e)
                session_rows.append({"name": name, "kind": "sessions", "sweep": name, "available": False,
                                     "reason": f"failed during the run: {type(e).__name__}: {str(e)[:300]}"})
            finally:
                for c in clients:
                    c.close()
        phase("sessions_sweeps")
    finally:
        if progress is not None:
            progress.close()
        services.stop()
        for close in close_anchors:
            close()

    baseline = next(c for c in cfgs if c.name == "specdec-target-only")
    reference = {}
    for s in baseline.samples:
        reference.setdefault(s.prompt, s.tokens)
    rows = [summarise_config(c, baseline, micro, strategy, reference, services.engine) for c in cfgs]
    res = _assemble(args, rows, session_rows, micro, overheads, flags, strategy, draft, prompts, ids, not_measured)
    res.update(headline_vs_llamacpp(res, args.threads, os.cpu_count() or 1, services.target_threads))
    target_only_row = next((r for r in rows if r["name"] == "specdec-target-only"), {})
    res["overheads"]["target_only_ms_per_token"] = target_only_breakdown(target_only_row,
                                                                         res.get("llamacpp_tokens_per_s"))
    res["target_only_vs_llamacpp"] = analysis.ratio(res.get("target_only_tokens_per_s"),
                                                    res.get("llamacpp_tokens_per_s"))
    res.update(llama_server_keys(res))
    plain = f"{PLAIN}-t{res['llamacpp_threads']}" if res.get("llamacpp_threads") else None
    lookup = next((c.name for c in cfgs if c.kind == PROMPT_LOOKUP), None)
    res["by_category"] = by_category(prompts, cfgs, res.get("headline_config"), plain, lookup)
    res.update(engine=services.engine, engine_reason=services.engine_reason, target_threads=services.target_threads)
    res.update(http=http, http_grpc_ratio=http and http["http_grpc_ratio"], ttft_ms=http and http["ttft_ms"])
    res["machine"]["cpu_affinity"] = {
        "single-session configurations": pinned or "not pinned (the OS scheduler places the services)",
        "sessions sweeps": "not pinned, as `specdec up` (8 sessions ran 4-18% slower pinned)"}
    res["machine"].update(load_average_begin=load_begin, load_average_end=os.getloadavg(),
                          service_startup_s=startup_s, total_s=time.time() - t_begin, phases_s=phases)
    res["targets"] = evaluate_targets(res)
    return res


def cpu_model() -> str:
    """The CPU's name (/proc/cpuinfo): the hosts differ between runs, and so do their ratios."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _assemble(args, rows, session_rows, micro, overheads, flags, strategy, draft, prompts, ids, not_measured) -> dict:
    import torch
    import transformers

    by = {r["name"]: r for r in rows}
    ok = lambda r: r.get("available") and r.get("tokens_per_s")  # noqa: E731
    pipelined = [r for r in rows if r["kind"] == "specdec-pipelined" and ok(r)]
    sequential = [r for r in rows if r["kind"] == "specdec-sequential" and ok(r)]
    fixed = getattr(args, "headline_fixed", None)
    if fixed and ok(by.get(fixed, {})):  # the llama.cpp engine: what `specdec run` runs by default
        head = by[fixed]
    elif pipelined:
        if fixed:
            not_measured["headline_config"] = (f"{fixed} (`specdec run`'s default) did not run: "
                                               f"{by.get(fixed, {}).get('reason', 'not configured')}; the fastest "
                                               "pipelined configuration stands in")
        head = max(pipelined, key=lambda r: r["tokens_per_s"])
    else:
        head = max(sequential, key=lambda r: r["tokens_per_s"]) if sequential else None
        not_measured["pipelined_speedup_vs_target_only"] = next(
            (r.get("reason", "") for r in rows if r["kind"] == "specdec-pipelined"), "no pipelined configuration")
        not_measured["pipelined_faster_than_sequential"] = not_measured["pipelined_speedup_vs_target_only"]
    best_seq = max(sequential, key=lambda r: r["tokens_per_s"]) if sequential else None
    hf_anchor = by.get("hf-assisted") if ok(by.get("hf-assisted", {})) else by.get("hf-prompt-lookup")
    if hf_anchor is not None and not ok(hf_anchor):
        hf_anchor = None
    sweep_name = next((n for n in ("sessions-batched", "sessions-unbatched")
                       if any(r.get("sweep") == n and r.get("available") for r in session_rows)), None)
    sweep = [r for r in session_rows if r.get("sweep") == sweep_name and r.get("available")]
    s1 = next((r for r in sweep if r["sessions"] == 1), None)
    smax = max(sweep, key=lambda r: r["sessions"]) if sweep else None
    if smax is None:
        not_measured["throughput_8_sessions_vs_1"] = next((r.get("reason", "") for r in session_rows), "no sweep ran")
    head_tps = head["tokens_per_s"] if head else None
    same_policy = None
    if head and head["kind"] == "specdec-pipelined":
        # pipelined adaptive (on or auto) vs sequential adaptive; pipelined g=N vs sequential g=N
        twin = by.get(head["name"].replace("-pipe-auto-", "-seq-").replace("-pipe-", "-seq-"))
        same_policy = analysis.ratio(head_tps, twin.get("tokens_per_s")) if twin and ok(twin) else None
    res = {
        "benchmark": "specdec",
        "command": None,  # set by main()
        "mode": "quick" if args.quick else "full",
        "headline_config": head["name"] if head else None,
        "headline_is_pipelined": bool(head and head["kind"] == "specdec-pipelined"),
        "speedup_vs_target_only": head.get("speedup_vs_target_only") if head else None,
        "speedup_vs_hf_assisted": analysis.ratio(head_tps, hf_anchor["tokens_per_s"]) if head and hf_anchor else None,
        "hf_anchor": hf_anchor["name"] if hf_anchor else None,
        "speedup_vs_hf_prompt_lookup": analysis.ratio(head_tps, by.get("hf-prompt-lookup", {}).get("tokens_per_s"))
        if head else None,
        "speedup_vs_hf_target_only": analysis.ratio(head_tps, by.get("hf-target-only", {}).get("tokens_per_s"))
        if head else None,
        "pipelined_vs_sequential": (analysis.ratio(head_tps, best_seq["tokens_per_s"])
                                    if head and head["kind"] == "specdec-pipelined" and best_seq else None),
        "best_sequential_config": best_seq["name"] if best_seq else None,
        "pipelined_vs_sequential_same_policy": same_policy,
        "acceptance_rate": head.get("acceptance_rate") if head else None,
        "alpha": head.get("alpha") if head else None,
        "mean_accepted_length": head.get("mean_accepted_length") if head else None,
        "predicted_speedup": head.get("predicted_speedup") if head else None,
        "measured_over_predicted": head.get("measured_over_predicted") if head else None,
        "decode_phase_speedup_vs_target_only": head.get("decode_phase_speedup_vs_target_only") if head else None,
        "measured_over_predicted_decode_phase": head.get("measured_over_predicted_decode_phase") if head else None,
        "tokens_per_s": head_tps,
        "target_only_tokens_per_s": by["specdec-target-only"].get("tokens_per_s"),
        "throughput_8_sessions_vs_1": analysis.ratio(smax["tokens_per_s"], s1["tokens_per_s"]) if smax and s1 else None,
        "system_overhead_share": head.get("system_overhead_share") if head else None,
        "system_overhead_ms_per_step": head.get("system_overhead_ms_per_step") if head else None,
        "sessions_sweep": sweep_name,
        "max_sessions": smax["sessions"] if smax else None,
        "draft": {"strategy": strategy,
                  "model": None if draft is None else draft.name if strategy == "quantized" else args.draft_model,
                  "note": _draft_note(args, strategy)},
        "flags_available": flags,
        "settings": {"target_model": args.target_model, "max_new_tokens": args.max_new_tokens,
                     "prompts": [{"name": p.name, "kind": p.kind, "prompt_tokens": len(ids[p.name])} for p in prompts],
                     "rounds": args.rounds, "draft_lens": args.draft_lens, "sessions": args.sessions,
                     "session_jobs": {n: session_job_count(args, n, min(args.session_prompts, len(prompts)))
                                      for n in args.sessions},
                     "session_prompts": [p.name for p in prompts[: max(1, min(args.session_prompts, len(prompts)))]],
                     "batch_window_ms": args.batch_window_ms
                     if flags["target --batch-window-ms"] else None,
                     "batch_wait_fraction": args.batch_wait_fraction, "threads": args.threads,
                     "target_threads": getattr(args, "target_threads", args.threads),
                     "decoding": "greedy (temperature 0)", "chat_template": True, "warmup_tokens": args.warmup_tokens,
                     "timing": "client wall time per generation (request sent -> final message), prefill included; "
                               "tokens/s = all generated tokens / all wall time of a configuration",
                     "interleaving": "every prompt runs every configuration back to back, the order rotated by one "
                                     "per prompt; session counts alternate order per round"},
        "machine": {"cpus": os.cpu_count(), "cpu_model": cpu_model(), "cpu_flags": torch.backends.cpu.get_cpu_capability(),
                    "platform": platform.platform(), "python": platform.python_version(),
                    "torch": torch.__version__, "transformers": transformers.__version__,
                    "device": str(getattr(draft, "device", None) or args.device)},
        "microbench": micro,
        "overheads": overheads,
        "not_measured": not_measured,
        "configs": rows + session_rows,
    }
    return res


def write_outputs(res: dict, out_dir: str | os.PathLike) -> dict[str, str]:
    from bench.report import markdown, plot

    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "latest.json", "markdown": out / "latest.md", "plot": out / "latest.png"}
    paths["json"].write_text(json.dumps(res, indent=2, default=float) + "\n")
    paths["markdown"].write_text(markdown(res))
    plot(res, paths["plot"])
    return {k: str(v) for k, v in paths.items()}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    from specdec.core.grpc_util import StartupError

    try:
        res = run(args)
    except StartupError as e:  # an --engine that cannot serve the target: say why instead of a traceback
        print(f"python -m bench: {e}", file=sys.stderr)
        return 2
    res["command"] = "python -m bench " + " ".join(argv)
    res["outputs"] = write_outputs(res, args.out_dir)
    if args.json:
        print(json.dumps(res, indent=2, default=float))
    else:
        print(open(res["outputs"]["markdown"]).read())
    return 0
