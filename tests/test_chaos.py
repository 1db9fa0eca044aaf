"""The chaos suite, quick version: every scenario on one shared stack of real processes (docs/chaos.md).

One `python -m chaos --scenario NAME... --quick --json` run of the selected scenarios (all but the heavy ones by
default: about 3 minutes here) feeds one test per scenario.
"""

import json
import subprocess
import sys

import pytest

from chaos import DRAFT_FAULTS, NETWORK_SCENARIOS, SCENARIOS
from chaos.report import markdown
from chaos.scenarios import checks


RUN_TIMEOUT_S = 600  # the budget is 3-6 minutes on a busy host; this only stops a hung run
# Cheap to run but close to a default-suite scenario (a slower link, connections cut): only with -m heavy.
HEAVY_SCENARIOS = ("target_latency", "redis_latency", "redis_conn_drop", "target_conn_drop", "redis_partition",
                   "slow_target")


@pytest.fixture(scope="module")
def results(request, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("chaos-logs")
    selected = {item.callspec.params["name"] for item in request.session.items
                if item.module is request.module and "name" in getattr(getattr(item, "callspec", None), "params", {})}
    names = [n for n in SCENARIOS if n in selected]  # only the scenarios whose tests run (-m, -k)
    cmd = [sys.executable, "-m", "chaos", *[a for n in names for a in ("--scenario", n)], "--quick", "--json",
           "--seed", "0", "--log-dir", str(log_dir)]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"chaos run exceeded {RUN_TIMEOUT_S} s; logs in {log_dir}; output so far:\n{e.stdout}")
    (log_dir / "results.jsonl").write_text(out.stdout)
    parsed = {}
    for line in out.stdout.splitlines():
        if line.startswith("{"):
            res = json.loads(line)
            parsed[res["scenario"]] = res
    assert parsed, f"no results (rc {out.returncode}); stderr:\n{out.stderr[-3000:]}"
    return parsed


def _why(res: dict) -> str:
    keep = ("checks", "failures", "errors", "store_notes", "stalls", "fault", "baseline", "log_problems", "log_dir",
            "request_detail", "error")
    return json.dumps({k: res.get(k) for k in keep}, indent=1)[:6000]


@pytest.mark.serial  # stall bounds: the scenarios run alone after the parallel part (scripts/test.sh)
@pytest.mark.timeout(RUN_TIMEOUT_S + 60)  # the first one runs the whole suite in its fixture: past the 300 s default
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.heavy) if n in HEAVY_SCENARIOS else n
                                  for n in SCENARIOS])
