"""The HTTP API's hand-over of a generation to the event loop (orchestrator/api/http/bridge.py): every message in
order, in batches, the error that ended the stream after the messages before it, a cancel reaching the servicer."""

from __future__ import annotations

import asyncio
import threading

import grpc

from orchestrator.api.http.bridge import GenerateStream, HttpContext
from orchestrator.api.http.errors import ApiError


class FakeServicer:
    """Generate yields `count` messages (each after `gate` lets it through), then ends or aborts."""

    def __init__(self, count: int, fail: bool = False):
        self.count, self.fail = count, fail
        self.gate = threading.Semaphore(0)
        self.cancelled = threading.Event()

    def Generate(self, request, context):
        context.add_callback(self.cancelled.set)
        for i in range(self.count):
            self.gate.acquire()
            yield i
        if self.fail:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "busy")


async def _queued(stream: GenerateStream, n: int) -> None:
    """Until n items wait in the stream (the generation thread ran ahead of the reader)."""
    for _ in range(500):
        if len(stream._items) >= n:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{len(stream._items)} items queued, not {n}")


async def _drain(stream: GenerateStream) -> list:
    got = []
    while batch := await stream.batch():
        got.append(batch)
    return got


def test_messages_arrive_in_order_and_those_waiting_come_as_one_batch():
    async def main():
        servicer = FakeServicer(6)
        stream = GenerateStream(servicer, None, HttpContext(None))
        servicer.gate.release()
        assert await stream.first() == 0
        for _ in range(5):
            servicer.gate.release()  # all five sent while nobody reads
        await _queued(stream, 6)  # and the end
        batches = await _drain(stream)
        assert batches == [[1, 2, 3, 4, 5]]  # one hand-over for all that waited
        assert stream.done and await stream.batch() == []

    asyncio.run(main())


def test_the_error_that_ends_a_stream_comes_after_its_messages():
    async def main():
        servicer = FakeServicer(3, fail=True)
        stream = GenerateStream(servicer, None, HttpContext(None))
        for _ in range(3):
            servicer.gate.release()
        await _queued(stream, 5)  # messages, the error and the end all queued
        assert await stream.first() == 0
        assert await stream.batch() == [1, 2]
        try:
            await stream.batch()
        except ApiError as e:
            assert e.status == 429 and e.message == "busy"
        else:
            raise AssertionError("the stream's error was not raised")
        assert await stream.batch() == []

    asyncio.run(main())


def test_an_error_before_any_message_is_the_requests_error_and_cancel_reaches_the_servicer():
    async def main():
        stream = GenerateStream(FakeServicer(0, fail=True), None, HttpContext(None))
        try:
            await stream.first()
        except ApiError as e:
            assert e.status == 429
        else:
            raise AssertionError("no error")
        servicer = FakeServicer(5)
        stream = GenerateStream(servicer, None, HttpContext(None))
        servicer.gate.release()
        await stream.first()
        stream.cancel()  # the HTTP client went away
        assert servicer.cancelled.wait(5)
        for _ in range(4):
            servicer.gate.release()

    asyncio.run(main())
