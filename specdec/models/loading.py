"""Load a model and its tokenizer from a spec (see specdec.models): device and dtype, fingerprints, EOS ids,
local directories, GGUF files and the hub fallback."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pathlib
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import transformers
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from specdec.models.cpu_kernels import MIN_PACKED_ELEMENTS, prepack_linears, should_prepack
from specdec.models.ragged_batch import enable as enable_ragged_batch
from specdec.models.cache import (DRAFT_DIRNAME, SMOLLM2_ALIASES, distilled_draft_dir, ensure_smollm2,
                                  smollm2_cached_dir, smollm2_gguf_path)
from specdec.models.tiny import _is_tiny, build_tiny, parse_tiny_spec, tiny_tokenizer

logger = logging.getLogger("specdec.models")


_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


@dataclass
class LoadedModel:
    model: PreTrainedModel  # eval mode, requires_grad False
    tokenizer: PreTrainedTokenizerBase
    name: str  # the spec it was loaded from
    device: torch.device
    dtype: torch.dtype
    vocab_size: int  # the model's output vocabulary size (logits width)
    max_context: int  # config.max_position_embeddings
    eos_token_ids: list[int]
    fingerprint: str  # tokenizer_fingerprint(tokenizer)
    ragged_batch: bool = False  # batched forwards attend per session cache (specdec/models/ragged_batch.py)
    kv_fingerprint: str = ""  # weights_fingerprint(model), taken before any prepacking or quantisation


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """``"auto"`` -> cuda if available else cpu; also ``"cpu"``, ``"cuda"``, ``"cuda:1"``."""
    if isinstance(device, torch.device):
        dev = device
    else:
        text = (device or "auto").strip().lower()
        if text == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        try:
            dev = torch.device(text)
        except (RuntimeError, ValueError) as e:
            raise ValueError(f"unknown device {device!r} (use auto, cpu, cuda or cuda:N)") from e
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r} requested but CUDA is not available on this machine")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(
                f"device {device!r} requested but only {torch.cuda.device_count()} CUDA device(s) exist"
            )
    return dev


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """``"auto"`` -> float32 on cpu, bfloat16 on cuda; or float32 / bfloat16 / float16."""
    if isinstance(dtype, torch.dtype):
        return dtype
    text = (dtype or "auto").strip().lower().removeprefix("torch.")
    if text == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    try:
        return _DTYPES[text]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r} (use auto, float32, bfloat16 or float16)") from None


def weights_fingerprint(model: PreTrainedModel, samples: int = 4096) -> str:
    """sha256 hex over the architecture (config fields that shape the KV cache and the rotary embedding) and, per
    parameter, its name, shape and an evenly strided sample of its values rounded to bfloat16: equal for two
    loads of the same weights whatever their dtype (float32, bfloat16) and whatever either does to them later
    (prepacking, int8 rounding). Two services with equal fingerprints compute the same keys and values for the
    same tokens, up to their own rounding; the KV exchange between a target and its int8 draft relies on it."""
    cfg = model.config
    arch = {key: getattr(cfg, key, None) for key in (
        "model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
        "rope_theta", "rope_scaling", "rope_parameters", "max_position_embeddings", "vocab_size", "rms_norm_eps")}
    h = hashlib.sha256(json.dumps(arch, sort_keys=True, default=str).encode())
    with torch.no_grad():
        for name, p in model.named_parameters():
            flat = p.detach().reshape(-1)
            step = max(1, flat.numel() // samples)
            h.update(f"{name}:{tuple(p.shape)}".encode())
            h.update(flat[::step][:samples].to("cpu", torch.bfloat16).view(torch.int16).numpy().tobytes())
    return h.hexdigest()


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """sha256 hex over the sorted vocab (token -> id) and the bos/eos/unk ids.

    The pad token is deliberately left out: it does not change how text maps
    to ids, and different loaders set it differently.
    """
    vocab = tokenizer.get_vocab()
    payload = {
        "vocab": sorted((str(tok), int(i)) for tok, i in vocab.items()),
        "special": {
            "bos": tokenizer.bos_token_id,
            "eos": tokenizer.eos_token_id,
            "unk": tokenizer.unk_token_id,
        },
    }
    blob = json.dumps(payload, ensure_ascii=True, separators=(",", ":"), sort_keys=True)
    return hashlib.sha256(blob.encode("ascii")).hexdigest()


def eos_token_ids(model: PreTrainedModel | None, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    ids: list[int] = []

    def add(value: Any) -> None:
        if value is None:
            return
        if isinstance(value, (list, tuple, set)):
            for v in value:
                add(v)
            return
        if isinstance(value, torch.Tensor):
            add(value.tolist())
            return
        v = int(value)
        if v >= 0 and v not in ids:
            ids.append(v)

    if model is not None:
        gen = getattr(model, "generation_config", None)
        if gen is not None:
            add(gen.eos_token_id)
        add(getattr(model.config, "eos_token_id", None))
    add(tokenizer.eos_token_id)
    return ids


def _is_smollm2(spec: str) -> bool:
    return spec.strip().lower() in SMOLLM2_ALIASES


_NO_HUB_HINT = (
    "this machine has no model hub, so pass a local model directory path "
    "(or a .gguf file, 'smollm2' or 'tiny')"
)


def _looks_like_path(s: str) -> bool:
    # Hub ids are "name" or "org/name"; anything else with slashes is a path.
    return s.startswith(("/", "./", "../", "~", ".")) or s.count("/") >= 2


def _hf_target(spec: str) -> str:
    """Strip ``hf:``; check local paths up front for a clear error."""
    target = spec[3:] if spec.lower().startswith("hf:") else spec
    target = target.strip()
    if not target:
        raise ValueError(f"empty model spec {spec!r}")
    expanded = os.path.expanduser(target)
    if os.path.exists(expanded):
        if os.path.isdir(expanded) and not os.path.isfile(os.path.join(expanded, "config.json")):
            raise FileNotFoundError(f"model spec {spec!r}: directory {expanded} has no config.json")
        return expanded
    if _looks_like_path(target):
        raise FileNotFoundError(f"model spec {spec!r}: no such file or directory {expanded}")
    return target


def _hub_reachable(timeout: float = 3.0) -> bool:
    """Quick TCP probe of the hub endpoint (avoids ~20 s of hub retries offline)."""
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        return False
    import socket
    import urllib.parse

    url = urllib.parse.urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    host = url.hostname or "huggingface.co"
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def _from_pretrained(what: str, spec: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``: local files / HF cache first, the hub only if reachable."""
    try:
        return fn(*args, local_files_only=True, **kwargs)
    except OSError as e:
        first: OSError = e
    reason = str(first)
    if _hub_reachable():
        try:
            return fn(*args, **kwargs)
        except OSError as e:
            reason = str(e)
            first = e
    else:
        reason = f"the model hub is unreachable and it is not in the local cache ({reason})"
    raise FileNotFoundError(
        f"could not load {what} for model spec {spec!r}: it is neither a local model "
        f"directory nor an available Hugging Face model id; {_NO_HUB_HINT}. [{reason}]"
    ) from first


