"""`--engine llamacpp|torch|auto`: which backend serves the target (auto: llama.cpp for a GGUF on a CPU when
the llama_cpp module is installed, else PyTorch, with one log line saying why)."""

from __future__ import annotations

import logging
import pathlib

from specdec.core.settings import MAX_DRAFT_LEN
from specdec.models import SMOLLM2_ALIASES, smollm2_gguf_path
from target_service.settings import TargetSettings

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


def build_engine(settings: TargetSettings):
    """The backend `serve target` runs, from its settings."""
    try:
        backend, reason = choose_engine(settings.engine, settings.model, settings.device)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    log.info("target engine: %s (%s)", backend, reason)
    if backend == "llamacpp":
        from target_service.engines.llamacpp import LlamaCppEngine

        return LlamaCppEngine(gguf_file(settings.model), settings)
    from specdec.core.kv_cache import SessionCacheStore
    from specdec.models import load_model
    from target_service.engines.torch import TargetEngine

    loaded = load_model(settings.model, device=settings.device, dtype=settings.dtype, prepack=settings.prepack,
                        ragged=settings.ragged_batch == "auto")
    store = SessionCacheStore(max_sessions=settings.max_sessions, max_bytes=settings.max_cache_mb * 1024 * 1024)
    return TargetEngine(loaded, store, max_draft_len=settings.max_draft_len or MAX_DRAFT_LEN,
                        batch_window_ms=settings.batch_window_ms,
                        max_batch=settings.max_batch, batch_wait_fraction=settings.batch_wait_fraction)
