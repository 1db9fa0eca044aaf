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


def prompt_session(loaded, ids: list[int]):
    # The services' own KV-cache code path (specdec.core.kv_cache.CachedLM), so the step times match theirs.
    from specdec.core.kv_cache import CachedLM, SessionCacheStore

    lm = CachedLM(loaded, SessionCacheStore())
    sess = lm.store.get("bench-microbench")
    tok = int(lm.extend(sess, list(ids))[-1].argmax())
    return lm, sess, tok


def step_costs(target, draft, ids: list[int], sizes: list[int], reps: int = 8, target_session=None) -> dict:
    """Median forward times, interleaved so drift of a shared machine hits every number alike.

    Each repetition times, in an order rotated per repetition, one cached forward of n new tokens on the
    target for n in ``[1] + sizes`` (each cropped back afterwards, so the context stays the prompt), and
    after each of them one single-token draft step (when there is a draft model). target_session: the target's
    (lm, session, next token) after the prompt when not the torch model's (the llama.cpp engine's)."""
    t_lm, t_sess, tok = target_session or prompt_session(target, ids)
    t_base = len(t_sess.tokens)
    d = None
    if draft is not None:
        d_lm, d_sess, d_tok = prompt_session(draft, ids)
        d = (d_lm, d_sess, d_tok, len(d_sess.tokens))
    order = [1] + [n for n in sizes if n != 1]
    times: dict[int, list[float]] = {n: [] for n in order}
    dtimes: list[float] = []
    for r in range(reps + 1):  # repetition 0 is a warm-up
        k = r % len(order)
        for n in order[k:] + order[:k]:
            t0 = time.perf_counter()
            t_lm.extend(t_sess, [tok] * n)
            dt = (time.perf_counter() - t0) * 1e3
            t_lm.crop(t_sess, t_base)
            if r:
                times[n].append(dt)
            if d is not None:
                d_lm, d_sess, d_tok, d_base = d
                t0 = time.perf_counter()
                d_lm.extend(d_sess, [d_tok])
                dt = (time.perf_counter() - t0) * 1e3
                d_lm.crop(d_sess, d_base)
                if r:
                    dtimes.append(dt)
    med = statistics.median
    return {"target_ms": {n: med(v) for n, v in times.items()}, "draft_step_ms": med(dtimes) if dtimes else None,
            "reps": reps}
