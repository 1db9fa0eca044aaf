"""The serving benchmark (`python -m bench --serving`): its percentiles, Poisson schedule, latency definitions,
targets and report checked on made-up records; one tiny end-to-end run checks the JSON's shape (tiny models say
nothing about speed); and 64 sessions at once through real `specdec serve` processes, none refused or starved."""

from __future__ import annotations

import contextlib
import io
import json
import math
import statistics
import threading

import numpy as np
import pytest

from bench import serving_metrics as sm
from bench.serving import memory_report
from bench.serving_report import markdown, plot
from tests.harness import DRAFT_EARLY, TARGET


def test_percentile_interpolates_like_numpy():
    rng = np.random.default_rng(0)
    for n in (1, 2, 3, 7, 100):
        xs = list(rng.exponential(size=n))
        for q in (0, 1, 25, 50, 90, 99, 100):
            assert math.isclose(sm.percentile(xs, q), float(np.percentile(xs, q)), rel_tol=1e-12)
    assert sm.percentile([], 50) is None
    assert sm.percentile([None, 3.0], 50) == 3.0
    with pytest.raises(ValueError, match="0..100"):
        sm.percentile([1.0], 101)


def test_poisson_arrivals_are_seeded_exponential_gaps():
    a = sm.poisson_arrivals(4.0, 20000, seed=3)
    assert a == sm.poisson_arrivals(4.0, 20000, seed=3)  # both modes get the same schedule
    assert a != sm.poisson_arrivals(4.0, 20000, seed=4)
    assert a[0] == 0.0 and all(y >= x for x, y in zip(a, a[1:]))
    gaps = [y - x for x, y in zip(a, a[1:])]
    assert math.isclose(statistics.fmean(gaps), 0.25, rel_tol=0.03)  # mean 1 / rate
    # Exponential, not evenly spaced: P(gap > mean) = 1/e, and the standard deviation equals the mean.
    assert math.isclose(sum(g > 0.25 for g in gaps) / len(gaps), math.exp(-1), abs_tol=0.015)
    assert math.isclose(statistics.pstdev(gaps), 0.25, rel_tol=0.05)
    assert sm.poisson_arrivals(1.0, 0) == []
    with pytest.raises(ValueError, match="positive"):
        sm.poisson_arrivals(0.0, 5)


def _rec(prompt, chunks, wall, stats=None, tokens=None, ids=None, error=None):
    r = sm.RequestRecord(prompt, tokens=sum(c[1] for c in chunks) if tokens is None else tokens, wall_s=wall,
                         chunks=list(chunks), stats=stats or {}, token_ids=ids or [], error=error)
    return r


def test_request_latencies_follow_the_vllm_definitions():
    r = _rec("p", [(0.1, 1), (0.3, 4), (0.4, 3)], wall=0.45)
    assert r.ttft_s == 0.1
    assert math.isclose(r.tpot_s, (0.45 - 0.1) / 7)  # time after the first chunk over the tokens after it
    assert [round(g, 9) for g in r.itl_s()] == [0.2, 0.1]
    one = _rec("p", [(0.2, 5)], wall=0.2)
    assert one.tpot_s is None and one.itl_s() == []
    assert _rec("p", [], wall=1.0).ttft_s is None


def test_level_summary_counts_tokens_steps_and_errors():
    stats = {"draft_tokens_proposed": 8, "draft_tokens_accepted": 6, "verify_steps": 3, "decode_steps": 1}
    recs = [_rec("a", [(0.1, 1), (0.2, 4), (0.3, 5)], 0.3, stats),
            _rec("b", [(0.2, 2), (0.6, 8)], 0.7, {**stats, "queued_ms": 100.0}),
            _rec("c", [], 0.0, error="UNAVAILABLE: gone")]
    recs[1].refusals = 2
    s = sm.summarise_level(recs, wall_s=2.0)
    assert (s["requests"], s["completed"], s["errors"], s["refusals"]) == (3, 2, 1, 2)
    assert s["output_tokens"] == 20 and s["tokens_per_s"] == 10.0 and s["requests_per_s"] == 1.0
    assert math.isclose(s["ttft_p50_ms"], 150.0) and math.isclose(s["ttft_p99_ms"], 199.0)
    assert math.isclose(s["queued_p50_ms"], 50.0) and math.isclose(s["queued_p99_ms"], 99.0)  # inside the TTFT
    assert math.isclose(s["tpot_p50_ms"], 1e3 * statistics.fmean([0.2 / 9, 0.5 / 8]))
    assert s["acceptance_rate"] == 0.75 and s["speculated_step_share"] == 0.75
    assert s["first_error"] == "UNAVAILABLE: gone"


