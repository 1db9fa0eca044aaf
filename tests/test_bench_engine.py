"""`python -m bench --engine`: the benchmark's services run the engine, draft strategy, target threads and CPU plan
that `specdec run` resolves for the same options (llama.cpp with suffix-tree drafting in the orchestrator for the
GGUF target on a CPU), its headline is `specdec run`'s default configuration, and `speedup_vs_llamacpp` compares
it with plain llama.cpp at the cores that configuration uses in all."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from bench.configs import RUN_DEFAULT, Config, Sample, headline, orchestrator_specs
from bench.llamacpp_rows import core_counts, headline_vs_llamacpp
from bench.runner import main, parse_args
from bench.services import BenchServices, available_flags
from launcher.cli import _stack_config, build_parser
from launcher.stack import LocalStack
from specdec.core.strategies import LOCAL_DRAFTS, LOCAL_SUFFIX, QUANTIZED
from specdec.ops.cpu_affinity import affinity_args, allowed_cpus

TINY = "tiny:vocab=64,layers=2,hidden=64,seed=0,std=0.3"


def specdec_run_stack(tmp_path, *options: str) -> LocalStack:
    """The stack `specdec run OPTIONS` would start (resolved, nothing started)."""
    args = build_parser().parse_args(["run", *options])
    return LocalStack(_stack_config(args), log_dir=str(tmp_path / "run"))


def bench_services(tmp_path, argv: list[str]) -> tuple:
    args = parse_args(argv)
    services = BenchServices(args.target_model, args.draft_model, args.draft_strategy, threads=args.threads,
                             device=args.device, dtype=args.dtype, engine=args.engine, pin_cpus=args.pin_cpus == "auto",
                             batch_window_ms=args.batch_window_ms, log_dir=str(tmp_path / "bench"))
    services.orchestrators = orchestrator_specs(args, available_flags(), services.strategy, services.engine)
    return args, services


def spawned_command_lines(services: BenchServices) -> dict[str, list[str]]:
    """The `specdec serve` arguments launch() starts, without starting the model services (Redis is real)."""
    spawned: dict[str, list[str]] = {}
    services._spawn = lambda name, argv: spawned.__setitem__(name, list(argv))
    try:
        services.launch()
    finally:
        services.stop()
    return spawned


def test_the_gguf_target_runs_on_the_engine_specdec_run_picks(tmp_path):
    args, services = bench_services(tmp_path, ["--quick"])
    stack = specdec_run_stack(tmp_path)
    assert args.engine == "auto"
    assert services.engine == stack.engine == "llamacpp" and services.engine_reason == stack.engine_reason
    assert services.strategy == stack.draft_strategy == LOCAL_SUFFIX
    cores = min(len(allowed_cpus()), 2)  # the target computes on the draft's core as well
    assert services.target_threads == stack.target_threads == cores
    assert services.cpu_plan == stack.cpu_plan

    spawned = spawned_command_lines(services)
    assert set(spawned) == {"target"}  # no draft process; the batched twin starts once the target is up
    target = spawned["target"]
    assert target[target.index("--engine") + 1] == "llamacpp"
    assert target[target.index("--threads") + 1] == str(cores)
    if stack.cpu_plan:
        assert target[-2:] == affinity_args(stack.cpu_plan, "target")

    services._spawn_batched_target()  # started by wait() once the target is up
    twin = spawned["target-batched"]
    assert twin[twin.index("--engine") + 1] == "llamacpp" and "--batch-window-ms" in twin
    # A KV stream for every session an orchestrator admits (`specdec up`'s --max-sessions: the target is shared by
    # several orchestrators, and the sweep runs up to 8 sessions at once)
    cache = services.target_cache_args
    assert cache[0] == "--max-sessions" and int(cache[1]) >= max(args.sessions)
    for argv in (target, twin):
        assert argv[argv.index(cache[0]): argv.index(cache[0]) + len(cache)] == cache

    for name, (target_proc, extra) in services.orchestrators.items():  # every orchestrator drafts in process
        assert extra[extra.index("--draft") + 1] == "local:suffix", name
        assert not name.startswith("orch-tree")
    # The headline's orchestrator is `specdec run`'s: --pipeline auto, the goodput draft length, local suffix trees.
    flags = services.orchestrator_flags(services.orchestrators["orch-pipe-auto"][1])
    assert stack.cfg.pipeline == "auto" and flags[flags.index("--pipeline") + 1] == "auto"
    assert stack.cfg.adaptive_draft_len and "--adaptive-draft-len" in flags
    assert flags[flags.index("--draft-len") + 1] == str(stack.cfg.draft_len)
    assert "orch-pipe-auto-batched" in services.orchestrators  # the sessions sweep's batched twin, also local


def test_engine_torch_keeps_the_pytorch_stack(tmp_path):
    args, services = bench_services(tmp_path, ["--quick", "--engine", "torch"])
    stack = specdec_run_stack(tmp_path, "--engine", "torch")
    assert services.engine == "torch" and services.strategy == stack.draft_strategy not in LOCAL_DRAFTS
    assert services.target_threads == 1 and services.cpu_plan == {
        "draft" if n == "draft0" else n: c for n, c in stack.cpu_plan.items()}
    spawned = spawned_command_lines(services)
    assert {"target", "target-batched", "draft"} == set(spawned)
    assert spawned["target"][spawned["target"].index("--engine") + 1] == "torch"
    flags = available_flags()
    assert services.orchestrators == orchestrator_specs(args, flags, services.strategy)  # as before --engine


def test_an_int8_draft_against_llamacpp_prefills_its_own_prompt(tmp_path):
    """llama.cpp's KV is not the wire's: the int8 draft cannot take the target's, so its orchestrators say own."""
    args, services = bench_services(tmp_path, ["--quick", "--engine", "llamacpp", "--draft-strategy", "quantized"])
    assert services.strategy == QUANTIZED and services.has_draft_process and services.target_threads == 1
    for extra in (extra for _, extra in services.orchestrators.values()):
        assert extra[extra.index("--draft-prefill") + 1] == "own"


