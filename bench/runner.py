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
import sys
import time

from bench import analysis
from specdec.eval_prompts import CATEGORIES, encode, select
from bench.configs import Config, RUN_DEFAULT, build_configs, headline, orchestrator_specs, sessions_sweep_flags
from bench.categories import by_category
from bench.llama_server import add_cli_option as add_llama_server_option
from bench.llama_server_rows import llama_server_configs, runner_keys as llama_server_keys
from bench.llamacpp_rows import PLAIN, PROMPT_LOOKUP, headline_vs_llamacpp, llamacpp_configs, llamacpp_session
from bench.measure import (_run_one, measure_overheads, microbench, run_sessions_level, target_only_breakdown,
                           verify_forward)
from bench.result import Measured, assemble
from bench.run_state import BenchRun
from bench.summary import SessionSweep, evaluate_targets, summarise_config, summarise_sessions

log = logging.getLogger("bench")


RESULTS_DIR = pathlib.Path(__file__).resolve().parent / "results"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    for add_flags in (_mode_flags, _model_flags, _configuration_flags, _sessions_flags, _machine_flags,
                      _output_flags, add_llama_server_option):
        add_flags(p)
    a = p.parse_args(argv)
    if a.serving:
        p.error("--serving has options of its own: `python -m bench --serving --help` (bench/serving.py)")
    return _mode_defaults(a)


def _mode_flags(p: argparse.ArgumentParser) -> None:
    """Which benchmark, how long a run, what it prints."""
    p.add_argument("--quick", action="store_true",
                   help="a short run: one prompt of each category, 48 tokens, g = 4, no tree, HF target-only or "
                        "--pipeline on")
    p.add_argument("--json", action="store_true", help="print the result JSON on stdout")
    p.add_argument("--serving", action="store_true",
                   help="the serving benchmark instead (bench/serving.py: closed-loop 1..64 streams and Poisson "
                        "arrivals, speculative against target-only; `python -m bench --serving --help`)")


def _model_flags(p: argparse.ArgumentParser) -> None:
    """The target, the draft and the engine, resolved as `specdec run` resolves them."""
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
    p.add_argument("--draft-vocab", type=int, default=8192,
                   help="the draft model proposes only ids below N (draft --draft-vocab; 0 = all)")


def _configuration_flags(p: argparse.ArgumentParser) -> None:
    """The single-session configurations: prompts, lengths, which ones run, the anchors."""
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
    p.add_argument("--prompt-lookup-num-tokens", type=int, default=10, help="HF prompt-lookup anchor")
    p.add_argument("--warmup-tokens", type=int, default=16)


def _sessions_flags(p: argparse.ArgumentParser) -> None:
    """The concurrent sessions sweep and its batching target."""
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
    p.add_argument("--speculation-max-sessions", type=int, default=None,
                   help="the batched sessions sweep's orchestrator decodes target-only above this many generating "
                        "sessions (default: as `specdec up` runs the engine, 1 on llama.cpp, none on torch; 0 = no "
                        "fixed switch: the goodput draft length costs each block as part of the batch and stops "
                        "drafting when that does not pay)")


def _machine_flags(p: argparse.ArgumentParser) -> None:
    """Threads, CPU placement, device and dtype."""
    p.add_argument("--threads", type=int, default=1,
                   help="threads per model service and torch threads in this process (a llama.cpp target drafting "
                        "in the orchestrator also gets the draft's, as `specdec run` gives it)")
    p.add_argument("--pin-cpus", choices=["auto", "off"], default="auto",
                   help="auto: the target and the draft services on CPUs of their own, as `specdec run` starts them "
                        "(specdec/ops/cpu_affinity.py); off: the OS scheduler places them")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")


def _output_flags(p: argparse.ArgumentParser) -> None:
    """Where the results and the service logs go."""
    p.add_argument("--out-dir", default=None,
                   help="where latest.json / latest.md / latest.png go (default: bench/results/quick or /full)")
    p.add_argument("--log-dir", default=None, help="service logs (default: a temp dir)")
    p.add_argument("--no-progress", action="store_true")