def _gguf_parts(spec: str) -> tuple[str, str]:
    path = pathlib.Path(spec[3:] if spec.lower().startswith("hf:") else spec).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"model spec {spec!r}: GGUF file {path} does not exist")
    return str(path.parent.resolve()), path.name


def load_tokenizer(spec: str) -> PreTrainedTokenizerBase:
    """Tokenizer only (cheap: never converts or loads weights)."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"empty model spec {spec!r}")
    spec = spec.strip()
    auto = transformers.AutoTokenizer.from_pretrained
    if _is_tiny(spec):
        return tiny_tokenizer(int(parse_tiny_spec(spec)["vocab"]))
    if _is_smollm2(spec):
        cached = smollm2_cached_dir()
        if cached is not None:
            return auto(str(cached))
        gguf = smollm2_gguf_path()  # same tokenizer; avoids the slow weight conversion
        return auto(str(gguf.parent), gguf_file=gguf.name)
    if spec.lower() == DRAFT_DIRNAME:
        return auto(str(distilled_draft_dir()))
    if spec.lower().endswith(".gguf"):
        d, name = _gguf_parts(spec)
        return _from_pretrained("tokenizer", spec, auto, d, gguf_file=name)
    return _from_pretrained("tokenizer", spec, auto, _hf_target(spec))


def load_model(spec: str, device: str = "auto", dtype: str = "auto", prepack: str = "auto",
               prepack_min_elements: int = MIN_PACKED_ELEMENTS, ragged: bool = True) -> LoadedModel:
    """prepack: auto | on | off: fast CPU linear layers, native few-row GEMM and oneDNN-prepacked weights
    (specdec/models/cpu_kernels.py).
    ragged: batched forwards attend per session cache where the architecture allows (specdec/models/ragged_batch.py);
    False keeps the padded batch."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"empty model spec {spec!r}")
    spec = spec.strip()
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    t0 = time.monotonic()
    model, tok, source = _model_and_tokenizer(spec, dt)
    model = model.to(device=dev, dtype=dt)
    model.eval()
    model.requires_grad_(False)

    eos = eos_token_ids(model, tok)
    gen = getattr(model, "generation_config", None)
    if gen is not None and gen.pad_token_id is None:
        pad = tok.pad_token_id if tok.pad_token_id is not None else (eos[0] if eos else None)
        if pad is not None:
            gen.pad_token_id = pad

    out_emb = model.get_output_embeddings()
    if out_emb is not None and getattr(out_emb, "weight", None) is not None:
        vocab_size = int(out_emb.weight.shape[0])
    else:
        vocab_size = int(model.config.vocab_size)
    max_context = int(getattr(model.config, "max_position_embeddings", 0) or tok.model_max_length)
    kv_fingerprint = weights_fingerprint(model)
    packed = prepack_linears(model, prepack_min_elements) if should_prepack(prepack, dev) else 0
    ragged = enable_ragged_batch(model) if ragged else False

    loaded = LoadedModel(model=model, tokenizer=tok, name=spec, device=dev, dtype=dt, vocab_size=vocab_size,
                         max_context=max_context, eos_token_ids=eos, fingerprint=tokenizer_fingerprint(tok),
                         ragged_batch=ragged, kv_fingerprint=kv_fingerprint)
    logger.info("loaded model %r from %s on %s/%s in %.2fs (vocab %d, ctx %d, eos %s, %d prepacked linears, "
                "ragged batch %s)", spec, source, dev, str(dt).removeprefix("torch."), time.monotonic() - t0,
                vocab_size, max_context, eos, packed, ragged)
    return loaded


