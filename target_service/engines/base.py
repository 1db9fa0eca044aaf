"""What the target service needs from an inference engine. The gRPC service (target_service/server.py), its
batcher and the orchestrator above it know nothing else about the engine, so a backend is swapped without
touching them: target_service/engines/torch.py (PyTorch, any Hugging Face model, tree speculation, KV export) and
target_service/engines/llamacpp.py (llama.cpp on a GGUF, the fastest on a CPU). docs/engines.md has more.

Exactness contract: a verify's rows come from the same engine as its target-only decoding, and the
accept/reject decision is always specdec/core/sampling.py's (greedy: the first mismatch with the row's argmax;
sampling: the shared rejection sampler on the row's logits), so greedy speculative output equals the same
engine's target-only output and sampled output has the target's distribution."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from target_service.engines.jobs import DecodeTask, VerifyOutcome, VerifyTask


class ModelDescription(Protocol):
    """What GetInfo reports about the model (specdec.models.LoadedModel is one)."""

    name: str
    vocab_size: int
    max_context: int
    eos_token_ids: list[int]
    fingerprint: str  # tokenizer fingerprint: drafts must share it
    kv_fingerprint: str  # empty: this engine cannot export KV to a draft
    device: object
    dtype: object


@runtime_checkable
class TargetBackend(Protocol):
    loaded: ModelDescription
    max_draft_len: int  # longest draft block one Verify may carry
    max_batch: int  # sessions whose blocks one forward verifies together (1: no batching)
    max_sessions: int  # sessions whose KV caches it keeps (advertised in GetInfo for the orchestrator's admission)
    forward_ms: list[float]  # profile_forward_ms's result once measured; [] otherwise

    @property
    def vocab_size(self) -> int: ...

    def prefill(self, session_id: str, prefix_len: int, delta: list[int], prompt_len: int = 0) -> int:
        """Keep the session's first prefix_len cached tokens, append delta; returns the cached length.
        prompt_len: the context's first prompt_len tokens are the session's prompt (TokenDelta.prompt_len; 0: not
        said). Raises specdec.core.kv_cache.CacheMiss when the engine holds fewer than prefix_len tokens."""

    def verify(self, task: VerifyTask) -> VerifyOutcome:
        """Context delta + draft block in one forward, the block's rows judged by specdec.core.sampling.verify;
        the session keeps the context and the accepted drafts (rejected positions leave its cache)."""

    def decode(self, task: DecodeTask) -> tuple[list[int], int, float]:
        """Target-only decoding: (tokens, cached length, milliseconds)."""

    def release(self, session_id: str) -> bool:
        """Drop the session's cache; True when there was one."""

    def export_kv(self, session_id: str, max_bytes: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The session's keys and values as float16 [layers, kv_heads, positions, head_dim]; None when this
        engine cannot export them (then loaded.kv_fingerprint is empty and the service never asks)."""

    def profile_forward_ms(self, max_tokens: int, context: int = 32, reps: int = 3) -> list[float]:
        """Milliseconds of one cached forward over 1 .. max_tokens new tokens (target_service/engines/profile.py measure_profile)."""

    def cache_bytes(self) -> int:
        """KV cache bytes the sessions hold (a gauge)."""

    def cached_sessions(self) -> int:
        """Sessions holding a KV cache (a gauge)."""

    def forget_prompts(self) -> int:
        """Drop the prompts kept for reuse by later sessions (not the sessions' caches); returns how many."""
