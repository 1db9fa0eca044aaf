"""The running system's design outline (`specdec outline`, Orchestrator.GetOutline).

Everything here is read from the live orchestrator: its loop configuration, the models the services
reported, the acceptance measured over its recent verify steps, the draft breaker's state and (when
telemetry is installed) the measured round-trip latencies of draft and verify calls. The draft's
ModelInfo is cached, so an outline request never waits long on a draft that is down.
"""

from __future__ import annotations

import dataclasses
import threading
import time
import weakref
from dataclasses import dataclass
from urllib.parse import urlsplit

import grpc

from orchestrator.loop.state import Measurements
from orchestrator.policy.draft_length import GoodputDraftLength
from orchestrator.replicas.draft_pool import DraftPool
from orchestrator.replicas.pool import OPEN, Replica
from orchestrator.replicas.target_pool import TargetPool
from orchestrator.settings import LoopConfig
from specdec.core.security import redact_url

DRAFT_INFO_TIMEOUT_S = 0.5  # how long an outline request may wait on the draft's GetInfo
DRAFT_INFO_TTL_S = 60.0     # re-ask a reachable draft after this long (it may have been replaced)
DRAFT_RETRY_S = 5.0         # re-ask an unreachable draft after this long

_cache: "weakref.WeakKeyDictionary[object, tuple[float, object, str]]" = weakref.WeakKeyDictionary()
_cache_lock = threading.Lock()


@dataclass(frozen=True)
class OutlineState:
    """What the outline reads from the running orchestrator (OrchestratorServicer.outline_state())."""

    cfg: LoopConfig
    measured: Measurements
    target_info: object  # common_pb2.ModelInfo, the target pool's merged answer
    targets: TargetPool
    drafts: DraftPool | None  # None: no speculation configured
    store_url: str  # redacted of its password
    active_streams: int

    @property
    def draft_replicas(self) -> list:
        return list(self.drafts.replicas) if self.drafts is not None else []


def _replica_info(replica: Replica):
    """(ModelInfo or None, status): status 'reachable', 'unreachable: CODE' or 'refused: why'.

    The pool's own cached info is used when it has one; else GetInfo with a short deadline, cached
    (long on success, short on failure) so outline requests never pile up on a dead draft."""
    if replica.refused:
        return replica.info, f"refused: {replica.refused}"
    known = replica.info
    now = time.monotonic()
    with _cache_lock:
        hit = _cache.get(replica)
    breaker_open = replica.breaker.state == OPEN
    if hit is not None and hit[0] > now and not (breaker_open and hit[2] == "reachable"):
        return hit[1] or known, hit[2]
    try:
        info = replica.client.info(timeout=DRAFT_INFO_TIMEOUT_S)
    except Exception as e:  # noqa: BLE001 - grpc.RpcError or a closed channel: the draft is unreachable
        name = e.code().name if isinstance(e, grpc.RpcError) else type(e).__name__
        prev = known or (hit[1] if hit is not None else None)  # what the draft said when it last answered
        entry = (now + DRAFT_RETRY_S, prev, f"unreachable: {name}")
    else:
        entry = (now + DRAFT_INFO_TTL_S, info, "reachable")
    with _cache_lock:
        _cache[replica] = entry
    return entry[1], entry[2]


REDACTED = "<redacted: admin only>"


def _internal_addresses(state: OutlineState) -> set[str]:
    """The addresses the outline may reveal: target replicas, draft replicas, the store's host:port."""
    found = {r.address for r in state.targets.replicas}
    found |= {r.address for r in state.draft_replicas}
    store_url = state.store_url
    try:
        parts = urlsplit(store_url)
        found |= {store_url, parts.netloc, parts.netloc.rpartition("@")[2]}
    except ValueError:
        found.add(store_url)
    return {a for a in found if a and a != "memory://" and not a.startswith("local:")}  # local: names a mode


def redact_addresses(value, addresses: set[str]):
    """The outline with every occurrence of an internal address replaced (longest first, so a URL goes whole)."""
    if isinstance(value, dict):
        return {k: redact_addresses(v, addresses) for k, v in value.items()}
    if isinstance(value, list):
        return [redact_addresses(v, addresses) for v in value]
    if isinstance(value, str):
        for a in sorted(addresses, key=len, reverse=True):
            value = value.replace(a, REDACTED)
    return value


