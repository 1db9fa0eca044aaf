"""A loopback TCP proxy in front of Redis that can lose the reply of the next atomic write.

This is the moment `redis_restart` hits by chance: Redis executes a MULTI/EXEC or a script (a commit) and
exits (or the connection drops) before its reply reaches the orchestrator, which then sees a connection
error for a write that did happen. `drop_next_exec_reply()` makes that moment deterministic: the next request
that contains EXEC or EVALSHA is forwarded to Redis, its reply is swallowed and the client connection is closed.
"""

from __future__ import annotations

import threading
import time

from chaos.fault_proxy import FaultProxy


class ExecReplyDroppingProxy(FaultProxy):
    def __init__(self, redis_port: int, host: str = "127.0.0.1"):
        super().__init__((host, redis_port), host=host)
        self.redis_port = redis_port
        self._drop = threading.Event()
        self.dropped = 0

    def drop_next_exec_reply(self) -> None:
        self._drop.set()

    def _client_data(self, conn, data: bytes) -> None:
        if self._drop.is_set() and (b"EXEC" in data or b"EVALSHA" in data):
            self._drop.clear()
            conn.mute_replies = True   # the reply will not reach the client...

            def lose_connection():     # ...but Redis executes the transaction, forwarded meanwhile
                time.sleep(0.3)
                self.dropped += 1
                conn.close()

            threading.Thread(target=lose_connection, daemon=True).start()
