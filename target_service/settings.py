"""The target service's settings, each default written once: `specdec serve target`'s flags are generated from these
fields (specdec/core/settings.py)."""

from __future__ import annotations

from dataclasses import dataclass

from specdec.models import DEFAULT_TARGET
from specdec.core.settings import DEVICE_HELP, DTYPE_HELP, LONG_DRAFT_LEN, MAX_DRAFT_LEN, setting


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
        0, "llama.cpp engine: KV cache cells in all, an upper bound (float16 keys and q8_0 values, 17.2 KiB a cell for SmolLM2); 0 = auto: "
        "a stream of --llama-session-context cells for each of --max-sessions sessions and one spare, within "
        "--max-cache-mb (llama.cpp allocates them all at start)")
    llama_session_context: int = setting(
        2048, "llama.cpp engine: each session's own KV stream, its context limit (per-session streams make greedy "
        "output independent of the other sessions); rounded up to llama.cpp's 256 cells; when --max-cache-mb cannot "
        "hold --max-sessions streams it shrinks (to 1024 at least) before fewer sessions are kept, with a warning")
    llama_prompt_cache: int = setting(
        16, "llama.cpp engine: prompts kept in the prompt context's float16 cache after they are computed (LRU); a new "
        "prompt that starts with one of them (a repeated request, a conversation's earlier turns, a long shared "
        "lead-in) computes only the rest, bit for bit what it would get from scratch; each takes a stream of "
        "--llama-session-context cells (45 MiB for SmolLM2's 2048) out of --max-cache-mb, those past the first within "
        "a quarter of it; 0 = keep none")
    llama_kv_unified: bool = setting(
        False, "llama.cpp engine: one KV pool shared by all sessions instead of a stream each; needed for tree "
        "speculation (`specdec run/up --tree-budget N` turn it on), but a session's greedy tokens then depend on the "
        "other sessions' cache history (not batch-invariant)")
    max_sessions: int = setting(
        64, "KV caches kept (LRU); the llama.cpp engine allocates a stream for each at start (`specdec run/up` pass "
        "their orchestrator's --max-sessions)")
    max_cache_mb: int = setting(
        4096, "KV cache bytes kept (LRU), the llama.cpp engine's budget for its streams: 4096 holds 64 SmolLM2 "
        "sessions of 2048 tokens (2.9 GiB in f16) with most of a 24 GiB, 2-core host to spare; a larger model gets "
        "shorter session contexts, then fewer sessions, with a warning")
    max_draft_len: int = setting(
        0, f"the most draft tokens one Verify may carry (advertised in GetInfo); 0 = the engine's own: "
        f"{LONG_DRAFT_LEN} on llama.cpp (long blocks of a suffix-tree draft), {MAX_DRAFT_LEN} on torch")
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
        "in GetInfo, for the orchestrator's adaptive draft length (the llama.cpp engine measures a profile taken on a "
        "loaded machine again, then raises it to a conservative curve: docs/architecture.md)", choices=("on", "off"))
    inject_latency_ms: float = setting(
        0.0, "fault injection: once SIGUSR1 turns it on, delay every Verify and Decode this much (SIGUSR1 again turns "
        "it off; a target starts with it off)")
