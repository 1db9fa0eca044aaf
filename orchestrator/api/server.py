"""The public gRPC API: `specdec serve orchestrator`."""

from __future__ import annotations

import argparse
import logging
import math
import os
import secrets
import socket
import threading
from collections import Counter

import grpc

from orchestrator.policy.admission import Admission, QueueCancelled, QueueTimeout
from orchestrator.api.cancel import cancel_stored, lease_wait_s
from orchestrator.replicas.clients import TargetClient
from orchestrator.policy.draft_length import AcceptancePrior, DraftCost, DraftEvidence, TargetCost
from orchestrator.replicas.discovery import is_dns, parse_dns
from orchestrator.replicas.draft_pool import DraftPool
from orchestrator.replicas.target_pool import IncompatibleTargets, TargetPool, TargetsUnreachable, open_targets
from orchestrator.loop import (AcceptanceWindow, Backends, Generation, GenerationError, Measurements, StepTimer,
                               StreamControl, stats_message)
from orchestrator.api.prompts import chat_prompt_ids
from orchestrator.store.records import GenerationParams
from orchestrator.store.session_store import (LeaseLost, SessionLost, SessionRecord, StoreFull, StoreUnavailable,
                                        open_store)
from orchestrator.store.status import store_errors, store_error
from orchestrator.settings import LoopConfig, ServerSettings
from specdec.ops import cpu_affinity
from specdec import observability as telemetry
from specdec.core import settings
from specdec.core.grpc_util import RpcAbort, ServiceServer, StartupError, add_tls_arguments, configure_tls, handle_errors, tls_from_args
from specdec.core.security import is_loopback, principal_of, read_secret, require_public_auth, url_with_password
from specdec.v1 import orchestrator_pb2 as opb
from specdec.v1 import orchestrator_pb2_grpc

log = logging.getLogger("specdec.orchestrator")


class IncompatibleModels(Exception):
    pass


