"""Evaluation on held-out continuations: greedy acceptance per position, the mean accepted length for a
draft length, the speedup it predicts, and per-token decode latency."""

from __future__ import annotations

import copy
import time
from typing import Any, Sequence

import torch

from offline.distill.teacher import TeacherData
from offline.distill.train import _pad_batch, length_sorted_batches


@torch.no_grad()
def greedy_matches(model: Any, data: TeacherData, pad_id: int, batch_tokens: int = 4096) -> list[torch.Tensor]:
    """Per held-out sequence, a bool vector: model argmax == teacher argmax at each generated position."""
    model.eval()
    out: list[torch.Tensor | None] = [None] * len(data)
    for b in length_sorted_batches(data, batch_tokens):
        ids, att, flat_pos, tidx, _, _ = _pad_batch(data, b, pad_id)
        hidden = model.model(input_ids=ids, attention_mask=att).last_hidden_state
        h = hidden.reshape(-1, hidden.shape[-1]).index_select(0, flat_pos)
        pred = model.lm_head(h).float().argmax(-1)
        match = pred == tidx[:, 0].long()
        off = 0
        for i in b:
            n = int(data.topk_idx[i].shape[0])
            out[i] = match[off:off + n].clone()
            off += n
    return [m for m in out if m is not None]


def acceptance_metrics(matches: Sequence[torch.Tensor], gamma: int) -> dict[str, float]:
    """Greedy speculative-decoding statistics from per-position argmax matches.

    * ``acceptance_rate``: fraction of positions where draft argmax == target argmax.
    * ``mean_accepted_len``: simulated greedy speculative decoding along each
      continuation: each round drafts ``gamma`` tokens, accepts up to the first
      mismatch, then the target supplies one token; mean accepted per round.
    * ``mean_accepted_len_any_start``: mean over every start position of the
      number of leading matches in the next ``gamma`` positions.
    * ``iid_expected_accepted_len``: ``sum_{i=1..gamma} a^i`` for the rate ``a``.
    """
    tot = sum(int(m.numel()) for m in matches)
    hits = sum(int(m.sum()) for m in matches)
    a = hits / max(tot, 1)
    rounds, accepted = 0, 0
    any_sum, any_n = 0, 0
    for m in matches:
        v = m.tolist()
        n = len(v)
        t = 0
        while t < n:
            k = 0
            while k < gamma and t + k < n and v[t + k]:
                k += 1
            rounds += 1
            accepted += k
            t += k + 1
        run = 0
        runs = [0] * n
        for j in range(n - 1, -1, -1):
            run = run + 1 if v[j] else 0
            runs[j] = run
        any_sum += sum(min(r, gamma) for r in runs)
        any_n += n
    return {
        "positions": tot,
        "acceptance_rate": a,
        "gamma": gamma,
        "mean_accepted_len": accepted / max(rounds, 1),
        "mean_accepted_len_any_start": any_sum / max(any_n, 1),
        "iid_expected_accepted_len": sum(a ** i for i in range(1, gamma + 1)),
    }


def expected_speedup(a: float, gamma: int, c: float) -> float:
    """Speculative speedup (1 - a^(g+1)) / ((1 - a)(g c + 1)) for i.i.d. acceptance ``a``."""
    if a >= 1.0:
        return (gamma + 1) / (gamma * c + 1)
    return (1 - a ** (gamma + 1)) / ((1 - a) * (gamma * c + 1))


@torch.no_grad()
def decode_latency_ms(model: Any, dtype: torch.dtype, prompt_len: int = 64, n_tokens: int = 32, vocab: int | None = None,
                      repeats: int = 3) -> float:
    """Per-token latency (ms) of cached single-token decode steps after a prefill, batch 1.

    The median step time of each of ``repeats`` runs, minimum over runs (robust to other load on the machine).
    """
    from transformers import DynamicCache

    m = model if next(model.parameters()).dtype == dtype else copy.deepcopy(model).to(dtype)
    m.eval()
    V = vocab or int(m.config.vocab_size)
    g = torch.Generator().manual_seed(0)
    best = float("inf")
    for _ in range(repeats):
        ids = torch.randint(0, V, (1, prompt_len), generator=g)
        cache = DynamicCache(config=m.config)
        out = m(input_ids=ids, cache=cache, use_cache=True)
        tok = out.logits[:, -1:].argmax(-1)
        times = []
        for _ in range(n_tokens):
            t0 = time.perf_counter()
            out = m(input_ids=tok, cache=cache, use_cache=True)
            tok = out.logits[:, -1:].argmax(-1)
            times.append(time.perf_counter() - t0)
        times.sort()
        best = min(best, times[len(times) // 2])
    return 1000.0 * best