def _model_dict(info) -> dict:
    """A ModelInfo's name, strategy and the facts it reports (the ones it leaves empty left out)."""
    if info is None:
        return {}
    out = {"name": info.model_name, "strategy": info.strategy}
    if info.vocab_size:
        out["vocabSize"] = int(info.vocab_size)
    if info.max_context:
        out["maxContext"] = int(info.max_context)
    if info.device:
        out["device"] = info.device
    if info.dtype:
        out["dtype"] = info.dtype
    if info.tokenizer_fingerprint:
        out["tokenizerFingerprint"] = info.tokenizer_fingerprint[:12]
    return out


def _tree_settings(cfg: LoopConfig) -> dict:
    """The loop config's tree-speculation settings that are set."""
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)
            if "tree" in f.name and getattr(cfg, f.name) not in (None, 0, False, "", (), [])}


def _measured_latency_ms() -> dict:
    """Mean orchestrator-side round trips of draft Propose / target Verify / target Decode, if recorded."""
    from specdec import observability as telemetry

    if not telemetry.providers_installed():
        return {}
    entry = telemetry.snapshot().get("rpc.client.call.duration")
    if not entry:
        return {}
    out = {}
    for key, method in (("draftRoundTripMs", "Propose"), ("verifyRoundTripMs", "Verify"),
                        ("decodeRoundTripMs", "Decode")):
        pts = [p for p in entry["points"] if p["attributes"].get("rpc.method") == method
               and p["attributes"].get("rpc.grpc.status_code") == "OK"]
        count = sum(p["count"] for p in pts)
        if count:
            out[key] = round(sum(p["sum"] for p in pts) / count * 1e3, 3)
    return out


def _draft_view(state: OutlineState) -> dict:
    """Per-replica info and status, and the first known ModelInfo."""
    reps = []
    info = None
    for r in state.draft_replicas:
        r_info, status = _replica_info(r)
        info = info or r_info
        entry = {"address": r.address, "status": status, "breaker": r.breaker.state}
        if r_info is not None:
            entry["model"] = r_info.model_name
        reps.append(entry)
    return {"replicas": reps, "info": info}


def _draft_status(view: dict) -> str:
    reps = view["replicas"]
    if not reps:
        return "not configured"
    up = [r for r in reps if r["status"] == "reachable"]
    if len(reps) == 1:
        return reps[0]["status"]
    return f"{len(up)} of {len(reps)} replicas reachable"


