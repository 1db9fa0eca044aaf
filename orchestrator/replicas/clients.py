"""Orchestrator-side clients of the draft and target services.

Each call sends only the committed tokens the service does not hold yet (a TokenDelta from the
position the orchestrator tracks); on a cache miss (evicted, restarted or new replica) it resends
the whole context once, which rebuilds the service's cache transparently.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import grpc

from specdec.core import wire
from specdec.core.grpc_util import make_channel
from specdec.core.sampling import SamplingParams
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc

log = logging.getLogger("specdec.orchestrator")


def _delta(committed: list[int], pos: int, prompt_len: int = 0) -> common_pb2.TokenDelta:
    pos = min(pos, len(committed))
    return common_pb2.TokenDelta(prefix_len=pos, tokens=committed[pos:], prompt_len=prompt_len)


def _release_async(stub, address: str, session_id: str, timeout: float,
                   final_delta: common_pb2.TokenDelta | None = None):
    """Free a session's cache without waiting: a lost release only costs cache space until LRU eviction."""
    try:
        future = stub.Release.future(common_pb2.ReleaseRequest(session_id=session_id, final_delta=final_delta),
                                     timeout=timeout)
    except ValueError as e:  # the channel was closed (shutting down): nothing left to free
        log.info("release skipped", extra={"replica": address, "session_id": session_id, "error": str(e)})
        return None
    future.add_done_callback(lambda f: _log_release_failure(f, address, session_id))
    return future


def _log_release_failure(future, address: str, session_id: str) -> None:
    if not future.cancelled() and future.exception() is not None:
        code = getattr(future.exception(), "code", lambda: None)()
        log.info("release failed", extra={"replica": address, "session_id": session_id,
                                           "code": code.name if code else "?"})


def _is_cache_miss(e: grpc.RpcError) -> bool:
    return e.code() == grpc.StatusCode.FAILED_PRECONDITION and "cache-miss" in (e.details() or "")


def _call_with_resync(fn, committed: list[int], pos: int, prompt_len: int = 0):
    """fn(delta from pos); on a cache-miss, fn(the whole context) once. A replica holds a session through one call
    (target engines keep it through a Decode's prefill and steps), so a resend does not miss again. prompt_len:
    the session's prompt length, sent with every delta (TokenDelta.prompt_len)."""
    try:
        return fn(_delta(committed, pos, prompt_len)), False
    except grpc.RpcError as e:
        if not _is_cache_miss(e):
            raise
        return fn(_delta(committed, 0, prompt_len)), True


@dataclass(frozen=True)
class ProposeCall:
    """One Propose of a session's step: the committed tokens and the position the draft replica holds (a TokenDelta
    is sent from it), the longest draft to make, and the step's sampling. ``tree``: ask for a token tree (keys
    tree_budget, tree_branch, tree_branch_below, tree_max_depth). ``kv``: the target's KV of committed's first
    kv.length tokens (pos must be 0), installed instead of a prefill. ``principal``: the caller the session belongs
    to (drafters that learn across sessions keep principals apart)."""

    session_id: str
    committed: list[int]
    pos: int
    max_len: int
    params: SamplingParams
    seed: int = 0
    step: int = 0
    min_confidence: float = 0.0
    tree: dict | None = None
    kv: common_pb2.KvBlock | None = None
    principal: str = ""


@dataclass(frozen=True)
class VerifyCall:
    """One Verify of a session's step: the committed tokens and the position the target holds, the draft block (a
    chain; the nodes of a token tree when tree_parents is set) and the step's sampling."""

    session_id: str
    committed: list[int]
    pos: int
    draft_tokens: list[int]
    draft_probs: list  # repeated Distribution, as the draft sent them
    params: SamplingParams
    seed: int = 0
    step: int = 0
    tree_parents: list[int] | None = None
    prompt_len: int = 0  # the first prompt_len committed tokens are the prompt (TokenDelta.prompt_len)


@dataclass(frozen=True)
class DecodeCall:
    """One target-only Decode or DecodeStream: up to max_tokens tokens after the committed ones, ending at any of
    stop_token_ids. A stream sends its tokens in blocks of block_tokens, its first of first_block_tokens (0: a
    block's); with max_block_tokens, the blocks after the first double from block_tokens up to it."""

    session_id: str
    committed: list[int]
    pos: int
    max_tokens: int
    params: SamplingParams
    seed: int = 0
    step: int = 0
    stop_token_ids: tuple[int, ...] = ()
    block_tokens: int = 1
    first_block_tokens: int = 0
    max_block_tokens: int = 0
    prompt_len: int = 0  # the first prompt_len committed tokens are the prompt (TokenDelta.prompt_len)

    def request(self, delta: common_pb2.TokenDelta) -> target_pb2.DecodeRequest:
        return target_pb2.DecodeRequest(session_id=self.session_id, delta=delta, max_tokens=self.max_tokens,
                                        sampling=wire.sampling_to_proto(self.params, self.seed), step=self.step,
                                        stop_token_ids=self.stop_token_ids, block_tokens=self.block_tokens,
                                        first_block_tokens=self.first_block_tokens,
                                        max_block_tokens=self.max_block_tokens)


