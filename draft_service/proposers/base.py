"""The proposer interface every drafting strategy implements (cf. transformers' CandidateGenerator)."""

from __future__ import annotations

import abc
from collections.abc import Callable
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


@dataclass(frozen=True)
class ProposeTask:
    """One Propose as a drafter takes it, built once from the wire message (draft_service/servicer.py): sync the
    session to prefix_len + delta and draft up to max_len tokens with the step's random stream (seed, step).
    What a drafter has no use for it ignores: min_confidence (stop after a less confident token), principal (the
    caller the session belongs to: drafters that learn across sessions keep principals apart), kv ((keys, values)
    of delta's first tokens, installed instead of a prefill; prefix_len 0 only), should_stop (checked between
    tokens: a cancelled call stops early)."""

    session_id: str
    prefix_len: int
    delta: list[int]
    max_len: int
    params: SamplingParams
    seed: int = 0
    step: int = 0
    min_confidence: float = 0.0
    principal: str = ""
    kv: tuple[torch.Tensor, torch.Tensor] | None = None
    should_stop: Callable[[], bool] | None = None


class Proposer(abc.ABC):
    strategy: str = "abstract"
    vocab_size: int

    @abc.abstractmethod
    def get_candidates(self, task: ProposeTask) -> Proposal:
        """Sync the session to prefix_len + delta (cropping what was rejected) and draft up to max_len tokens."""

    @abc.abstractmethod
    def release(self, session_id: str) -> bool:
        """Free the session's state."""

    def take_final(self, session_id: str, prefix_len: int, delta: list[int]) -> None:
        """A finished session's last tokens (after the prefix_len it was shown), just before its release: a drafter
        that learns across sessions takes them in; the others have no use for them."""

    def num_sessions(self) -> int:
        return 0

    @property
    def drafts_trees(self) -> bool:
        """Whether tree requests get a tree (get_tree); a drafter that cannot answers them with a chain."""
        return callable(getattr(self, "get_tree", None))
