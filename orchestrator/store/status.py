"""The gRPC status of a session-store failure, for the public API's handlers."""

from __future__ import annotations

import functools

import grpc

from orchestrator.store.session_store import LeaseLost, SessionLost, StoreFull, StoreUnavailable
from specdec.core.grpc_util import RpcAbort


def store_error(e: Exception) -> RpcAbort | None:
    """The gRPC status of a session-store failure (None: not one)."""
    if isinstance(e, SessionLost):
        return RpcAbort(grpc.StatusCode.DATA_LOSS, f"{e}; the session cannot continue (start a new one)")
    if isinstance(e, StoreFull):
        return RpcAbort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
    if isinstance(e, StoreUnavailable):
        return RpcAbort(grpc.StatusCode.UNAVAILABLE, str(e))
    if isinstance(e, LeaseLost):
        return RpcAbort(grpc.StatusCode.ABORTED, str(e))
    return None


def store_errors(method):
    """GetSession/CancelSession: a store failure ends the call with its own status (not INTERNAL)."""
    @functools.wraps(method)
    def wrapper(self, request, context):
        try:
            return method(self, request, context)
        except (SessionLost, StoreFull, StoreUnavailable, LeaseLost) as e:
            raise store_error(e) from e

    return wrapper
