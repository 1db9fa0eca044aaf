"""Target-only decoding as a stream of blocks (the DecodeStream RPC). The llama.cpp engine decodes a stream in its
step loop (engine.decode_stream: one row of the continuous batch per step); any other engine's decode() runs on a
thread of its own and hands each token over as it comes. Either way the caller takes blocks (DecodeWork.take)
while the engine decodes on, and cancel() stops it."""

from __future__ import annotations

import contextvars
import threading

from specdec.core.grpc_util import call_deadline
from target_service.engines.jobs import DecodeTask
from target_service.engines.llama_steps import DecodeWork


def start_decode_stream(engine, task: DecodeTask) -> DecodeWork:
    own = getattr(engine, "decode_stream", None)
    if own is not None:
        return own(task)
    sink = DecodeWork(task, call_deadline())

    def run() -> None:
        try:
            engine.decode(task, on_token=lambda token, cached_len: not (sink.push(token, cached_len) or sink.cancelled))
            with sink.cond:  # ended by its consumer's cancel: wake anyone still waiting
                sink.finished = True
                sink.cond.notify_all()
        except BaseException as e:  # noqa: BLE001 - the consumer raises it after the tokens before it
            sink.fail(e)

    context = contextvars.copy_context()  # the call's deadline, for the engine's queued steps
    threading.Thread(target=context.run, args=(run,), name=f"decode-stream-{task.session_id[:16]}", daemon=True).start()
    return sink
