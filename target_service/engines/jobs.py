"""A verify step as the engine's batcher and the tree verifier see it: the job a call submits and its outcome."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

from specdec.core.sampling import SamplingParams


@dataclass
class VerifyOutcome:
    num_accepted: int
    next_token: int
    cached_len: int
    verify_ms: float
    batch_size: int = 1
    accepted_nodes: tuple[int, ...] = ()  # tree speculation: the accepted path's node indices


@dataclass
class VerifyJob:
    session_id: str
    prefix_len: int
    delta: list[int]
    draft_tokens: list[int]
    draft_probs: torch.Tensor | None
    params: SamplingParams
    seed: int
    step: int
    tree_parents: list[int] | None = None  # tree speculation: draft_tokens is a token tree
    generator: torch.Generator | None = None  # set by a batched Decode: one stream for all its tokens
    deadline: float | None = None  # time.monotonic() its caller stops waiting: the batcher skips it after that
    # set by a batched Decode: the session object it prefilled, used instead of a store lookup so that another
    # session evicting it between the steps cannot lose its tokens (an engine's own type; None: look it up)
    session: object | None = None
    result: VerifyOutcome | None = None
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)

    def outcome(self) -> VerifyOutcome:
        if self.error is not None:
            raise self.error
        return self.result
