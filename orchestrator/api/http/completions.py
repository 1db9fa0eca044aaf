"""POST /v1/chat/completions and /v1/completions; the resume of a session's stream (sessions.py) runs here too."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, StreamingResponse

from orchestrator.api.http.responses import Shaper, sse, whole
from orchestrator.api.http.bridge import GenerateStream, HttpContext
from orchestrator.api.http.deps import authorization, servicer_of
from orchestrator.api.http.errors import documented, model_not_found
from orchestrator.api.http.schemas import ChatCompletion, ChatCompletionRequest, Completion, CompletionRequest
from orchestrator.api.http.translate import chat_request, completion_request
from specdec.v1 import orchestrator_pb2 as opb

SESSION_HEADER = "X-Specdec-Session-Id"
ERRORS = documented(400, 401, 404, 429, 500, 503)
SSE_EVENT = {"type": "object", "required": ["data"], "description": "one server-sent event",
             "properties": {"data": {"type": "string", "description": "a chunk as JSON; the last: [DONE]"}}}


def generation_responses(model: type, chunk: str) -> dict:
    """The OpenAPI `responses` of a generation: JSON, or with stream true server-sent events."""
    return {200: {"model": model, "description": f"the whole response; with stream true, `text/event-stream`: one "
                                                 f"`data: {{{chunk}}}` per committed block, then `data: [DONE]`",
                  "headers": {SESSION_HEADER: {"description": "the session id", "schema": {"type": "string"}}},
                  "content": {"text/event-stream": {"schema": SSE_EVENT}}}, **ERRORS}


class SseResponse(StreamingResponse):
    """Cancels its generation however the response ends: a client that disconnects cancels the generation and
    frees the caches everywhere, as a gRPC cancel does."""

    def __init__(self, content, stream: GenerateStream, headers: dict):
        super().__init__(content, headers=headers, media_type="text/event-stream")
        self.stream = stream

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.stream.cancel()


async def _watch_disconnect(request: Request, stream: GenerateStream) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            stream.cancel()
            return


async def run(request: Request, req: opb.GenerateRequest, authorization: str | None, *, chat: bool, stream: bool,
              include_usage: bool = False):
    """One generation through servicer.Generate, answered whole or as server-sent events."""
    servicer = request.app.state.servicer
    gen = GenerateStream(servicer, req, HttpContext(authorization))
    # Watched from the start: a client that leaves while its request waits in the admission queue leaves it.
    watcher = asyncio.create_task(_watch_disconnect(request, gen))
    try:
        first = await gen.first()  # the session id, or the request's error before anything is streamed
    except BaseException:
        watcher.cancel()
        gen.cancel()
        raise
    shaper = Shaper(chat, first.session_id, servicer.target_info.model_name, include_usage)
    headers = {SESSION_HEADER: first.session_id}
    if stream:
        watcher.cancel()  # the streaming response watches for itself
        return SseResponse(sse(gen, first, shaper), gen, headers=headers)
    try:
        return JSONResponse(await whole(gen, first, shaper), headers=headers)
    finally:
        watcher.cancel()
        gen.cancel()


def _served(servicer, body):
    """The body, once its model is the one this server serves (else a 404)."""
    if body.model != servicer.target_info.model_name:
        raise model_not_found(body.model, servicer.target_info.model_name)
    return body


def usage_asked(body) -> bool:
    """stream_options.include_usage (read with stream true only)."""
    return bool(body.stream_options and body.stream_options.include_usage)


router = APIRouter(tags=["completions"])


@router.post("/v1/chat/completions", response_model=None,
             responses=generation_responses(ChatCompletion, "chat.completion.chunk"))
async def chat_completions(body: ChatCompletionRequest, request: Request, servicer=Depends(servicer_of),
                           auth: str | None = Depends(authorization)):
    """A chat completion: the messages through the model's chat template."""
    req = chat_request(servicer, _served(servicer, body))
    return await run(request, req, auth, chat=True, stream=bool(body.stream), include_usage=usage_asked(body))


@router.post("/v1/completions", response_model=None, responses=generation_responses(Completion, "text_completion"))
async def completions(body: CompletionRequest, request: Request, servicer=Depends(servicer_of),
                      auth: str | None = Depends(authorization)):
    """A text completion of a prompt (a string, or token ids)."""
    req = completion_request(servicer, _served(servicer, body))
    return await run(request, req, auth, chat=False, stream=bool(body.stream), include_usage=usage_asked(body))
