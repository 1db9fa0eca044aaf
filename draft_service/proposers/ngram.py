"""Model-free drafting: continue the latest n-gram that already occurred in the context (prompt lookup), and
with a datastore, what the target wrote after the same n-gram in other conversations."""

from __future__ import annotations

import threading
from collections import OrderedDict

from draft_service.proposers.base import Proposal, Proposer
from draft_service.proposers.datastore import NgramDatastore
from specdec.kv_cache import CacheMiss
from specdec.sampling import SamplingParams


class NgramProposer(Proposer):
    """Deterministic drafts (q is one-hot), so the verifier's rejection sampling stays exact."""

    strategy = "ngram"

    def __init__(self, vocab_size: int, max_ngram: int = 3, min_ngram: int = 1, max_sessions: int = 1024,
                 max_tokens_per_session: int = 65536, datastore: NgramDatastore | None = None):
        self.vocab_size = vocab_size
        self.datastore = datastore
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.max_sessions = max_sessions
        self.max_tokens_per_session = max_tokens_per_session
        self._sessions: OrderedDict[str, list[int]] = OrderedDict()
        self._lock = threading.Lock()

    def _tokens(self, session_id: str) -> list[int]:
        with self._lock:
            tokens = self._sessions.get(session_id)
            if tokens is None:
                tokens = self._sessions[session_id] = []
                while len(self._sessions) > self.max_sessions:
                    self._sessions.popitem(last=False)
            self._sessions.move_to_end(session_id)
            return tokens

    def get_candidates(self, session_id, prefix_len, delta, max_len, params: SamplingParams, seed, step,
                       min_confidence=0.0) -> Proposal:
        tokens = self._tokens(session_id)
        if prefix_len > len(tokens):
            raise CacheMiss(session_id, len(tokens), prefix_len)
        del tokens[prefix_len:]
        tokens.extend(delta)
        if len(tokens) > self.max_tokens_per_session:
            raise ValueError(f"context longer than {self.max_tokens_per_session} tokens")
        return Proposal(self.lookup(tokens, max_len), None, len(tokens))

    def lookup(self, tokens: list[int], max_len: int) -> list[int]:
        """The context first (what this conversation repeats is the best evidence), the datastore where the context
        has no match at all. Simulated greedy decoding, 4 drafts: held-out distill replies 1.64 tokens per verify
        step (prompt lookup alone 1.44), the bench prompts' replies 1.68 (1.49)."""
        follow = self.context_lookup(tokens, max_len, self.min_ngram)
        if follow or self.datastore is None:
            return follow
        return self.datastore.continuation(tokens, max_len)

    def context_lookup(self, tokens: list[int], max_len: int, min_ngram: int) -> list[int]:
        n_tokens = len(tokens)
        for n in range(min(self.max_ngram, n_tokens - 1), min_ngram - 1, -1):
            pattern = tokens[n_tokens - n :]
            # Latest earlier occurrence first: recent context predicts best.
            for start in range(n_tokens - n - 1, -1, -1):
                if tokens[start : start + n] == pattern:
                    follow = tokens[start + n : start + n + max_len]
                    if follow:
                        return follow
        return []

    def session_tokens(self, session_id: str) -> list[int]:
        with self._lock:
            return list(self._sessions.get(session_id, ()))

    def release(self, session_id: str) -> bool:
        with self._lock:
            return self._sessions.pop(session_id, None) is not None

    def num_sessions(self) -> int:
        return len(self._sessions)
