"""A request's admission check, in one place for the gRPC and HTTP APIs: every field checked against the limits in
force, and the limits the generation runs under resolved once, into the GenerationParams the session keeps
(orchestrator/store/records.py). Nothing downstream clamps a request's limit again; the draft and target services
only refuse what exceeds their own advertised capacity."""

from __future__ import annotations

import math
from dataclasses import dataclass

import grpc

from orchestrator.api.prompts import chat_prompt_ids
from orchestrator.store.records import GenerationParams
from specdec.core.grpc_util import RpcAbort
from specdec.v1 import orchestrator_pb2 as opb


@dataclass(frozen=True)
class RequestLimits:
    """The limits a request is checked against and resolved within, as they stand when it is admitted."""
    max_new_tokens: int  # --max-new-tokens-limit
    max_draft_len: int  # the smallest of the orchestrator's, the target's and the drafts' advertised limits
    vocab_size: int
    max_context: int  # the target model's context
    max_prompt_tokens: int
    max_prompt_bytes: int = 1 << 20
    max_stop_strings: int = 16
    max_stop_string_bytes: int = 256
    max_stop_token_ids: int = 64


def smallest_limit(*limits: int) -> int:
    """The smallest of the limits that are set (0: not advertised); 0 when none is."""
    return min((x for x in limits if x), default=0)


def bad_request(message: str) -> RpcAbort:
    return RpcAbort(grpc.StatusCode.INVALID_ARGUMENT, message)


def draft_len_limit(requested: int, limits: RequestLimits) -> int:
    """The longest draft a step of this request may ask the services for (a prefetch asks one more than the
    step's length): the limits' ceiling. A request asking for a fixed length beyond it is refused."""
    if requested > limits.max_draft_len:
        raise bad_request(f"max_draft_len {requested} exceeds the limit of {limits.max_draft_len}")
    return limits.max_draft_len


def resolve_resumed(params: GenerationParams, limits: RequestLimits) -> None:
    """A resumed session's draft lengths within the limits of the services it runs on now (they may advertise
    less than when it started): its fixed length, if any, is shortened to fit rather than refused."""
    params.max_draft_len = smallest_limit(params.max_draft_len, limits.max_draft_len)
    params.draft_len_limit = limits.max_draft_len


def check_request(req: opb.GenerateRequest, limits: RequestLimits, tokenizer) -> tuple[list[int], GenerationParams]:
    """The prompt's token ids and the request's parameters, or INVALID_ARGUMENT (OUT_OF_RANGE for a prompt and
    output beyond the model's context) naming the first field that is wrong."""
    if req.max_new_tokens <= 0:
        raise bad_request("max_new_tokens must be at least 1")
    if req.max_new_tokens > limits.max_new_tokens:
        raise bad_request(f"max_new_tokens {req.max_new_tokens} exceeds this server's limit of {limits.max_new_tokens}")
    top_p = _check_sampling(req)
    ceiling = draft_len_limit(req.max_draft_len, limits)
    _check_stops(req, limits)
    ids = prompt_ids(req, limits, tokenizer)
    if len(ids) + req.max_new_tokens > limits.max_context:
        raise RpcAbort(grpc.StatusCode.OUT_OF_RANGE,
                       f"prompt ({len(ids)}) + max_new_tokens ({req.max_new_tokens}) exceeds the model's "
                       f"context of {limits.max_context} tokens")
    params = GenerationParams(temperature=float(req.temperature), top_k=int(req.top_k), top_p=float(top_p),
                              seed=int(req.seed), max_new_tokens=int(req.max_new_tokens), stop=list(req.stop),
                              stop_token_ids=list(req.stop_token_ids),
                              speculation=req.speculation != opb.SPECULATION_OFF,
                              max_draft_len=int(req.max_draft_len), draft_len_limit=ceiling,
                              ignore_eos=bool(req.ignore_eos))
    return ids, params


def _check_sampling(req: opb.GenerateRequest) -> float:
    """Temperature, top-k and top-p checked; top_p with 0 (unset) read as 1."""
    if math.isnan(req.temperature) or math.isinf(req.temperature) or req.temperature < 0:
        raise bad_request(f"temperature must be a finite number >= 0, got {req.temperature}")
    top_p = req.top_p if req.top_p != 0 else 1.0
    if math.isnan(top_p) or not 0 < top_p <= 1:
        raise bad_request(f"top_p must be in (0, 1], got {req.top_p}")
    if req.top_k < 0:
        raise bad_request(f"top_k must be >= 0, got {req.top_k}")
    return top_p


def _check_stops(req: opb.GenerateRequest, limits: RequestLimits) -> None:
    if len(req.stop) > limits.max_stop_strings:
        raise bad_request(f"stop has {len(req.stop)} strings; the limit is {limits.max_stop_strings}")
    for i, stop in enumerate(req.stop):
        if len(stop.encode()) > limits.max_stop_string_bytes:
            raise bad_request(f"stop[{i}] is {len(stop.encode())} bytes long; the limit is "
                              f"{limits.max_stop_string_bytes} bytes")
    if len(req.stop_token_ids) > limits.max_stop_token_ids:
        raise bad_request(f"stop_token_ids has {len(req.stop_token_ids)} ids; the limit is {limits.max_stop_token_ids}")
    bad = [t for t in req.stop_token_ids if t >= limits.vocab_size]
    if bad:
        raise bad_request(f"stop_token_ids: token id {bad[0]} is outside the vocabulary (size {limits.vocab_size})")


def prompt_ids(req: opb.GenerateRequest, limits: RequestLimits, tokenizer) -> list[int]:
    """The prompt as token ids: a text prompt tokenized (with the chat template when asked), token ids checked."""
    which = req.WhichOneof("prompt")
    if which == "text":
        if len(req.text.encode()) > limits.max_prompt_bytes:
            raise bad_request(f"text prompt is {len(req.text.encode())} bytes long; the limit is "
                              f"{limits.max_prompt_bytes} bytes")
        if not req.text.strip():
            raise bad_request("prompt is empty")
        if tokenizer is None:
            raise bad_request("this orchestrator has no tokenizer; send token_ids")
        if req.apply_chat_template:
            ids = chat_prompt_ids(tokenizer, [{"role": "user", "content": req.text}])
        else:
            ids = tokenizer.encode(req.text, add_special_tokens=True)
    elif which == "token_ids":
        ids = list(req.token_ids.ids)
        if not ids:
            raise bad_request("prompt is empty")
        if len(ids) > limits.max_prompt_tokens:
            raise bad_request(f"token_ids has {len(ids)} tokens; the limit is {limits.max_prompt_tokens}")
        bad = [t for t in ids if t >= limits.vocab_size]
        if bad:
            raise bad_request(f"prompt token id {bad[0]} is outside the vocabulary (size {limits.vocab_size})")
    else:
        raise bad_request("prompt is empty: set text or token_ids")
    if len(ids) > limits.max_prompt_tokens:
        raise bad_request(f"prompt has {len(ids)} tokens; the limit is {limits.max_prompt_tokens}")
    return ids
