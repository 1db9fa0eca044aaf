"""A session's generation: the parts of its loop put together (state.py, step.py, stream.py)."""

from __future__ import annotations

from collections.abc import Iterator

from orchestrator.loop.state import Backends, Chunk, LoopState, Measurements, StreamControl
from orchestrator.loop.step import Step
from orchestrator.loop.stream import Stream
from orchestrator.store.records import COUNTERS, TIMERS
from orchestrator.store.session_store import SessionRecord
from orchestrator.settings import LoopConfig
from orchestrator.loop.text import TextTracker
from specdec.v1 import orchestrator_pb2 as opb


class Generation:
    def __init__(self, rec: SessionRecord, cfg: LoopConfig, backends: Backends, measured: Measurements | None = None,
                 control: StreamControl | None = None):
        self.state = LoopState(rec, cfg, backends, measured or Measurements(), control or StreamControl())
        self.text = TextTracker(backends.tokenizer, rec.params.stop)
        self.step = Step(self.state)
        self.stream = Stream(self.state, self.step, self.text)

    @property
    def rec(self) -> SessionRecord:
        return self.state.rec

    def run(self, store) -> Iterator[Chunk]:
        """The session's blocks, each stored before it is yielded (stream.py); the session's place on its target
        is given up when they end."""
        try:
            yield from self.stream.run(store)
        finally:
            self.state.leave_target()


def stats_message(rec: SessionRecord) -> opb.GenerationStats:
    s = rec.stats
    n = len(rec.generated)
    msg = opb.GenerationStats(
        prompt_tokens=len(rec.prompt_ids),
        generated_tokens=n,
        acceptance_rate=s.draft_tokens_accepted / s.draft_tokens_proposed if s.draft_tokens_proposed else 0.0,
        mean_accepted_length=(s.draft_tokens_accepted + s.verify_steps) / s.verify_steps if s.verify_steps else 0.0,
        tokens_per_second=n / (s.wall_ms / 1e3) if s.wall_ms > 0 else 0.0,
        **{k: getattr(s, k) for k in (*COUNTERS, *TIMERS)},
    )
    for kind, count in s.draft_failures_by_kind.items():
        msg.draft_failures_by_kind[kind] = count
    return msg
