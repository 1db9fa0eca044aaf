"""How an HTTP request calls the gRPC servicer: its own Generate/GetSession/CancelSession with a stand-in for the
gRPC context (one generation path, one validation, one auth check, one cancellation path)."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque

import grpc

from orchestrator.api.http.errors import ApiError
from specdec.core.grpc_util import RpcAbort

log = logging.getLogger("specdec.http")


class HttpContext:
    """What OrchestratorServicer needs of a grpc.ServicerContext: the caller's token, a cancellation callback
    (the HTTP client went away), and abort as an ApiError."""

    def __init__(self, authorization: str | None):
        self._metadata = (("authorization", authorization),) if authorization else ()
        self._callbacks = []
        self._active = True

    def invocation_metadata(self):
        return self._metadata

    def add_callback(self, callback) -> bool:
        self._callbacks.append(callback)
        return True

    def is_active(self) -> bool:
        return self._active

    def abort(self, code: grpc.StatusCode, details: str):
        raise ApiError.from_grpc(code, details)

    def cancel(self) -> None:
        self._active = False
        for callback in list(self._callbacks):
            callback()


def authorize(servicer, authorization: str | None) -> str | None:
    """The Authorization header, once the servicer's own check (the gRPC API's) accepts it."""
    try:
        servicer.authenticate(HttpContext(authorization))
    except RpcAbort:
        raise ApiError(401, "missing or invalid bearer token (Authorization: Bearer <token>)",
                       code="invalid_api_key") from None
    return authorization


async def call_unary(method, request, authorization: str | None):
    """A unary servicer method on a worker thread (it blocks on Redis); its aborts as ApiError."""
    def call():
        try:
            return method(request, HttpContext(authorization))
        except ApiError:
            raise
        except Exception as e:  # noqa: BLE001 - reported to the client as a 500
            raise ApiError(500, f"internal error: {type(e).__name__}: {e}") from e

    return await asyncio.to_thread(call)


END = object()


class GenerateStream:
    """servicer.Generate run to its end on a thread of its own (it blocks on gRPC and Redis), its messages handed
    to the event loop in batches: the generation thread wakes the loop only when the reader waits, and the reader
    takes every message that arrived meanwhile at once (no event-loop hop per message). cancel() is a gRPC
    client's cancel: the generation stops, the session is recorded as cancelled and the caches are freed."""

    def __init__(self, servicer, request, ctx: HttpContext):
        self.ctx = ctx
        self.loop = asyncio.get_running_loop()
        self.done = False
        self._items: deque = deque()  # bounded by the request's max_new_tokens (one message per block at most)
        self._lock = threading.Lock()
        self._waiter: asyncio.Future | None = None
        self._held: list = []  # read by the loop only: messages taken but not handed out yet
        self._error: ApiError | None = None  # the error after them
        threading.Thread(target=self._run, args=(servicer, request), name="http-generate", daemon=True).start()

    def _put(self, item) -> None:
        with self._lock:
            self._items.append(item)
            waiter, self._waiter = self._waiter, None
        if waiter is not None:
            try:
                self.loop.call_soon_threadsafe(_wake, waiter)
            except RuntimeError:  # the event loop is gone (server shutting down): nobody reads on
                self.ctx.cancel()

    def _run(self, servicer, request) -> None:
        try:
            for msg in servicer.Generate(request, self.ctx):
                self._put(msg)
        except ApiError as e:
            self._put(e)
        except Exception as e:  # noqa: BLE001 - reported to the client as a 500, logged here
            log.exception("generate failed")
            self._put(ApiError(500, f"internal error: {type(e).__name__}: {e}"))
        self._put(END)

    async def batch(self) -> list:
        """The GenerateResponses that arrived since the last call (waiting for one); [] at the end. Raises the
        ApiError that ended the stream once the messages before it were taken."""
        if self._held:
            items, self._held = self._held, []
            return items
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        while not self.done:
            with self._lock:
                items = list(self._items)
                self._items.clear()
                if not items:
                    self._waiter = waiter = self.loop.create_future()
            if items:
                return self._messages(items)
            await waiter
        return []

    def _messages(self, items: list) -> list:
        for i, item in enumerate(items):
            if item is END or isinstance(item, ApiError):
                self.done = True
                if isinstance(item, ApiError):
                    if not i:
                        raise item
                    self._error = item
                return items[:i]
        return items

    async def first(self):
        """The first GenerateResponse (the session id), or the request's error before anything is streamed."""
        items = await self.batch()
        if not items:
            raise ApiError(500, "internal error: the generation ended without a response")
        self._held = items[1:]
        return items[0]

    def cancel(self) -> None:
        if not self.done:
            self.ctx.cancel()


def _wake(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(None)
