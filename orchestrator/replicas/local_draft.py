"""An in-process draft replica (`--draft local:suffix` or `local:ngram`): a model-free drafter inside the orchestrator.

Model-free drafting needs no accelerator and reads only the committed tokens, which the orchestrator already
holds, so its cheapest home is the orchestrator itself (vLLM runs its n-gram proposer in the engine for the same
reason): every speculative step then costs one round trip (Verify) instead of two. It runs the draft service's
own servicer (same validation, same proposer, same datastore) with the transport taken out, and sits in the
draft pool like any replica, so the generation loop does not know the difference. Model drafts stay services.
"""

from __future__ import annotations

import concurrent.futures
import logging

import grpc

from orchestrator.replicas.clients import DraftClient

log = logging.getLogger("specdec.orchestrator")

LOCAL_PREFIX = "local:"
LOCAL_STRATEGIES = ("ngram", "suffix")


def is_local(address: str) -> bool:
    return address.startswith(LOCAL_PREFIX)


class LocalRpcError(grpc.RpcError):
    """What a servicer's context.abort raises in process: the same code() / details() as a remote error."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class _Context:
    def abort(self, code: grpc.StatusCode, details: str):
        raise LocalRpcError(code, details)

    def invocation_metadata(self):
        return ()

    def is_active(self) -> bool:
        return True  # an in-process call is never cancelled under it


class _Method:
    """A servicer method with the call shapes of a grpc stub method: call(request, timeout=...) and .future()."""

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, request, timeout: float | None = None, **_):
        return self.fn(request, _Context())

    def future(self, request, timeout: float | None = None, **_) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        try:
            future.set_result(self(request))
        except grpc.RpcError as e:
            future.set_exception(e)
        return future


class _Stub:
    def __init__(self, servicer):
        self.Propose = _Method(servicer.Propose)
        self.Release = _Method(servicer.Release)
        self.GetInfo = _Method(servicer.GetInfo)


class LocalDraftClient(DraftClient):
    """DraftClient whose stub calls an in-process DraftServicer."""

    def __init__(self, address: str, servicer):
        self.address = address
        self.channel = None  # no channel: DraftReplica then has no health stub (never health-checked)
        self.servicer = servicer
        self.stub = _Stub(servicer)

    def close(self) -> None:
        pass


def build_local_client(address: str, tokenizer, target_name: str, vocab_size: int,
                       datastore: str = "auto") -> LocalDraftClient:
    """`local:ngram`: the n-gram drafter for the target's tokenizer, with the target's datastore when one is cached
    (`specdec datastore`; ``datastore``: auto, none or a path, as the draft service's --datastore). `local:suffix`:
    the suffix-tree drafter (draft_service/proposers/suffix.py), drafting up to the longest block it advertises."""
    from draft_service.build import build_ngram_proposer, build_suffix_proposer
    from draft_service.servicer import DraftServicer

    strategy = address[len(LOCAL_PREFIX):]
    if strategy not in LOCAL_STRATEGIES:
        raise ValueError(f"unknown in-process drafter {address!r}: only "
                         f"{', '.join(LOCAL_PREFIX + s for s in LOCAL_STRATEGIES)} (model drafts run as draft services)")
    if strategy == "suffix":
        proposer, info = build_suffix_proposer(tokenizer, vocab_size)
        log.info("in-process suffix-tree drafter", extra={"replica": address})
        return LocalDraftClient(address, DraftServicer(proposer, info, max_draft_len=info.max_draft_len))
    proposer, info = build_ngram_proposer(tokenizer, target_name, datastore, vocab_size)
    log.info("in-process n-gram drafter", extra={"replica": address, "datastore": proposer.datastore is not None})
    return LocalDraftClient(address, DraftServicer(proposer, info))
