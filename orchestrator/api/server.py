"""The public gRPC API: `specdec serve orchestrator`."""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import socket
import threading
from collections import Counter
from dataclasses import dataclass

import grpc

from orchestrator.api.cancel import cancel_stored, lease_wait_s
from orchestrator.api.limits import (RequestLimits, bad_request, check_request, resolve_resumed, smallest_limit)
from orchestrator.loop import (AcceptanceWindow, Backends, Generation, GenerationError, Measurements, StepTimer,
                               StreamControl, stats_message)
from orchestrator.policy.admission import Admission, QueueCancelled, QueueTimeout
from orchestrator.policy.draft_length import AcceptancePrior, DraftCost, DraftEvidence, TargetCost
from orchestrator.replicas.clients import TargetClient
from orchestrator.replicas.draft_pool import DraftPool
from orchestrator.replicas.pool import PoolSettings
from orchestrator.replicas.target_pool import IncompatibleTargets, TargetPool, TargetsUnreachable, open_targets
from orchestrator.settings import LoopConfig, OrchestratorSettings, ServerSettings
from orchestrator.store.session_store import LeaseLost, SessionLost, SessionRecord, StoreFull, StoreUnavailable, open_store
from orchestrator.store.status import store_error, store_errors
from specdec import observability as telemetry
from specdec.core import settings as flags
from specdec.core.grpc_util import (RpcAbort, ServiceServer, StartupError, add_tls_arguments, configure_tls,
                                    handle_errors, tls_from_args)
from specdec.core.security import is_loopback, principal_of
from specdec.ops import cpu_affinity
from specdec.v1 import common_pb2
from specdec.v1 import orchestrator_pb2 as opb
from specdec.v1 import orchestrator_pb2_grpc

log = logging.getLogger("specdec.orchestrator")


class IncompatibleModels(Exception):
    pass


# Worker threads beyond one per generating session: a stream holds its thread for its whole life, so Health,
# GetSession and CancelSession always find one free however many sessions stream.
CONTROL_WORKERS = 16
SESSION_METADATA = "x-specdec-session-id"  # a queued Generate's response header: its session id before it starts


MAX_FINAL_DELTA = 4096  # tokens a release hands the drafter at most (a reply's last block is a few dozen)


def final_draft_delta(rec: SessionRecord) -> common_pb2.TokenDelta | None:
    """The session's committed tokens its drafter was never shown (the reply's last block: drafting happens before
    a step, so the step that finishes a reply is never followed by one), for the release to hand over."""
    committed = rec.committed
    pos = min(rec.draft_pos, len(committed))
    if pos == len(committed) or len(committed) - pos > MAX_FINAL_DELTA:
        return None
    return common_pb2.TokenDelta(prefix_len=pos, tokens=committed[pos:])


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


@dataclass
class Connections:
    """What the servicer serves with: the target replicas (one client: a pool of one), the draft replicas (None:
    no speculation), the session store, the tokenizer and the target model's facts."""
    targets: TargetPool | TargetClient
    drafts: DraftPool | None
    store: object
    tokenizer: object
    target_info: object  # common_pb2.ModelInfo, the target pool's merged answer


