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

Such a 304 is answered before routing (:class:`NotModified`): routing, dependencies and
validation are most of what a request costs the API here, and a poller that is told "no
change" needs none of them. It takes the same key check and rate limit as every keyed
request (``app.auth.deps``), and only for a URL (route, run, query) the route itself has
validated and answered before: a query it would refuse gets its 422, whatever the tag.
Anything else (no key, a run the hub does not know, a stale tag) goes on to the route.
"""

from __future__ import annotations

import uuid
import zlib
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Annotated, Any, Protocol, TypeVar

from fastapi import Header, Request, Response
from fastapi.routing import APIRoute
from fastapi.security.utils import get_authorization_scheme_param
from starlette.types import ASGIApp, Receive, Scope, Send

from app.auth.deps import count_request, principal_of
from app.core.errors import Problem
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


def entity_tag(latest: int, query: bytes) -> str:
    return f'"{latest}.{zlib.crc32(query):08x}"'


def _matches(if_none_match: str, tag: str) -> bool:
    """RFC 9110 §13.1.2: a list of tags, compared weakly, or ``*``."""
    for candidate in if_none_match.split(","):
        candidate = candidate.strip()
        if candidate == "*" or candidate.removeprefix("W/") == tag:
            return True
    return False


R = TypeVar("R", bound=Read)


class Answered:
    """The conditional URLs (route, run, query) this process's routes have validated and
    answered, the least recently asked for forgotten first: the ones :class:`NotModified`
    may answer. One per app (``app.state.answered``)."""

    def __init__(self, size: int = 100_000) -> None:
        self._size = size
        self._routes: dict[str, APIRoute] = {}  # the routes that answer through answer()
        self._urls: OrderedDict[tuple[str, uuid.UUID, bytes], None] = OrderedDict()

    def taken(self, route: APIRoute, run_id: uuid.UUID, query: bytes) -> None:
        self._routes.setdefault(route.path, route)
        key = (route.path, run_id, query)
        self._urls[key] = None
        self._urls.move_to_end(key)
        if len(self._urls) > self._size:
            self._urls.popitem(last=False)

    def find(self, path: str, query: bytes) -> tuple[APIRoute, uuid.UUID] | None:
        """The route and run of a URL answered before, or None."""
        for route in self._routes.values():
            found = route.path_regex.match(path)
            if found is None:
                continue
            try:
                run_id = uuid.UUID(found["run_id"])
            except ValueError:
                return None
            return (route, run_id) if (route.path, run_id, query) in self._urls else None
        return None


async def answer(
    request: Request,
    project_id: uuid.UUID,
    run_id: uuid.UUID,
    if_none_match: str | None,
    read: Callable[[], Awaitable[R | None]],
    respond: Callable[[R], Response],
) -> Response | None:
    """304 if the client's tag is current, else ``respond(read())`` with its tag; None when
    ``read`` found no such run (the caller's 404). Called once the route has validated the
    request."""
    hub: EventHub = request.app.state.event_hub
    query: bytes = request.scope.get("query_string", b"")
    request.app.state.answered.taken(request.scope["route"], run_id, query)
    if if_none_match is not None:
        latest = hub.latest(run_id, project_id)
        if latest is not None:
            tag = entity_tag(latest, query)
            if _matches(if_none_match, tag):
                return Response(status_code=304, headers={"ETag": tag})
    epoch = hub.epoch()  # before the read: what the hub hears from now on is newer
    found = await read()
    if found is None:
        return None
    hub.read_through(run_id, project_id, found.latest, epoch)
    tag = entity_tag(found.latest, query)
    if if_none_match is not None and _matches(if_none_match, tag):
        return Response(status_code=304, headers={"ETag": tag})
    response = respond(found)
    response.headers["ETag"] = tag
    return response


class NotModified:
    """Pure ASGI, innermost of the app's middleware: the 304 of a conditional GET of a URL
    answered before (``answered``), when what the hub knows answers it; everything else
    goes on to the router.

    The 304 is the route's own: the same key check and rate limit, the same tag, and the
    route in the scope, as the router puts it there, for the metrics and the access line."""

    def __init__(self, app: ASGIApp, answered: Answered) -> None:
        self.app = app
        self.answered = answered

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "GET":
            tag = await self._current_tag(scope)
            if tag is not None:
                await send(
                    {"type": "http.response.start", "status": 304, "headers": [(b"etag", tag)]}
                )
                await send({"type": "http.response.body", "body": b""})
                return
        await self.app(scope, receive, send)

    async def _current_tag(self, scope: Scope) -> bytes | None:
        """The tag to answer 304 with, or None: the route answers."""
        if_none_match = key = None
        for name, value in scope["headers"]:
            if name == b"if-none-match":
                if_none_match = value.decode("latin-1")
            elif name == b"authorization":
                scheme, key = get_authorization_scheme_param(value.decode("latin-1"))
                if scheme.lower() != "bearer":
                    return None
        if if_none_match is None or not key:
            return None
        query: bytes = scope.get("query_string", b"")
        found = self.answered.find(scope["path"], query)
        if found is None:
            return None
        route, run_id = found
        app_state = scope["app"].state
        try:
            principal = await principal_of(app_state, key)
        except Problem:
            return None  # the route answers the 401
        latest = app_state.event_hub.latest(run_id, principal.project_id)
        if latest is None:
            return None
        tag = entity_tag(latest, query)
        if not _matches(if_none_match, tag):
            return None
        try:
            await count_request(app_state, scope.setdefault("state", {}), principal)
        except Problem:
            return None  # the route answers the 429
        scope["route"] = route
        return tag.encode()
