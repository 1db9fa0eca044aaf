"""CancelSession of a session this orchestrator does not stream: it is written like any other write, under the
session's lease (a new fencing epoch), by whichever orchestrator can take that lease."""

from __future__ import annotations

import math

from specdec.v1 import orchestrator_pb2 as opb


def lease_wait_s(store, context) -> float:
    """How long to wait for another stream's lease: its TTL, within the caller's deadline (the HTTP API's stand-in
    context has none)."""
    remaining = getattr(context, "time_remaining", lambda: None)()
    return min(store.lease_ttl_s + 0.5, math.inf if remaining is None else max(0.0, remaining - 0.5))


def cancel_stored(store, session_id: str, token: str, load, wait_s: float) -> tuple[bool, bool]:
    """Cancel a running session that is not streaming here; (cancelled, written here: its caches are ours to
    free). `load()` reads the stored record once the lease is ours.

    If another orchestrator streams it, a live stream writes the cancellation itself at its next commit (its lease
    fences us out), while a dead one never will: so ask for it, then wait the lease out (a live stream renews it,
    and the wait ends within ~0.2 s) and write it here. After `wait_s` the request stays set for the stream."""
    asked = store.acquire_lease(session_id, token, wait_s=0) is not None
    if asked:
        store.request_cancel(session_id)
        if store.acquire_lease(session_id, token, wait_s=wait_s) is not None:
            return True, False
        store.clear_cancel_request(session_id)
    try:
        rec = load()
        if rec.status != "running":  # ended meanwhile: cancelled by our request, or finished first
            return asked and rec.status == "cancelled", False
        rec.status, rec.finish_reason = "cancelled", opb.FINISH_REASON_CANCELLED
        store.update_state(rec, token)
    finally:
        store.release_lease(session_id, token)
    return True, True
