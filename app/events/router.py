"""Run progress: a paginated event log and a Server-Sent Events stream of the same log.

The stream resumes from ``Last-Event-ID`` (the raw event id of the last ``id:`` line), so a
client that reconnects gets every event once, without gaps or repeats, and it ends after the
run's last event. ``?after=`` takes the page's opaque cursor on both routes, so a client can
read the log's pages and then follow the stream from where the last page ended.
"""

from __future__ import annotations

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
from app.events import conditional, service, sse
from app.events.conditional import NOT_MODIFIED, IfNoneMatch
from app.events.fanout import EventHub
from app.events.schemas import RunEventsPage
from app.runs.service import ensure_run_visible

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
    responses={**NOT_MODIFIED, **problem_responses(401, 404, 422)},
)
async def list_run_events(
    request: Request,
    run_id: uuid.UUID,
    caller: Caller,
    page: Paging,
    if_none_match: IfNoneMatch = None,
) -> Response:
    """The run's events, oldest first. Answers carry an `ETag`: send it back as
    `If-None-Match` to get a 304 while the run has no new event."""
    after_id = _after_id(page.after, run_id)

    def respond(found: service.RenderedEvents) -> Response:
        cursor = (
            encode_cursor([found.last_id], of=LIST, scope=(run_id,)) if found.has_more else None
        )
        return rendered_page(found.data, found.has_more, cursor)

    answered = await conditional.answer(
        request,
        caller.project_id,
        run_id,
        if_none_match,
        lambda: service.page(
            request.app.state.pg, caller.project_id, run_id, after_id=after_id, limit=page.limit
        ),
        respond,
    )
    if answered is None:
        raise NotFound("Run")
    return answered


# The stream is text (text/event-stream), never JSON. Before Open API 3.2 (itemSchema), an
# event stream's schema describes each event (Schemathesis checks every event against it):
# here an object with the event's fields. It says so under `if: object`, without a type, so
# that generated clients read the answer as the text it is (openapi-python-client: `Any`,
# the text; openapi-typescript: `unknown`) instead of parsing it as one JSON object. Each
# event is a run event, or the last one, `end`, with the run's final status; `data` is a
# RunEventPublic (or the end's status) as JSON.
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
                        "properties": {
                            "status": {
                                "anyOf": [
                                    {"$ref": "#/components/schemas/RunStatus"},
                                    {"type": "null"},
                                ]
                            }
                        },
                    },
                ]
            },
        },
        "retry": {
            "type": "integer",
            "description": f"Reconnect delay in milliseconds ({sse.RETRY_MS}).",
        },
    },
}
_SSE_STREAM = {
    "description": "Server-Sent Events (the WHATWG HTML standard's format), text: `retry:`, "
    "then one event per run event (`id:` its id, `event:` its type, `data:` the event as "
    "JSON), `: keep-alive` comments while the run is quiet, and `event: end` last. The schema "
    "is each event's, as its fields.",
    "if": {"type": "object"},
    "then": _SSE_EVENT,
}


@router.get(
    "/stream",
    operation_id="stream_run_events",
    response_class=StreamingResponse,
    responses={
        200: {
            "description": "text/event-stream of run events; `id:` is the event id.",
            "content": {"text/event-stream": {"schema": _SSE_STREAM}},
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
    await session.close()  # the stream reads through the pool, not this session
    if last_event_id is not None:
        # Past the largest event id there can be: nothing to resume, as after the last one.
        start = min(int(last_event_id), INT64_MAX)
    hub: EventHub = request.app.state.event_hub

    async def events() -> AsyncIterator[bytes]:
        yield sse.RETRY
        async with hub.subscribe(run_id, start) as subscription:
            async for message in subscription.messages():
                yield message

    return StreamingResponse(
        events(),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
