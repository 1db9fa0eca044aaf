"""gRPC front of a drafter: `specdec serve draft` (the RPCs: servicer.py; which proposer: build.py)."""

from __future__ import annotations

import argparse
import logging

from draft_service.build import build_proposer
from draft_service.proposers.base import Proposer
from draft_service.servicer import DraftServicer
from draft_service.settings import DraftSettings
from specdec.core.grpc_util import ServiceServer
from specdec.core.settings import MAX_DRAFT_LEN, from_args
from specdec.ops.service import add_service_arguments, prepare_process, run_until_signal
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc

log = logging.getLogger("specdec.draft")


def build_server(proposer: Proposer, info: common_pb2.ModelInfo, address: str, max_workers: int = 8,
                 inject_latency_ms: float = 0.0, max_draft_len: int = MAX_DRAFT_LEN) -> ServiceServer:
    server = ServiceServer(address, max_workers=max_workers)
    server.servicer = DraftServicer(proposer, info, max_draft_len, inject_latency_ms=inject_latency_ms)
    server.add(
        draft_pb2_grpc.add_DraftServiceServicer_to_server,
        server.servicer,
        draft_pb2.DESCRIPTOR.services_by_name["DraftService"].full_name,
    )
    return server


def add_arguments(p: argparse.ArgumentParser) -> None:
    """`specdec serve draft`'s flags: the fields of DraftSettings (draft_service/settings.py)."""
    add_service_arguments(p, DraftSettings)


def serve(args: argparse.Namespace) -> None:
    prepare_process(args, "specdec-draft", log)
    settings = from_args(DraftSettings, args)
    proposer, info = build_proposer(settings)
    # A Propose holds its thread while it waits for its step batch: one per cached session (and its prefetch).
    server = build_server(proposer, info, settings.listen, max_workers=settings.max_sessions + 8,
                          inject_latency_ms=settings.inject_latency_ms,
                          max_draft_len=settings.max_draft_len or info.max_draft_len or MAX_DRAFT_LEN).start()
    run_until_signal(server, log)
