"""The public gRPC API: `specdec serve orchestrator`."""

from __future__ import annotations

import argparse
import hashlib
import logging
import math
import os
import secrets
import socket
import threading
from collections import Counter

import grpc

from orchestrator.clients import TargetClient
from orchestrator.draft_length import AcceptancePrior, DraftCost, DraftEvidence, TargetCost
from orchestrator.draft_pool import DraftPool
from orchestrator.generation import (AcceptanceWindow, Chunk, Generation, GenerationError, LoopConfig,
                                     StepTimer, stats_message)
from orchestrator.session_store import (LeaseLost, SessionLost, SessionRecord, StoreFull, StoreUnavailable,
                                        open_store)
from specdec import cpu_affinity, telemetry
from specdec.grpc_util import RpcAbort, ServiceServer, StartupError, add_tls_arguments, configure_tls, handle_errors, tls_from_args
from specdec.v1 import orchestrator_pb2 as opb
from specdec.v1 import orchestrator_pb2_grpc

log = logging.getLogger("specdec.orchestrator")


class IncompatibleModels(Exception):
    pass


# Worker threads beyond one per generating session: a stream holds its thread for its whole life, so Health,
# GetSession and CancelSession always find one free however many sessions stream.
CONTROL_WORKERS = 16


def store_error(e: Exception) -> RpcAbort | None:
    """The gRPC status of a session-store failure (None: not one)."""
    if isinstance(e, SessionLost):
        return RpcAbort(grpc.StatusCode.DATA_LOSS, f"{e}; the session cannot continue (start a new one)")
    if isinstance(e, StoreFull):
        return RpcAbort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
    if isinstance(e, StoreUnavailable):
        return RpcAbort(grpc.StatusCode.UNAVAILABLE, str(e))
    if isinstance(e, LeaseLost):
        return RpcAbort(grpc.StatusCode.ABORTED, str(e))
    return None


def _store_errors(method):
    """GetSession/CancelSession: a store failure ends the call with its own status (not INTERNAL)."""
    import functools

    @functools.wraps(method)
    def wrapper(self, request, context):
        try:
            return method(self, request, context)
        except (SessionLost, StoreFull, StoreUnavailable, LeaseLost) as e:
            raise store_error(e) from e

    return wrapper


