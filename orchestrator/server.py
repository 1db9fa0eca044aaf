"""The public gRPC API: `specdec serve orchestrator`."""

from __future__ import annotations

import argparse
import logging
import math
import secrets
import threading

import grpc

from orchestrator.clients import DraftClient, TargetClient
from orchestrator.generation import AcceptanceWindow, Chunk, DraftHealth, Generation, GenerationError, LoopConfig, stats_message
from orchestrator.session_store import SessionRecord, StoreUnavailable, open_store
from specdec import telemetry
from specdec.grpc_util import RpcAbort, ServiceServer, handle_errors
from specdec.v1 import orchestrator_pb2 as opb
from specdec.v1 import orchestrator_pb2_grpc

log = logging.getLogger("specdec.orchestrator")


class IncompatibleModels(Exception):
    pass


def check_compatible(target_info, draft_info) -> None:
    """Refuse a draft whose tokenizer differs from the target's: its token ids would mean other words."""
    if draft_info.strategy == "ngram" and not draft_info.tokenizer_fingerprint:
        return  # model-free drafter: copies token ids from the context, any tokenizer works
    if draft_info.tokenizer_fingerprint != target_info.tokenizer_fingerprint:
        raise IncompatibleModels(
            f"draft {draft_info.model_name!r} and target {target_info.model_name!r} use different tokenizers "
            f"(fingerprints {draft_info.tokenizer_fingerprint[:12]} vs {target_info.tokenizer_fingerprint[:12]}); "
            "a draft must share the target's tokenizer"
        )
    if draft_info.vocab_size and draft_info.vocab_size != target_info.vocab_size:
        raise IncompatibleModels(
            f"draft vocabulary ({draft_info.vocab_size}) differs from the target's ({target_info.vocab_size})"
        )


