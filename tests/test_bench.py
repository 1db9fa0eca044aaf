"""The benchmark machinery (`python -m bench`) end to end on tiny random models: real services on loopback,
HF anchors in-process, the concurrency sweep, the JSON / markdown / PNG outputs. Checks structure and that
every ratio is computed from the measured tokens/s -- never the numbers themselves (tiny models say
nothing about speed)."""

from __future__ import annotations

import json
import math

import pytest

from bench import analysis
from bench.runner import main
from bench.summary import LOWER_IS_BETTER, TARGETS
from specdec.core.sampling import expected_accepted_length, speculative_speedup

# The tests on the benchmark run are serial (scripts/test.sh runs them alone after the rest): the run measures
# speed, and a draft call that misses its deadline on a loaded host flags its configuration. The others are
# arithmetic, configuration and llama.cpp greedy-output checks that hold at any speed.
ON_THE_RUN = pytest.mark.serial

TARGET = "tiny:vocab=64,layers=2,hidden=64,seed=0,std=0.3"
DRAFT = "tiny:vocab=64,layers=1,hidden=64,seed=0,std=0.3"
HEADLINE_KEYS = ("speedup_vs_target_only", "speedup_vs_hf_assisted", "pipelined_vs_sequential", "acceptance_rate",
                 "measured_over_predicted", "throughput_8_sessions_vs_1")


def close(a, b, rel=1e-9):
    return a is not None and b is not None and math.isclose(a, b, rel_tol=rel, abs_tol=1e-12)


def test_predicted_speedup_is_the_leviathan_formula():
    for a in (0.0, 0.3, 0.55, 0.8, 0.97, 1.0):
        for g in (1, 2, 3, 4, 6, 8):
            for c in (0.0, 0.05, 0.2, 1.0):
                ref = speculative_speedup(a, g, c)
                assert analysis.predicted_speedup(a, g, c) == ref
                assert analysis.predicted_speedup(a, float(g), c) == ref
                if a < 1:
                    assert math.isclose(ref, (1 - a ** (g + 1)) / ((1 - a) * (g * c + 1)), rel_tol=1e-12)
                # Real-valued g (adaptive draft length) uses the same closed form, continuous in g.
                assert math.isclose(analysis.predicted_speedup(a, g + 1e-9, c), ref, rel_tol=1e-6)
                # No plain steps: identical to the formula.
                assert analysis.predicted_speedup_with_plain_steps(a, g, c, 10, 0) == ref


def test_alpha_inverts_the_expected_accepted_length():
    for a in (0.1, 0.5, 0.77, 0.95):
        for g in (2, 4, 6):
            mal = expected_accepted_length(a, g)
            assert math.isclose(analysis.alpha_from_accepted_length(mal, g), a, abs_tol=1e-9)
    assert analysis.alpha_from_accepted_length(1.0, 4) == 0.0
    assert analysis.alpha_from_accepted_length(5.0, 4) == 1.0


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(["--quick", "--json", "--no-progress", "--target-model", TARGET, "--draft-model", DRAFT,
                   "--draft-strategy", "model", "--num-prompts", "2", "--max-new-tokens", "10", "--warmup-tokens", "4",
                   "--draft-lens", "2,3", "--sessions", "1,8", "--session-jobs", "8", "--session-gens-per-client", "1", "--tree", "--hf-target-only", "--pipe-on",
                   "--out-dir", str(out)])
    assert rc == 0
    return json.loads(buf.getvalue()), out


@ON_THE_RUN
def test_bench_json_keys_and_targets(bench_run):
    res, _ = bench_run
    for key in HEADLINE_KEYS + ("configs", "targets", "headline_config", "microbench", "overheads"):
        assert key in res, key
    assert set(res["targets"]) == {k for k, _, _ in TARGETS}
    for t in res["targets"].values():
        assert t["met"] in (True, False, None)
        if t["met"] is not True:
            assert t["why"], t  # every missed or unmeasured target says why
    names = {c["name"] for c in res["configs"]}
    assert {"specdec-target-only", "hf-target-only", "hf-assisted", "hf-prompt-lookup", "specdec-seq-g2",
            "specdec-seq-g3", "specdec-pipe-adaptive"} <= names
    assert res["draft"]["strategy"] == "model"
    phases = res["machine"]["phases_s"]  # where the time went (quick mode must stay under 3 minutes)
    assert {"service_startup", "warmup", "single_session_configs", "sessions_sweeps"} <= set(phases)
    assert sum(phases.values()) <= res["machine"]["total_s"] + 1
    assert res["settings"]["max_new_tokens"] == 10 and len(res["settings"]["prompts"]) == 2


