"""The OpenAI-compatible HTTP API's requests: which parameters are accepted, how each is checked, and the
GenerateRequest a body becomes (orchestrator/http_api.py serves it)."""

from __future__ import annotations

import json
import math

import grpc

from orchestrator.api.prompts import chat_prompt_ids
from specdec.v1 import orchestrator_pb2 as opb

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's legacy completions default

# gRPC status -> (HTTP status, OpenAI error type)
STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (409, "conflict_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (503, "service_unavailable_error"),
}

# OpenAI parameters this server does not implement, with the values that mean "not used": any other value is
# refused with a 400 naming the parameter.
NEUTRAL = {
    "presence_penalty": (0, 0.0), "frequency_penalty": (0, 0.0), "repetition_penalty": (1, 1.0),
    "logprobs": (False, 0), "top_logprobs": (0,), "logit_bias": ({},), "tools": ([],), "tool_choice": ("none",),
    "functions": ([],), "function_call": ("none",), "parallel_tool_calls": (False,), "echo": (False,),
    "best_of": (1,), "suffix": ("",), "store": (False,), "min_tokens": (0,), "min_p": (0, 0.0),
    "response_format": ({"type": "text"},), "service_tier": ("auto", "default"),
}
COMMON = {"model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "seed", "stop", "n", "user",
          "top_k", "ignore_eos", "stop_token_ids", "speculation", "max_draft_len"}
CHAT = COMMON | {"messages", "max_completion_tokens"}
COMPLETION = COMMON | {"prompt"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    @classmethod
    def from_grpc(cls, code: grpc.StatusCode, message: str) -> "ApiError":
        status, type_ = STATUS.get(code, (500, "server_error"))
        return cls(status, message, type_, code=code.name.lower())

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


# -- request parsing --------------------------------------------------------------------------------------------

def number_param(body: dict, key: str, default, lo: float, hi: float, integer: bool = False):
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not float(value).is_integer()):
        raise bad_request(f"{key} must be {'an integer' if integer else 'a number'}, got {json.dumps(value)}", key)
    if math.isnan(value) or not lo <= value <= hi:
        raise bad_request(f"{key} must be between {lo:g} and {hi:g}, got {value}", key)
    return int(value) if integer else float(value)


def flag_param(body: dict, key: str, default: bool = False) -> bool:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"{key} must be true or false, got {json.dumps(value)}", key)
    return value


def token_ids_param(value, key: str, vocab_size: int) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise bad_request(f"{key} must be a list of token ids", key)
    bad = [t for t in value if not 0 <= t < vocab_size]
    if bad:
        raise bad_request(f"{key}: token id {bad[0]} is outside the vocabulary (size {vocab_size})", key)
    return value


def check_keys(body: dict, allowed: set[str]) -> None:
    for key, value in body.items():
        if key in allowed:
            continue
        if key in NEUTRAL:
            if value is None or value in NEUTRAL[key]:
                continue
            raise bad_request(f"{key} is not supported by this server (only its neutral value {NEUTRAL[key][0]!r})", key)
        raise bad_request(f"unsupported parameter {key!r}", key)


