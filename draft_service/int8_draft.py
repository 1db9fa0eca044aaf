"""The target's own weights, rounded to int8, as the draft model (`--strategy quantized`, `--quantize int8`).

Weight-only int8 with one scale per output row keeps SmolLM2-135M's greedy token at 97% of positions (measured on
the 12 bench prompts' replies, teacher-forced), where the distilled 2-layer draft agrees at 24%. It streams a
quarter of the target's weight bytes per token (specdec/models/csrc/skinny_gemm.cpp `specdec_int8_gemm`).

transformers' module stack costs ~20 ms a token here whatever the weights (30 layers of small ops at a few
microseconds each), as much as the int8 products themselves, so for Llama-family models (llama, mistral, qwen2)
the draft runs a lean forward instead: fused q|k|v and gate|up projections, the model's own rotary embedding
computed once per forward, and a per-session KV buffer that grows in place and is cropped by moving its length (no
concatenation per layer). Its decoder stack runs in C++ where the native library is built
(specdec/models/csrc/int8_llama.cpp: SmolLM2 ~14 ms a token against ~28 ms for the same forward as torch ops, which stay
as the fallback and the tests' reference). Other architectures keep the transformers forward with their linear
layers replaced by Int8Linear.

Exactness never depends on this: the target verifies every drafted token.
"""

from __future__ import annotations

import ctypes
import logging

import torch
import torch.nn.functional as F

from draft_service.draft_batcher import DraftStepBatcher
from specdec.models import cpu_kernels
from specdec.core.kv_cache import CachedLM, SessionCacheStore, SessionKV, check_context
from specdec.models import LoadedModel

log = logging.getLogger("specdec.draft.int8")

LEAN_MODEL_TYPES = ("llama", "mistral", "qwen2")


class _FusedInt8(torch.nn.Module):
    """Several linear layers on the same input as one int8 product (q|k|v, gate|up)."""

    def __init__(self, linears: list[torch.nn.Module]):
        super().__init__()
        weight = torch.cat([lin.weight.detach().float() for lin in linears])
        biases = [getattr(lin, "bias", None) for lin in linears]
        bias = None
        if any(b is not None for b in biases):
            bias = torch.cat([b.detach().float() if b is not None else torch.zeros(lin.out_features)
                              for b, lin in zip(biases, linears)])
        self.linear = cpu_kernels.Int8Linear(weight=weight, bias=bias)
        self.sizes = [lin.out_features for lin in linears]

    def forward(self, x):
        return self.linear(x)