@ON_THE_RUN
def test_bench_ratios_come_from_the_measured_tokens_per_second(bench_run):
    res, _ = bench_run
    by = {c["name"]: c for c in res["configs"]}
    base = by["specdec-target-only"]
    assert base["available"] and base["tokens"] > 0
    for c in res["configs"]:
        if c.get("kind") == "sessions" or not c.get("available"):
            continue
        assert close(c["tokens_per_s"], c["tokens"] / c["wall_s"])
        assert close(c["speedup_vs_target_only"], c["tokens_per_s"] / base["tokens_per_s"])
        if c["kind"].startswith("specdec"):  # through the client: the prefill-free phase is measured too
            assert 0 < c["decode_phase_tokens_per_s"]
            assert close(c["decode_phase_speedup_vs_target_only"],
                         c["decode_phase_tokens_per_s"] / base["decode_phase_tokens_per_s"])
        if c["kind"] in ("specdec-sequential", "specdec-pipelined") and c.get("predicted_speedup") is not None:
            st = c["service_stats"]
            assert close(c["acceptance_rate"], st["draft_tokens_accepted"] / st["draft_tokens_proposed"])
            v = st["verify_steps"]
            assert close(c["mean_accepted_length"], (st["draft_tokens_accepted"] + v) / v)
            assert close(c["mean_draft_len"], st["draft_tokens_proposed"] / v)
            assert math.isclose(analysis.accepted_length(c["alpha"], c["mean_draft_len"]),
                                min(c["mean_accepted_length"], c["mean_draft_len"] + 1), rel_tol=1e-6) \
                or c["alpha"] in (0.0, 1.0)
            pred = analysis.predicted_speedup_with_plain_steps(c["alpha"], c["mean_draft_len"], c["cost_ratio_c"],
                                                               int(v), int(st["decode_steps"]))
            assert close(c["predicted_speedup"], pred)
            if not st["decode_steps"]:
                assert close(c["predicted_speedup"],
                             (1 - c["alpha"] ** (c["mean_draft_len"] + 1)) / ((1 - c["alpha"])
                              * (c["mean_draft_len"] * c["cost_ratio_c"] + 1)), rel=1e-6) or c["alpha"] == 1.0
            assert close(c["measured_over_predicted"], c["speedup_vs_target_only"] / c["predicted_speedup"])

    head = by[res["headline_config"]]
    assert close(res["speedup_vs_target_only"], head["tokens_per_s"] / base["tokens_per_s"])
    if head["service_stats"]["verify_steps"]:
        assert close(res["acceptance_rate"], head.get("acceptance_rate"))
    else:  # the goodput policy decoded target-only throughout: with a tiny target the orchestrator's own ~ms per
        # step outweighs the forward, which a 4-token Decode call pays once (10-token replies never reach a probe)
        assert res["acceptance_rate"] is None and head.get("acceptance_rate") is None
    if res["measured_over_predicted"] is not None:
        assert close(res["measured_over_predicted"], head["speedup_vs_target_only"] / head["predicted_speedup"])
    anchor = by[res["hf_anchor"]]
    assert close(res["speedup_vs_hf_assisted"], head["tokens_per_s"] / anchor["tokens_per_s"])
    if res["headline_is_pipelined"]:
        assert head["kind"] == "specdec-pipelined"
        fastest = max((c for c in res["configs"] if c.get("kind") == "specdec-pipelined" and c.get("available")),
                      key=lambda c: c["tokens_per_s"])
        assert fastest["name"] == head["name"]
        seq = by[res["best_sequential_config"]]
        assert seq["tokens_per_s"] == max(c["tokens_per_s"] for c in res["configs"]
                                          if c.get("kind") == "specdec-sequential" and c.get("available"))
        assert close(res["pipelined_vs_sequential"], head["tokens_per_s"] / seq["tokens_per_s"])
    else:
        assert res["pipelined_vs_sequential"] is None and res["targets"]["pipelined_faster_than_sequential"]["met"] is None

    rows = [c for c in res["configs"] if c.get("kind") == "sessions" and c.get("sweep") == res["sessions_sweep"]]
    by_n = {r["sessions"]: r for r in rows}
    assert set(by_n) == {1, 8}
    for r in rows:
        assert r["tokens"] > 0 and close(r["tokens_per_s"], r["tokens"] / r["wall_s"])
        busy = r["cpu_cores_busy"]  # measured from /proc: the batching target did the work, not the other one
        assert busy["target-batched"] > max(0.05, busy.get("target", 0.0))
        assert sum(busy.values()) <= res["machine"]["cpus"] + 0.5
    assert close(res["throughput_8_sessions_vs_1"], by_n[8]["tokens_per_s"] / by_n[1]["tokens_per_s"])
    for key, thr, _ in TARGETS:
        t = res["targets"][key]
        if t["value"] is not None:
            assert t["met"] == (t["value"] > thr if key == "pipelined_faster_than_sequential"
                                else t["value"] < thr if key in LOWER_IS_BETTER else t["value"] >= thr)


