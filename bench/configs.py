"""The configurations the benchmark compares (specdec target-only, sequential, pipelined, tree; Hugging Face
target-only, assisted and prompt-lookup anchors), each with how to run one prompt and why it may be unavailable."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

from specdec.core.strategies import LOCAL_DRAFTS, LOCAL_NGRAM, QUANTIZED


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
    cpu_s: dict[str, float] = field(default_factory=dict)  # CPU seconds each process used during the timed samples

    def tokens_per_s(self) -> float:
        wall = sum(s.wall_s for s in self.samples)
        return sum(len(s.tokens) for s in self.samples) / wall if wall else 0.0

    def add_cpu(self, before: dict[str, float], after: dict[str, float]) -> None:
        """Count one timed sample's CPU time per process (BenchServices.cpu_seconds before and after it)."""
        for name, t in after.items():
            if name in before:
                self.cpu_s[name] = self.cpu_s.get(name, 0.0) + t - before[name]

    @property
    def speculative(self) -> bool:
        return self.kind in ("specdec-sequential", "specdec-pipelined", "specdec-tree")


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


RUN_DEFAULT = "specdec-pipe-auto-adaptive"  # `specdec run`'s default: --pipeline auto, the goodput draft length


def headline(cfgs: list[Config], fixed: str | None = None) -> Config | None:
    """The configuration the headline figures and the sessions sweep describe: `fixed` where given and it ran
    (the llama.cpp engine's: what `specdec run` runs by default), else the fastest pipelined one that ran (else
    the fastest speculative one)."""
    spec = [c for c in cfgs if c.speculative and c.available and c.samples]
    chosen = next((c for c in spec if c.name == fixed), None)
    if chosen is not None or not spec:
        return chosen
    return max([c for c in spec if c.pipelined] or spec, key=Config.tokens_per_s)


def orchestrator_specs(args, flags: dict, strategy: str = "ngram", engine: str = "torch") -> dict:
    """The orchestrators to start: name -> (target process, extra flags). With the n-gram drafter in the
    orchestrator (LOCAL_NGRAM: no draft process) every one drafts with --draft local:ngram; with a llama.cpp
    target the int8 draft prefills its prompt itself (llama.cpp's KV is not the wire's, nothing to hand over)."""
    if strategy in LOCAL_DRAFTS:
        specs = _base_specs(args, flags, "in-orchestrator")
        return {name: (target, [*extra, "--draft", LOCAL_DRAFTS[strategy]]) for name, (target, extra) in specs.items()}
    specs = _base_specs(args, flags, strategy)
    if engine == "llamacpp" and strategy == QUANTIZED:
        return {name: (target, [*extra, "--draft-prefill", "own"]) for name, (target, extra) in specs.items()}
    return specs


def _base_specs(args, flags: dict, strategy: str) -> dict:
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
    if args.tree and strategy != "in-orchestrator":  # at the largest draft length's node budget (= its chain's)
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


def _no_draft_reason(args, strategy: str | None = None) -> str:
    if strategy in LOCAL_DRAFTS:
        how = "n-gram prompt lookup" if strategy == LOCAL_NGRAM else "suffix trees"
        return (f"--draft-strategy {args.draft_strategy} drafts with {how} inside the orchestrator "
                "(the llama.cpp engine's default)" if args.draft_strategy == "auto"
                else f"--draft-strategy {strategy}")
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
    if strategy in LOCAL_DRAFTS:
        return (f"{_no_draft_reason(args, strategy)}: no draft process, every specdec configuration drafts with "
                f"--draft {LOCAL_DRAFTS[strategy]} and the target computes on the draft's cores as well (`specdec run`); HF "
                "prompt lookup and llama.cpp's prompt lookup are the in-process anchors")
    return (f"{_no_draft_reason(args)}, so the services draft with the n-gram prompt-lookup drafter"
            f"{_datastore_note(args)}, and HF prompt lookup is the in-process anchor")


def _specdec_config(cfg: Config, services) -> Config:
    """Fill in what a specdec configuration takes from its orchestrator: the client call, whether it runs, its
    flags, and the drafter where it drafts in the orchestrator."""
    addr, specs = services.addresses, services.orchestrators
    orch = cfg.orchestrator
    speculation = cfg.kind != "specdec-target-only"
    extra = specs.get(orch, ("", []))[1]
    ok = cfg.available and orch in addr
    local = next((f for f in extra if f.startswith("local:")), None)
    if speculation and local and local not in cfg.label:
        drafter = "n-gram" if local == "local:ngram" else "suffix-tree"
        cfg.label += f", {drafter} drafter in the orchestrator (--draft {local})"
    cfg.run = _specdec_run(addr[orch], speculation, cfg.draft_len or 0) if ok else None
    cfg.available = ok
    cfg.reason = "" if ok else (cfg.reason or f"orchestrator {orch} is not running")
    cfg.orchestrator_extra = list(extra)
    cfg.orchestrator_flags = services.orchestrator_flags(extra)
    return cfg


