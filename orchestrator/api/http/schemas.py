"""The HTTP API's request and response bodies as Pydantic models: OpenAI's field names and ranges, vLLM's extras,
and our `specdec` extension. FastAPI validates requests against them and writes them into /openapi.json; the
server's own limits (max_tokens, max_draft_len, vocabulary, ...) are added to that document by app.py from the
servicer that enforces them (one check, shared with gRPC)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, WithJsonSchema, model_validator
from pydantic_core import PydanticCustomError

U32 = 2**32 - 1
I32 = 2**31 - 1


class Strict(BaseModel):
    """A request body: exact JSON types, unknown fields refused (nothing that would change the output is ignored)."""
    model_config = ConfigDict(extra="forbid", strict=True, regex_engine="python-re")


def _integral(value):
    """JSON Schema's integer: 3.0 is one (the strict model refuses strings and booleans all the same)."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _only_false(value: bool) -> bool:
    if value:
        raise ValueError("only false is supported")
    return value


def integer(**constraints):
    """An integer field (the validator after the constraints, so the schema keeps them as minimum/maximum)."""
    return Annotated[int, Field(**constraints), BeforeValidator(_integral)]


FalseOnly = Annotated[bool, AfterValidator(_only_false), WithJsonSchema({"type": "boolean", "enum": [False]})]
NonEmpty = Annotated[str, Field(min_length=1)]
Text = Annotated[str, Field(pattern=r"\S", description="text with a non-blank character")]  # blank: no prompt
TokenId = integer(ge=0, description="a token id of the target's vocabulary")


def neutral(value, what: str):
    """An OpenAI parameter this server does not implement: accepted only at the value that means "not used"."""
    return Field(None, description=f"not supported: only {what} (or null) is accepted")


Zero = Annotated[float, Field(ge=0, le=0)]
One = Annotated[float, Field(ge=1, le=1)]
NoList = Annotated[list[dict], Field(max_length=0)]


class StreamOptions(Strict):
    include_usage: bool | None = Field(None, description="a last chunk with usage and no choices")


class ResponseFormat(Strict):
    type: Literal["text"]


class GenerationFields(Strict):
    """What chat and text completions share."""
    model: NonEmpty = Field(description="the target's name (GET /v1/models)")
    max_tokens: integer(ge=1, le=U32) | None = Field(
        None, description="tokens to generate; chat's default: up to the context and the server's limit, "
                          "completions': 16")
    temperature: Annotated[float, Field(ge=0, le=2)] | None = Field(None, description="0 is greedy; default 1")
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    seed: integer() | None = Field(
        None, description="any integer, taken modulo 2**64; the same seed gives the same text over HTTP and gRPC")
    stop: NonEmpty | list[NonEmpty] | None = Field(None, description="the text ends before the first one")
    n: integer(ge=1, le=1) | None = Field(None, description="one choice per request")
    user: str | None = Field(None, description="accepted, not used")
    stream: bool | None = Field(None, description="server-sent events")
    stream_options: StreamOptions | None = Field(None, description="read with stream true")
    # vLLM's sampling extras
    top_k: integer(ge=-1, le=I32) | None = Field(None, description="0 or -1: off")
    ignore_eos: bool | None = None
    stop_token_ids: list[TokenId] | None = None
    # specdec's
    speculation: bool | Literal["on", "off", "default"] | None = Field(
        None, description='true/"on", false/"off" (target-only decoding), null/"default" (the server\'s)')
    max_draft_len: integer(ge=0, le=I32) | None = Field(
        None, description="the longest draft of this request (0: the server's default)")
    # OpenAI's and vLLM's parameters this server does not implement
    presence_penalty: Zero | None = neutral(0, "0")
    frequency_penalty: Zero | None = neutral(0, "0")
    repetition_penalty: One | None = neutral(1, "1")
    min_p: Zero | None = neutral(0, "0")
    min_tokens: integer(ge=0, le=0) | None = neutral(0, "0")
    logit_bias: Annotated[dict[str, float], Field(max_length=0)] | None = neutral({}, "{}")
    service_tier: Literal["auto", "default"] | None = neutral("auto", '"auto" or "default"')
    store: FalseOnly | None = neutral(False, "false")


class ChatMessagePart(Strict):
    type: Literal["text"]
    text: str


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant"] = Field(description="developer reads as system")
    content: str | list[ChatMessagePart] = Field(description="text, or text parts")


