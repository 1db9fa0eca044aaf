"""Errors in OpenAI's shape, {"error": {message, type, param, code}}, from every source: the servicer's gRPC
status codes (one validation path with gRPC), the request models' validation, and HTTP routing (404, 405)."""

from __future__ import annotations

import json

import grpc
from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from orchestrator.api.http.schemas import NEUTRAL_ONLY, ErrorResponse

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
TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
         405: "invalid_request_error", 409: "conflict_error", 429: "rate_limit_error",
         503: "service_unavailable_error"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str | None = None, param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type_ or TYPES.get(status, "server_error")

    @classmethod
    def from_grpc(cls, code: grpc.StatusCode, message: str) -> "ApiError":
        status, type_ = STATUS.get(code, (500, "server_error"))
        return cls(status, message, type_, code=code.name.lower())

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


def model_not_found(model: str, served: str) -> ApiError:
    return ApiError(404, f"the model {model!r} does not exist; this server serves {served!r}", param="model",
                    code="model_not_found")


# -- what each status means, for the OpenAPI document -----------------------------------------------------------

WHEN = {
    400: "invalid or unsupported parameters, a prompt too long for the context",
    401: "missing or wrong bearer token",
    404: "unknown model or session (or another token's session)",
    409: "the session is already streaming",
    429: "the server is busy (admission queue timeout, or every session slot taken)",
    500: "an unexpected failure",
    503: "target or session store unavailable",
}


def documented(*statuses: int) -> dict:
    """FastAPI `responses=` for these error statuses, each with the OpenAI error body."""
    return {s: {"model": ErrorResponse, "description": WHEN[s]} for s in statuses}


# -- handlers ----------------------------------------------------------------------------------------------------

def error_response(e: ApiError, headers: dict | None = None) -> JSONResponse:
    if e.status == 401:
        headers = {**(headers or {}), "WWW-Authenticate": "Bearer"}
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


def _param(loc: tuple) -> str | None:
    """A validation error's location as the parameter a client sent: messages[0].role, stop, ..."""
    out = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part.isidentifier() and part not in ("str", "int", "float", "bool", "list", "dict"):
            out += f".{part}" if out else part
        else:
            break  # a union member's tag (list[str], function-after[...]): the parameter is named already
    return out or None


def validation_error(e: RequestValidationError) -> ApiError:
    errors = e.errors()
    first = errors[0]
    if first.get("type") == "json_invalid" or isinstance(first.get("input"), bytes):
        try:
            json.loads(first.get("input") or b"")
        except ValueError as bad:
            return bad_request(f"the request body is not valid JSON: {bad}")
        return bad_request(f"the request body is not valid JSON: {first.get('msg')}")
    param = _param(tuple(first.get("loc", ())))
    if param is None:
        if first.get("type") in ("model_attributes_type", "model_type", "missing"):
            return bad_request("the request body must be a JSON object")
        return bad_request(first["msg"])  # a rule over several fields
    # A union's members each fail: the deepest location says most (stop: [""] -> the empty string, not "a str").
    first = max((x for x in errors if (_param(tuple(x.get("loc", ()))) or "").split("[")[0] == param.split("[")[0]),
                key=lambda x: len(x.get("loc", ())))
    param = _param(tuple(first["loc"]))
    if first.get("type") == "extra_forbidden":
        return bad_request(f"unsupported parameter {param!r}", param)
    if param.split("[")[0] in NEUTRAL_ONLY:
        return bad_request(f"{param} is not supported by this server (only its neutral value): {first['msg']}", param)
    return bad_request(f"{param}: {first['msg']}", param)


async def on_api_error(request: Request, e: ApiError) -> JSONResponse:
    return error_response(e)


async def on_validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
    return error_response(validation_error(e))


def _routes(routes):
    for route in routes:
        inner = getattr(route, "original_router", None)  # FastAPI wraps an included router (no prefix here)
        yield from (_routes(inner.routes) if inner is not None else (route,))


def allowed_methods(request: Request) -> str:
    """Every method some route serves on this path (Starlette's own Allow names the first matching route's)."""
    methods = set()
    for route in _routes(request.app.router.routes):
        match, _ = route.matches(request.scope)
        if match != Match.NONE and getattr(route, "methods", None):
            methods |= route.methods
    return ", ".join(sorted(methods))


async def on_http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
    """Routing's own errors: an unknown path; a method the path does not serve, with the Allow header."""
    headers = dict(getattr(e, "headers", None) or {})
    if e.status_code == 405:
        headers["Allow"] = allowed_methods(request)
    return error_response(ApiError(e.status_code, str(e.detail)), headers=headers or None)


def install(app) -> None:
    app.add_exception_handler(ApiError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