def _mode_defaults(a: argparse.Namespace) -> argparse.Namespace:
    """Fill what --quick or a full run decides where no flag did."""
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

    from bench import http_bench
    from bench.services import available_flags
    from specdec.ops.cpu_affinity import describe as describe_cpu_plan

    _quiet_libraries()
    torch.set_num_threads(args.threads)
    t_begin = time.time()
    load_begin = os.getloadavg()
    flags = available_flags()
    if not flags["target --batch-wait-fraction"]:
        args.batch_wait_fraction = None  # an older checkout's target: its batches wait the window only
    bench = BenchRun(args, flags, _bench_services(args, flags))
    t0 = time.perf_counter()
    bench.services.launch()  # the services load their models while this process loads its own (HF anchors)
    try:
        _load_models(bench)
    except BaseException:
        bench.services.stop()
        raise
    bench.phase("load_models")
    close_anchors: list = []
    session_rows: list[dict] = []
    try:
        bench.services.wait()
        startup_s = time.perf_counter() - t0  # launch to ready, the models loaded here meanwhile
        bench.phase("service_startup")
        cfgs, close_anchors = _configurations(bench)
        micro, overheads = _step_costs(bench)
        sweeps = _sweeps_to_run(bench)
        live = [c for c in cfgs if c.available]
        bench.progress = _progress_bar(bench, len(live), len(sweeps))
        _single_session_rounds(bench, live)
        http = http_bench.run_in_bench(bench.services, cfgs, [(p.name, bench.ids[p.name]) for p in bench.prompts],
                                       args, bench.not_measured)
        bench.phase("http_vs_grpc")
        pinned = describe_cpu_plan(bench.services.cpu_plan)
        bench.services.unpin()  # the sweeps run as `specdec up`: many sessions' gRPC work needs the other CPU too
        session_rows = _sessions_sweeps(bench, cfgs, sweeps)
        bench.phase("sessions_sweeps")
    finally:
        if bench.progress is not None:
            bench.progress.close()
        bench.services.stop()
        for close in close_anchors:
            close()
    res = _result(bench, cfgs, session_rows, micro, overheads)
    res.update(http=http, http_grpc_ratio=http and http["http_grpc_ratio"], ttft_ms=http and http["ttft_ms"])
    res["machine"]["cpu_affinity"] = {
        "single-session configurations": pinned or "not pinned (the OS scheduler places the services)",
        "sessions sweeps": "not pinned, as `specdec up` (8 sessions ran 4-18% slower pinned)"}
    res["machine"].update(load_average_begin=load_begin, load_average_end=os.getloadavg(),
                          service_startup_s=startup_s, total_s=time.time() - t_begin, phases_s=bench.phases)
    res["targets"] = evaluate_targets(res)
    return res


def _quiet_libraries() -> None:
    import warnings

    import transformers

    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", message=r".*past_key_values.*deprecated.*")


def _bench_services(args: argparse.Namespace, flags: dict):
    """The specdec services as `specdec run` starts them, not launched yet; settles the engine's choices in args."""
    from bench.services import BenchServices

    services = BenchServices(args.target_model, args.draft_model, args.draft_strategy, threads=args.threads,
                             device=args.device, dtype=args.dtype, adaptive=flags["orchestrator --adaptive-draft-len"],
                             engine=args.engine,
                             batch_window_ms=args.batch_window_ms if flags["target --batch-window-ms"] else None,
                             batch_wait_fraction=args.batch_wait_fraction,
                             draft_vocab=args.draft_vocab,
                             pin_cpus=args.pin_cpus == "auto" and flags["target --cpu-affinity"],
                             log_dir=args.log_dir)
    if args.speculation_max_sessions is None:  # the sessions sweep as `specdec up` serves on this engine
        from launcher.stack import LLAMACPP_SPECULATION_MAX_SESSIONS

        args.speculation_max_sessions = LLAMACPP_SPECULATION_MAX_SESSIONS if services.engine == "llamacpp" else 0
    services.orchestrators = orchestrator_specs(args, flags, services.strategy, services.engine)
    args.target_threads = services.target_threads
    # llama.cpp: the headline is what `specdec run` runs by default; torch: the fastest pipelined configuration
    args.headline_fixed = RUN_DEFAULT if services.engine == "llamacpp" else None
    return services


def _load_models(bench: BenchRun) -> None:
    """The target (and the draft the anchors use) in this process, and the prompts' token ids."""
    from specdec.core.strategies import MODEL_STRATEGIES, QUANTIZED
    from specdec.models.loading import load_model

    args, strategy = bench.args, bench.strategy
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
    bench.target, bench.draft = target, draft
    bench.prompts = select(args.num_prompts)
    bench.ids = {p.name: encode(p, target.tokenizer, chat=True, tiny_vocab=tiny_vocab) for p in bench.prompts}


