"""gRPC front of the target model: `specdec serve target`."""

from __future__ import annotations

import argparse
import logging
import threading
import time

import grpc

from specdec import observability as telemetry
from specdec.core import wire
from specdec.core.grpc_util import (RpcAbort, ServiceServer, call_deadline, handle_errors, handle_stream_errors,
                                    require_session_id)
from specdec.core.settings import from_args
from specdec.ops.service import add_service_arguments, prepare_process, run_until_signal
from specdec.v1 import common_pb2, target_pb2, target_pb2_grpc
from target_service.engines import select as engines
from target_service.engines.base import TargetBackend
from target_service.engines.jobs import DecodeTask, VerifyTask
from target_service.settings import TargetSettings
from target_service.streaming import start_decode_stream

PROFILE_MAX_TOKENS = 64  # the longest forward the start-up profile times (a few seconds in all)

log = logging.getLogger("specdec.target")


class TargetServicer(target_pb2_grpc.TargetServiceServicer):
    def __init__(self, engine: TargetBackend, max_decode_tokens: int = 64, inject_latency_ms: float = 0.0):
        self.engine = engine
        # Fault injection for the chaos suite: armed by the flag, off until SIGUSR1 turns it on (see serve).
        self.inject_latency_ms = inject_latency_ms
        self.latency_enabled = False
        self.delayed_calls = 0  # the calls that slept, logged at each toggle
        self._delay_lock = threading.Lock()
        self.max_decode_tokens = max_decode_tokens
        loaded = engine.loaded
        self.info = common_pb2.ModelInfo(
            model_name=loaded.name,
            vocab_size=loaded.vocab_size,
            tokenizer_fingerprint=loaded.fingerprint,
            max_context=loaded.max_context,
            eos_token_ids=loaded.eos_token_ids,
            device=str(loaded.device),
            dtype=str(loaded.dtype).replace("torch.", ""),
            strategy="target",
            forward_ms=engine.forward_ms,
            max_batch=engine.max_batch,
            kv_fingerprint=loaded.kv_fingerprint,
            max_draft_len=engine.max_draft_len,
            max_sessions=engine.max_sessions,
        )
        component = {"specdec.component": "target"}
        telemetry.register_gauge("specdec.kv_cache.size", engine.cache_bytes, "By", "KV cache bytes held", component)
        telemetry.register_gauge("specdec.kv_cache.sessions", engine.cached_sessions, "{session}",
                                 "sessions holding a KV cache", component)
        if hasattr(engine, "prompt_rows_reused"):  # the llama.cpp engine's prompt cache (llama_prompt.py)
            telemetry.register_gauge("specdec.prompt_cache.reused_rows", engine.prompt_rows_reused, "{token}",
                                     "prompt rows a kept prompt gave, since start", component)
            telemetry.register_gauge("specdec.prompt_cache.computed_rows", engine.prompt_rows_computed, "{token}",
                                     "prompt rows the prompt context computed, since start", component)
            telemetry.register_gauge("specdec.engine.steps", engine.step_counts, "{count}",
                                     "llama.cpp step loop since start: steps, rows fed, ubatches", component)

    def _delta(self, delta: common_pb2.TokenDelta) -> tuple[int, list[int]]:
        return delta.prefix_len, wire.check_token_ids(delta.tokens, self.engine.vocab_size, "delta")

    @handle_errors
    def Prefill(self, request, context):
        sid = require_session_id(request.session_id)
        prefix_len, delta = self._delta(request.delta)
        telemetry.annotate(session_id=sid, tokens=len(delta), export_kv=request.export_kv)
        reply = target_pb2.PrefillResponse(cached_len=self.engine.prefill(sid, prefix_len, delta,
                                                                          prompt_len=request.delta.prompt_len))
        if request.export_kv and self.info.kv_fingerprint:
            kv = self.engine.export_kv(sid, self.MAX_KV_EXPORT_BYTES)
            if kv is not None:
                reply.kv.CopyFrom(wire.encode_kv(*kv, self.info.kv_fingerprint))
        return reply

    # A KV export holds at most this much (the first positions that fit; the draft prefills the rest itself): under
    # the 8 MiB message limit with room for the Propose request around it. SmolLM2-135M: 22.5 KiB a position.
    MAX_KV_EXPORT_BYTES = 7 * 1024 * 1024

    @handle_errors
    def Verify(self, request, context):
        sid = require_session_id(request.session_id)
        prefix_len, delta = self._delta(request.delta)
        params = wire.sampling_from_proto(request.sampling)
        if len(request.tree.tokens) or len(request.tree.parents):
            return self._verify_tree(sid, request, prefix_len, delta, params)
        draft = wire.check_token_ids(request.draft_tokens, self.engine.vocab_size, "draft_tokens")
        self._injected_latency()
        if len(draft) > self.engine.max_draft_len:
            raise RpcAbort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{len(draft)} draft tokens exceed this target's limit of {self.engine.max_draft_len}",
            )
        probs = None
        if not params.is_greedy:
            probs = wire.decode_distributions(request.draft_probs, self.engine.vocab_size, len(draft))
        telemetry.annotate(session_id=sid, draft_tokens=len(draft))
        out = self.engine.verify(VerifyTask(sid, prefix_len, delta, draft, probs, params, request.sampling.seed,
                                            request.step, prompt_len=request.delta.prompt_len))
        telemetry.record_verify(len(draft), out.num_accepted, out.verify_ms)
        return target_pb2.VerifyResponse(
            num_accepted=out.num_accepted, next_token=out.next_token, cached_len=out.cached_len, verify_ms=out.verify_ms
        )

    MAX_TREE_NODES = 64

    def _verify_tree(self, sid, request, prefix_len, delta, params):
        """Tree speculation: the token tree in request.tree, verified in one forward pass."""
        from specdec.core import tree as tree_mod

        if len(request.draft_tokens) or len(request.draft_probs):
            raise RpcAbort(grpc.StatusCode.INVALID_ARGUMENT, "send either draft_tokens or a tree, not both")
        msg = request.tree
        tokens = wire.check_token_ids(msg.tokens, self.engine.vocab_size, "tree tokens")
        if len(tokens) > self.MAX_TREE_NODES:
            raise RpcAbort(grpc.StatusCode.INVALID_ARGUMENT,
                           f"{len(tokens)} tree nodes exceed this target's limit of {self.MAX_TREE_NODES}")
        parents = tree_mod.check_parents(msg.parents, len(tokens))
        probs = None
        if not params.is_greedy:
            probs = wire.decode_distributions(msg.probs, self.engine.vocab_size, len(tokens))
        telemetry.annotate(session_id=sid, draft_tokens=len(tokens), tree=True)
        self._injected_latency()
        out = self.engine.verify(VerifyTask(sid, prefix_len, delta, tokens, probs, params, request.sampling.seed,
                                            request.step, tree_parents=parents))
        telemetry.record_verify(len(tokens), out.num_accepted, out.verify_ms)
        return target_pb2.VerifyResponse(num_accepted=out.num_accepted, next_token=out.next_token,
                                         cached_len=out.cached_len, verify_ms=out.verify_ms,
                                         accepted_nodes=list(out.accepted_nodes))

    def _decode_task(self, request: target_pb2.DecodeRequest, max_tokens: int) -> DecodeTask:
        """A Decode or DecodeStream request, checked, as the engine takes it."""
        sid = require_session_id(request.session_id)
        prefix_len, delta = self._delta(request.delta)
        params = wire.sampling_from_proto(request.sampling)
        if not 1 <= request.max_tokens <= max_tokens:
            raise RpcAbort(grpc.StatusCode.INVALID_ARGUMENT, f"max_tokens must be in 1..{max_tokens}")
        return DecodeTask(sid, prefix_len, delta, request.max_tokens, params, request.sampling.seed, request.step,
                          frozenset(request.stop_token_ids), prompt_len=request.delta.prompt_len)

    @handle_errors
    def Decode(self, request, context):
        task = self._decode_task(request, self.max_decode_tokens)
        telemetry.annotate(session_id=task.session_id, max_tokens=task.max_tokens)
        self._injected_latency()
        tokens, cached_len, ms = self.engine.decode(task)
        return target_pb2.DecodeResponse(tokens=tokens, cached_len=cached_len, decode_ms=ms)

    # A stream ends by itself this long (at most) before its deadline, after a block: the caller opens the next one
    # instead of seeing DEADLINE_EXCEEDED, which would count against a target that is only busy.
    STREAM_END_MARGIN_S = 2.0

    @handle_stream_errors
    def DecodeStream(self, request, context):
        task = self._decode_task(request, self.engine.loaded.max_context)
        want, next_want, grown_to = self._stream_blocks(request, self.engine.loaded.max_context)
        telemetry.annotate(session_id=task.session_id, max_tokens=task.max_tokens, stream=True)
        self._injected_latency()
        stream = start_decode_stream(self.engine, task)
        context.add_callback(stream.cancel)  # the caller cancelled or the call ended: the engine stops decoding it
        deadline, sent = call_deadline(), 0
        margin = 0.0 if deadline is None else min(self.STREAM_END_MARGIN_S, 0.2 * (deadline - time.monotonic()))
        try:
            while True:
                left = None if deadline is None else deadline - time.monotonic()
                if sent and left is not None and left <= margin:
                    return  # a clean end before the deadline; the caller continues with a new stream
                try:
                    block = stream.take(want, None if left is None else max(0.0, left - margin) if sent else left)
                except TimeoutError:
                    if sent:
                        return  # no token since the last block before the margin: the clean end, as above
                    raise
                if block.tokens:
                    sent += 1
                    yield target_pb2.DecodeResponse(tokens=block.tokens, cached_len=block.cached_len,
                                                    decode_ms=block.decode_ms)
                if block.finished:
                    return
                want, next_want = next_want, min(grown_to, 2 * next_want)
                self._injected_latency()
        finally:
            stream.cancel()

    @staticmethod
    def _stream_blocks(request: target_pb2.DecodeRequest, limit: int) -> tuple[int, int, int]:
        """A DecodeStream's (first block, next block, largest block) in tokens, checked. Blocks after the first:
        block_tokens, then doubling up to max_block_tokens (a session whose drafter keeps finding nothing consults
        it at short blocks first, then costs what a target-only stream does)."""
        for name in ("block_tokens", "first_block_tokens", "max_block_tokens"):
            value = getattr(request, name)
            if value > limit:
                raise RpcAbort(grpc.StatusCode.INVALID_ARGUMENT,
                               f"{name} must be at most {limit} (the stream's token limit), got {value}")
        block = max(1, request.block_tokens)
        if request.max_block_tokens and request.max_block_tokens < block:
            raise RpcAbort(grpc.StatusCode.INVALID_ARGUMENT,
                           f"max_block_tokens ({request.max_block_tokens}) is below block_tokens ({block}); "
                           "0 means blocks do not grow")
        return max(1, request.first_block_tokens or request.block_tokens), block, max(block, request.max_block_tokens)

    def _injected_latency(self) -> None:
        if self.latency_enabled:
            with self._delay_lock:
                self.delayed_calls += 1
            time.sleep(self.inject_latency_ms / 1e3)

    @handle_errors
    def Release(self, request, context):
        sid = require_session_id(request.session_id)
        return common_pb2.ReleaseResponse(released=self.engine.release(sid))

    @handle_errors
    def GetInfo(self, request, context):
        return self.info

    @handle_errors
    def ResetPromptCache(self, request, context):
        return target_pb2.ResetPromptCacheResponse(dropped=self.engine.forget_prompts())


