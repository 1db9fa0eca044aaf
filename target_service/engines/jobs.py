"""What a call asks of a target engine, built once from the wire message (target_service/server.py): a Verify
(VerifyTask) or a target-only Decode (DecodeTask); and a verify step as the engine's batcher and the tree verifier
see it: the job a call submits (VerifyJob) and its outcome."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, replace

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
    """The batcher's mutable record of one verify: its task (what was asked), how the call wants it run, and
    its outcome once computed."""

    task: VerifyTask
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


@dataclass(frozen=True)
class VerifyTask:
    """One Verify: the context delta after the session's first prefix_len cached tokens, and a draft block (a chain,
    or a token tree when tree_parents is set) judged in one forward with the step's random stream (seed, step)."""

    session_id: str
    prefix_len: int
    delta: list[int]
    draft_tokens: list[int]
    draft_probs: torch.Tensor | None
    params: SamplingParams
    seed: int = 0
    step: int = 0
    tree_parents: list[int] | None = None

    def job(self) -> VerifyJob:
        """The batcher's mutable record of this verify (its own copies of the lists)."""
        return VerifyJob(replace(self, delta=list(self.delta), draft_tokens=list(self.draft_tokens),
                                 tree_parents=None if self.tree_parents is None else list(self.tree_parents)))


@dataclass(frozen=True)
class DecodeTask:
    """One target-only Decode (or DecodeStream): up to max_tokens tokens after the context delta, ending early at
    any of stop_token_ids, with one random stream (seed, step) for the whole call."""

    session_id: str
    prefix_len: int
    delta: list[int]
    max_tokens: int
    params: SamplingParams
    seed: int = 0
    step: int = 0
    stop_token_ids: frozenset[int] = frozenset()

    def __post_init__(self):
        object.__setattr__(self, "stop_token_ids", frozenset(self.stop_token_ids))

    def moved(self, prefix_len: int, delta: list[int]) -> DecodeTask:
        """The same decode from another point of the context (after a prefill of part of the delta)."""
        return replace(self, prefix_len=prefix_len, delta=list(delta))