def principal_of(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()[:32]


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
    def __init__(self, target: TargetClient, pool: DraftPool | None, store, tokenizer, target_info,
                 cfg: LoopConfig, max_new_tokens_limit: int = 2048, max_prompt_tokens: int | None = None,
                 max_stop_strings: int = 16, max_active_sessions: int = 64, auth_tokens: list[str] = (),
                 max_stop_string_bytes: int = 256, max_stop_token_ids: int = 64, max_prompt_bytes: int = 1 << 20,
                 max_sessions_per_principal: int = 0):
        self.target = target
        self.pool = pool
        self.store = store
        self.tokenizer = tokenizer
        self.target_info = target_info
        self.cfg = cfg
        self.max_new_tokens_limit = max_new_tokens_limit
        self.max_prompt_tokens = max_prompt_tokens or target_info.max_context
        self.max_stop_strings = max_stop_strings
        self.max_stop_string_bytes = max_stop_string_bytes
        self.max_stop_token_ids = max_stop_token_ids
        self.max_prompt_bytes = max_prompt_bytes
        self.max_sessions_per_principal = max_sessions_per_principal or max_active_sessions
        self.eos_ids = set(target_info.eos_token_ids)
        self.vocab_size = target_info.vocab_size
        self.window = AcceptanceWindow()
        self.target_step = StepTimer()
        self.target_cost = (TargetCost(list(target_info.forward_ms), target_info.max_batch, self._active_count)
                            if len(target_info.forward_ms) >= 2 else None)
        self.acceptance_prior = AcceptancePrior()
        self.draft_evidence = DraftEvidence()  # what the drafters' token scores mean, learned across sessions
        self.draft_cost = DraftCost()  # what drafting costs per call, token and prefilled token, across sessions
        telemetry.set_gen_ai_model(target_info.model_name)
        self.max_active_sessions = max_active_sessions
        # Principals are hashes of bearer tokens; a session belongs to the principal that created it.
        self.principals = {principal_of(t): t for t in auth_tokens}
        self._active: dict[str, threading.Event] = {}
        self._active_by_principal: Counter[str] = Counter()
        self._active_lock = threading.Lock()
        # Session leases (single writer across orchestrator processes): this process's streams and their tokens,
        # renewed by a heartbeat at a third of the lease TTL.
        self.instance = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"
        self._leases: dict[str, str] = {}
        self._closed = threading.Event()
        threading.Thread(target=self._renew_leases, name="lease-heartbeat", daemon=True).start()

    def _renew_leases(self) -> None:
        interval = max(0.05, self.store.lease_ttl_s / 3)
        while not self._closed.wait(interval):
            with self._active_lock:
                leases = dict(self._leases)
            if not leases:
                continue
            try:
                lost = self.store.renew_leases(leases)
            except (StoreUnavailable, StoreFull):
                continue  # commits wait for the store; an expired lease is taken back if nobody acquired it since
            for sid in lost:
                log.warning("session lease taken by another stream", extra={"session_id": sid})

    def close(self) -> None:
        self._closed.set()

    def _active_count(self) -> int:
        return len(self._active)  # a racy read is fine for a load switch

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
            raise self._bad(f"stop has {len(req.stop)} strings; the limit is {self.max_stop_strings}")
        for i, stop in enumerate(req.stop):
            if len(stop.encode()) > self.max_stop_string_bytes:
                raise self._bad(f"stop[{i}] is {len(stop.encode())} bytes long; the limit is "
                                f"{self.max_stop_string_bytes} bytes")
        if len(req.stop_token_ids) > self.max_stop_token_ids:
            raise self._bad(f"stop_token_ids has {len(req.stop_token_ids)} ids; the limit is {self.max_stop_token_ids}")
        bad = [t for t in req.stop_token_ids if t >= self.vocab_size]
        if bad:
            raise self._bad(f"stop_token_ids: token id {bad[0]} is outside the vocabulary (size {self.vocab_size})")
        which = req.WhichOneof("prompt")
        if which == "text":
            if len(req.text.encode()) > self.max_prompt_bytes:
                raise self._bad(f"text prompt is {len(req.text.encode())} bytes long; the limit is "
                                f"{self.max_prompt_bytes} bytes")
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
            if len(ids) > self.max_prompt_tokens:
                raise self._bad(f"token_ids has {len(ids)} tokens; the limit is {self.max_prompt_tokens}")
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

    def _principal(self, context) -> str:
        """The caller's identity: '' without auth; UNAUTHENTICATED for a missing or wrong bearer token."""
        if not self.principals:
            return ""
        for key, value in context.invocation_metadata():
            if key == "authorization" and value.startswith("Bearer "):
                principal = principal_of(value[len("Bearer "):])
                if principal in self.principals:
                    return principal
        raise RpcAbort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid bearer token")

    def Generate(self, request, context):
        try:
            yield from self._generate(request, context)
        except RpcAbort as e:
            context.abort(e.code, e.message)
        except GenerationError as e:
            context.abort(e.code, e.message)
        except (SessionLost, StoreFull, StoreUnavailable, LeaseLost) as e:
            abort = store_error(e)
            context.abort(abort.code, abort.message)
        except Exception as e:  # noqa: BLE001
            if isinstance(e, grpc.RpcError):
                raise
            log.exception("generate failed")
            context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(e).__name__}: {e}")

    def _acquire_lease(self, sid: str, token: str) -> None:
        try:
            holder = self.store.acquire_lease(sid, token)
        except (StoreUnavailable, StoreFull) as e:
            raise store_error(e) from e
        if holder is not None:
            raise RpcAbort(grpc.StatusCode.FAILED_PRECONDITION,
                           f"session {sid} is already streaming on another orchestrator ({holder.rsplit('/', 1)[0]}); "
                           "one stream per session: resume it after that stream ends")
        with self._active_lock:
            self._leases[sid] = token

    def _release_lease(self, sid: str, token: str) -> None:
        with self._active_lock:
            self._leases.pop(sid, None)
        try:
            self.store.release_lease(sid, token)
        except StoreUnavailable:
            pass  # it expires by itself

    def _generate(self, request, context):
        principal = self._principal(context)
        if request.resume_session_id:
            rec = self._load(request.resume_session_id, principal)
        else:
            rec = self._new_record(request)
            rec.params["owner"] = principal
        sid = rec.session_id
        cancel = threading.Event()
        with self._active_lock:
            if sid in self._active:
                raise RpcAbort(grpc.StatusCode.FAILED_PRECONDITION, f"session {sid} is already streaming")
            if len(self._active) >= self.max_active_sessions:
                raise RpcAbort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"{self.max_active_sessions} sessions are generating; retry later")
            if self._active_by_principal[principal] >= self.max_sessions_per_principal:
                raise RpcAbort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"this caller's quota of {self.max_sessions_per_principal} generating sessions is used "
                               "up; retry when one of them ends")
            self._active[sid] = cancel
            self._active_by_principal[principal] += 1
        lease = f"{self.instance}/{secrets.token_hex(4)}"
        leased = lost = False
        try:
            self._acquire_lease(sid, lease)
            leased = True
            if request.resume_session_id:
                rec = self._load(sid, principal)  # as stored when the previous stream let go of it
                if request.resume_from > len(rec.generated):
                    raise self._bad(f"resume_from {request.resume_from} is past the {len(rec.generated)} "
                                    "generated tokens")
                if rec.status == "cancelled":
                    rec.status, rec.finish_reason = "running", 0  # resuming a cancelled session continues it
                self.store.clear_cancel_request(sid)  # one aimed at an earlier stream that ended meanwhile
            else:
                self.store.create(rec)
            context.add_callback(cancel.set)  # client cancelled or disconnected
            if not context.is_active():
                cancel.set()  # it went away before the callback was registered (e.g. while waiting for the lease)
            gen = Generation(rec, self.target, self.pool, self.tokenizer, self.eos_ids, self.vocab_size, self.cfg,
                             cancel, self.window, self.target_step, self._active_count, self.target_cost,
                             self.acceptance_prior, lease, self.draft_evidence, self.draft_cost,
                             self.target_info.kv_fingerprint)
            with telemetry.span("orchestrator.generate", session_id=sid, resumed=bool(request.resume_session_id)):
                # First message: the session id, plus whatever a resuming client has not seen yet.
                offset = request.resume_from if request.resume_session_id else 0
                gen.text.emitted = len(gen.text.decode(rec.generated[:offset])) if offset else 0
                text = gen.text.delta(rec.generated, rec.status != "running")
                yield opb.GenerateResponse(session_id=sid, token_ids=rec.generated[offset:], text=text, offset=offset)
                for chunk in gen.run(self.store):
                    yield opb.GenerateResponse(session_id=sid, text=chunk.text, token_ids=chunk.tokens,
                                               offset=chunk.offset)
                yield opb.GenerateResponse(session_id=sid, offset=len(rec.generated), stats=stats_message(rec),
                                           finish_reason=rec.finish_reason)
        except SessionLost:
            lost = True  # nothing more can be stored for it: its caches are of no use
            raise
        finally:
            with self._active_lock:
                self._active.pop(sid, None)
                self._active_by_principal[principal] -= 1
                if not self._active_by_principal[principal]:
                    del self._active_by_principal[principal]
            if leased:  # without the lease this stream wrote nothing and owns nothing to free
                if cancel.is_set() and rec.status == "running":
                    # The client went away mid-step: record it and free the caches.
                    rec.status, rec.finish_reason = "cancelled", opb.FINISH_REASON_CANCELLED
                    try:
                        self.store.update_state(rec, lease)
                    except (StoreUnavailable, LeaseLost, SessionLost):
                        log.warning("could not record cancellation", extra={"session_id": sid})
                self._release_lease(sid, lease)
                if rec.status != "running" or lost:
                    self._release_caches(sid)

    def _release_caches(self, sid: str) -> None:
        # Off the request's path: the stream ends without waiting for the services to free their caches.
        if self._closed.is_set():
            return  # shutting down: the channels are closing, and the caches go with the services
        self.target.release_async(sid)
        if self.pool is not None:
            self.pool.release(sid)

    @handle_errors
    @_store_errors
    def GetSession(self, request, context):
        rec = self._load(request.session_id, self._principal(context))
        text = self.tokenizer.decode(rec.generated, skip_special_tokens=True) if self.tokenizer else ""
        return opb.SessionInfo(session_id=rec.session_id, status=rec.status, prompt_tokens=len(rec.prompt_ids),
                               generated_token_ids=rec.generated, text=text, stats=stats_message(rec),
                               finish_reason=rec.finish_reason)

    @handle_errors
    @_store_errors
    def CancelSession(self, request, context):
        rec = self._load(request.session_id, self._principal(context))
        with self._active_lock:
            event = self._active.get(rec.session_id)
        if event is not None:
            event.set()
            return opb.CancelSessionResponse(cancelled=True)
        if rec.status != "running":
            return opb.CancelSessionResponse(cancelled=False)
        # Write the cancellation as a writer like any other: under the session's lease (a new fencing epoch).
        token = f"{self.instance}/cancel-{secrets.token_hex(4)}"
        if self.store.acquire_lease(rec.session_id, token, wait_s=0) is not None:
            # Streaming on another orchestrator: it must write the cancellation itself (its lease fences us out).
            self.store.request_cancel(rec.session_id)
            return opb.CancelSessionResponse(cancelled=True)
        try:
            rec = self._load(request.session_id, rec.params.get("owner", ""))  # as stored, now that we hold it
            if rec.status != "running":
                return opb.CancelSessionResponse(cancelled=False)
            rec.status, rec.finish_reason = "cancelled", opb.FINISH_REASON_CANCELLED
            self.store.update_state(rec, token)
        finally:
            self.store.release_lease(rec.session_id, token)
        self._release_caches(rec.session_id)
        return opb.CancelSessionResponse(cancelled=True)

    @handle_errors
    def GetOutline(self, request, context):
        from google.protobuf import struct_pb2

        from orchestrator.outline import build_outline

        msg = opb.Outline(outline=struct_pb2.Struct())
        msg.outline.update(build_outline(self))
        return msg

    def _load(self, session_id: str, principal: str) -> SessionRecord:
        if not session_id:
            raise self._bad("session_id is required")
        if len(session_id) > 128:
            raise self._bad("session_id is longer than 128 characters")
        try:
            rec = self.store.load(session_id)
        except (StoreUnavailable, SessionLost) as e:
            raise store_error(e) from e
        # Another principal's session answers exactly like a missing one: ids reveal nothing.
        if rec is None or rec.params.get("owner", "") != principal:
            raise RpcAbort(grpc.StatusCode.NOT_FOUND, f"unknown session id {session_id!r}")
        return rec


