"""`--engine llamacpp|torch|auto`: which backend serves the target (auto: llama.cpp for a GGUF on a CPU when
the llama_cpp module is installed, else PyTorch, with one log line saying why)."""

from __future__ import annotations

import argparse
import logging
import pathlib

from specdec.models import SMOLLM2_ALIASES, smollm2_gguf_path

log = logging.getLogger("specdec.target")

ENGINES = ("auto", "llamacpp", "torch")


def gguf_file(model: str) -> pathlib.Path | None:
    """The GGUF file a model spec names (the default SmolLM2 is one), or None."""
    spec = model.strip()
    if spec.lower() in SMOLLM2_ALIASES:
        return smollm2_gguf_path()
    if spec.lower().endswith(".gguf"):
        return pathlib.Path(spec).expanduser()
    return None


def llama_cpp_missing() -> str | None:
    """Why llama_cpp cannot be imported, or None when it can."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError as e:
        return str(e)
    return None


def choose_engine(engine: str, model: str, device: str) -> tuple[str, str]:
    """(backend, reason). Raises ValueError for an explicit --engine llamacpp that cannot run."""
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}; choose one of {', '.join(ENGINES)}")
    if engine == "torch":
        return "torch", "--engine torch"
    gguf = gguf_file(model)
    on_cpu = device in ("cpu", "auto") and (device == "cpu" or not _accelerator())
    why_not = (f"{model!r} is not a GGUF model" if gguf is None
               else f"device {device!r} is not a CPU" if not on_cpu
               else llama_cpp_missing())
    if engine == "llamacpp":
        if why_not is not None:
            raise ValueError(f"--engine llamacpp cannot serve this target: {why_not}")
        return "llamacpp", "--engine llamacpp"
    if why_not is not None:
        return "torch", why_not
    return "llamacpp", f"{gguf.name} is a GGUF on a CPU and llama_cpp is installed"


def _accelerator() -> bool:
    import torch

    return torch.cuda.is_available() or (hasattr(torch.backends, "mps") and torch.backends.mps.is_available())


def build_engine(args: argparse.Namespace):
    """The backend `serve target` runs, from its parsed arguments."""
    try:
        backend, reason = choose_engine(args.engine, args.model, args.device)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    log.info("target engine: %s (%s)", backend, reason)
    if backend == "llamacpp":
        from target_service.engines.llamacpp import LlamaCppEngine

        return LlamaCppEngine(gguf_file(args.model), args.model, threads=args.threads,
                              context_tokens=args.llama_context, max_sessions=args.max_sessions,
                              max_draft_len=args.max_draft_len, batch_window_ms=args.batch_window_ms,
                              max_batch=args.max_batch, batch_wait_fraction=args.batch_wait_fraction,
                              kv_unified=args.llama_kv_unified, session_tokens=args.llama_session_context,
                              kv_budget_mib=args.max_cache_mb)
    from specdec.core.kv_cache import SessionCacheStore
    from specdec.models import load_model
    from target_service.engines.torch import TargetEngine

    loaded = load_model(args.model, device=args.device, dtype=args.dtype, prepack=args.prepack,
                        ragged=args.ragged_batch == "auto")
    store = SessionCacheStore(max_sessions=args.max_sessions, max_bytes=args.max_cache_mb * 1024 * 1024)
    return TargetEngine(loaded, store, max_draft_len=args.max_draft_len, batch_window_ms=args.batch_window_ms,
                        max_batch=args.max_batch, batch_wait_fraction=args.batch_wait_fraction)