def test_scenario(results, name):
    assert name in results, f"{name} produced no result"
    res = results[name]
    assert "error" not in res, _why(res)
    for key in ("scenario", "requests", "completed", "failed", "mismatched_tokens", "fallback_steps",
                "speculation_resumed", "max_stall_ms", "draft_failures_by_kind", "replica_failovers", "duration_s",
                "p50_latency_ms", "p95_latency_ms"):
        assert key in res, key
    # Every scenario: every request completes (a resumed one counts), no token lost, changed or duplicated,
    # and the store holds exactly what each client received. Where Redis lost data, a request may end DATA_LOSS
    # instead, and the store may lack a session or its tail, never have a hole (faults_network.py).
    lost = res["ended_data_loss"] if res.get("data_loss_allowed") else 0
    assert res["requests"] > 0 and res["completed"] + lost == res["requests"] and res["failed"] == lost, _why(res)
    if name == "sampling_draft_faults":  # sampled output: no greedy reference; its distribution is tested below
        assert res["mismatched_tokens"] is None and "no_mismatched_tokens" not in res["checks"], _why(res)
    else:
        assert res["mismatched_tokens"] == 0, _why(res)
    assert res["duplicated_or_lost_offsets"] == 0, _why(res)
    assert res["store_mismatches"] == 0, _why(res)
    assert res["fault"]["error"] is None and res["fault"]["settled"], _why(res)
    # After the heal, requests verify drafts again and the draft is accepted again.
    assert res["speculation_resumed"] is True, _why(res)
    assert res["post_heal_requests"] > 0 and res["post_heal_accepted_tokens"] > 0, _why(res)
    if name in DRAFT_FAULTS:
        # A draft fault never breaks a stream and costs at most a bounded stall: the draft deadline plus a
        # few target steps (bound computed in the same run from the flags and the measured step).
        assert res["resumes"] == 0 and res["retried_requests"] == 0, _why(res)
        assert res["draft_failures"] + res["replica_failovers"] > 0, _why(res)  # live streams were hit
        assert res["stall_bound_ms"] > 0 and res["max_stall_ms"] <= res["stall_bound_ms"], _why(res)
        if name == "kill_all_drafts":
            assert res["fallback_steps"] > 0, _why(res)  # no replica left: target-only decoding
        else:
            assert res["replica_failovers"] > 0, _why(res)  # sessions moved to the surviving replica
    elif name == "kill_target":
        assert res["resumes"] == 0 and res["retried_requests"] == 0, _why(res)  # streams just paused
        assert res["target_resyncs"] > 0, _why(res)  # the restarted target rebuilt the caches
        assert res["fault"]["outage_s"] < res["config"]["target_grace_s"], _why(res)
    elif name == "kill_target_pool":
        assert res["config"]["target_replicas"] == 2, _why(res)
        assert res["resumes"] == 0 and res["target_resyncs"] > 0, _why(res)  # streams moved to the other target
        # No stream waited for the killed target: the longest stall is far below the grace period.
        assert res["max_stall_ms"] < res["config"]["target_grace_s"] * 1e3 / 3, _why(res)
    elif name == "redis_restart":
        assert res["resumes"] == 0, _why(res)  # in-flight streams waited for the store
        assert res["fault"]["outage_s"] < res["config"]["store_grace_s"], _why(res)
    elif name == "kill_orchestrator":
        assert res["resumes"] > 0 and res["resumed_streams"] > 0, _why(res)  # streams resumed by session id
    elif name in NETWORK_SCENARIOS:
        assert res["data_loss_allowed"] == name.startswith(("redis_sigkill", "redis_empty")), _why(res)
        assert "INTERNAL" not in res["error_codes"], _why(res)  # never an internal error, whatever was lost
        assert set(res["error_codes"]) <= {"DATA_LOSS", "UNAVAILABLE"}, _why(res)
        assert res["stall_bound_ms"] > 0 and res["max_stall_ms"] <= res["stall_bound_ms"], _why(res)
        if not res["data_loss_allowed"]:
            assert res["resumes"] == 0, _why(res)  # in-flight streams waited for the link
        if name == "target_partition" or name == "redis_partition":
            # several seconds held, and the streams stood still through it (then completed)
            assert res["fault"]["held_ms"] >= 3000 and res["max_stall_in_fault_window_ms"] >= 2400, _why(res)
        if name.endswith("conn_drop"):
            assert res["fault"]["connections_dropped"] > 0, _why(res)
        if name == "redis_empty_restart":
            # streams in flight at the restart lost their stored state: they end DATA_LOSS, or had finished
            assert res["ended_data_loss"] + res["fault"]["sessions_lost"] > 0, _why(res)
    elif name in ("slow_target", "hang_target"):
        # The target only waited: no stream broke, and the longest stall is the slowed calls (slow: 2 x L) or the
        # hang (its outage) plus a few loop steps.
        assert res["resumes"] == 0 and res["retried_requests"] == 0, _why(res)
        assert 0 < res["max_stall_ms"] <= res["stall_bound_ms"], _why(res)
        assert res["checks"]["fault_exercised"], _why(res)  # a step paid the latency / streams waited out the hang
        if name == "slow_target":
            assert res["post_heal_step_p50_ms"] < res["slowed_step_min_ms"], _why(res)
        else:
            assert res["fault"]["outage_s"] < res["config"]["target_grace_s"], _why(res)
    elif name == "sampling_draft_faults":
        d = res["distribution"]
        assert res["resumes"] == 0 and res["retried_requests"] == 0, _why(res)
        assert res["fallback_steps"] > 0 and res["draft_failures"] > 0, _why(res)  # the fault paths ran
        assert d["samples"] >= 300 and d["p_value"] > d["alpha"], _why(res)
        assert d["fault_path_samples"] > 0, _why(res)
        assert res["max_stall_ms"] <= res["stall_bound_ms"], _why(res)
    assert res["ok"] is True and all(res["checks"].values()), _why(res)


def test_checks_and_report_without_services():
    res = {"scenario": "kill_draft", "requests": 3, "completed": 3, "failed": 0, "mismatched_tokens": 0,
           "duplicated_or_lost_offsets": 0, "store_mismatches": 0, "speculation_resumed": True,
           "fault": {"error": None, "settled": True, "outage_s": 2.0}, "max_stall_ms": 90.0,
           "stall_bound_ms": 200.0, "resumes": 0, "retried_requests": 0, "draft_failures": 2,
           "fallback_steps": 1, "replica_failovers": 1, "healed_replica": None, "config": {}}
    assert all(checks(res).values())
    assert not checks({**res, "max_stall_ms": 250.0})["stall_within_bound"]
    assert not checks({**res, "mismatched_tokens": 1})["no_mismatched_tokens"]
    assert not checks({**res, "resumes": 1})["streams_never_broken"]
    table = markdown([{**res, "ok": True}])
    assert table.splitlines()[2].startswith("| kill_draft | 3 | 3 | 0 | 0 |")


