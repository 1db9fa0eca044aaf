"""Suffix decoding (Oliaro et al. 2024, SuffixDecoding; Snowflake's Arctic Inference, a method of vLLM): drafts from
suffix trees over this session's prompt and output and over the principal's recent outputs.

The trees are arctic-inference's `SuffixDecodingCache` (the implementation vLLM's suffix method runs; C++ behind
nanobind): per session a tree over its prompt and what it has generated so far, and per principal (the caller a
session belongs to: one user's text never drafts for another) one bounded global tree over the outputs of that
principal's recent sessions. A draft continues the longest match of the context's latest tokens in either tree;
its length follows the match (at most `max_spec_factor` tokens per matched token, each token's estimated
probability, from how often the tree's paths took it, above `min_token_prob`), so a passage the reply is quoting
drafts up to the longest block a Verify takes, and text that matches nothing drafts nothing.

Per token the drafter also sends a score (ProposeResponse.token_scores): the token's probability given the path
before it, times 2 to the power of the context it continues (the match plus the tokens drafted before it, capped at
18). The orchestrator learns what each order of magnitude of score means in acceptance (DraftEvidence) and verifies
only the prefix whose expected tokens pay for the block on the target's measured forward-cost curve.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from draft_service.proposers.base import Proposal, Proposer, ProposeTask
from specdec.core.kv_cache import CacheMiss

MAX_SCORED_CONTEXT = 18  # matched tokens beyond this add no evidence: 2**18 is the top DraftEvidence bucket (8**6)


@dataclass(frozen=True)
class SuffixLimits:
    """The trees' depth, how a draft follows its match (vLLM's defaults), and every bound."""
    max_depth: int = 64  # tokens of context matched and of tree kept per path
    max_spec_factor: float = 1.0  # at most this many drafted tokens per matched token (+ offset)
    max_spec_offset: float = 0.0
    min_token_prob: float = 0.1  # a draft stops where the path's estimated probability falls below this
    max_sessions: int = 1024
    max_tokens_per_session: int = 65536
    max_principals: int = 256  # global trees kept, least recently used go first
    responses_per_principal: int = 64  # outputs in one principal's global tree, oldest evicted first


@dataclass
class _Session:
    principal: str
    cache: object  # the principal's SuffixDecodingCache when the session started
    tokens: list[int]


class SuffixProposer(Proposer):
    """Deterministic drafts (q is one-hot), so the verifier's rejection sampling stays exact."""

    strategy = "suffix"

    def __init__(self, vocab_size: int, limits: SuffixLimits | None = None):
        from arctic_inference.suffix_decoding import SuffixDecodingCache

        self._cache_class = SuffixDecodingCache
        self.vocab_size = vocab_size
        limits = limits or SuffixLimits()
        self.max_depth = limits.max_depth
        self.max_spec_factor, self.max_spec_offset = limits.max_spec_factor, limits.max_spec_offset
        self.min_token_prob = limits.min_token_prob
        self.max_sessions, self.max_tokens_per_session = limits.max_sessions, limits.max_tokens_per_session
        self.max_principals, self.responses_per_principal = limits.max_principals, limits.responses_per_principal
        self._caches: OrderedDict[str, object] = OrderedDict()  # principal -> its cache, least recent first
        self._sessions: OrderedDict[str, _Session] = OrderedDict()
        self._lock = threading.Lock()  # the trees are not thread-safe; every call is microseconds

    def _principal_cache(self, principal: str):
        cache = self._caches.get(principal)
        if cache is None:
            # a bounded global tree: its oldest responses are evicted first (FIFO)
            cache = self._caches[principal] = self._cache_class(self.max_depth, self.responses_per_principal)
            while len(self._caches) > self.max_principals:
                self._caches.popitem(last=False)  # its live sessions keep their cache until they end
        self._caches.move_to_end(principal)
        return cache

    def _start(self, session_id: str, principal: str, tokens: list[int]) -> _Session:
        cache = self._principal_cache(principal)
        cache.start_request(session_id, tokens)
        s = self._sessions[session_id] = _Session(principal, cache, list(tokens))
        while len(self._sessions) > self.max_sessions:
            old_id, old = self._sessions.popitem(last=False)
            old.cache.stop_request(old_id)
        return s

    def _sync(self, session_id: str, prefix_len: int, delta: list[int], principal: str) -> _Session:
        s = self._sessions.get(session_id)
        if s is not None and not principal:
            principal = s.principal
        if s is None or s.principal != principal:
            if prefix_len:
                raise CacheMiss(session_id, 0, prefix_len)
            if s is not None:
                self._stop(session_id)
            return self._start(session_id, principal, delta)
        self._sessions.move_to_end(session_id)
        held = len(s.tokens)
        if prefix_len > held:
            raise CacheMiss(session_id, held, prefix_len)
        if prefix_len + len(delta) > self.max_tokens_per_session:
            raise ValueError(f"context longer than {self.max_tokens_per_session} tokens")
        # A resend from an earlier position (a resync) repeats what the tree holds: only the rest is new. A tree
        # cannot forget tokens, so a context that differs from what it holds starts the session's tree again.
        same = min(held - prefix_len, len(delta))
        if s.tokens[prefix_len:prefix_len + same] != delta[:same] or prefix_len + len(delta) < held:
            self._stop(session_id)
            return self._start(session_id, principal, s.tokens[:prefix_len] + list(delta))
        new = list(delta[same:])
        if new:
            s.cache.add_active_response(session_id, new)
            s.tokens.extend(new)
        return s

    def _stop(self, session_id: str) -> None:
        s = self._sessions.pop(session_id, None)
        if s is not None:
            s.cache.stop_request(session_id)

    def get_candidates(self, task: ProposeTask) -> Proposal:
        """The Proposer call; seed, step and min_confidence mean nothing to a deterministic, unscored-by-a-model
        drafter. task.principal: the caller the session belongs to (a session keeps the one it started with when a
        later call, e.g. a prefetch, names none)."""
        session_id, max_len = task.session_id, task.max_len
        with self._lock:
            s = self._sync(session_id, task.prefix_len, list(task.delta), task.principal)
            context = np.asarray(s.tokens[-self.max_depth:], dtype=np.int32)
            draft = s.cache.speculate(session_id, context, max_spec_tokens=max_len,
                                      max_spec_factor=self.max_spec_factor, max_spec_offset=self.max_spec_offset,
                                      min_token_prob=self.min_token_prob)
            cached = len(s.tokens)
        tokens = [int(t) for t in draft.token_ids]
        return Proposal(tokens, None, cached, token_scores(draft.probs, draft.match_len))

    def take_final(self, session_id: str, prefix_len: int, delta: list[int]) -> None:
        """The reply's last block, never drafted from, into the session's tree (the principal's tree then holds the
        whole reply once the session is released); a session this drafter no longer holds has nothing to add to."""
        with self._lock:
            if session_id in self._sessions and delta:
                try:
                    self._sync(session_id, prefix_len, list(delta), "")
                except (CacheMiss, ValueError):
                    pass  # evicted tokens or a context over the bound: the tree keeps what it has

    def release(self, session_id: str) -> bool:
        with self._lock:
            found = session_id in self._sessions
            self._stop(session_id)
            return found

    def num_sessions(self) -> int:
        return len(self._sessions)


def token_scores(path_probs, match_len: int) -> list[float]:
    """Per drafted token: its probability given the tokens drafted before it (the tree's path probabilities are
    cumulative) times 2 ** (the context it continues, capped at MAX_SCORED_CONTEXT)."""
    scores, before = [], 1.0
    for i, p in enumerate(path_probs):
        conditional = float(p) / before if before > 0 else 0.0
        before = float(p)
        scores.append(conditional * 2.0 ** min(match_len + i, MAX_SCORED_CONTEXT))
    return scores
