"""The draft length without a cost model: fixed, or transformers' heuristic (orchestrator/policy/draft_length.py
has the goodput policy and picks between them)."""

from __future__ import annotations


class DraftLength:
    """Fixed, or the heuristic transformers uses for assisted generation: +2 after a fully accepted block,
    -1 after a rejection."""

    free = False  # heuristic and fixed lengths treat every drafter alike (use_free_drafter)
    stream_open = False  # set by the step; nothing here prices it
    context = 0

    def __init__(self, start: int, max_len: int, adaptive: bool):
        self.k = max(1, min(start, max_len))
        self.max_len = max_len
        self.adaptive = adaptive

    def update(self, proposed: int, accepted: int) -> None:
        if not self.adaptive or proposed == 0:
            return
        self.k = min(self.max_len, self.k + 2) if accepted == proposed else max(1, self.k - 1)

    def step_taken(self) -> None:
        """Heuristic and fixed lengths never pause."""

    def dry(self) -> bool:
        """Heuristic and fixed lengths never pause: a step that drafted nothing takes the dry ramp."""
        return False

    def request_len(self, k: int) -> int:
        """How many tokens to ask the drafter for when this step drafts k."""
        return k

    def use_free_drafter(self, free: bool) -> None:
        """Heuristic and fixed lengths treat every drafter alike."""

    def verify_len(self, scores: list[float], limit: int) -> int:
        """How many of the drafted tokens to verify, given the drafter's scores for them."""
        return len(scores)

    def observe_evidence(self, scores: list[float], verified: int, accepted: int) -> None:
        """Heuristic and fixed lengths ignore the drafter's scores."""
