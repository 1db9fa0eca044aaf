"""uvicorn serving the HTTP API on a thread of the orchestrator process."""

from __future__ import annotations

import logging
import socket
import threading
import time

from orchestrator.api.http.app import build_app
from specdec.core.grpc_util import listen_error

log = logging.getLogger("specdec.http")


class HttpServer:
    """The socket is bound first (before the orchestrator waits for its target), so a taken port fails at once
    with the same message as gRPC's; port 0 reports the port it got."""

    def __init__(self, address: str):
        host, _, port = address.rpartition(":")
        if not port.isdigit():
            raise listen_error("HTTP", address, "not a host:port address")
        host = host.strip("[]") or "127.0.0.1"
        self.sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.sock.bind((host, int(port)))
        except OSError as e:
            self.sock.close()
            raise listen_error("HTTP", address, e.strerror or str(e)) from e
        self.sock.listen(512)
        self.port = self.sock.getsockname()[1]
        self.url = f"http://{f'[{host}]' if ':' in host else host}:{self.port}"
        self.server = self.thread = None

    def start(self, servicer, timeout: float = 30.0) -> "HttpServer":
        import uvicorn

        config = uvicorn.Config(build_app(servicer), log_config=None, access_log=False, lifespan="off",
                                timeout_graceful_shutdown=2, ws="none")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, name="http-api",
                                       daemon=True)
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the HTTP API did not start on {self.url}")
            time.sleep(0.01)
        log.info("serving HTTP", extra={"url": self.url})
        return self

    def stop(self, grace: float = 2.0) -> None:
        if self.server is not None:
            self.server.should_exit = True
            self.thread.join(grace + 3)
        self.sock.close()