class ChatCompletionRequest(GenerationFields):
    model_config = ConfigDict(json_schema_extra={"not": {"required": ["max_tokens", "max_completion_tokens"]}})

    messages: Annotated[list[ChatMessage], Field(min_length=1)] = Field(
        description="through the model's chat template; a model without one takes a single user message")
    max_completion_tokens: integer(ge=1, le=U32) | None = Field(
        None, description="chat's newer name for max_tokens (give one of them)")
    logprobs: FalseOnly | None = neutral(False, "false")
    top_logprobs: integer(ge=0, le=0) | None = neutral(0, "0")
    tools: NoList | None = neutral([], "[]")
    tool_choice: Literal["none"] | None = neutral("none", '"none"')
    functions: NoList | None = neutral([], "[]")
    function_call: Literal["none"] | None = neutral("none", '"none"')
    parallel_tool_calls: FalseOnly | None = neutral(False, "false")
    response_format: ResponseFormat | None = neutral({"type": "text"}, '{"type": "text"}')

    @model_validator(mode="after")
    def _one_length(self):
        if {"max_tokens", "max_completion_tokens"} <= self.model_fields_set:
            raise PydanticCustomError("conflict", "give max_completion_tokens or max_tokens (its older name), not both")
        return self


class CompletionRequest(GenerationFields):
    prompt: (Text | Annotated[list[TokenId], Field(min_length=1)]
             | Annotated[list[Text], Field(min_length=1, max_length=1)]
             | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1, max_length=1)]) = \
        Field(description="a string or a list of token ids; a batch of one of either")
    logprobs: integer(ge=0, le=0) | None = neutral(0, "0")
    echo: FalseOnly | None = neutral(False, "false")
    best_of: integer(ge=1, le=1) | None = neutral(1, "1")
    suffix: Annotated[str, Field(max_length=0)] | None = neutral("", '""')


class ResumeRequest(Strict):
    resume_from: integer(ge=0, le=U32) = Field(0, description="the first token not yet received")
    stream: bool = True
    stream_options: StreamOptions | None = None
    object: Literal["chat.completion", "text_completion"] = Field(
        "chat.completion", description="the shape of the chunks")


NEUTRAL_ONLY = frozenset(name for model in (ChatCompletionRequest, CompletionRequest)
                         for name, field in model.model_fields.items()
                         if (field.description or "").startswith("not supported"))


# -- responses ---------------------------------------------------------------------------------------------------

FinishReason = Literal["stop", "length", "abort"]


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class SpecDecodeFigures(BaseModel):
    """The request's speculative-decoding figures, named as vLLM names its spec-decode metrics."""
    num_drafts: int = Field(description="verification steps (one draft each)")
    num_draft_tokens: int
    num_accepted_tokens: int
    draft_acceptance_rate: float = Field(description="accepted / drafted")
    mean_acceptance_length: float = Field(description="tokens committed per verification step")
    fallback_steps: int = Field(description="target-only steps because the draft failed")


class SpecdecExtra(SpecDecodeFigures):
    session_id: str = Field(description="the session (also the X-Specdec-Session-Id header)")
    token_ids: list[int] = Field(description="the completion's token ids")


class ChunkExtra(BaseModel):
    """A streamed chunk's: its block (offset, token_ids), or on the last chunks the request's figures."""
    session_id: str
    offset: int | None = Field(None, description="the index of the chunk's first token among the generated ones")
    token_ids: list[int] | None = None
    num_drafts: int | None = None
    num_draft_tokens: int | None = None
    num_accepted_tokens: int | None = None
    draft_acceptance_rate: float | None = None
    mean_acceptance_length: float | None = None
    fallback_steps: int | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: None
    finish_reason: FinishReason


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    specdec: SpecdecExtra


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChunkChoice(BaseModel):
    index: int
    delta: Delta
    logprobs: None
    finish_reason: FinishReason | None


class ChatCompletionChunk(BaseModel):
    """One server-sent event of a chat stream (`data: {chunk}`)."""
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None
    specdec: ChunkExtra


class TextChoice(BaseModel):
    index: int
    text: str
    logprobs: None
    finish_reason: FinishReason | None


class Completion(BaseModel):
    """A text completion, and one server-sent event of its stream (OpenAI names both `text_completion`)."""
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[TextChoice]
    usage: Usage | None
    specdec: SpecdecExtra | ChunkExtra


class DraftReplica(BaseModel):
    address: str
    model: str | None
    strategy: str | None


class ModelExtra(BaseModel):
    drafts: list[DraftReplica]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int
    specdec: ModelExtra


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class SessionExtra(SpecDecodeFigures):
    session_id: str


class SessionInfo(BaseModel):
    id: str
    object: Literal["session"]
    status: Literal["running", "finished", "cancelled", "failed"]
    finish_reason: FinishReason | None
    text: str
    token_ids: list[int]
    usage: Usage
    specdec: SessionExtra


class SessionCancelled(BaseModel):
    id: str
    object: Literal["session"]
    cancelled: bool


class Health(BaseModel):
    status: Literal["ok", "unavailable"]
    target: str = Field(description='"ok" or "unavailable (why)"')
    store: str = Field(description='"ok" or "unavailable (why)"')


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = Field(description="the offending parameter, where one is to blame")
    code: str | None = Field(description="the gRPC status the orchestrator's checks answered, model_not_found, "
                                         "invalid_api_key, or null")


class ErrorResponse(BaseModel):
    error: ErrorDetail
