"""A loopback TCP proxy in front of Redis that can lose the reply of the next atomic write.

This is the moment `redis_restart` hits by chance: Redis executes a MULTI/EXEC or a script (a commit) and
exits (or the connection drops) before its reply reaches the orchestrator, which then sees a connection
error for a write that did happen. `drop_next_exec_reply()` makes that moment deterministic: the next request
that contains EXEC or EVALSHA is forwarded to Redis, its reply is swallowed and the client connection is closed.
"""

from __future__ import annotations

import socket
import threading
import time


class ExecReplyDroppingProxy:
    def __init__(self, redis_port: int, host: str = "127.0.0.1"):
        self.redis_port = redis_port
        self.host = host
        self._listener = socket.socket()
        self._listener.bind((host, 0))
        self._listener.listen(16)
        self.port = self._listener.getsockname()[1]
        self._drop = threading.Event()
        self.dropped = 0
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    def drop_next_exec_reply(self) -> None:
        self._drop.set()

    def close(self) -> None:
        self._closed = True
        self._listener.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            upstream = socket.create_connection((self.host, self.redis_port))
            lost = threading.Event()
            threading.Thread(target=self._up, args=(client, upstream, lost), daemon=True).start()
            threading.Thread(target=self._down, args=(upstream, client, lost), daemon=True).start()

    def _up(self, client: socket.socket, upstream: socket.socket, lost: threading.Event) -> None:
        while True:
            try:
                data = client.recv(65536)
            except OSError:
                break
            if not data:
                break
            if self._drop.is_set() and (b"EXEC" in data or b"EVALSHA" in data):
                self._drop.clear()
                lost.set()                 # the reply will not reach the client...
                upstream.sendall(data)     # ...but Redis executes the transaction
                time.sleep(0.3)
                self.dropped += 1
                break
            try:
                upstream.sendall(data)
            except OSError:
                break
        for s in (client, upstream):
            try:
                s.close()
            except OSError:
                pass

    @staticmethod
    def _down(upstream: socket.socket, client: socket.socket, lost: threading.Event) -> None:
        while True:
            try:
                data = upstream.recv(65536)
            except OSError:
                return
            if not data:
                return
            if lost.is_set():
                continue
            try:
                client.sendall(data)
            except OSError:
                return
