"""Drafting with a small causal LM that shares the target's tokenizer, with per-session KV caches."""

from __future__ import annotations

import torch

from draft_service.proposers.base import Proposal, Proposer
from specdec import sampling, wire
from specdec.kv_cache import CachedLM, SessionCacheStore
from specdec.models import LoadedModel
from specdec.sampling import SamplingParams


class ModelProposer(Proposer):
    strategy = "model"

    def __init__(self, loaded: LoadedModel, store: SessionCacheStore | None = None):
        self.loaded = loaded
        self.vocab_size = loaded.vocab_size
        self.store = store if store is not None else SessionCacheStore()
        self.lm = CachedLM(loaded, self.store)

    def get_candidates(self, session_id, prefix_len, delta, max_len, params: SamplingParams, seed, step,
                       min_confidence=0.0) -> Proposal:
        sess = self.store.get(session_id)
        with sess.lock:
            new = self.lm.sync(sess, prefix_len, delta)
            gen = None if params.is_greedy else sampling.make_generator(seed, step, "draft")
            tokens: list[int] = []
            rows: list[torch.Tensor] = []
            for _ in range(max_len):
                logits = self.lm.extend(sess, new, keep=1)[-1]
                if params.is_greedy:
                    token = int(torch.argmax(logits))
                    confidence = float(torch.softmax(logits, -1)[token])
                else:
                    # Sample from the float16-rounded q that goes on the wire, so the verifier sees the same q.
                    q16, q = wire.to_fp16_distribution(sampling.warp_probs(logits, params))
                    token = int(sampling.sample(q, gen))
                    confidence = float(q[token])
                    rows.append(q16)
                tokens.append(token)
                new = [token]
                if min_confidence > 0 and confidence < min_confidence:
                    break
            self.store.update_size(sess)
            probs = torch.stack(rows) if rows else None
            return Proposal(tokens, probs, len(sess.tokens))

    def get_tree(self, session_id, prefix_len, delta, shape, params: SamplingParams, seed, step):
        """Tree speculation: a token tree instead of a chain (see draft_service/proposers/tree.py)."""
        from draft_service.proposers.tree import propose_tree

        return propose_tree(self, session_id, prefix_len, delta, shape, params, seed, step)

    def release(self, session_id: str) -> bool:
        return self.lm.release(session_id)

    def num_sessions(self) -> int:
        return len(self.store)