@ON_THE_RUN
def test_bench_overhead_share_comes_from_the_orchestrator_stats(bench_run):
    """The gRPC + Redis overhead target: the headline's critical-path RPC overhead and Redis commits per step (the
    orchestrator's stats, from its own run) over the target step of the microbenchmark."""
    res, _ = bench_run
    step_ms = res["microbench"]["target_step_ms"]
    for c in res["configs"]:
        if not c.get("kind", "").startswith("specdec") or not c.get("available"):
            continue
        st, per = c["service_stats"], c["per_step_ms"]
        steps = st["verify_steps"] + st["decode_steps"]
        assert st["rpc_overhead_ms"] > 0 and st["store_ms"] > 0  # real round trips and Redis commits cost time
        assert close(per["rpc_overhead"], st["rpc_overhead_ms"] / steps)
        assert 0 <= st["store_overlapped_ms"] <= st["store_ms"]
        assert close(c["system_overhead_ms_per_step"],
                     (st["rpc_overhead_ms"] + st["store_ms"] - st["store_overlapped_ms"]) / steps)
        assert close(c["system_overhead_share"], c["system_overhead_ms_per_step"] / step_ms)
    head = {c["name"]: c for c in res["configs"]}[res["headline_config"]]
    assert close(res["system_overhead_share"], head["system_overhead_share"])
    assert res["targets"]["system_overhead_share"]["why"]  # met or not, it shows the measurement
    # The floor it is judged against: a bare gRPC call around the target's own forward, each case measured
    ov = res["overheads"]
    for key in ("grpc_bare_ms", "grpc_bare_after_wait_ms", "grpc_bare_after_forward_ms"):
        assert ov[key] > 0, key
    assert "a bare gRPC call (no service code) around the target's forward" in \
        res["targets"]["system_overhead_share"]["why"]


@ON_THE_RUN
def test_bench_counts_each_processs_cpu_time_per_token(bench_run):
    """Every timed specdec configuration carries the CPU ms per generated token of the processes that served it
    (read from /proc around each sample), and the target-only breakdown repeats it: the target burned CPU for its
    forwards, the orchestrator and Redis for the blocks, the bench process for its client."""
    res, _ = bench_run
    rows = {c["name"]: c for c in res["configs"]}
    cpu = rows["specdec-target-only"]["cpu_ms_per_token"]
    assert {"target", "redis", "bench clients"} <= set(cpu)
    assert sum(cpu.values()) > 0 and all(v >= 0 for v in cpu.values())
    assert res["overheads"]["target_only_ms_per_token"]["cpu_ms_per_token"] == cpu


