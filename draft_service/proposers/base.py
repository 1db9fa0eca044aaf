"""The proposer interface every drafting strategy implements (cf. transformers' CandidateGenerator)."""

from __future__ import annotations

import abc
from dataclasses import dataclass

import torch

from specdec.core.sampling import SamplingParams


@dataclass
class Proposal:
    tokens: list[int]
    # float16 [k, V]: the distribution each token was drawn from (sampling with a model draft), else None.
    probs_fp16: torch.Tensor | None
    cached_len: int  # committed-or-drafted tokens the proposer holds for the session afterwards
    scores: list[float] | None = None  # evidence per token (ProposeResponse.token_scores), if the drafter has any


class Proposer(abc.ABC):
    strategy: str = "abstract"
    vocab_size: int

    @abc.abstractmethod
    def get_candidates(
        self,
        session_id: str,
        prefix_len: int,
        delta: list[int],
        max_len: int,
        params: SamplingParams,
        seed: int,
        step: int,
        min_confidence: float = 0.0,
    ) -> Proposal:
        """Sync the session to prefix_len + delta (cropping what was rejected) and draft up to max_len tokens."""

    @abc.abstractmethod
    def release(self, session_id: str) -> bool:
        """Free the session's state."""

    def num_sessions(self) -> int:
        return 0

    @property
    def drafts_trees(self) -> bool:
        """Whether tree requests get a tree (get_tree); a drafter that cannot answers them with a chain."""
        return callable(getattr(self, "get_tree", None))