def _configurations(bench: BenchRun) -> tuple[list[Config], list]:
    """Every single-session configuration (specdec's, the llama.cpp anchors, llama-server) and their closers."""
    args = bench.args
    anchors, close_anchors = llamacpp_configs(args, bench.target.eos_token_ids)
    servers, close_servers = llama_server_configs(args, bench.services.target_threads, list(bench.ids.values()))
    anchors, close_anchors = anchors + servers, close_anchors + close_servers
    return build_configs(args, bench.services, bench.target, bench.draft, bench.flags) + anchors, close_anchors


def _step_costs(bench: BenchRun) -> tuple[dict, dict]:
    """The model step times (microbench) and the per-step gRPC and Redis overheads."""
    args, services = bench.args, bench.services
    first = bench.ids[bench.prompts[0].name]
    session, close_session = (llamacpp_session(args.target_model, services.target_threads, first)
                              if services.engine == "llamacpp" else (None, None))
    try:  # the target step of the engine that serves: torch in this process, or the GGUF through llama_decode
        micro = microbench(bench.target, bench.draft, first, args.draft_lens, target_session=session,
                           engine=services.engine)
        bench.phase("microbench")
        overheads = measure_overheads(services, first, k=max(args.draft_lens), step_ms=micro["target_step_ms"],
                                      forward=verify_forward(bench.target, first, max(args.draft_lens) + 1, session))
    finally:
        if close_session is not None:
            close_session()
    bench.phase("overheads")
    return micro, overheads


def _sweeps_to_run(bench: BenchRun) -> list[str]:
    """The sessions sweeps: batched where the target batches, unbatched unless quick mode has the batched one."""
    batched = "target-batched" in bench.services.addresses
    if not batched:
        bench.not_measured["batched"] = "the target has no --batch-window-ms flag in this checkout"
    args = bench.args
    unbatched = args.unbatched_sweep if args.unbatched_sweep is not None else (not args.quick or not batched)
    return ["sessions-batched"] * batched + ["sessions-unbatched"] * unbatched


def _progress_bar(bench: BenchRun, n_live: int, n_sweeps: int):
    from tqdm import tqdm

    args = bench.args
    n_single = n_live * (1 + args.rounds * len(bench.prompts))
    n_sessions = n_sweeps * (1 + args.rounds * len(args.sessions))
    return tqdm(total=n_single + n_sessions, file=sys.stderr, disable=args.no_progress, desc="bench",
                unit="run", dynamic_ncols=True)


def _single_session_rounds(bench: BenchRun, live: list[Config]) -> None:
    """Warm every configuration up once, then time them all prompt by prompt, the order rotated every prompt."""
    args, prompts, progress = bench.args, bench.prompts, bench.progress
    for cfg in live:  # warm-up: every configuration once, untimed
        progress.set_postfix_str(f"warm-up {cfg.name}")
        _run_one(cfg, bench.ids[prompts[0].name], args.warmup_tokens, prompts[0].name, -1)
        progress.update(1)
    bench.phase("warmup")
    for r in range(args.rounds):
        for pi, prompt in enumerate(prompts):
            k = (r * len(prompts) + pi) % len(live)
            for cfg in live[k:] + live[:k]:
                if not cfg.available:
                    progress.update(1)
                    continue
                progress.set_postfix_str(f"round {r + 1} {prompt.name} {cfg.name}")
                cpu0 = bench.services.cpu_seconds()
                s = _run_one(cfg, bench.ids[prompt.name], args.max_new_tokens, prompt.name, r)
                if s is not None:
                    cfg.samples.append(s)
                    cfg.add_cpu(cpu0, bench.services.cpu_seconds())
                progress.update(1)
    bench.phase("single_session_configs")


