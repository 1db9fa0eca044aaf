"""The OpenAI-compatible HTTP API (docs/http.md), served by the orchestrator beside its gRPC API.

Every request runs through the gRPC servicer's own Generate/GetSession/CancelSession with a stand-in for the
gRPC context: one generation path, one validation, one auth check, one cancellation path."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import socket
import threading
import time

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from orchestrator.prompts import chat_prompt_ids
from orchestrator.server import OrchestratorServicer, principal_of
from specdec.core.grpc_util import listen_error
from specdec.v1 import orchestrator_pb2 as opb

log = logging.getLogger("specdec.http")

SESSION_HEADER = "X-Specdec-Session-Id"
EXTRA = "specdec"  # the one extra response field: session id and the request's speculative-decoding figures
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's legacy completions default

FINISH = {opb.FINISH_REASON_LENGTH: "length", opb.FINISH_REASON_EOS: "stop", opb.FINISH_REASON_STOP: "stop",
          opb.FINISH_REASON_CANCELLED: "abort"}

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


def _bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


class HttpContext:
    """What OrchestratorServicer needs of a grpc.ServicerContext: the caller's token, a cancellation callback
    (the HTTP client went away), and abort as an ApiError."""

    def __init__(self, authorization: str | None):
        self._metadata = (("authorization", authorization),) if authorization else ()
        self._callbacks = []
        self._active = True

    def invocation_metadata(self):
        return self._metadata

    def add_callback(self, callback) -> bool:
        self._callbacks.append(callback)
        return True

    def is_active(self) -> bool:
        return self._active

    def abort(self, code: grpc.StatusCode, details: str):
        raise ApiError.from_grpc(code, details)

    def cancel(self) -> None:
        self._active = False
        for callback in list(self._callbacks):
            callback()


_END = object()


class GenerateStream:
    """servicer.Generate run to its end on a thread of its own (it blocks on gRPC and Redis), its messages handed
    to the event loop. cancel() is a gRPC client's cancel: the generation stops, the session is recorded as
    cancelled and the caches are freed."""

    def __init__(self, servicer: OrchestratorServicer, request: opb.GenerateRequest, ctx: HttpContext):
        self.ctx = ctx
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.done = False
        threading.Thread(target=self._run, args=(servicer, request), name="http-generate", daemon=True).start()

    def _put(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the event loop is gone (server shutting down): nobody reads on
            self.ctx.cancel()

    def _run(self, servicer, request) -> None:
        try:
            for msg in servicer.Generate(request, self.ctx):
                self._put(msg)
        except ApiError as e:
            self._put(e)
        except Exception as e:  # noqa: BLE001 - reported to the client as a 500, logged here
            log.exception("generate failed")
            self._put(ApiError(500, f"internal error: {type(e).__name__}: {e}", "server_error"))
        self._put(_END)

    async def next(self):
        """The next GenerateResponse, or None at the end; raises the ApiError that ended the stream."""
        item = await self.queue.get()
        if item is _END:
            self.done = True
            return None
        if isinstance(item, ApiError):
            self.done = True
            raise item
        return item

    def cancel(self) -> None:
        if not self.done:
            self.ctx.cancel()


# -- request parsing --------------------------------------------------------------------------------------------

def _number(body: dict, key: str, default, lo: float, hi: float, integer: bool = False):
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not float(value).is_integer()):
        raise _bad(f"{key} must be {'an integer' if integer else 'a number'}, got {json.dumps(value)}", key)
    if math.isnan(value) or not lo <= value <= hi:
        raise _bad(f"{key} must be between {lo:g} and {hi:g}, got {value}", key)
    return int(value) if integer else float(value)


def _flag(body: dict, key: str, default: bool = False) -> bool:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _bad(f"{key} must be true or false, got {json.dumps(value)}", key)
    return value


def _token_ids(value, key: str, vocab_size: int) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise _bad(f"{key} must be a list of token ids", key)
    bad = [t for t in value if not 0 <= t < vocab_size]
    if bad:
        raise _bad(f"{key}: token id {bad[0]} is outside the vocabulary (size {vocab_size})", key)
    return value


def _check_keys(body: dict, allowed: set[str]) -> None:
    for key, value in body.items():
        if key in allowed:
            continue
        if key in NEUTRAL:
            if value is None or value in NEUTRAL[key]:
                continue
            raise _bad(f"{key} is not supported by this server (only its neutral value {NEUTRAL[key][0]!r})", key)
        raise _bad(f"unsupported parameter {key!r}", key)


def _messages(value) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise _bad("messages must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise _bad(f"{where} must be an object with role and content", where)
        extra = set(m) - {"role", "content"}
        if extra:
            raise _bad(f"{where}.{sorted(extra)[0]} is not supported", f"{where}.{sorted(extra)[0]}")
        role = {"developer": "system"}.get(m.get("role"), m.get("role"))
        if role not in ("system", "user", "assistant"):
            raise _bad(f"{where}.role must be system, user or assistant, got {json.dumps(m.get('role'))}",
                       f"{where}.role")
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise _bad(f"{where}.content: only text parts are supported", f"{where}.content")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise _bad(f"{where}.content must be a string", f"{where}.content")
        out.append({"role": role, "content": content})
    return out


class Parsed:
    def __init__(self, request: opb.GenerateRequest, stream: bool, include_usage: bool, chat: bool):
        self.request, self.stream, self.include_usage, self.chat = request, stream, include_usage, chat


def parse_generate(servicer: OrchestratorServicer, body, chat: bool, model_name: str) -> Parsed:
    """An OpenAI request body as the gRPC GenerateRequest that means the same; the servicer validates the rest
    (limits, context length) exactly as for gRPC."""
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object")
    _check_keys(body, CHAT if chat else COMPLETION)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("model is required", "model")
    if model != model_name:
        raise ApiError(404, f"the model {model!r} does not exist; this server serves {model_name!r}",
                       "not_found_error", "model", "model_not_found")
    if _number(body, "n", 1, 1, 2**31, integer=True) != 1:
        raise _bad("n must be 1: this server returns one choice per request", "n")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise _bad("user must be a string", "user")
    stream = _flag(body, "stream")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise _bad("stream_options is only allowed with stream true", "stream_options")
        if not isinstance(options, dict) or set(options) - {"include_usage"}:
            raise _bad("stream_options supports include_usage only", "stream_options")
        include_usage = _flag(options, "include_usage")
    req = opb.GenerateRequest(
        temperature=_number(body, "temperature", 1.0, 0, 2),
        top_p=_number(body, "top_p", 1.0, 0, 1),
        top_k=_number(body, "top_k", 0, -1, 2**31 - 1, integer=True),
        seed=_number(body, "seed", 0, -2**63, 2**64 - 1, integer=True) % 2**64,
        ignore_eos=_flag(body, "ignore_eos"),
        max_draft_len=_number(body, "max_draft_len", 0, 0, 2**31 - 1, integer=True),
    )
    if req.top_k == -1:
        req.top_k = 0  # vLLM's "no top-k"
    if req.top_p == 0:
        raise _bad("top_p must be greater than 0", "top_p")
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else ([] if stop is None else stop)
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise _bad("stop must be a non-empty string or a list of them", "stop")
    req.stop.extend(stop)
    if body.get("stop_token_ids") is not None:
        req.stop_token_ids.extend(_token_ids(body["stop_token_ids"], "stop_token_ids", servicer.vocab_size))
    speculation = body.get("speculation")
    if speculation not in (None, True, False, "on", "off", "default"):
        raise _bad('speculation must be true, false, "on", "off" or "default"', "speculation")
    req.speculation = {True: opb.SPECULATION_ON, "on": opb.SPECULATION_ON, False: opb.SPECULATION_OFF,
                       "off": opb.SPECULATION_OFF}.get(speculation, opb.SPECULATION_DEFAULT)

    # max_completion_tokens is chat's newer name for max_tokens; it wins when both are given.
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _number(body, key, None, 1, 2**32 - 1, integer=True)
    if chat:
        if servicer.tokenizer is None:
            raise _bad("this orchestrator has no tokenizer: use /v1/completions with token ids", "messages")
        try:
            ids = chat_prompt_ids(servicer.tokenizer, _messages(body.get("messages")))
        except ValueError as e:
            raise _bad(str(e), "messages") from None
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
            req.token_ids.ids.extend(_token_ids(prompt, "prompt", servicer.vocab_size))
        elif isinstance(prompt, list) and prompt:
            raise _bad("batched prompts are not supported: send one prompt per request", "prompt")
        else:
            raise _bad("prompt must be a string or a list of token ids", "prompt")
        if max_tokens is None:
            max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS
    req.max_new_tokens = max_tokens
    return Parsed(req, stream, include_usage, chat)


# -- responses --------------------------------------------------------------------------------------------------

def spec_decode_figures(stats: opb.GenerationStats) -> dict:
    """The request's speculative-decoding figures, named as vLLM names its spec-decode metrics where they mean the
    same (num_drafts, num_draft_tokens, num_accepted_tokens; mean acceptance length = accepted per draft + 1)."""
    return {"num_drafts": stats.verify_steps, "num_draft_tokens": stats.draft_tokens_proposed,
            "num_accepted_tokens": stats.draft_tokens_accepted,
            "draft_acceptance_rate": stats.acceptance_rate, "mean_acceptance_length": stats.mean_accepted_length,
            "fallback_steps": stats.fallback_steps}


def usage(stats: opb.GenerationStats) -> dict:
    return {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.generated_tokens,
            "total_tokens": stats.prompt_tokens + stats.generated_tokens}


class Shaper:
    """Builds the OpenAI response objects of one request (chat or text completion)."""

    def __init__(self, chat: bool, session_id: str, model: str):
        self.chat, self.model, self.sid = chat, model, session_id
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{session_id}"
        self.created = int(time.time())

    def _choice(self, text: str | None, finish: str | None, delta: bool, role: bool = False) -> dict:
        if not self.chat:
            return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        if delta:
            body = {"role": "assistant", "content": text or ""} if role else ({} if text is None else {"content": text})
            return {"index": 0, "delta": body, "logprobs": None, "finish_reason": finish}
        return {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                "finish_reason": finish}

    def chunk(self, extra: dict, text: str | None = None, finish: str | None = None, role: bool = False,
              usage_: dict | None = None, include_usage: bool = False, choices: bool = True) -> str:
        obj = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
               "created": self.created, "model": self.model,
               "choices": [self._choice(text, finish, True, role)] if choices else []}
        if include_usage:
            obj["usage"] = usage_
        obj[EXTRA] = {"session_id": self.sid, **extra}
        return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"

    def whole(self, text: str, token_ids: list[int], final: opb.GenerateResponse) -> dict:
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model,
                "choices": [self._choice(text, FINISH.get(final.finish_reason, "stop"), False)],
                "usage": usage(final.stats),
                EXTRA: {"session_id": self.sid, "token_ids": token_ids, **spec_decode_figures(final.stats)}}


# -- the application --------------------------------------------------------------------------------------------

def build_app(servicer: OrchestratorServicer):
    class SseResponse(StreamingResponse):
        """Cancels its generation however the response ends: a client that disconnects cancels the generation
        and frees the caches everywhere, as a gRPC cancel does."""

        def __init__(self, content, stream: GenerateStream, headers: dict):
            super().__init__(content, headers=headers, media_type="text/event-stream")
            self.stream = stream

        async def __call__(self, scope, receive, send):
            try:
                await super().__call__(scope, receive, send)
            finally:
                self.stream.cancel()

    model_name = servicer.target_info.model_name
    started = int(time.time())
    app = FastAPI(title="specdec", description="OpenAI-compatible API of the specdec orchestrator (docs/http.md)")

    def error_response(e: ApiError) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if e.status == 401 else None
        return JSONResponse(e.body(), status_code=e.status, headers=headers)

    @app.exception_handler(ApiError)
    async def _api_error(request, e: ApiError):
        return error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, e):
        status = e.status_code
        return error_response(ApiError(status, str(e.detail), "not_found_error" if status == 404 else
                                       "invalid_request_error"))

    def authorize(request: Request) -> str | None:
        header = request.headers.get("authorization")
        if servicer.principals:
            token = header[len("Bearer "):] if header and header.startswith("Bearer ") else None
            if token is None or principal_of(token) not in servicer.principals:
                raise ApiError(401, "missing or invalid bearer token (Authorization: Bearer <token>)",
                               "authentication_error", code="invalid_api_key")
        return header

    async def json_body(request: Request):
        try:
            return json.loads(await request.body() or b"null")
        except ValueError as e:
            raise _bad(f"the request body is not valid JSON: {e}") from None

    async def watch_disconnect(request: Request, stream: GenerateStream) -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                stream.cancel()
                return

    async def run(request: Request, parsed: Parsed, kind_chat: bool):
        ctx = HttpContext(request.headers.get("authorization"))
        stream = GenerateStream(servicer, parsed.request, ctx)
        try:
            first = await stream.next()  # the session id, or the request's error before anything is streamed
        except BaseException:
            stream.cancel()
            raise
        shaper = Shaper(kind_chat, first.session_id, model_name)
        headers = {SESSION_HEADER: first.session_id}
        if parsed.stream:
            return SseResponse(sse(stream, first, shaper, parsed.include_usage), stream, headers=headers)
        watcher = asyncio.create_task(watch_disconnect(request, stream))
        try:
            text, tokens, final = [first.text], list(first.token_ids), first
            while (msg := await stream.next()) is not None:
                text.append(msg.text)
                tokens.extend(msg.token_ids)
                final = msg
        finally:
            watcher.cancel()
            stream.cancel()
        return JSONResponse(shaper.whole("".join(text), tokens, final), headers=headers)

    async def sse(stream: GenerateStream, first, shaper: Shaper, include_usage: bool):
        try:
            msg = first
            if shaper.chat:
                yield shaper.chunk({"offset": msg.offset, "token_ids": list(msg.token_ids)}, msg.text, role=True,
                                   include_usage=include_usage)
            elif msg.token_ids or msg.text:
                yield shaper.chunk({"offset": msg.offset, "token_ids": list(msg.token_ids)}, msg.text,
                                   include_usage=include_usage)
            try:
                while (msg := await stream.next()) is not None:
                    if msg.HasField("stats"):
                        stats = spec_decode_figures(msg.stats)
                        yield shaper.chunk(stats, None if shaper.chat else "",
                                           FINISH.get(msg.finish_reason, "stop"), include_usage=include_usage)
                        if include_usage:
                            yield shaper.chunk(stats, usage_=usage(msg.stats), include_usage=True, choices=False)
                    else:
                        yield shaper.chunk({"offset": msg.offset, "token_ids": list(msg.token_ids)}, msg.text,
                                           include_usage=include_usage)
            except ApiError as e:  # after the headers: the error as the stream's last event (as vLLM does)
                yield f"data: {json.dumps(e.body())}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            stream.cancel()  # the client went away (the task was cancelled) or the stream ended

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        authorize(request)
        return await run(request, parse_generate(servicer, await json_body(request), True, model_name), True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        authorize(request)
        return await run(request, parse_generate(servicer, await json_body(request), False, model_name), False)

    def model_card() -> dict:
        drafts = []
        for replica in (servicer.pool.replicas if servicer.pool is not None else []):
            info = replica.info
            drafts.append({"address": replica.address, "model": info.model_name if info else None,
                           "strategy": info.strategy if info else None})
        return {"id": model_name, "object": "model", "created": started, "owned_by": "specdec",
                "max_model_len": servicer.target_info.max_context, EXTRA: {"drafts": drafts}}

    @app.get("/v1/models")
    async def models(request: Request):
        authorize(request)
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str, request: Request):
        authorize(request)
        if model != model_name:
            raise ApiError(404, f"the model {model!r} does not exist; this server serves {model_name!r}",
                           "not_found_error", "model", "model_not_found")
        return model_card()

    # -- durable sessions --

    def call(method, request, ctx):
        try:
            return method(request, ctx)
        except ApiError:
            raise
        except Exception as e:  # noqa: BLE001
            raise ApiError(500, f"internal error: {type(e).__name__}: {e}", "server_error") from e

    @app.get("/v1/sessions/{session_id}")
    async def get_session(session_id: str, request: Request):
        ctx = HttpContext(authorize(request))
        info = await asyncio.to_thread(call, servicer.GetSession, opb.GetSessionRequest(session_id=session_id), ctx)
        return JSONResponse({"id": info.session_id, "object": "session", "status": info.status,
                             "finish_reason": FINISH.get(info.finish_reason) if info.status != "running" else None,
                             "text": info.text, "token_ids": list(info.generated_token_ids),
                             "usage": usage(info.stats), EXTRA: {"session_id": info.session_id,
                                                                 **spec_decode_figures(info.stats)}},
                            headers={SESSION_HEADER: info.session_id})

    @app.delete("/v1/sessions/{session_id}")
    async def cancel_session(session_id: str, request: Request):
        ctx = HttpContext(authorize(request))
        reply = await asyncio.to_thread(call, servicer.CancelSession,
                                        opb.CancelSessionRequest(session_id=session_id), ctx)
        return {"id": session_id, "object": "session", "cancelled": reply.cancelled}

    @app.post("/v1/sessions/{session_id}/resume")
    async def resume(session_id: str, request: Request):
        authorize(request)
        body = await json_body(request)
        if body is None:
            body = {}
        if not isinstance(body, dict):
            raise _bad("the request body must be a JSON object")
        _check_keys(body, {"resume_from", "stream", "stream_options", "object"})
        kind = body.get("object", "chat.completion")
        if kind not in ("chat.completion", "text_completion"):
            raise _bad('object must be "chat.completion" or "text_completion"', "object")
        stream = _flag(body, "stream", True)
        options = body.get("stream_options") or {}
        if not isinstance(options, dict) or set(options) - {"include_usage"}:
            raise _bad("stream_options supports include_usage only", "stream_options")
        req = opb.GenerateRequest(resume_session_id=session_id,
                                  resume_from=_number(body, "resume_from", 0, 0, 2**32 - 1, integer=True))
        return await run(request, Parsed(req, stream, _flag(options, "include_usage"), kind == "chat.completion"),
                         kind == "chat.completion")

    # -- operations --

    def healthy() -> tuple[bool, dict]:
        checks = {}
        try:
            servicer.target.info(timeout=2.0)
            checks["target"] = "ok"
        except grpc.RpcError as e:
            checks["target"] = f"unavailable ({e.code().name})"
        try:
            servicer.store.ping()
            checks["store"] = "ok"
        except Exception as e:  # noqa: BLE001 - any failure means not healthy
            checks["store"] = f"unavailable ({e})"
        return all(v == "ok" for v in checks.values()), checks

    @app.get("/health")
    async def health():
        ok, checks = await asyncio.to_thread(healthy)
        return JSONResponse({"status": "ok" if ok else "unavailable", **checks}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics():
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        from specdec import observability as telemetry

        registry = telemetry.prometheus_registry()
        if registry is None:
            raise ApiError(503, "the Prometheus exporter is not installed", "service_unavailable_error")
        return PlainTextResponse(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return app


class HttpServer:
    """uvicorn serving the app on a thread of the orchestrator process. The socket is bound first (before the
    orchestrator waits for its target), so a taken port fails at once with the same message as gRPC's; port 0
    reports the port it got."""

    def __init__(self, address: str):
        host, _, port = address.rpartition(":")
        if not port.isdigit():
            raise listen_error("HTTP", address, "not a host:port address")
        host = host.strip("[]") or "127.0.0.1"
        self.sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.sock.bind((host, int(port)))
        except OSError as e:
            self.sock.close()
            raise listen_error("HTTP", address, e.strerror or str(e)) from e
        self.sock.listen(512)
        self.port = self.sock.getsockname()[1]
        self.url = f"http://{f'[{host}]' if ':' in host else host}:{self.port}"
        self.server = self.thread = None

    def start(self, servicer: OrchestratorServicer, timeout: float = 30.0) -> "HttpServer":
        import uvicorn

        config = uvicorn.Config(build_app(servicer), log_config=None, access_log=False, lifespan="off",
                                timeout_graceful_shutdown=2, ws="none")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, name="http-api",
                                       daemon=True)
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the HTTP API did not start on {self.url}")
            time.sleep(0.01)
        log.info("serving HTTP", extra={"url": self.url})
        return self

    def stop(self, grace: float = 2.0) -> None:
        if self.server is not None:
            self.server.should_exit = True
            self.thread.join(grace + 3)
        self.sock.close()