def build_servicer(target_addr: str, draft_addrs: str | list[str] | None, store_url: str,
                   tokenizer_spec: str | None, cfg: LoopConfig, max_new_tokens_limit: int = 2048,
                   session_ttl_s: int = 3600, startup_timeout_s: float = 60.0, max_active_sessions: int = 64,
                   auth_tokens: list[str] = (), breaker_open_s: float = 1.0,
                   breaker_failures: int = 2, local_datastore: str = "auto",
                   session_lease_s: float = 5.0, max_sessions_per_principal: int = 0) -> OrchestratorServicer:
    """Connect to the target (required) and the draft replicas (optional: unreachable ones join later).
    A ``local:ngram`` replica drafts in this process (orchestrator/local_draft.py)."""
    from orchestrator.local_draft import build_local_client
    from specdec.models import load_tokenizer

    target = TargetClient(target_addr)
    try:
        target_info = target.info(timeout=startup_timeout_s)
    except grpc.RpcError as e:
        raise StartupError(f"the target at {target_addr} did not answer within {startup_timeout_s:g} s "
                           f"({e.code().name}): start it first, or point --target at it") from e
    tokenizer = load_tokenizer(tokenizer_spec or target_info.model_name)
    if isinstance(draft_addrs, str):
        draft_addrs = [a.strip() for a in draft_addrs.split(",")]
    draft_addrs = [a for a in (draft_addrs or []) if a]
    pool = None
    if draft_addrs:
        pool = DraftPool(draft_addrs, breaker_open_s=breaker_open_s, breaker_failures=breaker_failures,
                         on_info=lambda replica, info: check_compatible(target_info, info),
                         local_client=lambda address: build_local_client(
                             address, tokenizer, target_info.model_name, target_info.vocab_size, local_datastore))
        for replica in pool.replicas:
            try:
                replica.info = replica.client.info(timeout=min(startup_timeout_s, 10.0))
            except grpc.RpcError as e:
                log.warning("draft replica not reachable at start-up; it joins when healthy",
                            extra={"replica": replica.address, "code": e.code().name})
            else:
                check_compatible(target_info, replica.info)  # a wrong tokenizer is a configuration error
                if cfg.tree_budget and not replica.info.drafts_trees:
                    log.warning("tree speculation asked for, but this draft drafts chains only: its steps verify "
                                "chains", extra={"replica": replica.address, "model": replica.info.model_name})
    store = open_store(store_url, ttl_s=session_ttl_s, lease_ttl_s=session_lease_s)
    try:
        store.ping()
    except StoreUnavailable as e:
        log.warning("session store unreachable at start-up; new sessions fail until it is back",
                    extra={"error": str(e)})
    return OrchestratorServicer(target, pool, store, tokenizer, target_info, cfg, max_new_tokens_limit,
                                max_active_sessions=max_active_sessions, auth_tokens=auth_tokens,
                                max_sessions_per_principal=max_sessions_per_principal)


