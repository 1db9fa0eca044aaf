"""Chaos on the llama.cpp target engine: every draft replica killed mid-load, with the SmolLM2 GGUF served by
`--engine llamacpp` and n-gram draft replicas. Streams fall back to target-only decoding, speculation resumes
once the replicas are back, and every reply is token-identical to the same engine's target-only decoding (the
harness's references come from this stack's own target)."""

import json
import subprocess
import sys

import pytest

# heavy: 76-108 s on a busy 2-core AMD EPYC host (`pytest -m heavy tests/test_llamacpp_chaos.py`). It guards the
# engine's batch invariance: on the unified KV cache (--llama-kv-unified) 41 tokens at concurrency 2 differed from
# the stack's own target-only references (docs/engines.md, "Batch invariance").
pytestmark = [pytest.mark.serial, pytest.mark.heavy]

RUN_TIMEOUT_S = 240


@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
def test_kill_all_drafts_on_the_llamacpp_engine(tmp_path):
    cmd = [sys.executable, "-m", "chaos", "--scenario", "kill_all_drafts", "--quick", "--json", "--seed", "0",
           "--target-model", "smollm2", "--engine", "llamacpp", "--draft-strategy", "ngram",
           "--speculation-max-sessions", "0",  # the stack's llama.cpp default drafts for one session at a time
           "--log-dir", str(tmp_path)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    results = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert results, f"no result (rc {out.returncode}); stderr:\n{out.stderr[-3000:]}"
    res = results[0]
    why = json.dumps({k: res.get(k) for k in ("checks", "failures", "errors", "fault", "error")}, indent=1)[:4000]
    assert "error" not in res, why
    target_log = next(tmp_path.rglob("target.log")).read_text(errors="replace")
    assert "target engine: llamacpp" in target_log  # the stack really ran the llama.cpp backend
    assert res["requests"] > 0 and res["completed"] == res["requests"] and res["failed"] == 0, why
    assert res["mismatched_tokens"] == 0 and res["duplicated_or_lost_offsets"] == 0, why  # = target-only
    assert res["store_mismatches"] == 0, why
    assert res["fallback_steps"] > 0, why  # no replica left: target-only decoding on llama.cpp
    assert res["speculation_resumed"] is True and res["post_heal_accepted_tokens"] > 0, why
    assert res["stall_bound_ms"] > 0 and res["max_stall_ms"] <= res["stall_bound_ms"], why
    assert res["ok"] is True and all(res["checks"].values()), why