# Worker threads beyond one per generating session: a stream holds its thread for its whole life, so Health,
# GetSession and CancelSession always find one free however many sessions stream.
CONTROL_WORKERS = 16
SESSION_METADATA = "x-specdec-session-id"  # a queued Generate's response header: its session id before it starts


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
    def __init__(self, target: TargetClient | TargetPool, pool: DraftPool | None, store, tokenizer, target_info,
                 cfg: LoopConfig, max_new_tokens_limit: int = ServerSettings.max_new_tokens_limit,
                 max_prompt_tokens: int | None = None, max_stop_strings: int = 16,
                 max_active_sessions: int = ServerSettings.max_sessions, auth_tokens: list[str] = (),
                 admin_tokens: list[str] = (), max_stop_string_bytes: int = 256, max_stop_token_ids: int = 64,
                 max_prompt_bytes: int = 1 << 20, max_sessions_per_principal: int = 0,
                 max_running: int = 0, queue_timeout_s: float = ServerSettings.queue_timeout_s,
                 adaptive_admission: bool = ServerSettings.admission == "adaptive"):
        # A single client (tests, embedders) is a pool of one; the pool's threads end with close().
        self.targets = target if isinstance(target, TargetPool) else TargetPool.of_client(target)
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
        self.measured = Measurements(
            window=AcceptanceWindow(), target_step=StepTimer(), active_sessions=self._active_count,
            # A target forward batches the sessions placed on its replica, not every session of this orchestrator.
            target_cost=(TargetCost(list(target_info.forward_ms), target_info.max_batch,
                                    lambda: self.targets.sessions_per_replica())
                         if len(target_info.forward_ms) >= 2 else None),
            acceptance_prior=AcceptancePrior(),
            draft_evidence=DraftEvidence(),  # what the drafters' token scores mean, learned across sessions
            draft_cost=DraftCost())  # what drafting costs per call, token and prefilled token, across sessions
        telemetry.set_gen_ai_model(target_info.model_name)
        self.max_active_sessions = max_active_sessions
        # Generations beyond what the targets serve at once wait their turn (0 = auto: TargetPool.capacity).
        self.admission = Admission(lambda: min(max_active_sessions, max_running or self.targets.capacity(
            self.target_info) or max_active_sessions), queue_timeout_s, max_active_sessions, adaptive_admission)
        self.measured.target_latency = self.admission.observe  # below that ceiling, what the target's latency allows
        # Principals are hashes of bearer tokens; a session belongs to the principal that created it.
        # Admin tokens authenticate too; only they see internal addresses in GetOutline.
        self.principals = {principal_of(t): t for t in [*auth_tokens, *admin_tokens]}
        self.admins = {principal_of(t) for t in admin_tokens}
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
        self.targets.close()

    @property
    def target(self) -> TargetClient | None:
        """The first target replica's client (a one-target setup's only one)."""
        return self.targets.first

    @target.setter
    def target(self, client: TargetClient) -> None:
        """Serve with this one target client from now on (a test swaps in an unreachable one)."""
        old, self.targets = self.targets, TargetPool.of_client(client)
        old.close()

    @property
    def backends(self) -> Backends:
        """What a generation calls, as configured now (a test may swap the pool)."""
        info = self.target_info
        return Backends(self.targets, self.pool, self.tokenizer, self.eos_ids, self.vocab_size, info.kv_fingerprint,
                        info.max_draft_len)

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
            if req.apply_chat_template:
                ids = chat_prompt_ids(self.tokenizer, [{"role": "user", "content": req.text}])
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
        params = GenerationParams(temperature=float(req.temperature), top_k=int(req.top_k), top_p=float(top_p),
                                  seed=int(req.seed), max_new_tokens=int(req.max_new_tokens), stop=list(req.stop),
                                  stop_token_ids=list(req.stop_token_ids), speculation=speculation,
                                  max_draft_len=int(req.max_draft_len), ignore_eos=bool(req.ignore_eos))
        return SessionRecord(session_id=secrets.token_urlsafe(18), prompt_ids=ids, params=params)

    # -- RPCs -----------------------------------------------------------------------------------

    def authenticate(self, context) -> str:
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
        principal = self.authenticate(context)
        if request.resume_session_id:
            rec = self._load(request.resume_session_id, principal)
        else:
            rec = self._new_record(request)
            rec.params.owner = principal
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
        ticket = self.admission.ticket(sid, principal)
        try:
            context.add_callback(lambda: (cancel.set(), self.admission.cancel_ticket(ticket)))  # client went away
            if not context.is_active():
                cancel.set()  # it went away before the callback was registered
                self.admission.cancel_ticket(ticket)
            queued_ms = self._admit(ticket, context) * 1e3
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
            rec.stats.queued_ms += queued_ms
            gen = Generation(rec, self.cfg, self.backends, self.measured, StreamControl(cancel, lease))
            with telemetry.span("orchestrator.generate", session_id=sid, resumed=bool(request.resume_session_id),
                                queued_ms=round(queued_ms, 1)):
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
            self.admission.release(ticket)
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

    def _admit(self, ticket, context) -> float:
        """Wait for the generation's turn (orchestrator/policy/admission.py), at most until the call's deadline; the seconds
        waited. A queued gRPC call gets its session id at once in the response headers (SESSION_METADATA), for
        CancelSession."""
        remaining = getattr(context, "time_remaining", lambda: None)()  # the HTTP API's stand-in has none
        headers = getattr(context, "send_initial_metadata", None)
        try:
            with telemetry.span("orchestrator.admission", session_id=ticket.key):
                return self.admission.admit(ticket, None if remaining is None else remaining - 0.5, on_queued=(
                    headers and (lambda: headers(((SESSION_METADATA, ticket.key),)))))
        except QueueTimeout as e:
            raise RpcAbort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e)) from None
        except QueueCancelled as e:
            raise RpcAbort(grpc.StatusCode.CANCELLED, str(e)) from None

    def _release_caches(self, sid: str) -> None:
        # Off the request's path: the stream ends without waiting for the services to free their caches.
        if self._closed.is_set():
            return  # shutting down: the channels are closing, and the caches go with the services
        self.targets.release(sid)
        if self.pool is not None:
            self.pool.release(sid)

    @handle_errors
    @store_errors
    def GetSession(self, request, context):
        rec = self._load(request.session_id, self.authenticate(context))
        text = self.tokenizer.decode(rec.generated, skip_special_tokens=True) if self.tokenizer else ""
        return opb.SessionInfo(session_id=rec.session_id, status=rec.status, prompt_tokens=len(rec.prompt_ids),
                               generated_token_ids=rec.generated, text=text, stats=stats_message(rec),
                               finish_reason=rec.finish_reason)

    @handle_errors
    @store_errors
    def CancelSession(self, request, context):
        principal = self.authenticate(context)
        queued = self.admission.cancel(request.session_id, principal)  # one waiting to start leaves the queue
        try:
            rec = self._load(request.session_id, principal)
        except RpcAbort:
            if queued:
                return opb.CancelSessionResponse(cancelled=True)  # a new session: stored once it starts
            raise
        with self._active_lock:
            event = None if queued else self._active.get(rec.session_id)
        if event is not None:
            event.set()
            return opb.CancelSessionResponse(cancelled=True)
        if rec.status != "running":
            return opb.CancelSessionResponse(cancelled=queued)
        token = f"{self.instance}/cancel-{secrets.token_hex(4)}"
        cancelled, written = cancel_stored(self.store, rec.session_id, token, lambda: self._load(
            request.session_id, rec.params.owner), lease_wait_s(self.store, context))
        if written:
            self._release_caches(rec.session_id)
        return opb.CancelSessionResponse(cancelled=cancelled)

    @handle_errors
    def GetOutline(self, request, context):
        from google.protobuf import struct_pb2

        from orchestrator.api.outline import build_outline

        principal = self.authenticate(context)
        # Without auth (loopback or --insecure) every caller is the operator; with it, only admins see addresses.
        admin = not self.principals or principal in self.admins
        msg = opb.Outline(outline=struct_pb2.Struct())
        msg.outline.update(build_outline(self, show_addresses=admin))
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
        if rec is None or rec.params.owner != principal:
            raise RpcAbort(grpc.StatusCode.NOT_FOUND, f"unknown session id {session_id!r}")
        return rec


