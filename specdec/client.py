"""Python client of the orchestrator's public API."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Iterator, Sequence

import grpc

from specdec.core.grpc_util import make_channel
from specdec.v1 import orchestrator_pb2 as opb
from specdec.v1 import orchestrator_pb2_grpc

FINISH_REASONS = {v: k.removeprefix("FINISH_REASON_").lower() for k, v in opb.FinishReason.items()}


@dataclass
class GenerationResult:
    session_id: str
    text: str
    token_ids: list[int]
    finish_reason: str
    stats: dict = field(default_factory=dict)
    wall_s: float = 0.0
    ttft_s: float | None = None  # time to the first streamed tokens (prompt prefill + the first step)
    first_tokens: int = 0        # how many tokens that first chunk carried

    def to_json(self) -> dict:
        s = self.stats
        return {
            "session_id": self.session_id,
            "text": self.text,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            "acceptance_rate": s.get("acceptance_rate", 0.0),
            "mean_accepted_length": s.get("mean_accepted_length", 0.0),
            "verify_steps": s.get("verify_steps", 0),
            "fallback_steps": s.get("fallback_steps", 0),
            "tokens_per_second": s.get("tokens_per_second", 0.0),
            "client_tokens_per_second": len(self.token_ids) / self.wall_s if self.wall_s else 0.0,
            "ttft_s": self.ttft_s,
            "stats": s,
        }


def _stats_dict(stats: opb.GenerationStats) -> dict:
    from google.protobuf.json_format import MessageToDict

    d = MessageToDict(stats, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
    return {k: (int(v) if isinstance(v, str) and v.isdigit() else v) for k, v in d.items()}


class GenerationInterrupted(grpc.RpcError):
    """A Generate stream that failed after its session started (the orchestrator went away, the deadline passed):
    the session is kept, and `generate(resume_session_id=session_id, resume_from=resume_from)` goes on from the
    first token this stream did not deliver. code() and details() are the failed call's."""

    def __init__(self, error: grpc.RpcError, session_id: str, resume_from: int):
        self.error, self.session_id, self.resume_from = error, session_id, resume_from
        super().__init__(f"{self.code().name}: {self.details()} (session {session_id}, interrupted at token "
                         f"{resume_from})")

    def code(self) -> grpc.StatusCode:
        code = getattr(self.error, "code", None)
        return code() if callable(code) else grpc.StatusCode.UNKNOWN

    def details(self) -> str:
        details = getattr(self.error, "details", None)
        return (details() if callable(details) else None) or str(self.error)


_SPECULATION = {None: opb.SPECULATION_DEFAULT, True: opb.SPECULATION_ON, False: opb.SPECULATION_OFF}


@dataclass(frozen=True)
class GenerateOptions:
    """One generation's settings, each with the server's default (docs/api.md). `speculation`: None leaves it to
    the server, True or False asks for speculative or target-only decoding; `chat` applies the model's chat
    template; `resume_session_id` and `resume_from` go on with an interrupted session; `timeout_s` is the call's
    deadline (None: the client's)."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    stop: Sequence[str] = ()
    stop_token_ids: Sequence[int] = ()
    speculation: bool | None = None
    max_draft_len: int = 0
    ignore_eos: bool = False
    chat: bool = False
    resume_session_id: str = ""
    resume_from: int = 0
    timeout_s: float | None = None

    @classmethod
    def of(cls, options: GenerateOptions | None = None, **fields) -> GenerateOptions:
        """`options` (or the defaults) with `fields` replaced; an unknown field name is a TypeError."""
        return replace(options or cls(), **fields)

    def request(self, prompt: str | list[int] | None) -> opb.GenerateRequest:
        req = opb.GenerateRequest(
            max_new_tokens=self.max_new_tokens, temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
            seed=self.seed, stop=list(self.stop), stop_token_ids=list(self.stop_token_ids),
            max_draft_len=self.max_draft_len, ignore_eos=self.ignore_eos, apply_chat_template=self.chat,
            resume_session_id=self.resume_session_id, resume_from=self.resume_from,
            speculation=_SPECULATION[self.speculation])
        if isinstance(prompt, str):
            req.text = prompt
        elif prompt is not None:
            req.token_ids.ids.extend(prompt)
        return req


class SpecdecClient:
    def __init__(self, address: str = "127.0.0.1:50050", timeout_s: float = 600.0, token: str | None = None,
                 tls=None):
        self.address = address
        self.timeout_s = timeout_s
        self.metadata = [("authorization", f"Bearer {token}")] if token else []
        self.channel = make_channel(address, tls=tls)
        self.stub = orchestrator_pb2_grpc.OrchestratorStub(self.channel)

    def stream(self, prompt: str | list[int] | None = None, options: GenerateOptions | None = None,
               **fields) -> Iterator[opb.GenerateResponse]:
        """Start one Generate call and return its raw response iterator. The request's settings come as a
        `GenerateOptions`, as keywords (its field names), or both (the keywords win)."""
        options = GenerateOptions.of(options, **fields)
        return self.stub.Generate(options.request(prompt), timeout=options.timeout_s or self.timeout_s,
                                  metadata=self.metadata)

    def generate(self, prompt: str | list[int] | None = None, on_message=None, *,
                 options: GenerateOptions | None = None, **fields) -> GenerationResult:
        """Run one generation to its end; `on_message(msg)` sees each streamed message as it arrives. A stream that
        fails after the session started raises GenerationInterrupted, which says where to resume it; one that
        fails before raises the call's own grpc.RpcError. Any exception here (Ctrl-C too) cancels the call."""
        t0 = time.perf_counter()
        text, tokens, sid, finish, stats = [], [], "", "unspecified", {}
        ttft, first = None, 0
        options = GenerateOptions.of(options, **fields)
        next_token = options.resume_from if options.resume_session_id else 0
        stream = self.stream(prompt, options)
        done = False
        try:
            for msg in stream:
                sid = msg.session_id or sid
                text.append(msg.text)
                if ttft is None and msg.token_ids:
                    ttft, first = time.perf_counter() - t0, len(msg.token_ids)
                tokens.extend(msg.token_ids)
                if msg.token_ids:
                    next_token = msg.offset + len(msg.token_ids)
                if msg.HasField("stats"):
                    stats = _stats_dict(msg.stats)
                    finish = FINISH_REASONS.get(msg.finish_reason, "unspecified")
                if on_message is not None:
                    on_message(msg)
            done = True
        except grpc.RpcError as e:
            if sid:
                raise GenerationInterrupted(e, sid, next_token) from e
            raise
        finally:
            if not done:
                stream.cancel()  # the orchestrator stops and keeps the session resumable
        return GenerationResult(sid, "".join(text), tokens, finish, stats, time.perf_counter() - t0, ttft, first)

    def get_session(self, session_id: str, timeout_s: float = 10.0) -> opb.SessionInfo:
        return self.stub.GetSession(opb.GetSessionRequest(session_id=session_id), timeout=timeout_s,
                                    metadata=self.metadata)

    def cancel(self, session_id: str, timeout_s: float = 10.0) -> bool:
        return self.stub.CancelSession(opb.CancelSessionRequest(session_id=session_id), timeout=timeout_s,
                                       metadata=self.metadata).cancelled

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        grpc.channel_ready_future(self.channel).result(timeout=timeout_s)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
