from specdec.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ProposeRequest(_message.Message):
    __slots__ = ("session_id", "delta", "max_draft_len", "sampling", "step", "min_confidence", "tree_budget", "tree_branch", "tree_branch_below", "tree_max_depth", "kv", "principal")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    MAX_DRAFT_LEN_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    MIN_CONFIDENCE_FIELD_NUMBER: _ClassVar[int]
    TREE_BUDGET_FIELD_NUMBER: _ClassVar[int]
    TREE_BRANCH_FIELD_NUMBER: _ClassVar[int]
    TREE_BRANCH_BELOW_FIELD_NUMBER: _ClassVar[int]
    TREE_MAX_DEPTH_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    PRINCIPAL_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    delta: _common_pb2.TokenDelta
    max_draft_len: int
    sampling: _common_pb2.SamplingParams
    step: int
    min_confidence: float
    tree_budget: int
    tree_branch: int
    tree_branch_below: float
    tree_max_depth: int
    kv: _common_pb2.KvBlock
    principal: str
    def __init__(self, session_id: _Optional[str] = ..., delta: _Optional[_Union[_common_pb2.TokenDelta, _Mapping]] = ..., max_draft_len: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., step: _Optional[int] = ..., min_confidence: _Optional[float] = ..., tree_budget: _Optional[int] = ..., tree_branch: _Optional[int] = ..., tree_branch_below: _Optional[float] = ..., tree_max_depth: _Optional[int] = ..., kv: _Optional[_Union[_common_pb2.KvBlock, _Mapping]] = ..., principal: _Optional[str] = ...) -> None: ...

class ProposeResponse(_message.Message):
    __slots__ = ("tokens", "probs", "cached_len", "draft_ms", "tree", "token_scores")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    CACHED_LEN_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MS_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_SCORES_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    probs: _containers.RepeatedCompositeFieldContainer[_common_pb2.Distribution]
    cached_len: int
    draft_ms: float
    tree: _common_pb2.TokenTree
    token_scores: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, tokens: _Optional[_Iterable[int]] = ..., probs: _Optional[_Iterable[_Union[_common_pb2.Distribution, _Mapping]]] = ..., cached_len: _Optional[int] = ..., draft_ms: _Optional[float] = ..., tree: _Optional[_Union[_common_pb2.TokenTree, _Mapping]] = ..., token_scores: _Optional[_Iterable[float]] = ...) -> None: ...