class OrchestratorServicer(orchestrator_pb2_grpc.OrchestratorServicer):
    def __init__(self, target: TargetClient, draft: DraftClient | None, store, tokenizer, target_info,
                 cfg: LoopConfig, max_new_tokens_limit: int = 2048, max_prompt_tokens: int | None = None,
                 max_stop_strings: int = 16):
        self.target = target
        self.draft = draft
        self.store = store
        self.tokenizer = tokenizer
        self.target_info = target_info
        self.cfg = cfg
        self.max_new_tokens_limit = max_new_tokens_limit
        self.max_prompt_tokens = max_prompt_tokens or target_info.max_context
        self.max_stop_strings = max_stop_strings
        self.eos_ids = set(target_info.eos_token_ids)
        self.vocab_size = target_info.vocab_size
        self.draft_health = DraftHealth(cfg.draft_retry_after_s)
        self.window = AcceptanceWindow()
        self._active: dict[str, threading.Event] = {}
        self._active_lock = threading.Lock()

    # -- validation -----------------------------------------------------------------------------

    def _bad(self, message: str) -> RpcAbort:
        return RpcAbort(grpc.StatusCode.INVALID_ARGUMENT, message)

    def _new_record(self, req: opb.GenerateRequest) -> SessionRecord:
        if req.max_new_tokens <= 0:
            raise self._bad("max_new_tokens must be at least 1")
        if req.max_new_tokens > self.max_new_tokens_limit:
            raise self._bad(f"max_new_tokens {req.max_new_tokens} exceeds this server's limit of {self.max_new_tokens_limit}")
        if math.isnan(req.temperature) or math.isinf(req.temperature) or req.temperature < 0:
            raise self._bad(f"temperature must be a finite number >= 0, got {req.temperature}")
        top_p = req.top_p if req.top_p != 0 else 1.0
        if math.isnan(top_p) or not 0 < top_p <= 1:
            raise self._bad(f"top_p must be in (0, 1], got {req.top_p}")
        if req.top_k < 0:
            raise self._bad(f"top_k must be >= 0, got {req.top_k}")
        if req.max_draft_len > self.cfg.max_draft_len:
            raise self._bad(f"max_draft_len {req.max_draft_len} exceeds the limit of {self.cfg.max_draft_len}")
        if len(req.stop) > self.max_stop_strings:
            raise self._bad(f"at most {self.max_stop_strings} stop strings")
        which = req.WhichOneof("prompt")
        if which == "text":
            if not req.text.strip():
                raise self._bad("prompt is empty")
            if self.tokenizer is None:
                raise self._bad("this orchestrator has no tokenizer; send token_ids")
            if req.apply_chat_template and getattr(self.tokenizer, "chat_template", None):
                ids = self.tokenizer.apply_chat_template(
                    [{"role": "user", "content": req.text}], add_generation_prompt=True, tokenize=True)
                ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
            else:
                ids = self.tokenizer.encode(req.text, add_special_tokens=True)
        elif which == "token_ids":
            ids = list(req.token_ids.ids)
            if not ids:
                raise self._bad("prompt is empty")
            bad = [t for t in ids if t >= self.vocab_size]
            if bad:
                raise self._bad(f"prompt token id {bad[0]} is outside the vocabulary (size {self.vocab_size})")
        else:
            raise self._bad("prompt is empty: set text or token_ids")
        if len(ids) > self.max_prompt_tokens:
            raise self._bad(f"prompt has {len(ids)} tokens; the limit is {self.max_prompt_tokens}")
        if len(ids) + req.max_new_tokens > self.target_info.max_context:
            raise RpcAbort(grpc.StatusCode.OUT_OF_RANGE,
                           f"prompt ({len(ids)}) + max_new_tokens ({req.max_new_tokens}) exceeds the model's "
                           f"context of {self.target_info.max_context} tokens")
        speculation = req.speculation != opb.SPECULATION_OFF
        params = dict(temperature=float(req.temperature), top_k=int(req.top_k), top_p=float(top_p),
                      seed=int(req.seed), max_new_tokens=int(req.max_new_tokens), stop=list(req.stop),
                      stop_token_ids=list(req.stop_token_ids), speculation=speculation,
                      max_draft_len=int(req.max_draft_len), ignore_eos=bool(req.ignore_eos))
        return SessionRecord(session_id=secrets.token_urlsafe(18), prompt_ids=ids, params=params)

    # -- RPCs -----------------------------------------------------------------------------------

    def Generate(self, request, context):
        try:
            yield from self._generate(request, context)
        except RpcAbort as e:
            context.abort(e.code, e.message)
        except GenerationError as e:
            context.abort(e.code, e.message)
        except StoreUnavailable as e:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        except Exception as e:  # noqa: BLE001
            if isinstance(e, grpc.RpcError):
                raise
            log.exception("generate failed")
            context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(e).__name__}: {e}")

    def _generate(self, request, context):
        if request.resume_session_id:
            rec = self.store.load(request.resume_session_id)
            if rec is None:
                raise RpcAbort(grpc.StatusCode.NOT_FOUND, f"unknown session id {request.resume_session_id!r}")
            if request.resume_from > len(rec.generated):
                raise self._bad(f"resume_from {request.resume_from} is past the {len(rec.generated)} generated tokens")
        else:
            rec = self._new_record(request)
            self.store.create(rec)
        sid = rec.session_id
        cancel = threading.Event()
        with self._active_lock:
            if sid in self._active:
                raise RpcAbort(grpc.StatusCode.FAILED_PRECONDITION, f"session {sid} is already streaming")
            self._active[sid] = cancel
        context.add_callback(cancel.set)  # client cancelled or disconnected
        gen = Generation(rec, self.target, self.draft, self.tokenizer, self.eos_ids, self.vocab_size, self.cfg,
                         self.draft_health, cancel, self.window)
        try:
            with telemetry.span("orchestrator.generate", session_id=sid, resumed=bool(request.resume_session_id)):
                # Replay what the client has not seen yet (everything after resume_from).
                offset = request.resume_from if request.resume_session_id else 0
                replay = rec.generated[offset:]
                if replay or not request.resume_session_id:
                    gen.text.emitted = len(gen.text.decode(rec.generated[:offset])) if offset else 0
                    final = rec.status != "running"
                    text = gen.text.delta(rec.generated, final)
                    yield opb.GenerateResponse(session_id=sid, token_ids=replay, text=text, offset=offset)
                for chunk in gen.run(self.store):
                    yield self._response(rec, chunk)
                yield opb.GenerateResponse(session_id=sid, offset=len(rec.generated), stats=stats_message(rec),
                                           finish_reason=rec.finish_reason)
        finally:
            with self._active_lock:
                self._active.pop(sid, None)
            if rec.status != "running":
                self._release_caches(sid)

    def _response(self, rec, chunk: Chunk) -> opb.GenerateResponse:
        return opb.GenerateResponse(session_id=rec.session_id, text=chunk.text, token_ids=chunk.tokens,
                                    offset=chunk.offset)

    def _release_caches(self, sid: str) -> None:
        for client in (self.target, self.draft):
            if client is None:
                continue
            try:
                client.release(sid)
            except grpc.RpcError as e:
                log.info("release failed", extra={"session_id": sid, "service": client.address, "code": e.code().name})

    @handle_errors
    def GetSession(self, request, context):
        rec = self._load(request.session_id)
        text = self.tokenizer.decode(rec.generated, skip_special_tokens=True) if self.tokenizer else ""
        return opb.SessionInfo(session_id=rec.session_id, status=rec.status, prompt_tokens=len(rec.prompt_ids),
                               generated_token_ids=rec.generated, text=text, stats=stats_message(rec),
                               finish_reason=rec.finish_reason)

    @handle_errors
    def CancelSession(self, request, context):
        rec = self._load(request.session_id)
        with self._active_lock:
            event = self._active.get(rec.session_id)
        if event is not None:
            event.set()
            return opb.CancelSessionResponse(cancelled=True)
        if rec.status == "running":
            rec.status, rec.finish_reason = "cancelled", opb.FINISH_REASON_CANCELLED
            self.store.update_state(rec)
            self._release_caches(rec.session_id)
            return opb.CancelSessionResponse(cancelled=True)
        return opb.CancelSessionResponse(cancelled=False)

    @handle_errors
    def GetOutline(self, request, context):
        from google.protobuf import struct_pb2

        from orchestrator.outline import build_outline

        msg = opb.Outline(outline=struct_pb2.Struct())
        msg.outline.update(build_outline(self))
        return msg

    def _load(self, session_id: str) -> SessionRecord:
        if not session_id:
            raise self._bad("session_id is required")
        try:
            rec = self.store.load(session_id)
        except StoreUnavailable as e:
            raise RpcAbort(grpc.StatusCode.UNAVAILABLE, str(e)) from e
        if rec is None:
            raise RpcAbort(grpc.StatusCode.NOT_FOUND, f"unknown session id {session_id!r}")
        return rec


