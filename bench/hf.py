"""In-process anchors (Hugging Face ``generate``) and the direct model microbenchmarks, in the benchmark's process.

The benchmark process runs torch with one intra-op thread, like each model service (``--threads 1``).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch


@dataclass
class HFRun:
    tokens: list[int]
    wall_s: float
    target_forwards: int
    draft_forwards: int


class _Counter:
    def __init__(self, module: torch.nn.Module | None):
        self.n = 0
        self._h = module.register_forward_hook(self._hook) if module is not None else None

    def _hook(self, *_):
        self.n += 1

    def remove(self):
        if self._h is not None:
            self._h.remove()


def hf_settings(kind: str, assistant=None, prompt_lookup_num_tokens: int = 10) -> dict:
    """What HF's candidate generator will do, as configured (its own defaults; nothing tuned here)."""
    if kind == "hf_assisted":
        gc = assistant.generation_config
        return {"num_assistant_tokens": gc.num_assistant_tokens,
                "num_assistant_tokens_schedule": gc.num_assistant_tokens_schedule,
                "assistant_confidence_threshold": gc.assistant_confidence_threshold,
                "note": "HF defaults: draft up to num_assistant_tokens per step, stopping early when the draft's "
                        "top probability falls below assistant_confidence_threshold (which HF re-tunes across "
                        "calls); 'constant' = num_assistant_tokens itself is not adapted"}
    if kind == "hf_prompt_lookup":
        return {"prompt_lookup_num_tokens": prompt_lookup_num_tokens, "max_matching_ngram_size": 2,
                "note": "HF prompt-lookup decoding: copy up to prompt_lookup_num_tokens tokens after the latest "
                        "matching n-gram (n <= max_matching_ngram_size) of the context"}
    return {}


@torch.no_grad()
def hf_generate(model, ids: list[int], max_new_tokens: int, eos_ids: list[int], pad_id: int,
                assistant=None, prompt_lookup_num_tokens: int | None = None) -> HFRun:
    x = torch.tensor([ids], dtype=torch.long, device=model.device)
    kwargs = dict(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens, do_sample=False,
                  eos_token_id=list(eos_ids), pad_token_id=pad_id, temperature=None, top_p=None, top_k=None)
    if assistant is not None:
        kwargs["assistant_model"] = assistant
    if prompt_lookup_num_tokens:
        kwargs["prompt_lookup_num_tokens"] = prompt_lookup_num_tokens
    tc, dc = _Counter(model), _Counter(assistant)
    try:
        t0 = time.perf_counter()
        out = model.generate(**kwargs)
        wall = time.perf_counter() - t0
    finally:
        tc.remove()
        dc.remove()
    return HFRun(out[0, len(ids):].tolist(), wall, tc.n, dc.n)


def _session(loaded, ids: list[int]):
    # The services' own KV-cache code path (specdec.kv_cache.CachedLM), so the step times match theirs.
    from specdec.kv_cache import CachedLM, SessionCacheStore

    lm = CachedLM(loaded, SessionCacheStore())
    sess = lm.store.get("bench-microbench")
    tok = int(lm.extend(sess, list(ids))[-1].argmax())
    return lm, sess, tok


def decode_step_ms(loaded, ids: list[int], steps: int = 12) -> float:
    """Median time of one cached single-token forward (a plain decode step) after prefilling ``ids``."""
    lm, sess, tok = _session(loaded, ids)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        tok = int(lm.extend(sess, [tok])[-1].argmax())
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def block_forward_ms(loaded, ids: list[int], n: int, reps: int = 6) -> float:
    """Median time of one cached forward over ``n`` new tokens (a verify of g = n - 1 drafts), cropped back after."""
    lm, sess, tok = _session(loaded, ids)
    base = len(sess.tokens)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        lm.extend(sess, [tok] * n)
        times.append((time.perf_counter() - t0) * 1e3)
        lm.crop(sess, base)
    return statistics.median(times)
