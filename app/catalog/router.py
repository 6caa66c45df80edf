"""``GET /catalog``: what the operator lets this service's runs name (docs/security.md)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from app.auth.deps import Caller
from app.catalog.policy import CodePolicy
from app.catalog.schemas import CatalogPublic
from app.core.errors import problem_responses

router = APIRouter(prefix="/catalog", tags=["catalog"])


@router.get(
    "",
    operation_id="get_catalog",
    response_model=CatalogPublic,
    responses=problem_responses(401),
)
async def get_catalog(caller: Caller, request: Request) -> CatalogPublic:
    """The code policy and the catalog's entries, by name and description: what a run of
    this service may name for its environment, reward, judges and models."""
    policy: CodePolicy = request.app.state.policy
    return CatalogPublic.of(policy.mode, policy.catalog)