class OrchestratorServicer(orchestrator_pb2_grpc.OrchestratorServicer):
    def __init__(self, settings: OrchestratorSettings, connections: Connections):
        target, target_info = connections.targets, connections.target_info
        self.settings = settings
        cfg, server = settings.loop, settings.server
        max_active_sessions = server.max_sessions
        # A single client (tests, embedders) is a pool of one; the pool's threads end with close().
        self.targets = target if isinstance(target, TargetPool) else TargetPool.of_client(target)
        self.pool = connections.drafts
        self.store = connections.store
        self.tokenizer = connections.tokenizer
        self.target_info = target_info
        self.cfg = cfg
        self.max_new_tokens_limit = server.max_new_tokens_limit
        self.max_sessions_per_principal = server.max_sessions_per_principal or max_active_sessions
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
        self.admission = Admission(lambda: min(max_active_sessions, settings.max_running or self.targets.capacity(
            self.target_info) or max_active_sessions), server.queue_timeout_s, max_active_sessions,
            server.admission == "adaptive")
        self.measured.target_latency = self.admission.observe  # below that ceiling, what the target's latency allows
        # Principals are hashes of bearer tokens; a session belongs to the principal that created it.
        # Admin tokens authenticate too; only they see internal addresses in GetOutline.
        self.principals = {principal_of(t): t for t in [*settings.auth_tokens, *settings.admin_tokens]}
        self.admins = {principal_of(t) for t in settings.admin_tokens}
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

    def outline_state(self):
        """What GetOutline reads (orchestrator/api/outline.py's OutlineState), as configured now."""
        from orchestrator.api.outline import OutlineState

        with self._active_lock:
            active = len(self._active)
        return OutlineState(self.cfg, self.measured, self.target_info, self.targets, self.pool, self.store.url, active)

    @property
    def backends(self) -> Backends:
        """What a generation calls, as configured now (a test may swap the pool)."""
        info = self.target_info
        return Backends(self.targets, self.pool, self.tokenizer, self.eos_ids, self.vocab_size, info.kv_fingerprint)

    def _active_count(self) -> int:
        return len(self._active)  # a racy read is fine for a load switch

    # -- admission ------------------------------------------------------------------------------

    def _bad(self, message: str) -> RpcAbort:
        return bad_request(message)

    def request_limits(self) -> RequestLimits:
        """The limits a request is admitted within now: the draft ceiling is the smallest of this orchestrator's,
        the target's and the draft replicas' advertised limits (replicas come and go)."""
        info = self.target_info
        drafts = self.pool.max_draft_len() if self.pool is not None else 0
        return RequestLimits(max_new_tokens=self.max_new_tokens_limit,
                             max_draft_len=smallest_limit(self.cfg.max_draft_len, info.max_draft_len, drafts),
                             vocab_size=self.vocab_size, max_context=info.max_context,
                             max_prompt_tokens=max(1, info.max_context - 1))  # room for one new token

    def _new_record(self, req: opb.GenerateRequest) -> SessionRecord:
        ids, params = check_request(req, self.request_limits(), self.tokenizer)
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
                resolve_resumed(rec.params, self.request_limits())
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
                    self._release_caches(sid, None if lost else final_draft_delta(rec))

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

    def _release_caches(self, sid: str, final_delta: common_pb2.TokenDelta | None = None) -> None:
        # Off the request's path: the stream ends without waiting for the services to free their caches.
        if self._closed.is_set():
            return  # shutting down: the channels are closing, and the caches go with the services
        self.targets.release(sid)
        if self.pool is not None:
            self.pool.release(sid, final_delta)

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


def build_servicer(settings: OrchestratorSettings) -> OrchestratorServicer:
    """Connect to the target replicas (--target: comma-separated, ``dns:///`` names too; at least one must answer,
    all must serve the same model), the draft replicas (optional: unreachable ones join later) and the session
    store. A ``local:ngram`` replica drafts in this process (orchestrator/replicas/local_draft.py)."""
    server = settings.server
    try:
        targets, target_info = open_targets(server.target, server.startup_timeout_s,
                                            PoolSettings(breaker_open_s=server.breaker_open_s,
                                                         resolve_interval_s=server.resolve_interval_s))
    except TargetsUnreachable as e:
        raise StartupError(f"the target at {server.target} did not answer within {server.startup_timeout_s:g} s "
                           f"({e}): start it first, or point --target at it") from e
    except (IncompatibleTargets, ValueError) as e:
        raise StartupError(f"--target: {e}") from e
    try:
        from specdec.models import load_tokenizer

        tokenizer = load_tokenizer(server.tokenizer or target_info.model_name)
        drafts = _open_drafts(settings, tokenizer, target_info)
        store = _open_store(settings)
        return OrchestratorServicer(settings, Connections(targets, drafts, store, tokenizer, target_info))
    except BaseException:
        targets.close()  # its health thread must not outlive a failed start
        raise


