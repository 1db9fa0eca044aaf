"""The HTTP API against its own OpenAPI document: schemathesis (every check it has: status codes, content types,
headers, response schemas, schema-valid requests accepted, schema-violating ones rejected, unsupported methods
with their Allow header, auth ignored nowhere, ...) against a live stack (tiny models, real Redis, a bearer token,
a chat template), with a bounded number of examples."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import httpx2 as httpx
import pytest

from orchestrator.api.http import HttpServer
from orchestrator.api.server import principal_of
from tests.harness import DRAFT_EARLY, TARGET, start_stack

TOKEN = "schema-token"
MAX_NEW = 4  # short generations
# Resuming from a token the session has not reached is a 400 that depends on the session's state, not on the
# request's shape: the one schema-valid request the server may refuse, on that route only.
CONFIG = """
[[operations]]
include-path = "/v1/sessions/{session_id}/resume"
checks.positive_data_acceptance.expected-statuses = ["2xx", "400", "401", "403", "404", "409", "429"]
"""


@pytest.fixture(scope="module")
def live(redis_url):
    s = start_stack(redis_url, draft=DRAFT_EARLY, max_new_tokens_limit=MAX_NEW)
    # Prompt and completion always fit the context, as the document's limits say (JSON Schema cannot add them up).
    limits = s.servicer.request_limits()
    s.servicer.request_limits = lambda: dataclasses.replace(limits, max_prompt_tokens=limits.max_context - MAX_NEW)
    s.servicer.principals = {principal_of(TOKEN): TOKEN}
    s.servicer.tokenizer.chat_template = ("{% for m in messages %}{{ m['content'] }} {% endfor %}"
                                          "{% if add_generation_prompt %}t2{% endif %}")
    http = HttpServer("127.0.0.1:0").start(s.servicer)
    yield http
    http.stop()
    s.servicer.tokenizer.chat_template = None
    s.stop()


def test_the_document_declares_the_servers_limits_and_errors(live):
    doc = httpx.get(live.url + "/openapi.json", timeout=30).json()
    schemas = doc["components"]["schemas"]
    chat = schemas["ChatCompletionRequest"]["properties"]
    assert chat["model"]["enum"] == [TARGET]
    assert {"type": "integer", "minimum": 1, "maximum": MAX_NEW}.items() <= chat["max_tokens"]["anyOf"][0].items()
    assert "additionalProperties" in schemas["ChatCompletionRequest"]  # unknown parameters are refused
    ops = doc["paths"]["/v1/chat/completions"]["post"]
    assert {"200", "400", "401", "404", "429", "500", "503"} <= set(ops["responses"]) and "422" not in ops["responses"]
    assert ops["security"] == [{"HTTPBearer": []}]
    metrics = doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert list(metrics) == [httpx.get(live.url + "/metrics", timeout=30).headers["content-type"]]
    r = httpx.put(live.url + "/v1/sessions/x", timeout=30)
    assert r.status_code == 405 and r.headers["allow"] == "DELETE, GET" and r.json()["error"]["type"]


def test_schemathesis_finds_nothing(live, tmp_path):
    config = tmp_path / "schemathesis.toml"
    config.write_text(CONFIG)
    cmd = [sys.executable, "-m", "schemathesis.cli", "--config-file", str(config), "run",
           f"{live.url}/openapi.json", "--checks", "all", "--header", f"Authorization: Bearer {TOKEN}",
           "--max-examples", "4", "--workers", "1", "--request-timeout", "30", "--seed", "7",
           "--suppress-health-check", "too_slow"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]
