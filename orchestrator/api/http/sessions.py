"""Durable sessions: GET a session's state, DELETE (cancel) it, POST .../resume its stream from token N."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Body, Depends, Path, Request
from fastapi.responses import JSONResponse

from orchestrator.api.http.bridge import call_unary
from orchestrator.api.http.completions import SESSION_HEADER, usage_asked, generation_responses, run
from orchestrator.api.http.deps import authorization, servicer_of
from orchestrator.api.http.errors import documented
from orchestrator.api.http.responses import session_info
from orchestrator.api.http.schemas import ChatCompletion, Completion, ResumeRequest, SessionCancelled, SessionInfo
from orchestrator.api.http.translate import resume_request
from specdec.v1 import orchestrator_pb2 as opb

SessionId = Annotated[str, Path(min_length=1, max_length=128, description="a session id (the X-Specdec-Session-Id "
                                                                          "header of its response)")]
router = APIRouter(tags=["sessions"])


@router.get("/v1/sessions/{session_id}", response_model=SessionInfo, responses=documented(400, 401, 404, 500, 503))
async def get_session(session_id: SessionId, servicer=Depends(servicer_of), auth: str | None = Depends(authorization)):
    """A session's state: status, text, token ids, usage, speculative-decoding figures."""
    info = await call_unary(servicer.GetSession, opb.GetSessionRequest(session_id=session_id), auth)
    return JSONResponse(session_info(info), headers={SESSION_HEADER: info.session_id})


@router.delete("/v1/sessions/{session_id}", response_model=SessionCancelled,
               responses=documented(400, 401, 404, 500, 503))
async def cancel_session(session_id: SessionId, servicer=Depends(servicer_of),
                         auth: str | None = Depends(authorization)):
    """Cancel a session (as gRPC CancelSession)."""
    reply = await call_unary(servicer.CancelSession, opb.CancelSessionRequest(session_id=session_id), auth)
    return {"id": session_id, "object": "session", "cancelled": reply.cancelled}


@router.post("/v1/sessions/{session_id}/resume", response_model=None,
             responses={**generation_responses(ChatCompletion | Completion, "chat.completion.chunk or text_completion"),
                        **documented(409)})
async def resume(session_id: SessionId, request: Request, body: Annotated[ResumeRequest | None, Body()] = None,
                 auth: str | None = Depends(authorization)):
    """Resume a session's stream from token `resume_from`, with the session's own prompt and parameters: a
    cancelled session continues, a finished one replays its tail."""
    body = body or ResumeRequest()
    return await run(request, resume_request(session_id, body.resume_from), auth,
                     chat=body.object == "chat.completion", stream=body.stream, include_usage=usage_asked(body))
