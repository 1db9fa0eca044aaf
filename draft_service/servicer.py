"""The draft service's RPCs (Propose, Release, GetInfo) over one proposer. Served over gRPC by server.py, and
called in-process by the orchestrator's in-process drafter (orchestrator/replicas/local_draft.py), so both take the
same checks."""

from __future__ import annotations

import time

import grpc

from draft_service.proposers.base import Proposer, ProposeTask
from specdec import observability as telemetry
from specdec.core import wire
from specdec.core.grpc_util import RpcAbort, handle_errors, require_session_id
from specdec.core.settings import MAX_DRAFT_LEN
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc


class DraftServicer(draft_pb2_grpc.DraftServiceServicer):
    def __init__(self, proposer: Proposer, info: common_pb2.ModelInfo, max_draft_len: int = MAX_DRAFT_LEN,
                 inject_latency_ms: float = 0.0):
        self.proposer = proposer
        self.info = info
        info.max_draft_len = max_draft_len  # advertised: the orchestrator asks for no more
        self.max_draft_len = max_draft_len
        # Fault injection for chaos tests: extra latency per Propose (toggled by SIGUSR1 in `serve`).
        self.inject_latency_ms = inject_latency_ms
        self.latency_enabled = inject_latency_ms > 0
        component = {"specdec.component": "draft"}
        if getattr(proposer, "store", None) is not None:
            telemetry.register_gauge("specdec.kv_cache.size", proposer.store.total_bytes, "By", "KV cache bytes held",
                                     component)
        telemetry.register_gauge("specdec.kv_cache.sessions", proposer.num_sessions, "{session}",
                                 "sessions holding a KV cache", component)

    @handle_errors
    def Propose(self, request, context):
        sid = require_session_id(request.session_id)
        params = wire.sampling_from_proto(request.sampling)
        delta = wire.check_token_ids(request.delta.tokens, self.proposer.vocab_size, "delta")
        if not 1 <= request.max_draft_len <= self.max_draft_len:
            raise RpcAbort(grpc.StatusCode.INVALID_ARGUMENT, f"max_draft_len must be in 1..{self.max_draft_len}")
        if self.latency_enabled:
            time.sleep(self.inject_latency_ms / 1e3)
        if request.tree_budget and self.proposer.drafts_trees:
            return self._propose_tree(sid, request, params, delta)
        s = telemetry.annotate(session_id=sid, max_draft_len=request.max_draft_len)
        t0 = time.perf_counter()
        kv = None
        if request.HasField("kv"):
            kv = self._imported_kv(request)
            s.set_attribute("kv_imported", request.kv.length)
        proposal = self.proposer.get_candidates(ProposeTask(
            sid, request.delta.prefix_len, delta, request.max_draft_len, params, request.sampling.seed, request.step,
            request.min_confidence, request.principal, kv, should_stop=lambda: not context.is_active()))
        ms = (time.perf_counter() - t0) * 1e3
        s.set_attribute("draft_tokens", len(proposal.tokens))
        telemetry.record_draft(ms)
        probs = [] if proposal.probs_fp16 is None else [wire.encode_distribution(r) for r in proposal.probs_fp16]
        return draft_pb2.ProposeResponse(
            tokens=proposal.tokens, probs=probs, cached_len=proposal.cached_len, draft_ms=ms,
            token_scores=proposal.scores or []
        )

    def _imported_kv(self, request):
        """The request's KvBlock as (keys, values), after checking it is this draft's kind (where it goes in the
        session is the proposer's check: get_candidates)."""
        kv = request.kv
        if not self.info.kv_fingerprint or kv.fingerprint != self.info.kv_fingerprint:
            raise RpcAbort(grpc.StatusCode.FAILED_PRECONDITION,
                           "this draft cannot take that KV (it holds KV of other weights, or none from elsewhere): "
                           "send the context without it")
        return wire.decode_kv(kv, *self.proposer.kv_dims)

    MAX_TREE_NODES = 64
    MAX_TREE_BRANCH = 16

    def _propose_tree(self, sid, request, params, delta):
        """Tree speculation (a drafter that cannot build trees answers tree requests with a chain instead)."""
        from specdec.core.tree import TreeShape

        if request.tree_budget > self.MAX_TREE_NODES:
            raise RpcAbort(grpc.StatusCode.INVALID_ARGUMENT, f"tree_budget must be in 1..{self.MAX_TREE_NODES}")
        if request.tree_branch > self.MAX_TREE_BRANCH:
            raise RpcAbort(grpc.StatusCode.INVALID_ARGUMENT, f"tree_branch must be in 0..{self.MAX_TREE_BRANCH}")
        below = request.tree_branch_below
        if not (wire.is_finite(below) and 0.0 <= below <= 1.0):
            raise RpcAbort(grpc.StatusCode.INVALID_ARGUMENT, "tree_branch_below must be in [0, 1]")
        default = TreeShape(budget=1)
        shape = TreeShape(budget=request.tree_budget, branch=request.tree_branch or default.branch,
                          branch_below=below or default.branch_below, max_depth=request.tree_max_depth)
        s = telemetry.annotate(session_id=sid, tree_budget=request.tree_budget)
        t0 = time.perf_counter()
        proposal = self.proposer.get_tree(sid, request.delta.prefix_len, delta, shape, params,
                                          request.sampling.seed, request.step)
        ms = (time.perf_counter() - t0) * 1e3
        s.set_attribute("draft_tokens", len(proposal.tokens))
        telemetry.record_draft(ms)
        probs = [] if proposal.probs_fp16 is None else [wire.encode_distribution(r) for r in proposal.probs_fp16]
        tree = common_pb2.TokenTree(parents=proposal.parents, tokens=proposal.tokens, probs=probs)
        return draft_pb2.ProposeResponse(tree=tree, cached_len=proposal.cached_len, draft_ms=ms)

    @handle_errors
    def Release(self, request, context):
        sid = require_session_id(request.session_id)
        if request.final_delta.tokens:
            final = wire.check_token_ids(request.final_delta.tokens, self.proposer.vocab_size, "final_delta")
            self.proposer.take_final(sid, request.final_delta.prefix_len, final)
        return common_pb2.ReleaseResponse(released=self.proposer.release(sid))

    @handle_errors
    def GetInfo(self, request, context):
        return self.info