@dataclass
class DraftReply:
    tokens: list[int]
    probs: list  # repeated Distribution, passed through to the target untouched
    cached_len: int
    draft_ms: float
    resynced: bool
    tree_parents: list[int] | None = None  # tree speculation: tokens/probs are the nodes of this tree
    scores: list[float] = field(default_factory=list)  # the drafter's evidence per token (may be empty)


@dataclass
class VerifyReply:
    num_accepted: int
    next_token: int
    cached_len: int
    verify_ms: float
    resynced: bool
    accepted_nodes: list[int] = field(default_factory=list)  # tree speculation: the accepted path


@dataclass
class DecodeReply:
    tokens: list[int]
    cached_len: int
    decode_ms: float
    resynced: bool


class DecodeStream:
    """An open DecodeStream call: its first block (taken when it was opened, so a cache-miss or an unavailable
    target surfaces there) and the blocks after it."""

    def __init__(self, call, first: DecodeReply):
        self.call, self.first, self.resynced = call, first, False

    def next(self) -> DecodeReply | None:
        """The next block; None when the stream ended. Raises grpc.RpcError when it failed."""
        try:
            r = next(self.call)
        except StopIteration:
            return None
        return DecodeReply(list(r.tokens), r.cached_len, r.decode_ms, False)

    def cancel(self) -> None:
        self.call.cancel()


class DraftClient:
    def __init__(self, address: str, channel: grpc.Channel | None = None):
        self.address = address
        self.channel = channel or make_channel(address)
        self.stub = draft_pb2_grpc.DraftServiceStub(self.channel)

    def info(self, timeout: float = 5.0) -> common_pb2.ModelInfo:
        return self.stub.GetInfo(common_pb2.GetInfoRequest(), timeout=timeout, wait_for_ready=True)

    def propose(self, call: ProposeCall, timeout: float) -> DraftReply:
        sampling = wire.sampling_to_proto(call.params, call.seed)

        def send(delta):
            return self.stub.Propose(
                draft_pb2.ProposeRequest(session_id=call.session_id, delta=delta, max_draft_len=call.max_len,
                                         sampling=sampling, step=call.step, min_confidence=call.min_confidence,
                                         kv=call.kv, principal=call.principal, **(call.tree or {})),
                timeout=timeout,
            )

        r, resynced = _call_with_resync(send, call.committed, call.pos)
        if len(r.tree.tokens) or len(r.tree.parents):
            return DraftReply(list(r.tree.tokens), list(r.tree.probs), r.cached_len, r.draft_ms, resynced,
                              list(r.tree.parents))
        return DraftReply(list(r.tokens), list(r.probs), r.cached_len, r.draft_ms, resynced,
                          scores=list(r.token_scores))

    def propose_async(self, session_id: str, prefix_len: int, delta: list[int], max_len: int,
                      params: SamplingParams, seed: int, step: int, timeout: float):
        """Start a Propose without waiting (pipelining); call .result() on the returned future for the reply."""
        request = draft_pb2.ProposeRequest(
            session_id=session_id, delta=common_pb2.TokenDelta(prefix_len=prefix_len, tokens=delta),
            max_draft_len=max_len, sampling=wire.sampling_to_proto(params, seed), step=step)
        return self.stub.Propose.future(request, timeout=timeout)

    def release(self, session_id: str, timeout: float = 1.0) -> bool:
        return self.stub.Release(common_pb2.ReleaseRequest(session_id=session_id), timeout=timeout).released

    def release_async(self, session_id: str, timeout: float = 1.0, final_delta: common_pb2.TokenDelta | None = None):
        """final_delta: the session's tokens after those the drafter was shown (a reply's last block), taken in
        before its state is freed."""
        return _release_async(self.stub, self.address, session_id, timeout, final_delta)

    def close(self) -> None:
        self.channel.close()


