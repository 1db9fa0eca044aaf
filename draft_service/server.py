"""gRPC front of a drafter: `specdec serve draft`."""

from __future__ import annotations

import argparse
import logging
import pathlib
import signal
import time

import grpc

from draft_service.proposers.base import Proposer
from draft_service.settings import DEFAULT_BATCH_ROWS, DraftSettings
from specdec.ops import cpu_affinity
from specdec import observability as telemetry
from specdec.core import settings, wire
from specdec.core.grpc_util import RpcAbort, ServiceServer, add_tls_arguments, configure_tls, handle_errors, tls_from_args, require_session_id
from specdec.core.settings import MAX_DRAFT_LEN
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc

log = logging.getLogger("specdec.draft")


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
        stoppable = getattr(self.proposer, "stoppable", False)
        extra = {"should_stop": lambda: not context.is_active()} if stoppable else {}
        if request.HasField("kv"):
            extra["kv"] = self._imported_kv(request)
            s.set_attribute("kv_imported", request.kv.length)
        proposal = self.proposer.get_candidates(
            sid, request.delta.prefix_len, delta, request.max_draft_len, params,
            request.sampling.seed, request.step, request.min_confidence, **extra,
        )
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
        return common_pb2.ReleaseResponse(released=self.proposer.release(sid))

    @handle_errors
    def GetInfo(self, request, context):
        return self.info


def build_proposer(strategy: str, model: str, device: str, dtype: str, vocab_from: str | None,
                   max_sessions: int = 64, max_cache_mb: int = 2048, prepack: str = "auto",
                   hybrid_model_max_len: int = 2, draft_vocab: int = 0,
                   datastore: str = "none", quantize: str = "none",
                   batch_rows: int = DEFAULT_BATCH_ROWS) -> tuple[Proposer, common_pb2.ModelInfo]:
    from specdec.core.kv_cache import SessionCacheStore
    from specdec.models import load_model, load_tokenizer

    if strategy == "ngram":
        return build_ngram_proposer(load_tokenizer(vocab_from) if vocab_from else None, vocab_from, datastore)
    from draft_service.proposers.model import ModelProposer, limit_draft_vocab
    from specdec.core.strategies import MODEL_STRATEGIES

    if strategy not in MODEL_STRATEGIES:
        raise ValueError(f"unknown draft strategy {strategy!r} (model, ngram, hybrid or quantized)")
    if strategy == "quantized":  # --model (the target) with its weights rounded to int8
        quantize = "int8"
    if quantize not in ("none", "int8"):
        raise ValueError(f"quantize must be none or int8, not {quantize!r}")
    # int8 replaces the linear layers: no oneDNN-packed float copies of them first
    loaded = load_model(model, device=device, dtype=dtype, prepack="off" if quantize == "int8" else prepack)
    store = SessionCacheStore(max_sessions=max_sessions, max_bytes=max_cache_mb * 1024 * 1024)
    info = common_pb2.ModelInfo(
        model_name=loaded.name, vocab_size=loaded.vocab_size, tokenizer_fingerprint=loaded.fingerprint,
        max_context=loaded.max_context, eos_token_ids=loaded.eos_token_ids, device=str(loaded.device),
        dtype=str(loaded.dtype).replace("torch.", ""), strategy=strategy,
    )
    lm = None
    if quantize == "int8":
        from draft_service.int8_draft import int8_draft

        lm = int8_draft(loaded, store, batch_rows=batch_rows)  # the full vocabulary: its head is the target's, in int8
        info.model_name = f"{loaded.name}[int8]"
        info.dtype = "int8"
        if getattr(lm, "kv_dims", None) is not None:  # the lean runtime takes the target's prompt KV
            info.kv_fingerprint = loaded.kv_fingerprint
    elif limit_draft_vocab(loaded, draft_vocab):
        info.model_name = f"{loaded.name}[vocab<{draft_vocab}]"
    proposer = ModelProposer(loaded, store, lm)
    info.drafts_trees = proposer.drafts_trees
    if strategy == "hybrid":
        from draft_service.proposers.hybrid import HybridProposer
        from draft_service.proposers.ngram import NgramProposer

        store = open_datastore(datastore, vocab_from or model, loaded.fingerprint, loaded.vocab_size)
        info.model_name = f"{ngram_model_name(store)}+{info.model_name}"
        info.kv_fingerprint = ""  # the hybrid's n-gram side drafts too: it takes no KV
        info.drafts_trees = False
        return HybridProposer(NgramProposer(vocab_size=loaded.vocab_size, datastore=store), proposer,
                              hybrid_model_max_len), info
    return proposer, info


