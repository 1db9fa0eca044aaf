"""chaos/fault_proxy.py on its own: latency, partition and dropped connections against a loopback echo server."""

import socket
import threading
import time

import pytest

from chaos.fault_proxy import FaultProxy


@pytest.fixture
def echo():
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    stop = threading.Event()

    def serve(conn):
        with conn:
            while True:
                try:
                    data = conn.recv(65536)
                except OSError:
                    return
                if not data:
                    return
                conn.sendall(data)

    def accept():
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    yield "127.0.0.1:%d" % srv.getsockname()[1]
    stop.set()
    srv.close()


@pytest.fixture
def proxy(echo):
    p = FaultProxy(echo)
    yield p
    p.close()


def _connect(proxy, timeout=2.0):
    return socket.create_connection(("127.0.0.1", proxy.port), timeout=timeout)


def _roundtrip(sock, payload=b"ping"):
    sock.sendall(payload)
    got = b""
    while len(got) < len(payload):
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("closed")
        got += chunk
    return got


def test_forwards_both_ways(proxy):
    with _connect(proxy) as s:
        assert _roundtrip(s, b"hello" * 1000) == b"hello" * 1000
    assert proxy.connections_accepted == 1


def test_latency_is_added_in_each_direction(proxy):
    with _connect(proxy) as s:
        _roundtrip(s)
        proxy.set_latency(300)  # far above a loaded host's scheduling delays, so the healed round trip is told apart
        t = time.monotonic()
        assert _roundtrip(s) == b"ping"
        assert time.monotonic() - t >= 0.59  # 300 ms there, 300 ms back
        proxy.heal()
        t = time.monotonic()
        _roundtrip(s)
        assert time.monotonic() - t < 0.3


def test_partition_holds_bytes_without_closing(proxy):
    with _connect(proxy) as s:
        _roundtrip(s)
        proxy.partition()
        s.sendall(b"held")
        s.settimeout(0.5)
        with pytest.raises(socket.timeout):  # nothing comes back, and the connection is not closed either
            s.recv(16)
        late = _connect(proxy)  # a connection opened during the partition is accepted but goes nowhere yet
        late.sendall(b"late")
        late.settimeout(0.3)
        with pytest.raises(socket.timeout):
            late.recv(16)
        proxy.heal()
        s.settimeout(2.0)
        late.settimeout(2.0)
        assert s.recv(16) == b"held"  # delivered after the heal: delayed, not lost
        assert late.recv(16) == b"late"
        late.close()


def test_drop_connections_resets_them_and_accepts_new_ones(proxy):
    socks = [_connect(proxy) for _ in range(3)]
    for s in socks:
        _roundtrip(s)
    assert proxy.drop_connections() == 3
    for s in socks:
        with pytest.raises((ConnectionResetError, ConnectionError)):
            _roundtrip(s)
        s.close()
    with _connect(proxy) as s:
        assert _roundtrip(s) == b"ping"
    assert proxy.connections_dropped == 3


def test_upstream_down_resets_the_client():
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    p = FaultProxy(f"127.0.0.1:{port}")  # nothing listens there
    try:
        # The reset may come while the connection is still being set up, or on the first round trip.
        with pytest.raises((ConnectionResetError, ConnectionError)):
            with _connect(p) as s:
                _roundtrip(s)
    finally:
        p.close()
