"""One forward pass over several sessions that each keep their own KV cache, at their own lengths.

A padded batch must first copy every session's cache into one left-padded tensor, let the model concatenate the
new keys onto that, copy each row back out, and (for grouped-query attention with a padding mask) expand the keys
to every query head; and every row feeds as many tokens as the longest. Measured on SmolLM2-135M (8 sessions x 3
new tokens, ~200 tokens of context, 1 CPU thread) a third of the forward was those copies. Here the sessions'
new tokens are packed into one sequence (no padding: a block of 5 and seven decode steps are 12 tokens, not 40),
each session's keys and values go straight into its own cache, and attention runs per session against that
cache, with the query heads of a group stacked so one key/value head serves them without being repeated. Only
the positions a caller reads reach the LM head.

The model's attention implementation is set to "specdec" (registered here), which is transformers' own sdpa for
every ordinary call (tree masks, HF generate) and this per-session attention only when the cache is a
`RaggedRows`. Only architectures whose attention is plain causal softmax attention (no sliding window,
soft-capping or sinks) and whose LM head is a plain projection are switched; others keep the padded batch
(specdec/core/kv_cache.py).
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, AttentionMaskInterface, DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

IMPLEMENTATION = "specdec"
PACKED_MAX_TOKENS = 16  # up to this many new tokens a session stacks its query heads; a prefill uses sdpa's GQA
# Model types whose attention is `cache.update` then plain causal attention over the result (checked by
# tests/test_ragged_batch.py for each).
SUPPORTED_MODEL_TYPES = {"llama", "qwen2", "qwen3", "mistral"}

_registered = threading.Lock()
_done = False


def _register() -> None:
    global _done
    with _registered:
        if not _done:
            AttentionInterface.register(IMPLEMENTATION, attention)
            AttentionMaskInterface.register(IMPLEMENTATION, sdpa_mask)  # ordinary calls get sdpa's masks
            _done = True


def supports(model) -> bool:
    config = model.config
    if getattr(config, "model_type", None) not in SUPPORTED_MODEL_TYPES:
        return False
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return False
    return getattr(config, "_attn_implementation", None) in ("sdpa", "eager", IMPLEMENTATION)


def enable(model) -> bool:
    """Switch `model` to the "specdec" attention when its architecture allows; whether it did."""
    if not supports(model):
        return False
    _register()
    model.config._attn_implementation = IMPLEMENTATION
    return True


class RaggedRows:
    """Stands in for the cache during one packed forward: the positions offsets[i] .. offsets[i] + lengths[i] of
    the sequence are session i's new tokens; their keys and values are appended to caches[i], and attention
    reads them back per session."""

    def __init__(self, caches: list[DynamicCache], lengths: list[int]):
        self.caches = caches
        self.lengths = lengths
        self.offsets = [sum(lengths[:i]) for i in range(len(lengths))]
        self._kv: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._masks: dict[tuple[int, int, int, torch.dtype], torch.Tensor | None] = {}

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        self._kv = [cache.update(key_states[:, :, o : o + n], value_states[:, :, o : o + n], layer_idx)
                    for cache, o, n in zip(self.caches, self.offsets, self.lengths)]
        return self, self

    def packed_mask(self, m: int, length: int, groups: int, dtype: torch.dtype, device) -> torch.Tensor | None:
        """Additive causal mask for m queries at the end of `length` keys, repeated for `groups` stacked heads
        (the same for every layer, so built once per forward)."""
        if m == 1:
            return None
        key = (m, length, groups, dtype)
        if key not in self._masks:
            allowed = _causal(m, length, device)
            mask = torch.zeros(m, length, dtype=dtype, device=device).masked_fill_(~allowed, torch.finfo(dtype).min)
            self._masks[key] = mask.repeat(groups, 1)
        return self._masks[key]


def _causal(m: int, length: int, device) -> torch.Tensor:
    """[m, length] bool: query i (the i-th of the last m positions) may attend to key j."""
    return torch.arange(length, device=device)[None, :] <= (length - m + torch.arange(m, device=device))[:, None]


def _row_attention(rows: RaggedRows, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   scaling: float | None) -> torch.Tensor:
    """Attention of one session's queries [1, H, m, D] against its whole cache; returns [m, H, D]."""
    _, heads, m, dim = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    if m <= PACKED_MAX_TOKENS:
        # Heads h = j * groups + r share key/value head j: stack them along the query axis.
        packed = query.reshape(1, kv_heads, groups * m, dim)
        mask = rows.packed_mask(m, length, groups, query.dtype, query.device)
        out = F.scaled_dot_product_attention(packed, key, value, attn_mask=mask, scale=scaling)
        return out.view(heads, m, dim).transpose(0, 1)
    if length == m:  # a prompt on an empty cache: plain causal
        out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling, enable_gqa=True)
    else:
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=_causal(m, length, query.device),
                                             scale=scaling, enable_gqa=True)
    return out[0].transpose(0, 1)


def attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None, **kwargs):
    """The "specdec" attention implementation: per-row attention for a RaggedRows forward, sdpa otherwise."""
    if not isinstance(key, RaggedRows):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    for unsupported in ("sliding_window", "softcap", "s_aux"):
        if kwargs.get(unsupported) is not None:
            raise NotImplementedError(f"ragged batch attention does not support {unsupported}")
    rows = key
    _, heads, total, dim = query.shape
    out = query.new_empty(1, total, heads, dim)
    for (k, v), o, n in zip(rows._kv, rows.offsets, rows.lengths):
        out[0, o : o + n] = _row_attention(rows, query[:, :, o : o + n], k, v, scaling)
    return out, None


def truncate_cache(cache: DynamicCache | None, length: int) -> None:
    """Every layer of `cache` back to its first `length` positions (views: the next append copies)."""
    if cache is None:
        return
    for layer in cache.layers:
        if getattr(layer, "keys", None) is not None and layer.keys.numel():
            layer.keys = layer.keys[..., :length, :]
            layer.values = layer.values[..., :length, :]


@torch.inference_mode()
def forward_rows(model, caches: list[DynamicCache], cached_lens: list[int], new_tokens: list[list[int]],
                 keep: list[int], device) -> list[torch.Tensor]:
    """Feed new_tokens[i] after the cached_lens[i] tokens in caches[i] (appended in place), all in one forward.
    Returns each row's logits [keep[i], V] for its last keep[i] positions (1 <= keep[i] <= len(new_tokens[i]))."""
    lengths = [len(new) for new in new_tokens]
    total = sum(lengths)
    ids = torch.tensor([[t for new in new_tokens for t in new]], dtype=torch.long, device=device)
    positions = torch.cat([torch.arange(c, c + n, device=device) for c, n in zip(cached_lens, lengths)])[None]
    rows = RaggedRows(caches, lengths)
    read = torch.cat([torch.arange(o + n - k, o + n, device=device)
                      for o, n, k in zip(rows.offsets, lengths, keep)])  # the LM head runs on these only
    # A prepared 4D mask makes transformers skip building one (RaggedRows has no mask sizes); attention ignores it.
    unused_mask = torch.ones(1, 1, total, 1, dtype=torch.bool, device=device)
    try:
        out = model(input_ids=ids, attention_mask=unused_mask, position_ids=positions, cache=rows, use_cache=True,
                    logits_to_keep=read)
    except BaseException:
        # Layers before the failure appended their keys; the caches must match the sessions' tokens again.
        for cache, length in zip(caches, cached_lens):
            truncate_cache(cache, length)
        raise
    return list(out.logits[0].split(keep))
