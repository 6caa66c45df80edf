from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from sqlalchemy import text

router = APIRouter(tags=["health"])


class Health(BaseModel):
    status: str
    checks: dict[str, str] = {}


@router.get("/healthz", operation_id="healthz", response_model=Health)
async def healthz() -> Health:
    """The process is up."""
    return Health(status="ok")


@router.get(
    "/readyz",
    operation_id="readyz",
    response_model=Health,
    responses={503: {"model": Health, "description": "A dependency is unreachable."}},
)
async def readyz(request: Request) -> JSONResponse:
    """The database and the broker answer."""
    checks: dict[str, str] = {}
    try:
        async with request.app.state.engine.connect() as conn:
            await asyncio.wait_for(conn.execute(text("SELECT 1")), timeout=2)
        checks["database"] = "ok"
    except Exception as exc:
        checks["database"] = f"error: {type(exc).__name__}"
    try:
        await asyncio.wait_for(asyncio.to_thread(_ping_broker, request), timeout=3)
        checks["broker"] = "ok"
    except Exception as exc:
        checks["broker"] = f"error: {type(exc).__name__}"
    ok = all(v == "ok" for v in checks.values())
    return JSONResponse(
        Health(status="ok" if ok else "unavailable", checks=checks).model_dump(),
        status_code=200 if ok else 503,
    )


def _ping_broker(request: Request) -> None:
    with request.app.state.celery.connection_for_write() as conn:
        conn.ensure_connection(max_retries=1, timeout=2)