def _summary(tps, tpot99, share=0.5, acc=0.6):
    return {"tokens_per_s": tps, "requests_per_s": tps / 10, "ttft_p50_ms": 100.0, "ttft_p99_ms": 150.0,
            "tpot_p50_ms": tpot99 * 0.8, "tpot_p99_ms": tpot99, "itl_p50_ms": 30.0, "itl_p99_ms": 60.0,
            "acceptance_rate": acc, "speculated_step_share": share, "load_shed_steps": 3,
            "speculation_paused_steps": 4}


def _levels(ratios, tpot_ratios):
    return [sm.level_row("concurrency", n, _summary(20.0 * r, 50.0 * t), _summary(20.0, 50.0), True)
            for n, r, t in zip((1, 2, 4, 8, 16, 32, 64), ratios, tpot_ratios)]


def test_targets_met_and_missed_with_the_measurement():
    ok = sm.evaluate_targets(_levels([1.8, 1.5, 1.3, 1.1, 1.0, 0.98, 0.97], [0.6] * 6 + [1.1]))
    assert all(t["met"] is True and t["why"] == "" for t in ok.values()), ok
    bad = sm.evaluate_targets(_levels([1.4, 1.5, 1.3, 1.1, 1.0, 0.9, 0.97], [0.6] * 5 + [1.3, 1.0]))
    assert bad["single_stream_ratio"]["met"] is False
    assert "28.0 vs 20.0 tokens/s = 1.40x" in bad["single_stream_ratio"]["why"]
    e = bad["every_level_ratio"]
    assert e["met"] is False and e["at_concurrency"] == 32 and math.isclose(e["value"], 0.9)
    assert "32 streams: 18.0 vs 20.0 tokens/s = 0.90x" in e["why"] and "acceptance 0.60" in e["why"]
    t = bad["tpot_p99"]
    assert t["met"] is False and t["at_concurrency"] == 32 and "p99 TPOT 65.0 vs 50.0 ms = 1.30x" in t["why"]
    none = sm.evaluate_targets([])
    assert all(v["met"] is None and v["why"] for v in none.values())


def test_a_level_with_failed_requests_says_so():
    levels = _levels([1.8] * 7, [0.6] * 7)
    last = levels[-1]
    last["target_only"].update(errors=64, requests=64, first_error="UNAVAILABLE: target unavailable for 30 s")
    last["ratio"] = last["tpot_p99_ratio"] = None
    t = sm.evaluate_targets(levels)
    assert t["every_level_ratio"]["met"] is False and t["tpot_p99"]["met"] is False
    assert "target-only: 64 of 64 requests failed (UNAVAILABLE: target unavailable for 30 s)" in t["every_level_ratio"]["why"]
    assert "64 streams not measured" in t["tpot_p99"]["why"]


def test_same_outputs_compares_per_prompt():
    a = [_rec("x", [(0.1, 2)], 0.1, ids=[1, 2]), _rec("y", [(0.1, 1)], 0.1, ids=[3])]
    assert sm.same_outputs(a, [_rec("y", [(0.1, 1)], 0.1, ids=[3]), _rec("x", [(0.1, 2)], 0.1, ids=[1, 2])])
    assert sm.same_outputs(a, [_rec("x", [(0.1, 2)], 0.1, ids=[1, 9])]) is False
    assert sm.same_outputs(a, []) is None


def test_memory_report_checks_the_cache_bounds():
    bounds = {"target": {"max_sessions": 64, "max_cache_mb": 1}, "draft0": {"max_sessions": 64, "max_cache_mb": 1}}
    mem = {"speculative": {"rss_mib_peak": {"target": 500.0},
                           "kv_cache": {"target": {"peak_bytes": 2 ** 19, "peak_sessions": 8, "bytes_per_session": 65536.0},
                                        "draft0": {"peak_bytes": 2 ** 21, "peak_sessions": 8, "bytes_per_session": 2 ** 18}}}}
    out = memory_report(mem, bounds, 64)
    assert out["within_bounds"] is False  # the draft held 2 MiB against a 1 MiB bound
    assert mem["speculative"]["kv_cache"]["target"]["within_bounds"] is True
    assert out["kv_bytes_per_session"] == {"target": 65536.0, "draft0": 2 ** 18}
    assert memory_report({}, bounds, 64)["within_bounds"] is None