def test_bench_writes_table_and_plot(bench_run):
    res, out = bench_run
    md = (out / "latest.md").read_text()
    assert "| configuration | g | tokens/s | speedup |" in md and "## Targets" in md
    assert "specdec-target-only" in md or "specdec target-only" in md
    png = (out / "latest.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    assert json.loads((out / "latest.json").read_text())["headline_config"] == res["headline_config"]


@ON_THE_RUN
def test_tree_configuration_is_benchmarked_against_the_chain(bench_run):
    res, _ = bench_run
    by_name = {c["name"]: c for c in res["configs"]}
    tree, chain = by_name["specdec-tree-n3"], by_name["specdec-seq-g3"]
    assert tree["available"], tree.get("reason")
    assert tree["output_matches_target_only"] == 1.0
    # Drafted trees and verified them: not a run of draft failures decoded target-only (which matches too).
    assert "warning" not in tree and tree["service_stats"]["verify_steps"] > 0
    for key in ("tokens_per_s", "mean_accepted_length"):
        assert key in tree and key in chain


def test_the_tree_configuration_needs_a_draft_that_drafts_trees():
    """An int8 draft (lean forward, no tree mask) answers tree requests with chains: the bench says so instead of
    running a chain under a tree's name; a model draft runs it."""
    from types import SimpleNamespace

    from bench.configs import _draft_drafts_trees
    from tests.harness import INT8_SELF, start_draft

    for spec, expected in ((INT8_SELF, False), (DRAFT, True)):
        server = start_draft(spec)
        try:
            trees, why = _draft_drafts_trees(SimpleNamespace(addresses={"draft": server.address}))
        finally:
            server.stop()
        assert trees is expected
        assert ("drafts chains only" in why) is not expected


def test_a_configuration_whose_draft_failed_is_flagged():
    """A config whose draft failed still matches target-only (steps fall back): its summary and the markdown say
    how many steps fell back and why, so a slow configuration is not read as a slow method."""
    from bench.configs import Config, Sample
    from bench.summary import summarise_config

    stats = {"verify_steps": 0, "decode_steps": 5, "fallback_steps": 5, "draft_failures": 2, "decode_ms": 50.0,
             "wall_ms": 60.0, "rpc_overhead_ms": 1.0, "draft_failures_by_kind": {"internal": 2}}
    cfg = Config("specdec-tree-n3", "specdec-tree", "specdec tree", None, draft_len=3,
                 samples=[Sample("p", 0, [1, 2, 3, 4, 5], 0.1, stats)])
    out = summarise_config(cfg, None, {"target_step_ms": 10.0}, "model", {"p": [1, 2, 3, 4, 5]})
    assert out["warning"].startswith("2 draft failures (internal 2); 5 steps decoded target-only")

    clean = summarise_config(Config("specdec-seq-g3", "specdec-sequential", "specdec seq", None, draft_len=3,
                                    samples=[Sample("p", 0, [1, 2], 0.1, {"verify_steps": 1})]),
                             None, {"target_step_ms": 10.0}, "model", {})
    assert "warning" not in clean


@ON_THE_RUN
def test_the_report_shows_a_configurations_warning(bench_run):
    import copy

    from bench.report import markdown

    res = copy.deepcopy(bench_run[0])
    assert "draft failures" not in markdown(res)
    spec = next(c for c in res["configs"] if c["name"] == "specdec-seq-g3")
    spec["warning"] = "2 draft failures (internal 2); 5 steps decoded target-only (the services' logs say why)"
    assert f"- **{spec['label']}**: 2 draft failures (internal 2)" in markdown(res)


def test_orchestrators_for_an_ngram_drafter():
    """With the n-gram drafter the bench also runs it inside the orchestrator (--draft local:ngram); the auto
    orchestrators get batched twins for the sessions sweep; quick mode leaves out --pipeline on."""
    from bench.configs import orchestrator_specs
    from bench.runner import parse_args
    from bench.services import available_flags

    flags = available_flags()
    assert flags["orchestrator --draft local:ngram"] and flags["pipeline_modes"]
    quick = orchestrator_specs(parse_args(["--quick"]), flags, "ngram")
    assert set(quick) == {"orch-sequential", "orch-pipe-auto", "orch-pipe-auto-local", "orch-pipe-auto-batched",
                          "orch-pipe-auto-local-batched"}
    target, extra = quick["orch-pipe-auto-local-batched"]
    assert target == "target-batched" and "--speculation-max-sessions" not in extra  # goodput decides under load
    assert extra[extra.index("--draft") + 1] == "local:ngram"
    switched = orchestrator_specs(parse_args(["--quick", "--speculation-max-sessions", "4"]), flags, "ngram")
    assert switched["orch-pipe-auto-local-batched"][1][-2:] == ["--speculation-max-sessions", "4"]
    full = orchestrator_specs(parse_args([]), flags, "model")
    assert "orch-pipe-on" in full and "orch-pipe-auto-local" not in full and "orch-tree-n6" in full
    assert full["orch-heuristic"] == ("target", ["--draft-len-policy", "heuristic"])  # goodput's comparison
    full_ngram = orchestrator_specs(parse_args([]), flags, "ngram")
    assert full_ngram["orch-local"] == ("target", ["--draft", "local:ngram"])  # the local headline's twin


def test_every_client_thread_runs_at_least_the_asked_generations():
    from bench.configs import session_job_count
    from bench.runner import parse_args

    args = parse_args(["--quick"])
    assert [session_job_count(args, n, 4) for n in (1, 2, 4, 8)] == [4, 4, 8, 16]  # lcm(n, 4), >= 2 per thread
    args = parse_args(["--quick", "--session-gens-per-client", "1", "--session-jobs", "6"])
    assert [session_job_count(args, n, 4) for n in (1, 3, 8)] == [8, 12, 8]


@ON_THE_RUN
def test_the_http_api_is_measured_beside_grpc(bench_run):
    res, out = bench_run
    h = res["http"]
    assert res["http_grpc_ratio"] == pytest.approx(h["http"]["tokens_per_s"] / h["grpc"]["tokens_per_s"])
    assert h["same_tokens"] and h["grpc"]["requests"] == h["http"]["requests"] == 2
    assert res["ttft_ms"]["http"] > 0 and res["ttft_ms"]["grpc"] > 0
    assert "## HTTP vs gRPC" in (out / "latest.md").read_text()


@ON_THE_RUN
def test_llamacpp_keys_are_null_with_the_reason_when_llamacpp_cannot_run(bench_run):
    res, out = bench_run  # a tiny random target: no GGUF for llama.cpp
    assert res["llamacpp_tokens_per_s"] is None and res["speedup_vs_llamacpp"] is None
    assert "not a GGUF" in res["llamacpp_reason"]
    rows = [c for c in res["configs"] if c["name"].startswith("llamacpp-")]
    assert {c["kind"] for c in rows} == {"llamacpp-plain", "llamacpp-prompt-lookup"}
    assert all(not c["available"] and "not a GGUF" in c["reason"] for c in rows)
    assert "llama.cpp plain, 1 thread" in (out / "latest.md").read_text()
    assert res["llama_server_tokens_per_s"] is None and res["speedup_vs_llama_server"] is None
    assert "not a GGUF" in res["llama_server_reason"] and "not a GGUF" in res["llama_server_ngram_reason"]


@ON_THE_RUN
def test_a_tiny_random_target_runs_on_torch(bench_run):
    """--engine auto (the default) resolves as `specdec run` does: a tiny random model is no GGUF, so torch."""
    res, out = bench_run
    assert res["engine"] == "torch" and "not a GGUF" in res["engine_reason"]
    assert res["microbench"]["engine"] == "torch" and res["target_threads"] == res["settings"]["threads"]
    assert "target engine: **torch**" in (out / "latest.md").read_text()


def test_headline_vs_llamacpp_takes_plain_llamacpp_at_the_headlines_cores():
    from bench.llamacpp_rows import core_counts, headline_vs_llamacpp

    assert core_counts(1, 2) == [1, 2] and core_counts(2, 8) == [1, 2, 4] and core_counts(4, 4) == [1, 4]
    plain = {t: {"name": f"llamacpp-plain-t{t}", "kind": "llamacpp-plain", "available": True,
                 "tokens_per_s": 20.0 * t, "settings": {"threads": t}} for t in (1, 2, 4)}

    def res(flags):
        head = {"name": "specdec-pipe-auto-adaptive", "orchestrator_flags": flags, "tokens_per_s": 30.0}
        return {"headline_config": head["name"], "tokens_per_s": 30.0, "configs": [head, *plain.values()]}

    with_draft = headline_vs_llamacpp(res(["--pipeline", "auto"]), threads=1, cpus=2)  # target + draft process
    assert with_draft["llamacpp_cores"] == 2 and with_draft["llamacpp_tokens_per_s"] == 40.0
    assert with_draft["llamacpp_threads"] == 2 and close(with_draft["speedup_vs_llamacpp"], 30.0 / 40.0)
    local = headline_vs_llamacpp(res(["--draft", "local:ngram"]), threads=1, cpus=2)  # no draft process
    assert local["llamacpp_cores"] == 1 and close(local["speedup_vs_llamacpp"], 30.0 / 20.0)
    capped = headline_vs_llamacpp(res([]), threads=2, cpus=2)  # never more threads than the machine has
    assert capped["llamacpp_cores"] == 2 and capped["llamacpp_threads"] == 2
    plain[2]["tokens_per_s"] = 5.0  # 2 threads slower than one (a busy host): the anchor is the faster row
    slow = headline_vs_llamacpp(res([]), threads=1, cpus=2)
    assert (slow["llamacpp_threads"], slow["llamacpp_tokens_per_s"]) == (1, 20.0)
    for t in (1, 2):
        plain[t].update(available=False, tokens_per_s=None, reason="failed during the run: X")
    failed = headline_vs_llamacpp(res([]), threads=1, cpus=2)
    assert failed["llamacpp_tokens_per_s"] is None and failed["speedup_vs_llamacpp"] is None
    assert failed["llamacpp_reason"] == "failed during the run: X"


def test_llamacpp_anchor_rows_decode_the_gguf_greedily():
    import argparse

    from bench.llamacpp_rows import llamacpp_configs
    from specdec.models import load_tokenizer, smollm2_gguf_path

    tok = load_tokenizer(str(smollm2_gguf_path()))
    ids = tok.encode("one two three four five one two three four five one two three", add_special_tokens=True)
    args = argparse.Namespace(target_model="smollm2", threads=1, prompt_lookup_num_tokens=10)
    cfgs, closers = llamacpp_configs(args, eos_ids=[], cpus=2)
    try:
        assert [c.name for c in cfgs] == ["llamacpp-plain-t1", "llamacpp-plain-t2", "llamacpp-prompt-lookup-t2"]
        outs = {c.name: c.run(ids, 12) for c in cfgs}
        assert all(len(s.tokens) == 12 and s.wall_s > 0 for s in outs.values())
        # Greedy everywhere: the prompt-lookup anchor commits exactly plain decoding's tokens.
        assert outs["llamacpp-plain-t1"].tokens == outs["llamacpp-prompt-lookup-t2"].tokens
        stop = outs["llamacpp-plain-t1"].tokens[3]
        stopped = llamacpp_configs(args, eos_ids=[stop], cpus=1)
        try:
            assert [c.name for c in stopped[0]] == ["llamacpp-plain-t1", "llamacpp-prompt-lookup-t1"]
            first = outs["llamacpp-plain-t1"].tokens
            assert stopped[0][0].run(ids, 12).tokens == first[: first.index(stop) + 1]  # stops at EOS as specdec
        finally:
            for close_ in stopped[1]:
                close_()
    finally:
        for close_ in closers:
            close_()


def test_prompt_set_covers_every_category_and_quick_keeps_one_of_each():
    from specdec.eval_prompts import CATEGORIES, PROMPTS, select
    from bench.runner import parse_args

    kinds = [p.kind for p in PROMPTS]
    assert set(kinds) == set(CATEGORIES) and all(kinds.count(k) >= 2 for k in CATEGORIES)
    assert len({p.name for p in PROMPTS}) == len(PROMPTS)
    quick = parse_args(["--quick"])
    assert [p.kind for p in select(quick.num_prompts)] == list(CATEGORIES)  # one prompt of each, in order
    full = select(parse_args([]).num_prompts)
    assert all([p.kind for p in full].count(k) == 2 for k in CATEGORIES)
    # multi-turn prompts carry the conversation they refer to; the others are one user message
    assert all(len(p.messages()) >= 3 for p in PROMPTS if p.kind == "multi_turn")
    assert all(len(p.messages()) == 1 for p in PROMPTS if p.kind != "multi_turn")


def test_rag_prompts_carry_one_to_two_thousand_tokens_of_context():
    from specdec.eval_prompts import PROMPTS, encode
    from specdec.models import load_tokenizer, smollm2_gguf_path

    tok = load_tokenizer(str(smollm2_gguf_path()))
    lengths = {p.name: len(encode(p, tok)) for p in PROMPTS}
    assert all(1000 <= n <= 2000 for name, n in lengths.items() if name.startswith("rag-")), lengths
    assert all(n < 400 for name, n in lengths.items() if not name.startswith("rag-")), lengths


@ON_THE_RUN
def test_bench_by_category_ratios_come_from_its_tokens_per_second(bench_run):
    res, out = bench_run
    cats = res["by_category"]
    assert list(cats) == list(dict.fromkeys(p["kind"] for p in res["settings"]["prompts"]))
    for kind, c in cats.items():
        assert set(c["prompts"]) <= {p["name"] for p in res["settings"]["prompts"] if p["kind"] == kind}
        assert c["target_only_tokens_per_s"] > 0 and c["speculative_tokens_per_s"] > 0
        assert close(c["speedup_vs_target_only"], c["speculative_tokens_per_s"] / c["target_only_tokens_per_s"])
        assert c["llamacpp_tokens_per_s"] is None and c["speedup_vs_llamacpp"] is None  # tiny models: no GGUF
        assert c["greedy_identical_to_target_only"] is True  # greedy: the same tokens, category by category
        if c["mean_accepted_length"] is not None:
            assert c["mean_accepted_length"] >= 1.0 and 0.0 <= c["acceptance_rate"] <= 1.0
    assert "## By category" in (out / "latest.md").read_text()
