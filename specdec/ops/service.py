"""What `specdec serve draft|target` do around their own work, written once: the flags every service takes besides
its settings, the process set-up before a model is loaded, and the run until a signal stops the server."""

from __future__ import annotations

import argparse
import logging
import signal
from typing import Callable

from specdec import observability as telemetry
from specdec.core import settings
from specdec.core.grpc_util import ServiceServer, add_tls_arguments, configure_tls, tls_from_args
from specdec.core.security import require_mtls
from specdec.ops import cpu_affinity


def add_service_arguments(p: argparse.ArgumentParser, settings_class: type) -> None:
    """The service's settings as flags (specdec/core/settings.py), then CPU pinning, TLS and the metrics port."""
    settings.add_arguments(p, settings_class)
    cpu_affinity.add_argument(p)
    add_tls_arguments(p)
    telemetry.add_metrics_argument(p)


def prepare_process(args: argparse.Namespace, service_name: str, log: logging.Logger) -> None:
    """Before anything is loaded: an unauthenticated non-loopback listener is refused, the CPUs pinned, telemetry
    and TLS set up, and torch given the service's threads (--threads)."""
    import torch

    require_mtls(args)
    cpus = cpu_affinity.apply_from_args(args)
    telemetry.setup(service_name, metrics_port=args.metrics_port)
    cpu_affinity.log_pinning(log, cpus, args.threads)
    configure_tls(tls_from_args(args))
    torch.set_num_threads(args.threads)


def run_until_signal(server: ServiceServer, log: logging.Logger,
                     latency_detail: Callable[[], dict] = dict) -> None:
    """Announce readiness and serve until SIGTERM/SIGINT. A servicer with injected latency (chaos tests) has it
    toggled by SIGUSR1; `latency_detail()` adds the servicer's own counts to the log line."""
    servicer = server.servicer
    if servicer.inject_latency_ms > 0:
        def _toggle(signum, frame):
            servicer.latency_enabled = not servicer.latency_enabled
            log.warning("injected latency toggled", extra={"enabled": servicer.latency_enabled, **latency_detail()})

        signal.signal(signal.SIGUSR1, _toggle)
    telemetry.ready(server.address)
    telemetry.wait_for_signal(server)
