"""The OpenAI-compatible HTTP API, driven by the official `openai` client against a real orchestrator, tiny-model
target and draft services and a real Redis: same outputs as the gRPC path, OpenAI's shapes and errors, streaming,
disconnects, durable sessions."""

import asyncio
import json
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import httpx2 as httpx
import openai
import pytest

from orchestrator.api.http import SESSION_HEADER, HttpServer
from orchestrator.api.server import principal_of
from orchestrator.store.session_store import open_store
from tests.harness import DRAFT_EARLY, TARGET, start_stack

PROMPT_IDS = [1, 5, 9, 12, 5, 9]
PROMPT_TEXT = "t1 t5 t9 t12 t5 t9"  # the tiny tokenizer's spelling of PROMPT_IDS
GREEDY = {"ignore_eos": True}


@pytest.fixture(scope="module")
def stack(redis_url):
    s = start_stack(redis_url, draft=DRAFT_EARLY)
    s.http = HttpServer("127.0.0.1:0").start(s.servicer)
    yield s
    s.http.stop()
    s.stop()


@pytest.fixture
def client(stack):
    return openai.OpenAI(base_url=stack.http.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def wait_finished(stack, sid, timeout=10.0):
    deadline = time.monotonic() + timeout
    while stack.client.get_session(sid).status == "running" and time.monotonic() < deadline:
        time.sleep(0.05)
    return stack.client.get_session(sid)


def wait_recorded(stack, sid, timeout=10.0):
    deadline = time.monotonic() + timeout
    while True:
        try:
            return stack.client.get_session(sid)
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.NOT_FOUND or time.monotonic() > deadline:
                raise
            time.sleep(0.01)


# -- outputs equal the gRPC path's ------------------------------------------------------------------------------

def test_greedy_completion_equals_grpc_and_target_only(stack, client):
    target_only = stack.client.generate(PROMPT_IDS, max_new_tokens=40, ignore_eos=True, speculation=False)
    grpc_spec = stack.client.generate(PROMPT_IDS, max_new_tokens=40, ignore_eos=True, max_draft_len=4)
    out = client.completions.create(model=TARGET, prompt=PROMPT_IDS, max_tokens=40, temperature=0,
                                    extra_body=GREEDY)
    extra = out.model_extra["specdec"]
    assert extra["token_ids"] == grpc_spec.token_ids == target_only.token_ids
    assert out.choices[0].text == grpc_spec.text and out.choices[0].finish_reason == "length"
    assert out.object == "text_completion" and out.id == f"cmpl-{extra['session_id']}"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (6, 40, 46)
    # The speculative-decoding figures, vLLM's names: this draft is the target's first layer, partly accepted.
    assert extra["num_drafts"] > 0 and 0 < extra["num_accepted_tokens"] <= extra["num_draft_tokens"]
    assert extra["draft_acceptance_rate"] == pytest.approx(extra["num_accepted_tokens"] / extra["num_draft_tokens"])
    assert extra["mean_acceptance_length"] > 1 and extra["fallback_steps"] == 0
    # A text prompt is tokenized as gRPC's text prompt is.
    text = client.completions.create(model=TARGET, prompt=PROMPT_TEXT, max_tokens=40, temperature=0,
                                     extra_body=GREEDY)
    assert text.choices[0].text == out.choices[0].text


def test_chat_applies_the_template_as_grpc_does(stack, client):
    grpc_chat = stack.client.generate(PROMPT_TEXT, chat=True, max_new_tokens=20, ignore_eos=True)
    out = client.chat.completions.create(model=TARGET, messages=[{"role": "user", "content": PROMPT_TEXT}],
                                         max_tokens=20, temperature=0, extra_body=GREEDY)
    assert out.choices[0].message.content == grpc_chat.text and out.choices[0].message.role == "assistant"
    assert out.object == "chat.completion" and out.usage.completion_tokens == 20
    # Several messages need the model's chat template: without one, a 400 that says so.
    with pytest.raises(openai.BadRequestError, match="no chat template"):
        client.chat.completions.create(model=TARGET, max_tokens=5, messages=[
            {"role": "system", "content": "t3"}, {"role": "user", "content": PROMPT_TEXT}])
    tok = stack.servicer.tokenizer
    tok.chat_template = ("{% for m in messages %}{{ 't' ~ (m['content'] | length) ~ ' ' ~ m['content'] ~ ' ' }}"
                         "{% endfor %}{% if add_generation_prompt %}t2{% endif %}")
    try:
        messages = [{"role": "system", "content": "t3"}, {"role": "user", "content": PROMPT_TEXT},
                    {"role": "assistant", "content": "t7"}, {"role": "user", "content": "t8"}]
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        out = client.chat.completions.create(model=TARGET, messages=messages, max_completion_tokens=15,
                                             temperature=0, extra_body=GREEDY)
        reference = stack.client.generate(ids, max_new_tokens=15, ignore_eos=True)
        assert out.usage.prompt_tokens == len(ids) and out.choices[0].message.content == reference.text
    finally:
        tok.chat_template = None


def test_a_seeded_sample_is_the_same_over_http_and_grpc(stack, client):
    grpc_text = stack.client.generate(PROMPT_IDS, max_new_tokens=30, ignore_eos=True, temperature=0.9, top_p=0.95,
                                      top_k=40, seed=1234).text
    http = [client.completions.create(model=TARGET, prompt=PROMPT_IDS, max_tokens=30, temperature=0.9, top_p=0.95,
                                      seed=1234, extra_body={"top_k": 40, **GREEDY}).choices[0].text
            for _ in range(2)]
    assert http == [grpc_text, grpc_text]
    other = client.completions.create(model=TARGET, prompt=PROMPT_IDS, max_tokens=30, temperature=0.9, top_p=0.95,
                                      seed=99, extra_body={"top_k": 40, **GREEDY}).choices[0].text
    assert other != grpc_text


def test_stop_strings_and_stop_token_ids(stack, client):
    full = stack.client.generate(PROMPT_IDS, max_new_tokens=30, ignore_eos=True, speculation=False)
    words = full.text.split()
    stop = " ".join(words[5:7])
    out = client.completions.create(model=TARGET, prompt=PROMPT_IDS, max_tokens=30, temperature=0,
                                    stop=[stop, "never-there"], extra_body=GREEDY)
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].text == full.text[: full.text.index(stop)]
    single = client.completions.create(model=TARGET, prompt=PROMPT_IDS, max_tokens=30, temperature=0, stop=stop,
                                       extra_body=GREEDY)
    assert single.choices[0].text == out.choices[0].text
    stop_id = full.token_ids[4]
    by_id = client.completions.create(model=TARGET, prompt=PROMPT_IDS, max_tokens=30, temperature=0,
                                      extra_body={"stop_token_ids": [stop_id], **GREEDY})
    assert by_id.model_extra["specdec"]["token_ids"] == full.token_ids[: full.token_ids.index(stop_id) + 1]
    assert by_id.choices[0].finish_reason == "stop"