def _result(levels):
    return {"command": "python -m bench --serving --quick", "serving": {
        "mode": "quick", "levels": levels, "poisson": [], "min_ratio": min(r["ratio"] for r in levels),
        "targets": sm.evaluate_targets(levels),
        "memory": memory_report({}, {}, 64),
        "stack": {"command": "specdec up defaults", "target_model": "smollm2", "draft_strategy": "quantized"},
        "settings": {"max_new_tokens": 24, "prompts": [{"name": "a"}], "modes": "m", "poisson_requests": 8,
                     "definitions": "d"},
        "machine": {"cpus": 2, "cpu_model": "cpu", "load_average_begin": [1, 1, 1], "load_average_end": [2, 2, 2],
                    "total_s": 300.0, "service_startup_s": 30.0}}}


def test_report_table_and_plot(tmp_path):
    levels = _levels([1.8, 1.5, 1.3, 1.1, 1.0, 0.9, 0.97], [0.6] * 7)
    for r in levels:
        r["rss_mib_peak"] = {"target": 600.0, "draft0": 500.0}
    res = _result(levels)
    md = markdown(res)
    assert "| 32 | 18.0 / 20.0 | **0.90** |" in md
    assert "**not met**" in md and "32 streams: 18.0 vs 20.0 tokens/s = 0.90x" in md
    assert "Lowest ratio over the closed-loop levels: **0.90**" in md
    plot(res, tmp_path / "p.png")
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_serving_bench_end_to_end_json_shape(tmp_path):
    from bench.serving import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(["--serving", "--quick", "--json", "--no-progress", "--target-model", TARGET, "--draft-model",
                   DRAFT_EARLY, "--draft-strategy", "model", "--concurrency", "1,2", "--max-new-tokens", "6",
                   "--min-requests", "2", "--request-rates", "50", "--poisson-requests", "2", "--warmup-tokens", "2",
                   "--out-dir", str(tmp_path)])
    assert rc == 0
    res = json.loads(buf.getvalue())
    s = res["serving"]
    assert [r["concurrency"] for r in s["levels"]] == [1, 2]
    for r in s["levels"] + s["poisson"]:
        for k in ("spec_tokens_per_s", "target_only_tokens_per_s", "ratio", "ttft_p50_ms", "ttft_p99_ms",
                  "tpot_p50_ms", "tpot_p99_ms", "itl_p99_ms", "requests_per_s", "acceptance_rate",
                  "speculated_step_share"):
            assert k in r, k
        assert math.isclose(r["ratio"], r["spec_tokens_per_s"] / r["target_only_tokens_per_s"])
        assert r["speculative"]["errors"] == r["target_only"]["errors"] == 0
        assert r["same_tokens"] is True  # greedy speculation is lossless
    assert s["poisson"][0]["request_rate"] == 50.0 and s["poisson"][0]["speculative"]["requests"] == 2
    assert s["min_ratio"] == min(r["ratio"] for r in s["levels"])
    assert set(s["targets"]) == {"single_stream_ratio", "every_level_ratio", "tpot_p99"}
    assert {"target", "draft0", "orchestrator", "redis"} <= set(s["levels"][0]["rss_mib_peak"])
    assert s["memory"]["concurrency"] == 2 and set(s["memory"]["bounds"]) == {"target", "draft0"}
    assert s["stack"]["engine"] == "torch" and "GGUF" in s["stack"]["engine_reason"]  # a tiny HF model
    assert s["llama_server"]["binary"] is None and "not a GGUF" in s["llama_server"]["found"]
    assert all("llama_server" not in r for r in s["levels"])
    assert (tmp_path / "latest.md").read_text().startswith("# specdec serving benchmark")
    assert (tmp_path / "latest.png").stat().st_size > 0
    assert json.loads((tmp_path / "latest.json").read_text())["serving"]["levels"] == s["levels"]


