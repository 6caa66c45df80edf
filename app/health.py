from __future__ import annotations

import asyncio

import redis.asyncio
from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from sqlalchemy import text

from app.core.embedded import redis_py_url
from app.core.query import known_query_parameters

# No key here: the unknown-query check the keyed routes get from their key (app/core/query.py).
router = APIRouter(tags=["health"], dependencies=[Depends(known_query_parameters)])

# Each dependency must answer within this; a probe that hangs is an answer too.
READY_TIMEOUT = 2.0


class Health(BaseModel):
    status: str
    checks: dict[str, str] = {}


def broker_client(url: str) -> redis.asyncio.Redis:
    """The client ``/readyz`` pings the broker's Redis with (``app.state.redis``).

    A PING is all readiness needs to know about the broker, so the API holds no Celery app.
    No retries: the probe's caller (an orchestrator, ``trainyard up``) asks again anyway.
    """
    return redis.asyncio.from_url(
        redis_py_url(url),
        socket_connect_timeout=READY_TIMEOUT,
        socket_timeout=READY_TIMEOUT,
        retry=Retry(NoBackoff(), 0),
    )


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
        async with asyncio.timeout(READY_TIMEOUT), request.app.state.engine.connect() as conn:
            await conn.execute(text("SELECT 1"))
        checks["database"] = "ok"
    except Exception as exc:
        checks["database"] = f"error: {type(exc).__name__}"
    try:
        async with asyncio.timeout(READY_TIMEOUT):
            await request.app.state.redis.ping()
        checks["broker"] = "ok"
    except Exception as exc:
        checks["broker"] = f"error: {type(exc).__name__}"
    ok = all(v == "ok" for v in checks.values())
    return JSONResponse(
        Health(status="ok" if ok else "unavailable", checks=checks).model_dump(),
        status_code=200 if ok else 503,
    )
