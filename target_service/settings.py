"""The target service's settings, each default written once: `specdec serve target`'s flags are generated from these
fields (specdec/core/settings.py)."""

from __future__ import annotations

from dataclasses import dataclass

from specdec.models import DEFAULT_TARGET
from specdec.core.settings import DEVICE_HELP, DTYPE_HELP, MAX_DRAFT_LEN, setting


@dataclass
class TargetSettings:
    model: str = setting(DEFAULT_TARGET, "model spec: smollm2, tiny:..., a local path, a .gguf file or an HF id")
    listen: str = setting("127.0.0.1:50052", "address to serve on")
    device: str = setting("auto", DEVICE_HELP)
    dtype: str = setting("auto", DTYPE_HELP)
    prepack: str = setting(
        "auto", "fast CPU linear layers (native few-row GEMM, oneDNN-prepacked weights for larger batches): a verify "
        "block then costs little more than one decode step (auto: when torch has oneDNN)", choices=("auto", "on", "off"))
    threads: int = setting(1, "compute threads (torch intra-op, or llama.cpp's)")
    # torch stays the default: with llama.cpp's forward cost nearly linear in tokens at one thread, speculation
    # does not pay against it here, and the default int8 draft needs the torch target's KV (docs/engines.md).
    engine: str = setting(
        "torch", "inference engine: torch (any model, CPU or GPU, tree speculation, KV export to the int8 draft), "
        "llamacpp (a GGUF in llama.cpp's quantized CPU kernels); auto: llamacpp for a GGUF on a CPU when "
        "llama-cpp-python is installed, else torch", choices=("auto", "llamacpp", "torch"))
    llama_context: int = setting(
        16384, "llama.cpp engine: KV cache cells in all (f16, 22.5 KiB a token for SmolLM2); per-session streams: "
        "at most llama_context / llama_session_context - 1 sessions are kept")
    llama_session_context: int = setting(
        2048, "llama.cpp engine: each session's own KV stream, its context limit (per-session streams make greedy "
        "output independent of the other sessions)")
    llama_kv_unified: bool = setting(
        False, "llama.cpp engine: one KV pool shared by all sessions instead of a stream each; needed for tree "
        "speculation, but a session's greedy tokens then depend on the other sessions' cache history")
    max_sessions: int = setting(64, "KV caches kept (LRU)")
    max_cache_mb: int = setting(4096, "KV cache bytes kept (LRU)")
    max_draft_len: int = setting(MAX_DRAFT_LEN, "the most draft tokens one Verify may carry (advertised in GetInfo)")
    batch_window_ms: float = setting(
        0.0, "collect concurrent Verify calls this long and run them as one batched forward (0 = off)")
    max_batch: int = setting(16, "sessions whose steps one batched forward runs at most")
    batch_wait_fraction: float = setting(
        0.5, "a batch also waits for recently active sessions up to this fraction of the recent forward time (a job "
        "that misses the batch waits for that forward anyway); 0 = the window only")
    ragged_batch: str = setting(
        "auto", "batched forwards attend to each session's own KV cache instead of a padded copy (auto: llama, qwen2, "
        "qwen3 and mistral without sliding window; specdec/models/ragged_batch.py)", choices=("auto", "off"))
    profile_forward: str = setting(
        "on", "measure the forward cost of 1 .. max-draft-len + 1 tokens at start-up (a few seconds) and report it "
        "in GetInfo, for the orchestrator's adaptive draft length", choices=("on", "off"))
    inject_latency_ms: float = setting(
        0.0, "fault injection: once SIGUSR1 turns it on, delay every Verify and Decode this much (SIGUSR1 again turns "
        "it off; a target starts with it off)")