class LeanCache:
    """One session's keys and values for every layer, [layers, kv_heads, capacity, head_dim] each; `length`
    positions are valid. Grows by doubling (amortised), crops by moving `length`."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, capacity: int = 256):
        self.keys = torch.zeros(layers, kv_heads, capacity, head_dim)
        self.values = torch.zeros_like(self.keys)
        self.length = 0

    def reserve(self, total: int) -> None:
        cap = self.keys.shape[2]
        if total <= cap:
            return
        while cap < total:
            cap *= 2
        keys = self.keys.new_zeros(*self.keys.shape[:2], cap, self.keys.shape[3])
        values = torch.zeros_like(keys)
        keys[:, :, : self.length] = self.keys[:, :, : self.length]
        values[:, :, : self.length] = self.values[:, :, : self.length]
        self.keys, self.values = keys, values

    @property
    def nbytes(self) -> int:
        return 2 * self.keys.numel() * self.keys.element_size()


class _Matrix(ctypes.Structure):
    _fields_ = [("q", ctypes.c_void_p), ("scale", ctypes.c_void_p), ("bias", ctypes.c_void_p),
                ("n", ctypes.c_long), ("k", ctypes.c_long), ("int16_activations", ctypes.c_long)]


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", ctypes.c_void_p), ("post_attn_norm", ctypes.c_void_p), ("qkv", _Matrix),
                ("o", _Matrix), ("gate_up", _Matrix), ("down", _Matrix)]


class _KvBuffer(ctypes.Structure):
    _fields_ = [("keys", ctypes.c_void_p), ("values", ctypes.c_void_p), ("capacity", ctypes.c_long)]


class _Dims(ctypes.Structure):
    _fields_ = [("hidden", ctypes.c_long), ("heads", ctypes.c_long), ("kv_heads", ctypes.c_long),
                ("head_dim", ctypes.c_long), ("intermediate", ctypes.c_long), ("layers", ctypes.c_long),
                ("eps", ctypes.c_float)]


def _matrix(module: torch.nn.Module) -> _Matrix:
    lin = module.linear if isinstance(module, _FusedInt8) else module
    bias = 0 if lin.bias is None else lin.bias.data_ptr()
    return _Matrix(lin.qweight.data_ptr(), lin.scale.data_ptr(), bias, lin.out_features, lin.in_features,
                   int(lin.int16_activations))


def _native_stack():
    """specdec_int8_llama_forward_rows from the native library, or None (then the torch ops below run instead)."""
    fn = cpu_kernels.native_gemm()
    if fn is None or fn.lib.specdec_int8_llama_version() != 3:
        return None
    forward = fn.lib.specdec_int8_llama_forward_rows
    forward.argtypes = [ctypes.POINTER(_Dims), ctypes.POINTER(_Layer), ctypes.c_void_p, ctypes.c_long,
                        ctypes.POINTER(_KvBuffer), ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p,
                        ctypes.c_void_p, ctypes.c_void_p]
    forward.restype = ctypes.c_int
    return forward


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LlamaRMSNorm in float32 (torch's fused rms_norm took ~50 us a call here, these four ops ~15)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


class LeanLlama(torch.nn.Module):
    """A Llama-family decoder over int8 weights, for one session's tokens at a time."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        cfg = model.config
        inner = model.model
        self.hidden = cfg.hidden_size
        self.heads = cfg.num_attention_heads
        self.kv_heads = getattr(cfg, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(cfg, "head_dim", None) or self.hidden // self.heads
        self.eps = cfg.rms_norm_eps
        self.embed = inner.embed_tokens
        self.rotary = inner.rotary_emb
        self.final_norm = inner.norm.weight.detach().float()
        self.head = cpu_kernels.Int8Linear(model.get_output_embeddings())
        self.layers = []
        for layer in inner.layers:
            attn, mlp = layer.self_attn, layer.mlp
            self.layers.append(dict(
                in_norm=layer.input_layernorm.weight.detach().float(),
                post_norm=layer.post_attention_layernorm.weight.detach().float(),
                qkv=_FusedInt8([attn.q_proj, attn.k_proj, attn.v_proj]),
                o=cpu_kernels.Int8Linear(attn.o_proj),
                gate_up=_FusedInt8([mlp.gate_proj, mlp.up_proj]),
                down=cpu_kernels.Int8Linear(mlp.down_proj),
            ))
        self.intermediate = self.layers[0]["gate_up"].sizes[0]
        # The native decoder stack (csrc/int8_llama.cpp) reads these tensors through raw pointers: they live as
        # long as this module and are never resized.
        self.native = _native_stack()
        self._dims = _Dims(self.hidden, self.heads, self.kv_heads, self.head_dim, self.intermediate,
                           len(self.layers), self.eps)
        self.set_int16_activations(cpu_kernels.int16_activations())

    def set_int16_activations(self, on: bool) -> None:
        """Round every layer's activations to int16 and multiply in integers (VNNI, cpu_kernels.int16_activations)
        or keep them float32; the native stack's layer table follows."""
        fn = cpu_kernels.native_gemm()
        if on and (fn is None or fn.int8_a16 is None):
            raise ValueError("int16 activations need the native kernel on a CPU with AVX-512 VNNI")
        for L in self.layers:
            for m in (L["qkv"].linear, L["o"], L["gate_up"].linear, L["down"]):
                m.int16_activations = on
        self.head.int16_activations = on
        self._layers = (_Layer * len(self.layers))(*[
            _Layer(L["in_norm"].data_ptr(), L["post_norm"].data_ptr(), _matrix(L["qkv"]), _matrix(L["o"]),
                   _matrix(L["gate_up"]), _matrix(L["down"])) for L in self.layers])

    @staticmethod
    def supports(model: torch.nn.Module) -> str | None:
        """None if the lean forward reproduces this model, else why not."""
        cfg = model.config
        if cfg.model_type not in LEAN_MODEL_TYPES:
            return f"model type {cfg.model_type!r} is not one of {', '.join(LEAN_MODEL_TYPES)}"
        if getattr(cfg, "hidden_act", "silu") != "silu":
            return f"activation {cfg.hidden_act!r}"
        if getattr(cfg, "sliding_window", None) and (cfg.model_type == "mistral"
                                                     or getattr(cfg, "use_sliding_window", False)):
            return "sliding-window attention"
        if getattr(cfg, "mlp_bias", False):
            return "MLP biases"
        inner = getattr(model, "model", None)
        if inner is None or not hasattr(inner, "rotary_emb") or not hasattr(inner, "layers"):
            return "unexpected module layout"
        return None

    def new_cache(self) -> LeanCache:
        return LeanCache(len(self.layers), self.kv_heads, self.head_dim)

    def forward(self, tokens: list[int], cache: LeanCache, keep: int, native: bool = True) -> torch.Tensor:
        """Feed `tokens` after the cache's `length` positions; float32 logits of the last `keep` of them.
        native=False runs the torch ops even where the native stack is available (tests compare the two)."""
        return self.forward_rows([(tokens, cache, keep)], native)[0]

    @torch.inference_mode()
    def forward_rows(self, feeds: list[tuple[list[int], LeanCache, int]], native: bool = True) -> list[torch.Tensor]:
        """Several sessions' new tokens in one forward (distinct caches): feeds are (tokens, cache, keep); each
        gets the float32 logits of its last `keep` tokens. The products run over every row at once, attention per
        session (natively; the torch ops loop over the sessions)."""
        if len({id(cache) for _, cache, _ in feeds}) != len(feeds):
            raise ValueError("forward_rows takes each session's cache once")
        if not (native and self.native is not None):
            return [self._forward_torch(tokens, cache, keep) for tokens, cache, keep in feeds]
        ids, positions, row_seq, kept = [], [], [], []
        for i, (tokens, cache, keep) in enumerate(feeds):
            cache.reserve(cache.length + len(tokens))
            kept.extend(range(len(ids) + len(tokens) - keep, len(ids) + len(tokens)))
            ids.extend(tokens)
            positions.extend(range(cache.length, cache.length + len(tokens)))
            row_seq.extend([i] * len(tokens))
        t = len(ids)
        x = self.embed(torch.tensor(ids, dtype=torch.long)).float().contiguous()  # [t, hidden]
        pos = torch.tensor(positions, dtype=torch.long)
        cos, sin = self.rotary(x.unsqueeze(0), pos.unsqueeze(0))  # [1, t, head_dim]
        cos, sin = cos[0].float().contiguous(), sin[0].float().contiguous()
        seq = torch.tensor(row_seq, dtype=torch.long)
        buffers = (_KvBuffer * len(feeds))(*[_KvBuffer(c.keys.data_ptr(), c.values.data_ptr(), c.keys.shape[2])
                                             for _, c, _ in feeds])
        status = self.native(ctypes.byref(self._dims), self._layers, x.data_ptr(), t, buffers, len(feeds),
                             seq.data_ptr(), pos.data_ptr(), cos.data_ptr(), sin.data_ptr())
        if status:
            raise RuntimeError(f"native int8 decoder stack failed ({status})")
        for tokens, cache, _ in feeds:
            cache.length += len(tokens)
        logits = self.head(_rms_norm(x[kept], self.final_norm, self.eps))
        return list(logits.split([keep for _, _, keep in feeds]))

    @torch.inference_mode()
    def _forward_torch(self, tokens: list[int], cache: LeanCache, keep: int) -> torch.Tensor:
        """The same forward as torch ops, one session (the fallback and the native stack's reference)."""
        t, past = len(tokens), cache.length
        cache.reserve(past + t)
        x = self.embed(torch.tensor(tokens, dtype=torch.long)).float().contiguous()  # [t, hidden]
        pos = torch.arange(past, past + t).unsqueeze(0)
        cos, sin = self.rotary(x.unsqueeze(0), pos)  # [1, t, head_dim]
        cos, sin = cos[0].unsqueeze(1), sin[0].unsqueeze(1)  # [t, 1, head_dim]
        half = self.head_dim // 2
        nq, nkv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        group, scale = self.heads // self.kv_heads, self.head_dim**-0.5
        mask = None
        if t > 1:  # new token i sees every cached position and new tokens 0..i
            mask = torch.ones(t, past + t, dtype=torch.bool).tril(past)
        for i, layer in enumerate(self.layers):
            h = _rms_norm(x, layer["in_norm"], self.eps)
            qkv = layer["qkv"](h)
            qk = qkv[:, : nq + nkv].view(t, self.heads + self.kv_heads, self.head_dim)
            rotated = torch.cat((-qk[..., half:], qk[..., :half]), dim=-1)
            qk = qk * cos + rotated * sin
            q = qk[:, : self.heads].transpose(0, 1)  # [heads, t, d]
            cache.keys[i, :, past : past + t] = qk[:, self.heads :].transpose(0, 1)
            v = qkv[:, nq + nkv :].view(t, self.kv_heads, self.head_dim)
            cache.values[i, :, past : past + t] = v.transpose(0, 1)
            keys = cache.keys[i, :, : past + t]
            values = cache.values[i, :, : past + t]
            if t == 1:  # one query: plain matmuls over the query heads grouped per kv head beat SDPA's kernel
                scores = torch.matmul(q.reshape(self.kv_heads, group, self.head_dim), keys.transpose(1, 2))
                attn = torch.matmul(torch.softmax(scores * scale, dim=-1), values).reshape(1, nq)
            else:
                attn = F.scaled_dot_product_attention(q.unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0),
                                                      attn_mask=mask, enable_gqa=self.heads != self.kv_heads)
                attn = attn[0].transpose(0, 1).reshape(t, nq)
            x = x + layer["o"](attn)
            h = _rms_norm(x, layer["post_norm"], self.eps)
            gate, up = layer["gate_up"](h).split(self.intermediate, dim=-1)
            x = x + layer["down"](F.silu(gate) * up)
        cache.length = past + t
        x = _rms_norm(x[t - keep :], self.final_norm, self.eps)
        return self.head(x)