def _cfg(name: str, tps: float, pipelined: bool = True) -> Config:
    c = Config(name, "specdec-pipelined" if pipelined else "specdec-sequential", name, None, pipelined=pipelined)
    c.samples = [Sample("p", 0, [1] * int(tps), 1.0)]
    return c


def test_the_headline_is_specdec_runs_default_on_llamacpp():
    cfgs = [_cfg(RUN_DEFAULT, 20), _cfg("specdec-pipe-g4", 30), _cfg("specdec-seq-g4", 40, pipelined=False)]
    assert headline(cfgs, RUN_DEFAULT).name == RUN_DEFAULT  # llama.cpp: `specdec run`'s configuration
    assert headline(cfgs).name == "specdec-pipe-g4"  # torch: the fastest pipelined one, as before
    cfgs[0].available = False
    assert headline(cfgs, RUN_DEFAULT).name == "specdec-pipe-g4"  # it failed: the fastest pipelined stands in


def test_speedup_vs_llamacpp_counts_the_targets_threads():
    """A llama.cpp target drafting in the orchestrator runs on 2 threads: plain llama.cpp at 2 is the anchor."""
    assert core_counts(1, 2, target_threads=2) == [1, 2] and core_counts(1, 8, target_threads=2) == [1, 2, 3]
    plain = [{"name": f"llamacpp-plain-t{t}", "kind": "llamacpp-plain", "available": True,
              "tokens_per_s": 10.0 * t, "settings": {"threads": t}} for t in (1, 2)]
    head = {"name": RUN_DEFAULT, "tokens_per_s": 30.0,
            "orchestrator_flags": ["--draft-len", "4", "--adaptive-draft-len", "--pipeline", "auto", "--draft",
                                   "local:ngram"]}
    out = headline_vs_llamacpp({"headline_config": RUN_DEFAULT, "tokens_per_s": 30.0, "configs": [head, *plain]},
                               threads=1, cpus=2, target_threads=2)
    assert out["llamacpp_cores"] == 2 and out["llamacpp_threads"] == 2
    assert out["speedup_vs_llamacpp"] == pytest.approx(30.0 / 20.0)


def test_engine_llamacpp_that_cannot_serve_the_target_says_why(capsys):
    assert main(["--quick", "--engine", "llamacpp", "--target-model", TINY, "--no-progress"]) == 2
    assert "not a GGUF" in capsys.readouterr().err


@pytest.mark.heavy  # 1.2-3.5 min on the loaded 2-core host (both llama.cpp targets profile their forwards at start)
def test_bench_on_the_gguf_measures_the_llamacpp_stack(tmp_path):
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(["--quick", "--json", "--no-progress", "--num-prompts", "1", "--max-new-tokens", "8",
                   "--warmup-tokens", "4", "--sessions", "1,2", "--session-jobs", "2", "--session-gens-per-client", "1",
                   "--out-dir", str(tmp_path)])
    assert rc == 0
    res = json.loads(buf.getvalue())
    assert res["engine"] == "llamacpp" and "GGUF" in res["engine_reason"]
    assert res["headline_config"] == RUN_DEFAULT and res["draft"]["strategy"] == LOCAL_SUFFIX
    by = {c["name"]: c for c in res["configs"]}
    assert "local:suffix" in by[RUN_DEFAULT]["orchestrator_flags"]
    assert res["llamacpp_cores"] == res["target_threads"] == res["settings"]["target_threads"]
    assert res["speedup_vs_llamacpp"] == pytest.approx(res["tokens_per_s"] / res["llamacpp_tokens_per_s"])
    assert res["microbench"]["engine"] == "llamacpp" and res["overheads"]["draft_propose_rpc_ms"] is None
    assert any(c.get("sweep") == "sessions-batched" and c.get("available") for c in res["configs"])
    assert by[RUN_DEFAULT]["output_matches_target_only"] == 1.0
