from specdec.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ResetPromptCacheRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResetPromptCacheResponse(_message.Message):
    __slots__ = ("dropped",)
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    dropped: int
    def __init__(self, dropped: _Optional[int] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("session_id", "delta", "export_kv")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    EXPORT_KV_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    delta: _common_pb2.TokenDelta
    export_kv: bool
    def __init__(self, session_id: _Optional[str] = ..., delta: _Optional[_Union[_common_pb2.TokenDelta, _Mapping]] = ..., export_kv: _Optional[bool] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("cached_len", "kv")
    CACHED_LEN_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    cached_len: int
    kv: _common_pb2.KvBlock
    def __init__(self, cached_len: _Optional[int] = ..., kv: _Optional[_Union[_common_pb2.KvBlock, _Mapping]] = ...) -> None: ...

class VerifyRequest(_message.Message):
    __slots__ = ("session_id", "delta", "draft_tokens", "draft_probs", "sampling", "step", "tree")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PROBS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    delta: _common_pb2.TokenDelta
    draft_tokens: _containers.RepeatedScalarFieldContainer[int]
    draft_probs: _containers.RepeatedCompositeFieldContainer[_common_pb2.Distribution]
    sampling: _common_pb2.SamplingParams
    step: int
    tree: _common_pb2.TokenTree
    def __init__(self, session_id: _Optional[str] = ..., delta: _Optional[_Union[_common_pb2.TokenDelta, _Mapping]] = ..., draft_tokens: _Optional[_Iterable[int]] = ..., draft_probs: _Optional[_Iterable[_Union[_common_pb2.Distribution, _Mapping]]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., step: _Optional[int] = ..., tree: _Optional[_Union[_common_pb2.TokenTree, _Mapping]] = ...) -> None: ...

class VerifyResponse(_message.Message):
    __slots__ = ("num_accepted", "next_token", "cached_len", "verify_ms", "accepted_nodes")
    NUM_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    CACHED_LEN_FIELD_NUMBER: _ClassVar[int]
    VERIFY_MS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_NODES_FIELD_NUMBER: _ClassVar[int]
    num_accepted: int
    next_token: int
    cached_len: int
    verify_ms: float
    accepted_nodes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, num_accepted: _Optional[int] = ..., next_token: _Optional[int] = ..., cached_len: _Optional[int] = ..., verify_ms: _Optional[float] = ..., accepted_nodes: _Optional[_Iterable[int]] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("session_id", "delta", "max_tokens", "sampling", "step", "stop_token_ids", "block_tokens", "first_block_tokens", "max_block_tokens")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_BLOCK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    delta: _common_pb2.TokenDelta
    max_tokens: int
    sampling: _common_pb2.SamplingParams
    step: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    block_tokens: int
    first_block_tokens: int
    max_block_tokens: int
    def __init__(self, session_id: _Optional[str] = ..., delta: _Optional[_Union[_common_pb2.TokenDelta, _Mapping]] = ..., max_tokens: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., step: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., block_tokens: _Optional[int] = ..., first_block_tokens: _Optional[int] = ..., max_block_tokens: _Optional[int] = ...) -> None: ...

class DecodeResponse(_message.Message):
    __slots__ = ("tokens", "cached_len", "decode_ms")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_LEN_FIELD_NUMBER: _ClassVar[int]
    DECODE_MS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    cached_len: int
    decode_ms: float
    def __init__(self, tokens: _Optional[_Iterable[int]] = ..., cached_len: _Optional[int] = ..., decode_ms: _Optional[float] = ...) -> None: ...
