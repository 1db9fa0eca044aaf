"""The closed request loop both serving benchmarks drive (specdec's streams in bench/serving.py, llama-server's
in bench/llama_server.py): n client threads, each sending its next request when its previous one ends."""

from __future__ import annotations

import threading
import time
from typing import Callable, TypeVar

Record = TypeVar("Record")


def drain(n: int, jobs: list[tuple[str, list[int]]], send: Callable[[int, str, list[int]], Record],
          timeout_s: float, thread_name: str | None = None) -> tuple[float, list[Record]]:
    """n streams drain `jobs` (prompt name, token ids); `send(stream_index, name, ids)` runs one request to its
    end and returns its record. Returns the wall seconds from the first send to the last stream's end and the
    records in the order they finished; each stream waits at most `timeout_s` per job."""
    lock = threading.Lock()
    queue = list(jobs)
    out: list[Record] = []

    def stream(index: int) -> None:
        while True:
            with lock:
                if not queue:
                    return
                name, ids = queue.pop(0)
            rec = send(index, name, ids)
            with lock:
                out.append(rec)

    threads = [threading.Thread(target=stream, args=(i,), daemon=True,
                                name=f"{thread_name}-{i}" if thread_name else None) for i in range(n)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s * (len(jobs) + 1))
    return time.perf_counter() - t0, out