def _draft_strategy(state: OutlineState, view: dict) -> dict:
    cfg = state.cfg
    info, reps = view["info"], view["replicas"]
    status = _draft_status(view)
    tree = _tree_settings(cfg)
    kind = (info.strategy if info is not None else ("unknown" if reps else "none")) or "unknown"
    if not reps:
        drafter = "none: no draft service configured; every step is a target-only Decode"
    elif kind == "ngram":
        drafter = ("n-gram prompt lookup (model-free): every earlier occurrence of the context's last 1-3 tokens "
                   "votes for what followed it (plus the n-gram datastore, if any); the best-voted path is the chain, "
                   "the best-voted nodes the tree; deterministic, so q is one-hot")
    elif kind == "model":
        drafter = (f"draft model {info.model_name}: a small causal LM sharing the target's tokenizer proposes k "
                   "tokens autoregressively from its own per-session KV cache")
    elif kind == "quantized":
        drafter = (f"the target's own weights in int8 ({info.model_name}): proposes k tokens autoregressively from "
                   "its own per-session KV cache, at a fraction of the target's cost per token")
    elif kind == "hybrid":
        drafter = (f"hybrid {info.model_name}: n-gram prompt lookup where the context repeats itself, else the "
                   "draft model for a few tokens from its per-session KV cache (it catches up lazily)")
    else:
        drafter = f"draft service ({status}); its kind is not known yet"
    if reps and not any(r["status"] == "reachable" for r in reps):
        drafter += f" [currently {status}: steps fall back to target-only decoding]"
    default_k, max_k = cfg.default_draft_len, cfg.max_draft_len
    adaptive = bool(cfg.adaptive_draft_len)
    goodput = adaptive and cfg.draft_len_policy == "goodput" and \
        state.measured.target_cost is not None
    if goodput:
        policy = (f"adaptive per session (goodput): each step drafts the k in 0..{max_k} that maximises expected "
                  "tokens per ms, (1 - a^(k+1)) / (1 - a) over the target's measured forward cost for k + 1 tokens "
                  "(its start-up profile, scaled by the load it reports; on a batching target, for k + 1 tokens "
                  "from every generating session, so drafts shrink as load grows) plus the measured draft cost and "
                  "the orchestrator's own time per step, which target-only Decode calls pay once per chunk; a = the "
                  "session's recent per-token acceptance; k = 0 (target-only) when no k pays, probed again every "
                  "few steps; a drafter that scores its tokens (n-gram) is asked for up to "
                  f"{GoodputDraftLength.EVIDENCE_REQUEST} and only the prefix that pays is verified (at least one "
                  "token), by the acceptance each order of magnitude of score has shown across sessions; a request's "
                  "max_draft_len fixes k instead")
    elif adaptive:
        policy = (f"adaptive per session (heuristic): starts at {default_k}, +2 after a fully accepted block, -1 "
                  f"after a rejection, within 1..{max_k}; a request's max_draft_len fixes k instead")
    else:
        policy = f"fixed: k = the request's max_draft_len or the default {default_k}, at most {max_k}"
    policy += ("; never more than the tokens left minus one; a drafter may return fewer (a short n-gram "
               "continuation), and an empty draft makes that step one target-only token")
    limit = int(cfg.speculation_max_sessions or 0)
    if limit:
        policy += f"; target-only while more than {limit} sessions are generating (load switch)"
    pipeline = cfg.pipeline
    pipelining = {"off": "off: draft, then verify", "on": "on: the next block is drafted while the target verifies",
                  "auto": "auto: the next block is drafted during verification when the measured full-block rate "
                          "x Propose round trip beats the minimum gain"}.get(pipeline, pipeline)
    out = {
        "kind": kind,
        "drafter": drafter,
        "structure": "tree" if tree else "chain",
        "structureDetail": (f"token tree verified in one target forward with a tree attention mask: {tree}" if tree
                            else "one linear chain of k draft tokens per step, verified in one target forward"),
        **({"chainsOnly": f"{info.model_name} drafts chains only (no tree attention mask in its forward): tree "
                          "requests get a chain, verified as a chain"}
           if tree and info is not None and not info.drafts_trees else {}),
        "draftLength": {"policy": policy, "adaptive": adaptive, "default": default_k, "max": max_k},
        "pipelining": pipelining,
        "status": status,
    }
    if reps:
        out["replicas"] = reps
        if len(reps) > 1:
            out["placement"] = ("a session sticks to one replica (rendezvous hashing of session id and address) "
                                "and fails over to the next in its ranking")
    return out


def _verification(state: OutlineState) -> dict:
    where = ", ".join(r.address for r in state.targets.replicas) or "the target service"
    return {
        "scheme": "greedy when temperature is 0, rejection sampling otherwise (chosen per request)",
        "greedy": ("accept draft tokens while each equals the target's argmax; the first mismatch is replaced "
                   "by the target's argmax (plus a bonus token when all k match): output identical to "
                   "target-only greedy decoding"),
        "sampling": ("speculative rejection sampling (Leviathan et al. 2023; Chen et al. 2023): accept x_i with "
                     "probability min(1, p(x_i)/q(x_i)), else sample from norm(max(0, p - q)); a bonus token from p "
                     "when all k are accepted; a deterministic drafter (n-gram) has one-hot q, so x_i is accepted "
                     "with probability p(x_i). Committed tokens are distributed exactly as the target's samples"),
        "runsOn": f"target service ({where}): one forward over the new context + k draft tokens gives k+1 rows",
        "network": ("only token ids cross the network (deltas past each service's cached position), plus the "
                    "draft's fp16 distributions q when a model drafter samples; the target's full logits never "
                    "leave the target service, which answers (num_accepted, next_token)"),
        "randomness": "seeded per (seed, step, stream): a resumed session draws the same random numbers",
        "lossless": True,
        **({"tree": ("tree speculation (--tree-budget): the whole token tree is verified in one target forward "
                     "(tree attention mask, positions = context + depth); greedy follows the child equal to the "
                     "target's argmax; sampling tries the siblings in draw order, accepting x_j with probability "
                     "min(1, p_j(x_j)/q_j(x_j)) and else continuing with p_{j+1} = norm(max(0, p_j - q_j)) "
                     "(SpecInfer multi-step speculative sampling; siblings drawn without replacement, q_j zeroes the "
                     "earlier siblings); only the accepted path's KV is kept")}
           if _tree_settings(state.cfg) else {}),
    }


