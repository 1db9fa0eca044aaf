"""What every route needs: the servicer it serves and the caller's checked bearer token."""

from __future__ import annotations

from fastapi import Request, Security
from fastapi.security import HTTPBearer

from orchestrator.api.http.bridge import authorize

bearer = HTTPBearer(auto_error=False, description="a token of the orchestrator's --auth-tokens-file "
                                                  "(the gRPC API's); none needed without one")


def servicer_of(request: Request):
    return request.app.state.servicer


def authorization(request: Request, _=Security(bearer)) -> str | None:
    """The request's Authorization header, once the servicer's own check accepts it (else a 401)."""
    return authorize(request.app.state.servicer, request.headers.get("authorization"))