def _open_drafts(settings: OrchestratorSettings, tokenizer, target_info) -> DraftPool | None:
    """The draft pool of --draft (None: no speculation), each replica's ModelInfo asked for once at start."""
    from orchestrator.replicas.local_draft import build_local_client

    server, cfg = settings.server, settings.loop
    addresses = [a.strip() for a in (server.draft or "").split(",") if a.strip()]
    if not addresses:
        return None
    timings = PoolSettings(breaker_open_s=server.breaker_open_s, breaker_failures=server.breaker_failures,
                           resolve_interval_s=server.resolve_interval_s)
    pool = DraftPool(addresses, timings, on_info=lambda replica, info: check_compatible(target_info, info),
                     local_client=lambda address: build_local_client(
                         address, tokenizer, target_info.model_name, target_info.vocab_size, server.local_datastore))
    for replica in pool.replicas:
        try:
            replica.info = replica.client.info(timeout=min(server.startup_timeout_s, 10.0))
        except grpc.RpcError as e:
            log.warning("draft replica not reachable at start-up; it joins when healthy",
                        extra={"replica": replica.address, "code": e.code().name})
            continue
        check_compatible(target_info, replica.info)  # a wrong tokenizer is a configuration error
        if cfg.tree_budget and not replica.info.drafts_trees:
            log.warning("tree speculation asked for, but this draft drafts chains only: its steps verify "
                        "chains", extra={"replica": replica.address, "model": replica.info.model_name})
    return pool


def _open_store(settings: OrchestratorSettings):
    server = settings.server
    try:
        store = open_store(settings.session_store_url, ttl_s=server.session_ttl_s, lease_ttl_s=server.session_lease_s)
    except ValueError as e:  # orchestrator/store/client.py's StoreUrlError: a malformed --redis URL
        raise StartupError(f"--redis: {e}") from None
    try:
        store.ping()
    except StoreUnavailable as e:
        log.warning("session store unreachable at start-up; new sessions fail until it is back",
                    extra={"error": str(e)})
    return store


def build_server(servicer: OrchestratorServicer, address: str, tls=None) -> ServiceServer:
    # One thread per generating session (each stream holds one) plus CONTROL_WORKERS that nothing long holds.
    server = ServiceServer(address, max_workers=servicer.max_active_sessions + CONTROL_WORKERS, tls=tls)
    server.add(orchestrator_pb2_grpc.add_OrchestratorServicer_to_server, servicer,
               opb.DESCRIPTOR.services_by_name["Orchestrator"].full_name)
    return server


def add_arguments(p: argparse.ArgumentParser) -> None:
    """`specdec serve orchestrator`'s flags: the fields of ServerSettings and LoopConfig (orchestrator/settings.py)."""
    flags.add_arguments(p, ServerSettings)
    flags.add_arguments(p, LoopConfig)
    cpu_affinity.add_argument(p)
    add_tls_arguments(p)
    telemetry.add_metrics_argument(p)


def serve(args: argparse.Namespace) -> None:
    settings = OrchestratorSettings.from_args(args)  # bad flags are refused before anything process-wide is set up
    cpus = cpu_affinity.apply_from_args(args)
    telemetry.setup("specdec-orchestrator", metrics_port=args.metrics_port)
    cpu_affinity.log_pinning(log, cpus, 1)
    if (settings.auth_tokens or settings.admin_tokens) and not args.tls_cert and not is_loopback(args.listen):
        log.warning("bearer tokens over plaintext: give the public port TLS (--tls-cert/--tls-key)")
    configure_tls(tls_from_args(args))  # channels to draft and target
    http = None
    if args.http_listen:
        from orchestrator.api.http import HttpServer

        http = HttpServer(args.http_listen)  # bound now: a taken port fails before the wait for the target
    servicer = build_servicer(settings)
    public_tls = tls_from_args(args, require_client_cert=not args.tls_public_no_client_cert)
    server = build_server(servicer, args.listen, tls=public_tls).start()
    if http is not None:
        http.start(servicer)
        print(f"SPECDEC_HTTP {http.url}", flush=True)  # before SPECDEC_READY: launchers read both
    telemetry.ready(server.address)
    telemetry.wait_for_signal(server)
    if http is not None:
        http.stop()