_S = ServerSettings  # the defaults below are the flags' (orchestrator/settings.py)


def build_servicer(target_addr: str, draft_addrs: str | list[str] | None, store_url: str,
                   tokenizer_spec: str | None, cfg: LoopConfig, max_new_tokens_limit: int = _S.max_new_tokens_limit,
                   session_ttl_s: int = _S.session_ttl_s, startup_timeout_s: float = _S.startup_timeout_s,
                   max_active_sessions: int = _S.max_sessions, auth_tokens: list[str] = (),
                   breaker_open_s: float = _S.breaker_open_s, breaker_failures: int = _S.breaker_failures,
                   local_datastore: str = _S.local_datastore,
                   session_lease_s: float = _S.session_lease_s,
                   resolve_interval_s: float = _S.resolve_interval_s,
                   admin_tokens: list[str] = (),
                   max_sessions_per_principal: int = _S.max_sessions_per_principal, max_running: int = 0,
                   queue_timeout_s: float = _S.queue_timeout_s,
                   adaptive_admission: bool = _S.admission == "adaptive") -> OrchestratorServicer:
    """Connect to the target replicas (``target_addr``: comma-separated, ``dns:///`` names too; at least one must
    answer, all must serve the same model) and the draft replicas (optional: unreachable ones join later).
    A ``local:ngram`` replica drafts in this process (orchestrator/replicas/local_draft.py)."""
    from orchestrator.replicas.local_draft import build_local_client
    from specdec.models import load_tokenizer

    try:
        targets, target_info = open_targets(target_addr, startup_timeout_s, breaker_open_s=breaker_open_s,
                                            resolve_interval_s=resolve_interval_s)
    except TargetsUnreachable as e:
        raise StartupError(f"the target at {target_addr} did not answer within {startup_timeout_s:g} s "
                           f"({e}): start it first, or point --target at it") from e
    except (IncompatibleTargets, ValueError) as e:
        raise StartupError(f"--target: {e}") from e
    try:
        tokenizer = load_tokenizer(tokenizer_spec or target_info.model_name)
        if isinstance(draft_addrs, str):
            draft_addrs = [a.strip() for a in draft_addrs.split(",")]
        draft_addrs = [a for a in (draft_addrs or []) if a]
        pool = None
        if draft_addrs:
            pool = DraftPool(draft_addrs, breaker_open_s=breaker_open_s, breaker_failures=breaker_failures,
                             on_info=lambda replica, info: check_compatible(target_info, info),
                             local_client=lambda address: build_local_client(
                                 address, tokenizer, target_info.model_name, target_info.vocab_size, local_datastore),
                             resolve_interval_s=resolve_interval_s)
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
        try:
            store = open_store(store_url, ttl_s=session_ttl_s, lease_ttl_s=session_lease_s)
        except ValueError as e:  # orchestrator/store/client.py's StoreUrlError: a malformed --redis URL
            raise StartupError(f"--redis: {e}") from None
        try:
            store.ping()
        except StoreUnavailable as e:
            log.warning("session store unreachable at start-up; new sessions fail until it is back",
                        extra={"error": str(e)})
        return OrchestratorServicer(targets, pool, store, tokenizer, target_info, cfg, max_new_tokens_limit,
                                    max_active_sessions=max_active_sessions, auth_tokens=auth_tokens,
                                    admin_tokens=admin_tokens,
                                    max_sessions_per_principal=max_sessions_per_principal,
                                    max_running=max_running, queue_timeout_s=queue_timeout_s,
                                    adaptive_admission=adaptive_admission)
    except BaseException:
        targets.close()  # its health thread must not outlive a failed start
        raise


