"""The target model's work: prefill, verify a draft block in one forward pass, and target-only decoding."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from specdec import sampling
from specdec.kv_cache import CachedLM, SessionCacheStore
from specdec.models import LoadedModel
from specdec.sampling import SamplingParams


@dataclass
class VerifyOutcome:
    num_accepted: int
    next_token: int
    cached_len: int
    verify_ms: float


class TargetEngine:
    def __init__(self, loaded: LoadedModel, store: SessionCacheStore | None = None, max_draft_len: int = 16):
        self.loaded = loaded
        self.store = store if store is not None else SessionCacheStore()
        self.lm = CachedLM(loaded, self.store)
        self.max_draft_len = max_draft_len

    @property
    def vocab_size(self) -> int:
        return self.loaded.vocab_size

    def prefill(self, session_id: str, prefix_len: int, delta: list[int]) -> int:
        sess = self.store.get(session_id)
        with sess.lock:
            if delta or prefix_len < len(sess.tokens):
                new = self.lm.sync(sess, prefix_len, delta)
                self.lm.extend(sess, new)
            self.store.update_size(sess)
            return len(sess.tokens)

    def verify(
        self,
        session_id: str,
        prefix_len: int,
        delta: list[int],
        draft_tokens: list[int],
        draft_probs: torch.Tensor | None,
        params: SamplingParams,
        seed: int,
        step: int,
    ) -> VerifyOutcome:
        t0 = time.perf_counter()
        sess = self.store.get(session_id)
        with sess.lock:
            new = self.lm.sync(sess, prefix_len, delta)
            context_len = len(sess.tokens) + len(new)
            logits = self.lm.extend(sess, new + list(draft_tokens))
            # Row i predicts draft token i; the last row predicts the bonus token.
            rows = logits[len(new) - 1 :]
            gen = None if params.is_greedy else sampling.make_generator(seed, step, "verify")
            result = sampling.verify(rows, draft_tokens, draft_probs, params, gen)
            # Keep KV of the context and the accepted drafts; the next token has no KV yet.
            self.lm.crop(sess, context_len + result.num_accepted)
            self.store.update_size(sess)
            return VerifyOutcome(
                result.num_accepted, int(result.next_token), len(sess.tokens), (time.perf_counter() - t0) * 1e3
            )

    def decode(
        self,
        session_id: str,
        prefix_len: int,
        delta: list[int],
        max_tokens: int,
        params: SamplingParams,
        seed: int,
        step: int,
        stop_token_ids: set[int] = frozenset(),
    ) -> tuple[list[int], int, float]:
        t0 = time.perf_counter()
        sess = self.store.get(session_id)
        with sess.lock:
            new = self.lm.sync(sess, prefix_len, delta)
            gen = None if params.is_greedy else sampling.make_generator(seed, step, "decode")
            out: list[int] = []
            for _ in range(max_tokens):
                last = self.lm.extend(sess, new)[-1]
                if params.is_greedy:
                    token = int(torch.argmax(last))
                else:
                    token = int(sampling.sample(sampling.warp_probs(last, params), gen))
                out.append(token)
                new = [token]
                if token in stop_token_ids:
                    break
            self.store.update_size(sess)
            return out, len(sess.tokens), (time.perf_counter() - t0) * 1e3

    def release(self, session_id: str) -> bool:
        return self.lm.release(session_id)