def test_speculation_control_per_request(stack, client):
    off = client.completions.create(model=TARGET, prompt=PROMPT_IDS, max_tokens=20, temperature=0,
                                    extra_body={"speculation": False, **GREEDY})
    assert off.model_extra["specdec"]["num_drafts"] == 0
    short = client.completions.create(model=TARGET, prompt=PROMPT_IDS, max_tokens=20, temperature=0,
                                      extra_body={"max_draft_len": 1, **GREEDY})
    extra = short.model_extra["specdec"]
    assert extra["num_draft_tokens"] <= extra["num_drafts"]  # at most one drafted token per step
    assert short.choices[0].text == off.choices[0].text


# -- streaming --------------------------------------------------------------------------------------------------

def test_streaming_chat_deltas_add_up_and_usage_comes_last(stack, client):
    whole = client.chat.completions.create(model=TARGET, messages=[{"role": "user", "content": PROMPT_TEXT}],
                                           max_tokens=25, temperature=0, extra_body=GREEDY)
    raw = client.chat.completions.with_raw_response.create(
        model=TARGET, messages=[{"role": "user", "content": PROMPT_TEXT}], max_tokens=25, temperature=0,
        stream=True, stream_options={"include_usage": True}, extra_body=GREEDY)
    sid = raw.headers[SESSION_HEADER]
    chunks = list(raw.parse())
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.id == f"chatcmpl-{sid}" and c.object == "chat.completion.chunk" for c in chunks)
    assert all(c.model_extra["specdec"]["session_id"] == sid for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    tokens = [t for c in chunks if c.choices for t in c.model_extra["specdec"].get("token_ids", [])]
    assert len(tokens) == 25
    finish = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finish) == 1 and finish[0].choices[0].finish_reason == "length"
    assert finish[0].model_extra["specdec"]["num_drafts"] > 0
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == 25 and last.usage.total_tokens == 25 + \
        last.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_streaming_completion_without_usage(stack, client):
    chunks = list(client.completions.create(model=TARGET, prompt=PROMPT_IDS, max_tokens=12, temperature=0,
                                            stream=True, extra_body=GREEDY))
    ref = client.completions.create(model=TARGET, prompt=PROMPT_IDS, max_tokens=12, temperature=0,
                                    extra_body=GREEDY)
    assert "".join(c.choices[0].text for c in chunks) == ref.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length" and all(c.usage is None for c in chunks)


