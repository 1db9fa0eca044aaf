"""The FastAPI application: the routers, the error handlers, and the OpenAPI document with this server's limits
written into it (taken from the servicer that enforces them)."""

from __future__ import annotations

import copy
import time

from fastapi import FastAPI

from orchestrator.api.http.completions import router as completions
from orchestrator.api.http.errors import install as install_error_handlers
from orchestrator.api.http.models import router as models
from orchestrator.api.http.operations import router as operations
from orchestrator.api.http.sessions import router as sessions


def build_app(servicer) -> FastAPI:
    app = FastAPI(title="specdec", version="1",
                  description="OpenAI-compatible API of the specdec orchestrator (docs/http.md). Errors answer "
                              "OpenAI's shape, {\"error\": {message, type, param, code}}.")
    app.state.servicer = servicer
    app.state.started = int(time.time())
    install_error_handlers(app)
    for router in (completions, models, sessions, operations):  # one module per route group
        app.include_router(router)
    base = app.openapi
    app.openapi = lambda: with_limits(base(), servicer)  # auth and limits as they are now (a test may change them)
    return app


def _value_branch(prop: dict) -> dict:
    """An optional field's non-null alternative (pydantic writes `X | None` as anyOf [X, null])."""
    for branch in prop.get("anyOf", []):
        if branch.get("type") != "null":
            return branch
    return prop


def _walk(node, visit) -> None:
    if isinstance(node, dict):
        visit(node)
        for value in node.values():
            _walk(value, visit)
    elif isinstance(node, list):
        for value in node:
            _walk(value, visit)


def with_limits(base: dict, servicer) -> dict:
    """The document as FastAPI writes it, plus what this server accepts: the served model, the request limits the
    servicer checks (gRPC's), the vocabulary; without a chat template, one user message; no 422 (a validation
    error is OpenAI's 400); the bearer scheme only where tokens are configured."""
    doc = copy.deepcopy(base)
    schemas = doc["components"]["schemas"]
    info = servicer.target_info
    limits = servicer.request_limits()  # orchestrator/api/limits.py: what a request is admitted within
    vocab_max = limits.vocab_size - 1

    def set_limits(model: str, field: str, **keywords) -> None:
        prop = schemas[model]["properties"][field]
        _value_branch(prop).update(keywords)

    for model in ("ChatCompletionRequest", "CompletionRequest"):
        set_limits(model, "model", enum=[info.model_name])
        set_limits(model, "max_tokens", maximum=limits.max_new_tokens)
        set_limits(model, "max_draft_len", maximum=limits.max_draft_len)
        set_limits(model, "stop_token_ids", maxItems=limits.max_stop_token_ids)
        stop = _value_branch(schemas[model]["properties"]["stop"])
        for branch in stop.get("anyOf", []):
            if branch.get("type") == "array":
                branch["maxItems"] = limits.max_stop_strings
    set_limits("ChatCompletionRequest", "max_completion_tokens", maximum=limits.max_new_tokens)
    for branch in schemas["CompletionRequest"]["properties"]["prompt"]["anyOf"]:
        ids = branch.get("items", {}) if branch.get("items", {}).get("type") == "array" else branch  # a batch of one
        if ids.get("items", {}).get("type") == "integer":
            ids["maxItems"] = limits.max_prompt_tokens
    if not getattr(servicer.tokenizer, "chat_template", None):
        set_limits("ChatCompletionRequest", "messages", maxItems=1)
        schemas["ChatMessage"]["properties"]["role"]["enum"] = ["user"]

    def visit(node: dict) -> None:
        if node.get("description") == "a token id of the target's vocabulary":
            node["maximum"] = vocab_max
        responses = node.get("responses")
        if isinstance(responses, dict):
            responses.pop("422", None)
            if not servicer.principals:
                node.pop("security", None)

    _walk(doc["paths"], visit)
    _walk(schemas, visit)
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    return doc