def build_configs(args, services, target, draft, flags: dict) -> list[Config]:
    from bench.hf import hf_settings

    specs = services.orchestrators
    no_pipe = "the orchestrator has no --pipeline flag in this checkout"
    no_adapt = "the orchestrator has no --adaptive-draft-len flag in this checkout"

    def sd(name: str, kind: str, label: str, orch: str, g: int | None = None, **more) -> Config:
        """A specdec configuration on orchestrator `orch` (`more`: pipelined, available, reason)."""
        return _specdec_config(Config(name, kind, label, None, draft_len=g, orchestrator=orch, **more), services)

    cfgs = [sd("specdec-target-only", "specdec-target-only", "specdec target-only (speculation off)",
               "orch-sequential"),
            Config("hf-target-only", "hf-target-only", "HF generate, target only (in-process)",
                   _hf_run(target) if args.hf_target_only else None, available=args.hf_target_only,
                   reason="" if args.hf_target_only else "skipped (--no-hf-target-only; quick mode's default)")]
    if draft is not None:
        cfgs.append(Config("hf-assisted", "hf-assisted", "HF generate(assistant_model=draft) (in-process)",
                           _hf_run(target, assistant=draft), settings=hf_settings("hf-assisted", draft.model)))
    else:
        cfgs.append(Config("hf-assisted", "hf-assisted", "HF generate(assistant_model=draft) (in-process)", None,
                           available=False, reason="no draft model: the services use the n-gram drafter "
                           f"({_no_draft_reason(args, services.strategy)}), so HF prompt lookup is the matching "
                           "anchor"))
    cfgs.append(Config("hf-prompt-lookup", "hf-prompt-lookup",
                       f"HF generate(prompt_lookup_num_tokens={args.prompt_lookup_num_tokens}) (in-process)",
                       _hf_run(target, prompt_lookup=args.prompt_lookup_num_tokens),
                       settings=hf_settings("hf-prompt-lookup", prompt_lookup_num_tokens=args.prompt_lookup_num_tokens)))
    for g in args.draft_lens:
        cfgs.append(sd(f"specdec-seq-g{g}", "specdec-sequential", f"specdec sequential, g={g}", "orch-sequential",
                       g))
    adaptive = flags["orchestrator --adaptive-draft-len"]
    cfgs.append(sd("specdec-seq-adaptive", "specdec-sequential", "specdec sequential, adaptive g", "orch-sequential",
                   available=adaptive, reason=no_adapt))
    if "orch-heuristic" in specs:
        cfgs.append(sd("specdec-seq-heuristic", "specdec-sequential",
                       "specdec sequential, adaptive g by transformers' heuristic (+2 / -1)", "orch-heuristic",
                       available=adaptive, reason=no_adapt))
    has_pipe = flags["orchestrator --pipeline"]
    cfgs.append(sd("specdec-pipe-adaptive", "specdec-pipelined", "specdec pipelined (on), adaptive g", "orch-pipe-on",
                   pipelined=True, available=has_pipe and adaptive and args.pipe_on,
                   reason=no_pipe if not has_pipe else no_adapt if not adaptive else
                   "skipped (--no-pipe-on; quick mode's default)"))
    if "orch-pipe-auto" in specs:
        cfgs.append(sd("specdec-pipe-auto-adaptive", "specdec-pipelined", "specdec pipelined (auto), adaptive g",
                       "orch-pipe-auto", pipelined=True, available=adaptive, reason=no_adapt))
    if "orch-local" in specs:
        cfgs.append(sd("specdec-seq-local-adaptive", "specdec-sequential",
                       "specdec sequential, adaptive g, n-gram drafter in the orchestrator (--draft local:ngram)",
                       "orch-local", available=adaptive, reason=no_adapt))
    if "orch-pipe-auto-local" in specs:
        cfgs.append(sd("specdec-pipe-auto-local-adaptive", "specdec-pipelined",
                       "specdec pipelined (auto), adaptive g, n-gram drafter in the orchestrator (--draft local:ngram)",
                       "orch-pipe-auto-local", pipelined=True, available=adaptive, reason=no_adapt))
    if args.tree and not services.has_draft_process:
        g = max(args.draft_lens)
        cfgs.append(Config(f"specdec-tree-n{g}", "specdec-tree", f"specdec tree, node budget {g} (vs chain g={g})",
                           None, draft_len=g, available=False,
                           reason="the drafter in the orchestrator (--draft local:...) drafts chains only"))
    trees, no_trees = _draft_drafts_trees(services)
    for orch in (o for o in specs if o.startswith("orch-tree-n")):
        g = int(orch.removeprefix("orch-tree-n"))
        cfgs.append(sd(f"specdec-tree-n{g}", "specdec-tree",
                       f"specdec tree, node budget {g} (vs chain g={g})", orch, g, available=trees,
                       reason=no_trees))
    if args.pipelined_sweep:
        for g in args.draft_lens:
            cfgs.append(sd(f"specdec-pipe-g{g}", "specdec-pipelined", f"specdec pipelined (on), g={g}", "orch-pipe-on",
                           g, pipelined=True, available=has_pipe, reason=no_pipe))
    return cfgs