def test_data_loss_checks_without_services():
    """The Redis-loss scenarios accept DATA_LOSS-ended requests and a lost tail, never a hole or INTERNAL."""
    from chaos.faults_network import stored_after_loss

    res = {"scenario": "redis_empty_restart", "requests": 4, "completed": 2, "failed": 2, "ended_data_loss": 2,
           "data_loss_allowed": True, "error_codes": {"DATA_LOSS": 2}, "mismatched_tokens": 0,
           "duplicated_or_lost_offsets": 0, "store_mismatches": 0, "speculation_resumed": True,
           "fault": {"error": None, "settled": True, "held_ms": 900.0}, "max_stall_ms": 900.0,
           "stall_bound_ms": 5000.0, "max_stall_in_fault_window_ms": 0.0}
    assert all(checks(res).values())
    assert not checks({**res, "ended_data_loss": 1})["all_completed"]  # the other failure was not DATA_LOSS
    assert not checks({**res, "data_loss_allowed": False})["all_completed"]  # other scenarios: every one completes
    assert not checks({**res, "error_codes": {"INTERNAL": 1}})["no_internal_error"]
    ref = [5, 6, 7, 8, 9, 10]
    assert stored_after_loss(ref[:4], ref[:4], ref, must_be_whole=True) == "exact"
    assert stored_after_loss(ref[:2], ref[:4], ref, must_be_whole=False) == "truncated"  # a lost tail
    assert stored_after_loss(None, ref[:4], ref, must_be_whole=False) == "lost"
    assert stored_after_loss([5, 6, 9, 10], ref[:4], ref, must_be_whole=False) == "bad"  # a hole
    assert stored_after_loss(ref[:2], ref, ref, must_be_whole=True) == "bad"  # completed after the restart
    assert stored_after_loss(None, ref, ref, must_be_whole=True) == "bad"


def test_target_fault_checks_without_services():
    """The stall bound and checks slow_target / hang_target add (chaos/faults_target.py), on made-up records."""
    from types import SimpleNamespace

    from chaos.faults_target import HangTarget, SlowTarget
    from chaos.harness import ChaosOptions
    from chaos.load import RequestRecord

    h = SimpleNamespace(opts=ChaosOptions(max_new_tokens=40, draft_len=4, slow_target_ms=300.0))
    tl = SimpleNamespace(injected=10.0, heal_started=11.0, settled=11.5)

    def record(phase, latency_s, step_ms=50.0):
        r = RequestRecord(0, 0, phase, start=20.0, end=20.0 + latency_s, finish="length")
        r.gaps_ms = [(20.1, 100.0), (20.2, step_ms), (20.3, step_ms)]
        return r

    def judged(fault, stall, window_stall, post_latency_s, outage_s=1.0, post_step_ms=50.0):
        res = {"stall_bound": {"bound_ms": 1.0, "steps": 6, "step_ms": 50.0}, "resumes": 0, "retried_requests": 0,
               "max_stall_ms": stall, "max_stall_in_fault_window_ms": window_stall, "checks": {},
               "fault": {"outage_s": outage_s}, "config": {"target_grace_s": 30.0}}
        fault.judge(res, [record("load", 5.0), record("post_heal", post_latency_s, post_step_ms)], tl)
        return res

    slow = SlowTarget(h, None)
    slow.delayed_calls = 0  # the target's log: no call slept
    assert not judged(slow, 700.0, 350.0, 0.5)["checks"]["fault_exercised"]
    slow.delayed_calls = 12
    res = judged(slow, 700.0, 350.0, 0.5)
    assert res["stall_bound_ms"] == 600.0 + 300.0 and all(res["checks"].values()), res
    assert not judged(slow, 901.0, 350.0, 0.5)["checks"]["stall_within_bound"]
    assert not judged(slow, 700.0, 100.0, 0.5)["checks"]["fault_exercised"]  # no step paid the latency
    assert not judged(slow, 700.0, 350.0, 2.5, post_step_ms=310.0)["checks"]["throughput_resumed"]  # still slow
    assert judged(slow, 700.0, 350.0, 9.0)["checks"]["throughput_resumed"]  # long but queued: its steps are fast
    hang = HangTarget(h, None)
    res = judged(hang, 1200.0, 900.0, 0.5, outage_s=1.0)
    assert res["stall_bound_ms"] == 1000.0 + 300.0 and all(res["checks"].values()), res
    assert not judged(hang, 1200.0, 900.0, 0.5, outage_s=31.0)["checks"]["within_target_grace"]
    assert not judged(hang, 1200.0, 500.0, 0.5)["checks"]["fault_exercised"]  # no stream waited the hang out


