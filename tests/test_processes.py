"""Real processes on loopback: the orchestrator restarts mid-generation; `specdec run --json` works."""

import json
import subprocess
import sys

import pytest

from specdec.client import SpecdecClient
from launcher.stack import LocalStack, StackConfig
from tests.harness import DRAFT_EARLY, TARGET


PROMPT = [1, 5, 9, 12, 5, 9]
MAX_NEW = 400


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    cfg = StackConfig(target_model=TARGET, draft_strategy="model", draft_model=DRAFT_EARLY, store="redis",
                      device="cpu", dtype="float32")
    s = LocalStack(cfg, str(tmp_path_factory.mktemp("stack"))).start(timeout=120)
    yield s
    s.stop()


@pytest.mark.serial  # the kill must land while the generation runs: alone after the rest (scripts/test.sh)
def test_orchestrator_restart_mid_generation_loses_and_duplicates_nothing(stack):
    with SpecdecClient(stack.address) as client:
        reference = client.generate(PROMPT, max_new_tokens=MAX_NEW, speculation=False, ignore_eos=True).token_ids
        stream = client.stream(PROMPT, max_new_tokens=MAX_NEW, ignore_eos=True, max_draft_len=3)
        received, session_id = [], None
        for msg in stream:
            session_id = msg.session_id or session_id
            assert msg.offset == len(received) or not msg.token_ids
            received += msg.token_ids
            if len(received) >= 20:
                break
        stack.orchestrator.kill()  # SIGKILL: no chance to flush or clean up
    stack.start_orchestrator()
    with SpecdecClient(stack.address) as client:
        info = client.get_session(session_id)
        assert info.status == "running" and len(info.generated_token_ids) < MAX_NEW, "killed too late to test a resume"
        stored = list(info.generated_token_ids)
        assert stored[: len(received)] == received  # everything the client saw was stored first
        rest = client.generate(resume_session_id=session_id, resume_from=len(received))
        assert received + rest.token_ids == reference
        assert rest.finish_reason == "length"
        assert rest.stats["generated_tokens"] == MAX_NEW
        # The finished session can be replayed from any offset.
        again = client.generate(resume_session_id=session_id, resume_from=100)
        assert again.token_ids == reference[100:]


def test_specdec_run_json(tmp_path):
    """`specdec run` starts the whole stack (here drafting inside the orchestrator; the stack above runs a draft
    model process); its speculative output equals transformers' greedy generate."""
    import torch

    from tests.harness import model

    prompt, n = "t1 t5 t9 t12 t5 t9", 24
    cmd = [sys.executable, "-m", "launcher.cli", "run", "--target-model", TARGET, "--draft-strategy", "local-ngram",
           "--prompt", prompt, "--no-chat", "--max-new-tokens", str(n),
           "--ignore-eos", "--mode", "speculative", "--json", "--log-dir", str(tmp_path)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    spec = json.loads(out.stdout.strip().splitlines()[-1])
    for key in ("text", "token_ids", "acceptance_rate", "mean_accepted_length", "verify_steps", "fallback_steps",
                "tokens_per_second"):
        assert key in spec
    # Reference without a second stack: the target model greedy in this process, the same tokenizer.
    loaded = model(TARGET)
    ids = loaded.tokenizer.encode(prompt, add_special_tokens=True)
    ref = loaded.model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                                pad_token_id=0)[0, len(ids):].tolist()
    assert spec["token_ids"] == ref and len(ref) == n
    assert spec["text"] == loaded.tokenizer.decode(ref, skip_special_tokens=True) and spec["text"].startswith("t")
    assert spec["verify_steps"] > 0 and spec["draft_strategy"] == "local-ngram"
    assert spec["tokens_per_second"] > 0
    from specdec.ops.cpu_affinity import format_cpu_list, local_stack_plan

    plan = local_stack_plan(1, 0) or {}  # `run` pins the target (no draft process here) where 2+ CPUs are allowed
    assert spec["cpu_affinity"] == {k: format_cpu_list(v) for k, v in plan.items()}