def build_servicer(target_addr: str, draft_addr: str | None, store_url: str, tokenizer_spec: str | None,
                   cfg: LoopConfig, max_new_tokens_limit: int = 2048, session_ttl_s: int = 3600,
                   startup_timeout_s: float = 60.0) -> OrchestratorServicer:
    from specdec.models import load_tokenizer

    target = TargetClient(target_addr)
    target_info = target.info(timeout=startup_timeout_s)
    draft = None
    draft_addr = (draft_addr or "").split(",")[0].strip()
    if draft_addr:
        draft = DraftClient(draft_addr)
        try:
            draft_info = draft.info(timeout=startup_timeout_s)
        except grpc.RpcError as e:
            log.warning("draft not reachable at start-up; starting degraded", extra={"draft": draft_addr,
                                                                                     "code": e.code().name})
        else:
            check_compatible(target_info, draft_info)
    tokenizer = load_tokenizer(tokenizer_spec or target_info.model_name)
    store = open_store(store_url, ttl_s=session_ttl_s)
    store.ping()
    return OrchestratorServicer(target, draft, store, tokenizer, target_info, cfg, max_new_tokens_limit)


def build_server(servicer: OrchestratorServicer, address: str, max_workers: int = 32) -> ServiceServer:
    server = ServiceServer(address, max_workers=max_workers)
    server.add(orchestrator_pb2_grpc.add_OrchestratorServicer_to_server, servicer,
               opb.DESCRIPTOR.services_by_name["Orchestrator"].full_name)
    return server


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--listen", default="127.0.0.1:50050")
    p.add_argument("--target", default="127.0.0.1:50052", help="target service address")
    p.add_argument("--draft", default="127.0.0.1:50051", help="draft service address ('' = no speculation)")
    p.add_argument("--redis", default="redis://127.0.0.1:6379/0", help="session store URL, or 'memory'")
    p.add_argument("--tokenizer", default=None, help="tokenizer spec (default: the target's model)")
    p.add_argument("--draft-len", type=int, default=4, help="default max draft length")
    p.add_argument("--max-new-tokens-limit", type=int, default=2048)
    p.add_argument("--session-ttl-s", type=int, default=3600)
    p.add_argument("--fallback-chunk", type=int, default=4, help="tokens per target-only Decode when degraded")


def serve(args: argparse.Namespace) -> None:
    telemetry.setup("specdec-orchestrator")
    cfg = LoopConfig(default_draft_len=args.draft_len, fallback_chunk=args.fallback_chunk)
    servicer = build_servicer(args.target, args.draft or None, args.redis, args.tokenizer, cfg,
                              args.max_new_tokens_limit, args.session_ttl_s)
    server = build_server(servicer, args.listen).start()
    telemetry.ready(server.address)
    telemetry.wait_for_signal(server)
