"""Prompt lookup first, a small draft model where the context has no match.

The n-gram drafter is free and, where the output copies the context (summaries, code edits), accepted at high
rates; elsewhere it proposes nothing and the step is a plain target decode. The model fills those gaps with a
few tokens (a weak draft pays only at short lengths). Both keep the session's tokens; the model catches up
lazily, in one forward over what it missed, the next time it is needed.
"""

from __future__ import annotations

from dataclasses import replace

from draft_service.proposers.base import Proposal, Proposer, ProposeTask
from draft_service.proposers.model import ModelProposer
from draft_service.proposers.ngram import NgramProposer


class HybridProposer(Proposer):
    strategy = "hybrid"

    def __init__(self, ngram: NgramProposer, model: ModelProposer, model_max_len: int = 2):
        if model_max_len < 1:
            raise ValueError("model_max_len must be at least 1")
        self.ngram = ngram
        self.model = model
        self.model_max_len = model_max_len
        self.vocab_size = model.vocab_size
        self.store = model.store  # KV cache gauges
        self.model_proposals = 0
        self.ngram_proposals = 0

    def _model_len(self, session_id: str) -> int:
        sess = self.model.store.get(session_id, create=False)
        return 0 if sess is None else len(sess.tokens)

    def get_candidates(self, task: ProposeTask) -> Proposal:
        session_id = task.session_id
        found = self.ngram.get_candidates(task)
        if found.tokens:
            self.ngram_proposals += 1
            # Report what BOTH hold, so the next request resends whatever the model has not seen yet.
            return Proposal(found.tokens, None, min(found.cached_len, self._model_len(session_id)), found.scores)
        # The n-gram side now holds the whole context: feed the model what it lacks from there.
        context = self.ngram.session_tokens(session_id)
        have = min(self._model_len(session_id), task.prefix_len)
        drafted = self.model.get_candidates(replace(task, prefix_len=have, delta=context[have:],
                                                    max_len=min(task.max_len, self.model_max_len), should_stop=None))
        self.model_proposals += 1
        return Proposal(drafted.tokens, drafted.probs_fp16, min(drafted.cached_len, found.cached_len))

    def release(self, session_id: str) -> bool:
        a = self.ngram.release(session_id)
        b = self.model.release(session_id)
        return a or b

    def num_sessions(self) -> int:
        return self.model.num_sessions()
