"""Run every configuration side by side on the same prompts and machine, and summarise.

Flow: load the target (and draft) in this process for the Hugging Face anchors and the microbenchmarks;
start the specdec services; measure the per-step overheads (gRPC round trip, Redis commit) and the
model step times; warm every configuration up once; then time all single-session configurations
interleaved prompt by prompt (the order rotates every prompt, so slow drift of a shared machine is
spread over all of them); then the concurrency sweep, its session counts also rotated per round.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import pathlib
import platform
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from bench import analysis
from bench.report import batch_label, cpu_label
from bench.prompts import Prompt, encode, select

log = logging.getLogger("bench")

RESULTS_DIR = pathlib.Path(__file__).resolve().parent / "results"

TARGETS = [
    # key, threshold, description
    ("pipelined_speedup_vs_target_only", 1.5, "specdec speculative pipelined >= 1.5x target-only"),
    ("speedup_vs_hf_assisted", 1.0, "specdec pipelined >= 1.0x in-process HF assisted generation"),
    ("pipelined_faster_than_sequential", 1.0, "pipelined faster than sequential (ratio > 1.0)"),
    ("measured_over_predicted", 0.9, "measured / predicted speedup >= 0.9"),
    ("throughput_8_sessions_vs_1", 2.0, "8 concurrent sessions >= 2x the aggregate throughput of 1"),
    ("system_overhead_share", 0.05, "per-step gRPC + Redis overhead on the critical path < 5% of a target step"),
]
LOWER_IS_BETTER = {"system_overhead_share"}


@dataclass
class Sample:
    prompt: str
    round: int
    tokens: list[int]
    wall_s: float
    stats: dict = field(default_factory=dict)
    extra: dict = field(default_factory=dict)


@dataclass
class Config:
    name: str
    kind: str  # specdec-target-only | hf-target-only | hf-assisted | hf-prompt-lookup | specdec-sequential | specdec-pipelined
    label: str
    run: Callable[[list[int], int], Sample] | None
    draft_len: int | None = None  # None: adaptive / HF's own schedule / no drafting
    pipelined: bool = False
    available: bool = True
    reason: str = ""
    settings: dict = field(default_factory=dict)
    samples: list[Sample] = field(default_factory=list)
    orchestrator: str | None = None  # the BenchServices orchestrator it talks to
    orchestrator_extra: list[str] = field(default_factory=list)  # that orchestrator's flags beyond the common ones
    orchestrator_flags: list[str] = field(default_factory=list)

    def tokens_per_s(self) -> float:
        wall = sum(s.wall_s for s in self.samples)
        return sum(len(s.tokens) for s in self.samples) / wall if wall else 0.0

    @property
    def speculative(self) -> bool:
        return self.kind in ("specdec-sequential", "specdec-pipelined", "specdec-tree")


# ------------------------------------------------------------------------------------------------
# arguments
# ------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a run under ~3 minutes: 4 prompts, 48 tokens, g = 4, no tree, HF target-only or --pipeline on")
    p.add_argument("--json", action="store_true", help="print the result JSON on stdout")
    p.add_argument("--target-model", default="smollm2")
    p.add_argument("--draft-model", default="smollm2-draft")
    p.add_argument("--draft-strategy", choices=["auto", "model", "ngram", "hybrid", "quantized"], default="auto",
                   help="auto: the distilled draft if it is in the cache, else n-gram prompt lookup")
    p.add_argument("--max-new-tokens", type=int, default=None, help="per prompt (default 96; quick 48)")
    p.add_argument("--num-prompts", type=int, default=None, help="prompts from bench/prompts.py (default 12; quick 4)")
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
    p.add_argument("--threads", type=int, default=1, help="torch threads per model service and in this process")
    p.add_argument("--pin-cpus", choices=["auto", "off"], default="auto",
                   help="auto: the target and the draft services on CPUs of their own, as `specdec run` starts them "
                        "(specdec/cpu_affinity.py); off: the OS scheduler places them")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--out-dir", default=str(RESULTS_DIR), help="where latest.json / latest.md / latest.png go")
    p.add_argument("--log-dir", default=None, help="service logs (default: a temp dir)")
    p.add_argument("--no-progress", action="store_true")
    a = p.parse_args(argv)
    q = a.quick
    a.max_new_tokens = a.max_new_tokens or (48 if q else 96)
    a.num_prompts = a.num_prompts or (4 if q else 12)
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


# ------------------------------------------------------------------------------------------------
# running
# ------------------------------------------------------------------------------------------------


def _specdec_run(address: str, speculation: bool, draft_len: int) -> Callable[[list[int], int], Sample]:
    from specdec.client import SpecdecClient

    client = SpecdecClient(address)

    def run(ids: list[int], max_new: int) -> Sample:
        r = client.generate(ids, max_new_tokens=max_new, speculation=speculation, max_draft_len=draft_len)
        return Sample("", 0, list(r.token_ids), r.wall_s, dict(r.stats),
                      extra={"ttft_s": r.ttft_s, "first_tokens": r.first_tokens})

    return run


def decode_phase_tps(samples: list[Sample]) -> float | None:
    """Tokens/s after the first streamed chunk: the prompt prefill (the same work with or without a draft)
    and the first step left out, which is the phase the paper's speedup model describes."""
    done = [s for s in samples if s.extra.get("ttft_s") is not None]
    if not done or len(done) < len(samples):
        return None
    tokens = sum(len(s.tokens) - s.extra["first_tokens"] for s in done)
    wall = sum(s.wall_s - s.extra["ttft_s"] for s in done)
    return tokens / wall if wall > 0 and tokens > 0 else None


