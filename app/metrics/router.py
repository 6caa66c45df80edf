from __future__ import annotations

import uuid
from typing import Annotated

from fastapi import APIRouter, Query, Request, Response

from app.auth.deps import Caller
from app.core.columns import INT32_MAX
from app.core.domain import NotFound
from app.core.errors import problem_responses
from app.core.pagination import check_range
from app.core.storable import NO_NUL
from app.events import conditional
from app.events.conditional import NOT_MODIFIED, IfNoneMatch
from app.metrics import service
from app.metrics.models import RunMetrics

router = APIRouter(prefix="/runs/{run_id}/metrics", tags=["metrics"])

# Names asked for at once: 20 of the longest (128 characters, percent-encoded up to 12 bytes
# each) still fit a URL the HTTP parser reads (64 KiB; tests/api/test_url_limits.py).
MAX_NAMES = 20


@router.get(
    "",
    operation_id="get_run_metrics",
    response_model=RunMetrics,
    responses={**NOT_MODIFIED, **problem_responses(401, 404, 422)},
)
async def get_run_metrics(
    request: Request,
    run_id: uuid.UUID,
    caller: Caller,
    name: Annotated[
        list[Annotated[str, Query(max_length=128, pattern=NO_NUL)]] | None,
        Query(max_length=MAX_NAMES, description="Only these series."),
    ] = None,
    step_min: Annotated[int | None, Query(ge=0, le=INT32_MAX)] = None,
    step_max: Annotated[int | None, Query(ge=0, le=INT32_MAX)] = None,
    if_none_match: IfNoneMatch = None,
) -> Response:
    """Per-step metric series of the run (reward mean/std, loss, kl …), by step. Pollers
    should ask for the steps they have not seen (``step_min``), or send the last answer's
    `ETag` as `If-None-Match`: a 304 while the run has no new event."""
    check_range("step_min", step_min, "step_max", step_max)
    answered = await conditional.answer(
        request,
        caller.project_id,
        run_id,
        if_none_match,
        lambda: service.run_metrics(
            request.app.state.pg,
            caller.project_id,
            run_id,
            names=name,
            step_min=step_min,
            step_max=step_max,
        ),
        lambda found: Response(found.body, media_type="application/json"),
    )
    if answered is None:
        raise NotFound("Run")
    return answered
