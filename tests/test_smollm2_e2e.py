"""The real default model, SmolLM2-135M-Instruct, through the gRPC services and Redis: speculative greedy output
is token-identical to target-only greedy output (n-gram drafter, and the model as its own draft)."""

import pytest

from tests.harness import start_stack

pytestmark = pytest.mark.smollm2

PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number.",
    "Summarise in one sentence: The cat sat on the mat because the mat was warm and the sun was shining.",
]


@pytest.mark.parametrize("draft", ["ngram", "smollm2"])
def test_smollm2_speculative_equals_target_only(redis_url, draft):
    stack = start_stack(redis_url, target="smollm2", draft=draft)
    try:
        for prompt in PROMPTS:
            ref = stack.client.generate(prompt, max_new_tokens=32, chat=True, speculation=False)
            spec = stack.client.generate(prompt, max_new_tokens=32, chat=True, max_draft_len=4)
            assert spec.token_ids == ref.token_ids
            assert spec.text == ref.text and len(ref.text) > 20
            assert spec.stats["verify_steps"] > 0
            if draft == "smollm2":
                assert spec.stats["acceptance_rate"] == 1.0
    finally:
        stack.stop()
