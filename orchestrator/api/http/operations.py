"""GET /health and /metrics: for load balancers and Prometheus, no token needed."""

from __future__ import annotations

import asyncio

import grpc
from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from orchestrator.api.http.deps import servicer_of
from orchestrator.api.http.errors import ApiError, documented
from orchestrator.api.http.schemas import Health

router = APIRouter(tags=["operations"])


def healthy(servicer) -> tuple[bool, dict]:
    checks = {}
    try:
        servicer.targets.info(timeout=2.0)
        checks["target"] = "ok"
    except grpc.RpcError as e:
        checks["target"] = f"unavailable ({e.code().name})"
    except Exception as e:  # noqa: BLE001 - no target replica at all (a DNS name with no records)
        checks["target"] = f"unavailable ({e})"
    try:
        servicer.store.ping()
        checks["store"] = "ok"
    except Exception as e:  # noqa: BLE001 - any failure means not healthy
        checks["store"] = f"unavailable ({e})"
    return all(v == "ok" for v in checks.values()), checks


@router.get("/health", response_model=Health,
            responses={503: {"model": Health, "description": "the target or the session store is unavailable"}})
async def health(servicer=Depends(servicer_of)):
    """200 when the target answers and the session store is up, else 503; says which."""
    ok, checks = await asyncio.to_thread(healthy, servicer)
    return JSONResponse({"status": "ok" if ok else "unavailable", **checks}, status_code=200 if ok else 503)


@router.get("/metrics", response_class=Response, responses={
    200: {"description": "the orchestrator's Prometheus metrics (text exposition format)",
          "content": {CONTENT_TYPE_LATEST: {"schema": {"type": "string"}}}},
    **documented(503)})
async def metrics():
    """The orchestrator's Prometheus metrics (the same as --metrics-port serves)."""
    from specdec import observability as telemetry

    registry = telemetry.prometheus_registry()
    if registry is None:
        raise ApiError(503, "the Prometheus exporter is not installed")
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