def test_the_sse_wire_format(stack):
    with httpx.Client(timeout=60) as http:
        r = http.post(stack.http.url + "/v1/completions", json={
            "model": TARGET, "prompt": PROMPT_IDS, "max_tokens": 8, "temperature": 0, "stream": True,
            "ignore_eos": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [e for e in r.text.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    assert all("choices" in json.loads(e[6:]) for e in events[:-1])


def test_eight_concurrent_streams_with_the_async_client(stack):
    prompts = [[1 + i, 5, 9, 12 + i, 5] for i in range(8)]
    references = [stack.client.generate(p, max_new_tokens=20, ignore_eos=True, speculation=False).text
                  for p in prompts]

    async def one(aclient, prompt):
        stream = await aclient.chat.completions.create(
            model=TARGET, messages=[{"role": "user", "content": " ".join(f"t{t}" for t in prompt)}],
            max_tokens=20, temperature=0, stream=True, extra_body=GREEDY)
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    async def main():
        async with openai.AsyncOpenAI(base_url=stack.http.url + "/v1", api_key="x", max_retries=0,
                                      timeout=120) as aclient:
            return await asyncio.gather(*(one(aclient, p) for p in prompts))

    assert asyncio.run(main()) == references


# -- errors through the client's own exception classes ---------------------------------------------------------

def test_invalid_requests_are_400_naming_the_parameter(client):
    cases = [
        (dict(logprobs=True), "logprobs"), (dict(presence_penalty=0.5), "presence_penalty"),
        (dict(n=2), "n"), (dict(temperature=-1), "temperature"), (dict(top_p=1.5), "top_p"),
        (dict(tools=[{"type": "function", "function": {"name": "f"}}]), "tools"),
        (dict(extra_body={"guided_json": {}}), "guided_json"), (dict(max_tokens=0), "max_tokens"),
        (dict(stop=[""]), "stop"),
    ]
    for kwargs, param in cases:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=TARGET, messages=[{"role": "user", "content": "t1"}], **kwargs)
        assert e.value.param == param and param in e.value.message, (kwargs, e.value.body)
        assert e.value.body["type"] == "invalid_request_error"
    # Neutral values of unsupported parameters are accepted: nothing is ignored that would change the output.
    ok = client.chat.completions.create(model=TARGET, messages=[{"role": "user", "content": "t1"}], max_tokens=2,
                                        presence_penalty=0, frequency_penalty=0, logprobs=False, n=1, user="me")
    assert ok.choices[0].message.content is not None
    with pytest.raises(openai.BadRequestError, match="max_new_tokens .* exceeds"):  # the servicer's own check
        client.completions.create(model=TARGET, prompt=PROMPT_IDS, max_tokens=100000)
    with pytest.raises(openai.BadRequestError, match="outside the vocabulary"):
        client.completions.create(model=TARGET, prompt=[1, 5, 100000], max_tokens=3)
    r = httpx.post(str(client.base_url.join("completions")), content=b"{", timeout=30)
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4o", prompt="t1", max_tokens=2)
    assert e.value.code == "model_not_found" and "gpt-4o" in e.value.message
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")
    assert client.models.retrieve(TARGET).id == TARGET


def test_bearer_tokens_are_the_grpc_ones(stack, client, monkeypatch):
    monkeypatch.setattr(stack.servicer, "principals", {principal_of("s3cret"): "s3cret"})
    for bad in ("unused", "wrong"):
        with pytest.raises(openai.AuthenticationError):
            client.with_options(api_key=bad).completions.create(model=TARGET, prompt="t1", max_tokens=2)
    with pytest.raises(openai.AuthenticationError):
        client.models.list()
    good = client.with_options(api_key="s3cret")
    out = good.completions.create(model=TARGET, prompt=PROMPT_IDS, max_tokens=3)
    assert good.models.list().data[0].id == TARGET
    # A session belongs to its token's principal: another token is told it does not exist.
    sid = out.model_extra["specdec"]["session_id"]
    r = httpx.get(f"{stack.http.url}/v1/sessions/{sid}", headers={"Authorization": "Bearer s3cret"}, timeout=30)
    assert r.status_code == 200 and r.json()["status"] == "finished"
    monkeypatch.setattr(stack.servicer, "principals", {principal_of("s3cret"): "s3cret",
                                                       principal_of("other"): "other"})
    r = httpx.get(f"{stack.http.url}/v1/sessions/{sid}", headers={"Authorization": "Bearer other"}, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


def test_too_many_sessions_is_429(stack, client, monkeypatch):
    monkeypatch.setattr(stack.servicer, "max_active_sessions", 0)
    with pytest.raises(openai.RateLimitError, match="sessions are generating"):
        client.completions.create(model=TARGET, prompt=PROMPT_IDS, max_tokens=3)
    with pytest.raises(openai.RateLimitError):
        list(client.completions.create(model=TARGET, prompt=PROMPT_IDS, max_tokens=3, stream=True))


def test_store_unavailable_is_503_and_health_says_so(stack, client, monkeypatch):
    assert httpx.get(stack.http.url + "/health", timeout=30).status_code == 200
    dead = open_store("redis://127.0.0.1:1/0")
    monkeypatch.setattr(stack.servicer, "store", dead)
    with pytest.raises(openai.InternalServerError) as e:
        client.completions.create(model=TARGET, prompt=PROMPT_IDS, max_tokens=3)
    assert e.value.status_code == 503 and "unavailable" in e.value.message
    health = httpx.get(stack.http.url + "/health", timeout=30)
    assert health.status_code == 503 and health.json()["store"].startswith("unavailable")


def test_an_unexpected_failure_is_500(stack, client, monkeypatch):
    def broken(request):
        raise RuntimeError("boom")

    monkeypatch.setattr(stack.servicer, "_new_record", broken)
    with pytest.raises(openai.InternalServerError) as e:
        client.completions.create(model=TARGET, prompt=PROMPT_IDS, max_tokens=3)
    assert e.value.status_code == 500 and "boom" in e.value.message and e.value.body["type"] == "server_error"


# -- disconnects and durable sessions --------------------------------------------------------------------------

def test_a_client_that_disconnects_cancels_and_frees_the_caches(stack, client):
    stream = client.completions.create(model=TARGET, prompt=PROMPT_IDS, max_tokens=400, temperature=0, stream=True,
                                       extra_body=GREEDY)
    seen = 0
    for chunk in stream:
        sid = chunk.model_extra["specdec"]["session_id"]
        seen += len(chunk.model_extra["specdec"].get("token_ids", []))
        if seen >= 3:
            break
    stream.close()
    info = wait_finished(stack, sid)
    assert info.status == "cancelled" and len(info.generated_token_ids) < 400
    deadline = time.monotonic() + 10
    while (sid in stack.target_engine.store or sid in stack.proposer.store) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sid not in stack.target_engine.store and sid not in stack.proposer.store


def test_a_dropped_stream_resumes_from_token_n(stack, client):
    stream = client.chat.completions.with_raw_response.create(
        model=TARGET, messages=[{"role": "user", "content": PROMPT_TEXT}], max_tokens=60, temperature=0,
        stream=True, extra_body=GREEDY)
    sid = stream.headers[SESSION_HEADER]
    chat_ref = stack.client.generate(PROMPT_TEXT, chat=True, max_new_tokens=60, ignore_eos=True, speculation=False)
    seen, text = [], ""
    chunks = stream.parse()
    for chunk in chunks:
        seen += chunk.model_extra["specdec"].get("token_ids", [])
        text += chunk.choices[0].delta.content or ""
        if len(seen) >= 5:
            break
    chunks.close()
    assert wait_finished(stack, sid).status == "cancelled"
    with httpx.Client(timeout=60) as http:
        r = http.post(f"{stack.http.url}/v1/sessions/{sid}/resume", json={"resume_from": len(seen)})
        assert r.status_code == 200 and r.headers[SESSION_HEADER] == sid
        events = [json.loads(e[6:]) for e in r.text.split("\n\n") if e.startswith("data: {")]
        rest = [t for e in events for t in e["specdec"].get("token_ids", [])]
        text += "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
        assert seen + rest == chat_ref.token_ids and text == chat_ref.text
        assert events[0]["specdec"]["offset"] == len(seen)
        # Not streamed: the rest in one response; the session's state by GET.
        whole = http.post(f"{stack.http.url}/v1/sessions/{sid}/resume",
                          json={"resume_from": 10, "stream": False, "object": "text_completion"}).json()
        assert whole["specdec"]["token_ids"] == chat_ref.token_ids[10:] and whole["object"] == "text_completion"
        info = http.get(f"{stack.http.url}/v1/sessions/{sid}").json()
        assert info["status"] == "finished" and info["token_ids"] == chat_ref.token_ids
        assert info["finish_reason"] == "length" and info["usage"]["completion_tokens"] == 60
        bad = http.post(f"{stack.http.url}/v1/sessions/{sid}/resume", json={"resume_from": 61})
        assert bad.status_code == 400 and "past the 60 generated tokens" in bad.json()["error"]["message"]
        missing = http.post(f"{stack.http.url}/v1/sessions/nope/resume", json={})
        assert missing.status_code == 404


def test_a_session_resumes_on_a_restarted_orchestrator(stack, redis_url):
    """The session lives in Redis: a new orchestrator (servicer + HTTP server) on the same store goes on with it."""
    from orchestrator.api.server import Connections, OrchestratorServicer

    reference = stack.client.generate(PROMPT_IDS, max_new_tokens=30, ignore_eos=True, speculation=False)
    first = httpx.post(stack.http.url + "/v1/completions", json={
        "model": TARGET, "prompt": PROMPT_IDS, "max_tokens": 30, "temperature": 0, "ignore_eos": True,
        "stream": False}, timeout=60).json()
    sid = first["specdec"]["session_id"]
    s = stack.servicer
    fresh = OrchestratorServicer(s.settings, Connections(s.target, s.pool, open_store(redis_url), s.tokenizer,
                                                         s.target_info))
    other = HttpServer("127.0.0.1:0").start(fresh)
    try:
        r = httpx.post(f"{other.url}/v1/sessions/{sid}/resume",
                       json={"resume_from": 12, "stream": False, "object": "text_completion"}, timeout=60)
        assert r.json()["specdec"]["token_ids"] == reference.token_ids[12:]
    finally:
        other.stop()
        fresh.close()


# -- models, health, metrics ------------------------------------------------------------------------------------

def test_models_health_and_metrics(stack, client):
    models = client.models.list().data
    assert [m.id for m in models] == [TARGET]
    drafts = models[0].model_extra["specdec"]["drafts"]
    assert drafts[0]["model"] == DRAFT_EARLY and drafts[0]["address"] == stack.draft_server.address
    health = httpx.get(stack.http.url + "/health", timeout=30)
    assert health.status_code == 200 and health.json() == {"status": "ok", "target": "ok", "store": "ok"}
    client.completions.create(model=TARGET, prompt=PROMPT_IDS, max_tokens=4)
    metrics = httpx.get(stack.http.url + "/metrics", timeout=30)
    assert metrics.status_code == 200 and "text/plain" in metrics.headers["content-type"]
    assert re.search(r"^specdec_\w+", metrics.text, re.M)


def test_health_is_503_when_the_target_is_unreachable(stack, monkeypatch):
    from orchestrator.replicas.clients import TargetClient

    monkeypatch.setattr(stack.servicer, "target", TargetClient("127.0.0.1:1"))
    health = httpx.get(stack.http.url + "/health", timeout=30)
    assert health.status_code == 503 and health.json()["target"].startswith("unavailable")


def test_unknown_routes_answer_in_openai_shape(stack):
    r = httpx.get(stack.http.url + "/v1/nothing", timeout=30)
    assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}


# -- the documented examples ------------------------------------------------------------------------------------

ROOT = Path(__file__).resolve().parents[1]


def _doc_blocks(path: Path, lang: str) -> list[str]:
    return re.findall(rf"<!-- readme -->\n```{lang}\n(.*?)```", path.read_text(), re.S)


@pytest.mark.parametrize("doc", ["docs/http.md", "README.md"])
def test_the_readme_snippet_runs_against_a_server(stack, doc):
    """The README snippet (curl and the openai client; its source is docs/http.md, the blocks marked
    `<!-- readme -->`), pointed at this test's server and model."""
    curls, pythons = _doc_blocks(ROOT / doc, "sh"), _doc_blocks(ROOT / doc, "python")
    if doc == "docs/http.md":
        assert len(curls) == len(pythons) == 1
    port = stack.http.url.rsplit(":", 1)[1]

    def local(text):
        return text.replace("localhost:8000", f"127.0.0.1:{port}").replace('"smollm2"', json.dumps(TARGET))

    for curl in curls:
        out = subprocess.run(["bash", "-c", local(curl)], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        reply = json.loads(out.stdout)
        assert reply["object"] == "chat.completion" and reply["choices"][0]["message"]["role"] == "assistant"
    for python in pythons:
        out = subprocess.run([sys.executable, "-c", local(python)], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0 and out.stdout.strip(), out.stderr


def test_specdec_up_serves_it_and_prints_its_url(tmp_path):
    """`specdec up --http-port 0`: the JSON line names the HTTP API ("http"), which answers for the target."""
    import signal

    proc = subprocess.Popen([sys.executable, "-m", "launcher.cli", "up", "--port", "0", "--http-port", "0",
                             "--metrics-base-port", "0", "--target-model", TARGET, "--draft-strategy", "ngram",
                             "--log-dir", str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = json.loads(proc.stdout.readline())
        url = line["http"]
        assert re.fullmatch(r"http://127\.0\.0\.1:\d+", url) and not url.endswith(":0")
        assert httpx.get(url + "/health", timeout=30).status_code == 200
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
        out = client.completions.create(model=TARGET, prompt=PROMPT_IDS, max_tokens=5, temperature=0)
        assert out.usage.completion_tokens >= 1 and out.model_extra["specdec"]["session_id"]
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.communicate(timeout=60)
        finally:
            proc.kill()



def test_run_serves_no_http_api_and_up_defaults_to_8000():
    from launcher import cli
    from launcher.stack import StackConfig

    assert StackConfig().http_port is None  # `specdec run` and library stacks: unchanged, no HTTP API
    assert cli.build_parser().parse_args(["up"]).http_port == 8000


def test_the_benchmark_compares_http_with_grpc_on_the_same_requests(stack):
    from bench.http_bench import markdown_lines, measure

    jobs = [("a", PROMPT_IDS), ("b", [2, 7, 9, 11])]
    res = measure(stack.orchestrator_server.address, stack.http.url, jobs, max_new=12, rounds=1, draft_len=3,
                  warmup_tokens=2)
    assert res["same_tokens"] and res["grpc"]["requests"] == res["http"]["requests"] == 2
    assert res["http_grpc_ratio"] == pytest.approx(res["http"]["tokens_per_s"] / res["grpc"]["tokens_per_s"])
    assert res["ttft_ms"]["http"] > 0 and res["ttft_ms"]["grpc"] > 0 and res["http_grpc_ratio_paired_median"] > 0
    res["config"] = "orch"
    assert any("HTTP / gRPC tokens/s" in line for line in markdown_lines({"http": res}))


class _RecordingSessions(dict):
    """The servicer's active-session table that remembers every id admitted (a poll can miss a short-lived one)."""

    def __init__(self, *args):
        super().__init__(*args)
        self.admitted = []
        self.first_admitted = threading.Event()

    def __setitem__(self, sid, value):
        self.admitted.append(sid)
        super().__setitem__(sid, value)
        self.first_admitted.set()


def test_a_non_streamed_request_whose_client_leaves_is_cancelled(stack, monkeypatch):
    """The client hangs up while the whole completion is still being generated: cancelled, freed."""
    sessions = _RecordingSessions(stack.servicer._active)
    monkeypatch.setattr(stack.servicer, "_active", sessions)
    body = json.dumps({"model": TARGET, "prompt": PROMPT_IDS, "max_tokens": 500, "temperature": 0,
                       "ignore_eos": True, "speculation": False}).encode()
    host, port = stack.http.url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as conn:
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body) + body)
        assert sessions.first_admitted.wait(10), "the request was never admitted"
        sid, = sessions.admitted
        wait_recorded(stack, sid)  # hang up once the session is stored (admitted first, stored just after)
    info = wait_finished(stack, sid)
    assert info.status == "cancelled" and len(info.generated_token_ids) < 500


def test_resuming_a_session_that_is_streaming_is_409(stack, client):
    stream = client.completions.create(model=TARGET, prompt=PROMPT_IDS, max_tokens=400, temperature=0, stream=True,
                                       extra_body=GREEDY)
    sid = next(iter(stream)).model_extra["specdec"]["session_id"]
    try:
        with pytest.raises(openai.ConflictError, match="already streaming"):
            client.post(f"/sessions/{sid}/resume", body={"resume_from": 0, "stream": False}, cast_to=object)
        cancelled = client.delete(f"/sessions/{sid}", cast_to=object)
        assert cancelled == {"id": sid, "object": "session", "cancelled": True}
        assert wait_finished(stack, sid).status == "cancelled"
    finally:
        stream.close()
