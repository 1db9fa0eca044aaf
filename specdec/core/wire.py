"""Conversions between protobuf messages and tensors, and request validation shared by the services."""

from __future__ import annotations

import math

import numpy as np
import torch

from specdec.core.sampling import SamplingParams
from specdec.v1 import common_pb2


def sampling_from_proto(msg: common_pb2.SamplingParams) -> SamplingParams:
    """Read SamplingParams, mapping proto3 defaults (top_p == 0) to 'disabled'. Raises ValueError on bad values."""
    top_p = msg.top_p if msg.top_p != 0 else 1.0
    params = SamplingParams(temperature=float(msg.temperature), top_k=int(msg.top_k), top_p=float(top_p))
    params.validate()
    return params


def sampling_to_proto(params: SamplingParams, seed: int = 0) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(
        temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, seed=seed
    )


def to_fp16_distribution(probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Round a distribution to float16 for the wire; return (fp16 tensor to send, float32 distribution it encodes).

    The draft samples from the second value, so the q that the target verifies against is exactly the q the
    draft used; that is what keeps rejection sampling exact despite the lossy encoding.
    """
    q16 = probs.detach().to("cpu", torch.float16)
    return q16, fp16_to_distribution(q16)


def fp16_to_distribution(q16: torch.Tensor) -> torch.Tensor:
    q = q16.to(torch.float32)
    return q / q.sum(dim=-1, keepdim=True)


def encode_distribution(q16: torch.Tensor) -> common_pb2.Distribution:
    """One float16 row -> Distribution, sparse when that is smaller (6 bytes per nonzero vs 2 per entry)."""
    row = q16.detach().to("cpu", torch.float16).numpy()
    nz = np.flatnonzero(row)
    if len(nz) * 6 < row.size * 2:
        return common_pb2.Distribution(indices=nz.tolist(), values_fp16=row[nz].astype("<f2").tobytes())
    return common_pb2.Distribution(values_fp16=row.astype("<f2").tobytes())


def decode_distribution(msg: common_pb2.Distribution, vocab_size: int) -> torch.Tensor:
    """Distribution -> float16 row of length vocab_size. Raises ValueError if malformed."""
    values = np.frombuffer(msg.values_fp16, dtype="<f2")
    if len(msg.indices) == 0:
        if values.size != vocab_size:
            raise ValueError(f"dense draft distribution has {values.size} entries, vocabulary has {vocab_size}")
        row = values.astype(np.float16)
    else:
        idx = np.asarray(msg.indices, dtype=np.int64)
        if idx.size != values.size:
            raise ValueError("sparse draft distribution: indices and values differ in length")
        if idx.max() >= vocab_size:
            raise ValueError(f"draft distribution index {int(idx.max())} is outside the vocabulary ({vocab_size})")
        row = np.zeros(vocab_size, dtype=np.float16)
        row[idx] = values
    if not np.all(np.isfinite(row)) or np.any(row < 0) or float(row.astype(np.float32).sum()) <= 0:
        raise ValueError("draft distribution has NaN, infinite, negative or all-zero probabilities")
    return torch.from_numpy(row.copy())


def decode_distributions(msgs, vocab_size: int, expected: int) -> torch.Tensor | None:
    """Repeated Distribution -> float32 [k, V] distributions, or None when absent (greedy or deterministic drafter)."""
    if len(msgs) == 0:
        return None
    if len(msgs) != expected:
        raise ValueError(f"got {len(msgs)} draft distributions for {expected} draft tokens")
    return fp16_to_distribution(torch.stack([decode_distribution(m, vocab_size) for m in msgs]))


def check_token_ids(tokens, vocab_size: int, what: str) -> list[int]:
    tokens = list(tokens)
    for t in tokens:
        if t >= vocab_size:
            raise ValueError(f"{what}: token id {t} is outside the vocabulary (size {vocab_size})")
    return tokens


def is_finite(x: float) -> bool:
    return not (math.isnan(x) or math.isinf(x))


# A session's KV on the wire (common.proto KvBlock): the target's prompt KV for its int8 draft.

def encode_kv(keys: torch.Tensor, values: torch.Tensor, fingerprint: str) -> common_pb2.KvBlock:
    """keys, values: [layers, kv_heads, length, head_dim] -> KvBlock (float16)."""
    if keys.shape != values.shape or keys.dim() != 4:
        raise ValueError(f"keys {tuple(keys.shape)} and values {tuple(values.shape)} must be equal 4-d shapes")
    layers, heads, length, dim = keys.shape

    def pack(t: torch.Tensor) -> bytes:
        return t.detach().to("cpu", torch.float16).contiguous().numpy().astype("<f2", copy=False).tobytes()

    return common_pb2.KvBlock(length=length, layers=layers, kv_heads=heads, head_dim=dim, keys_fp16=pack(keys),
                              values_fp16=pack(values), fingerprint=fingerprint)


def kv_nbytes(layers: int, kv_heads: int, length: int, head_dim: int) -> int:
    """Bytes of a KvBlock's two float16 arrays."""
    return 2 * 2 * layers * kv_heads * length * head_dim


def decode_kv(msg: common_pb2.KvBlock, layers: int, kv_heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """KvBlock -> float32 keys, values [layers, kv_heads, length, head_dim]. Raises ValueError when its shape is
    not this model's or its arrays do not hold that shape."""
    if (msg.layers, msg.kv_heads, msg.head_dim) != (layers, kv_heads, head_dim):
        raise ValueError(f"KV block of {msg.layers} layers x {msg.kv_heads} kv heads x {msg.head_dim} dims; this "
                         f"model has {layers} x {kv_heads} x {head_dim}")
    want = kv_nbytes(layers, kv_heads, msg.length, head_dim) // 2
    if msg.length < 1 or len(msg.keys_fp16) != want or len(msg.values_fp16) != want:
        raise ValueError(f"KV block of {msg.length} positions needs {want} bytes of keys and of values; got "
                         f"{len(msg.keys_fp16)} and {len(msg.values_fp16)}")
    shape = (layers, kv_heads, msg.length, head_dim)

    def unpack(b: bytes) -> torch.Tensor:
        t = torch.from_numpy(np.frombuffer(b, dtype="<f2").astype(np.float32)).reshape(shape)
        if not torch.isfinite(t).all():
            raise ValueError("KV block has NaN or infinite values")
        return t

    return unpack(msg.keys_fp16), unpack(msg.values_fp16)