def _hf_run(target, assistant=None, prompt_lookup: int | None = None) -> Callable[[list[int], int], Sample]:
    from bench.hf import hf_generate

    pad = target.model.generation_config.pad_token_id
    pad = pad if pad is not None else target.eos_token_ids[0]

    def run(ids: list[int], max_new: int) -> Sample:
        r = hf_generate(target.model, ids, max_new, target.eos_token_ids, pad,
                        assistant=None if assistant is None else assistant.model, prompt_lookup_num_tokens=prompt_lookup)
        return Sample("", 0, r.tokens, r.wall_s, extra={"target_forwards": r.target_forwards,
                                                         "draft_forwards": r.draft_forwards})

    return run


def orchestrator_specs(args, flags: dict, strategy: str = "ngram") -> dict:
    """The orchestrators to start: name -> (target process, extra flags)."""
    specs = {"orch-sequential": ("target", [])}
    modes = flags["pipeline_modes"]
    if "on" in modes and args.pipe_on:
        specs["orch-pipe-on"] = ("target", modes["on"])
    if "auto" in modes:
        specs["orch-pipe-auto"] = ("target", modes["auto"])
        if strategy == "ngram" and flags["orchestrator --draft local:ngram"]:
            specs["orch-pipe-auto-local"] = ("target", [*modes["auto"], "--draft", "local:ngram"])
            if not args.quick:  # its sequential twin (same draft-length policy), full mode only
                specs["orch-local"] = ("target", ["--draft", "local:ngram"])
    if args.heuristic and flags["orchestrator --draft-len-policy"]:
        specs["orch-heuristic"] = ("target", ["--draft-len-policy", "heuristic"])
    if args.tree:  # tree speculation at the largest draft length's node budget (equal budget to that chain)
        g = max(args.draft_lens)
        specs[f"orch-tree-n{g}"] = ("target", ["--tree-budget", str(g)])
    if flags["target --batch-window-ms"]:
        # The sessions sweep runs the headline (a pipelined configuration when there is one) against the batching
        # target; its orchestrator starts with the others instead of after the single-session runs.
        for name in [n for n in specs if n.startswith("orch-pipe-auto")]:
            specs[name + "-batched"] = ("target-batched", [*specs[name][1], *sessions_sweep_flags(args, flags)])
    return specs


def _draft_drafts_trees(services) -> tuple[bool, str]:
    """Whether the draft service builds token trees (GetInfo.drafts_trees), and if not, why a tree configuration
    is not run: its tree requests would get chains, so it would measure a sequential chain under a tree's name."""
    import grpc

    from specdec.v1 import common_pb2, draft_pb2_grpc

    address = services.addresses.get("draft")
    if not address:
        return False, "no draft service"
    with grpc.insecure_channel(address) as channel:
        info = draft_pb2_grpc.DraftServiceStub(channel).GetInfo(common_pb2.GetInfoRequest(), timeout=30)
    if info.drafts_trees:
        return True, ""
    return False, (f"the draft ({info.model_name}) drafts chains only (no tree attention mask in its forward): "
                   "tree requests get a chain, which the sequential configurations already measure")


