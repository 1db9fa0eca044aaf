"""A loopback TCP proxy in front of one address that injects network faults (this kernel has no tc netem).

    proxy = FaultProxy("127.0.0.1:6379")   # clients connect to proxy.address (or proxy.url for Redis)
    proxy.set_latency(50)                  # every chunk waits 50 ms, in each direction (pipelined, order kept)
    proxy.partition(); proxy.heal()       # nothing moves between the two: connections stay open, bytes wait
    proxy.drop_connections()               # reset (RST) every open connection; new ones are accepted

A partition holds bytes rather than discarding them: TCP retransmits what a partition loses, so a peer sees its
bytes late, never a gap in the stream. A call waiting on a reply ends on its deadline (or the caller's grace), and
whatever the client sent meanwhile (a write it gave up on included) reaches the server after the heal, as it would
after a real partition. A connection opened during a partition is accepted (the kernel does that) and connected
upstream after the heal.
"""

from __future__ import annotations

import queue
import socket
import struct
import threading
import time

CHUNK = 65536
QUEUE_CHUNKS = 256  # per direction: a full queue stops the reader, and the sender's kernel buffers fill up


def _close(sock: socket.socket, reset: bool) -> None:
    """Close; with reset, by RST (SO_LINGER 0), as a dropped connection looks to both ends. The shutdown wakes this
    proxy's thread blocked in recv() on it: a plain close() would not, and the socket would stay open until then."""
    try:
        if reset:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.shutdown(socket.SHUT_RD if reset else socket.SHUT_RDWR)
    except OSError:
        pass
    try:
        sock.close()
    except OSError:
        pass


class _Conn:
    """One client connection and its upstream connection: two directions, each a reader and a writer thread."""

    def __init__(self, proxy: "FaultProxy", client: socket.socket):
        self.proxy = proxy
        self.client = client
        self.upstream: socket.socket | None = None
        self.closed = threading.Event()
        self.mute_replies = False  # ExecReplyDroppingProxy: the server's bytes are swallowed
        self._done = 0
        self._lock = threading.Lock()

    def start(self) -> None:
        threading.Thread(target=self._connect, daemon=True, name="fault-proxy-conn").start()

    def _connect(self) -> None:
        p = self.proxy
        while not p.open.wait(0.1):  # partitioned: the upstream handshake waits for the heal
            if self.closed.is_set():
                return
        try:
            self.upstream = socket.create_connection(p.upstream, timeout=5)
            self.upstream.settimeout(None)
        except OSError:
            self.abort()  # the server is down: the client sees its connection reset
            return
        self.upstream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self.closed.is_set():
            _close(self.upstream, reset=True)
            return
        for src, dst, up in ((self.client, self.upstream, True), (self.upstream, self.client, False)):
            q: queue.Queue = queue.Queue(QUEUE_CHUNKS)
            threading.Thread(target=self._read, args=(src, q, up), daemon=True, name="fault-proxy-read").start()
            threading.Thread(target=self._write, args=(dst, q, up), daemon=True, name="fault-proxy-write").start()

    def _read(self, src: socket.socket, q: queue.Queue, up: bool) -> None:
        while not self.closed.is_set():
            try:
                data = src.recv(CHUNK)
            except OSError:
                self.abort()
                return
            if up and data:
                self.proxy._client_data(self, data)
            item = (time.monotonic() + self.proxy.latency_s, data)
            while not self.closed.is_set():
                try:
                    q.put(item, timeout=0.2)
                    break
                except queue.Full:
                    continue
            if not data:  # EOF: the writer half-closes the other side after what is queued
                return

    def _write(self, dst: socket.socket, q: queue.Queue, up: bool) -> None:
        p = self.proxy
        while not self.closed.is_set():
            try:
                due, data = q.get(timeout=0.2)
            except queue.Empty:
                continue
            while not self.closed.is_set():
                wait = due - time.monotonic()
                if wait > 0:
                    time.sleep(min(wait, 0.05))
                elif not p.open.wait(0.1):
                    continue  # partitioned: hold it
                else:
                    break
            if self.closed.is_set():
                return
            if not data:
                try:
                    dst.shutdown(socket.SHUT_WR)
                except OSError:
                    pass
                self._finish()
                return
            if not up and self.mute_replies:
                continue
            try:
                dst.sendall(data)
            except OSError:
                self.abort()
                return

    def _finish(self) -> None:
        with self._lock:
            self._done += 1
            both = self._done == 2
        if both:
            self.close()

    def close(self, reset: bool = False) -> None:
        with self._lock:
            if self.closed.is_set():
                return
            self.closed.set()
        for s in (self.client, self.upstream):
            if s is not None:
                _close(s, reset)
        self.proxy._forget(self)

    def abort(self) -> None:
        self.close(reset=True)


class FaultProxy:
    """Forward every connection made to `address` to `upstream` ("host:port" or (host, port)); inject faults."""

    def __init__(self, upstream, host: str = "127.0.0.1", port: int = 0):
        if isinstance(upstream, str):
            h, _, p = upstream.rpartition(":")
            upstream = (h or host, int(p))
        self.upstream = upstream
        self.host = host
        self._listener = socket.socket()
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((host, port))
        self._listener.listen(64)
        self.port = self._listener.getsockname()[1]
        self.latency_s = 0.0
        self.open = threading.Event()  # set: traffic flows; clear: partitioned
        self.open.set()
        self.connections_accepted = 0
        self.connections_dropped = 0
        self._conns: set[_Conn] = set()
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept, daemon=True, name="fault-proxy-accept").start()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def url(self) -> str:
        """The proxy as a Redis URL (database 0)."""
        return f"redis://{self.host}:{self.port}/0"

    @property
    def partitioned(self) -> bool:
        return not self.open.is_set()

    def set_latency(self, ms: float) -> None:
        """Delay every chunk by `ms`, in each direction (chunks already queued keep their time)."""
        self.latency_s = max(0.0, ms) / 1e3

    def partition(self) -> None:
        self.open.clear()

    def heal(self) -> None:
        """End a partition and any added latency."""
        self.latency_s = 0.0
        self.open.set()

    def drop_connections(self) -> int:
        """Reset every open connection (both ends see an RST); returns how many."""
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            c.abort()
        self.connections_dropped += len(conns)
        return len(conns)

    @property
    def open_connections(self) -> int:
        with self._lock:
            return len(self._conns)

    def close(self) -> None:
        self._closed = True
        self.open.set()
        try:
            self._listener.close()
        except OSError:
            pass
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            c.close()

    def _forget(self, conn: _Conn) -> None:
        with self._lock:
            self._conns.discard(conn)

    def _client_data(self, conn: _Conn, data: bytes) -> None:
        """A hook on every chunk from a client before it is queued (ExecReplyDroppingProxy)."""

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = _Conn(self, client)
            with self._lock:
                self._conns.add(conn)
            self.connections_accepted += 1
            conn.start()
