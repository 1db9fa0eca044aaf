"""The draft service's settings, each default written once: `specdec serve draft`'s flags are generated from these
fields (specdec/core/settings.py)."""

from __future__ import annotations

from dataclasses import dataclass

from specdec.core.settings import DEVICE_HELP, DTYPE_HELP, LONG_DRAFT_LEN, MAX_DRAFT_LEN, setting

DEFAULT_BATCH_ROWS = 32  # int8 draft: rows per batched forward (a 16-row prefill chunk and others' steps)


@dataclass
class DraftSettings:
    strategy: str = setting(
        "ngram", "model: a small LM; ngram: prompt lookup; suffix: suffix trees over each session's context and its "
        "principal's recent outputs (arctic-inference); hybrid: prompt lookup, the model where it finds no match; "
        "quantized: --model (give the target's) with int8 weights",
        choices=("model", "ngram", "suffix", "hybrid", "quantized"))
    model: str = setting("smollm2-draft", "draft model spec (strategy model or hybrid)")
    draft_vocab: int = setting(
        8192, "the model drafts only token ids below N (a smaller LM head: FR-Spec); 0 = the whole vocabulary. "
        "Exactness does not depend on it, only speed and acceptance")
    quantize: str = setting(
        "none", "int8: int8-weight copy of --model (CPU; activations int16 where AVX-512 VNNI allows; the way to "
        "draft with the target's own weights: draft_service/int8_draft.py)", choices=("none", "int8"))
    batch_rows: int = setting(
        DEFAULT_BATCH_ROWS, "int8 draft: concurrent sessions' draft steps share one forward of up to this many rows, "
        "a prompt is fed in chunks of half this size beside them (0: every session's step runs alone; "
        "draft_service/draft_batcher.py)")
    hybrid_model_max_len: int = setting(
        2, "hybrid: the most tokens the model drafts per step (a weak draft pays only short)")
    datastore: str = setting(
        "auto", "ngram/hybrid: n-gram table of the target's own replies (`specdec datastore`): auto (the one built "
        "for --vocab-from's target, if any), none, or a path")
    vocab_from: str | None = setting(None, "ngram: the target's model spec, for the tokenizer check")
    listen: str = setting("127.0.0.1:50051", "address to serve on")
    device: str = setting("auto", DEVICE_HELP)
    dtype: str = setting("auto", DTYPE_HELP)
    prepack: str = setting(
        "auto", "fast CPU linear layers: native few-row GEMM, oneDNN-prepacked weights for larger batches "
        "(auto: on CPU)", choices=("auto", "on", "off"))
    threads: int = setting(1, "torch intra-op threads")
    max_sessions: int = setting(64, "KV caches kept (LRU)")
    max_cache_mb: int = setting(2048, "KV cache bytes kept (LRU)")
    max_draft_len: int = setting(
        0, f"the most tokens one Propose may ask for (advertised in GetInfo); 0 = the strategy's own: "
        f"{LONG_DRAFT_LEN} for suffix, {MAX_DRAFT_LEN} otherwise")
    inject_latency_ms: float = setting(0.0, "fault injection: delay every Propose (SIGUSR1 toggles it on/off)")