def build_server(servicer: OrchestratorServicer, address: str, tls=None) -> ServiceServer:
    # One thread per generating session (each stream holds one) plus CONTROL_WORKERS that nothing long holds.
    server = ServiceServer(address, max_workers=servicer.max_active_sessions + CONTROL_WORKERS, tls=tls)
    server.add(orchestrator_pb2_grpc.add_OrchestratorServicer_to_server, servicer,
               opb.DESCRIPTOR.services_by_name["Orchestrator"].full_name)
    return server


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--listen", default="127.0.0.1:50050")
    p.add_argument("--target", default="127.0.0.1:50052", help="target service address")
    p.add_argument("--draft", default="127.0.0.1:50051",
                   help="draft replica addresses, comma-separated ('' = no speculation); 'local:ngram' drafts with "
                        "the n-gram drafter inside this process (no Propose round trip)")
    p.add_argument("--local-datastore", default="auto",
                   help="n-gram datastore of a local:ngram drafter: auto (the target's, if `specdec datastore` "
                        "built one), none, or a path")
    p.add_argument("--redis", default="redis://127.0.0.1:6379/0", help="session store URL, or 'memory'")
    p.add_argument("--tokenizer", default=None, help="tokenizer spec (default: the target's model)")
    p.add_argument("--draft-len", type=int, default=4, help="default draft length")
    p.add_argument("--max-draft-len", type=int, default=16, help="largest draft length a request may ask for")
    p.add_argument("--adaptive-draft-len", action="store_true", help="adapt the draft length per session")
    p.add_argument("--draft-len-policy", choices=["goodput", "heuristic"], default="goodput",
                   help="with --adaptive-draft-len: goodput = the k that maximises expected tokens per ms from the "
                        "session's acceptance and the measured target/draft costs (0 = target-only when no k pays; "
                        "needs the target's forward profile, else heuristic); heuristic = transformers' +2/-1 schedule")
    p.add_argument("--draft-min-confidence", type=float, default=0.0,
                   help="the draft stops a block early when its top probability is below this (0 = never)")
    p.add_argument("--pipeline", choices=["off", "on", "auto"], default="off",
                   help="draft the next block while the target verifies (auto: when the measured saving, full-block "
                        "rate x Propose round trip, beats --pipeline-min-gain-ms)")
    p.add_argument("--pipeline-min-gain-ms", type=float, default=1.0,
                   help="auto pipelining: the mean saving per step a prefetch must bring (about one RPC's cost)")
    p.add_argument("--pipeline-max-sessions", type=int, default=2,
                   help="auto pipelining: no prefetching while more than N sessions are generating; their drafting "
                        "already fills the draft's time during each other's verifies, and a prefetch not accepted "
                        "whole delays theirs (0 = no limit)")
    p.add_argument("--draft-prefill", choices=["target-kv", "own"], default="target-kv",
                   help="how a new session's draft gets the prompt when it is the target's own weights in int8 "
                        "(equal kv fingerprints): target-kv = the target prefills and hands its KV over (a few MiB "
                        "through this process per session); own = the draft prefills, in parallel with the target")
    p.add_argument("--speculation-max-sessions", type=int, default=0,
                   help="decode target-only while more than N sessions are generating: a busy batched target is "
                        "compute-bound and verifying drafts costs more than it saves (0 = always speculate)")
    p.add_argument("--tree-budget", type=int, default=0,
                   help="tree speculation: the draft proposes a token tree of up to N nodes, verified in one "
                        "target pass (0 = chain)")
    p.add_argument("--tree-branch", type=int, default=0,
                   help="tree speculation: children of an uncertain node (0 = the draft's default, 2)")
    p.add_argument("--tree-branch-below", type=float, default=0.0,
                   help="tree speculation: branch where the draft's top probability is below this (0 = default, 0.75)")
    p.add_argument("--max-new-tokens-limit", type=int, default=2048)
    p.add_argument("--max-sessions", type=int, default=64, help="concurrent generations; more get RESOURCE_EXHAUSTED")
    p.add_argument("--max-sessions-per-principal", type=int, default=0,
                   help="concurrent generations of one caller (bearer token); more get RESOURCE_EXHAUSTED "
                        "(0 = --max-sessions)")
    p.add_argument("--session-ttl-s", type=int, default=3600)
    p.add_argument("--startup-timeout-s", type=float, default=60.0,
                   help="how long to wait at start for the target to answer (it may still be loading its model)")
    p.add_argument("--session-lease-s", type=float, default=5.0,
                   help="a session's single-writer lease in Redis: a stream renews it every third of this; a crashed "
                        "orchestrator's sessions can be resumed elsewhere after at most this long")
    p.add_argument("--fallback-chunk", type=int, default=4,
                   help="tokens per target-only Decode call (degraded, paused by the draft length, or speculation off)")
    p.add_argument("--draft-timeout-floor-ms", type=float, default=100.0)
    p.add_argument("--draft-timeout-factor", type=float, default=2.0, help="x the measured target step time")
    p.add_argument("--breaker-open-s", type=float, default=1.0, help="how long a failed draft replica is skipped")
    p.add_argument("--breaker-failures", type=int, default=2,
                   help="consecutive draft failures (timeouts, errors) that open a replica's breaker")
    p.add_argument("--target-grace-s", type=float, default=30.0, help="wait this long for a dead target to return")
    p.add_argument("--store-grace-s", type=float, default=10.0, help="wait this long for Redis to return")
    p.add_argument("--auth-tokens-file", default=os.environ.get("SPECDEC_AUTH_TOKENS_FILE"),
                   help="file with one bearer token per line; when set, the public API requires one")
    cpu_affinity.add_argument(p)
    add_tls_arguments(p)
    telemetry.add_metrics_argument(p)
    p.add_argument("--tls-public-no-client-cert", action="store_true",
                   help="public API over TLS without client certificates (bearer tokens authenticate instead)")


