"""``ETag`` / ``If-None-Match`` for what changes only with a run's events: its event pages
and its metric series (every metrics write appends an event: app/metrics/service.py).

The tag is the run's last event id and the request's query, so one URL's tag changes exactly
when an event is appended to its run. A poller's ``If-None-Match`` is answered from what the
process's event hub knows (app/events/fanout.py): a run it has read through once stays known
while it listens, its notifications keep the last id current, and a 304 costs no query. What
the hub does not know (a run not read yet, or any run while its connection is being remade)
is read from the database, which answers the body and the tag from one snapshot.

A 304 from memory is as fresh as the last notification the hub handled: an event is seen
there a few milliseconds after its commit, not at the instant of it.
"""

from __future__ import annotations

import uuid
import zlib
from collections.abc import Awaitable, Callable
from typing import Annotated, Any, Protocol, TypeVar

from fastapi import Header, Request, Response

from app.events.fanout import EventHub

IfNoneMatch = Annotated[
    str | None,
    Header(
        alias="If-None-Match",
        max_length=1024,
        description="The `ETag` of an earlier answer to the same URL: 304 Not Modified, with "
        "no body, while the run has no new event.",
    ),
]

#: The 304 answer, for the routes' OpenAPI `responses`.
NOT_MODIFIED: dict[int | str, dict[str, Any]] = {
    304: {
        "description": "Not Modified: the run has no event since the `ETag` sent in "
        "`If-None-Match`.",
        "headers": {"ETag": {"schema": {"type": "string"}}},
    }
}


class Read(Protocol):
    """What a conditional route reads: its answer and the run's last event id."""

    @property
    def latest(self) -> int: ...


def entity_tag(latest: int, request: Request) -> str:
    query = request.scope.get("query_string", b"")
    return f'"{latest}.{zlib.crc32(query):08x}"'


def _matches(if_none_match: str, tag: str) -> bool:
    """RFC 9110 §13.1.2: a list of tags, compared weakly, or ``*``."""
    for candidate in if_none_match.split(","):
        candidate = candidate.strip()
        if candidate == "*" or candidate.removeprefix("W/") == tag:
            return True
    return False


R = TypeVar("R", bound=Read)


async def answer(
    request: Request,
    project_id: uuid.UUID,
    run_id: uuid.UUID,
    if_none_match: str | None,
    read: Callable[[], Awaitable[R | None]],
    respond: Callable[[R], Response],
) -> Response | None:
    """304 if the client's tag is current, else ``respond(read())`` with its tag; None when
    ``read`` found no such run (the caller's 404)."""
    hub: EventHub = request.app.state.event_hub
    if if_none_match is not None:
        latest = hub.latest(run_id, project_id)
        if latest is not None:
            tag = entity_tag(latest, request)
            if _matches(if_none_match, tag):
                return Response(status_code=304, headers={"ETag": tag})
    epoch = hub.epoch()  # before the read: what the hub hears from now on is newer
    found = await read()
    if found is None:
        return None
    hub.read_through(run_id, project_id, found.latest, epoch)
    tag = entity_tag(found.latest, request)
    if if_none_match is not None and _matches(if_none_match, tag):
        return Response(status_code=304, headers={"ETag": tag})
    response = respond(found)
    response.headers["ETag"] = tag
    return response