def _sessions_sweeps(bench: BenchRun, cfgs: list[Config], names: list[str]) -> list[dict]:
    """The sessions sweeps run the headline configuration (the fastest pipelined one, else the fastest speculative
    one) with its orchestrator flags and draft length, against the batching target and the plain one."""
    args, services = bench.args, bench.services
    head_cfg = headline(cfgs, args.headline_fixed)
    if head_cfg is None:
        bench.not_measured["throughput_8_sessions_vs_1"] = "no speculative configuration ran"
        return []
    sweeps = []
    for name in names:
        if name == "sessions-batched":
            extra = [*head_cfg.orchestrator_extra, *sessions_sweep_flags(args, bench.flags)]
            twin = f"{head_cfg.orchestrator}-batched"
            if twin not in services.addresses:  # started already for a pipelined headline
                services.add_orchestrators({twin: ("target-batched", extra)})
            sweeps.append((SessionSweep(name, "target-batched", True, head_cfg, services.orchestrator_flags(extra),
                                        args.batch_window_ms, args.batch_wait_fraction), services.addresses[twin]))
        else:
            sweeps.append((SessionSweep(name, "target", False, head_cfg,
                                        services.orchestrator_flags(head_cfg.orchestrator_extra)),
                           services.addresses[head_cfg.orchestrator]))
    rows: list[dict] = []
    for sweep, address in sweeps:
        try:
            rows += _sessions_sweep(bench, sweep, address)
        except Exception as e:  # noqa: BLE001
            log.error("%s failed: %s", sweep.name, e)
            rows.append({"name": sweep.name, "kind": "sessions", "sweep": sweep.name, "available": False,
                         "reason": f"failed during the run: {type(e).__name__}: {str(e)[:300]}"})
    return rows


def _sessions_sweep(bench: BenchRun, sweep: SessionSweep, address: str) -> list[dict]:
    """One sweep: a warm-up at the most sessions, then every session count per round, the order alternating."""
    from specdec.client import SpecdecClient

    args, services, progress = bench.args, bench.services, bench.progress
    n_max = max(args.sessions)
    clients = [SpecdecClient(address) for _ in range(n_max)]
    levels: dict[int, list] = {n: [] for n in args.sessions}
    cpu: dict[int, list[dict[str, float]]] = {n: [] for n in args.sessions}  # CPU seconds per process
    g = sweep.head_cfg.draft_len or 0
    try:
        progress.set_postfix_str(f"warm-up {sweep.name}")
        run_sessions_level(n_max, bench.jobs_for(n_max)[:n_max], args.warmup_tokens, clients, g)
        progress.update(1)
        for r in range(args.rounds):
            order = args.sessions if r % 2 == 0 else list(reversed(args.sessions))
            for n in order:
                progress.set_postfix_str(f"round {r + 1} {sweep.name} x{n}")
                cpu0 = services.cpu_seconds()
                wall, samples = run_sessions_level(n, bench.jobs_for(n), args.max_new_tokens, clients, g)
                cpu1 = services.cpu_seconds()
                for s in samples:
                    s.round = r
                levels[n].append((wall, samples))
                cpu[n].append({k: cpu1[k] - cpu0[k] for k in cpu1 if k in cpu0})
                progress.update(1)
        return summarise_sessions(sweep, levels, cpu)
    finally:
        for c in clients:
            c.close()


def _result(bench: BenchRun, cfgs: list[Config], session_rows: list[dict], micro: dict, overheads: dict) -> dict:
    """The result dict: every row summarised, the headline figures, the anchors' ratios, by category."""
    args, services = bench.args, bench.services
    baseline = next(c for c in cfgs if c.name == "specdec-target-only")
    reference = {}
    for s in baseline.samples:
        reference.setdefault(s.prompt, s.tokens)
    rows = [summarise_config(c, baseline, micro, bench.strategy, reference, services.engine) for c in cfgs]
    res = assemble(bench, Measured(rows, session_rows, micro, overheads))
    res.update(headline_vs_llamacpp(res, args.threads, os.cpu_count() or 1, services.target_threads))
    target_only_row = next((r for r in rows if r["name"] == "specdec-target-only"), {})
    plain_row = next((r for r in rows if r["name"] == f"{PLAIN}-t{res.get('llamacpp_threads')}"), {})
    res["overheads"]["target_only_ms_per_token"] = target_only_breakdown(
        target_only_row, res.get("llamacpp_tokens_per_s"), plain_row.get("cpu_ms_per_token"))
    res["target_only_vs_llamacpp"] = analysis.ratio(res.get("target_only_tokens_per_s"),
                                                    res.get("llamacpp_tokens_per_s"))
    res.update(llama_server_keys(res))
    plain = f"{PLAIN}-t{res['llamacpp_threads']}" if res.get("llamacpp_threads") else None
    lookup = next((c.name for c in cfgs if c.kind == PROMPT_LOOKUP), None)
    res["by_category"] = by_category(bench.prompts, cfgs, res.get("headline_config"), plain, lookup)
    res.update(engine=services.engine, engine_reason=services.engine_reason, target_threads=services.target_threads)
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