class TargetClient:
    def __init__(self, address: str, channel: grpc.Channel | None = None):
        self.address = address
        self.channel = channel or make_channel(address)
        self.stub = target_pb2_grpc.TargetServiceStub(self.channel)

    def info(self, timeout: float = 5.0) -> common_pb2.ModelInfo:
        return self.stub.GetInfo(common_pb2.GetInfoRequest(), timeout=timeout, wait_for_ready=True)

    def verify(self, call: VerifyCall, timeout: float, wait_for_ready: bool = False) -> VerifyReply:
        sampling = wire.sampling_to_proto(call.params, call.seed)
        if call.tree_parents is not None:
            tree = common_pb2.TokenTree(parents=call.tree_parents, tokens=call.draft_tokens, probs=call.draft_probs)
            fields = dict(tree=tree)
        else:
            fields = dict(draft_tokens=call.draft_tokens, draft_probs=call.draft_probs)

        def send(delta):
            return self.stub.Verify(
                target_pb2.VerifyRequest(session_id=call.session_id, delta=delta, sampling=sampling, step=call.step,
                                         **fields),
                timeout=timeout, wait_for_ready=wait_for_ready,
            )

        r, resynced = _call_with_resync(send, call.committed, call.pos, call.prompt_len)
        return VerifyReply(r.num_accepted, r.next_token, r.cached_len, r.verify_ms, resynced,
                           list(r.accepted_nodes))

    def prefill(self, session_id: str, committed: list[int], pos: int, timeout: float,
                export_kv: bool = False, prompt_len: int = 0) -> target_pb2.PrefillResponse:
        """Prefill committed[pos:] (from 0 after a cache miss) and wait; with export_kv the reply carries the
        session's KV (PrefillResponse.kv, empty when the target leaves it out). prompt_len: TokenDelta's."""
        def call(delta):
            return self.stub.Prefill(target_pb2.PrefillRequest(session_id=session_id, delta=delta, export_kv=export_kv),
                                     timeout=timeout)

        return _call_with_resync(call, committed, pos, prompt_len)[0]

    def prefill_async(self, session_id: str, committed: list[int], pos: int, timeout: float, prompt_len: int = 0):
        """Start a Prefill of committed[pos:] without waiting; the future's .result().cached_len is what the target
        then holds (a cache miss raises: the caller's next call resends from 0 anyway)."""
        request = target_pb2.PrefillRequest(session_id=session_id, delta=_delta(committed, pos, prompt_len))
        return self.stub.Prefill.future(request, timeout=timeout)

    def decode(self, call: DecodeCall, timeout: float, wait_for_ready: bool = False) -> DecodeReply:
        def send(delta):
            return self.stub.Decode(call.request(delta), timeout=timeout, wait_for_ready=wait_for_ready)

        r, resynced = _call_with_resync(send, call.committed, call.pos, call.prompt_len)
        return DecodeReply(list(r.tokens), r.cached_len, r.decode_ms, resynced)

    def decode_stream(self, call: DecodeCall, timeout: float, wait_for_ready: bool = False) -> DecodeStream:
        """Open a DecodeStream of up to call.max_tokens tokens (the whole stream within `timeout`; the target ends it
        cleanly a little before) and wait for its first block."""
        def send(delta):
            stream = self.stub.DecodeStream(call.request(delta), timeout=timeout, wait_for_ready=wait_for_ready)
            try:
                r = next(stream)
            except StopIteration:  # a target never ends a stream without a token; if one did, say so as a failure
                raise _EmptyStream() from None
            except BaseException:
                stream.cancel()
                raise
            return DecodeStream(stream, DecodeReply(list(r.tokens), r.cached_len, r.decode_ms, False))

        r, resynced = _call_with_resync(send, call.committed, call.pos, call.prompt_len)
        r.resynced = r.first.resynced = resynced
        return r

    def release(self, session_id: str, timeout: float = 1.0) -> bool:
        return self.stub.Release(common_pb2.ReleaseRequest(session_id=session_id), timeout=timeout).released

    def release_async(self, session_id: str, timeout: float = 1.0):
        return _release_async(self.stub, self.address, session_id, timeout)

    def reset_prompt_cache(self, timeout: float = 10.0) -> int:
        """Drop the prompts the target keeps for later sessions; returns how many it dropped."""
        return self.stub.ResetPromptCache(target_pb2.ResetPromptCacheRequest(), timeout=timeout).dropped

    def close(self) -> None:
        self.channel.close()


class _EmptyStream(grpc.RpcError):
    """A DecodeStream that ended before its first block (as UNAVAILABLE: the caller tries again)."""

    def code(self):
        return grpc.StatusCode.UNAVAILABLE

    def details(self):
        return "the target ended a decode stream before its first block"
