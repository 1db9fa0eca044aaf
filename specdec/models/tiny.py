"""Tiny random Llama models built in memory from a spec (`tiny:vocab=64,layers=2,...`): the same spec gives
bitwise identical weights in every process; the tokenizer is a WordLevel one over `<eos>, t1, ..., t{vocab-1}`."""

from __future__ import annotations

import math

import torch
import transformers
from transformers import PreTrainedModel, PreTrainedTokenizerBase


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


def _is_tiny(spec: str) -> bool:
    s = spec.strip().lower()
    return s == "tiny" or s.startswith("tiny:")


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