def _acceptance(state: OutlineState) -> dict:
    snap = state.measured.window.snapshot()
    rate = snap.get("acceptance_rate")
    out = {
        "value": round(rate, 4) if rate is not None else None,
        "windowSteps": snap.get("window_steps"),
        "stepsObserved": snap.get("steps", 0),
        "draftTokensProposed": snap.get("proposed", 0),
        "draftTokensAccepted": snap.get("accepted", 0),
        "meanAcceptedLength": (round(snap["mean_accepted_length"], 4)
                               if snap.get("mean_accepted_length") is not None else None),
        "scope": "accepted / proposed draft tokens over this orchestrator's most recent verify steps, all sessions",
    }
    if rate is None:
        out["note"] = "no verify steps yet"
    return out


def _failure_mode(state: OutlineState, view: dict) -> dict:
    from specdec import observability as telemetry

    cfg = state.cfg
    chunk = cfg.fallback_chunk
    if state.draft_replicas:
        timings = state.drafts.settings
        breaker_text = (f"that replica's circuit breaker opens for {timings.breaker_open_s:g} s (doubling after a "
                        f"failed probe, up to {timings.breaker_max_open_s:g} s; a passing health check every "
                        f"{timings.health_interval_s:g} s lets one probe call through)")
    else:
        breaker_text = "the draft is skipped for a short cool-down before it is tried again"
    out = {
        "draftFailure": (f"a draft error, deadline or malformed reply never fails a request: {breaker_text}; the "
                         "session moves to its next healthy replica (which rebuilds its cache from the committed "
                         f"tokens) or, with none left, decodes target-only (one Decode of up to {chunk} tokens per "
                         "step) until a replica answers again. Output is unchanged; only speed drops"),
        "draftDeadline": (f"max({cfg.draft_timeout_floor_ms:g} ms, "
                          f"{cfg.draft_timeout_factor:g} x the larger of one measured target step and "
                          "k drafted tokens at the drafts' measured time per token, each capped at a target step); "
                          "a call that must first prefill the context (new session, failover) adds the context at "
                          "the drafts' measured prefill time per token (capped likewise), or x (1 + context/128) "
                          f"until that is measured; {cfg.draft_first_call_timeout_ms:g} ms before "
                          "any target step has been measured"),
        "targetFailure": ("the target is required: a session on a target replica that goes away moves at once to "
                          "another healthy replica, which rebuilds its cache from the committed tokens; with none "
                          f"left, a step waits up to {cfg.target_grace_s:g} s for one to come back, then ends the stream with UNAVAILABLE; committed tokens "
                          "are in the session store, so the client resumes with resume_session_id"),
        "cacheLoss": ("a service that lost a session's KV cache (eviction, restart, another replica) answers "
                      "cache-miss; the orchestrator resends the whole context once and continues"),
        "sessionStore": (f"each committed block is written to the session store (one atomic script, fenced by the session's lease) before the client "
                         f"sees it; a step waits up to {cfg.store_grace_s:g} s for an unreachable store, "
                         "then fails with UNAVAILABLE, resumable later"),
        "draftStatus": _draft_status(view),
    }
    if telemetry.providers_installed():
        entry = telemetry.snapshot().get("specdec.draft.failures")
        if entry:
            by_kind: dict = {}
            for p in entry["points"]:
                kind = str(p["attributes"].get("kind", "unknown"))
                by_kind[kind] = by_kind.get(kind, 0) + int(p["value"])
            out["draftFailuresByKind"] = by_kind
    return out