def session_job_count(args, n: int, n_prompts: int) -> int:
    """Generations at n sessions: a multiple of lcm(n, prompts) (every client thread gets as many, every prompt runs
    as often), at least --session-jobs and --session-gens-per-client per thread."""
    unit = math.lcm(n, n_prompts)
    want = max(args.session_jobs, args.session_gens_per_client * n)
    return unit * max(1, -(-want // unit))


def sessions_sweep_flags(args, flags: dict) -> list[str]:
    if flags["orchestrator --speculation-max-sessions"] and args.speculation_max_sessions:
        return ["--speculation-max-sessions", str(args.speculation_max_sessions)]
    return []


def _no_draft_reason(args) -> str:
    if args.draft_strategy == "ngram":
        return "--draft-strategy ngram"
    from specdec.models import cache_dir

    if args.draft_model == "smollm2-draft" and (cache_dir() / "models" / "smollm2-draft" / "config.json").exists():
        return (f"{args.draft_model!r} is cached but its distill report predicts no speedup (--draft-strategy "
                "auto keeps n-gram; --draft-strategy model or hybrid uses it)")
    return f"{args.draft_model!r} is not in the cache (run `specdec distill`)"


def _datastore_note(args) -> str:
    """The n-gram drafter's table (draft service --datastore auto), if `specdec datastore` built one."""
    from draft_service.proposers.datastore import datastore_path

    path = datastore_path(args.target_model)
    if path.is_file():
        return (f" plus the n-gram datastore {path.name} (the target's replies to the distill training prompts, "
                "disjoint from the bench prompts; HF has no equivalent)")
    return " (no n-gram datastore: `specdec datastore` builds one)"


def _draft_note(args, strategy: str) -> str | None:
    if strategy == "hybrid":
        return "prompt lookup" + _datastore_note(args) + ", the draft model where neither has a match"
    if strategy == "model":
        return None
    if strategy == "quantized":
        return (f"the target's own weights rounded to int8 ({args.target_model}, draft_service/int8_draft.py); the "
                "in-process anchor runs the same int8 weights on transformers' forward")
    return (f"{_no_draft_reason(args)}, so the services draft with the n-gram prompt-lookup drafter"
            f"{_datastore_note(args)}, and HF prompt lookup is the in-process anchor")


def build_configs(args, services, target, draft, flags: dict) -> list[Config]:
    from bench.hf import hf_settings

    addr = services.addresses
    specs = services.orchestrators
    no_pipe = "the orchestrator has no --pipeline flag in this checkout"
    no_adapt = "the orchestrator has no --adaptive-draft-len flag in this checkout"

    def sd(name, kind, label, orch, speculation, g, pipelined=False, available=True, reason=""):
        ok = available and orch in addr
        return Config(name, kind, label, _specdec_run(addr[orch], speculation, g or 0) if ok else None,
                      draft_len=g, pipelined=pipelined, available=ok,
                      reason="" if ok else (reason or f"orchestrator {orch} is not running"),
                      orchestrator=orch, orchestrator_extra=list(specs.get(orch, ("", []))[1]),
                      orchestrator_flags=services.orchestrator_flags(specs.get(orch, ("", []))[1]))

    cfgs = [sd("specdec-target-only", "specdec-target-only", "specdec target-only (speculation off)",
               "orch-sequential", False, None),
            Config("hf-target-only", "hf-target-only", "HF generate, target only (in-process)",
                   _hf_run(target) if args.hf_target_only else None, available=args.hf_target_only,
                   reason="" if args.hf_target_only else "skipped (--no-hf-target-only; quick mode's default)")]
    if draft is not None:
        cfgs.append(Config("hf-assisted", "hf-assisted", "HF generate(assistant_model=draft) (in-process)",
                           _hf_run(target, assistant=draft), settings=hf_settings("hf-assisted", draft.model)))
    else:
        cfgs.append(Config("hf-assisted", "hf-assisted", "HF generate(assistant_model=draft) (in-process)", None,
                           available=False, reason="no draft model: the services use the n-gram drafter "
                           f"({_no_draft_reason(args)}), so HF prompt lookup is the matching anchor"))
    cfgs.append(Config("hf-prompt-lookup", "hf-prompt-lookup",
                       f"HF generate(prompt_lookup_num_tokens={args.prompt_lookup_num_tokens}) (in-process)",
                       _hf_run(target, prompt_lookup=args.prompt_lookup_num_tokens),
                       settings=hf_settings("hf-prompt-lookup", prompt_lookup_num_tokens=args.prompt_lookup_num_tokens)))
    for g in args.draft_lens:
        cfgs.append(sd(f"specdec-seq-g{g}", "specdec-sequential", f"specdec sequential, g={g}", "orch-sequential",
                       True, g))
    adaptive = flags["orchestrator --adaptive-draft-len"]
    cfgs.append(sd("specdec-seq-adaptive", "specdec-sequential", "specdec sequential, adaptive g", "orch-sequential",
                   True, None, available=adaptive, reason=no_adapt))
    if "orch-heuristic" in specs:
        cfgs.append(sd("specdec-seq-heuristic", "specdec-sequential",
                       "specdec sequential, adaptive g by transformers' heuristic (+2 / -1)", "orch-heuristic",
                       True, None, available=adaptive, reason=no_adapt))
    has_pipe = flags["orchestrator --pipeline"]
    cfgs.append(sd("specdec-pipe-adaptive", "specdec-pipelined", "specdec pipelined (on), adaptive g", "orch-pipe-on",
                   True, None, pipelined=True, available=has_pipe and adaptive and args.pipe_on,
                   reason=no_pipe if not has_pipe else no_adapt if not adaptive else
                   "skipped (--no-pipe-on; quick mode's default)"))
    if "orch-pipe-auto" in specs:
        cfgs.append(sd("specdec-pipe-auto-adaptive", "specdec-pipelined", "specdec pipelined (auto), adaptive g",
                       "orch-pipe-auto", True, None, pipelined=True, available=adaptive, reason=no_adapt))
    if "orch-local" in specs:
        cfgs.append(sd("specdec-seq-local-adaptive", "specdec-sequential",
                       "specdec sequential, adaptive g, n-gram drafter in the orchestrator (--draft local:ngram)",
                       "orch-local", True, None, available=adaptive, reason=no_adapt))
    if "orch-pipe-auto-local" in specs:
        cfgs.append(sd("specdec-pipe-auto-local-adaptive", "specdec-pipelined",
                       "specdec pipelined (auto), adaptive g, n-gram drafter in the orchestrator (--draft local:ngram)",
                       "orch-pipe-auto-local", True, None, pipelined=True, available=adaptive, reason=no_adapt))
    trees, no_trees = _draft_drafts_trees(services)
    for orch in (o for o in specs if o.startswith("orch-tree-n")):
        g = int(orch.removeprefix("orch-tree-n"))
        cfgs.append(sd(f"specdec-tree-n{g}", "specdec-tree",
                       f"specdec tree, node budget {g} (vs chain g={g})", orch, True, g, available=trees,
                       reason=no_trees))
    if args.pipelined_sweep:
        for g in args.draft_lens:
            cfgs.append(sd(f"specdec-pipe-g{g}", "specdec-pipelined", f"specdec pipelined (on), g={g}", "orch-pipe-on",
                           True, g, pipelined=True, available=has_pipe, reason=no_pipe))
    return cfgs


def _run_one(cfg: Config, ids: list[int], max_new: int, prompt: str, rnd: int) -> Sample | None:
    try:
        s = cfg.run(ids, max_new)
    except Exception as e:  # noqa: BLE001 - one broken configuration must not sink the whole run
        cfg.available = False
        cfg.reason = f"failed during the run: {type(e).__name__}: {str(e)[:300]}"
        log.error("%s failed: %s", cfg.name, e)
        return None
    s.prompt, s.round = prompt, rnd
    return s


def run_sessions_level(n: int, jobs: list[tuple[str, list[int]]], max_new: int, clients: list,
                       draft_len: int = 0) -> tuple[float, list[Sample]]:
    """n worker threads (one client each) drain the job list; returns (wall seconds, samples)."""
    lock = threading.Lock()
    queue = list(jobs)
    out: list[Sample] = []
    errors: list[BaseException] = []

    def worker(client):
        while True:
            with lock:
                if not queue or errors:
                    return
                name, ids = queue.pop(0)
            try:
                r = client.generate(ids, max_new_tokens=max_new, speculation=True, max_draft_len=draft_len)
            except BaseException as e:  # noqa: BLE001
                with lock:
                    errors.append(e)
                return
            with lock:
                out.append(Sample(name, 0, list(r.token_ids), r.wall_s, dict(r.stats)))

    threads = [threading.Thread(target=worker, args=(clients[i],), daemon=True) for i in range(n)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return wall, out


# ------------------------------------------------------------------------------------------------
# measurements besides the sweep
# ------------------------------------------------------------------------------------------------


def microbench(target, draft, ids: list[int], draft_lens: list[int], reps: int = 8) -> dict:
    """Target step time, (g+1)-token verify forwards and the draft step, in this process on the services'
    KV-cache code path, interleaved (see bench.hf.step_costs)."""
    from bench.hf import step_costs

    sizes = list(range(2, max(draft_lens) + 3))  # verify blocks of g + 1 tokens, g = 1 .. max + 1
    r = step_costs(target, draft, ids, sizes, reps=reps)
    t = r["target_ms"][1]
    out = {"target_step_ms": t, "target_block_ms": {str(n): r["target_ms"][n] for n in sizes},
           "draft_step_ms": r["draft_step_ms"], "c": None, "reps": reps,
           "note": "medians of interleaved in-process forwards (torch threads as the services) after prefilling "
                   "the first prompt; c = draft step / target step"}
    out["verify_cost_vs_step"] = {k: v / t for k, v in out["target_block_ms"].items()}
    if r["draft_step_ms"] is not None:
        out["c"] = r["draft_step_ms"] / t
    return out


def verify_forward(target, ids: list[int], n: int):
    """One cached forward of n new tokens on the target after the prompt, cropped back after: a verify's work
    (see bench.hf.step_costs)."""
    from bench.hf import prompt_session

    lm, sess, tok = prompt_session(target, ids)
    base = len(sess.tokens)

    def forward() -> None:
        lm.extend(sess, [tok] * n)
        lm.crop(sess, base)

    return forward


def bare_grpc_cost(wait_ms: float, reps: int = 20, forward=None) -> dict:
    """Medians of a bare gRPC call in this process (no interceptors, no service code) beyond what its handler
    did: nothing, sleeping wait_ms (a target step), and running `forward()` (a verify's forward of the target
    model, when given). Sleep minus nothing is this host waking threads that waited that long (a client blocked
    on the call, the server's poller); forward minus sleep is the same call's code running from caches the
    model's weights just swept. Every Verify pays both on top of gRPC's own cost: together they are the floor
    of a Python gRPC round trip around a target forward here, whatever the service code does."""
    import statistics
    from concurrent import futures

    import grpc

    work = {"grpc_bare_ms": lambda: None, "grpc_bare_after_wait_ms": lambda: time.sleep(wait_ms / 1e3)}
    if forward is not None:
        work["grpc_bare_after_forward_ms"] = forward

    def handler(request, context):  # the request names the case; the reply is what its work took
        t0 = time.perf_counter()
        work[request.decode()]()
        return repr(time.perf_counter() - t0).encode()

    server = grpc.server(futures.ThreadPoolExecutor(2))
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
        "bench.Wait", {"Wait": grpc.unary_unary_rpc_method_handler(handler)})])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    call = channel.unary_unary("/bench.Wait/Wait")
    out = {}
    try:
        for key in work:
            call(key.encode(), timeout=60)
            extra = []
            for _ in range(reps):
                t0 = time.perf_counter()
                took = float(call(key.encode(), timeout=60))
                extra.append((time.perf_counter() - t0 - took) * 1e3)
            out[key] = statistics.median(extra)
    finally:
        channel.close()
        server.stop(0)
    return out


