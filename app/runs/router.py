from __future__ import annotations

import uuid
from datetime import datetime
from typing import Annotated

from fastapi import APIRouter, Header, Query, Request, Response
from fastapi.responses import JSONResponse

from app.auth.deps import Caller, Member
from app.core.deps import ReadSession, Session
from app.core.errors import problem_responses
from app.core.pagination import Paging, check_range, decode_cursor, make_page
from app.core.settings import app_settings
from app.core.storable import NO_NUL
from app.core.time import Instant
from app.runs import service
from app.runs.lifecycle.status import RunStatus
from app.runs.models import Run
from app.runs.schemas import RunPublic, RunsPage
from app.runs.spec.body import RunCreate

router = APIRouter(prefix="/runs", tags=["runs"])

IdempotencyKey = Annotated[
    str | None,
    Header(
        alias="Idempotency-Key",
        min_length=1,
        max_length=255,
        description="Same key + same body replays the first answer; another body is a 422.",
    ),
]


def _etag(run: RunPublic) -> str:
    return f'"{run.id.hex}-{run.version}"'


def _run_response(
    run: RunPublic | Run, status_code: int = 200, headers: dict[str, str] | None = None
) -> Response:
    public = run if isinstance(run, RunPublic) else RunPublic.model_validate(run)
    return Response(
        public.model_dump_json(),
        status_code=status_code,
        media_type="application/json",
        headers={"ETag": _etag(public), **(headers or {})},
    )


@router.post(
    "",
    status_code=202,
    operation_id="create_run",
    response_model=RunPublic,
    responses={
        202: {
            "description": "Accepted: the run is queued.",
            "headers": {"Location": {"schema": {"type": "string"}}},
        },
        **problem_responses(401, 403, 404, 409, 413, 422, 429),
    },
)
async def create_run(
    body: RunCreate,
    caller: Member,
    request: Request,
    idempotency_key: IdempotencyKey = None,
) -> Response:
    """Create a run and queue it. Answers 202 with the run and its `Location`.

    A project with `max_active_runs_per_project` unfinished runs gets a 429 instead (a
    replay of an `Idempotency-Key` already answered is still replayed)."""
    async with request.app.state.pg.acquire() as conn:
        created = await service.create_run(
            conn,
            caller.project_id,
            body,
            policy=request.app.state.policy,
            max_active=app_settings(request).max_active_runs_per_project,
            due=request.app.state.due_bell.ring,
            idempotency_key=idempotency_key,
        )
    if isinstance(created, RunPublic):
        return _run_response(created, 202, {"Location": f"/runs/{created.id}"})
    return JSONResponse(
        created.response,
        status_code=created.status_code,
        headers={"Location": f"/runs/{created.response['id']}", "Idempotent-Replayed": "true"},
    )


@router.get(
    "",
    operation_id="list_runs",
    response_model=RunsPage,
    responses=problem_responses(401, 422),
)
async def list_runs(
    caller: Caller,
    session: ReadSession,
    page: Paging,
    status: Annotated[list[RunStatus] | None, Query(max_length=9)] = None,
    model_name: Annotated[str | None, Query(max_length=500, pattern=NO_NUL)] = None,
    learning_key: Annotated[str | None, Query(max_length=200, pattern=NO_NUL)] = None,
    created_after: Instant | None = None,
    created_before: Instant | None = None,
) -> dict[str, object]:
    """The project's runs, newest first."""
    check_range("created_after", created_after, "created_before", created_before)
    scope = (sorted(status or ()), model_name, learning_key, created_after, created_before)
    after = None
    if page.after:
        created, last_id = decode_cursor(
            page.after, datetime.fromisoformat, uuid.UUID, of="list_runs", scope=scope
        )
        after = (created, last_id)
    rows = await service.list_runs(
        session,
        caller.project_id,
        service.RunFilters(
            status=status,
            model_name=model_name,
            learning_key=learning_key,
            created_after=created_after,
            created_before=created_before,
        ),
        limit=page.limit,
        after=after,
    )
    return make_page(
        rows,
        page.limit,
        lambda r: (r.created_at.isoformat(), str(r.id)),
        RunPublic.model_validate,
        of="list_runs",
        scope=scope,
    )


@router.get(
    "/{run_id}",
    operation_id="get_run",
    response_model=RunPublic,
    responses={
        200: {"headers": {"ETag": {"schema": {"type": "string"}}}},
        304: {"description": "Not modified (If-None-Match matched the ETag)."},
        **problem_responses(401, 404, 422),
    },
)
async def get_run(
    run_id: uuid.UUID,
    caller: Caller,
    request: Request,
    if_none_match: Annotated[str | None, Header(alias="If-None-Match", max_length=200)] = None,
) -> Response:
    """One run. Send `If-None-Match` with the last ETag to poll cheaply (304)."""
    async with request.app.state.pg.acquire() as conn:
        run = await service.fetch_run(conn, caller.project_id, run_id)
    etag = _etag(run)
    if if_none_match is not None and etag in {t.strip() for t in if_none_match.split(",")}:
        return Response(status_code=304, headers={"ETag": etag})
    return _run_response(run)


_ACTION_RESPONSES = problem_responses(401, 403, 404, 409, 422)


@router.post(
    "/{run_id}/cancel",
    operation_id="cancel_run",
    response_model=RunPublic,
    responses=_ACTION_RESPONSES,
)
async def cancel_run(run_id: uuid.UUID, caller: Member, session: Session) -> Response:
    """Cancel the run. A run held by a worker stops within one heartbeat; idempotent."""
    return _run_response(await service.cancel_run(session, caller.project_id, run_id))


@router.post(
    "/{run_id}/pause",
    operation_id="pause_run",
    response_model=RunPublic,
    responses=_ACTION_RESPONSES,
)
async def pause_run(run_id: uuid.UUID, caller: Member, session: Session) -> Response:
    """Pause the run at the next safe point (a step boundary); resume continues from there."""
    return _run_response(await service.pause_run(session, caller.project_id, run_id))


@router.post(
    "/{run_id}/resume",
    operation_id="resume_run",
    response_model=RunPublic,
    responses=_ACTION_RESPONSES,
)
async def resume_run(run_id: uuid.UUID, caller: Member, session: Session) -> Response:
    """Put a paused run back in the queue."""
    return _run_response(await service.resume_run(session, caller.project_id, run_id))
