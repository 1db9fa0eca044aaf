"""The OpenAI-compatible HTTP API (docs/http.md), served by the orchestrator beside its gRPC API.

Every request runs through the gRPC servicer's own Generate/GetSession/CancelSession with a stand-in for the
gRPC context: one generation path, one validation, one auth check, one cancellation path."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from orchestrator.http_request import (ApiError, Parsed, bad_request, check_keys, flag_param, number_param,
                                       parse_generate)
from specdec.core.grpc_util import RpcAbort, listen_error
from specdec.v1 import orchestrator_pb2 as opb

log = logging.getLogger("specdec.http")

SESSION_HEADER = "X-Specdec-Session-Id"
EXTRA = "specdec"  # the one extra response field: session id and the request's speculative-decoding figures

FINISH = {opb.FINISH_REASON_LENGTH: "length", opb.FINISH_REASON_EOS: "stop", opb.FINISH_REASON_STOP: "stop",
          opb.FINISH_REASON_CANCELLED: "abort"}


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

    def __init__(self, servicer, request: opb.GenerateRequest, ctx: HttpContext):
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

def build_app(servicer):
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
        """The request's Authorization header, once the servicer's own check (the gRPC API's) accepts it."""
        header = request.headers.get("authorization")
        try:
            servicer.authenticate(HttpContext(header))
        except RpcAbort:
            raise ApiError(401, "missing or invalid bearer token (Authorization: Bearer <token>)",
                           "authentication_error", code="invalid_api_key") from None
        return header

    async def json_body(request: Request):
        try:
            return json.loads(await request.body() or b"null")
        except ValueError as e:
            raise bad_request(f"the request body is not valid JSON: {e}") from None

    async def watch_disconnect(request: Request, stream: GenerateStream) -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                stream.cancel()
                return

    async def run(request: Request, parsed: Parsed, kind_chat: bool):
        ctx = HttpContext(request.headers.get("authorization"))
        stream = GenerateStream(servicer, parsed.request, ctx)
        # Watched from the start: a client that leaves while its request waits in the admission queue leaves it.
        watcher = asyncio.create_task(watch_disconnect(request, stream))
        try:
            first = await stream.next()  # the session id, or the request's error before anything is streamed
        except BaseException:
            watcher.cancel()
            stream.cancel()
            raise
        shaper = Shaper(kind_chat, first.session_id, model_name)
        headers = {SESSION_HEADER: first.session_id}
        if parsed.stream:
            watcher.cancel()  # the streaming response watches for itself
            return SseResponse(sse(stream, first, shaper, parsed.include_usage), stream, headers=headers)
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
            raise bad_request("the request body must be a JSON object")
        check_keys(body, {"resume_from", "stream", "stream_options", "object"})
        kind = body.get("object", "chat.completion")
        if kind not in ("chat.completion", "text_completion"):
            raise bad_request('object must be "chat.completion" or "text_completion"', "object")
        stream = flag_param(body, "stream", True)
        options = body.get("stream_options") or {}
        if not isinstance(options, dict) or set(options) - {"include_usage"}:
            raise bad_request("stream_options supports include_usage only", "stream_options")
        req = opb.GenerateRequest(resume_session_id=session_id,
                                  resume_from=number_param(body, "resume_from", 0, 0, 2**32 - 1, integer=True))
        return await run(request, Parsed(req, stream, flag_param(options, "include_usage"), kind == "chat.completion"),
                         kind == "chat.completion")

    # -- operations --

    def healthy() -> tuple[bool, dict]:
        checks = {}
        try:
            servicer.targets.info(timeout=2.0)
            checks["target"] = "ok"
        except grpc.RpcError as e:
            checks["target"] = f"unavailable ({e.code().name})"
        except Exception as e:  # noqa: BLE001 - no target replica at all (a DNS name with no records)
            checks["target"] = f"unavailable ({e})"
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

    def start(self, servicer, timeout: float = 30.0) -> "HttpServer":
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
