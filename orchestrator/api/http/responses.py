"""The OpenAI response objects of a generation (schemas.py declares them): a whole completion, or its stream of
server-sent events. Built as plain dicts on the streaming path (a chunk per committed block)."""

from __future__ import annotations

import json
import time

from orchestrator.api.http.bridge import GenerateStream
from orchestrator.api.http.errors import ApiError
from specdec.v1 import orchestrator_pb2 as opb

EXTRA = "specdec"  # the one extra response field: session id and the request's speculative-decoding figures

FINISH = {opb.FINISH_REASON_LENGTH: "length", opb.FINISH_REASON_EOS: "stop", opb.FINISH_REASON_STOP: "stop",
          opb.FINISH_REASON_CANCELLED: "abort"}


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


def session_info(info: opb.SessionInfo) -> dict:
    return {"id": info.session_id, "object": "session", "status": info.status,
            "finish_reason": FINISH.get(info.finish_reason) if info.status != "running" else None,
            "text": info.text, "token_ids": list(info.generated_token_ids), "usage": usage(info.stats),
            EXTRA: {"session_id": info.session_id, **spec_decode_figures(info.stats)}}


class Shaper:
    """Builds the OpenAI response objects of one request (chat or text completion)."""

    def __init__(self, chat: bool, session_id: str, model: str, include_usage: bool = False):
        self.chat, self.model, self.sid, self.include_usage = chat, model, session_id, include_usage
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
              usage_: dict | None = None, choices: bool = True) -> str:
        obj = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
               "created": self.created, "model": self.model,
               "choices": [self._choice(text, finish, True, role)] if choices else []}
        obj["usage"] = usage_  # null but on the usage chunk (a chunk without usage reads as usage: null)
        obj[EXTRA] = {"session_id": self.sid, **extra}
        return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"

    def blocks(self, msgs: list[opb.GenerateResponse], role: bool = False) -> str:
        """Consecutive committed blocks as one chunk (the ones that arrived while the last was being sent)."""
        tokens = [t for m in msgs for t in m.token_ids]
        text = "".join(m.text for m in msgs)
        return self.chunk({"offset": msgs[0].offset, "token_ids": tokens}, text, role=role)

    def last(self, msg: opb.GenerateResponse) -> str:
        """The finish_reason chunk, then, when asked for, the usage chunk."""
        stats = spec_decode_figures(msg.stats)
        out = self.chunk(stats, None if self.chat else "", FINISH.get(msg.finish_reason, "stop"))
        if self.include_usage:
            out += self.chunk(stats, usage_=usage(msg.stats), choices=False)
        return out

    def whole(self, text: str, token_ids: list[int], final: opb.GenerateResponse) -> dict:
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model,
                "choices": [self._choice(text, FINISH.get(final.finish_reason, "stop"), False)],
                "usage": usage(final.stats),
                EXTRA: {"session_id": self.sid, "token_ids": token_ids, **spec_decode_figures(final.stats)}}


def _events(shaper: Shaper, msgs: list[opb.GenerateResponse]) -> str:
    out, run = [], []
    for msg in msgs:
        if msg.HasField("stats"):
            if run:
                out.append(shaper.blocks(run))
                run = []
            out.append(shaper.last(msg))
        else:
            run.append(msg)
    if run:
        out.append(shaper.blocks(run))
    return "".join(out)


async def sse(stream: GenerateStream, first: opb.GenerateResponse, shaper: Shaper):
    """The stream's server-sent events: every message that arrived while the last write was under way goes out
    in one write (blocks merged into one chunk), so a slow reader costs fewer, larger writes, not more."""
    try:
        if shaper.chat:
            yield shaper.blocks([first], role=True)  # a chat stream opens with the assistant's role
        elif first.token_ids or first.text:
            yield shaper.blocks([first])
        try:
            while msgs := await stream.batch():
                yield _events(shaper, msgs)
        except ApiError as e:  # after the headers: the error as the stream's last event (as vLLM does)
            yield f"data: {json.dumps(e.body())}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        stream.cancel()  # the client went away (the task was cancelled) or the stream ended


async def whole(stream: GenerateStream, first: opb.GenerateResponse, shaper: Shaper) -> dict:
    text, tokens, final = [first.text], list(first.token_ids), first
    while msgs := await stream.batch():
        for msg in msgs:
            text.append(msg.text)
            tokens.extend(msg.token_ids)
            final = msg
    return shaper.whole("".join(text), tokens, final)
