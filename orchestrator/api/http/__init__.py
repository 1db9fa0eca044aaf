"""The OpenAI-compatible HTTP API (docs/http.md), served by the orchestrator beside its gRPC API.

Map (a request's way through):
- server.py       HttpServer: uvicorn on a thread of the orchestrator process
- app.py          build_app: the routers, error handlers, the OpenAPI document with the server's limits
- schemas.py      request and response bodies (Pydantic): OpenAI's names, vLLM's extras, `specdec`
- completions.py  POST /v1/chat/completions, /v1/completions (and `run`, one generation answered)
- sessions.py     GET/DELETE /v1/sessions/{id}, POST /v1/sessions/{id}/resume
- models.py       GET /v1/models, /v1/models/{id}
- operations.py   GET /health, /metrics
- translate.py    a request body -> the gRPC GenerateRequest (validated by the servicer, as for gRPC)
- bridge.py       the servicer called with a stand-in gRPC context; Generate's messages to the event loop
- responses.py    OpenAI's response objects and server-sent events
- errors.py       OpenAI's error shape for every status, the gRPC status mapping
- deps.py         the servicer and the checked bearer token, as route dependencies
"""

from orchestrator.api.http.completions import SESSION_HEADER
from orchestrator.api.http.server import HttpServer

__all__ = ["HttpServer", "SESSION_HEADER"]
