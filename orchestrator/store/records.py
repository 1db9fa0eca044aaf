"""What a session record stores besides its tokens: the request's parameters and the generation's statistics.

Both are stored as JSON objects carrying a `version`. A record written before the version existed (a plain dict
with the same keys, or fewer) still loads: missing keys take their defaults, keys this version does not know are
dropped.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

RECORD_VERSION = 1  # the layout of GenerationParams and GenerationStats as stored



def _from_dict(cls, data: dict | None):
    """An instance of dataclass `cls` from a stored object of any version (see the module docstring)."""
    data = dict(data or {})
    version = int(data.pop("version", 0))
    if version > RECORD_VERSION:
        raise ValueError(f"{cls.__name__} was stored by a newer orchestrator (version {version}; this one reads "
                         f"up to {RECORD_VERSION})")
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in data.items() if k in names})


class _Stored:
    def to_dict(self) -> dict:
        return {"version": RECORD_VERSION, **dataclasses.asdict(self)}

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_dict(cls, data: dict | None):
        return _from_dict(cls, data)

    @classmethod
    def from_json(cls, text: str | bytes):
        return _from_dict(cls, json.loads(text))


@dataclass
class GenerationParams(_Stored):
    """A Generate request's parameters as the session keeps them: validated, and its limits resolved, once when the
    request is admitted (orchestrator/api/limits.py); everything downstream reads them from here."""
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    max_new_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    speculation: bool = True
    max_draft_len: int = 0  # 0: the server's draft length policy; else this fixed length (within draft_len_limit)
    draft_len_limit: int = 0  # the longest draft a step may ask for: the smallest of the orchestrator's, the
    # target's and the drafts' limits (0: not resolved yet; a record stored before it existed)
    ignore_eos: bool = False
    owner: str = ""  # the principal that created the session ('' without auth)


@dataclass
class GenerationStats(_Stored):
    """A session's counters (COUNTERS) and times in ms (TIMERS), as GenerationStats in orchestrator.proto."""
    verify_steps: int = 0
    draft_tokens_proposed: int = 0
    draft_tokens_accepted: int = 0
    fallback_steps: int = 0
    fallback_tokens: int = 0
    draft_failures: int = 0
    decode_steps: int = 0
    replica_failovers: int = 0
    target_resyncs: int = 0
    pipeline_prefetches: int = 0
    pipeline_hits: int = 0
    load_shed_steps: int = 0
    speculation_paused_steps: int = 0
    draft_tokens_trimmed: int = 0
    parallel_prefills: int = 0
    kv_imports: int = 0
    draft_ms: float = 0.0
    verify_ms: float = 0.0
    wall_ms: float = 0.0
    degraded_ms: float = 0.0
    decode_ms: float = 0.0
    prefill_ms: float = 0.0
    rpc_overhead_ms: float = 0.0
    store_ms: float = 0.0
    prefetch_wait_ms: float = 0.0
    store_overlapped_ms: float = 0.0
    queued_ms: float = 0.0  # waited in the admission queue before it started (orchestrator/policy/admission.py)
    draft_failures_by_kind: dict[str, int] = field(default_factory=dict)

    def copy(self) -> "GenerationStats":
        return dataclasses.replace(self, draft_failures_by_kind=dict(self.draft_failures_by_kind))

    def count_draft_failure(self, kind: str) -> None:
        self.draft_failures += 1
        self.draft_failures_by_kind[kind] = self.draft_failures_by_kind.get(kind, 0) + 1


COUNTERS = tuple(f.name for f in dataclasses.fields(GenerationStats) if f.type == "int")
TIMERS = tuple(f.name for f in dataclasses.fields(GenerationStats) if f.type == "float")