def messages_param(value) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise bad_request("messages must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad_request(f"{where} must be an object with role and content", where)
        extra = set(m) - {"role", "content"}
        if extra:
            raise bad_request(f"{where}.{sorted(extra)[0]} is not supported", f"{where}.{sorted(extra)[0]}")
        role = {"developer": "system"}.get(m.get("role"), m.get("role"))
        if role not in ("system", "user", "assistant"):
            raise bad_request(f"{where}.role must be system, user or assistant, got {json.dumps(m.get('role'))}",
                       f"{where}.role")
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise bad_request(f"{where}.content: only text parts are supported", f"{where}.content")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise bad_request(f"{where}.content must be a string", f"{where}.content")
        out.append({"role": role, "content": content})
    return out


class Parsed:
    def __init__(self, request: opb.GenerateRequest, stream: bool, include_usage: bool, chat: bool):
        self.request, self.stream, self.include_usage, self.chat = request, stream, include_usage, chat


def parse_generate(servicer, body, chat: bool, model_name: str) -> Parsed:
    """An OpenAI request body as the gRPC GenerateRequest that means the same; the servicer validates the rest
    (limits, context length) exactly as for gRPC."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    check_keys(body, CHAT if chat else COMPLETION)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("model is required", "model")
    if model != model_name:
        raise ApiError(404, f"the model {model!r} does not exist; this server serves {model_name!r}",
                       "not_found_error", "model", "model_not_found")
    if number_param(body, "n", 1, 1, 2**31, integer=True) != 1:
        raise bad_request("n must be 1: this server returns one choice per request", "n")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise bad_request("user must be a string", "user")
    stream = flag_param(body, "stream")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise bad_request("stream_options is only allowed with stream true", "stream_options")
        if not isinstance(options, dict) or set(options) - {"include_usage"}:
            raise bad_request("stream_options supports include_usage only", "stream_options")
        include_usage = flag_param(options, "include_usage")
    req = opb.GenerateRequest(
        temperature=number_param(body, "temperature", 1.0, 0, 2),
        top_p=number_param(body, "top_p", 1.0, 0, 1),
        top_k=number_param(body, "top_k", 0, -1, 2**31 - 1, integer=True),
        seed=number_param(body, "seed", 0, -2**63, 2**64 - 1, integer=True) % 2**64,
        ignore_eos=flag_param(body, "ignore_eos"),
        max_draft_len=number_param(body, "max_draft_len", 0, 0, 2**31 - 1, integer=True),
    )
    if req.top_k == -1:
        req.top_k = 0  # vLLM's "no top-k"
    if req.top_p == 0:
        raise bad_request("top_p must be greater than 0", "top_p")
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else ([] if stop is None else stop)
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise bad_request("stop must be a non-empty string or a list of them", "stop")
    req.stop.extend(stop)
    if body.get("stop_token_ids") is not None:
        req.stop_token_ids.extend(token_ids_param(body["stop_token_ids"], "stop_token_ids", servicer.vocab_size))
    speculation = body.get("speculation")
    if speculation not in (None, True, False, "on", "off", "default"):
        raise bad_request('speculation must be true, false, "on", "off" or "default"', "speculation")
    req.speculation = {True: opb.SPECULATION_ON, "on": opb.SPECULATION_ON, False: opb.SPECULATION_OFF,
                       "off": opb.SPECULATION_OFF}.get(speculation, opb.SPECULATION_DEFAULT)

    # max_completion_tokens is chat's newer name for max_tokens; it wins when both are given.
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = number_param(body, key, None, 1, 2**32 - 1, integer=True)
    if chat:
        if servicer.tokenizer is None:
            raise bad_request("this orchestrator has no tokenizer: use /v1/completions with token ids", "messages")
        try:
            ids = chat_prompt_ids(servicer.tokenizer, messages_param(body.get("messages")))
        except ValueError as e:
            raise bad_request(str(e), "messages") from None
        req.token_ids.ids.extend(ids)
        if max_tokens is None:  # OpenAI: up to the context; here also up to the server's per-request limit
            room = servicer.target_info.max_context - len(ids)
            max_tokens = max(1, min(servicer.max_new_tokens_limit, room))
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            req.text = prompt
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            req.token_ids.ids.extend(token_ids_param(prompt, "prompt", servicer.vocab_size))
        elif isinstance(prompt, list) and prompt:
            raise bad_request("batched prompts are not supported: send one prompt per request", "prompt")
        else:
            raise bad_request("prompt must be a string or a list of token ids", "prompt")
        if max_tokens is None:
            max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS
    req.max_new_tokens = max_tokens
    return Parsed(req, stream, include_usage, chat)