def build_server(servicer: OrchestratorServicer, address: str, tls=None) -> ServiceServer:
    # One thread per generating session (each stream holds one) plus CONTROL_WORKERS that nothing long holds.
    server = ServiceServer(address, max_workers=servicer.max_active_sessions + CONTROL_WORKERS, tls=tls)
    server.add(orchestrator_pb2_grpc.add_OrchestratorServicer_to_server, servicer,
               opb.DESCRIPTOR.services_by_name["Orchestrator"].full_name)
    return server


def add_arguments(p: argparse.ArgumentParser) -> None:
    """`specdec serve orchestrator`'s flags: the fields of ServerSettings and LoopConfig (orchestrator/settings.py)."""
    settings.add_arguments(p, ServerSettings)
    settings.add_arguments(p, LoopConfig)
    cpu_affinity.add_argument(p)
    add_tls_arguments(p)
    telemetry.add_metrics_argument(p)


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
    max_running = 0 if args.max_running == "auto" else int(args.max_running) if args.max_running.isdigit() else -1
    if max_running < 0 or args.max_running == "0" or not args.queue_timeout_s > 0:
        raise SystemExit(f"--max-running must be auto or at least 1 (got {args.max_running!r}), --queue-timeout-s "
                         f"positive (got {args.queue_timeout_s})")
    if not args.resolve_interval_s > 0:
        raise SystemExit(f"--resolve-interval-s must be positive, got {args.resolve_interval_s}")
    for flag, addresses in (("--target", args.target), ("--draft", args.draft)):
        for address in (a.strip() for a in (addresses or "").split(",")):
            if is_dns(address):
                try:
                    parse_dns(address)
                except ValueError as e:
                    raise SystemExit(f"{flag}: {e}") from None
    if not 0.1 <= args.session_lease_s <= 3600:
        raise SystemExit(f"--session-lease-s must be between 0.1 and 3600 seconds, got {args.session_lease_s}")
    tokens, admin_tokens = require_public_auth(args)
    store_url = args.redis
    if args.redis_password_file:
        if "://" not in store_url or store_url.startswith("memory"):
            raise StartupError(f"--redis-password-file needs a redis:// store URL, not {store_url!r}")
        store_url = url_with_password(store_url, read_secret(args.redis_password_file, "the Redis password"))
    cpus = cpu_affinity.apply_from_args(args)
    telemetry.setup("specdec-orchestrator", metrics_port=args.metrics_port)
    cpu_affinity.log_pinning(log, cpus, 1)
    if (tokens or admin_tokens) and not args.tls_cert and not is_loopback(args.listen):
        log.warning("bearer tokens over plaintext: give the public port TLS (--tls-cert/--tls-key)")
    configure_tls(tls_from_args(args))  # channels to draft and target
    cfg = settings.from_args(LoopConfig, args)
    http = None
    if args.http_listen:
        from orchestrator.http_api import HttpServer

        http = HttpServer(args.http_listen)  # bound now: a taken port fails before the wait for the target
    servicer = build_servicer(args.target, args.draft, store_url, args.tokenizer, cfg, args.max_new_tokens_limit,
                              args.session_ttl_s, startup_timeout_s=args.startup_timeout_s,
                              max_active_sessions=args.max_sessions, auth_tokens=tokens,
                              breaker_open_s=args.breaker_open_s, breaker_failures=args.breaker_failures,
                              local_datastore=args.local_datastore, session_lease_s=args.session_lease_s,
                              resolve_interval_s=args.resolve_interval_s,
                              admin_tokens=admin_tokens,
                              max_sessions_per_principal=args.max_sessions_per_principal, max_running=max_running,
                              queue_timeout_s=args.queue_timeout_s, adaptive_admission=args.admission == "adaptive")
    public_tls = tls_from_args(args, require_client_cert=not args.tls_public_no_client_cert)
    server = build_server(servicer, args.listen, tls=public_tls).start()
    if http is not None:
        http.start(servicer)
        print(f"SPECDEC_HTTP {http.url}", flush=True)  # before SPECDEC_READY: launchers read both
    telemetry.ready(server.address)
    telemetry.wait_for_signal(server)
    if http is not None:
        http.stop()