def measure_overheads(services, ids: list[int], k: int = 4, reps: int = 30, model_reps: int = 6,
                      step_ms: float = 50.0, forward=None) -> dict:
    """Loopback costs around the models, measured against the running services.

    * an empty unary RPC (TargetService.GetInfo) and the orchestrator's per-step Redis commit;
    * Verify (k drafts), Decode (1 token) and Propose (k tokens) called directly: client round trip minus the
      model time the service itself reports = what gRPC, (de)serialisation and the service's own Python cost
      per call."""
    import statistics

    from orchestrator.clients import DraftClient, TargetClient
    from orchestrator.session_store import SessionRecord, open_store
    from specdec.sampling import SamplingParams

    med = statistics.median
    out: dict = {}
    target = TargetClient(services.addresses["target"])
    draft = DraftClient(services.addresses["draft"])
    try:
        target.info(timeout=10)
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            target.info(timeout=10)
            times.append((time.perf_counter() - t0) * 1e3)
        out["grpc_unary_roundtrip_ms"] = med(times)

        greedy = SamplingParams()
        sid = "bench-overhead"
        first = target.decode(sid, list(ids), 0, 1, greedy, 0, 0, [], 120.0)
        ctx = list(ids) + list(first.tokens)
        drafts = [ctx[-1]] * k
        rt, model = [], []
        for i in range(model_reps):  # Verify at a fixed position: crop to ctx - 1, feed 1 + k tokens
            t0 = time.perf_counter()
            v = target.verify(sid, ctx, len(ctx) - 1, drafts, [], greedy, 0, i + 1, 120.0)
            rt.append((time.perf_counter() - t0) * 1e3)
            model.append(v.verify_ms)
        out["target_verify_rpc_ms"] = med(rt)
        out["target_verify_service_ms"] = med(model)
        out["target_verify_rpc_overhead_ms"] = med([a - b for a, b in zip(rt, model)])
        rt, model = [], []
        for i in range(model_reps):  # Decode one token at a fixed position
            t0 = time.perf_counter()
            d = target.decode(sid, ctx, len(ctx) - 1, 1, greedy, 0, 100 + i, [], 120.0)
            rt.append((time.perf_counter() - t0) * 1e3)
            model.append(d.decode_ms)
        out["target_decode_rpc_ms"] = med(rt)
        out["target_decode_service_ms"] = med(model)
        out["target_decode_rpc_overhead_ms"] = med([a - b for a, b in zip(rt, model)])
        target.release(sid)
        rt, model = [], []
        draft.propose(sid, ctx, 0, k, greedy, 0, 0, 120.0)  # the draft prefills the prompt once
        for i in range(model_reps):
            t0 = time.perf_counter()
            r = draft.propose(sid, ctx, len(ctx) - 1, k, greedy, 0, i + 1, 120.0)
            rt.append((time.perf_counter() - t0) * 1e3)
            model.append(r.draft_ms)
        out["draft_propose_rpc_ms"] = med(rt)
        out["draft_propose_service_ms"] = med(model)
        out["draft_propose_rpc_overhead_ms"] = med([a - b for a, b in zip(rt, model)])
        draft.release(sid)
    finally:
        target.close()
        draft.close()

    store = open_store(services.redis.url)
    rec = SessionRecord("bench-overhead", list(ids), {"temperature": 0.0, "max_new_tokens": 96},
                        stats={k: 0 for k in ("verify_steps", "draft_tokens_proposed", "draft_tokens_accepted",
                                              "fallback_steps", "decode_steps", "draft_ms", "verify_ms", "wall_ms")})
    store.create(rec)
    rtimes = []
    for i in range(reps):
        rec.generated.extend([1, 2, 3])
        rec.step = i
        t0 = time.perf_counter()
        store.commit(rec, [1, 2, 3])
        rtimes.append((time.perf_counter() - t0) * 1e3)
    store.delete(rec.session_id)
    out["redis_commit_ms"] = med(rtimes)
    out.update(bare_grpc_cost(step_ms, forward=forward))
    out["grpc_wait_ms"] = step_ms
    out["per_step_system_overhead_ms"] = (out["target_verify_rpc_overhead_ms"] + out["draft_propose_rpc_overhead_ms"]
                                          + out["redis_commit_ms"])
    # --draft local:ngram drafts inside the orchestrator: no Propose round trip
    out["per_step_system_overhead_local_draft_ms"] = out["target_verify_rpc_overhead_ms"] + out["redis_commit_ms"]
    out["note"] = (f"medians; Verify with k={k} drafts and Propose of k={k} tokens ({model_reps} calls each), GetInfo "
                   f"and Redis commit ({reps} each); *_rpc_overhead = client round trip - the model time the service "
                   "reports; per_step_system_overhead = Verify + Propose overheads + one Redis commit (the orchestrator's "
                   "own Python per step is on top); grpc_bare_ms / grpc_bare_after_wait_ms: a bare gRPC call in the "
                   "benchmark process beyond its handler's time, without work and after sleeping grpc_wait_ms (a target "
                   "step): the difference is this host waking threads that waited, part of every call's overhead; "
                   f"grpc_bare_after_forward_ms: the same call around the target's forward of k+1 = {k + 1} tokens "
                   "(the services' KV-cache path): the floor of a gRPC round trip around a verify on this host")
    return out