def _model_and_tokenizer(spec: str, dt: torch.dtype) -> tuple[Any, Any, str]:
    """(model, tokenizer, where they came from) for a spec: a tiny random model, the packaged SmolLM2, the
    distilled draft, a GGUF file, or a Hugging Face directory or hub id."""
    auto_model = transformers.AutoModelForCausalLM.from_pretrained
    auto_tok = transformers.AutoTokenizer.from_pretrained
    if _is_tiny(spec):
        model, tok = build_tiny(spec)
        return model, tok, "memory"
    if _is_smollm2(spec) or spec.lower() == DRAFT_DIRNAME:
        path = ensure_smollm2() if _is_smollm2(spec) else distilled_draft_dir()
        tok = auto_tok(str(path))
        return auto_model(str(path), dtype=dt), tok, str(path)
    if spec.lower().endswith(".gguf"):
        d, name = _gguf_parts(spec)
        tok = _from_pretrained("tokenizer", spec, auto_tok, d, gguf_file=name)
        return _from_pretrained("model", spec, auto_model, d, gguf_file=name, dtype=dt), tok, os.path.join(d, name)
    target = _hf_target(spec)
    tok = _from_pretrained("tokenizer", spec, auto_tok, target)
    return _from_pretrained("model", spec, auto_model, target, dtype=dt), tok, target
