from google.protobuf import struct_pb2 as _struct_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Speculation(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SPECULATION_DEFAULT: _ClassVar[Speculation]
    SPECULATION_ON: _ClassVar[Speculation]
    SPECULATION_OFF: _ClassVar[Speculation]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_EOS: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_CANCELLED: _ClassVar[FinishReason]
SPECULATION_DEFAULT: Speculation
SPECULATION_ON: Speculation
SPECULATION_OFF: Speculation
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_EOS: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_CANCELLED: FinishReason

class GetOutlineRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Outline(_message.Message):
    __slots__ = ("outline",)
    OUTLINE_FIELD_NUMBER: _ClassVar[int]
    outline: _struct_pb2.Struct
    def __init__(self, outline: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("text", "token_ids", "max_new_tokens", "temperature", "top_k", "top_p", "seed", "stop", "stop_token_ids", "speculation", "max_draft_len", "ignore_eos", "apply_chat_template", "resume_session_id", "resume_from")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    MAX_DRAFT_LEN_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    APPLY_CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    RESUME_SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    RESUME_FROM_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: TokenIds
    max_new_tokens: int
    temperature: float
    top_k: int
    top_p: float
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    speculation: Speculation
    max_draft_len: int
    ignore_eos: bool
    apply_chat_template: bool
    resume_session_id: str
    resume_from: int
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., max_new_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., speculation: _Optional[_Union[Speculation, str]] = ..., max_draft_len: _Optional[int] = ..., ignore_eos: _Optional[bool] = ..., apply_chat_template: _Optional[bool] = ..., resume_session_id: _Optional[str] = ..., resume_from: _Optional[int] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("session_id", "text", "token_ids", "offset", "stats", "finish_reason")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    offset: int
    stats: GenerationStats
    finish_reason: FinishReason
    def __init__(self, session_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., offset: _Optional[int] = ..., stats: _Optional[_Union[GenerationStats, _Mapping]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ...) -> None: ...

class GenerationStats(_message.Message):
    __slots__ = ("prompt_tokens", "generated_tokens", "verify_steps", "draft_tokens_proposed", "draft_tokens_accepted", "acceptance_rate", "mean_accepted_length", "draft_ms", "verify_ms", "fallback_steps", "fallback_tokens", "wall_ms", "tokens_per_second", "draft_failures", "decode_steps", "draft_failures_by_kind", "degraded_ms", "replica_failovers", "target_resyncs", "pipeline_prefetches", "pipeline_hits", "decode_ms", "load_shed_steps", "speculation_paused_steps", "draft_tokens_trimmed", "parallel_prefills", "kv_imports", "prefill_ms", "rpc_overhead_ms", "store_ms", "prefetch_wait_ms", "store_overlapped_ms", "queued_ms")
    class DraftFailuresByKindEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_STEPS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_PROPOSED_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_RATE_FIELD_NUMBER: _ClassVar[int]
    MEAN_ACCEPTED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_MS_FIELD_NUMBER: _ClassVar[int]
    FALLBACK_STEPS_FIELD_NUMBER: _ClassVar[int]
    FALLBACK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WALL_MS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FAILURES_FIELD_NUMBER: _ClassVar[int]
    DECODE_STEPS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FAILURES_BY_KIND_FIELD_NUMBER: _ClassVar[int]
    DEGRADED_MS_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FAILOVERS_FIELD_NUMBER: _ClassVar[int]
    TARGET_RESYNCS_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_PREFETCHES_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_HITS_FIELD_NUMBER: _ClassVar[int]
    DECODE_MS_FIELD_NUMBER: _ClassVar[int]
    LOAD_SHED_STEPS_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_PAUSED_STEPS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_TRIMMED_FIELD_NUMBER: _ClassVar[int]
    PARALLEL_PREFILLS_FIELD_NUMBER: _ClassVar[int]
    KV_IMPORTS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MS_FIELD_NUMBER: _ClassVar[int]
    RPC_OVERHEAD_MS_FIELD_NUMBER: _ClassVar[int]
    STORE_MS_FIELD_NUMBER: _ClassVar[int]
    PREFETCH_WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    STORE_OVERLAPPED_MS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_MS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    generated_tokens: int
    verify_steps: int
    draft_tokens_proposed: int
    draft_tokens_accepted: int
    acceptance_rate: float
    mean_accepted_length: float
    draft_ms: float
    verify_ms: float
    fallback_steps: int
    fallback_tokens: int
    wall_ms: float
    tokens_per_second: float
    draft_failures: int
    decode_steps: int
    draft_failures_by_kind: _containers.ScalarMap[str, int]
    degraded_ms: float
    replica_failovers: int
    target_resyncs: int
    pipeline_prefetches: int
    pipeline_hits: int
    decode_ms: float
    load_shed_steps: int
    speculation_paused_steps: int
    draft_tokens_trimmed: int
    parallel_prefills: int
    kv_imports: int
    prefill_ms: float
    rpc_overhead_ms: float
    store_ms: float
    prefetch_wait_ms: float
    store_overlapped_ms: float
    queued_ms: float
    def __init__(self, prompt_tokens: _Optional[int] = ..., generated_tokens: _Optional[int] = ..., verify_steps: _Optional[int] = ..., draft_tokens_proposed: _Optional[int] = ..., draft_tokens_accepted: _Optional[int] = ..., acceptance_rate: _Optional[float] = ..., mean_accepted_length: _Optional[float] = ..., draft_ms: _Optional[float] = ..., verify_ms: _Optional[float] = ..., fallback_steps: _Optional[int] = ..., fallback_tokens: _Optional[int] = ..., wall_ms: _Optional[float] = ..., tokens_per_second: _Optional[float] = ..., draft_failures: _Optional[int] = ..., decode_steps: _Optional[int] = ..., draft_failures_by_kind: _Optional[_Mapping[str, int]] = ..., degraded_ms: _Optional[float] = ..., replica_failovers: _Optional[int] = ..., target_resyncs: _Optional[int] = ..., pipeline_prefetches: _Optional[int] = ..., pipeline_hits: _Optional[int] = ..., decode_ms: _Optional[float] = ..., load_shed_steps: _Optional[int] = ..., speculation_paused_steps: _Optional[int] = ..., draft_tokens_trimmed: _Optional[int] = ..., parallel_prefills: _Optional[int] = ..., kv_imports: _Optional[int] = ..., prefill_ms: _Optional[float] = ..., rpc_overhead_ms: _Optional[float] = ..., store_ms: _Optional[float] = ..., prefetch_wait_ms: _Optional[float] = ..., store_overlapped_ms: _Optional[float] = ..., queued_ms: _Optional[float] = ...) -> None: ...

class GetSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class SessionInfo(_message.Message):
    __slots__ = ("session_id", "status", "prompt_tokens", "generated_token_ids", "text", "stats", "finish_reason")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    status: str
    prompt_tokens: int
    generated_token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    stats: GenerationStats
    finish_reason: FinishReason
    def __init__(self, session_id: _Optional[str] = ..., status: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., generated_token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., stats: _Optional[_Union[GenerationStats, _Mapping]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ...) -> None: ...

class CancelSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class CancelSessionResponse(_message.Message):
    __slots__ = ("cancelled",)
    CANCELLED_FIELD_NUMBER: _ClassVar[int]
    cancelled: bool
    def __init__(self, cancelled: _Optional[bool] = ...) -> None: ...