# ------------------------------------------------------------------------------------------------
# summaries
# ------------------------------------------------------------------------------------------------


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
                     reference_tokens: dict[str, list[int]]) -> dict:
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
    if not out["available"]:
        out["reason"] = cfg.reason or "no samples"
        return out
    tokens = sum(len(s.tokens) for s in cfg.samples)
    wall = sum(s.wall_s for s in cfg.samples)
    out.update(samples=len(cfg.samples), tokens=tokens, wall_s=wall, tokens_per_s=tokens / wall if wall else None)
    base_tps = None
    if baseline is not None and baseline.samples:
        bt = sum(len(s.tokens) for s in baseline.samples)
        bw = sum(s.wall_s for s in baseline.samples)
        base_tps = bt / bw if bw else None
    out["speedup_vs_target_only"] = analysis.ratio(out["tokens_per_s"], base_tps)
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
    matches = [s.tokens == reference_tokens.get(s.prompt) for s in cfg.samples if s.prompt in reference_tokens]
    out["output_matches_target_only"] = (sum(matches) / len(matches)) if matches else None

    if cfg.kind.startswith("hf-"):
        tf = sum(s.extra.get("target_forwards", 0) for s in cfg.samples)
        df = sum(s.extra.get("draft_forwards", 0) for s in cfg.samples)
        out["target_forwards"] = tf
        out["mean_accepted_length"] = tokens / tf if tf else None  # tokens committed per target forward
        if cfg.kind == "hf-assisted" and df:
            out["draft_forwards"] = df
            out["acceptance_rate"] = max(0.0, (tokens - tf) / df)
            out["acceptance_note"] = "approx.: (tokens - target forwards) / draft forwards, from forward hooks"
        return out

    st = _sum_stats(cfg.samples)
    out["service_stats"] = st
    if st["draft_failures"]:  # a draft that errs costs speed, never output: say so rather than report a slow config
        kinds = ", ".join(f"{k} {v:.0f}" for k, v in sorted(st["draft_failures_by_kind"].items()))
        out["warning"] = (f"{st['draft_failures']:.0f} draft failures ({kinds}); {st['fallback_steps']:.0f} steps "
                          "decoded target-only (the services' logs say why)")
    steps = st["verify_steps"] + st["decode_steps"]
    t_step = micro["target_step_ms"]
    client_ms = wall * 1e3
    if steps:
        # Older services carry no decode_ms: then the overhead is exact only where every step was a verify.
        exact = not cfg.pipelined and (not st["decode_steps"] or st["decode_ms"] > 0)
        out["per_step_ms"] = {
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
            "note": "rpc_and_orchestrator_overhead = (orchestrator step time - draft_ms - verify_ms - decode_ms - "
                    "prefill_ms) "
                    "per step, where not pipelined (draft and verify overlap); store_and_stream = client wall - "
                    "orchestrator step time (Redis commit, streaming, session setup); rpc_overhead = the orchestrator's "
                    "rpc_overhead_ms stat per step: for each call the loop waited for (Verify, Decode, a Propose not "
                    "prefetched and not carrying the prompt's KV, which is prefill_ms) its round trip minus the "
                    "service's reported time; redis_commit = its store_ms stat (the per-step commit), "
                    "redis_commit_critical = the part of it the steps waited for (a block is committed and sent "
                    "while the orchestrator's stepper thread runs the next step; store_ms - store_overlapped_ms); "
                    "prefetch_wait = time a step waited for the previous step's prefetched block",
        }
        if st["rpc_overhead_ms"] or st["store_ms"]:
            out["system_overhead_ms_per_step"] = (st["rpc_overhead_ms"] + st["store_ms"]
                                                  - st["store_overlapped_ms"]) / steps
            out["system_overhead_share"] = out["system_overhead_ms_per_step"] / t_step if t_step else None
        if cfg.pipelined:
            out["pipeline"] = {"prefetches": st["pipeline_prefetches"], "hits": st["pipeline_hits"],
                               "verify_steps": st["verify_steps"]}
    if not cfg.speculative:
        return out
    v = st["verify_steps"]
    proposed, accepted = st["draft_tokens_proposed"], st["draft_tokens_accepted"]
    if not v or not proposed:
        out["reason_no_prediction"] = "no verify steps (nothing was drafted)"
        return out
    g_mean = proposed / v
    mal = (accepted + v) / v
    out["acceptance_rate"] = accepted / proposed
    out["mean_accepted_length"] = mal
    out["mean_draft_len"] = g_mean  # tokens verified per step: a scored draft's trimmed tail is not counted
    out["trimmed_per_verify"] = st["draft_tokens_trimmed"] / v
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
            out["speedup_vs_target_only"], out["predicted_speedup_measured_verify_cost"])
    out["predicted_model"] = ("leviathan" if not st["decode_steps"] else
                              "leviathan, plus plain target steps where nothing was drafted")
    out["measured_over_predicted"] = analysis.ratio(out["speedup_vs_target_only"], pred)
    out["measured_over_predicted_decode_phase"] = analysis.ratio(out["decode_phase_speedup_vs_target_only"], pred)
    return out