def build_ngram_proposer(tokenizer, target: str | None, datastore: str,
                         vocab_size: int | None = None) -> tuple[Proposer, common_pb2.ModelInfo]:
    """The n-gram drafter and its ModelInfo. A model-free drafter still answers to the target's tokenizer, for the
    start-up compatibility check; ``vocab_size`` defaults to the tokenizer's (the orchestrator's in-process
    drafter passes the target's)."""
    from draft_service.proposers.ngram import NgramProposer
    from specdec.models import tokenizer_fingerprint

    vocab = vocab_size or (len(tokenizer) if tokenizer is not None else 2**31)
    fingerprint = "" if tokenizer is None else tokenizer_fingerprint(tokenizer)
    store = open_datastore(datastore, target, fingerprint, vocab)
    info = common_pb2.ModelInfo(model_name=ngram_model_name(store), vocab_size=0 if tokenizer is None else vocab,
                                tokenizer_fingerprint=fingerprint, strategy="ngram", drafts_trees=True)
    return NgramProposer(vocab_size=vocab, datastore=store), info


def ngram_model_name(store) -> str:
    return "ngram(prompt-lookup" + (f"+datastore[{store.entries}])" if store else ")")


def open_datastore(choice: str, target: str | None, fingerprint: str, vocab_size: int):
    """--datastore: none; a path; or auto: the table `specdec datastore` wrote for the target, if there is one.
    A table from another tokenizer would only propose wrong tokens: refused (auto: ignored with a warning)."""
    from draft_service.proposers.datastore import NgramDatastore, datastore_path

    if choice in ("", "none"):
        return None
    path = datastore_path(target) if choice == "auto" and target else pathlib.Path(choice).expanduser()
    if choice == "auto" and (not target or not path.is_file()):
        log.info("no n-gram datastore; prompt lookup only (`specdec datastore` builds one)",
                 extra={"path": str(path) if target else None})
        return None
    store = NgramDatastore.load(path)
    problem = None
    if fingerprint and store.meta.get("tokenizer_fingerprint") != fingerprint:
        problem = f"datastore {path} was built for another tokenizer ({store.meta.get('target')!r})"
    elif store.max_token() >= vocab_size:
        problem = f"datastore {path} holds token ids beyond the vocabulary of {vocab_size}"
    if problem and choice == "auto":
        log.warning(problem + "; not used", extra={"path": str(path)})
        return None
    if problem:
        raise ValueError(problem)
    log.info("n-gram datastore loaded", extra={"path": str(path), "entries": store.entries})
    return store


def build_server(proposer: Proposer, info: common_pb2.ModelInfo, address: str, max_workers: int = 8,
                 inject_latency_ms: float = 0.0, max_draft_len: int = MAX_DRAFT_LEN) -> ServiceServer:
    server = ServiceServer(address, max_workers=max_workers)
    server.servicer = DraftServicer(proposer, info, max_draft_len, inject_latency_ms=inject_latency_ms)
    server.add(
        draft_pb2_grpc.add_DraftServiceServicer_to_server,
        server.servicer,
        draft_pb2.DESCRIPTOR.services_by_name["DraftService"].full_name,
    )
    return server


def add_arguments(p: argparse.ArgumentParser) -> None:
    """`specdec serve draft`'s flags: the fields of DraftSettings (draft_service/settings.py)."""
    settings.add_arguments(p, DraftSettings)
    cpu_affinity.add_argument(p)
    add_tls_arguments(p)
    telemetry.add_metrics_argument(p)


def serve(args: argparse.Namespace) -> None:
    import torch

    from specdec.core.security import require_mtls

    require_mtls(args)  # before loading anything: an unauthenticated non-loopback listener is refused
    cpus = cpu_affinity.apply_from_args(args)
    telemetry.setup("specdec-draft", metrics_port=args.metrics_port)
    cpu_affinity.log_pinning(log, cpus, args.threads)
    configure_tls(tls_from_args(args))
    torch.set_num_threads(args.threads)
    proposer, info = build_proposer(args.strategy, args.model, args.device, args.dtype, args.vocab_from,
                                    args.max_sessions, args.max_cache_mb, args.prepack, args.hybrid_model_max_len,
                                    args.draft_vocab, args.datastore, args.quantize, args.batch_rows)
    # A Propose holds its thread while it waits for its step batch: one per cached session (and its prefetch).
    server = build_server(proposer, info, args.listen, max_workers=args.max_sessions + 8,
                          inject_latency_ms=args.inject_latency_ms, max_draft_len=args.max_draft_len).start()
    if args.inject_latency_ms > 0:
        def _toggle(signum, frame):
            server.servicer.latency_enabled = not server.servicer.latency_enabled
            log.warning("injected latency toggled", extra={"enabled": server.servicer.latency_enabled})

        signal.signal(signal.SIGUSR1, _toggle)
    telemetry.ready(server.address)
    telemetry.wait_for_signal(server)
