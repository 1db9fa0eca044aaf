"""Per-session state: prompt, committed tokens, parameters, RNG step, service cache positions, stats.

Redis layout (TTL on both keys):
  specdec:session:{id}       hash: prompt (packed uint32), params (json), status, finish_reason,
                             target_pos, draft_pos, step, stats (json), updated
  specdec:session:{id}:gen   string: generated tokens, packed little-endian uint32, appended per block
Each committed block costs one MULTI/EXEC round trip (SETRANGE + HSET + 2x EXPIRE), so a block is
either fully stored or not at all, and writing it again (a retry after a lost reply) changes nothing.
"""

from __future__ import annotations

import json
import struct
import threading
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass, field

import numpy as np

from specdec import telemetry

KEY_PREFIX = "specdec:session:"


def pack_tokens(tokens) -> bytes:
    return np.asarray(tokens, dtype="<u4").tobytes()


def unpack_tokens(data: bytes | None) -> list[int]:
    return np.frombuffer(data or b"", dtype="<u4").astype(np.int64).tolist()


@dataclass
class SessionRecord:
    session_id: str
    prompt_ids: list[int]
    params: dict
    generated: list[int] = field(default_factory=list)
    status: str = "running"  # running, finished, cancelled, failed
    finish_reason: int = 0
    target_pos: int = 0
    draft_pos: int = 0
    draft_replica: str = ""  # the draft replica holding this session's cache (draft_pos refers to it)
    step: int = 0
    stats: dict = field(default_factory=dict)

    @property
    def committed(self) -> list[int]:
        return self.prompt_ids + self.generated

    def state_fields(self) -> dict:
        return {
            "status": self.status,
            "finish_reason": self.finish_reason,
            "target_pos": self.target_pos,
            "draft_pos": self.draft_pos,
            "draft_replica": self.draft_replica,
            "step": self.step,
            "stats": json.dumps(self.stats),
            "updated": time.time(),
        }


class StoreUnavailable(Exception):
    """The session store cannot be reached."""


class RedisSessionStore:
    def __init__(self, url: str, ttl_s: int = 3600, socket_timeout_s: float = 2.0):
        import redis

        self.url = url
        self.ttl_s = ttl_s
        self.client = redis.Redis.from_url(
            url, socket_timeout=socket_timeout_s, socket_connect_timeout=socket_timeout_s,
            health_check_interval=30,
        )

    def _keys(self, session_id: str) -> tuple[str, str]:
        k = KEY_PREFIX + session_id
        return k, k + ":gen"

    def _run(self, fn):
        import redis

        try:
            return fn()
        except (redis.ConnectionError, redis.TimeoutError) as e:
            raise StoreUnavailable(f"session store at {self.url} is unavailable: {e}") from e

    @telemetry.traced("redis.ping", telemetry.REDIS)
    def ping(self) -> bool:
        return bool(self._run(self.client.ping))

    @telemetry.traced("redis.create", telemetry.REDIS)
    def create(self, rec: SessionRecord) -> None:
        meta, gen = self._keys(rec.session_id)

        def _do():
            pipe = self.client.pipeline(transaction=True)
            pipe.hset(meta, mapping={"prompt": pack_tokens(rec.prompt_ids), "params": json.dumps(rec.params),
                                     **rec.state_fields()})
            pipe.set(gen, pack_tokens(rec.generated))
            pipe.expire(meta, self.ttl_s)
            pipe.expire(gen, self.ttl_s)
            pipe.execute()

        self._run(_do)

    @telemetry.traced("redis.commit", telemetry.REDIS)
    def commit(self, rec: SessionRecord, new_tokens: list[int]) -> None:
        """Append a committed block and the new state in one round trip."""
        meta, gen = self._keys(rec.session_id)

        def _do():
            pipe = self.client.pipeline(transaction=True)
            if new_tokens:
                # SETRANGE at the block's own offset, not APPEND: a retry after a lost reply rewrites the same
                # bytes instead of appending the block twice.
                pipe.setrange(gen, 4 * (len(rec.generated) - len(new_tokens)), pack_tokens(new_tokens))
            pipe.hset(meta, mapping=rec.state_fields())
            pipe.expire(meta, self.ttl_s)
            pipe.expire(gen, self.ttl_s)
            pipe.execute()

        self._run(_do)

    def update_state(self, rec: SessionRecord) -> None:
        self.commit(rec, [])

    @telemetry.traced("redis.load", telemetry.REDIS)
    def load(self, session_id: str) -> SessionRecord | None:
        meta, gen = self._keys(session_id)

        def _do():
            pipe = self.client.pipeline(transaction=False)
            pipe.hgetall(meta)
            pipe.get(gen)
            return pipe.execute()

        h, g = self._run(_do)
        if not h:
            return None
        h = {k.decode(): v for k, v in h.items()}
        return SessionRecord(
            session_id=session_id,
            prompt_ids=unpack_tokens(h["prompt"]),
            params=json.loads(h["params"]),
            generated=unpack_tokens(g),
            status=h["status"].decode(),
            finish_reason=int(h["finish_reason"]),
            target_pos=int(h["target_pos"]),
            draft_pos=int(h["draft_pos"]),
            draft_replica=h.get("draft_replica", b"").decode(),
            step=int(h["step"]),
            stats=json.loads(h["stats"]),
        )

    @telemetry.traced("redis.delete", telemetry.REDIS)
    def delete(self, session_id: str) -> None:
        self._run(lambda: self.client.delete(*self._keys(session_id)))


class MemorySessionStore:
    """In-process store: only the embedded default of a single-process local run (lost on restart)."""

    def __init__(self, max_sessions: int = 10_000, ttl_s: int = 3600):
        self.max_sessions = max_sessions
        self.ttl_s = ttl_s
        self._data: OrderedDict[str, tuple[float, dict]] = OrderedDict()
        self._lock = threading.Lock()
        self.url = "memory://"

    def ping(self) -> bool:
        return True

    def _put(self, rec: SessionRecord) -> None:
        with self._lock:
            self._data[rec.session_id] = (time.time() + self.ttl_s, json.loads(json.dumps(asdict(rec))))
            self._data.move_to_end(rec.session_id)
            while len(self._data) > self.max_sessions:
                self._data.popitem(last=False)

    def create(self, rec: SessionRecord) -> None:
        self._put(rec)

    def commit(self, rec: SessionRecord, new_tokens: list[int]) -> None:
        self._put(rec)

    def update_state(self, rec: SessionRecord) -> None:
        self._put(rec)

    def load(self, session_id: str) -> SessionRecord | None:
        with self._lock:
            item = self._data.get(session_id)
            if item is None or item[0] < time.time():
                return None
            return SessionRecord(**json.loads(json.dumps(item[1])))

    def delete(self, session_id: str) -> None:
        with self._lock:
            self._data.pop(session_id, None)


def open_store(url: str, ttl_s: int = 3600):
    if url in ("memory", "memory://"):
        return MemorySessionStore(ttl_s=ttl_s)
    return RedisSessionStore(url, ttl_s=ttl_s)
