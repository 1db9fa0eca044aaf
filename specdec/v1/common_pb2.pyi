from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "seed")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    seed: int
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ...) -> None: ...

class TokenDelta(_message.Message):
    __slots__ = ("prefix_len", "tokens", "prompt_len")
    PREFIX_LEN_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LEN_FIELD_NUMBER: _ClassVar[int]
    prefix_len: int
    tokens: _containers.RepeatedScalarFieldContainer[int]
    prompt_len: int
    def __init__(self, prefix_len: _Optional[int] = ..., tokens: _Optional[_Iterable[int]] = ..., prompt_len: _Optional[int] = ...) -> None: ...

class Distribution(_message.Message):
    __slots__ = ("indices", "values_fp16")
    INDICES_FIELD_NUMBER: _ClassVar[int]
    VALUES_FP16_FIELD_NUMBER: _ClassVar[int]
    indices: _containers.RepeatedScalarFieldContainer[int]
    values_fp16: bytes
    def __init__(self, indices: _Optional[_Iterable[int]] = ..., values_fp16: _Optional[bytes] = ...) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("model_name", "vocab_size", "tokenizer_fingerprint", "max_context", "eos_token_ids", "device", "dtype", "strategy", "forward_ms", "max_batch", "kv_fingerprint", "drafts_trees", "max_draft_len", "max_sessions")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    STRATEGY_FIELD_NUMBER: _ClassVar[int]
    FORWARD_MS_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_FIELD_NUMBER: _ClassVar[int]
    KV_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    DRAFTS_TREES_FIELD_NUMBER: _ClassVar[int]
    MAX_DRAFT_LEN_FIELD_NUMBER: _ClassVar[int]
    MAX_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    vocab_size: int
    tokenizer_fingerprint: str
    max_context: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    device: str
    dtype: str
    strategy: str
    forward_ms: _containers.RepeatedScalarFieldContainer[float]
    max_batch: int
    kv_fingerprint: str
    drafts_trees: bool
    max_draft_len: int
    max_sessions: int
    def __init__(self, model_name: _Optional[str] = ..., vocab_size: _Optional[int] = ..., tokenizer_fingerprint: _Optional[str] = ..., max_context: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., device: _Optional[str] = ..., dtype: _Optional[str] = ..., strategy: _Optional[str] = ..., forward_ms: _Optional[_Iterable[float]] = ..., max_batch: _Optional[int] = ..., kv_fingerprint: _Optional[str] = ..., drafts_trees: _Optional[bool] = ..., max_draft_len: _Optional[int] = ..., max_sessions: _Optional[int] = ...) -> None: ...

class KvBlock(_message.Message):
    __slots__ = ("length", "layers", "kv_heads", "head_dim", "keys_fp16", "values_fp16", "fingerprint")
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    KEYS_FP16_FIELD_NUMBER: _ClassVar[int]
    VALUES_FP16_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    length: int
    layers: int
    kv_heads: int
    head_dim: int
    keys_fp16: bytes
    values_fp16: bytes
    fingerprint: str
    def __init__(self, length: _Optional[int] = ..., layers: _Optional[int] = ..., kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., keys_fp16: _Optional[bytes] = ..., values_fp16: _Optional[bytes] = ..., fingerprint: _Optional[str] = ...) -> None: ...

class TokenTree(_message.Message):
    __slots__ = ("parents", "tokens", "probs")
    PARENTS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    parents: _containers.RepeatedScalarFieldContainer[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    probs: _containers.RepeatedCompositeFieldContainer[Distribution]
    def __init__(self, parents: _Optional[_Iterable[int]] = ..., tokens: _Optional[_Iterable[int]] = ..., probs: _Optional[_Iterable[_Union[Distribution, _Mapping]]] = ...) -> None: ...

class GetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("session_id", "final_delta")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    FINAL_DELTA_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    final_delta: TokenDelta
    def __init__(self, session_id: _Optional[str] = ..., final_delta: _Optional[_Union[TokenDelta, _Mapping]] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...