def serve(args: argparse.Namespace) -> None:
    # Bad flags are refused before anything process-wide (telemetry, TLS) is set up.
    if not 0 <= args.tree_budget <= 64 or not 0 <= args.tree_branch <= 16 or not 0 <= args.tree_branch_below <= 1:
        raise SystemExit("--tree-budget must be in 0..64, --tree-branch in 0..16, --tree-branch-below in [0, 1]")
    if args.pipeline_max_sessions < 0:
        raise SystemExit(f"--pipeline-max-sessions must be 0 (no limit) or more, got {args.pipeline_max_sessions}")
    if not args.startup_timeout_s > 0:
        raise SystemExit(f"--startup-timeout-s must be positive, got {args.startup_timeout_s}")
    if args.max_sessions < 1 or args.max_sessions_per_principal < 0:
        raise SystemExit("--max-sessions must be at least 1 and --max-sessions-per-principal 0 (= --max-sessions) "
                         "or more")
    if not 0.1 <= args.session_lease_s <= 3600:
        raise SystemExit(f"--session-lease-s must be between 0.1 and 3600 seconds, got {args.session_lease_s}")
    cpus = cpu_affinity.apply_from_args(args)
    telemetry.setup("specdec-orchestrator", metrics_port=args.metrics_port)
    cpu_affinity.log_pinning(log, cpus, 1)
    configure_tls(tls_from_args(args))  # channels to draft and target
    cfg = LoopConfig(default_draft_len=args.draft_len, max_draft_len=args.max_draft_len,
                     adaptive_draft_len=args.adaptive_draft_len, draft_len_policy=args.draft_len_policy,
                     pipeline=args.pipeline,
                     pipeline_min_gain_ms=args.pipeline_min_gain_ms,
                     pipeline_max_sessions=args.pipeline_max_sessions,
                     draft_prefill=args.draft_prefill,
                     speculation_max_sessions=args.speculation_max_sessions,
                     draft_min_confidence=args.draft_min_confidence,
                     tree_budget=args.tree_budget, tree_branch=args.tree_branch,
                     tree_branch_below=args.tree_branch_below,
                     fallback_chunk=args.fallback_chunk,
                     draft_timeout_floor_ms=args.draft_timeout_floor_ms, draft_timeout_factor=args.draft_timeout_factor,
                     target_grace_s=args.target_grace_s, store_grace_s=args.store_grace_s)
    tokens = []
    if args.auth_tokens_file:
        with open(args.auth_tokens_file) as f:
            tokens = [line.strip() for line in f if line.strip() and not line.startswith("#")]
    servicer = build_servicer(args.target, args.draft, args.redis, args.tokenizer, cfg, args.max_new_tokens_limit,
                              args.session_ttl_s, startup_timeout_s=args.startup_timeout_s,
                              max_active_sessions=args.max_sessions, auth_tokens=tokens,
                              breaker_open_s=args.breaker_open_s, breaker_failures=args.breaker_failures,
                              local_datastore=args.local_datastore, session_lease_s=args.session_lease_s,
                              max_sessions_per_principal=args.max_sessions_per_principal)
    public_tls = tls_from_args(args, require_client_cert=not args.tls_public_no_client_cert)
    server = build_server(servicer, args.listen, tls=public_tls).start()
    telemetry.ready(server.address)
    telemetry.wait_for_signal(server)
