"""Run progress: a paginated event log and a Server-Sent Events stream of the same log.

The stream resumes from ``Last-Event-ID`` (the raw event id of the last ``id:`` line), so a
client that reconnects gets every event once, without gaps or repeats, and it ends after the
run's last event. ``?after=`` takes the page's opaque cursor on both routes, so a client can
read the log's pages and then follow the stream from where the last page ended.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import APIRouter, Header, Request, Response
from fastapi.responses import StreamingResponse

from app.auth.deps import Caller
from app.core.columns import INT64_MAX
from app.core.deps import ReadSession
from app.core.domain import NotFound
from app.core.errors import problem_responses
from app.core.pagination import (
    Paging,
    cursor_query,
    decode_cursor,
    encode_cursor,
    rendered_page,
)
from app.core.settings import app_settings
from app.events import service
from app.events.models import RunEvent
from app.events.schemas import RunEventPublic, RunEventsPage
from app.runs.service import ensure_run_visible
from app.runs.status import TERMINAL, RunStatus

router = APIRouter(prefix="/runs/{run_id}/events", tags=["events"])

# The page and the stream share one cursor: `after` means the same on both.
LIST = "list_run_events"


def _after_id(cursor: str | None, run_id: uuid.UUID) -> int:
    if cursor is None:
        return 0
    return int(decode_cursor(cursor, int, of=LIST, scope=(run_id,))[0])


@router.get(
    "",
    operation_id=LIST,
    response_model=RunEventsPage,
    responses=problem_responses(401, 404, 422),
)
async def list_run_events(
    request: Request, run_id: uuid.UUID, caller: Caller, page: Paging
) -> Response:
    """The run's events, oldest first."""
    after_id = _after_id(page.after, run_id)
    found = await service.page(
        request.app.state.pg, caller.project_id, run_id, after_id=after_id, limit=page.limit
    )
    if found is None:
        raise NotFound("Run")
    cursor = encode_cursor([found.last_id], of=LIST, scope=(run_id,)) if found.has_more else None
    return rendered_page(found.data, found.has_more, cursor)


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
            description="Resume after this event id: what the last `id:` line said (an "
            "EventSource sends it by itself on reconnecting). Wins over `after`.",
        ),
    ] = None,
    after: Annotated[
        str | None,
        cursor_query(
            "A `next_cursor` of `GET /runs/{run_id}/events`: start after that page (the same "
            "cursor as the page's `after`). From an event id, send `Last-Event-ID`."
        ),
    ] = None,
) -> StreamingResponse:
    """Live events of the run; ends after the run reaches a terminal status. It starts after
    `Last-Event-ID` (an event id: the last `id:` line, or the last event of a page), else
    after the page `after` names, else at the first event."""
    start = _after_id(after, run_id)
    await ensure_run_visible(session, caller.project_id, run_id)
    await session.close()  # the stream opens short sessions of its own
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
                status, batch = await service.stream_batch(s, run_id, after_id=cursor, limit=500)
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