def estimate_speedup(acceptance: dict, measured: dict, target_step_ms: float | None = None) -> dict:
    """Expected speedup of sequential steps over target-only decoding, from what this orchestrator measured:
    Leviathan et al.'s (1 - a^(g+1)) / ((1 - a)(g c + r)) with the per-token acceptance a, the tokens drafted per
    verify step g, c = one drafted token's share of a Propose round trip and r = a Verify round trip, both over
    one target step (its profiled one-token forward; without it the Verify round trip, so r = 1 as in the
    paper)."""
    rate = acceptance.get("value")
    steps, proposed = acceptance.get("stepsObserved"), acceptance.get("draftTokensProposed")
    d, v = measured.get("draftRoundTripMs"), measured.get("verifyRoundTripMs")
    if rate is None or d is None or not v or not steps or not proposed:
        return {}
    from specdec.core.sampling import expected_accepted_length

    step = target_step_ms if target_step_ms and target_step_ms > 0 else v
    per_step = proposed / steps
    g, c, r = max(1, round(per_step)), d / per_step / step, v / step
    tokens = expected_accepted_length(min(max(rate, 0.0), 1.0), g)
    return {"estimatedSpeedup": round(tokens / (g * c + r), 3),
            "estimate": {"draftLength": g, "draftCostRatio": round(c, 4), "verifyCostRatio": round(r, 4),
                         "targetStepMs": round(step, 3),
                         "note": "sequential steps; a pipelined step drafts the next block during the verify"}}


def _trade_off(state: OutlineState, acceptance: dict) -> dict:
    cfg = state.cfg
    default_k = cfg.default_draft_len
    out = {
        "summary": ("each speculative step spends one draft call (k small-model forwards, or a lookup for n-gram) "
                    "and one target forward over k+1 positions to commit 1..k+1 tokens; it is faster than "
                    "target-only decoding when the mean accepted length outweighs the draft's cost and the extra "
                    "network round trip, and wastes target compute on the rejected positions"),
        "costPerStep": ("2 gRPC round trips (orchestrator->draft, orchestrator->target; 1 with the n-gram drafter "
                        "inside the orchestrator) + 1 Redis commit script; pipelined, the draft's call for the next "
                        "block runs during the verify; target verify cost grows with k; the draft holds its own KV "
                        "cache per session"),
        "defaultDraftLength": default_k,
    }
    measured = _measured_latency_ms()
    mal = acceptance.get("meanAcceptedLength")
    if mal is not None:
        measured["tokensPerVerifyStep"] = mal
    if measured:
        out["measured"] = measured
    profile = list(state.target_info.forward_ms)
    out.update(estimate_speedup(acceptance, measured, profile[0] if profile else None))
    return out


def build_outline(servicer, show_addresses: bool = True) -> dict:
    """The outline of an OrchestratorServicer (read through its outline_state()); without show_addresses,
    internal addresses (target, drafts, store) are replaced."""
    state: OutlineState = servicer.outline_state()
    view = _draft_view(state)
    status = _draft_status(view)
    store_url = state.store_url
    acceptance = _acceptance(state)

    models = {"target": _model_dict(state.target_info)}
    if not view["replicas"]:
        models["draft"] = {"name": "none", "status": "not configured"}
    else:
        models["draft"] = {**(_model_dict(view["info"]) or {"name": "unknown"}), "status": status}

    components = {
        "orchestrator": {"role": "public gRPC API (specdec.v1.Orchestrator); runs the draft/verify loop and owns "
                                 "session state",
                         "activeStreams": state.active_streams},
        "targetService": {"role": "holds the target model and per-session KV caches; verifies drafts and decodes",
                          "address": state.targets.replicas[0].address if state.targets.replicas else ""},
        "draftService": ({"role": "proposes draft tokens from its own per-session state",
                          "replicas": [r["address"] for r in view["replicas"]], "status": status}
                         if view["replicas"] else {"role": "none", "status": "not configured"}),
        "sessionStore": {"kind": ("redis" if store_url.startswith(("redis", "unix")) else
                                  (store_url.split(":")[0] or "unknown")),
                         "url": redact_url(store_url),
                         "role": "prompt, committed tokens, parameters, RNG step and cache positions per session"},
    }
    outline = {
        "system": "specdec: disaggregated speculative decoding (draft and target as separate gRPC services)",
        "draftStrategy": _draft_strategy(state, view),
        "verification": _verification(state),
        "acceptanceRate": acceptance,
        "failureMode": _failure_mode(state, view),
        "tradeOff": _trade_off(state, acceptance),
        "components": components,
        "models": models,
        "generatedAt": round(time.time(), 3),
    }
    return outline if show_addresses else redact_addresses(outline, _internal_addresses(state))
