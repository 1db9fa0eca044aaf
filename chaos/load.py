"""Client-side load for the chaos suite: streaming requests in threads, every token and its arrival time recorded.

A request that breaks with a retryable status resumes its session (`resume_session_id`, `resume_from` =
tokens received so far) when it has a session id, or is sent again when it has none (nothing was generated
yet). Both are counted, so a scenario can assert that a stream was never interrupted.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import grpc

from specdec.client import FINISH_REASONS, GenerateOptions, SpecdecClient, _stats_dict

RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL,
             grpc.StatusCode.CANCELLED, grpc.StatusCode.ABORTED, grpc.StatusCode.RESOURCE_EXHAUSTED}


@dataclass
class RequestRecord:
    index: int
    prompt_index: int
    phase: str                      # "load" (during the fault window) or "post_heal" (started after the heal)
    start: float = 0.0              # time.monotonic()
    end: float = 0.0
    session_id: str = ""
    tokens: list = field(default_factory=list)
    token_times: list = field(default_factory=list)  # arrival time of each message that carried tokens
    gaps_ms: list = field(default_factory=list)      # (arrival time, gap since the previous token message or start)
    stats: dict = field(default_factory=dict)
    finish: str = ""
    error: str | None = None
    errors: list = field(default_factory=list)       # every RPC error seen, resumed or not
    resumes: int = 0                # a broken stream continued with resume_session_id
    retries: int = 0                # a request sent again because it broke before it had a session id
    offset_errors: int = 0          # a message whose offset was not the number of tokens received before it

    @property
    def completed(self) -> bool:
        return self.error is None and bool(self.finish) and self.finish != "unspecified"

    @property
    def latency_ms(self) -> float:
        return (self.end - self.start) * 1e3 if self.end else 0.0

    @property
    def max_gap_ms(self) -> float:
        return max((g for _, g in self.gaps_ms), default=0.0)


class Progress:
    """Tokens streamed so far over all requests (the fault injector triggers on it)."""

    def __init__(self):
        self.tokens = 0
        self._lock = threading.Lock()

    def add(self, n: int) -> None:
        with self._lock:
            self.tokens += n


@dataclass(frozen=True)
class Retry:
    """How a request goes on after a retryable error: until `deadline` (time.monotonic()), at most `max_attempts`
    calls, `sleep_s` between them."""

    deadline: float
    max_attempts: int = 10_000
    sleep_s: float = 0.2


def run_request(client: SpecdecClient, prompt, rec: RequestRecord, options: GenerateOptions, retry: Retry,
                progress: Progress | None = None) -> RequestRecord:
    """Stream one request to the end, resuming/retrying on retryable errors as `retry` allows. `options`: the
    request's settings (each call's deadline is the time left until retry.deadline)."""
    rec.start = time.monotonic()
    attempts = 0
    while True:
        attempts += 1
        timeout = max(1.0, retry.deadline - time.monotonic())
        try:
            if rec.session_id:
                stream = client.stream(resume_session_id=rec.session_id, resume_from=len(rec.tokens),
                                       timeout_s=timeout)
            else:
                stream = client.stream(prompt, options, timeout_s=timeout)
            _record_stream(stream, rec, progress)
            if not rec.finish:
                rec.error = "stream ended without a final stats message"
            break
        except grpc.RpcError as e:
            if not _goes_on_after(e, rec, retry, attempts):
                break
            time.sleep(retry.sleep_s)
    rec.end = time.monotonic()
    return rec


def _record_stream(stream, rec: RequestRecord, progress: Progress | None) -> None:
    """Every message's tokens, their arrival times and gaps, and the final stats, into `rec`."""
    for msg in stream:
        if msg.session_id and not rec.session_id:
            rec.session_id = msg.session_id
        if msg.token_ids:
            now = time.monotonic()
            last = rec.token_times[-1] if rec.token_times else rec.start
            if msg.offset != len(rec.tokens):
                rec.offset_errors += 1
            rec.tokens.extend(msg.token_ids)
            rec.token_times.append(now)
            rec.gaps_ms.append((now, (now - last) * 1e3))
            if progress is not None:
                progress.add(len(msg.token_ids))
        if msg.HasField("stats"):
            rec.stats = _stats_dict(msg.stats)
            rec.finish = FINISH_REASONS.get(msg.finish_reason, "unspecified")


def _goes_on_after(e: grpc.RpcError, rec: RequestRecord, retry: Retry, attempts: int) -> bool:
    """Record the error; True when the request resumes (it has a session) or is sent again (it has none)."""
    code = e.code()
    rec.errors.append(f"{code.name}: {e.details()}")
    if code not in RETRYABLE or attempts >= retry.max_attempts or time.monotonic() + retry.sleep_s >= retry.deadline:
        rec.error = f"{code.name}: {e.details()}"
        return False
    if rec.session_id:
        rec.resumes += 1
    else:
        rec.retries += 1
    return True


def run_batch(address: str, prompts: list, max_new_tokens: int, concurrency: int, deadline: float,
              speculation: bool | None = None, phase: str = "load") -> list[RequestRecord]:
    """Run one request per prompt with `concurrency` threads; records in prompt order."""
    records = [RequestRecord(i, i, phase) for i in range(len(prompts))]
    options = GenerateOptions(max_new_tokens=max_new_tokens, ignore_eos=True, speculation=speculation)
    next_i = iter(range(len(prompts)))
    lock = threading.Lock()

    def worker():
        with SpecdecClient(address, timeout_s=600) as client:
            while True:
                with lock:
                    i = next(next_i, None)
                if i is None or time.monotonic() >= deadline:
                    return
                run_request(client, prompts[i], records[i], options, Retry(deadline))

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(max(1, min(concurrency, len(prompts))))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()) + 5)
    return records
