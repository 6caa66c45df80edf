"""Run progress: a paginated event log and a Server-Sent Events stream of the same log.

The stream resumes from ``Last-Event-ID`` (or ``?after=``), so a client that reconnects
gets every event once, without gaps or repeats, and it ends after the run's last event.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import APIRouter, Header, Query, Request, Response
from fastapi.responses import StreamingResponse
from sqlalchemy import select
from sqlmodel import col

from app.auth.deps import Caller
from app.core.columns import INT64_MAX
from app.core.deps import ReadSession
from app.core.errors import NotFound, problem_responses
from app.core.pagination import Paging, decode_cursor, encode_cursor
from app.core.settings import app_settings
from app.events import service
from app.events.models import RunEvent
from app.events.schemas import RunEventPublic, RunEventsPage
from app.runs.models import Run
from app.runs.service import ensure_run_visible
from app.runs.status import TERMINAL, RunStatus

router = APIRouter(prefix="/runs/{run_id}/events", tags=["events"])


@router.get(
    "",
    operation_id="list_run_events",
    response_model=RunEventsPage,
    responses=problem_responses(401, 404, 422),
)
async def list_run_events(
    request: Request, run_id: uuid.UUID, caller: Caller, page: Paging
) -> Response:
    """The run's events, oldest first."""
    after = decode_cursor(page.after, int)[0] if page.after else 0
    async with request.app.state.pg.acquire() as conn:
        row = await conn.fetchrow(_PAGE, run_id, caller.project_id, after, page.limit)
    if not row["visible"]:
        raise NotFound("Run")
    has_more = row["fetched"] > page.limit
    cursor = json.dumps(encode_cursor([row["last_id"]])) if has_more else "null"
    more = "true" if has_more else "false"
    body = f'{{"data":{row["data"]},"has_more":{more},"next_cursor":{cursor}}}'
    return Response(body, media_type="application/json")


# A page of events as the API shows them, rendered by PostgreSQL: polled by every client of
# every live run, so no ORM and no Python object per event (docs/benchmarks.md, pollers).
_PAGE = """
WITH run AS (
    SELECT id FROM runs WHERE id = $1 AND project_id = $2
), page AS (
    SELECT e.id, e.run_id, e.type, e.level, e.message, e.data, e.created_at
      FROM run_events AS e JOIN run ON e.run_id = run.id
     WHERE e.id > $3
     ORDER BY e.id
     LIMIT $4 + 1
), kept AS (
    SELECT * FROM page ORDER BY id LIMIT $4
)
SELECT EXISTS (SELECT 1 FROM run) AS visible,
       (SELECT count(*) FROM page) AS fetched,
       (SELECT max(id) FROM kept) AS last_id,
       (SELECT coalesce(json_agg(json_build_object(
                   'id', id, 'run_id', run_id, 'type', type, 'level', level,
                   'message', message, 'data', data, 'created_at', created_at) ORDER BY id),
               '[]'::json)::text
          FROM kept) AS data
"""


def _sse(event: RunEvent) -> str:
    payload = RunEventPublic.model_validate(event).model_dump_json()
    return f"id: {event.id}\nevent: {event.type}\ndata: {payload}\n\n"


# One Server-Sent Event (Open API before 3.2 has an event stream's schema describe each
# event): a run event, or the last one, `end`, with the run's final status.
_SSE_EVENT = {
    "type": "object",
    "required": ["data"],
    "properties": {
        "id": {"type": "string", "pattern": "^[0-9]+$", "description": "The event's id."},
        "event": {"type": "string", "description": "The run event's type, or `end`."},
        "data": {
            "type": "string",
            "contentMediaType": "application/json",
            "contentSchema": {
                "anyOf": [
                    {"$ref": "#/components/schemas/RunEventPublic"},
                    {
                        "type": "object",
                        "required": ["status"],
                        "properties": {"status": {"type": ["string", "null"]}},
                    },
                ]
            },
        },
        "retry": {"type": "integer", "description": "Reconnect delay in milliseconds."},
    },
}


@router.get(
    "/stream",
    operation_id="stream_run_events",
    response_class=StreamingResponse,
    responses={
        200: {
            "description": "text/event-stream of run events; `id:` is the event id.",
            "content": {"text/event-stream": {"schema": _SSE_EVENT}},
        },
        **problem_responses(401, 404, 422),
    },
)
async def stream_run_events(
    run_id: uuid.UUID,
    caller: Caller,
    session: ReadSession,
    request: Request,
    last_event_id: Annotated[
        str | None,
        Header(
            alias="Last-Event-ID",
            max_length=20,
            pattern=r"^[0-9]+$",
            description="Resume after this event id (what the last `id:` said).",
        ),
    ] = None,
    after: Annotated[
        int | None, Query(ge=0, le=INT64_MAX, description="Start after this event id.")
    ] = None,
) -> StreamingResponse:
    """Live events of the run; ends after the run reaches a terminal status."""
    await ensure_run_visible(session, caller.project_id, run_id)
    await session.close()  # the stream opens short sessions of its own
    start = after or 0
    if last_event_id is not None:
        # Past the largest event id there can be: nothing to resume, as after the last one.
        start = min(int(last_event_id), INT64_MAX)
    maker = request.app.state.sessionmaker
    settings = app_settings(request)

    async def events() -> AsyncIterator[str]:
        cursor = start
        idle = 0.0
        yield "retry: 2000\n\n"
        while not await request.is_disconnected():
            async with maker() as s:
                # Status first: a terminal status read here means its event (written in the
                # same transaction) is visible to the next statement.
                status = await s.scalar(select(col(Run.status)).where(col(Run.id) == run_id))
                batch = await service.list_after(s, run_id, after_id=cursor, limit=500)
            for event in batch:
                cursor = event.id or cursor
                yield _sse(event)
            if batch:
                idle = 0.0
                continue
            if status is None or RunStatus(status) in TERMINAL:
                yield f"event: end\ndata: {json.dumps({'status': status})}\n\n"
                return
            await asyncio.sleep(settings.sse_poll_seconds)
            idle += settings.sse_poll_seconds
            if idle >= settings.sse_keepalive_seconds:
                idle = 0.0
                yield ": keep-alive\n\n"

    return StreamingResponse(
        events(),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