class LeanCachedLM(CachedLM):
    """CachedLM over a LeanLlama: the same session protocol (sync, crop, extend, release), a LeanCache per
    session. With batch_rows > 0 (and the native stack) concurrent sessions' extends share forwards of up to
    batch_rows rows (draft_service/draft_batcher.py), a long feed in chunks of half that."""

    drafts_trees = False  # the lean forward attends causally only: no tree mask, so tree requests get a chain

    def __init__(self, loaded: LoadedModel, store: SessionCacheStore, lean: LeanLlama, batch_rows: int = 0,
                 batch_wait_ms: float = 2.0):
        super().__init__(loaded, store)
        self.lean = lean
        self.batcher = None
        if batch_rows > 0 and lean.native is not None:
            self.batcher = DraftStepBatcher(lean.forward_rows, max_rows=batch_rows, wait_ms=batch_wait_ms)

    def proposing(self, session_id: str):
        return self.batcher.member(session_id) if self.batcher is not None else super().proposing(session_id)

    @property
    def kv_dims(self) -> tuple[int, int, int]:
        """(layers, kv_heads, head_dim) of the keys and values import_kv takes."""
        return len(self.lean.layers), self.lean.kv_heads, self.lean.head_dim

    def import_kv(self, sess: SessionKV, tokens: list[int], keys: torch.Tensor, values: torch.Tensor) -> None:
        """Start the session over from KV computed elsewhere for `tokens` (the target's, of the weights this draft
        rounded: PrefillResponse.kv): keys and values [layers, kv_heads, len(tokens), head_dim], keys rotated as
        this forward stores them. Replaces a prompt prefill by a copy."""
        n = len(tokens)
        if keys.shape != (*self.kv_dims[:2], n, self.kv_dims[2]) or values.shape != keys.shape:
            raise ValueError(f"KV of shape {tuple(keys.shape)} for {n} tokens; this draft takes "
                             f"{(*self.kv_dims[:2], n, self.kv_dims[2])}")
        check_context(self.loaded, n)
        cache = self.lean.new_cache()
        cache.reserve(n)
        cache.keys[:, :, :n] = keys
        cache.values[:, :, :n] = values
        cache.length = n
        sess.cache, sess.tokens[:] = cache, tokens

    def crop(self, sess: SessionKV, length: int) -> None:
        if sess.cache is not None and length < len(sess.tokens):
            sess.cache.length = length
        del sess.tokens[length:]

    def extend(self, sess: SessionKV, new_tokens: list[int], keep: int = 0) -> torch.Tensor:
        check_context(self.loaded, len(sess.tokens) + len(new_tokens))
        if sess.cache is None:
            sess.cache = self.lean.new_cache()
        keep = keep if 0 < keep < len(new_tokens) else len(new_tokens)
        try:
            if self.batcher is None:
                logits = self.lean(new_tokens, sess.cache, keep)
            else:
                # A long feed in chunks of half a forward: the other sessions' steps fit in beside each chunk
                # (whole-forward chunks made them wait a chunk's forward, then run in one of their own).
                rows = max(1, self.batcher.max_rows // 2)
                for start in range(0, len(new_tokens), rows):
                    chunk = new_tokens[start : start + rows]
                    last = start + rows >= len(new_tokens)
                    logits = self.batcher.run(sess.session_id, (chunk, sess.cache, keep if last else 0), len(chunk))
        except BaseException:
            sess.cache.length = len(sess.tokens)  # layers before the failure wrote past the valid length
            raise
        sess.tokens.extend(new_tokens)
        return logits[:, : self.loaded.vocab_size]


def int8_draft(loaded: LoadedModel, store: SessionCacheStore, batch_rows: int = 0) -> CachedLM:
    """The int8 draft runtime for a loaded (float, unpacked) model: the lean forward where it applies, else the
    transformers forward over Int8Linear layers. Frees the float linear weights the lean model replaced.
    batch_rows > 0: concurrent sessions' draft steps share forwards of up to that many rows (lean forward only)."""
    if loaded.model.device.type != "cpu":
        raise ValueError("--quantize int8 runs on the CPU (the int8 kernel is AVX2 C++)")
    if cpu_kernels.native_gemm() is None:
        log.warning("int8 draft without the native kernel: each layer dequantises its weight per call (slow)")
    why = LeanLlama.supports(loaded.model)
    if why is None:
        lean = LeanLlama(loaded.model)
        for layer in loaded.model.model.layers:  # the float copies are no longer needed
            layer.self_attn = layer.mlp = None
        log.info("int8 draft: lean forward", extra={"layers": len(lean.layers)})
        return LeanCachedLM(loaded, store, lean, batch_rows=batch_rows)
    replaced = cpu_kernels.quantize_linears(loaded.model, min_elements=0)  # every layer, as the lean forward
    loaded.ragged_batch = False
    log.info("int8 draft: transformers forward (%s)", why, extra={"int8_layers": replaced})
    return CachedLM(loaded, store)