def build_server(engine: TargetBackend, address: str, max_workers: int = 8,
                 inject_latency_ms: float = 0.0) -> ServiceServer:
    server = ServiceServer(address, max_workers=max_workers)
    server.servicer = TargetServicer(engine, inject_latency_ms=inject_latency_ms)
    server.add(
        target_pb2_grpc.add_TargetServiceServicer_to_server,
        server.servicer,
        target_pb2.DESCRIPTOR.services_by_name["TargetService"].full_name,
    )
    return server


def add_arguments(p: argparse.ArgumentParser) -> None:
    """`specdec serve target`'s flags: the fields of TargetSettings (target_service/settings.py)."""
    add_service_arguments(p, TargetSettings)


def serve(args: argparse.Namespace) -> None:
    if not 0.0 <= args.batch_wait_fraction <= 1.0:
        raise SystemExit(f"--batch-wait-fraction must be between 0 and 1, got {args.batch_wait_fraction}")
    prepare_process(args, "specdec-target", log)
    engine = engines.build_engine(from_args(TargetSettings, args))
    if args.profile_forward == "on":
        # A batching target profiles up to a few full rows: the orchestrator weighs a batch's total tokens.
        rows = min(engine.max_batch, 4)
        # Capped: past it the orchestrator extends the curve linearly (TargetCost.forward).
        engine.forward_ms = engine.profile_forward_ms(min(rows * (engine.max_draft_len + 1),
                                                          max(PROFILE_MAX_TOKENS, engine.max_draft_len + 1)))
        log.info("forward cost profile", extra={"forward_ms": engine.forward_ms})
    # A Verify holds its thread while it waits for its batch: one per cached session, so a full orchestrator's
    # sessions are never refused for want of threads.
    server = build_server(engine, args.listen, max_workers=args.max_sessions + 8,
                          inject_latency_ms=args.inject_latency_ms).start()
    run_until_signal(server, log, lambda: {"delayed_calls": server.servicer.delayed_calls})
