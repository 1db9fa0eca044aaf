"""The chaos suite, quick version: every scenario on one shared stack of real processes (docs/chaos.md).

One `python -m chaos --scenario all --quick --json` run (a few minutes here) feeds one test per scenario.
"""

import json
import subprocess
import sys

import pytest

from chaos import DRAFT_FAULTS, SCENARIOS
from chaos.report import markdown
from chaos.scenarios import checks

pytestmark = pytest.mark.serial  # timing-sensitive: runs after the parallel part, alone (scripts/test.sh)

RUN_TIMEOUT_S = 600  # the budget is about 4 minutes (kill_target_pool starts a stack of its own); this only stops a hung run


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("chaos-logs")
    cmd = [sys.executable, "-m", "chaos", "--scenario", "all", "--quick", "--json", "--seed", "0",
           "--log-dir", str(log_dir)]
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


@pytest.mark.timeout(RUN_TIMEOUT_S + 60)  # the first one runs the whole suite in its fixture: past the 300 s default
@pytest.mark.parametrize("name", SCENARIOS)
def test_scenario(results, name):
    assert name in results, f"{name} produced no result"
    res = results[name]
    assert "error" not in res, _why(res)
    for key in ("scenario", "requests", "completed", "failed", "mismatched_tokens", "fallback_steps",
                "speculation_resumed", "max_stall_ms", "draft_failures_by_kind", "replica_failovers", "duration_s",
                "p50_latency_ms", "p95_latency_ms"):
        assert key in res, key
    # Every scenario: every request completes (a resumed one counts), no token lost, changed or duplicated,
    # and the store holds exactly what each client received.
    assert res["requests"] > 0 and res["completed"] == res["requests"] and res["failed"] == 0, _why(res)
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


def test_store_commit_survives_a_lost_exec_reply(redis_server):
    """What redis_restart hits by chance, made deterministic: Redis applies a commit but its reply is lost;
    the orchestrator's store retry (orchestrator/loop/stream.py: store_with_grace) must not store the block twice."""
    from chaos.redis_proxy import ExecReplyDroppingProxy
    from orchestrator.loop.stream import store_with_grace
    from orchestrator.session_store import RedisSessionStore, SessionRecord
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
