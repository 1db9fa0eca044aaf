"""An OpenAI request body (schemas.py) as the gRPC GenerateRequest that means the same: a field-for-field copy.
Everything the server limits (max_tokens, max_draft_len, stop lists, token ids, the context) is checked by the
servicer's own validation when Generate runs, exactly as for a gRPC call."""

from __future__ import annotations

from orchestrator.api.http.errors import bad_request
from orchestrator.api.http.schemas import ChatCompletionRequest, CompletionRequest, GenerationFields
from orchestrator.api.prompts import chat_prompt_ids
from specdec.v1 import orchestrator_pb2 as opb

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's legacy completions default
SPECULATION = {True: opb.SPECULATION_ON, "on": opb.SPECULATION_ON, False: opb.SPECULATION_OFF,
               "off": opb.SPECULATION_OFF}


def _common(body: GenerationFields) -> opb.GenerateRequest:
    stop = [body.stop] if isinstance(body.stop, str) else (body.stop or [])
    return opb.GenerateRequest(
        temperature=1.0 if body.temperature is None else body.temperature, top_p=body.top_p or 1.0,
        top_k=max(0, body.top_k or 0),  # -1: vLLM's "no top-k"
        seed=(body.seed or 0) % 2**64, ignore_eos=bool(body.ignore_eos), max_draft_len=body.max_draft_len or 0,
        stop=stop, stop_token_ids=body.stop_token_ids or [],
        speculation=SPECULATION.get(body.speculation, opb.SPECULATION_DEFAULT))


def chat_request(servicer, body: ChatCompletionRequest) -> opb.GenerateRequest:
    if servicer.tokenizer is None:
        raise bad_request("this orchestrator has no tokenizer: use /v1/completions with token ids", "messages")
    messages = [{"role": "system" if m.role == "developer" else m.role,
                 "content": m.content if isinstance(m.content, str) else "".join(p.text for p in m.content)}
                for m in body.messages]
    try:
        ids = chat_prompt_ids(servicer.tokenizer, messages)
    except ValueError as e:
        raise bad_request(str(e), "messages") from None
    req = _common(body)
    req.token_ids.ids.extend(ids)
    max_tokens = body.max_completion_tokens or body.max_tokens  # one of them at most
    if max_tokens is None:  # OpenAI: up to the context; here also up to the server's per-request limit
        limits = servicer.request_limits()
        max_tokens = max(1, min(limits.max_new_tokens, limits.max_context - len(ids)))
    req.max_new_tokens = max_tokens
    return req


def completion_request(servicer, body: CompletionRequest) -> opb.GenerateRequest:
    req = _common(body)
    prompt = body.prompt
    if isinstance(prompt, list) and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        req.text = prompt
    else:
        req.token_ids.ids.extend(prompt)
    # OpenAI's default, within what this server allows a request
    default = min(COMPLETIONS_DEFAULT_MAX_TOKENS, servicer.request_limits().max_new_tokens)
    req.max_new_tokens = body.max_tokens or default
    return req


def resume_request(session_id: str, resume_from: int) -> opb.GenerateRequest:
    return opb.GenerateRequest(resume_session_id=session_id, resume_from=resume_from)