def summarise_sessions(name: str, address_kind: str, levels: dict[int, list[tuple[float, list[Sample]]]],
                       batched: bool, head_cfg: Config, orchestrator_flags: list[str],
                       batch_window_ms: float | None, batch_wait_fraction: float | None = None,
                       cpu: dict[int, list[dict[str, float]]] | None = None) -> list[dict]:
    """cpu: per session count, the CPU seconds each process used in each run: reported as busy cores (CPU
    seconds / wall seconds), the processes that did work."""
    rows = []
    base = None
    for n in sorted(levels):
        runs = levels[n]
        if not runs:
            continue
        tokens = sum(len(s.tokens) for _, samples in runs for s in samples)
        wall = sum(w for w, _ in runs)
        st = _sum_stats([s for _, samples in runs for s in samples])
        tps = tokens / wall if wall else None
        if n == min(levels):
            base = tps
        row = {"name": f"{name}-{n}", "kind": "sessions", "sweep": name, "sessions": n, "available": True,
               "batched_verification": batched, "batch_window_ms": batch_window_ms,
               "batch_wait_fraction": batch_wait_fraction,
               "configuration": head_cfg.name, "orchestrator_flags": orchestrator_flags,
               "request_max_draft_len": head_cfg.draft_len or 0, "target": address_kind,
               "tokens": tokens, "wall_s": wall, "tokens_per_s": tps,
               "throughput_vs_1_session": analysis.ratio(tps, base),
               "mean_session_tokens_per_s": (sum(len(s.tokens) / s.wall_s for _, ss in runs for s in ss if s.wall_s)
                                             / max(1, sum(len(ss) for _, ss in runs))),
               "acceptance_rate": (st["draft_tokens_accepted"] / st["draft_tokens_proposed"]
                                   if st["draft_tokens_proposed"] else None),
               "mean_accepted_length": ((st["draft_tokens_accepted"] + st["verify_steps"]) / st["verify_steps"]
                                        if st["verify_steps"] else None),
               "target_verify_ms_per_step": st["verify_ms"] / st["verify_steps"] if st["verify_steps"] else None,
               "plain_decode_step_fraction": (st["decode_steps"] / (st["decode_steps"] + st["verify_steps"])
                                              if st["decode_steps"] + st["verify_steps"] else None),
               "load_shed_step_fraction": (st["load_shed_steps"] / (st["decode_steps"] + st["verify_steps"])
                                           if st["decode_steps"] + st["verify_steps"] else None),
               "service_stats": st}
        used: dict[str, float] = {}
        for d in (cpu or {}).get(n, []):
            for k, v in d.items():
                used[k] = used.get(k, 0.0) + v
        row["cpu_cores_busy"] = {k: v / wall for k, v in sorted(used.items()) if wall and v / wall >= 0.01} or None
        rows.append(row)
    return rows


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
            entry["why"] = "not measured: " + res.get("not_measured", {}).get(key, "the configuration is not available")
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
    hp = head.get("predicted_speedup")
    hpv = head.get("predicted_speedup_measured_verify_cost")
    ov = res.get("overheads", {})
    mb = res.get("microbench", {})
    per = head.get("per_step_ms") or {}
    sysov = (f"RPC + Redis overhead per step ~{_fmt(ov.get('per_step_system_overhead_ms'), 1)} ms (Verify "
             f"{_fmt(ov.get('target_verify_rpc_overhead_ms'))} + Propose {_fmt(ov.get('draft_propose_rpc_overhead_ms'))}"
             f" + Redis {_fmt(ov.get('redis_commit_ms'))}) vs a target step of {_fmt(mb.get('target_step_ms'), 1)} ms")
    if key == "pipelined_speedup_vs_target_only":
        verb = "met" if value >= thr else "not met"
        parts = [f"{verb}: {head.get('name')} runs {_fmt(head.get('tokens_per_s'))} tok/s = {_fmt(value)}x target-only"]
        if hp is not None:
            parts.append(f"the paper's model predicts {_fmt(hp)}x at the measured acceptance "
                         f"(accepted/proposed {_fmt(head.get('acceptance_rate'))}, alpha {_fmt(head.get('alpha'))}, "
                         f"mean accepted length {_fmt(head.get('mean_accepted_length'))}, mean g "
                         f"{_fmt(head.get('mean_draft_len'))}, c {head.get('cost_ratio_c') or 0:.3g})")
            if hpv is not None:
                parts.append(f"{_fmt(hpv)}x with the verify cost measured on this CPU (a "
                             f"{_fmt((head.get('mean_draft_len') or 0) + 1, 1)}-token forward = "
                             f"{_fmt(head.get('verify_cost_vs_step'))} target steps)")
            if value < thr and hp < thr:
                parts.append(f"so even with free verification and no system overhead this drafter could not reach "
                             f"{thr}x: the acceptance rate / draft length is the limit")
            elif value < thr:
                parts.append(f"the system reaches {_fmt(value / hp)} of the paper's prediction; {sysov}")
        return "; ".join(parts)
    if key == "speedup_vs_hf_assisted":
        anchor = cfgs.get(res.get("hf_anchor") or "", {})
        return (f"not met: {_fmt(head.get('tokens_per_s'))} tok/s vs {anchor.get('name')} "
                f"{_fmt(anchor.get('tokens_per_s'))} tok/s in one process (no RPC, no serialisation, no Redis); "
                f"{sysov}; HF commits {_fmt(anchor.get('mean_accepted_length'))} tokens per target forward, specdec "
                f"{_fmt(head.get('mean_accepted_length'))} per verify")
    if key == "pipelined_faster_than_sequential":
        seq = cfgs.get(res.get("best_sequential_config") or "", {})
        return (f"not met: {head.get('name')} {_fmt(head.get('tokens_per_s'))} tok/s vs best sequential "
                f"{seq.get('name')} {_fmt(seq.get('tokens_per_s'))} tok/s (same draft-length policy: "
                f"{_fmt(res.get('pipelined_vs_sequential_same_policy'))}x); pipelining hides the draft time, here "
                f"{_fmt(head.get('draft_ms_per_token'), 3)} ms per draft token (c = {head.get('cost_ratio_c') or 0:.3g}), "
                f"and on {res['machine']['cpus']} shared CPU cores draft and target compete for the same cores")
    if key == "measured_over_predicted":
        return (f"not met: measured {_fmt(head.get('speedup_vs_target_only'))}x vs predicted {_fmt(hp)}x. The paper's "
                f"model takes a verify of g+1 tokens to cost one target step; on this CPU a "
                f"{_fmt((head.get('mean_draft_len') or 0) + 1, 1)}-token forward costs "
                f"{_fmt(head.get('verify_cost_vs_step'))} steps, which alone predicts {_fmt(hpv)}x (measured/that = "
                f"{_fmt(head.get('measured_over_predicted_measured_verify_cost'))}); the prompt prefill (the same work "
                f"in both, outside the paper's model) is in the wall time: after the first streamed tokens the "
                f"speedup is {_fmt(head.get('decode_phase_speedup_vs_target_only'))}x, "
                f"{_fmt(head.get('measured_over_predicted_decode_phase'))} of the prediction; the rest: {sysov}, plus the "
                f"orchestrator's own Python per step and the shared machine (load average "
                f"{_fmt(res['machine'].get('load_average_begin', [None])[0])} -> "
                f"{_fmt(res['machine'].get('load_average_end', [None])[0])} on {res['machine']['cpus']} cores)")
    if key == "system_overhead_share":
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
    if key == "throughput_8_sessions_vs_1":
        rows = [c for c in res["configs"] if c.get("kind") == "sessions" and c.get("sweep") == res.get("sessions_sweep")]
        r1 = next((r for r in rows if r["sessions"] == 1), {})
        r8 = max(rows, key=lambda r: r["sessions"]) if rows else {}
        return (f"not met: {_fmt(r8.get('tokens_per_s'))} tok/s aggregate at {r8.get('sessions')} sessions vs "
                f"{_fmt(r1.get('tokens_per_s'))} at 1 ({res['machine']['cpus']} CPU cores, shared with other work; "
                f"each model service runs {res['settings']['threads']} torch thread); batched verification "
                f"{'on (' + batch_label(r8) + ')' if r8.get('batched_verification') else 'not available'}; "
                f"target verify per step grew from {_fmt(r1.get('target_verify_ms_per_step'))} to "
                f"{_fmt(r8.get('target_verify_ms_per_step'))} ms ({_fmt(ratio_or_none(r8, r1))}x for "
                f"{r8.get('sessions')}x the sessions); {_fmt(100 * (r8.get('plain_decode_step_fraction') or 0), 0)}% of "
                "the steps were target-only Decode calls (nothing drafted, speculation paused by the goodput draft "
                "length or shed by the load switch; the target batches their single-token steps too)"
                + _cpu_why(r1, r8, res["machine"]["cpus"]))
    return ""


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


