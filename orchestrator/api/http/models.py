"""GET /v1/models and /v1/models/{id}: the target, with its draft replicas under `specdec.drafts`."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request

from orchestrator.api.http.deps import authorization, servicer_of
from orchestrator.api.http.errors import documented, model_not_found
from orchestrator.api.http.schemas import ModelCard, ModelList

router = APIRouter(tags=["models"])


def model_card(request: Request) -> dict:
    servicer = request.app.state.servicer
    drafts = []
    for replica in (servicer.pool.replicas if servicer.pool is not None else []):
        info = replica.info
        drafts.append({"address": replica.address, "model": info.model_name if info else None,
                       "strategy": info.strategy if info else None})
    return {"id": servicer.target_info.model_name, "object": "model", "created": request.app.state.started,
            "owned_by": "specdec", "max_model_len": servicer.target_info.max_context,
            "specdec": {"drafts": drafts}}


@router.get("/v1/models", response_model=ModelList, responses=documented(401),
            dependencies=[Depends(authorization)])
async def models(request: Request):
    """The model this server serves (its target)."""
    return {"object": "list", "data": [model_card(request)]}


@router.get("/v1/models/{model:path}", response_model=ModelCard, responses=documented(401, 404),
            dependencies=[Depends(authorization)])
async def model(model: str, request: Request, servicer=Depends(servicer_of)):
    """One model: the target's card, else a 404."""
    if model != servicer.target_info.model_name:
        raise model_not_found(model, servicer.target_info.model_name)
    return model_card(request)
