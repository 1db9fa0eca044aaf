"""What every part of a generation shares: the session, the services it calls, what the orchestrator has measured
across sessions, and this step's timings."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from orchestrator.policy.draft_length import AcceptancePrior, DraftCost, DraftEvidence, Ema, TargetCost
from orchestrator.replicas.clients import DecodeCall, ProposeCall, VerifyCall
from orchestrator.replicas.draft_pool import DraftPool
from orchestrator.store.session_store import SessionRecord
from orchestrator.replicas.target_pool import TargetPool
from orchestrator.settings import LoopConfig
from specdec.core.sampling import SamplingParams
from specdec.v1 import orchestrator_pb2 as opb

FINISH_LENGTH = opb.FINISH_REASON_LENGTH
FINISH_EOS = opb.FINISH_REASON_EOS
FINISH_STOP = opb.FINISH_REASON_STOP
FINISH_CANCELLED = opb.FINISH_REASON_CANCELLED


class GenerationError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass
class Chunk:
    tokens: list[int]
    text: str
    offset: int
    finish_reason: int = 0


class AcceptanceWindow:
    """Acceptance over the orchestrator's most recent verify steps (all sessions), for the outline and metrics."""

    def __init__(self, max_steps: int = 1000):
        self.max_steps = max_steps
        self._steps = deque(maxlen=max_steps)
        self._lock = threading.Lock()

    def add(self, proposed: int, accepted: int) -> None:
        with self._lock:
            self._steps.append((proposed, accepted))

    def snapshot(self) -> dict:
        with self._lock:
            steps = list(self._steps)
        proposed = sum(p for p, _ in steps)
        accepted = sum(a for _, a in steps)
        return {"steps": len(steps), "window_steps": self.max_steps, "proposed": proposed, "accepted": accepted,
                "acceptance_rate": accepted / proposed if proposed else None,
                "mean_accepted_length": (accepted + len(steps)) / len(steps) if steps else None}


class StepTimer(Ema):
    """EMA of a step's duration: the target forward (shared by all sessions; it sets the draft deadline) or a
    session's Propose round trip (what a prefetch saves). 0 until measured."""

    @property
    def ms(self) -> float:
        return self.get(0.0)


@dataclass
class Backends:
    """The services a generation calls, and the target model's facts it needs."""
    target: TargetPool | None
    pool: DraftPool | None
    tokenizer: object
    eos_ids: set[int]
    vocab_size: int
    target_kv_fingerprint: str = ""  # ModelInfo.kv_fingerprint of the target: drafts with the same take its KV


@dataclass
class Measurements:
    """What the orchestrator measures across its sessions (one instance shared by all generations)."""
    window: AcceptanceWindow | None = None
    target_step: StepTimer = field(default_factory=StepTimer)
    active_sessions: Callable[[], int] | None = None  # generations running in this orchestrator (load switch)
    target_cost: TargetCost | None = None  # the target's measured step costs (goodput draft length)
    acceptance_prior: AcceptancePrior | None = None  # all sessions' acceptance (goodput draft length)
    draft_evidence: DraftEvidence | None = None  # what the drafter's token scores mean (goodput draft length)
    draft_cost: DraftCost = field(default_factory=DraftCost)
    # Told each target call's wall time and deadline, in seconds (admission lowers its limit on slow calls).
    target_latency: Callable[[float, float], None] | None = None

    def sessions(self) -> int:
        """Generations running in this orchestrator now: they share the draft (DraftCost keeps costs per session)."""
        return max(1, int(self.active_sessions())) if self.active_sessions is not None else 1


@dataclass
class StreamControl:
    """This stream's hold on the session: its cancel signal and its lease token (every write is fenced by it)."""
    cancel: threading.Event = field(default_factory=threading.Event)
    lease: str = ""


class LoopState:
    """The session being generated, as every part of its loop sees it."""

    def __init__(self, rec: SessionRecord, cfg: LoopConfig, backends: Backends, measured: Measurements,
                 control: StreamControl):
        self.rec, self.cfg, self.backends, self.measured, self.control = rec, cfg, backends, measured, control
        p = rec.params
        self.sampling = SamplingParams(p.temperature, p.top_k, p.top_p)
        self.seed = int(p.seed)
        self.stop_ids = set(p.stop_token_ids) | (set() if p.ignore_eos else backends.eos_ids)
        if not p.draft_len_limit:
            raise ValueError("a generation's draft_len_limit is resolved when it is admitted (orchestrator/api/limits.py)")
        # The longest draft a step asks for: resolved once at admission (the smallest of the
        # orchestrator's, the target's and the drafts' limits); nothing in the loop clamps it again.
        self.max_draft_len = p.draft_len_limit
        self.step_server_ms: float | None = None  # the target's time in this step, if it was a plain one
        self.step_draft_ms = 0.0  # the Propose call's wall time in this step (goodput costs drafting apart)
        self.target_seat = backends.target.seat(rec.session_id) if backends.target is not None else None

    def target_replica(self):
        """The session's target replica, placed on first use; None while no replica is usable. A replica new to the
        session (it moved off one that failed) rebuilds the session's cache from the committed tokens."""
        if self.target_seat is None:  # a unit test's state: no services
            return None
        replica, moved = self.target_seat.current()
        if moved:
            self.rec.target_pos = 0
            self.stats.target_resyncs += 1
        return replica

    # The requests of a step's calls, built from the session as it stands (a call moved to another replica is built
    # again: its position is then 0). Everything they carry was resolved at admission (rec.params) or by the loop.

    def propose_call(self, max_len: int, tree: dict | None = None, kv=None) -> ProposeCall:
        rec = self.rec
        return ProposeCall(rec.session_id, rec.committed, rec.draft_pos, max_len, self.sampling, self.seed, rec.step,
                           self.cfg.draft_min_confidence, tree, kv, rec.params.owner)

    def verify_call(self, reply) -> VerifyCall:
        """The Verify of a draft reply (a chain, or a tree when reply.tree_parents is set)."""
        rec = self.rec
        return VerifyCall(rec.session_id, rec.committed, rec.target_pos, reply.tokens, reply.probs, self.sampling,
                          self.seed, rec.step, reply.tree_parents, len(rec.prompt_ids))

    def decode_call(self, max_tokens: int, block_tokens: int = 1, first_block_tokens: int = 0,
                    max_block_tokens: int = 0) -> DecodeCall:
        rec = self.rec
        return DecodeCall(rec.session_id, rec.committed, rec.target_pos, max_tokens, self.sampling, self.seed,
                          rec.step, tuple(sorted(self.stop_ids)), block_tokens, first_block_tokens, max_block_tokens,
                          len(rec.prompt_ids))

    def leave_target(self) -> None:
        if self.target_seat is not None:
            self.target_seat.leave()

    @property
    def stats(self):
        return self.rec.stats

    @property
    def vocab_size(self) -> int:
        return self.backends.vocab_size

    def sessions(self) -> int:
        return self.measured.sessions()

    def count_overhead(self, t0: float, service_ms: float, stat: str = "rpc_overhead_ms") -> float:
        """Count a call's round trip since ``t0`` less the time its service reported working (the wire's and
        gRPC's share) in the stat named ``stat``; return the round trip in ms."""
        wall_ms = (time.perf_counter() - t0) * 1e3
        setattr(self.stats, stat, getattr(self.stats, stat) + max(0.0, wall_ms - service_ms))
        return wall_ms