# ------------------------------------------------------------------------------------------------
# main
# ------------------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> dict:
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    import torch
    from tqdm import tqdm

    from bench import http_bench
    from bench.services import BenchServices, available_flags
    from specdec.client import SpecdecClient
    from specdec.cpu_affinity import describe as describe_cpu_plan
    from specdec.models import load_model
    from specdec.stack import MODEL_STRATEGIES, QUANTIZED, StackConfig, resolve_draft_strategy

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
    strategy = resolve_draft_strategy(StackConfig(target_model=args.target_model, draft_strategy=args.draft_strategy,
                                                  draft_model=args.draft_model))
    services = BenchServices(args.target_model, args.draft_model, strategy, threads=args.threads, device=args.device,
                             dtype=args.dtype, adaptive=flags["orchestrator --adaptive-draft-len"],
                             orchestrators=orchestrator_specs(args, flags, strategy),
                             batch_window_ms=args.batch_window_ms if flags["target --batch-window-ms"] else None,
                             batch_wait_fraction=args.batch_wait_fraction,
                             draft_vocab=args.draft_vocab,
                             pin_cpus=args.pin_cpus == "auto" and flags["target --cpu-affinity"],
                             log_dir=args.log_dir)
    t0 = time.perf_counter()
    services.launch()  # the services load their models while this process loads its own (HF anchors)
    try:
        target = load_model(args.target_model, device=args.device, dtype=args.dtype)
        draft = None
        if strategy == QUANTIZED:  # the same int8 weights, on transformers' forward (HF's assisted generation)
            from specdec.cpu_kernels import quantize_linears

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
    progress = None
    session_rows: list[dict] = []
    try:
        services.wait()
        startup_s = time.perf_counter() - t0  # launch to ready, the models loaded here meanwhile
        phase("service_startup")
        cfgs = build_configs(args, services, target, draft, flags)
        live = [c for c in cfgs if c.available]
        first = ids[prompts[0].name]
        micro = microbench(target, draft, first, args.draft_lens)
        phase("microbench")
        overheads = measure_overheads(services, first, k=max(args.draft_lens), step_ms=micro["target_step_ms"],
                                      forward=verify_forward(target, first, max(args.draft_lens) + 1))
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
        spec = [c for c in cfgs if c.speculative and c.available and c.samples]
        pipe = [c for c in spec if c.pipelined]
        head_cfg = max(pipe or spec, key=Config.tokens_per_s) if spec else None
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

    baseline = next(c for c in cfgs if c.name == "specdec-target-only")
    reference = {}
    for s in baseline.samples:
        reference.setdefault(s.prompt, s.tokens)
    rows = [summarise_config(c, baseline, micro, strategy, reference) for c in cfgs]
    res = _assemble(args, rows, session_rows, micro, overheads, flags, strategy, draft, prompts, ids, not_measured)
    res.update(http=http, http_grpc_ratio=http and http["http_grpc_ratio"], ttft_ms=http and http["ttft_ms"])
    res["machine"]["cpu_affinity"] = {
        "single-session configurations": pinned or "not pinned (the OS scheduler places the services)",
        "sessions sweeps": "not pinned, as `specdec up` (8 sessions ran 4-18% slower pinned)"}
    res["machine"].update(load_average_begin=load_begin, load_average_end=os.getloadavg(),
                          service_startup_s=startup_s, total_s=time.time() - t_begin, phases_s=phases)
    res["targets"] = evaluate_targets(res)
    return res


def _cpu_model() -> str:
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
    if pipelined:
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
                     "decoding": "greedy (temperature 0)", "chat_template": True, "warmup_tokens": args.warmup_tokens,
                     "timing": "client wall time per generation (request sent -> final message), prefill included; "
                               "tokens/s = all generated tokens / all wall time of a configuration",
                     "interleaving": "every prompt runs every configuration back to back, the order rotated by one "
                                     "per prompt; session counts alternate order per round"},
        "machine": {"cpus": os.cpu_count(), "cpu_model": _cpu_model(), "cpu_flags": torch.backends.cpu.get_cpu_capability(),
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
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    res = run(args)
    res["command"] = "python -m bench " + " ".join(sys.argv[1:] if argv is None else argv)
    res["outputs"] = write_outputs(res, args.out_dir)
    if args.json:
        print(json.dumps(res, indent=2, default=float))
    else:
        print(open(res["outputs"]["markdown"]).read())
    return 0