def test_the_serving_bench_measures_the_stack_specdec_up_runs():
    """The default (--engine auto) resolves as `specdec up` does: llama.cpp for the GGUF default, n-gram drafting in
    the orchestrator, the target on the draft's cores; --engine torch keeps the PyTorch stack."""
    from bench.serving import parse_args, stack_config
    from launcher.stack import LocalStack
    from specdec.core.strategies import LOCAL_SUFFIX

    default = LocalStack(stack_config(parse_args(["--quick"]), 0))
    assert (default.engine, default.draft_strategy, default.target_threads) == ("llamacpp", LOCAL_SUFFIX, 2)
    torch_stack = LocalStack(stack_config(parse_args(["--quick", "--engine", "torch"]), 0))
    assert torch_stack.engine == "torch" and torch_stack.target_threads == 1


@pytest.mark.serial  # 64 streams through real processes
def test_64_sessions_at_once_none_refused_or_starved():
    """The target and the draft serve max_sessions + 8 worker threads: 64 sessions stepping at once (their calls held
    together by a wide batch window) all finish, never refused (the old 32-call limit answered RESOURCE_EXHAUSTED,
    which the orchestrator met with draft failures and target-only fallback) and token-identical to target-only."""
    from launcher.stack import LocalStack, StackConfig
    from specdec.client import SpecdecClient

    n = 64
    prompts = [[1 + (7 * i + j) % 60 for j in range(5 + i)] for i in range(4)]
    cfg = StackConfig(target_model=TARGET, draft_model=DRAFT_EARLY, draft_strategy="model", store="memory",
                      adaptive_draft_len=False, pipeline="on", batch_window_ms=100.0,
                      target_args=["--max-batch", "64", "--batch-wait-fraction", "0"],
                      # a loaded shared machine must not turn slow Proposes into timeouts: only refusals fail here
                      orchestrator_args=["--draft-timeout-floor-ms", "20000"])
    with LocalStack(cfg) as stack:
        with SpecdecClient(stack.address, timeout_s=120) as c:
            reference = [c.generate(p, max_new_tokens=12, ignore_eos=True, speculation=False).token_ids
                         for p in prompts]
        clients = [SpecdecClient(stack.address, timeout_s=120) for _ in range(8)]
        results: list = [None] * n
        start = threading.Barrier(n)

        def one(i):
            start.wait(30)
            try:
                results[i] = clients[i % 8].generate(prompts[i % 4], max_new_tokens=12, ignore_eos=True,
                                                     max_draft_len=3)
            except Exception as e:  # noqa: BLE001 - recorded and asserted on below
                results[i] = e

        threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(150)
        for c in clients:
            c.close()
    errors = [r for r in results if not hasattr(r, "token_ids")]
    assert not errors, errors[:3]
    for i, r in enumerate(results):
        assert r.token_ids == reference[i % 4], i
        assert r.stats.get("draft_failures", 0) == 0, r.stats.get("draft_failures_by_kind")
        assert r.stats.get("fallback_steps", 0) == 0, r.stats
        assert r.stats.get("verify_steps", 0) > 0  # it speculated: each step went through the draft and the target


def test_gpu_check_stops_with_a_clear_message_without_cuda():
    import os
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parent.parent
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "SPECDEC_PYTHON": sys.executable}
    r = subprocess.run(["bash", str(root / "scripts" / "gpu_check.sh")], env=env, capture_output=True, text=True,
                       timeout=180)
    assert r.returncode == 3, r.stderr
    assert "gpu_check: no CUDA device: torch.cuda.is_available() is False" in r.stderr
    assert "needs a machine with an NVIDIA GPU" in r.stderr and "==" not in r.stdout  # nothing else ran


def test_failed_requests_are_reported_without_their_session_ids():
    from bench.serving import without_session_ids

    msg = ("UNAVAILABLE: target unavailable for 30 s during decode: Deadline Exceeded; the session can be resumed "
           "(session 8EtYs_icZxoMl6qBLNw0y6BI, interrupted at token 8)")
    assert without_session_ids(msg) == ("UNAVAILABLE: target unavailable for 30 s during decode: Deadline Exceeded; "
                                        "the session can be resumed")
