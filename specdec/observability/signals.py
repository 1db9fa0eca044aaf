"""Process lifecycle: tell the launcher the service is ready, stop gracefully on SIGTERM/SIGINT."""

from __future__ import annotations

import logging
import signal
import threading
import time

from specdec.observability.providers import force_flush


def ready(address: str) -> None:
    """Tell a parent launcher (specdec up, tests) that the service listens, on stdout."""
    print(f"SPECDEC_READY {address}", flush=True)


def wait_for_signal(server, grace: float = 2.0) -> None:
    """Block until SIGTERM/SIGINT, then stop the server gracefully."""
    stop = threading.Event()

    def _handler(signum, frame):
        stop.set()

    signal.signal(signal.SIGTERM, _handler)
    signal.signal(signal.SIGINT, _handler)
    while not stop.is_set():
        stop.wait(0.5)
    logging.getLogger("specdec").info("shutting down")
    server.stop(grace)
    force_flush(2000)
    time.sleep(0.05)