def test_exact_first_tokens_is_a_distribution():
    from chaos.faults_target import SAMPLING, exact_first_tokens
    from chaos.harness import TINY_TARGET

    dist = exact_first_tokens(TINY_TARGET, [5, 6, 7])
    assert abs(sum(dist.values()) - 1.0) < 1e-5
    assert 1 < len(dist) <= SAMPLING["top_k"] ** 2 and all(len(k) == 2 for k in dist)


def test_store_commit_survives_a_lost_exec_reply(redis_server):
    """What redis_restart hits by chance, made deterministic: Redis applies a commit but its reply is lost;
    the orchestrator's store retry (orchestrator/loop/stream.py: store_with_grace) must not store the block twice."""
    from chaos.redis_proxy import ExecReplyDroppingProxy
    from orchestrator.loop.stream import store_with_grace
    from orchestrator.store.session_store import RedisSessionStore, SessionRecord
    from orchestrator.settings import LoopConfig
    from tests.harness import loop_state

    proxy = ExecReplyDroppingProxy(redis_server.port)
    try:
        store = RedisSessionStore(proxy.url)
        rec = SessionRecord("chaos-lost-reply", [1, 2, 3], {"owner": ""})
        store.create(rec)
        state = loop_state(rec, LoopConfig(store_grace_s=5.0))
        for block in ([7, 8], [9, 10], [11]):
            if block == [9, 10]:
                proxy.drop_next_exec_reply()
            rec.generated += block
            store_with_grace(state, lambda b=block: store.commit(rec, b))
        assert proxy.dropped == 1
        stored = RedisSessionStore(redis_server.url).load(rec.session_id).generated
        assert stored == rec.generated == [7, 8, 9, 10, 11], f"stored {stored}"
    finally:
        proxy.close()


def test_stall_bound_counts_the_longest_fault_free_step():
    """D + M x S with S the longest fault-free loop step (not its p95), scaled by the target's slowdown."""
    from chaos.harness import ChaosHarness, ChaosOptions

    h = object.__new__(ChaosHarness)  # the bound needs only the options, prompts and baseline: no services
    h.opts = ChaosOptions(draft_timeout_floor_ms=100.0, draft_timeout_factor=2.0)
    h.prompts = [[1] * 10]
    h.baseline = {"target_step_ms": 3.0, "step_p95_ms": 27.0, "max_stall_ms": 37.0, "stall_steps": 6}
    # D: a call that must prefill its context (74 tokens: 10 + 64 new) on a half-open replica may wait the budget
    # (factor x 4 drafted tokens x the step = 24 ms) plus factor x context x the step (the prefill rate's cap)
    b = h.stall_bound(3.0)
    assert b["draft_deadline_ms"] == 24.0 + 2 * 74 * 3.0 and b["bound_ms"] == 468.0 + 6 * 37.0
    slow = h.stall_bound(6.0)  # the target itself ran 2x slower during the fault: host contention
    assert slow["contention"] == 2.0 and slow["bound_ms"] == 48.0 + 2 * 74 * 6.0 + 6 * 37.0 * 2.0
    h.opts = ChaosOptions(draft_timeout_floor_ms=1000.0, draft_timeout_factor=2.0)  # the floor, where it is longer
    assert h.stall_bound(3.0)["draft_deadline_ms"] == 1000.0


def test_soak_reads_each_process_rss_and_prints_a_table():
    import os
    import subprocess

    from chaos.__main__ import _soak_text, parse_args
    from chaos.soak import rss_mb

    assert rss_mb(os.getpid()) > 10.0  # this interpreter: torch and friends are loaded
    assert rss_mb(None) is None
    gone = subprocess.Popen(["true"])
    gone.wait()
    assert rss_mb(gone.pid) is None
    assert parse_args(["--soak", "2.5", "--scenario", "none"]).soak == 2.5
    summary = {"soak_minutes": 1, "runs": 3, "failed_runs": [], "ok": True,
               "rss_start": {"target": {"pid": 10, "rss_mb": 300.0}, "draft0": {"pid": 11, "rss_mb": 200.0}},
               "rss_end": {"target": {"pid": 10, "rss_mb": 310.0}, "draft0": {"pid": 12, "rss_mb": 190.0}}}
    text = _soak_text(summary)
    assert "target" in text and "310.0" in text and "(restarted)" in text.splitlines()[-1]
